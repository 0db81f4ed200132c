"""cgn-infer's C kernels (qmatmul.c, activations.c, layer.c, sample.c, with half.h): prebuilt at
install for every instruction-set path, or built on first use for the CPU's path into one
library, cached, loaded.

Prebuilt: `python -m cgn_infer.kernels` (run by scripts/setup-dev.sh and bin/install.sh
where there is a C compiler) compiles every path this machine's compiler can target into
`prebuilt/` beside this file, named by the source and the flags. An engine whose path is
there loads it at once: no compiler runs at start (the first start took 3-4 s longer, each
path compiled). Otherwise it builds its own path into the cache below, as before, and says
so in its log.

The library is compiled with the system C compiler (`-O3 -fopenmp` and the flags of the
instruction-set path `isa.py` chooses: `-mavx2 -mfma -mf16c`, or none for the portable
loops; never `-march=native`, so that what it computes depends on the path, not on the
machine that built it) into `~/.cache/cognitora/kernels/` (or `$CGN_KERNEL_CACHE`), under a
name keyed by the source, the compiler and the flags, so a changed source, compiler or path
builds a fresh one. The build writes a temporary file and renames it into
place, so concurrent engines never load a half-written library; one that fails to
load is rebuilt once. Without a compiler, `load()` returns None with the reason,
and the engine falls back to dequantized weights (and logs why).

It links libgomp.so.1, as torch's own libraries do (torch ships one under that name):
whichever loads first, the dynamic linker resolves the other's to it, so a process that
runs both has one OpenMP thread pool, and `torch.set_num_threads` and
`cgn_set_threads` govern the same threads. The C backend never imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cgn_infer.kernels.isa import Isa, IsaError, current

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("qmatmul.c", "activations.c", "layer.c", "sample.c")
)
HEADERS = (Path(__file__).with_name("half.h"),)  # part of the cache key, not compiled alone
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")

# ggml type ids with a kernel, by GGUF type name
KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
KERNEL_TYPES |= {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # the K-quants: 256-value superblocks

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True, slots=True)
class Kernels:
    lib: ctypes.CDLL
    path: Path
    isa: str  # the instruction-set path it was compiled for (isa.ISAS)


_loaded: Kernels | None = None
_failure: str | None = None


PREBUILT = Path(__file__).with_name("prebuilt")


def prebuilt_path(isa: Isa, where: Path | None = None) -> Path:
    """Where the prebuilt library of `isa` for this source and these flags lives (the
    compiler that built it is not part of the name: whichever built the install)."""
    flags = " ".join((*FLAGS, *isa.cflags))
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (*(s.read_text() for s in (*SOURCES, *HEADERS)), flags))
    ).hexdigest()[:16]
    return (where or PREBUILT) / f"qmatmul-{platform.machine()}-{isa.name}-{key}.so"


def prebuild(isas: list[Isa], where: Path | None = None) -> tuple[list[Path], list[str]]:
    """`isas` built into `where` (default PREBUILT), their older builds there (another
    source) removed: (the libraries, why each other path was not built)."""
    cc = compiler()
    if cc is None:
        return [], [NO_COMPILER]
    built, skipped = [], []
    for isa in isas:
        path = prebuilt_path(isa, where)
        try:
            try:
                _bind(path)
            except OSError:  # missing, or a broken file: built (again)
                _build(cc, isa, path)
                _bind(path)
            built.append(path)
        except (OSError, subprocess.SubprocessError) as e:  # e.g. x86 flags on an Arm compiler
            skipped.append(f"{isa.name}: {e}")
    for isa in isas:
        for old in (where or PREBUILT).glob(f"qmatmul-{platform.machine()}-{isa.name}-*.so"):
            if old not in built:
                old.unlink(missing_ok=True)
    return built, skipped


def cache_dir() -> Path:
    env = os.environ.get("CGN_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cognitora" / "kernels"


def library_path(compiler: str, isa: Isa) -> Path:
    """Where the library for this source, compiler and instruction-set path lives."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    flags = " ".join((*FLAGS, *isa.cflags))
    key = hashlib.sha256(
        b"\0".join(
            x.encode() for x in (*(s.read_text() for s in (*SOURCES, *HEADERS)), version, flags)
        )
    ).hexdigest()[:16]
    return cache_dir() / f"qmatmul-{platform.machine()}-{isa.name}-{key}.so"


