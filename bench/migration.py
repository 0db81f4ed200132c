"""Request migration under failure: streams that outlive their engine. One run, side by side.

    .venv/bin/python -m bench.migration [--streams 64] [--speed 20] [--seconds 6]
    .venv/bin/python -m bench.migration --engine llamacpp [--streams 32] [--prompt 200]
                                        [--output 64]

`--engine llamacpp` (#59): three real llama.cpp servers (xllamacpp, SmolLM2, one thread
each, `--parallel 16`) in place of the sim engines, continued from their text
(cgn_core/openai/continuation.py); no kvcached (llama.cpp has none), so its scenarios
are kill -9, SIGTERM (what the agent sends when a drain outlasts its grace) and kill -9
with migration off; its cost check declares the sim engines as llama.cpp servers.
Results: bench/results/migration_llamacpp.{json,md} (`_N` for `--streams N` other than 32).

Three sim engines (each its own process, so one can be killed) behind a router,
with and without a shared cgn-kvcached; `--streams` concurrent streams, each a
completion of its own 1,000-token prompt (token ids: no prefix shared between
streams) with 500 output tokens. Once half the streams have 30 tokens (the rest
are still queued for their prefill, as in a busy fleet), one engine (the one
with the most streams in flight) is ended. Scenarios, each on a fresh
fleet:

1. kill -9, prefix restored from kvcached (the engines offer a prompt's blocks
   as soon as they are computed);
2. kill -9, no kvcached: the continuation recomputes prompt and output so far;
3. drain: SIGTERM, what the agent sends once a replica's drain timeout has
   passed (the engine stops accepting, gives its streams 2 s, closes the rest);
4. kill -9 with migration off (`migration.limit: 0`): today's behaviour before
   this change, for comparison.

Reported per scenario: streams that failed (an error event, a non-200, or an
answer short of its 500 tokens), streams continued (the router's
`cgn_router_migrations_total`), and the longest gap between two chunks each
client saw (p50/p99 over the streams that were on the ended engine, and p99
over all). The sim's output is a function of the whole context, so a
continued answer is checked token for token against the same stream on an
undisturbed fleet (`identical`).

Cost when nothing fails: two routers on the same engines, migration on and
off, `--streams` concurrent short streams (16 tokens) for `--seconds`,
alternating four times; completed requests/s of each, and the ratio.

Results: bench/results/migration.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from cgn_core.bundled_models import smollm2
from cgn_core.etcd.local import free_port
from harness.metrics import metric
from harness.procs import (
    Engine,
    Router,
    cgn_infer_engines,
    cgn_kvcached,
    cgn_router,
    llamacpp_server,
)

MODEL = "sim"
KILL_AT = 30
VOCAB = 40000


@dataclass
class Stream:
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # KILL_AT tokens, or ended
    text: list[str] = field(default_factory=list)
    endpoint: str = ""
    failed: str = ""
    max_gap_s: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    finish: str = ""  # the last chunk's finish reason


@dataclass
class Fleet:
    engines: dict[str, Engine]
    router: Router
    ports: dict[str, int]


@contextmanager
def fleet(
    tmp: Path, speed: float, kvcached: bool, migration: int = 3, engine: str = "sim"
) -> Iterator[Fleet]:
    tmp.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        extra: tuple[str, ...] = ()
        if kvcached:
            extra = stack.enter_context(cgn_kvcached(tmp, ram_bytes=8 << 30)).engine_args
        ports = {f"e{i}": free_port() for i in range(3)}
        engines: dict[str, Any] = {}
        for name, port in ports.items():
            if engine == "llamacpp":  # NOTE: .proc is all the scenarios use of an engine
                _, proc = stack.enter_context(llamacpp_server(
                    smollm2(), threads=1, parallel=16, ctx=16 * 1024, port=port))  # fmt: skip
                engines[name] = SimpleNamespace(proc=proc)
                continue
            (engines[name],) = stack.enter_context(cgn_infer_engines(
                tmp, 1, "--backend", "sim", "--speed", str(speed), "--model-name", MODEL,
                "--max-batch", "64", "--kv-pool-tokens", "131072", "--ctx", "4096",
                "--port", str(port), *extra))  # fmt: skip
        kind = {"engine": engine} if engine == "llamacpp" else {}
        endpoints = {n: {"url": f"http://127.0.0.1:{p}", "model": MODEL, **kind}
                     for n, p in ports.items()}  # fmt: skip
        config = {"discovery": "static", "endpoints": endpoints, "log": {"level": "warning"},
                  "migration": {"limit": migration}, "breaker": {"failures": 1000},
                  "models": {MODEL: {"tokenizer": str(smollm2())}} if kind else {}}  # fmt: skip
        yield Fleet(engines, stack.enter_context(cgn_router(tmp, config)), ports)


def prompt(i: int, length: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(100, VOCAB) for _ in range(length)]


async def one_stream(
    session: aiohttp.ClientSession, url: str, i: int, out: Stream, shape: tuple[int, int]
) -> None:
    length, output = shape
    body = {"model": MODEL, "prompt": prompt(i, length), "max_tokens": output, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            out.endpoint = resp.headers.get("x-cognitora-endpoint", "")
            if resp.status != 200:
                out.failed = f"status {resp.status}"
                return
            last = time.monotonic()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                out.max_gap_s, last = max(out.max_gap_s, now - last), now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.failed = chunk["error"].get("code") or "error"
                    return
                for choice in chunk.get("choices", []):
                    out.finish = choice.get("finish_reason") or out.finish
                    if choice.get("text"):
                        out.text.append(choice["text"])
                        out.tokens += 1
                if out.tokens >= KILL_AT:
                    out.progress.set()
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.failed = type(exc).__name__
    finally:
        out.progress.set()
        out.seconds = time.monotonic() - started
    # NOTE: a sim chunk is one token; llama.cpp's may hold none or several: its answer is
    # whole when it says so (max_tokens reached), whatever its chunks
    if not out.failed and out.finish != "length":
        out.failed = f"unfinished: {out.tokens} chunks, finish {out.finish or 'none'}"


async def run_streams(f: Fleet, n: int, end: str | None, shape: tuple[int, int]) -> list[Stream]:
    """`n` streams through the router; with `end` ("kill" or "term"), one engine is ended once
    half of them have KILL_AT tokens."""
    streams = [Stream() for _ in range(n)]  # NOTE: made in the loop their events belong to
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(600)) as s:
        tasks = [asyncio.create_task(one_stream(s, f.router.url, i, st, shape))
                 for i, st in enumerate(streams)]  # fmt: skip
        if end is not None:
            # half the streams under way: the rest are still in their prefill queue, as in a
            # fleet that is never idle (the end cuts both kinds)
            waits = {asyncio.ensure_future(st.progress.wait()) for st in streams}
            while len(waits) > n - n // 2:
                _, waits = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            counts: dict[str, int] = {}
            for st in streams:  # (a stream still waiting for its first byte names none yet)
                name = st.endpoint.rsplit("/", 1)[-1]
                if name:
                    counts[name] = counts.get(name, 0) + (not st.failed and st.tokens < shape[1])
            victim = max(counts, key=lambda k: counts[k])
            os.killpg(
                f.engines[victim].proc.pid, signal.SIGKILL if end == "kill" else signal.SIGTERM
            )
            for st in streams:  # the streams the end cut (not those that had finished)
                cut = st.endpoint.endswith("/" + victim) and st.tokens < shape[1] and not st.failed
                st.endpoint = "ended" if cut else st.endpoint
        await asyncio.gather(*tasks)
    return streams


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def scenario(tmp: Path, name: str, args: argparse.Namespace, reference: list[Stream], *,
             kvcached: bool, end: str, migration: int = 3) -> dict[str, Any]:  # fmt: skip
    with fleet(tmp / name, args.speed, kvcached, migration, args.engine) as f:
        streams = asyncio.run(run_streams(f, args.streams, end, (args.prompt, args.output)))
        moved = metric(f.router.admin, "cgn_router_migrations_total", result="continued")
    ended = [s for s in streams if s.endpoint == "ended"]
    gaps = [s.max_gap_s for s in ended]
    pairs = list(zip(streams, reference, strict=True))
    same = sum(not s.failed and s.text == r.text for s, r in pairs)
    same_cut = sum(not s.failed and s.text == r.text for s, r in pairs if s.endpoint == "ended")
    return {"scenario": name, "streams": len(streams), "on_ended_engine": len(ended),
            "failed": sum(bool(s.failed) for s in streams), "continued": int(moved),
            "identical": same, "identical_cut": same_cut,
            "gap_ended_p50_s": pct(gaps, 0.5), "gap_ended_p99_s": pct(gaps, 0.99),
            "gap_all_p99_s": pct([s.max_gap_s for s in streams], 0.99),
            "failures": sorted({s.failed for s in streams if s.failed})}  # fmt: skip


async def short_load(url: str, n: int, seconds: float) -> int:
    """Completed 16-token streams in `seconds` from `n` concurrent clients."""
    done = 0
    stop = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def client(i: int) -> None:
            nonlocal done
            k = 0
            while time.monotonic() < stop:
                k += 1
                body = {"model": MODEL, "prompt": [100 + i, 200 + k % 50, 300], "max_tokens": 16,
                        "stream": True, "ignore_eos": True}  # fmt: skip
                async with s.post(url + "/v1/completions", json=body) as resp:
                    ok = resp.status == 200 and b"[DONE]" in await resp.read()
                done += ok

        await asyncio.gather(*(client(i) for i in range(n)))
    return done


def overhead(tmp: Path, args: argparse.Namespace, kind: str = "") -> dict[str, Any]:
    """Requests/s through a router with migration on and one with it off, alternating.
    `kind` "llamacpp": the sim engines declared as llama.cpp servers, so the router keeps
    every stream's events to re-tokenize them (the cost of tracking a text-only stream)."""
    with fleet(tmp / "overhead", 200.0, kvcached=False) as f:
        declared = {"engine": kind} if kind else {}
        endpoints = {n: {"url": f"http://127.0.0.1:{p}", "model": MODEL, **declared}
                     for n, p in f.ports.items()}  # fmt: skip
        models = {MODEL: {"tokenizer": str(smollm2())}} if kind else {}
        config = {"discovery": "static", "endpoints": endpoints, "log": {"level": "warning"},
                  "models": models, "breaker": {"failures": 1000}}  # fmt: skip
        for side in ("on", "off"):
            (tmp / f"overhead-{side}").mkdir(exist_ok=True)
        with ExitStack() as routers:
            on = routers.enter_context(cgn_router(tmp / "overhead-on", {**config,
                                       "migration": {"limit": 3}}))  # fmt: skip
            off = routers.enter_context(cgn_router(tmp / "overhead-off", {**config,
                                        "migration": {"limit": 0}}))  # fmt: skip
            totals = {"on": 0, "off": 0}
            for _ in range(4):
                for key, r in (("on", on), ("off", off)):
                    totals[key] += asyncio.run(short_load(r.url, args.streams, args.seconds))
    spent = 4 * args.seconds
    on_rate, off_rate = totals["on"] / spent, totals["off"] / spent
    return {"req_s_migration_on": on_rate, "req_s_migration_off": off_rate,
            "ratio": on_rate / off_rate}  # fmt: skip


