"""LoRA adapters' cost in cgn-infer's decode steps (#60): 8 streams with 0, 1, 2 and 4
distinct adapters among them against the base alone, same backend, same run.

    .venv/bin/python bench/lora_overhead.py [--model smollm2] [--rank 8] [--steps 60]

The torch backend on the GGUF weights (layer.c), 8 sequences each decoding one token a
step at context `--ctx` (their prompts prefilled first). Adapters are written by the
test helper (harness/lora.py), rank `--rank`, on every matrix cgn-infer adapts (the
worst case: PEFT's "all-linear"), and again on attn_q and attn_v only (PEFT's default).
The configurations run round-robin, one step each in turn, so drift on a shared
machine falls on all alike; the table gives the median step time and its ratio to the
base's. Results: bench/results/lora_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core import bundled_models
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.adapters import Adapters
from cgn_infer.backends.paged import BatchItem, blocks_for
from cgn_infer.backends.torch_backend import TorchBackend
from cgn_infer.models import args_from_gguf
from harness.lora import write_adapter

ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QV = ("attn_q", "attn_v")
STREAMS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = bundled_models.resolve(Path(a.model))
    gguf = GGUFFile(path)
    args = args_from_gguf(gguf)
    backend = TorchBackend(gguf, args, threads=a.threads)
    adapters = Adapters("base", path, args, args.n_layers, 8)
    with tempfile.TemporaryDirectory() as tmp:
        for targets, tag in ((ALL, "all"), (QV, "qv")):
            for i in range(4):
                out = Path(tmp) / f"{tag}{i}.gguf"
                write_adapter(path, out, rank=a.rank, targets=targets, seed=i)
                adapters.load(f"{tag}{i}", out)
    backend.set_lora(adapters.tables)

    def rows(tag: str, distinct: int) -> list[tuple[int, float] | None]:
        if distinct == 0:
            return [None] * STREAMS
        return [adapters.resolve(f"{tag}{i % distinct}", 1.0) for i in range(STREAMS)]

    configs = {"base": rows("all", 0)}
    for tag in ("all", "qv"):
        for n in (1, 2, 4):
            configs[f"{n} adapter{'s' * (n > 1)} ({tag})"] = rows(tag, n)
    per = blocks_for(a.ctx + a.steps + 1)
    kv = backend.new_kv(per * STREAMS)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(STREAMS)]
    prompt = list(range(100, 100 + a.ctx))
    for lora in configs.values():  # every configuration's prompts, once (warm-up too)
        backend.forward_batch(
            [BatchItem(prompt, 0, t, lr) for t, lr in zip(tables, lora, strict=True)], kv
        )
    times: dict[str, list[float]] = {name: [] for name in configs}
    for step in range(a.steps):
        for name, lora in configs.items():
            items = [
                BatchItem([7], a.ctx + step, t, lr) for t, lr in zip(tables, lora, strict=True)
            ]
            start = time.perf_counter()
            backend.forward_batch(items, kv)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["base"])
    data = {
        name: {"median_ms": 1000 * statistics.median(t), "ratio": statistics.median(t) / base}
        for name, t in times.items()
    }
    lines = [
        f"| {STREAMS} streams, rank {a.rank}, ctx {a.ctx} | ms per step (median of "
        f"{a.steps}) | × base |",
        "|---|---:|---:|",
        *(f"| {n} | {d['median_ms']:.2f} | {d['ratio']:.2f} |" for n, d in data.items()),
    ]
    table = "\n".join(lines)
    print(table)
    write_result("lora_overhead", "python " + " ".join(sys.argv), data, table)
    gguf.close()


if __name__ == "__main__":
    main()
