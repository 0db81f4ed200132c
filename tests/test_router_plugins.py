"""Routing plugins, one table per plugin, over hand-built snapshots: exact picks, exact scores."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cgn_router.routing.chain import Policy, RoutingChain, chain_from_policy
from cgn_router.routing.plugins import FILTERS, PICKERS, SCORERS
from cgn_router.routing.plugins.affinity import AffinityScorer
from cgn_router.routing.plugins.base import build
from cgn_router.routing.plugins.kv_usage import KvUsageScorer
from cgn_router.routing.plugins.load import LoadScorer
from cgn_router.routing.plugins.picker import MaxScorePicker, PowerOfTwoPicker
from cgn_router.routing.plugins.prefix import PrefixScorer
from cgn_router.settings import RoutingSettings, ScorerSpec
from cgn_router.types import Endpoint, EndpointId, EndpointView, EngineLoad, RequestInfo, Speed

B = tuple(bytes([i]) * 32 for i in range(10))  # ten block hashes
REQ = RequestInfo("m", blocks=B, prompt_tokens=160)


def view(name: str, **kw: object) -> EndpointView:
    ep = Endpoint(EndpointId(f"m/{name}"), "m", f"http://{name}", role=str(kw.pop("role", "both")))
    kw.setdefault("load", EngineLoad(0, 0, 0, 0))
    return EndpointView(endpoint=ep, **kw)  # type: ignore[arg-type]


def ids(scores: dict[EndpointId, float]) -> dict[str, float]:
    return {k.split("/")[1]: round(v, 6) for k, v in scores.items()}


# ---- filters -------------------------------------------------------------------

FILTER_CASES = [
    # filter, request, view, kept
    ("model", REQ, view("a"), True),
    ("model", replace(REQ, model="other"), view("a"), False),
    ("role", REQ, view("a", role="both"), True),
    ("role", REQ, view("a", role="prefill"), False),
    ("role", replace(REQ, role="prefill"), view("a", role="prefill"), True),
    ("role", replace(REQ, role="prefill"), view("a", role="decode"), False),
    ("role", replace(REQ, role="decode"), view("a", role="both"), True),
    ("ready", REQ, view("a", ready=False), False),
    ("ready", REQ, view("a"), True),
    ("breaker", REQ, view("a", breaker_open=True), False),
    ("breaker", REQ, view("a"), True),
    ("cordon", REQ, view("a", cordoned=True), False),
    ("cordon", REQ, view("a"), True),
]


@pytest.mark.parametrize(("name", "req", "v", "kept"), FILTER_CASES)
def test_filter(name: str, req: RequestInfo, v: EndpointView, kept: bool) -> None:
    assert FILTERS[name]().keep(req, v) is kept


# ---- scorers -------------------------------------------------------------------

PREFIX_CASES = [
    # request, views, expected scores
    (REQ, [view("a", matched_blocks=10), view("b", matched_blocks=5), view("c")],
     {"a": 1.0, "b": 0.5, "c": 0.0}),
    (replace(REQ, blocks=()), [view("a", matched_blocks=3)], {"a": 0.0}),
    # the saturation guard: 100 tokens more pending work than the idlest: no prefix credit
    (REQ, [view("a", matched_blocks=10, pending_prefill=100), view("b", matched_blocks=4)],
     {"a": 0.0, "b": 0.4}),
    (REQ, [view("a", matched_blocks=10, pending_prefill=99), view("b")], {"a": 1.0, "b": 0.0}),
    # relative: a fleet busy everywhere still routes by cache
    (REQ, [view("a", matched_blocks=10, pending_prefill=5000), view("b", pending_prefill=4950)],
     {"a": 1.0, "b": 0.0}),
    # blocks the endpoint's node holds in cgn-kvcached count, discounted by tier (0.9, 0.8)
    (REQ, [view("a", matched_blocks=2, node_ram_blocks=4, node_ssd_blocks=4), view("b", matched_blocks=6)],
     {"a": 0.88, "b": 0.6}),
    (REQ, [view("a", node_ssd_blocks=10), view("b", matched_blocks=8)], {"a": 0.8, "b": 0.8}),
]  # fmt: skip


@pytest.mark.parametrize(("req", "views", "expected"), PREFIX_CASES)
def test_prefix_scorer(
    req: RequestInfo, views: list[EndpointView], expected: dict[str, float]
) -> None:
    assert ids(PrefixScorer(saturation_tokens=100).score(req, views).values) == expected


def test_prefix_scorer_reports_the_credit_its_guard_held_back() -> None:
    views = [view("a", matched_blocks=10, pending_prefill=100), view("b", pending_prefill=100),
             view("c")]  # fmt: skip
    assert PrefixScorer(saturation_tokens=100).score(REQ, views).held_back == 1  # b held none


LOAD_CASES = [
    ([view("a"), view("b")], {"a": 1.0, "b": 1.0}),  # all idle
    # requests only: half the score
    ([view("a", in_flight=4), view("b", in_flight=1), view("c")], {"a": 0.5, "b": 0.875, "c": 1.0}),
    # the engine's own queue counts when it is larger than the router's view
    ([view("a", in_flight=1, load=EngineLoad(3, 5, 0, 0)), view("b", in_flight=4)],
     {"a": 0.5, "b": 0.75}),
    # prefill work waiting: the other half
    ([view("a", in_flight=1, pending_prefill=3000), view("b", in_flight=1, pending_prefill=1000)],
     {"a": 0.0, "b": round(1 - (1 + 1 / 3) / 2, 6)}),
    # stale metrics: only the router's counts, and the score halved
    ([view("a", in_flight=0, load=None), view("b", in_flight=2)], {"a": 0.5, "b": 0.5}),
]  # fmt: skip


@pytest.mark.parametrize(("views", "expected"), LOAD_CASES)
def test_load_scorer(views: list[EndpointView], expected: dict[str, float]) -> None:
    assert ids(LoadScorer().score(REQ, views).values) == expected


KV_CASES = [
    ([view("a", load=EngineLoad(0, 0, 0.25, 0)), view("b", load=EngineLoad(0, 0, 1.0, 0))],
     {"a": 0.75, "b": 0.0}),
    ([view("a", load=None)], {"a": 0.0}),
    ([view("a", load=EngineLoad(0, 0, 1.5, 0))], {"a": 0.0}),  # clamped
]  # fmt: skip


@pytest.mark.parametrize(("views", "expected"), KV_CASES)
def test_kv_usage_scorer(views: list[EndpointView], expected: dict[str, float]) -> None:
    assert ids(KvUsageScorer().score(REQ, views).values) == expected


AFFINITY_CASES = [
    (replace(REQ, session="s1"), [view("a", session_owner=True), view("b")], {"a": 1.0, "b": 0.0}),
    (REQ, [view("a", session_owner=True)], {"a": 0.0}),  # no session on the request
]


@pytest.mark.parametrize(("req", "views", "expected"), AFFINITY_CASES)
def test_affinity_scorer(
    req: RequestInfo, views: list[EndpointView], expected: dict[str, float]
) -> None:
    assert ids(AffinityScorer().score(req, views).values) == expected


# ---- pickers -------------------------------------------------------------------


def test_max_picker_takes_the_best_and_breaks_ties_at_random() -> None:
    rng = random.Random(7)
    picker = MaxScorePicker()
    totals = {EndpointId("a"): 1.0, EndpointId("b"): 2.0, EndpointId("c"): 2.0}
    picks = {picker.pick(totals, rng) for _ in range(200)}
    assert picks == {"b", "c"}
    assert picker.pick({EndpointId("a"): 0.1, EndpointId("b"): 0.0}, rng) == "a"


def test_p2c_picker_never_takes_the_worst_of_three() -> None:
    rng = random.Random(7)
    picker = PowerOfTwoPicker()
    totals = {EndpointId("a"): 0.0, EndpointId("b"): 1.0, EndpointId("c"): 2.0}
    picks = [picker.pick(totals, rng) for _ in range(300)]
    assert "a" not in picks and {"b", "c"} == set(picks)
    assert picker.pick({EndpointId("only"): 0.0}, rng) == "only"


def test_registry_names_every_plugin() -> None:
    assert set(FILTERS) == {"model", "role", "ready", "breaker", "cordon"}
    assert set(PICKERS) == {"max", "p2c", "round_robin"}
    assert "time" in SCORERS


# ---- the pipeline ----------------------------------------------------------------


def policy(**prefix: float) -> Policy:
    """The default policy, the prefix scorer's parameters replaced."""
    base = Policy.from_settings(RoutingSettings())
    scorers = tuple(replace(s, params=prefix) if s.type == "prefix" else s for s in base.scorers)
    return replace(base, scorers=scorers)


