"""The layer pipeline against one process: memory per part, speed, bytes on the wire.

    .venv/bin/python bench/pipeline.py [--model smollm2] [--tokens 48] [--delay-ms 5]

Configurations, one after the other, each as real processes on this machine (a head
`cgn-infer serve --stages`, its `cgn-infer stage` processes): one process with one
thread (the reference), and with two, a 2-way split (f32, f16, int8 activations), a 3-way split (f16, int8), and the
2-way f16 split with a user-space relay that delays every chunk by `--delay-ms` each way
(no sch_netem in this kernel, so no `tc netem`). Splits balance weight bytes, not layer
counts: the head also holds the embedding and the LM head. Every part runs one thread,
as if each had a one-core machine of its own (NOTE: two threads per part on 2 cores made
every part's OpenMP team spin while another part computed: 3-way decode ran at a quarter
of 2-way's); the 3-way split then oversubscribes this 2-core machine. For each:

* weight bytes each part holds, from the GGUF's tensor sizes (the embedding and LM head
  go with the head), and each process's resident memory (VmRSS, VmHWM) after the run;
* TTFT of a ~200-token prompt (median of 3), decode tok/s of one stream, aggregate tok/s
  of 8 streams (`--tokens` each, greedy, EOS ignored);
* activation bytes per token, head to stages and back, from the head's
  cgn_infer_pipeline_bytes_total, against the model shape (hidden size x bytes a value;
  the last stage returns only each sequence's last row of a prompt).

Every part shares this machine's cores, so a split cannot be faster here: what it buys is
memory per machine. Results: bench/results/pipeline.{json,md} (another --model:
pipeline_<model>.{json,md}).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import peak_rss_mib, stream_completion, write_result
from cgn_core import bundled_models
from cgn_core.etcd.local import free_port
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models import args_from_gguf
from cgn_infer.pipeline.wire import balanced_split, layer_bytes
from harness.procs import cgn_infer_engines, cgn_infer_stages


def balanced(gguf: GGUFFile, n_layers: int, parts: int) -> list[str]:
    """The stages' ranges of the split `cgn-infer stage --part I/N` serves."""
    return [f"{a}:{b}" for a, b in balanced_split(gguf, n_layers, parts)[1:]]


class DelayRelay:
    """A TCP relay on loopback that holds every chunk `delay_s` before passing it on, each
    way (order kept): a link's latency, in user space."""

    def __init__(self, target: str, delay_s: float):
        self.host, port = target.rsplit(":", 1)
        self.target_port, self.delay_s = int(port), delay_s
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self._ready.set()
        with contextlib.suppress(RuntimeError):
            self.loop.run_until_complete(server.serve_forever())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, self.target_port)
        await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer),
                             return_exceptions=True)  # fmt: skip

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    dst.close()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                dst.write(data)
                await dst.drain()

        task = asyncio.create_task(deliver())
        while True:
            data = await src.read(1 << 16)
            queue.put_nowait((time.monotonic() + self.delay_s, data))
            if not data:
                break
        await task

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def one_stream(url: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client() as client:
        return stream_completion(client, url, body)


def measure(url: str, tokens: int) -> dict[str, float]:
    one_stream(url, "Warm up.", 4)
    long = "Notes: " + " ".join(f"river {i} bridge {i}" for i in range(60)) + "\nSummary:"
    ttfts = [one_stream(url, f"{i} {long}", 1)[0] for i in range(3)]
    _, stamps = one_stream(url, "Write a long story about rivers.", tokens)
    single = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one_stream, url, f"Story {i} about bridges.", tokens)
                   for i in range(8)]  # fmt: skip
        for f in futures:
            f.result()
    aggregate = 8 * tokens / (time.perf_counter() - start)
    return {"ttft_s": statistics.median(ttfts), "decode_tok_s_1": single,
            "aggregate_tok_s_8": aggregate}  # fmt: skip


