"""TTFT with cgn-kvcached: a shared prefix recomputed, hit in the engine's pool, restored from
the node's RAM tier and restored cold from its SSD tier, on real models, in one run.

    .venv/bin/python bench/kvcached_ttft.py [--models smollm2,qwen2.5-coder-0.5b]
        [--lengths 32,128,512,2048] [--repeats 2]

For each model: one `cgn-kvcached serve` (write-through, so every block is on
the SSD too) and `cgn-infer serve --kvcached` on loopback. Each prompt is a
fresh random token sequence of `length` tokens; TTFT is the latency of a
`max_tokens=1` completion (prefill plus the first token). Phases, each in a
freshly started engine (an empty pool), so nothing but the tier differs:

1. recompute: the prompt is new everywhere; then **pool hit**: the same again;
2. **RAM**: a new engine; the prompt's blocks come from kvcached's RAM;
3. **SSD cold**: kvcached restarted (RAM empty), every block file's pages
   dropped (`posix_fadvise(DONTNEED)`), a new engine.

Also reported: the engine's own restore bandwidth (bytes over
`cgn_infer_kv_restore_seconds`), kvcached's RSS against its RAM tier's
bytes, and the cost model's verdict when a tier is made slow on purpose
(`--set kvcached.ram_mb_per_s=1` on an engine that never measured it):
restores skipped, the prompt recomputed.

Results: bench/results/kvcached_ttft.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine, model_id, peak_rss_mib, write_result
from bench.kvcached_tiers import MODELS, drop_page_cache
from cgn_core.bundled_models import BUNDLED
from cgn_core.etcd.local import free_port
from harness.metrics import metric
from harness.procs import cgn_kvcached


def prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 40_000, length)]


def ttft(url: str, model: str, tokens: list[int]) -> tuple[float, int]:
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return time.perf_counter() - start, int(cached)


@contextmanager
def store(tmp: Path, port: int) -> Iterator[Any]:
    args = ("--port", str(port), "--ssd-dir", str(tmp / "ssd"), "--ssd-bytes", str(8 << 30),
            "--set", "write_through=true")  # fmt: skip
    with cgn_kvcached(tmp, *args, ram_bytes=2 << 30) as kv:
        yield kv


def measure(name: str, lengths: list[int], repeats: int, tmp: Path) -> dict[str, Any]:
    path = BUNDLED[name]()
    port = free_port()
    engine_args = ("--kvcached", f"127.0.0.1:{port}", "--kv-pool-tokens", "8192")
    prompts = {n: [prompt(1000 * r + n, n) for r in range(repeats)] for n in lengths}
    out: dict[str, dict[int, list[float]]] = {}
    cached: dict[str, dict[int, list[int]]] = {}

    def phase(label: str, url: str, model: str) -> None:
        out[label], cached[label] = {}, {}
        for n, ps in prompts.items():
            for p in ps:
                t, c = ttft(url, model, p)
                out[label].setdefault(n, []).append(t)
                cached[label].setdefault(n, []).append(c)

    with store(tmp, port) as kv:
        with engine("cgn-infer", path, 2, *engine_args) as e:
            model = model_id(e["url"])
            phase("recompute", e["url"], model)
            phase("pool", e["url"], model)
            want = sum(len(ps) * (n // 16) for n, ps in prompts.items())
            deadline = time.monotonic() + 120
            while metric(e["url"], "cgn_infer_kv_offloaded_blocks_total") < want:
                assert time.monotonic() < deadline, "offers never reached kvcached"
                time.sleep(0.2)
        with engine("cgn-infer", path, 2, *engine_args) as e:
            phase("ram", e["url"], model)
            ram_bw = metric(e["url"], "cgn_infer_kv_restore_seconds_sum")
            restored = metric(e["url"], "cgn_infer_kv_restored_tokens_total")
        stats = httpx.get(kv.admin + "/metrics").text
        ram_bytes = sum(float(line.rsplit(" ", 1)[1]) for line in stats.splitlines()
                        if line.startswith('cgn_kvcached_bytes{tier="ram"}'))  # fmt: skip
        kv_rss = peak_rss_mib(kv.proc.pid, "VmRSS")
        # The losing case, on purpose: a RAM tier believed to move 1 MB/s never pays.
        slow = ("--set", "kvcached.ram_mb_per_s=1", "--set", "kvcached.ssd_mb_per_s=1")
        with engine("cgn-infer", path, 2, *engine_args, *slow) as e:
            t, c = ttft(e["url"], model, prompts[max(lengths)][0])
            skipped = metric(e["url"], "cgn_infer_kv_restore_skipped_total")
    drop_page_cache(tmp / "ssd")
    with store(tmp, port), engine("cgn-infer", path, 2, *engine_args) as e:
        phase("ssd", e["url"], model)
        ssd_bw = metric(e["url"], "cgn_infer_kv_restore_seconds_sum")
        ssd_restored = metric(e["url"], "cgn_infer_kv_restored_tokens_total")
    bpt = kv_bytes_per_token(name)
    return {
        "ttft_s": {k: {n: statistics.median(v) for n, v in per.items()} for k, per in out.items()},
        "cached_tokens": cached,
        "runs": out,
        "restore_mb_per_s": {
            "ram": restored * bpt / ram_bw / 1e6 if ram_bw else None,
            "ssd_cold": ssd_restored * bpt / ssd_bw / 1e6 if ssd_bw else None,
        },
        "kvcached_rss_mib": kv_rss,
        "kvcached_ram_tier_mib": ram_bytes / 2**20,
        "slow_tier": {"ttft_s": t, "cached_tokens": c, "restores_skipped": skipped},
        "bytes_per_token": bpt,
    }


def kv_bytes_per_token(name: str) -> int:
    layers, heads, dim = MODELS[{"smollm2": "smollm2-135m"}.get(name, name)]
    return 2 * layers * heads * dim * 4  # float32


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| model | prefix tokens | recompute s | pool hit s | RAM s | SSD cold s | "
            "RAM speed-up | SSD speed-up |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        t = r["ttft_s"]
        for n in t["recompute"]:
            rec = t["recompute"][n]
            rows.append(
                f"| {name} | {n} | {rec:.3f} | {t['pool'][n]:.3f} | {t['ram'][n]:.3f} | "
                f"{t['ssd'][n]:.3f} | {rec / t['ram'][n]:.1f}x | {rec / t['ssd'][n]:.1f}x |"
            )
    rows += ["", "| model | restore MB/s RAM | restore MB/s SSD cold | kvcached RSS MiB | "
             "its RAM tier MiB | slow-tier verdict |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, r in results.items():
        bw, slow = r["restore_mb_per_s"], r["slow_tier"]
        verdict = (f"{slow['restores_skipped']:.0f} restore skipped, {slow['cached_tokens']} "
                   f"cached tokens, TTFT {slow['ttft_s']:.2f} s")  # fmt: skip
        rows.append(f"| {name} | {bw['ram'] or 0:.0f} | {bw['ssd_cold'] or 0:.0f} | "
                    f"{r['kvcached_rss_mib']:.0f} | {r['kvcached_ram_tier_mib']:.0f} | {verdict} |")  # fmt: skip
    rows += ["", "TTFT = latency of a max_tokens=1 completion (prefill + first token), medians. "
             "Each phase in a freshly started engine; SSD cold after a kvcached restart with every "
             "block file's pages dropped. Restore MB/s: the engine's fetch (lookup, kvcached "
             "reading its tier and writing shared memory, mapping it), not the copy into the pool."]  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", default="32,128,512,2048")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) + 1 for x in args.lengths.split(",")]  # + the token always computed
    results = {}
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = measure(name, lengths, args.repeats, Path(tmp))
            print(table({name: results[name]}), flush=True)
    cmd = (f".venv/bin/python bench/kvcached_ttft.py --models {args.models} "
           f"--lengths {args.lengths} --repeats {args.repeats}")  # fmt: skip
    write_result("kvcached_ttft", cmd, results, table(results))
    print(table(results))


if __name__ == "__main__":
    main()