def table(rows: list[dict[str, Any]], cost: dict[str, Any] | None) -> str:
    out = ["| scenario | streams the end cut | failed | continued | identical to undisturbed: "
           "all (of those cut) | longest gap p50 / p99 (ended engine's streams) | p99 (all) |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['scenario']} | {r['on_ended_engine']} of {r['streams']} | {r['failed']} "
                   f"| {r['continued']} | {r['identical']} of {r['streams']} "
                   f"({r['identical_cut']} of {r['on_ended_engine']}) "
                   f"| {r['gap_ended_p50_s'] * 1000:.0f} / {r['gap_ended_p99_s'] * 1000:.0f} ms "
                   f"| {r['gap_all_p99_s'] * 1000:.0f} ms |")  # fmt: skip
    if cost is None:
        return "\n".join(out)
    out += ["", f"Cost when nothing fails (short streams, c={cost['streams']}): "
            f"{cost['req_s_migration_on']:.0f} req/s with migration on, "
            f"{cost['req_s_migration_off']:.0f} off: ratio {cost['ratio']:.3f}."]  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--streams", type=int, default=0, help="concurrent streams (sim 64, llamacpp 32)"
    )
    ap.add_argument("--speed", type=float, default=20.0, help="sim speed (x the modelled engine)")
    ap.add_argument("--seconds", type=float, default=6.0, help="per round of the cost check")
    ap.add_argument("--cost-only", action="store_true", help="only the cost check (printed)")
    ap.add_argument("--engine", choices=("sim", "llamacpp"), default="sim")
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens (sim 1000, llamacpp 200)")
    ap.add_argument("--output", type=int, default=0, help="output tokens (sim 500, llamacpp 64)")
    args = ap.parse_args()
    llama = args.engine == "llamacpp"
    args.streams = args.streams or (32 if llama else 64)
    args.prompt = args.prompt or (200 if llama else 1000)
    args.output = args.output or (64 if llama else 500)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.cost_only:
            print(overhead(tmp, args))
            return
        with fleet(tmp / "reference", args.speed, kvcached=False, engine=args.engine) as f:
            reference = asyncio.run(run_streams(f, args.streams, None, (args.prompt, args.output)))
        assert not any(s.failed for s in reference), [s.failed for s in reference]
        took = pct([s.seconds for s in reference], 0.5)
        quiet = [s.max_gap_s for s in reference]  # the machine's own gaps, nothing ended
        if llama:
            cost = {**overhead(tmp, args, "llamacpp"), "streams": args.streams}
            rows = [
                scenario(tmp, "kill -9", args, reference, kvcached=False, end="kill"),
                scenario(tmp, "SIGTERM", args, reference, kvcached=False, end="term"),
                scenario(tmp, "kill -9, migration off", args, reference, kvcached=False,
                         end="kill", migration=0),
            ]  # fmt: skip
            command = "python -m bench.migration " + " ".join(sys.argv[1:])
            text = table(rows, cost) + (
                f"\n\nAn undisturbed stream took {took:.1f} s (median); its longest gap between "
                f"two chunks, with nothing ended, was {pct(quiet, 0.5) * 1000:.0f} / "
                f"{pct(quiet, 0.99) * 1000:.0f} ms (p50 / p99): the servers' own pauses "
                "(a prefill of a queued stream stops every stream's decode). llama.cpp's greedy "
                "output depends on what else is in its batch (so a stream nobody cut may differ "
                "from the reference run too: compare the migration-off row); a continuation "
                "starts with its prompt and answer recomputed in a batch of its own. The cost "
                "check runs sim engines declared as llama.cpp servers (the router keeps and "
                "re-tokenizes their events exactly as for llama.cpp; a real server would hide "
                "the router's cost behind its own)."
            )
            data = {"scenarios": rows, "stream_s_p50": took, "cost": cost,
                    "quiet_gap_p50_s": pct(quiet, 0.5), "quiet_gap_p99_s": pct(quiet, 0.99)}  # fmt: skip
            name = "migration_llamacpp" + ("" if args.streams == 32 else f"_{args.streams}")
            write_result(name, command.strip(), data, text)
            print(text)
            return
        rows = [
            scenario(tmp, "kill -9, restored from kvcached", args, reference, kvcached=True,
                     end="kill"),
            scenario(tmp, "kill -9, recomputed", args, reference, kvcached=False, end="kill"),
            scenario(tmp, "drain (SIGTERM after the drain timeout)", args, reference,
                     kvcached=True, end="term"),
            scenario(tmp, "kill -9, migration off", args, reference, kvcached=True, end="kill",
                     migration=0),
        ]  # fmt: skip
        cost = {**overhead(tmp, args), "streams": args.streams}
    command = "python -m bench.migration " + " ".join(sys.argv[1:])
    text = table(rows, cost) + f"\n\nAn undisturbed stream took {took:.1f} s (median)."
    data = {"scenarios": rows, "cost": cost, "stream_s_p50": took}
    write_result("migration", command.strip(), data, text)
    print(text)


if __name__ == "__main__":
    main()
