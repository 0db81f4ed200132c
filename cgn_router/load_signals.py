"""What the autoscaler reads from the router it runs in (cgn_control/decide/scaling.py, `Signals`).

The leader of the control loop is a router, and a router already knows the
fleet's load: each replica's running and waiting requests (scraped from its
/metrics every `scrape.interval_s`; this router's own requests in flight
where no fresh page is known), how long each has been routable, its own
time to first token per model, and the requests it could not route because
no replica of the model exists (a pool at `min: 0`); each replica's speed as
the router learned it (routing/speed.py) and each model's answers' mean
uncached prompt and output tokens, so that the autoscaler counts in tokens per
second. Nothing here blocks: `signals()` reads what is in memory.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from cgn_control.decide.scaling import ReplicaLoad, ReplicaSpeed, Signals
from cgn_router.registry import Registry
from cgn_router.routing.lifecycle import AttemptEnded, Record, Unrouted

WINDOW_S = 60.0  # latencies and unrouted requests count for this long
LEARNED_SAMPLES = 3  # a speed fitted from fewer answers is too noisy to size a pool by
MAX_SAMPLES = 4096  # per model: the most recent ones


@dataclass
class Window:
    """Recent values per model (time, value), bounded in age and in count."""

    points: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)

    def add(self, model: str, value: float, now: float | None = None) -> None:
        if not math.isfinite(value) or value < 0:
            return
        ring = self.points.setdefault(model, deque(maxlen=MAX_SAMPLES))
        ring.append((time.monotonic() if now is None else now, value))

    def recent(self, model: str, now: float) -> list[float]:
        ring = self.points.get(model)
        if ring is None:
            return []
        while ring and ring[0][0] < now - WINDOW_S:
            ring.popleft()
        return [v for _, v in ring]

    def p90(self, now: float) -> dict[str, float]:
        out = {}
        for model in list(self.points):
            values = sorted(self.recent(model, now))
            if values:
                out[model] = values[min(len(values) - 1, int(0.9 * len(values)))]
        return out

    def means(self, now: float) -> dict[str, float]:
        out = {}
        for model in list(self.points):
            values = self.recent(model, now)
            if values:
                out[model] = sum(values) / len(values)
        return out

    def counts(self, now: float) -> dict[str, int]:
        return {m: n for m in list(self.points) if (n := len(self.recent(m, now)))}


def replica_of(eid: str, node: str) -> str:
    """The placement's replica id in an endpoint id `<model>/<node>.<replica>` (or
    `<model>/<replica>` for one registered by hand)."""
    tail = eid.split("/", 1)[-1]
    return tail[len(node) + 1 :] if node and tail.startswith(node + ".") else tail


@dataclass
class LoadSignals:
    registry: Registry
    ttft: Window = field(default_factory=Window)
    unrouted: Window = field(default_factory=Window)  # requests no replica existed for
    prompts: Window = field(default_factory=Window)  # answers' uncached prompt tokens
    outputs: Window = field(default_factory=Window)  # answers' output tokens

    def signals(self) -> Signals:
        now = time.monotonic()
        replicas = []
        for eid, state in list(self.registry.states.items()):
            speed = self.registry.speed(state, now)
            learned = None
            if speed.samples >= LEARNED_SAMPLES:
                learned = ReplicaSpeed(speed.overhead_s, speed.prefill_s, speed.decode_s,
                                       speed.per_batch_s)  # fmt: skip
            load = self.registry.fresh_load(state, now)
            running = load.running if load is not None else float(state.in_flight)
            waiting = load.waiting if load is not None else 0.0
            replicas.append(
                ReplicaLoad(
                    model=state.endpoint.model,
                    role=state.endpoint.role,
                    replica=replica_of(eid, state.endpoint.node),
                    running=running,
                    waiting=waiting,
                    in_flight=state.in_flight,
                    ready_for_s=now - state.since,
                    cached_blocks=self.registry.index.exact_size(eid),
                    speed=learned,
                )
            )
        prompts, outputs = self.prompts.means(now), self.outputs.means(now)
        return Signals(
            replicas=tuple(replicas),
            ttft_p90_s=self.ttft.p90(now),
            waiting_at_router=self.unrouted.counts(now),
            shape={m: (prompts[m], outputs[m]) for m in prompts.keys() & outputs.keys()},
        )


class LoadObserver:
    """What the autoscaler learns from every request's records (routing/lifecycle.py): the
    time to each client's first byte, per model (its SLO signal), each answer's uncached
    prompt and output tokens (its shape), and the requests no replica existed for."""

    def __init__(self, load: LoadSignals):
        self.load = load

    def observe(self, record: Record) -> None:
        if isinstance(record, AttemptEnded):
            if record.first_byte_s is not None and record.leg == "client":
                self.load.ttft.add(record.model, record.first_byte_s)
            usage = record.usage
            if usage is not None and record.leg == "client" and record.outcome == "ok":
                uncached = usage.prompt_tokens - usage.cached_tokens
                self.load.prompts.add(record.model, float(max(0, uncached)))
                self.load.outputs.add(record.model, float(usage.completion_tokens))
        elif isinstance(record, Unrouted):
            self.load.unrouted.add(record.model, 1.0)
