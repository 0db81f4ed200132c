"""KV transfer for prefill/decode disaggregation: bytes per prompt token by model
shape, and what one decode leg's fetch of a 2,048-token prompt costs over each
transport.

The source is the KvCache gRPC service a prefill engine holds its blocks in
(cgn_core/kv, the one cgn-kvcached also serves), in a process of its own;
the client is the KvCacheClient a decode engine fetches with. Transports:

* loopback, gRPC messages (`transfer.shared_memory = false`);
* loopback, shared memory (the default between engines of one host);
* a veth pair into another network namespace, gRPC messages (a second "host";
  needs root, skipped with the reason otherwise). `tc netem` delay is not
  available in this kernel (no sch_netem), so there is no added-latency row.

Each row is the median of 5 fetches of the same 128 blocks, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.kv.client import KvCacheClient
from cgn_core.kv.layout import DTYPES, Layout
from cgn_core.readiness import wait_ready_file
from cgn_core.settings import TlsSettings
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models import args_from_gguf
from harness import netns
from harness.procs import REPO, stop

BLOCKS = 128  # a 2,048-token prompt
REPEATS = 5


def serve(host: str, ready: Path) -> None:
    """The source: a RAM-only block store over gRPC, offering shared memory, until SIGTERM."""
    from cgn_core.kv.ram_tier import RamTier
    from cgn_core.kv.service import KvCacheService, start_server
    from cgn_core.kv.store import BlockStore

    async def main() -> None:
        shm = Path(tempfile.mkdtemp(prefix="cgn-bench-", dir="/dev/shm"))
        service = KvCacheService(BlockStore(RamTier(2 << 30)), shm_dir=shm)
        server, port = await start_server(service, host, 0, TlsSettings())
        await asyncio.to_thread(ready.write_text, json.dumps({"port": port}))
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        await stopped.wait()
        await server.stop(1.0)
        shutil.rmtree(shm, ignore_errors=True)

    asyncio.run(main())


@contextmanager
def source(tmp: Path, host: str, ns: str = "") -> Iterator[str]:
    ready = tmp / f"source-{host}.ready"
    argv = [sys.executable, str(Path(__file__)), "--serve", host, "--ready", str(ready)]
    if ns:
        argv = ["ip", "netns", "exec", ns, *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        port = wait_ready_file(ready, timeout_s=60, proc=proc)["port"]
        yield f"{host}:{port}"
    finally:
        stop(proc)


def fetch_ms(address: str, layout: Layout, shared_memory: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (BLOCKS, layout.block_bytes), dtype=np.uint8)
    hashes = [i.to_bytes(8, "big") * 4 for i in range(BLOCKS)]  # 32-byte block hashes
    client = KvCacheClient(address, layout, timeout_s=60, shared_memory=shared_memory)
    try:
        assert client.put(hashes, data) == BLOCKS
        times = []
        for _ in range(REPEATS):
            began = time.perf_counter()
            got, _ = client.get(hashes)
            times.append(time.perf_counter() - began)
            assert got.shape == data.shape
        assert np.array_equal(got, data)
        assert client.shared_memory == shared_memory, "shared memory was not used as asked"
    finally:
        client.close()
    s = statistics.median(times)
    return {"ms": round(s * 1000, 1), "mb_per_s": round(data.nbytes / s / 1e6)}


def shapes() -> list[dict[str, Any]]:
    out = []
    for name, path in (("SmolLM2-135M", smollm2()), ("Qwen2.5-Coder-0.5B", qwen_coder_05b())):
        a = args_from_gguf(GGUFFile(path))
        for dtype in ("float32", "bfloat16"):
            per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * DTYPES[dtype]
            out.append({"model": name, "dtype": dtype, "layers": a.n_layers,
                        "kv_heads": a.n_kv_heads, "head_dim": a.head_dim,
                        "bytes_per_token": per_token,
                        "mb_per_2k_prompt": round(per_token * 2048 / 1e6, 1)})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve", metavar="HOST", help=argparse.SUPPRESS)
    p.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.ready)
        return
    results: dict[str, Any] = {"shapes": shapes(), "fetch": []}
    layouts = {(r["model"], r["dtype"]): Layout(r["dtype"], r["layers"], r["kv_heads"],
                                                r["head_dim"], 16, "bench")
               for r in results["shapes"] if r["model"] == "SmolLM2-135M"}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with source(tmp, "127.0.0.1") as address:
            for (model, dtype), lay in layouts.items():
                for shm in (False, True):
                    transport = "loopback, shared memory" if shm else "loopback, gRPC messages"
                    row = {"transport": transport, "model": model, "dtype": dtype}
                    results["fetch"].append({**row, **fetch_ms(address, lay, shm)})
        try:
            with netns.other_host() as (ns, addr, _), source(tmp, addr, ns) as address:
                for (model, dtype), lay in layouts.items():
                    row = {"transport": "veth pair, gRPC messages", "model": model, "dtype": dtype}
                    results["fetch"].append({**row, **fetch_ms(address, lay, False)})
        except netns.NetnsUnavailable as exc:
            results["veth_skipped"] = str(exc)
    command = "python bench/pd_transfer.py " + " ".join(sys.argv[1:])
    write_result("pd_transfer", command.strip(), results, table(results))


def table(r: dict[str, Any]) -> str:
    rows = ["| model | KV dtype | layers x KV heads x head dim | bytes per prompt token | "
            "MB per 2k-token prompt |", "|---|---|---|---:|---:|"]  # fmt: skip
    for s in r["shapes"]:
        rows.append(f"| {s['model']} | {s['dtype']} | {s['layers']} x {s['kv_heads']} x "
                    f"{s['head_dim']} | {s['bytes_per_token']:,} | {s['mb_per_2k_prompt']} |")  # fmt: skip
    rows += ["", f"One decode leg's fetch of {BLOCKS} blocks (2,048 tokens), median of {REPEATS}:",
             "", "| transport | model | KV dtype | ms | MB/s |", "|---|---|---|---:|---:|"]  # fmt: skip
    for f in r["fetch"]:
        rows.append(f"| {f['transport']} | {f['model']} | {f['dtype']} | {f['ms']} | "
                    f"{f['mb_per_s']:,} |")  # fmt: skip
    if "veth_skipped" in r:
        rows += ["", f"veth pair skipped: {r['veth_skipped']}"]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
