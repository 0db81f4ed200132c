"""cgn-kvcached restore bandwidth per tier: a 2,048-token prefix back from RAM and from SSD.

    .venv/bin/python bench/kvcached_tiers.py [--tokens 2048] [--repeats 5]

A real `cgn-kvcached serve` on loopback (write-through, so every block is on
the SSD too). For the KV layouts of SmolLM2-135M and Qwen2.5-Coder-0.5B
(float32, 16-token blocks), the blocks of a `--tokens` prefix are stored,
then read back with one `Get` stream: from RAM; then, after a restart (RAM
empty) with the files' pages dropped from the page cache
(`posix_fadvise(DONTNEED)` on each block file, not the global drop_caches),
cold from SSD; then again (promoted to RAM by the SSD read). Reported: bytes
per token against the layout's prediction, and MB/s per tier (median of
`--repeats` runs). These are the inputs the engine's restore-or-recompute
cost model will weigh against its prefill rate (issue #19).

Results: bench/results/kvcached_tiers.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.kv.layout import Layout
from cgn_core.readiness import wait_ready_file
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc
from harness.procs import BIN, stop

MODELS = {  # layers, KV heads, head dim (from the GGUFs)
    "smollm2-135m": (30, 3, 64),
    "qwen2.5-coder-0.5b": (24, 2, 64),
}


@contextmanager
def kvcached(ssd: Path) -> Iterator[pb_grpc.KvCacheStub]:
    ready = ssd.parent / f"kvcached-{time.monotonic_ns()}.ready"
    argv = [str(BIN / "cgn-kvcached"), "serve", "--port", "0", "--admin-port", "0",
            "--ram-bytes", str(1 << 30), "--ssd-dir", str(ssd), "--ssd-bytes", str(4 << 30),
            "--set", "write_through=true", "--ready-file", str(ready)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        port = wait_ready_file(ready, timeout_s=60, proc=proc)["ports"]["grpc"]
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            yield pb_grpc.KvCacheStub(ch)
    finally:
        stop(proc)


def drop_page_cache(ssd: Path) -> None:
    for path in ssd.glob("*.blk"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(
    stub: pb_grpc.KvCacheStub, layout: pb.KvLayout, hashes: list[bytes]
) -> tuple[float, int, set[int]]:
    start = time.perf_counter()
    total, tiers = 0, set()
    for reply in stub.Get(pb.GetRequest(layout=layout, hashes=hashes), timeout=600):
        total += len(reply.block.data)
        tiers.add(reply.tier)
    return time.perf_counter() - start, total, tiers


def measure(name: str, tokens: int, repeats: int, tmp: Path) -> dict[str, Any]:
    layers, heads, dim = MODELS[name]
    layout = Layout("float32", layers, heads, dim, 16, "cgn-infer 0.1.0")
    wire = pb.KvLayout(dtype="float32", layers=layers, kv_heads=heads, head_dim=dim,
                       block_size=16, engine="cgn-infer 0.1.0")  # fmt: skip
    n = tokens // 16
    blocks = [pb.KvBlock(hash=i.to_bytes(32, "big"), data=os.urandom(layout.block_bytes))
              for i in range(n)]  # fmt: skip
    hashes = [b.hash for b in blocks]
    ssd = tmp / name
    rates: dict[str, list[float]] = {"ram": [], "ssd_cold": [], "ram_after_promotion": []}
    total = 0
    for _ in range(repeats):
        for p in ssd.glob("*.blk") if ssd.exists() else ():
            p.unlink()
        with kvcached(ssd) as stub:
            stub.Put(iter(pb.PutRequest(layout=wire, block=b) for b in blocks), timeout=600)
            seconds, total, _ = read_all(stub, wire, hashes)
            rates["ram"].append(total / seconds / 1e6)
        drop_page_cache(ssd)
        with kvcached(ssd) as stub:
            seconds, total, tiers = read_all(stub, wire, hashes)
            assert tiers == {3}, tiers  # KV_TIER_SSD: nothing came from RAM
            rates["ssd_cold"].append(total / seconds / 1e6)
            seconds, total, _ = read_all(stub, wire, hashes)
            rates["ram_after_promotion"].append(total / seconds / 1e6)
    return {
        "tokens": tokens, "blocks": n, "bytes": total,
        "bytes_per_token": total / tokens, "predicted_bytes_per_token": layout.block_bytes / 16,
        "mb_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "runs": rates,
    }  # fmt: skip


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| model | tokens | MB moved | bytes/token (predicted) | RAM MB/s | SSD cold MB/s | "
            "RAM after promotion MB/s |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        m = r["mb_per_s"]
        rows.append(f"| {name} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | "
                    f"{r['bytes_per_token']:.0f} ({r['predicted_bytes_per_token']:.0f}) | "
                    f"{m['ram']:.0f} | {m['ssd_cold']:.0f} | {m['ram_after_promotion']:.0f} |")  # fmt: skip
    rows += ["", "One Get stream over gRPC on loopback (the client in Python, one process); "
             "medians of the runs. SSD cold: after a restart, each block file's pages dropped "
             "with posix_fadvise(DONTNEED)."]  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {m: measure(m, args.tokens, args.repeats, Path(tmp)) for m in MODELS}
    cmd = (
        f".venv/bin/python bench/kvcached_tiers.py --tokens {args.tokens} --repeats {args.repeats}"
    )
    write_result("kvcached_tiers", cmd, results, table(results))
    print(table(results))


if __name__ == "__main__":
    main()
