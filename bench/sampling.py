"""What one temperature draw costs per token, on real logits: the C selection
(cgn_infer/kernels/sample.c) against its numpy definition (sampling._select, what runs
without the kernels), same rows, same numbers, interleaved.

    python bench/sampling.py [--rows 48] [--reps 5]

Logits are real: each bundled model in process (its `gguf` weights, so the kernels are
loaded) over the parity corpus's texts, every position's row kept (SmolLM2's 49,152-token
vocabulary, Qwen's 151,936). For each parameter set below, every row is drawn from by both
paths in turn, `reps` times; the table gives the median microseconds per draw (the whole
`Sampler._draw`: temperature, exponential, selection, draw) and the ratio. Both paths
pick the same token every time (checked here, and in tests/test_sampling.py).

Writes bench/results/sampling.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer import kernels
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf
from cgn_infer.sampling import Sampler, SamplingParams
from harness.parity import CORPUS

MODELS = {"smollm2": smollm2, "qwen": qwen_coder_05b}
PARAMS = {
    "T 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T 1, top-k 40": SamplingParams(temperature=1.0, top_k=40),
    "T 0.7, top-k 50, top-p 0.95": SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
    "T 0.8, min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "T 1, no filter": SamplingParams(temperature=1.0),
}


def real_logits(path: Path, rows: int) -> np.ndarray:
    """[rows, vocab] float32: the model's logits at every position of the corpus's texts."""
    with GGUFFile(path) as gguf:
        tok = GGUFTokenizer(gguf)
        backend: Any = TorchBackend(gguf, args_from_gguf(gguf), threads=2)
        out: list[np.ndarray] = []
        for text in CORPUS:
            ids = tok.encode(text)[:128]
            out.extend(backend.forward(ids, 0, backend.new_cache(len(ids)), all_logits=True))
            if len(out) >= rows:
                break
    return np.stack(out[:rows]).astype(np.float32)


def time_draws(logits: np.ndarray, params: SamplingParams, reps: int) -> dict[str, Any]:
    """Median µs per draw, C and numpy, each row drawn from by both in turn."""
    loaded = kernels.loaded()
    assert loaded is not None, kernels.failure()
    per: dict[str, list[float]] = {"c": [], "numpy": []}
    for rep in range(reps):
        for i, row in enumerate(logits):
            tokens = []
            for name in ("c", "numpy") if (i + rep) % 2 == 0 else ("numpy", "c"):
                s = Sampler(params, lib=loaded.lib if name == "c" else None)
                s.rng = np.random.default_rng(rep * 100_000 + i)  # the same number for both
                start = time.perf_counter()
                tokens.append(s._draw(row))
                per[name].append(time.perf_counter() - start)
            assert tokens[0] == tokens[1], (params, i, tokens)
    c, npy = (statistics.median(per[k]) * 1e6 for k in ("c", "numpy"))
    return {"c_us": c, "numpy_us": npy, "speedup": npy / c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48, help="logits rows per model")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    opts = ap.parse_args()
    if kernels.load() is None:
        sys.exit(f"bench/sampling.py: the kernels are needed ({kernels.failure()})")
    results: dict[str, Any] = {}
    rows = ["| model (vocabulary) | parameters | C µs/draw | numpy µs/draw | numpy / C |",
            "|---|---|---|---|---|"]  # fmt: skip
    for model in opts.models:
        logits = real_logits(MODELS[model](), opts.rows)
        results[model] = {"vocab": logits.shape[1], "rows": len(logits)}
        for label, params in PARAMS.items():
            r = results[model][label] = time_draws(logits, params, opts.reps)
            rows.append(f"| {model} ({logits.shape[1]:,}) | {label} | {r['c_us']:.0f} | "
                        f"{r['numpy_us']:.0f} | {r['speedup']:.1f}× |")  # fmt: skip
            print(rows[-1], flush=True)
    command = "python bench/sampling.py " + " ".join(sys.argv[1:])
    write_result("sampling", command.strip(), results, "\n".join(rows))


if __name__ == "__main__":
    main()
