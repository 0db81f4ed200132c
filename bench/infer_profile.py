"""Where a cgn-infer decode step's time goes, per weight format: the per-op profile.

    python bench/infer_profile.py [--models smollm2 qwen] [--weights gguf gguf-ops float32 int8]

For each model and weight format: the torch backend in this process (no
server), the prompt's KV in the pool, then single-stream decode steps (one
token each, the way a lone stream runs) under torch.profiler. Ops are put in
buckets (weight matmuls, the LM head, attention with its KV gather, the KV
write, norms, RoPE and the rest) and reported as milliseconds per token; the
LM head is timed on its own, since its matmul is the same op as the layers'.
The C kernels of `gguf` are not torch ops: their calls are wrapped in
`record_function` here (only here) so that the profile sees them.
A step at 4 and 16 rows is timed too (no profile), for tokens/s per row.

This is the "where the time goes" table issue #22 asks for before and after
each change; ratios to llama.cpp live in infer_single_stream.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.backends.fused import FusedLayers
from cgn_infer.backends.paged import BatchItem
from cgn_infer.backends.quantized import QuantMatrix
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf

MODELS = {"smollm2": smollm2, "qwen": qwen_coder_05b}
CONTEXT = 128  # tokens already in the pool when decode starts
STEPS = 20
BUCKETS = [  # first match wins: (bucket, substrings of the aten op name)
    ("layers in C (kernels/layer.c: all of the below but the LM head)", ("cgn::layers",)),
    (
        "weight matmuls",
        ("int4pack_mm", "int8pack_mm", "linear", "addmm", " mm", "matmul", "cgn::qmatmul"),
    ),
    ("embedding lookup", ("cgn::embed", "embedding")),
    ("attention + KV gather", ("scaled_dot_product", "flash_attention", "aten::index", "bmm")),
    ("KV write", ("index_copy",)),
    ("norms", ("rms_norm", "pow", "rsqrt", "mean")),
    ("RoPE", ("complex", "view_as_real", "polar")),
]


def _traced(name: str, fn: Any) -> Any:
    def call(*args: Any) -> Any:
        with record_function(name):
            return fn(*args)

    return call


QuantMatrix.__call__ = _traced("cgn::qmatmul", QuantMatrix.__call__)  # type: ignore[method-assign]
QuantMatrix.rows = _traced("cgn::embed", QuantMatrix.rows)  # type: ignore[method-assign]
FusedLayers.run = _traced("cgn::layers", FusedLayers.run)  # type: ignore[method-assign]


def bucket(op: str) -> str:
    for label, keys in BUCKETS:
        if any(k.strip() in op for k in keys):
            return label
    return "other ops (dtype casts, views, adds, silu, sampling glue)"


def decode_items(rows: int) -> list[BatchItem]:
    per = -(-(CONTEXT + STEPS + 8) // 16)
    return [BatchItem([7], CONTEXT, list(range(r * per, (r + 1) * per))) for r in range(rows)]


def profile_one(model: str, weights: str, threads: int) -> dict[str, Any]:
    chosen = weights.removesuffix("-ops")
    # NOTE: the torch backend itself, not load_model's choice (which takes the C backend for
    # gguf weights): its ops are what this profile buckets, with the C calls traced among them
    gguf = GGUFFile(MODELS[model]())
    b: Any = TorchBackend(gguf, args_from_gguf(gguf), weights=chosen, threads=threads)
    if weights.endswith("-ops"):
        b._fused = None  # the op-by-op path the one-call layers replaced, for the comparison
    kv = b.new_kv(16 * (-(-(CONTEXT + STEPS + 8) // 16)))
    prompt = [BatchItem(list(range(100, 100 + CONTEXT)), 0, decode_items(16)[r].table)
              for r in range(16)]  # fmt: skip
    b.forward_batch(prompt, kv)
    one = decode_items(1)
    for _ in range(3):
        b.forward_batch(one, kv)
    began = time.perf_counter()
    for _ in range(STEPS):
        b.forward_batch(one, kv)
    step_ms = (time.perf_counter() - began) / STEPS * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            b.forward_batch(one, kv)
    buckets: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        buckets[bucket(ev.key)] += ev.self_cpu_time_total / 1000 / STEPS
    # the LM head is one of the weight matmuls: time it alone and move it to its own line
    x = torch.randn(1, b.args.dim)
    head = b.w.output
    head(x)
    began = time.perf_counter()
    for _ in range(STEPS):
        head(x)
    head_ms = (time.perf_counter() - began) / STEPS * 1000
    buckets["weight matmuls"] = max(0.0, buckets["weight matmuls"] - head_ms)
    buckets["LM head"] = head_ms
    batched = {}
    for rows in (4, 16):
        items = decode_items(rows)
        b.forward_batch(items, kv)
        began = time.perf_counter()
        for _ in range(5):
            b.forward_batch(items, kv)
        batched[rows] = round(rows / ((time.perf_counter() - began) / 5), 1)
    profiled = sum(buckets.values())
    return {"step_ms": round(step_ms, 1), "tok_s": round(1000 / step_ms, 1),
            "profiled_ms": round(profiled, 1),
            "buckets_ms": {k: round(v, 2) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
            "tok_s_at_rows": batched, "weight_mb": round(b.weight_bytes() / 1e6, 1),
            "decode_threads": b.decode_threads}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen"], choices=list(MODELS))
    p.add_argument("--weights", nargs="+", default=["gguf", "gguf-ops", "float32", "int8"],
                   help="gguf-ops: gguf weights with the layers op by op in torch (no layer.c)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    results: dict[str, Any] = {"threads": args.threads, "context": CONTEXT, "runs": {}}
    for model in args.models:
        for weights in args.weights:
            print(f"{model} {weights} ...", file=sys.stderr, flush=True)
            results["runs"][f"{model} {weights}"] = profile_one(model, weights, args.threads)
    command = "python bench/infer_profile.py " + " ".join(sys.argv[1:])
    write_result("infer_profile", command.strip(), results, table(results))


def table(r: dict[str, Any]) -> str:
    names = list(r["runs"])
    labels: list[str] = []
    for run in r["runs"].values():
        labels += [k for k in run["buckets_ms"] if k not in labels]
    rows = ["| ms per token | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    for label in labels:
        cells = [f"{r['runs'][n]['buckets_ms'].get(label, 0.0):.2f}" for n in names]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows.append("| **profiled total** | " + " | ".join(
        f"{r['runs'][n]['profiled_ms']}" for n in names) + " |")  # fmt: skip
    rows.append("| step, unprofiled | " + " | ".join(
        f"{r['runs'][n]['step_ms']} ({r['runs'][n]['tok_s']} tok/s)" for n in names) + " |")  # fmt: skip
    for rows_n in ("4", "16"):
        rows.append(f"| tok/s at {rows_n} rows | " + " | ".join(
            f"{r['runs'][n]['tok_s_at_rows'][int(rows_n)]}" for n in names) + " |")  # fmt: skip
    rows.append("| weight matrices MB | " + " | ".join(
        f"{r['runs'][n]['weight_mb']}" for n in names) + " |")  # fmt: skip
    single = {run.get("decode_threads", 1) for run in r["runs"].values()}
    rows += ["", f"Single-stream decode at {r['context']} tokens of context; batched steps use "
             f"{r['threads']} threads, a single stream {', '.join(map(str, sorted(single)))} "
             "(decode_threads)."]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    main()