def pipeline(**weights: float) -> RoutingChain:
    p = RoutingChain.build(policy(saturation_tokens=1000))
    p.set_weights(weights)
    return p


def test_pipeline_prefers_the_warm_endpoint_over_a_slightly_idler_one() -> None:
    views = [view("warm", matched_blocks=10, in_flight=2), view("cold", in_flight=1)]
    d = pipeline().route(REQ, views, random.Random(0))
    assert d.chosen == "m/warm"
    assert ids(d.scores["prefix"]) == {"warm": 1.0, "cold": 0.0}
    assert ids(d.totals) == {"warm": 3.0 + 0.5 + 0.5, "cold": 0.0 + 0.75 + 0.5}


def shared_prefix_counts(p: RoutingChain, requests: int = 40) -> dict[str, int]:
    """Route `requests` that share their 10 blocks over four replicas; none completes."""
    rng = random.Random(0)
    pending = dict.fromkeys("abcd", 0)
    held: set[str] = set()
    for _ in range(requests):
        snap = [
            replace(view(n), matched_blocks=10 if n in held else 0, pending_prefill=pending[n])
            for n in "abcd"
        ]
        name = str(p.route(REQ, snap, rng).chosen).split("/")[1]
        pending[name] += 160
        held.add(name)
    return {n: pending[n] // 160 for n in "abcd"}


def test_saturation_guard_spreads_a_shared_prefix() -> None:
    """Every request shares its first blocks: without the guard all go to one replica."""
    counts = shared_prefix_counts(pipeline())
    assert min(counts.values()) >= 4 and max(counts.values()) <= 16, counts
    unguarded = RoutingChain.build(policy(saturation_tokens=10**9))
    assert max(shared_prefix_counts(unguarded).values()) == 40


def test_pipeline_counts_filter_drops_and_reports_no_candidate() -> None:
    views = [view("a", breaker_open=True), view("b", cordoned=True), view("c", role="prefill")]
    d = pipeline().route(REQ, views, random.Random(0))
    assert d.chosen is None
    assert d.dropped == {"role": 1, "cordon": 1, "breaker": 1}


def test_zero_weight_scorers_are_skipped() -> None:
    d = pipeline(prefix=0, kv_usage=0, affinity=0).route(
        REQ, [view("a", matched_blocks=10, in_flight=3), view("b")], random.Random(0)
    )
    assert d.chosen == "m/b" and set(d.scores) == {"load"}


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"bogus": 1}, "unknown scorer 'bogus'"),
        ({"prefix": -1}, "must be a number from 0 to 1e9"),
        ({"load": "x"}, "must be a number from 0 to 1e9"),
        ({"load": True}, "must be a number from 0 to 1e9"),
    ],
)
def test_bad_weights_are_refused(weights: dict[str, object], message: str) -> None:
    p = pipeline()
    with pytest.raises(ValueError, match=message):
        p.set_weights(weights)
    assert p.weights == pipeline().weights


