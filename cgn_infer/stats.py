"""What the engine thread reports, as values (vLLM's IterationStats and FinishedRequestStats).

The engine counts nothing itself. Each model step it makes one `StepStats`; after
each turn of its loop, one `QueueStats`; and each finished job carries a `JobStats`
on its FinishEvent. They are consumed on the event loop's side: the Prometheus
metrics (`metrics.EngineMetrics.observe` and `.finished`) and each request's
generation trace (`trace.GenerationTrace.generated`). A step's stats are handed
over before its tokens are, so /metrics never lags an answer a client has.
"""

from __future__ import annotations

from typing import NamedTuple

Tiers = tuple[tuple[str, int], ...]  # (tier, prompt tokens restored from it)


class PromptStats(NamedTuple):
    """A request's prompt, counted at its first step."""

    tokens: int  # looked up in the prefix cache
    hits: int  # found in the engine's pool (not restored)
    restored: Tiers  # restored from the node's KV store, by tier


class StepStats(NamedTuple):
    """One model step (`sequences` 0: a turn that only preempted)."""

    sequences: int
    prefill_computed: int  # prompt tokens run through the model
    preempted: int
    prompts: tuple[PromptStats, ...]  # the requests whose first step this was
    first_tokens: tuple[float, ...]  # seconds from each request's arrival to its first token
    gaps: tuple[float, ...]  # seconds between a request's tokens


class QueueStats(NamedTuple):
    """The engine's queue and pool after a turn of its loop."""

    running: int
    waiting: int
    kv_usage: float  # 0-1


class JobStats(NamedTuple):
    """A finished job, on its FinishEvent. Times are time.monotonic(); None: not reached."""

    reason: str  # stop | length | cancelled | error
    enqueued: float
    finished: float
    first_step_at: float | None
    first_token_at: float | None
    prefill_steps: int  # steps that ran prompt tokens of it
    restored: Tiers


Stats = StepStats | QueueStats