def _build(compiler: str, isa: Isa, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        include = f"-I{HEADERS[0].parent}"
        done = subprocess.run(
            [compiler, *FLAGS, *isa.cflags, include, *map(str, SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.cgn_block_bytes.argtypes = [ctypes.c_int]
    lib.cgn_block_bytes.restype = ctypes.c_int
    lib.cgn_block_values.argtypes = [ctypes.c_int]
    lib.cgn_block_values.restype = ctypes.c_int
    lib.cgn_quantize_rows.argtypes = [_ptr, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr]
    lib.cgn_quantize_rows.restype = None
    lib.cgn_dequantize_rows.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _ptr]
    lib.cgn_dequantize_rows.restype = None
    lib.cgn_qmatmul.argtypes = [
        ctypes.c_int,
        _ptr,
        _i64,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
    ]
    lib.cgn_qmatmul.restype = None
    lib.cgn_attend.argtypes = [
        _ptr,
        _ptr,
        _ptr,
        ctypes.c_int,
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        _ptr,
    ]
    lib.cgn_attend.restype = ctypes.c_int
    lib.cgn_matrix_product.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
    lib.cgn_matrix_product.restype = None
    lib.cgn_layer.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr]
    lib.cgn_layer.restype = ctypes.c_int
    _f32, _f64 = ctypes.c_float, ctypes.c_double
    lib.cgn_sample.argtypes = [_ptr, _i64, _f32, _i64, _f64, _f32, _f64, _ptr, _ptr, _ptr]
    lib.cgn_sample.restype = _i64
    lib.cgn_set_threads.argtypes = [ctypes.c_int]
    lib.cgn_set_threads.restype = None
    lib.cgn_rms_norm.argtypes = [_ptr, _ptr, _i64, _i64, _f32, _ptr]
    lib.cgn_rms_norm.restype = None
    for name, type_id in KERNEL_TYPES.items():  # the C side and this table must agree
        if lib.cgn_block_bytes(type_id) == 0:
            raise OSError(f"{path}: no kernel for {name}")
    return lib


NO_COMPILER = "no C compiler (cc/gcc) on PATH: apt-get install gcc"


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(isa: Isa, path: Path) -> Kernels:
    """The kernels compiled for `isa` into `path` and loaded, whatever this process's own
    path is (the benchmark and the tests put paths side by side); OSError if that fails."""
    cc = compiler()
    if cc is None:
        raise OSError(NO_COMPILER)
    _build(cc, isa, path)
    return Kernels(_bind(path), path, isa.name)


def load() -> Kernels | None:
    """The kernels, built if needed; None (and `failure()` says why) where they cannot be."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    try:
        choice = current()
    except IsaError as e:
        _failure = str(e)
        return None
    prebuilt = prebuilt_path(choice.isa)
    if prebuilt.is_file():
        try:
            lib = _bind(prebuilt)
            log.info("CPU kernels: %s (prebuilt: %s)", choice.why, prebuilt)
            _loaded = Kernels(lib, prebuilt, choice.isa.name)
            return _loaded
        except OSError as e:
            log.warning("prebuilt kernels %s did not load (%s); building them", prebuilt, e)
    else:
        log.info("no prebuilt kernels for the %s path in %s (python -m cgn_infer.kernels "
                 "builds them at install)", choice.isa.name, prebuilt.parent)  # fmt: skip
    cc = compiler()
    if cc is None:
        _failure = NO_COMPILER
        return None
    try:
        path = library_path(cc, choice.isa)
        if not path.exists():
            log.info(
                "building cgn-infer's kernels for the %s path (once): %s", choice.isa.name, path
            )
            _build(cc, choice.isa, path)
        try:
            lib = _bind(path)
        except OSError as e:  # a corrupt or stale file: build it again, once
            log.warning("kernel library %s did not load (%s); rebuilding it", path, e)
            _build(cc, choice.isa, path)
            lib = _bind(path)
    except (OSError, subprocess.SubprocessError, IsaError) as e:
        _failure = str(e)
        return None
    log.info("CPU kernels: %s", choice.why)
    _loaded = Kernels(lib, path, choice.isa.name)
    return _loaded


def loaded() -> Kernels | None:
    """The kernels if this process has loaded them (the `gguf` weights did), without
    loading them: what the sampler uses where they are there."""
    return _loaded


def failure() -> str | None:
    """Why `load()` returned None, if it did."""
    return _failure
