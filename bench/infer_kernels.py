"""cgn-infer's quantized products on each instruction-set path this CPU runs, side by side.

    python bench/infer_kernels.py [--models smollm2 qwen] [--rows 1 4 16 64]

The kernels are compiled for every path of cgn_infer/kernels/isa.py that this CPU can run
(avx512vnni, avx2, generic) and loaded into this one process; each model's real matrices
(layer 0's QKV, output, gate/up and down, and the LM head) are multiplied by R activation
rows on each path in turn, interleaved round by round, and the best round counts (the
machine's noise is the slower rounds). avx512vnni and avx2 compute the same bits
(tests/test_quantized.py), so their ratio is speed alone. Threads: 2, as served.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.common import write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer import kernels
from cgn_infer.backends.quantized import QuantMatrix
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.kernels.isa import ISAS, cpu_features
from cgn_infer.models import args_from_gguf

MODELS = {"smollm2": smollm2, "qwen": qwen_coder_05b}
TYPE_NAMES = {v: k for k, v in kernels.KERNEL_TYPES.items()}
ROUNDS = 7


def libraries(where: Path) -> dict[str, kernels.Kernels]:
    if kernels.compiler() is None:
        sys.exit(f"error: {kernels.NO_COMPILER}")
    features = cpu_features()
    return {
        name: kernels.build(isa, where / f"{name}.so")
        for name, isa in ISAS.items()
        if isa.needs <= features
    }


def on(m: QuantMatrix, lib: kernels.Kernels) -> QuantMatrix:
    """`m`'s blocks and descriptor, multiplied by `lib`'s kernels."""
    q = object.__new__(QuantMatrix)
    for attr in QuantMatrix.__slots__:
        setattr(q, attr, getattr(m, attr))
    q.kernels = lib
    return q


def best_us(m: dict[str, QuantMatrix], x: torch.Tensor) -> dict[str, float]:
    any_path = next(iter(m.values()))
    work = x.shape[0] * any_path.cols * any_path.out  # multiply-adds per call
    calls = min(50, max(2, int(128e6 // work)))  # about the same time per round for any size
    best = dict.fromkeys(m, float("inf"))
    for _ in range(ROUNDS):
        for path, q in m.items():
            t = time.perf_counter()
            for _ in range(calls):
                q(x)
            best[path] = min(best[path], (time.perf_counter() - t) / calls)
    return {k: round(v * 1e6, 1) for k, v in best.items()}


def run_model(model: str, libs: dict[str, kernels.Kernels], rows: list[int]) -> dict[str, Any]:
    with GGUFFile(MODELS[model]()) as gguf:
        b = TorchBackend(gguf, args_from_gguf(gguf), threads=2)
        layer = b.w.layers[0]
        mats = {"qkv": layer.wqkv, "wo": layer.wo, "gate_up": layer.w_gate_up}
        mats |= {"down": layer.w_down, "lm_head": b.w.output}
        out: dict[str, Any] = {}
        for name, m in mats.items():
            if not isinstance(m, QuantMatrix):
                continue
            types = "+".join(sorted({TYPE_NAMES[t] for t, _, _ in m.parts}))
            per_path = {path: on(m, lib) for path, lib in libs.items()}
            for r in rows:
                if r > 16 and name == "lm_head":
                    continue  # the head multiplies one row per sequence
                x = torch.randn(r, m.cols)
                key = f"{name} [{m.out}x{m.cols}] {types}, {r} rows"
                out[key] = best_us(per_path, x)
                print(model, key, out[key], file=sys.stderr, flush=True)
        return out


def table(r: dict[str, Any], paths: list[str]) -> str:
    lines = []
    base = "avx2" if "avx2" in paths else paths[0]
    for model, runs in r["models"].items():
        lines += [f"## {model}", ""]
        head = " | ".join(f"{p} µs" for p in paths)
        ratios = " | ".join(f"{base}/{p}" for p in paths if p != base)
        lines += [f"| product | {head} | {ratios} |", "|---" * (1 + 2 * len(paths) - 1) + "|"]
        for key, us in runs.items():
            cells = " | ".join(f"{us[p]:.0f}" for p in paths)
            rel = " | ".join(f"{us[base] / us[p]:.2f}x" for p in paths if p != base)
            lines.append(f"| {key} | {cells} | {rel} |")
        lines.append("")
    lines.append(
        f"Best of {ROUNDS} interleaved rounds per cell, 2 threads. A ratio above 1 is faster "
        f"than {base}."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    args = p.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        libs = libraries(Path(tmp))
        results = {
            "paths": list(libs),
            "models": {m: run_model(m, libs, args.rows) for m in args.models},
        }
    command = "python bench/infer_kernels.py " + " ".join(sys.argv[1:])
    write_result("infer_kernels", command.strip(), results, table(results, list(libs)))


if __name__ == "__main__":
    main()
