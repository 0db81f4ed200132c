"""Routing by predicted time (#57) end to end: a real router with the `time` scorer over real
cgn-infer sim engines of unequal speed learns each one's speed from its answers, and a
replica twenty times slower than its peers gets a share of the requests near its share of
the capacity, not a third of them; every answer says what was predicted for it. (Streams:
a whole answer's first byte is its last, so only a stream shows its time to first token.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from cgn_router import legs
from cgn_router.proxy import AttemptFailed
from cgn_router.registry import Registry
from cgn_router.routing.chain import Decision, Policy, RoutingChain
from cgn_router.routing.kv_index import PrefixIndex
from cgn_router.routing.speed import Sample
from cgn_router.sessions import Sessions
from cgn_router.settings import BreakerSettings, ScorerSpec
from cgn_router.types import Endpoint, EndpointId, RequestInfo
from harness.metrics import metric
from harness.procs import cgn_infer, cgn_infer_fleet, cgn_router

MODEL = "sim"
SIM = ("--backend", "sim", "--model-name", MODEL, "--max-batch", "4")


def test_a_twenty_times_slower_replica_gets_its_share_and_answers_say_their_prediction(
    tmp_path: Path,
) -> None:
    with (
        cgn_infer_fleet(tmp_path, 1, *SIM, "--speed", "20", "--engines", "2") as fast,
        cgn_infer(tmp_path, *SIM, "--speed", "1") as slow,
    ):
        urls = {"fast0": fast[0], "fast1": fast[1], "slow": slow}
        config = {
            "discovery": "static",
            "endpoints": {name: {"url": url, "model": MODEL} for name, url in urls.items()},
            "routing": {"scorers": [{"type": "time", "weight": 1.0}], "picker": "max"},
        }
        with cgn_router(tmp_path, config) as router:

            def ask(i: int) -> tuple[int, str]:  # (predicted ms, the endpoint that answered)
                body = {"model": MODEL, "prompt": f"request {i} " + "word " * (20 + i % 40),
                        "max_tokens": 16, "ignore_eos": True, "stream": True}  # fmt: skip
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and "data: [DONE]" in r.text, r.text[:300]
                predicted = r.headers["x-cognitora-predicted-ttft-ms"]
                assert predicted.isdigit(), predicted
                return int(predicted), r.headers.get("x-cognitora-endpoint", "")

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(90)))
            # signed buckets: Prometheus exports no _count for them, the +Inf bucket counts
            errors = metric(router.admin, "cgn_router_prediction_error_seconds_bucket", le="+Inf")
            listed = httpx.get(router.admin + "/endpoints", timeout=10).json()["endpoints"]
            speeds = {e["id"].split("/")[-1]: e["speed"] for e in listed}
            # and as metrics a scraper reads: the same fits (one fit per SPEED_READ_S)
            for name, speed in speeds.items():
                endpoint = f"{MODEL}/{name}"
                learned = metric(router.admin, "cgn_router_endpoint_speed_learned",
                                 endpoint=endpoint)  # fmt: skip
                decode = metric(router.admin, "cgn_router_endpoint_decode_seconds_per_token",
                                endpoint=endpoint)  # fmt: skip
                assert learned == float(speed["warm"]) and decode > 0, (name, speed)
            # every answer is in: nothing left on the drain clock, and none running late
            assert [(e["queued_tokens"], e["lag"]) for e in listed] == [(0, 1.0)] * 3, listed
            explained = explain_route(router.admin)
    assert explained["chosen"] != f"{MODEL}/slow"
    assert len(answers) == 90
    routed = Counter(endpoint.split("/")[-1] for _, endpoint in answers)
    # capacity: the slow replica is 1/41 of the fleet (2.4 %), and its share tracks that,
    # with room for the first requests, sent before anything is learned: round-robin gives
    # it a third, today's queue-based default chain 8 or 9 of these 90 (it looks as good as the
    # others whenever its queue is as short). NOTE: 20x, not 10x: the sim engines sleep
    # their modelled time, and on a loaded machine (CI) the CPU time around it, the same
    # for every replica, brought a 10x ratio down to a few x, earning the slow one more
    assert routed["slow"] <= 5, routed
    assert errors >= 80  # answered attempts with a prediction are measured against it
    # what was learned, as /endpoints shows it: the fast pair warm, and the slow replica
    # (warm from its few answers, or its model's typical speed) never predicted faster
    assert speeds["fast0"]["warm"] and speeds["fast1"]["warm"], speeds

    def ttft_ms(s: dict[str, float]) -> float:  # a typical request's: ~60 prompt tokens
        return s["overhead_ms"] + 60 * s["prefill_ms_per_token"]

    # NOTE: a fit from one or two answers is noise on a loaded machine (CI): compared once
    # learned (3 answers), as the router itself trusts it, and against the better fast one
    if speeds["slow"]["samples"] >= 3:
        fast_ms = min(ttft_ms(speeds[f]) for f in ("fast0", "fast1"))
        assert ttft_ms(speeds["slow"]) > 2 * fast_ms, speeds


def explain_route(admin: str) -> dict[str, object]:
    """POST /debug/route: every candidate's predicted time, term by term, and the winner;
    a body that is not a request's is a 400 naming what is wrong, a model nothing serves
    a 404. Returns the explanation of a typical prompt."""
    url = admin + "/debug/route"
    body = {"model": MODEL, "prompt": "request 7 " + "word " * 40}
    got = httpx.post(url, json=body, timeout=10).json()
    rows = {row["id"]: row for row in got["candidates"]}
    assert set(rows) == {f"{MODEL}/{n}" for n in ("fast0", "fast1", "slow")}, rows
    assert got["prompt_tokens"] > 40 and rows[got["chosen"]]["chosen"]
    for row in rows.values():
        terms = row["terms_ms"]
        assert sum(terms.values()) == pytest.approx(row["predicted_ttft_ms"], abs=0.5), row
        assert row["scores"]["time"] > 0 and row["dropped_by"] is None
    best = min(rows.values(), key=lambda r: r["predicted_ttft_ms"])
    assert rows[got["chosen"]]["predicted_ttft_ms"] == best["predicted_ttft_ms"]  # picker max
    for bad, status, said in (
        ({**body, "max_tokens": 3}, 400, "max_tokens"),
        ({"model": MODEL}, 400, "one of 'prompt'"),
        ({**body, "model": "nothing"}, 404, "nothing"),
        ("[" * 5000, 400, "nests deeper"),
        ("{model", 400, "JSON"),
    ):
        r = httpx.post(url, content=bad if isinstance(bad, str) else None,
                       json=None if isinstance(bad, str) else bad, timeout=10)  # fmt: skip
        assert r.status_code == status and said in r.json()["error"]["message"], r.text[:300]
    return got


# ---- moving a stream that waits too long for its first token (#57, part 3) ------------


class Routes:
    """What `legs._moved_when_late` asks of the router service: its registry, and the
    chain's decision over it (a real registry and a real `time` chain, no process)."""

    def __init__(self) -> None:
        self.registry = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), 5)
        for name in ("slow", "fast"):
            self.registry.upsert(Endpoint(EndpointId(f"m/{name}"), "m", f"http://{name}"), "etcd")
        self.chain = RoutingChain.build(Policy(("model",), (ScorerSpec("time", 1.0),), "max"))

    def route(self, req: RequestInfo, tried: frozenset[EndpointId]) -> Decision:
        views = self.registry.views(req, time.monotonic(), tried)
        return self.chain.route(req, views, random.Random(0))