def wire_bytes(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("cgn_infer_pipeline_bytes_total{"):
            out[line.split("{", 1)[1].split("}")[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{")):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


@contextlib.contextmanager
def configuration(model: Path, spans: list[str], head_args: list[str], delay_s: float,
                  tmp: Path, threads: int) -> Iterator[tuple[str, list[int]]]:  # fmt: skip
    """The head's URL and every process's pid (head first)."""
    named = ["--model-name", "m", "--threads", str(threads)]
    if not spans:
        with cgn_infer_engines(tmp, 1, *named, model=model) as [eng]:
            yield eng.url, [eng.proc.pid]
        return
    with cgn_infer_stages(tmp, spans, "--threads", "1", model=model) as stages:
        relays = [DelayRelay(s.address, delay_s) for s in stages] if delay_s else []
        addresses = [r.address for r in relays] or [s.address for s in stages]
        try:
            with cgn_infer_engines(tmp, 1, *named, "--stages", ",".join(addresses), *head_args,
                                   model=model) as [eng]:  # fmt: skip
                yield eng.url, [eng.proc.pid, *(s.proc.pid for s in stages)]
        finally:
            for r in relays:
                r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    opts = ap.parse_args()
    path = bundled_models.resolve(Path(opts.model))
    gguf = GGUFFile(path)
    args = args_from_gguf(gguf)
    n = args.n_layers
    two, three = balanced(gguf, n, 2), balanced(gguf, n, 3)
    configs: list[tuple[str, list[str], list[str], float]] = [
        ("one process", [], [], 0.0),
        ("one process, 2 threads", [], [], 0.0),
        ("2-way f32", two, ["--activations", "f32"], 0.0),
        ("2-way f16", two, ["--activations", "f16"], 0.0),
        ("2-way int8", two, ["--activations", "int8"], 0.0),
        ("3-way f16", three, ["--activations", "f16"], 0.0),
        ("3-way int8", three, ["--activations", "int8"], 0.0),
        (
            f"2-way f16, +{opts.delay_ms:g} ms each way",
            two,
            ["--activations", "f16"],
            opts.delay_ms / 1000,
        ),
    ]
    per_layer, ends_bytes = layer_bytes(gguf, n)  # the embedding and LM head go with the head

    def part_weights(first: int, end: int, head: bool) -> int:
        return sum(per_layer[first:end]) + (ends_bytes if head else 0)

    whole = part_weights(0, n, True)
    results: dict[str, Any] = {}
    for label, spans, head_args, delay in configs:
        with tempfile.TemporaryDirectory() as tmp, \
                configuration(path, spans, head_args, delay, Path(tmp),
                              2 if "2 threads" in label else 1) as (url, pids):  # fmt: skip
            row: dict[str, Any] = measure(url, opts.tokens)
            firsts = [0] + [int(s.split(":")[0]) for s in spans]
            ends = [int(s.split(":")[0]) for s in spans] + [n]
            row["parts"] = []
            for i, (a, b, pid) in enumerate(zip(firsts, ends, pids, strict=True)):
                w = part_weights(a, b, i == 0)
                row["parts"].append({"layers": f"{a}:{b}", "weight_mib": w / 2**20,
                                     "weight_share": w / whole,
                                     "rss_mib": peak_rss_mib(pid, "VmRSS"),
                                     "hwm_mib": peak_rss_mib(pid)})  # fmt: skip
            if spans:
                w = wire_bytes(url)
                tokens = w.get("vllm:prompt_tokens_total", 0) + w.get(
                    "vllm:generation_tokens_total", 0
                )
                for way in ("out", "in"):  # per token and stage
                    moved = sum(v for k, v in w.items() if k.startswith(f'direction="{way}"'))
                    row[f"bytes_{way}_per_token"] = moved / tokens / len(spans)
            results[label] = row
            print(label, row, file=sys.stderr, flush=True)
    name = "pipeline" if opts.model == "smollm2" else f"pipeline_{opts.model}"
    command = "bench/pipeline.py " + " ".join(sys.argv[1:])
    write_result(name, command, results, table(results, args.dim, opts.model))


def table(results: dict[str, Any], dim: int, model: str) -> str:
    ref = results["one process"]
    lines = [
        f"Model {model} (hidden size {dim}); every process on the same 2 cores, one thread "
        "each unless said. Ratios are to one process (one thread) in the same run.",
        "",
        "| configuration | TTFT | decode tok/s, 1 stream | aggregate tok/s, 8 streams | "
        "bytes/token to a stage, back | parts: layers, weights (share), RSS |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        parts = "; ".join(f"{p['layers']} {p['weight_mib']:.0f} MiB ({p['weight_share']:.0%}), "
                          f"{p['rss_mib']:.0f} MiB" for p in r["parts"])  # fmt: skip
        per_hop = (f"{r['bytes_out_per_token']:.0f}, {r['bytes_in_per_token']:.0f}"
                   if "bytes_out_per_token" in r else "")  # fmt: skip
        lines.append(
            f"| {label} | {r['ttft_s'] * 1000:.0f} ms ({r['ttft_s'] / ref['ttft_s']:.2f}x) | "
            f"{r['decode_tok_s_1']:.1f} ({r['decode_tok_s_1'] / ref['decode_tok_s_1']:.2f}x) | "
            f"{r['aggregate_tok_s_8']:.1f} "
            f"({r['aggregate_tok_s_8'] / ref['aggregate_tok_s_8']:.2f}x) | "
            f"{per_hop} | {parts} |"
        )
    lines += ["", f"Model shape, bytes per token per hop: f32 {4 * dim}, f16 {2 * dim}, int8 "
              f"{dim + dim // 16 + 16} (int8 values, a float16 scale per 32 values, 4 outliers of "
              "4 bytes)."]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
