"""Whether a request is split into a prefill leg and a decode leg (pure; table-tested).

Disaggregation does not raise throughput: it keeps a long prefill off the
decode replica, whose running streams would otherwise stall behind it, and
lets each pool be sized on its own. So a request is split only when

    the model has a prefill pool            (else: no_prefill_pool)
    and P/D is on                           (else: disabled)
    and the prompt's uncached part on the
        chosen decode replica is long       (else: short_prompt; pd.min_uncached_tokens)
    and, where the routing chain predicts time (a `time` scorer, #57):
        splitting costs less time           (else: predicted_slower; `Costs`)
    or, where it does not:
        a prefill replica can take it now   (else: prefill_busy; pd.max_prefill_queue
                                             requests running or waiting there, or none)

The time a choice costs is what it costs every request it touches, in seconds:

    aggregated = start(D) + compute(D) · (1 + decoding(D))
    split      = ttft(P) + transfer + start(D) + compute(P) · decoding(P)

`ttft(X)`: the chain's predicted time to this request's first token on X, its queue
included; `start(D)`: the decode replica's prediction without computing the prompt (its
queue, its overhead); `compute(X)`: X computing the uncached prompt at its learned
prefill speed, slowed by its lag (the decode replica no faster than the prefill one: its
speed was learned from the short prompts it kept); `decoding(X)`: the streams X has in
flight, each of which that compute stalls (none on a prefill-role replica: nothing
decodes there); `transfer`: `pd.transfer_s_per_token` per uncached token. An idle
decode replica computes a prompt as soon as an equal prefill replica would, and keeps
it; a decode replica with streams running hands it to the prefill pool, unless the
prefill replica is so much slower or busier that its wait outweighs every stall it saves.

The reason is a label of `cgn_router_pd_decisions_total` and the value of the
response's `x-cognitora-pd` header.
"""

from __future__ import annotations

from dataclasses import dataclass

from cgn_router.settings import PdSettings
from cgn_router.types import EndpointView


@dataclass(frozen=True, slots=True)
class Split:
    split: bool
    reason: str  # "split", or why not


@dataclass(frozen=True, slots=True)
class Costs:
    """The seconds each choice costs every request it touches (the module docstring)."""

    aggregated_s: float
    split_s: float


def costs(
    decode: EndpointView, prefill: EndpointView, uncached_tokens: int, transfer_s_per_token: float
) -> Costs | None:
    """Both choices' costs, from the chain's predictions (None: it made none)."""
    if decode.predicted_ttft_s is None or prefill.predicted_ttft_s is None:
        return None
    there = _compute(prefill, prefill.speed.prefill_s, uncached_tokens)
    # a decode replica's prefill speed is learned from what it computed: in a P/D fleet, short
    # prompts, whose slope is no estimate of a long one's (priced at its own, 4 of 6 bursts
    # in bench/results/pd_mixed.md were computed there, stalling its streams 6 s at p99); so
    # it is taken to compute no faster than the prefill replica
    slowest = max(decode.speed.prefill_s, prefill.speed.prefill_s)
    here = _compute(decode, slowest, uncached_tokens)
    own = _compute(decode, decode.speed.prefill_s, uncached_tokens)  # in its prediction
    start = max(0.0, decode.predicted_ttft_s - own)
    return Costs(
        aggregated_s=start + here * (1 + _decoding(decode)),
        split_s=prefill.predicted_ttft_s
        + transfer_s_per_token * uncached_tokens
        + start
        + there * _decoding(prefill),
    )


def _compute(v: EndpointView, prefill_s: float, tokens: int) -> float:
    return prefill_s * max(0, tokens) * max(1.0, v.lag)


def _decoding(v: EndpointView) -> int:
    return 0 if v.endpoint.role == "prefill" else max(0, v.in_flight)


def decide(
    s: PdSettings,
    *,
    prefill_pool: bool,
    uncached_tokens: int,
    prefill_queue: int | None,
    predicted: Costs | None = None,
) -> Split:
    """`prefill_queue`: requests running and waiting on the best prefill candidate (the
    router's own in-flight count where the engine's is unknown); None: no candidate.
    `predicted`: both choices' costs where the chain predicts time (`costs`)."""
    if not prefill_pool:
        return Split(False, "no_prefill_pool")
    if not s.enabled:
        return Split(False, "disabled")
    if uncached_tokens < s.min_uncached_tokens:
        return Split(False, "short_prompt")
    if predicted is not None:
        if predicted.split_s < predicted.aggregated_s:
            return Split(True, "split")
        return Split(False, "predicted_slower")
    if prefill_queue is None or prefill_queue > s.max_prefill_queue:
        return Split(False, "prefill_busy")
    return Split(True, "split")
