"""cgn-infer's instruction-set paths (cgn_infer/kernels/isa.py): which one a CPU gets, and the
exactness tests passing on every path this machine can run, not only its default.

The suite itself runs on the default path; the other paths run here, each in a child pytest
with CGN_CPU_ISA set (torch is held to a path when it loads, so a path is a process): the
batch-invariance checks of the kernels and the model on each, and the llama.cpp parity bars
on a forced avx2 path (an AVX-512 machine then computes what an AVX2 machine does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgn_infer.kernels.isa import ENV, ISAS, IsaError, choose, cpu_features, current

REPO = Path(__file__).resolve().parent.parent
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}  # Skylake-X: no VNNI
VNNI = AVX512 | {"avx512_vnni"}
NEON = frozenset({"fp", "asimd", "aes", "crc32"})


@pytest.mark.parametrize(
    ("requested", "features", "machine", "path", "forced", "why"),
    [
        ("", AVX2, "x86_64", "avx2", False, "avx2: this CPU has AVX2, FMA and F16C"),
        ("auto", VNNI, "x86_64", "avx512vnni", False, "this CPU has AVX-512 VNNI"),
        ("auto", AVX512, "x86_64", "avx2", False, "this CPU has AVX2"),
        ("", frozenset({"sse4_2", "avx"}), "x86_64", "generic", False, "several times slower"),
        ("", NEON, "aarch64", "generic", False, "generic"),
        ("AVX2", VNNI, "x86_64", "avx2", True, "forced by CGN_CPU_ISA"),
        (" generic ", AVX512, "x86_64", "generic", True, "forced by CGN_CPU_ISA"),
        ("generic", NEON, "aarch64", "generic", True, "forced"),
    ],
)
def test_a_cpu_gets_its_path(
    requested: str, features: frozenset[str], machine: str, path: str, forced: bool, why: str
) -> None:
    choice = choose(requested, features, machine)
    assert (choice.isa.name, choice.forced) == (path, forced) and why in choice.why
    assert choice.isa.needs <= features


@pytest.mark.parametrize(
    ("requested", "features", "message"),
    [
        ("avx512", VNNI, "expected auto or one of avx512vnni, avx2, generic"),
        ("avx512vnni", AVX512, "this CPU lacks avx512_vnni"),
        ("native", AVX2, "expected auto or one of"),
        ("avx2", frozenset({"sse4_2", "avx"}), "this CPU lacks avx2, f16c, fma"),
        ("avx2", NEON, "this CPU lacks avx2"),
    ],
)
def test_a_path_the_cpu_cannot_run_is_refused_by_name(
    requested: str, features: frozenset[str], message: str
) -> None:
    with pytest.raises(IsaError, match=message):
        choose(requested, features, "x86_64")


def test_cgn_infer_refuses_a_bad_path_in_one_line(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("cgn-infer")
    res = subprocess.run([str(exe), "serve", "--model", "smollm2"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, ENV: "avx9"})  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: {ENV}='avx9': expected auto or one of avx512vnni, avx2, generic"
    ]


def _other_paths() -> list[str]:
    """Paths this CPU runs besides the suite's: `generic` everywhere, `avx2` where the
    default is avx512vnni (the kernels' bits are avx2's, torch's own kernels are held
    back), and a forced `avx2` where the default is avx2 but torch alone would go further
    (AVX-512 without VNNI)."""
    features, default = cpu_features(), current()
    if default.forced:  # the suite already runs on a forced path: nothing else to compare
        return []
    others = [
        name for name, isa in ISAS.items() if name != default.isa.name and isa.needs <= features
    ]
    if default.isa.name == "avx2" and "avx512f" in features:
        others.insert(0, "avx2")
    return others


PARITY = "tests/test_llamacpp_parity.py::test_teacher_forced_logits_match_llamacpp"
EXACTNESS = [
    "tests/test_quantized.py::test_products_track_float32_and_ignore_the_batch",
    "tests/test_quantized.py::test_activations_are_quantized_as_llamacpp_stores_them",
    "tests/test_paged_attention.py::test_torch_paged_batch_equals_alone",
]


def checks(path: str) -> list[str]:
    """What runs on `path`: on avx2 (what an AVX2 machine runs by default) the llama.cpp parity
    bars and exactness at the kernel and the model level; on generic the portable loops'
    products, their batch invariance and the activations' float16 scales (the only place CI
    compiles them). NOTE: `generic` on
    x86-64 is not the code an aarch64 machine runs (the compiler vectorizes the loops for each
    ISA), so model-level figures here would prove little about aarch64, and cost ~25 s."""
    return [PARITY, *EXACTNESS] if path == "avx2" else EXACTNESS[:2]


@pytest.mark.slow
@pytest.mark.parametrize("path", _other_paths() or [pytest.param("", marks=pytest.mark.skip(
    reason="this CPU runs no path besides the suite's own"))])  # fmt: skip
def test_parity_and_exactness_hold_on_the_other_paths(path: str) -> None:
    # NOTE: no PYTEST_XDIST_* (the child is no worker of this run: it must not take this
    # run's CPU lock) and no torch variables (the child's path sets its own)
    torch_vars = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CGN_TEST_"))}
    env = {**{k: v for k, v in env.items() if k not in torch_vars}, ENV: path}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", "-s", *checks(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = [line for line in res.stdout.splitlines() if "top-1 agreement" in line]
    print(f"\n{path}: {summary[0] if summary else res.stdout.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