BUILD_ERRORS = [
    (SCORERS, "scorer", "nope", {}, "unknown scorer 'nope' \\(known: affinity, efficiency, kv_usage, load, prefix, time\\)"),
    (SCORERS, "scorer", "prefix", {"bogus": 1}, "unknown parameter 'bogus' \\(known: saturation_tokens, ram_weight, ssd_weight\\)"),
    (SCORERS, "scorer", "load", {"x": 1}, "unknown parameter 'x' \\(known: none\\)"),
    (SCORERS, "scorer", "prefix", {"saturation_tokens": 1.5}, "must be a whole number"),
    (SCORERS, "scorer", "prefix", {"saturation_tokens": 0}, "must be positive"),
    (SCORERS, "scorer", "prefix", {"ram_weight": "high"}, "must be a number"),
    (SCORERS, "scorer", "prefix", {"ssd_weight": 1.5}, "between 0 and 1"),
    (FILTERS, "filter", "gpu", {}, "unknown filter 'gpu'"),
    (PICKERS, "picker", "best", {}, "unknown picker 'best'"),
]  # fmt: skip


@pytest.mark.parametrize(("table", "kind", "type_", "params", "message"), BUILD_ERRORS)
def test_plugins_from_config_are_checked(
    table: dict[str, object], kind: str, type_: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build(table, kind, type_, "", params)  # type: ignore[arg-type]


def test_a_pipeline_is_built_from_config_through_the_registries() -> None:
    s = RoutingSettings(
        filters=("model", "breaker"),
        scorers=(ScorerSpec("prefix", 2.0, params={"saturation_tokens": 500.0}),
                 ScorerSpec("load", 1.0, name="queue")),
        picker="p2c",
    )  # fmt: skip
    p = RoutingChain.from_settings(s)
    assert [f.name for f in p.filters] == ["model", "breaker"]
    assert p.weights == {"prefix": 2.0, "queue": 1.0} and p.picker.name == "p2c"
    prefix = p.scorers[0]
    assert isinstance(prefix, PrefixScorer) and prefix.saturation_tokens == 500
    d = p.route(REQ, [view("a", cordoned=True, matched_blocks=10), view("b")], random.Random(0))
    assert d.chosen == "m/a" and set(d.scores) == {"prefix", "queue"}  # no cordon filter
    # the live policy replaces parts and keeps the rest of its base
    live = chain_from_policy({"picker": "max", "weights": {"queue": 0}}, Policy.from_settings(s))
    assert live.weights == {"prefix": 2.0, "queue": 0.0} and live.picker.name == "max"
    assert [f.name for f in live.filters] == ["model", "breaker"]


# ---- the time scorer (predicted time to first token, #57) -------------------------

FAST = Speed(overhead_s=0.02, prefill_s=1e-3, samples=50)
SLOW = Speed(overhead_s=0.2, prefill_s=1e-2, samples=50)  # ten times slower


def timed() -> RoutingChain:
    return RoutingChain.build(Policy(("model",), (ScorerSpec("time", 1.0),), "max"))


@pytest.mark.parametrize(
    ("fast_queue", "winner"),
    [
        (0, "fast"),  # 0.18 s against 1.8 s
        (1500, "fast"),  # 1.68 s: still sooner than the slow one's whole 1.8 s
        (1700, "slow"),  # 1.88 s: the fast one's wait alone exceeds the slow one's time
    ],
)
def test_a_slow_replica_gets_a_request_only_when_waiting_on_the_fast_one_is_longer(
    fast_queue: int, winner: str
) -> None:
    views = [view("fast", speed=FAST, queued_tokens=fast_queue), view("slow", speed=SLOW)]
    d = timed().route(REQ, views, random.Random(0))
    assert d.chosen == f"m/{winner}"
    assert d.predicted_ttft_s == pytest.approx(min(d.predicted_s.values()))
    assert d.view is not None and d.view.predicted_ttft_s == d.predicted_ttft_s


def test_a_cached_prefix_on_a_slow_replica_loses_to_computing_it_on_a_fast_one() -> None:
    views = [view("fast", speed=FAST), view("slow", speed=SLOW, matched_blocks=10)]
    d = timed().route(REQ, views, random.Random(0))
    assert d.chosen == "m/fast"  # 0.18 s computing it, against the slow one's 0.2 s overhead
    assert ids(d.predicted_s) == {"fast": 0.18, "slow": 0.2}
    # between equals the prefix wins: a warm replica computes nothing
    d = timed().route(REQ, [view("a", speed=FAST), view("b", speed=FAST, matched_blocks=10)],
                      random.Random(0))  # fmt: skip
    assert d.chosen == "m/b"


@pytest.mark.parametrize(
    ("kw", "uncached"),
    [
        ({}, 160.0),
        ({"matched_blocks": 4}, 96.0),
        ({"matched_blocks": 4, "node_ram_blocks": 6}, 9.6),  # RAM restores at 0.1
        ({"node_ssd_blocks": 10}, 32.0),  # SSD at 0.2
        ({"matched_blocks": 99}, 0.0),  # an index claiming more than the prompt
    ],
)
def test_the_time_scorer_counts_what_the_replica_must_compute(
    kw: dict[str, int], uncached: float
) -> None:
    from cgn_router.routing.plugins.ttft import TimeScorer

    assert TimeScorer().uncached(REQ, view("a", **kw)) == pytest.approx(uncached)


def test_predictions_are_never_zero_negative_or_nan() -> None:
    from cgn_router.routing.plugins.ttft import FLOOR_S, TimeScorer

    instant = Speed(overhead_s=0.0, prefill_s=0.0)
    got = TimeScorer().score(RequestInfo("m"), [view("a", speed=instant), view("b")])
    assert min(got.predicted_s.values()) == FLOOR_S and 0 < min(got.values.values()) <= 1


@pytest.mark.parametrize(
    ("lag", "winner"),
    [
        (1.0, "cold"),  # priced at its peers' speed: 0.18 s against 0.68 s
        (3.0, "cold"),  # its oldest stream 3x late: 0.54 s, still sooner
        (4.0, "warm"),  # 0.72 s: the warm one's wait is now the shorter
    ],
)
def test_a_replica_running_late_is_priced_by_its_lag(lag: float, winner: str) -> None:
    """A cold replica takes its peers' speed until its answers teach its own; its oldest
    waiting stream's lateness says it is slower before any answer does."""
    views = [view("cold", speed=FAST, lag=lag), view("warm", speed=FAST, queued_tokens=500)]
    d = timed().route(REQ, views, random.Random(0))
    assert d.chosen == f"m/{winner}"
    assert d.predicted_s["m/cold"] == pytest.approx(0.18 * lag)


UNTRIED = Speed(overhead_s=0.02, prefill_s=1e-3)  # its peers' median, no sample of its own


@pytest.mark.parametrize(
    ("untried_in_flight", "warm_queue", "winner"),
    [
        (0, 500, "untried"),  # idle: priced at its peers' speed, 0.18 s against 0.68 s
        (1, 500, "warm"),  # busy and untried: held back, however long the warm one's wait
        (1, 50_000, "warm"),
    ],
)
def test_an_untried_replica_beside_learned_ones_takes_one_request_at_a_time(
    untried_in_flight: int, warm_queue: int, winner: str
) -> None:
    views = [
        view("untried", speed=UNTRIED, in_flight=untried_in_flight),
        view("warm", speed=FAST, queued_tokens=warm_queue),
    ]
    d = timed().route(REQ, views, random.Random(0))
    assert d.chosen == f"m/{winner}"
    assert d.predicted_s["m/untried"] == pytest.approx(0.18)  # its prediction stays honest


def test_untried_replicas_are_not_held_back_when_none_has_learned() -> None:
    """A fleet starting: every replica untried and busy; the predictions decide as ever."""
    views = [
        view("a", speed=UNTRIED, in_flight=2, queued_tokens=800),
        view("b", speed=UNTRIED, in_flight=2),
    ]
    d = timed().route(REQ, views, random.Random(0))
    assert d.chosen == "m/b"
    assert ids(d.scores["time"]) == {"a": pytest.approx(0.18 / 0.98, abs=1e-6), "b": 1.0}


def test_equal_predictions_are_broken_as_any_tie() -> None:
    chosen = {
        timed().route(REQ, [view("a"), view("b")], random.Random(i)).chosen for i in range(20)
    }
    assert chosen == {"m/a", "m/b"}