@pytest.mark.parametrize(
    ("fast_busy_tokens", "first_byte", "moved"),
    [
        (0, False, True),  # waited 4x its prediction, the fast one idle: moved there
        (200_000, False, False),  # the fast one predicts longer than it has waited: stays
        (0, True, False),  # it has its first token: never moved
        (-1, False, False),  # its replica's speed is learned: a late stream is queueing
    ],
)
def test_a_stream_late_for_its_first_token_is_moved_where_it_starts_sooner(
    monkeypatch: pytest.MonkeyPatch, fast_busy_tokens: int, first_byte: bool, moved: bool
) -> None:
    monkeypatch.setattr(legs, "MOVE_MIN_S", 0.05)
    monkeypatch.setattr(legs, "MOVE_CHECK_S", 0.01)
    svc = Routes()
    req = RequestInfo("m", prompt_tokens=20)  # 0.04 s at the default speed
    reg, now = svc.registry, time.monotonic()
    if fast_busy_tokens > 0:  # 200 s of prefill queued there
        busy = RequestInfo("m", prompt_tokens=fast_busy_tokens)
        reg.begin(reg.views(busy, now, frozenset({EndpointId("m/slow")}))[0], busy, now)
    slow = reg.views(req, now, frozenset({EndpointId("m/fast")}))[0]
    lease = reg.begin(slow, req, now, streamed=True)
    if first_byte:
        lease.first_byte(now)
    if fast_busy_tokens < 0:
        for _ in range(legs.MOVE_UNLEARNED):
            reg.learn(slow.id, Sample(20, 0.04, 2, 0.03, 1), now)
    relaying = asyncio.sleep(0.5, result="answered")  # an engine with no first token for 0.5 s

    async def run() -> object:
        tried = frozenset({slow.id})
        return await legs._moved_when_late(svc, req, slow, lease, relaying, tried)  # type: ignore[arg-type]

    started = time.monotonic()
    if moved:
        with pytest.raises(AttemptFailed) as got:
            asyncio.run(run())
        assert got.value.cause == "moved" and not got.value.breaker
        assert "m/fast predicts" in got.value.message
        assert time.monotonic() - started < 0.4  # at 4x 0.04 s, not the engine's 0.5 s
    else:
        assert asyncio.run(run()) == "answered"


