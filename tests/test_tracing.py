"""OpenTelemetry traces through a real router and real engines, into an OTLP/gRPC receiver.

Two sim engines (a prefill and a decode replica of one model) on one cgn-kvcached, and
a router, all with tracing on at 100 %, export to an in-process receiver speaking the
real OTLP/gRPC protocol (harness/otlp.py). A second router exports to a port where nothing listens.
Checked: one trace per request, router to engine, with the expected parents and
attributes; a client's `traceparent` continued; both P/D legs under one trace; a
restore's Get in kvcached under the engine's restore; an
unsampled trace dropped unless it failed; nothing that names a key or the prompt;
an unreachable collector costs no request anything and its drops are counted.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cgn_core.etcd.local import free_port
from cgn_router.routing.chain import Decision
from cgn_router.trace import PREDICTED_CANDIDATES, predictions
from cgn_router.types import EndpointId
from harness.metrics import metric
from harness.otlp import Receiver, Span, receiver
from harness.poll import until
from harness.procs import Router, cgn_infer_engines, cgn_kvcached, cgn_router

MODEL = "sim"
SECRET = "sk-never-in-a-span-" + secrets.token_hex(4)


@dataclass(frozen=True, slots=True)
class Fleet:
    rx: Receiver
    router: Router  # traced
    lost_router: Router  # its collector is down
    prefill: str  # the engines' URLs
    decode: str
    kvcached: str  # its admin URL (/metrics)


def tracing(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"enabled": True, "endpoint": endpoint, "sample_ratio": 1.0, "export_every_s": 0.1,
            **extra}  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("tracing")
    with ExitStack() as stack:
        rx = stack.enter_context(receiver())
        sets = [f"tracing.{k}={v}" for k, v in tracing(rx.url).items()]
        kv = stack.enter_context(cgn_kvcached(tmp, *(a for s in sets for a in ("--set", s))))
        argv = ["--backend", "sim", "--speed", "200", "--model-name", MODEL, *kv.engine_args]
        for s in sets:
            argv += ["--set", s]
        prefill, decode = stack.enter_context(cgn_infer_engines(tmp, 2, *argv))
        config = {
            "discovery": "static",
            "models": {MODEL: {"tokenizer": "smollm2"}},
            "endpoints": {"p": {"url": prefill.url, "model": MODEL, "role": "prefill"},
                          "d": {"url": decode.url, "model": MODEL, "role": "decode"}},
            "pd": {"min_uncached_tokens": 256, "prefill_timeout_s": 5},
            "tracing": tracing(rx.url),
        }  # fmt: skip
        router = stack.enter_context(cgn_router(tmp, config))
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        lost = {**config, "tracing": tracing(dead, queue_spans=16, export_timeout_s=0.5)}
        lost_router = stack.enter_context(cgn_router(tmp, lost))
        yield Fleet(rx, router, lost_router, prefill.url, decode.url, kv.admin)


def chat(
    router: Router, text: str, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            "temperature": 0, **extra}  # fmt: skip
    auth = {"Authorization": f"Bearer {SECRET}", **(headers or {})}
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)


def trace_of(rx: Receiver, engine_spans: int = 1) -> Any:
    """A finder: the trace holding a router root and `engine_spans` engine roots, whole."""

    def find(spans: list[Span]) -> list[Span] | None:
        for root in spans:
            if root.service == "cgn-router" and root.kind == "server":
                trace = [s for s in spans if s.trace_id == root.trace_id]
                engines = [s for s in trace if s.service == "cgn-infer" and s.kind == "server"]
                decodes = [s for s in trace if s.service == "cgn-infer" and s.name == "decode"]
                if len(engines) == engine_spans and len(decodes) >= 1:
                    return trace
        return None

    return find


def one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def test_a_request_is_one_trace_from_the_router_to_the_engines_last_token(
    fleet: Fleet,
) -> None:
    rx, router = fleet.rx, fleet.router
    prompt = "a question only this test asks " + secrets.token_hex(4)
    sent_ns = time.time_ns()
    resp = chat(router, prompt)
    assert resp.status_code == 200, resp.text
    spans = rx.wait("the request's trace", lambda s: trace_of(rx)(_since(s, sent_ns)))
    root = one(spans, "cgn-router", f"chat {MODEL}")
    assert root.parent_id == "" and root.kind == "server" and not root.error
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.response.model"] == MODEL and attrs["http.response.status_code"] == 200
    assert 0 < attrs["gen_ai.server.time_to_first_token"] < 30
    assert attrs["gen_ai.usage.output_tokens"] == resp.json()["usage"]["completion_tokens"]
    for name in ("admission", "upstream"):
        assert one(spans, "cgn-router", name).parent_id == root.span_id, name
    # two decisions: the decode replica, then whether a prefill replica takes the prompt (this
    # one is too short to split: aggregated, see x-cognitora-pd)
    routes = {s.attributes["cognitora.route.role"]: s for s in spans if s.name == "route"}
    assert routes.keys() == {"decode", "prefill"}
    assert all(s.parent_id == root.span_id for s in routes.values())
    decode = routes["decode"].attributes
    assert (
        decode["cognitora.route.endpoint"] == "sim/d" and decode["cognitora.route.candidates"] == 1
    )
    assert routes["prefill"].attributes["cognitora.route.endpoint"] == "sim/p"
    assert "cognitora.route.predicted_ttft_s" not in decode  # no time scorer in the chain
    assert resp.headers["x-cognitora-pd"].startswith("aggregated")
    upstream = one(spans, "cgn-router", "upstream")
    assert upstream.kind == "client" and upstream.attributes["cognitora.outcome"] == "ok"
    engine = one(spans, "cgn-infer", f"chat {MODEL}")
    assert engine.parent_id == upstream.span_id  # the traceparent went upstream
    for name in ("prepare", "queue", "prefill", "decode"):
        span = one(spans, "cgn-infer", name)
        assert span.parent_id == engine.span_id and span.start_ns <= span.end_ns, name
    prefill = one(spans, "cgn-infer", "prefill").attributes
    assert prefill["cognitora.prefill.tokens_computed"] > 0
    assert one(spans, "cgn-infer", "decode").attributes["gen_ai.usage.output_tokens"] == 3
    # nothing names the key or repeats the prompt
    for span in spans:
        for value in span.attributes.values():
            assert SECRET not in str(value) and prompt not in str(value), (span.name, value)


def _since(spans: list[Span], sent_ns: int) -> list[Span]:
    """The spans of the traces whose router root started after `sent_ns` (the request this
    test sent, with no traceparent: the router started its trace)."""
    ids = {s.trace_id for s in spans if s.service == "cgn-router" and s.parent_id == ""
           and s.start_ns >= sent_ns}  # fmt: skip
    return [s for s in spans if s.trace_id in ids]


def test_a_clients_traceparent_is_continued(fleet: Fleet) -> None:
    rx, router = fleet.rx, fleet.router
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    resp = chat(router, "continue my trace", {"traceparent": f"00-{trace_id}-{parent}-01"})
    assert resp.status_code == 200, resp.text
    spans = rx.wait("the continued trace", lambda _: trace_of(rx)(rx.trace(trace_id)))
    assert one(spans, "cgn-router", f"chat {MODEL}").parent_id == parent


def test_a_route_span_carries_the_time_scorers_predictions_soonest_first() -> None:
    chosen = EndpointId("m/e3")
    predicted = {EndpointId(f"m/e{i}"): 0.5 + abs(i - 3) / 10 for i in range(12)}
    got = predictions(Decision(chosen, predicted_s=predicted))
    assert got["cognitora.route.predicted_ttft_s"] == 0.5
    assert got["cognitora.route.candidates.endpoint"][:3] == ["m/e3", "m/e2", "m/e4"]
    assert len(got["cognitora.route.candidates.predicted_ttft_s"]) == PREDICTED_CANDIDATES
    assert got["cognitora.route.candidates.predicted_ttft_s"][:2] == [0.5, 0.6]


def test_a_disaggregated_request_shows_both_legs_under_one_trace(
    fleet: Fleet,
) -> None:
    rx, router = fleet.rx, fleet.router
    trace_id = secrets.token_hex(16)
    long = "the context goes on and on " * 60 + secrets.token_hex(4)
    resp = chat(router, long, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert resp.headers["x-cognitora-pd"].startswith("disaggregated"), resp.headers
    spans = rx.wait("both legs", lambda _: trace_of(rx, engine_spans=2)(rx.trace(trace_id)))
    leg = one(spans, "cgn-router", "prefill leg")
    upstream = one(spans, "cgn-router", "upstream")
    roots = {s.parent_id for s in spans if s.service == "cgn-infer" and s.kind == "server"}
    assert roots == {leg.span_id, upstream.span_id}
    restores = [s.attributes for s in spans if s.name == "kv restore"]
    assert any(r["cognitora.kv.blocks"] > 0 and "fetched" in r.get("cognitora.kv.transfer", "")
               for r in restores), restores  # fmt: skip


def test_a_restore_from_kvcached_shows_its_get_under_the_engines_restore(fleet: Fleet) -> None:
    """A prompt one engine computed (and offered to the node's store) is restored by the
    other from cgn-kvcached: kvcached's Get span, with tiers and bytes, joins the trace."""
    rx = fleet.rx
    body = {"model": MODEL, "prompt": "a prompt for the store " * 40 + secrets.token_hex(4),
            "max_tokens": 2}  # fmt: skip
    stored = metric(fleet.kvcached, "cgn_kvcached_blocks", tier="ram")
    assert httpx.post(fleet.prefill + "/v1/completions", json=body, timeout=30).status_code == 200
    # the engine offers the prompt's blocks from a background thread: wait for the store
    until("the offer stored", lambda: metric(fleet.kvcached, "cgn_kvcached_blocks", tier="ram")
          >= stored + 5)  # fmt: skip
    trace_id = secrets.token_hex(16)
    head = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    resp = httpx.post(fleet.decode + "/v1/completions", json=body, headers=head, timeout=30)
    assert resp.status_code == 200, resp.text
    spans = rx.wait("the engine's trace", lambda _: (t := rx.trace(trace_id)) and
                    any(s.name == "decode" for s in t) and t)  # fmt: skip
    restore = one(spans, "cgn-infer", "kv restore")
    assert restore.attributes["cognitora.kv.blocks"] >= 5
    assert restore.attributes["cognitora.kv.tiers"] == "ram"
    get = rx.wait("kvcached's Get", lambda _: [s for s in rx.trace(spans[0].trace_id)
                                               if s.name == "kv get"])  # fmt: skip
    assert len(get) == 1 and get[0].service == "cgn-kvcached"
    assert get[0].parent_id == restore.span_id
    attrs = get[0].attributes
    assert attrs["cognitora.kv.blocks_found"] == restore.attributes["cognitora.kv.blocks"]
    assert attrs["cognitora.kv.blocks_ram"] == attrs["cognitora.kv.blocks_found"]
    assert attrs["cognitora.kv.bytes"] > 0


def test_an_unsampled_trace_is_dropped_unless_it_fails(
    fleet: Fleet,
) -> None:
    rx, router = fleet.rx, fleet.router
    ok_id, failed_id, marker = (secrets.token_hex(16) for _ in range(3))
    unsampled = lambda tid: {"traceparent": f"00-{tid}-{secrets.token_hex(8)}-00"}  # noqa: E731
    assert chat(router, "fine", unsampled(ok_id)).status_code == 200
    bad = chat(router, "fine", unsampled(failed_id), model="no-such-model")
    assert bad.status_code == 404
    # a sampled request after both: once it is exported, so would they have been (one queue)
    chat(router, "marker", {"traceparent": f"00-{marker}-{secrets.token_hex(8)}-01"})
    rx.wait("the marker trace", lambda _: trace_of(rx)(rx.trace(marker)))
    assert rx.trace(ok_id) == []
    failed = rx.wait("the failed request", lambda _: rx.trace(failed_id))
    root = one(failed, "cgn-router", "chat no-such-model")
    assert root.error and root.attributes["http.response.status_code"] == 404


def test_an_unreachable_collector_never_fails_or_holds_a_request(
    fleet: Fleet,
) -> None:
    lost_router = fleet.lost_router
    for i in range(40):
        started = time.monotonic()
        resp = chat(lost_router, f"request {i}")
        assert resp.status_code == 200, resp.text
        # NOTE: an export on the request path would hold it 0.5 s (the export timeout)
        assert time.monotonic() - started < 2.0
    dropped = until(
        "spans counted as dropped",
        lambda: metric(lost_router.admin, "cgn_router_trace_spans_dropped_total"),
        timeout_s=20,
    )
    assert dropped > 0


def test_a_clients_tracestate_is_forwarded_only_as_the_spec_bounds_it() -> None:
    """At most 32 well-formed members and 512 characters (8 KB of it reached an engine)."""
    from cgn_core.tracing import TRACESTATE_CHARS, bounded_tracestate

    assert bounded_tracestate("a=1, b@v=x y,bad key=1,c=,d=2") == "a=1,b@v=x y,d=2"
    many = ",".join(f"k{i}=v" for i in range(100))
    assert bounded_tracestate(many).count(",") == 31
    huge = ",".join(f"k{i}={'v' * 200}" for i in range(40))
    kept = bounded_tracestate(huge)
    assert 0 < len(kept) <= TRACESTATE_CHARS and kept.count(",") == 1
    assert bounded_tracestate("x=" + "v" * 9000) == ""
    assert bounded_tracestate("a=\x1b[2J,b=ok\r\nX-Injected: 1") == ""
