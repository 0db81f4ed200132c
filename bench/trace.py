"""Mooncake-style traces: loading, expansion into token ids, and the offline yardstick.

A trace row has `timestamp` (ms), `input_length`, `output_length` and
`hash_ids`: ids of 512-token prompt blocks, equal ids in equal positions
meaning a shared prefix. `expand()` turns each id into `blocks_per_id` of our
16-token blocks of deterministic synthetic token ids (equal ids, equal
tokens), so block reuse in the trace becomes KV reuse in the engines.

`simulate()` is an offline, block-level model of the same fleet: one LRU
block cache per engine of `capacity_blocks`, a per-engine queue of uncached
prefill work draining at `drain_tokens_per_s`, and a routing policy. With
`ideal` it is the yardstick: it knows every cache and queue exactly and sends
each request to the longest cached prefix among the engines whose queue is
within `slack_tokens` of the shortest.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK = 16
VOCAB_LO, VOCAB_SPAN = 1000, 40000  # synthetic ids stay clear of special tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float  # arrival, seconds from the start (scaled)
    hash_ids: tuple[int, ...]
    output_tokens: int


def load(path: Path, limit: int | None = None, time_scale: float = 1.0) -> list[TraceRequest]:
    """The first `limit` rows; arrival times divided by `time_scale` (>1: faster)."""
    out = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            out.append(
                TraceRequest(
                    row["timestamp"] / 1000.0 / time_scale,
                    tuple(row["hash_ids"]),
                    max(1, int(row["output_length"])),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return out


def id_tokens(hash_id: int, pos: int, blocks_per_id: int) -> list[int]:
    """The synthetic token ids one trace block id stands for (deterministic in id and position)."""
    rng = random.Random(hash_id * 1_000_003 + pos)
    return [VOCAB_LO + rng.randrange(VOCAB_SPAN) for _ in range(blocks_per_id * BLOCK)]


def expand(req: TraceRequest, blocks_per_id: int, tail: int) -> list[int]:
    """The prompt's token ids: each id's tokens, then one request-specific token.

    The tail token makes every trace block a full, storable block (an engine
    never stores the block holding the prompt's last token).
    """
    tokens: list[int] = []
    for pos, h in enumerate(req.hash_ids):
        tokens.extend(id_tokens(h, pos, blocks_per_id))
    tokens.append(VOCAB_LO + tail % VOCAB_SPAN)
    return tokens


def block_keys(req: TraceRequest, blocks_per_id: int) -> Iterator[tuple[int, ...]]:
    """Chained identities of the request's 16-token blocks (prefix, block index)."""
    for pos in range(len(req.hash_ids)):
        for j in range(blocks_per_id):
            yield (*req.hash_ids[: pos + 1], j)


@dataclass(slots=True)
class SimResult:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    uncached_by_engine: list[int] | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def busiest_over_mean(self) -> float:
        work = self.uncached_by_engine or [0]
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 0.0


def simulate(
    reqs: list[TraceRequest],
    engines: int,
    capacity_blocks: int,
    blocks_per_id: int,
    policy: str,
    drain_tokens_per_s: float,
    slack_tokens: float = 0.0,
    seed: int = 0,
) -> SimResult:
    """Offline replay of `reqs` on `engines` LRU caches under `policy`.

    policy: `round_robin`, `least_loaded` (shortest uncached-work queue) or
    `ideal` (longest cached prefix among queues within `slack_tokens` of the
    shortest; ties to the shorter queue).
    """
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    queue = [0.0] * engines
    last_t = 0.0
    res = SimResult(uncached_by_engine=[0] * engines)
    assert res.uncached_by_engine is not None
    rr = 0
    rng = random.Random(seed)
    for req in reqs:
        dt, last_t = req.at_s - last_t, req.at_s
        queue = [max(0.0, q - drain_tokens_per_s * dt) for q in queue]
        keys = [hash(k) for k in block_keys(req, blocks_per_id)]
        matched = []
        for c in caches:
            n = 0
            for k in keys:
                if k not in c:
                    break
                n += 1
            matched.append(n)
        if policy == "round_robin":
            e, rr = rr % engines, rr + 1
        elif policy == "least_loaded":
            low = min(queue)
            e = rng.choice([i for i in range(engines) if queue[i] == low])
        else:
            low = min(queue)
            ok = [i for i in range(engines) if queue[i] <= low + slack_tokens]
            e = max(ok, key=lambda i: (matched[i], -queue[i]))
        tokens = len(keys) * BLOCK
        hit = matched[e] * BLOCK
        res.prompt_tokens += tokens
        res.hit_tokens += hit
        res.uncached_by_engine[e] += tokens - hit
        queue[e] += tokens - hit
        cache = caches[e]
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return res
