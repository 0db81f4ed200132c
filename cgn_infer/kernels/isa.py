"""Which instruction-set path cgn-infer's CPU code takes, chosen once per process.

A path names the flags the C kernels are compiled with and, when forced, the CPU capability
torch's own kernels are held to. Within one path the same inputs give bit-identical results
on every CPU that can run it (the same instructions in the same order); across paths they
differ in rounding, which a near-tie in a model's logits can turn into another greedy token
(docs/cgn-infer.md, "Portability").

| path | kernels compiled with | torch held to, when forced | runs on |
|---|---|---|---|
| `avx512vnni` | avx2's, `-mavx512f -mavx512vl -mavx512vnni` | AVX-512 | x86-64, AVX-512 VNNI |
| `avx2` | `-mavx2 -mfma -mf16c` | AVX2 (aten, MKL, oneDNN) | x86-64 with AVX2, FMA, F16C |
| `generic` | no ISA flags: portable C | its baseline | any CPU |

`avx512vnni` computes the kernels' results bit for bit as `avx2` does: one `vpdpbusd` makes
the integer sums that `vpmaddubsw` and `vpmaddwd` make there, and the float code keeps
avx2's 256-bit vectors (`-mprefer-vector-width=256`), so its reductions run in the same
order (tests/test_quantized.py compares the two libraries). `auto` (the default) takes the
first path of the table the CPU can run, with a warning where that is `generic` on x86-64
(several times slower), and leaves torch on the best capability it finds (AVX-512 where
there is one). `CGN_CPU_ISA=avx512vnni|avx2|generic` forces a path
for the kernels and torch alike; torch reads its variables when it loads, so `pin_torch()`
runs before anything imports it (cgn-infer's commands and the test suite call it first).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "CGN_CPU_ISA"


class IsaError(ValueError):
    """CGN_CPU_ISA names no path, or one this CPU cannot run; the message says which."""


@dataclass(frozen=True, slots=True)
class Isa:
    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]  # CPU feature flags, spelled as /proc/cpuinfo spells them
    torch_env: tuple[tuple[str, str], ...]  # variables that hold torch to the same path


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX2_NEEDS = frozenset({"avx2", "fma", "f16c"})

ISAS = {  # in the order `auto` tries them
    "avx512vnni": Isa(
        "avx512vnni",
        (*_AVX2_FLAGS, "-mavx512f", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"),
        _AVX2_NEEDS | {"avx512f", "avx512vl", "avx512_vnni"},
        (
            ("ATEN_CPU_CAPABILITY", "avx512"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX512"),
            ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"),
        ),
    ),
    "avx2": Isa(
        "avx2",
        _AVX2_FLAGS,
        _AVX2_NEEDS,
        (
            ("ATEN_CPU_CAPABILITY", "avx2"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
            ("ONEDNN_MAX_CPU_ISA", "AVX2"),
        ),
    ),
    "generic": Isa(
        "generic",
        (),
        frozenset(),
        (
            ("ATEN_CPU_CAPABILITY", "default"),
            ("MKL_ENABLE_INSTRUCTIONS", "SSE4_2"),
            ("ONEDNN_MAX_CPU_ISA", "SSE41"),
        ),
    ),
}


@dataclass(frozen=True, slots=True)
class Choice:
    isa: Isa
    forced: bool  # by CGN_CPU_ISA
    why: str  # one line for the start-up log


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where none can be read."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose(requested: str, features: frozenset[str], machine: str) -> Choice:
    """The path for `requested` ("auto", "" or a name in ISAS) on a CPU with `features`."""
    name = requested.strip().lower()
    if name in ("", "auto"):
        if ISAS["avx512vnni"].needs <= features:
            why = "avx512vnni: this CPU has AVX-512 VNNI (the integer sums in one instruction)"
            return Choice(ISAS["avx512vnni"], False, why)
        if ISAS["avx2"].needs <= features:
            return Choice(ISAS["avx2"], False, "avx2: this CPU has AVX2, FMA and F16C")
        slow = " (no AVX2 here: the portable loops are several times slower)"
        x86 = machine in ("x86_64", "AMD64", "i686")
        return Choice(ISAS["generic"], False, "generic" + (slow if x86 else ""))
    isa = ISAS.get(name)
    if isa is None:
        raise IsaError(f"{ENV}={requested!r}: expected auto or one of {', '.join(ISAS)}")
    if missing := sorted(isa.needs - features):
        raise IsaError(f"{ENV}={name}: this CPU lacks {', '.join(missing)}")
    return Choice(isa, True, f"{name}: forced by {ENV}")


def current() -> Choice:
    """This process's path, from CGN_CPU_ISA and the CPU (IsaError if it is not usable)."""
    return choose(os.environ.get(ENV, ""), cpu_features(), platform.machine())


def pin_torch() -> Choice:
    """Choose the path and, if it is forced, hold torch's kernels to it; call before torch is
    imported (afterwards torch keeps what it chose, and this says so in the log)."""
    choice = current()
    if choice.forced:
        for key, value in choice.isa.torch_env:
            os.environ.setdefault(key, value)
        if "torch" in sys.modules:
            log.warning("%s set after torch loaded: torch's own kernels keep their path", ENV)
    return choice
