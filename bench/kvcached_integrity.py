"""What the KV store's identity and sealed SSD blocks cost a restore: this tree against a base.

    .venv/bin/python bench/kvcached_integrity.py [--base b7f537b] [--tokens 2048] [--repeats 5]

Two `cgn-kvcached serve` processes on loopback, one run: the base commit's
(a git worktree; no tokens, unkeyed BLAKE3 checksums) and this tree's (a node
secret: every call carries the client token, every SSD block a tag keyed by
the seal key over its name and bytes). Both are driven by this tree's
`KvCacheClient` the way an engine restores a prompt: the blocks of a
`--tokens` prefix in SmolLM2-135M's layout put, then read back through
shared memory, from RAM, and cold from the SSD after a restart with each
block file's pages dropped (`posix_fadvise(DONTNEED)`). Both stores run at
once and their restores alternate (nine RAM restores each per repeat, one
cold one), so drift on a shared machine hits both alike; reported are the
medians and this tree's bandwidth as a share of the base's (the bound in
issue #40: at least 95 %).

Results: bench/results/kvcached_integrity.{json,md}.
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
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.kvcached_tiers import drop_page_cache
from cgn_core.kv.client import KvCacheClient
from cgn_core.kv.identity import StoreKeys, ensure_secret
from cgn_core.kv.layout import Layout
from cgn_core.readiness import wait_ready_file
from harness.procs import BIN, REPO, stop

LAYOUT = Layout("float32", 30, 3, 64, 16, "cgn-infer 0.1.0")  # SmolLM2-135M's
DEFAULT_BASE = "b7f537b"  # the last commit before the store had an identity


@contextmanager
def store(src: Path | None, ssd: Path, tmp: Path) -> Iterator[str]:
    """A kvcached of `src` (a base worktree) or of this tree (with a node secret); yields the
    client token ("" for the base)."""
    ready = tmp / f"kv-{time.monotonic_ns()}.ready"
    exe, env, token, extra = [str(BIN / "cgn-kvcached")], None, "", []
    if src is None:
        keys = StoreKeys.derive(ensure_secret(tmp / "kvcached.secret"))
        token, extra = keys.client_token, ["--set", f"secret_file={tmp / 'kvcached.secret'}"]
    else:  # NOTE: -P: modules from the worktree, not from the current folder
        exe = [sys.executable, "-P", "-c", "import sys; from cgn_kvcached.cli import main; "
               "sys.argv[0] = 'cgn-kvcached'; main()"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [*exe, "serve", "--port", "0", "--admin-port", "0", "--ram-bytes", str(1 << 30),
            "--ssd-dir", str(ssd), "--ssd-bytes", str(4 << 30), "--set", "write_through=true",
            "--set", f"shm_dir={tmp / ('shm-' + ssd.name)}", "--ready-file", str(ready),
            *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        port = wait_ready_file(ready, timeout_s=60, proc=proc)["ports"]["grpc"]
        yield f"127.0.0.1:{port}|{token}"
    finally:
        stop(proc)


def restore_mb_per_s(target: str, hashes: list[bytes]) -> float:
    address, token = target.split("|")
    client = KvCacheClient(address, LAYOUT, token=token, timeout_s=600)
    try:
        client.lookup(hashes[:1])  # connected, shared memory probed: not timed
        start = time.perf_counter()
        got, _ = client.get(hashes)
        seconds = time.perf_counter() - start
        assert got.shape[0] == len(hashes), f"{got.shape[0]} of {len(hashes)} blocks came back"
        return got.nbytes / seconds / 1e6
    finally:
        client.close()


def measure(base: Path, tokens: int, repeats: int, tmp: Path) -> dict[str, Any]:
    n = tokens // 16
    data = np.random.default_rng(0).integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    runs: dict[str, dict[str, list[float]]] = {
        side: {"ram": [], "ssd_cold": []} for side in ("base", "this")
    }
    sides: list[tuple[str, Path | None]] = [("base", base), ("this", None)]
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        ssd = {side: tmp / f"{side}-{r}" for side, _ in sides}
        with ExitStack() as stack:  # both stores up at once: their restores interleave
            targets = {side: stack.enter_context(store(src, ssd[side], tmp)) for side, src in order}
            for target in targets.values():
                address, token = target.split("|")
                client = KvCacheClient(address, LAYOUT, token=token, timeout_s=600)
                assert client.put(hashes, data) == n
                client.close()
            for _ in range(9):  # NOTE: one restore is ~40 ms: many, alternating, or noise wins
                for side, _src in order:
                    runs[side]["ram"].append(restore_mb_per_s(targets[side], hashes))
        for side, _src in order:
            drop_page_cache(ssd[side])
        with ExitStack() as stack:
            targets = {side: stack.enter_context(store(src, ssd[side], tmp)) for side, src in order}
            for side, _src in order:
                runs[side]["ssd_cold"].append(restore_mb_per_s(targets[side], hashes))
    med = {s: {k: statistics.median(v) for k, v in per.items()} for s, per in runs.items()}
    return {
        "tokens": tokens,
        "bytes": int(data.nbytes),
        "mb_per_s": med,
        "this_over_base": {k: med["this"][k] / med["base"][k] for k in ("ram", "ssd_cold")},
        "runs": runs,
    }


def table(r: dict[str, Any], base: str) -> str:
    m, q = r["mb_per_s"], r["this_over_base"]
    rows = ["| restore from | base MB/s | this tree MB/s | this / base |", "|---|---:|---:|---:|"]
    for tier, label in (("ram", "RAM"), ("ssd_cold", "SSD, cold")):
        rows.append(f"| {label} | {m['base'][tier]:.0f} | {m['this'][tier]:.0f} | {q[tier]:.3f} |")
    rows += [
        "",
        f"{r['tokens']} tokens of SmolLM2-135M's layout ({r['bytes'] / 1e6:.1f} MB) restored "
        f"through shared memory by KvCacheClient; base = {base} (no identity, unkeyed "
        "checksums), this tree = client token on every call, SSD blocks sealed with keyed "
        "BLAKE3 over name and bytes. Medians; both stores up at once, restores alternating.",
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=DEFAULT_BASE, help="the commit to compare against")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base),
                        args.base], check=True, capture_output=True)  # fmt: skip
        try:
            result = measure(base, args.tokens, args.repeats, Path(tmp))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                           check=False, capture_output=True)  # fmt: skip
    cmd = " ".join([".venv/bin/python bench/kvcached_integrity.py", *sys.argv[1:]])
    write_result("kvcached_integrity", cmd, result, table(result, args.base))
    print(table(result, args.base))


if __name__ == "__main__":
    main()