def test_a_moved_stream_teaches_its_replica_the_wait_as_a_lower_bound() -> None:
    """A cold replica is guessed at its peers' speed; a stream moved off it for lateness
    (no first token in 3 s where 0.05 s was predicted) teaches it that time, so the next
    request does not take it for as fast as its peers (it had nothing else to learn from:
    none of its streams reached a first token)."""
    svc = Routes()
    reg, now = svc.registry, time.monotonic()
    fast = EndpointId("m/fast")
    for i in range(5):  # the fast peer learned: the slow one is guessed at its speed
        reg.learn(fast, Sample(20 + 40 * i, 0.01 + 0.002 * i, 8, 0.08, 1), now + i)
    req = RequestInfo("m", prompt_tokens=40)
    slow = reg.views(req, now + 5, frozenset({fast}))[0]
    guessed = slow.speed.ttft(40)
    lease = reg.begin(slow, req, now + 5, streamed=True)
    assert lease.late() is None  # still holding the endpoint
    lease.end("failed", now + 8)  # moved after 3 s without a first token
    late = lease.late()
    assert late is not None and late.ttft_s == pytest.approx(3.0) and late.output_tokens == 0
    assert reg.learn(slow.id, late, now + 8)
    learned = reg.speed(reg.states[slow.id], now + 10)
    assert learned.warm and learned.ttft(40) > 20 * guessed, (guessed, learned)


def test_requests_whose_predicted_ttft_misses_the_slo_wait_at_the_router(tmp_path: Path) -> None:
    """One engine that runs one request at a time, its model's TTFT SLO shorter than two
    requests' time: once its speed is learned, a burst is held at the router and sent one
    by one as the engine frees (cgn_router/hold.py), not queued on the engine; all answer."""
    with cgn_infer(tmp_path, "--backend", "sim", "--model-name", MODEL, "--max-batch", "1",
                   "--speed", "2") as url:  # fmt: skip
        config = {
            "discovery": "static",
            "endpoints": {"only": {"url": url, "model": MODEL}},
            "models": {MODEL: {"ttft_slo_ms": 300}},
            "routing": {
                "scorers": [{"type": "time", "weight": 1.0}],
                "picker": "max",
                "hold_for_slo": True,
            },
        }
        with cgn_router(tmp_path, config) as router:

            def ask(i: int) -> httpx.Response:
                body = {"model": MODEL, "prompt": f"request {i} " + "word " * 30,
                        "max_tokens": 8, "ignore_eos": True, "stream": True}  # fmt: skip
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and "data: [DONE]" in r.text, r.text[:300]
                return r

            for i in range(4):  # one at a time: its speed learned, nothing held
                assert "x-cognitora-held-ms" not in ask(i).headers
            # bursts: the first teaches what a request waits behind others there, the next
            # are held (a request is never held where nothing is in flight)
            burst: list[httpx.Response] = []
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                for start in (10, 20, 30):
                    burst += pool.map(ask, range(start, start + 6))
            held = [int(r.headers["x-cognitora-held-ms"]) for r in burst
                    if "x-cognitora-held-ms" in r.headers]  # fmt: skip
            released = metric(router.admin, "cgn_router_held_seconds_count", model=MODEL,
                              result="released")  # fmt: skip
    predicted = [r.headers.get("x-cognitora-predicted-ttft-ms") for r in burst]
    assert held and max(held) > 0, predicted
    assert released == len(held)
