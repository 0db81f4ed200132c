"""Calibrate the sim backend's cost model against the torch backend (in process, no HTTP).

Times `forward_batch` on the real model for prompt chunks and for decode steps
over a grid of batch sizes and context lengths, then fits

    decode step = step_s + decode_s_per_seq * B + decode_s_per_ctx_token * sum(ctx)
    prefill     = step_s + prefill_s_per_token * tokens

by least squares, and prints the `sim:` settings block.

    .venv/bin/python -m bench.sim_calibrate [--model smollm2] [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import write_result
from cgn_core import bundled_models
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.backends.paged import BatchItem
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf

BATCHES = (1, 2, 4, 8, 16)
CONTEXTS = (64, 512, 1024)
PREFILLS = (64, 128, 256, 512)


def timed(backend: TorchBackend, items: list[BatchItem], kv: object, repeats: int) -> float:
    """Median seconds of one `forward_batch` over `items`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward_batch(items, kv)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    opts = ap.parse_args()
    gguf = GGUFFile(bundled_models.resolve(Path(opts.model)))
    backend = TorchBackend(gguf, args_from_gguf(gguf), weights=opts.dtype, threads=opts.threads)
    rng = np.random.default_rng(0)
    per_seq_blocks = max(CONTEXTS) // 16 + 2
    kv = backend.new_kv(per_seq_blocks * max(BATCHES))
    tables = [
        list(range(i * per_seq_blocks, (i + 1) * per_seq_blocks)) for i in range(max(BATCHES))
    ]

    prefill_rows = []
    for n in PREFILLS:
        ids = rng.integers(100, 20000, n).tolist()
        t = timed(backend, [BatchItem(ids, 0, tables[0])], kv, opts.repeats)
        prefill_rows.append({"tokens": n, "seconds": t})
        print(f"prefill {n:5d} tokens: {t * 1000:8.1f} ms", file=sys.stderr)
    decode_rows = []
    for ctx in CONTEXTS:
        for b in range(max(BATCHES)):  # fill every sequence's context once
            ids = rng.integers(100, 20000, ctx).tolist()
            backend.forward_batch([BatchItem(ids, 0, tables[b])], kv)
        for b in BATCHES:
            items = [BatchItem([int(rng.integers(100, 20000))], ctx, tables[i]) for i in range(b)]
            t = timed(backend, items, kv, opts.repeats)
            decode_rows.append({"batch": b, "ctx": ctx, "seconds": t})
            print(f"decode B={b:2d} ctx={ctx:5d}: {t * 1000:8.1f} ms", file=sys.stderr)

    a = np.array([[1.0, r["batch"], r["batch"] * r["ctx"]] for r in decode_rows])
    y = np.array([r["seconds"] for r in decode_rows])
    (step_s, per_seq, per_ctx), *_ = np.linalg.lstsq(a, y, rcond=None)
    pa = np.array([[r["tokens"]] for r in prefill_rows], dtype=float)
    py = np.array([r["seconds"] for r in prefill_rows]) - step_s
    (per_token,), *_ = np.linalg.lstsq(pa, py, rcond=None)
    fit = {
        "step_s": round(float(step_s), 6),
        "prefill_s_per_token": round(float(per_token), 7),
        "decode_s_per_seq": round(float(per_seq), 6),
        "decode_s_per_ctx_token": round(float(per_ctx), 9),
    }
    worst = max(
        abs(step_s + per_seq * r["batch"] + per_ctx * r["batch"] * r["ctx"] - r["seconds"])
        / r["seconds"]
        for r in decode_rows
    )
    lines = ["| batch | ctx | measured ms | model ms |", "|---|---|---|---|"]
    for r in decode_rows:
        model = step_s + per_seq * r["batch"] + per_ctx * r["batch"] * r["ctx"]
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['seconds'] * 1e3:.1f} | {model * 1e3:.1f} |"
        )
    lines += ["", "| prefill tokens | measured ms | model ms |", "|---|---|---|"]
    for r in prefill_rows:
        model = step_s + per_token * r["tokens"]
        lines.append(f"| {r['tokens']} | {r['seconds'] * 1e3:.1f} | {model * 1e3:.1f} |")
    lines += ["", "Fitted `sim:` settings: " + ", ".join(f"{k}={v}" for k, v in fit.items())]
    lines.append(f"Largest relative decode-step error of the fit: {worst:.0%}")
    table = "\n".join(lines)
    print(table)
    write_result(  # float32's keeps the historical name: the sim defaults come from it
        "sim_calibration" if opts.dtype == "float32" else f"sim_calibration_{opts.dtype}",
        "python -m bench.sim_calibrate " + " ".join(sys.argv[1:]),
        {"prefill": prefill_rows, "decode": decode_rows, "fit": fit, "worst_rel_error": worst,
         "model": opts.model, "threads": opts.threads, "weights": opts.dtype},
        table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
