"""One account of each request (cgn_router/routing/lifecycle.py): the records a scenario produces,
asserted as records, and the metrics observer's counts from them.

The router runs in-process (build_service and build_front, as the daemon builds
them) in front of a real cgn-infer sim engine and a port nobody listens on;
round-robin picking over names makes the dead endpoint the first pick.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from cgn_core.etcd.local import free_port
from cgn_router.daemon import build_service
from cgn_router.metrics import TENANT_LABELS, MetricsObserver, RouterMetrics
from cgn_router.routing.lifecycle import (
    AttemptEnded,
    AttemptStarted,
    Ended,
    Record,
    RecordList,
    Retried,
    Routed,
)
from cgn_router.server import build_front
from cgn_router.service import RouterService
from cgn_router.settings import (
    AuthSettings,
    RouterSettings,
    RoutingSettings,
    StaticEndpoint,
)
from cgn_router.types import Usage
from cgn_router.upstream import Upstream
from harness.procs import cgn_infer

MODEL = "sim"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lifecycle")
    with cgn_infer(tmp, "--backend", "sim", "--speed", "50", "--model-name", MODEL) as url:
        yield url


@asynccontextmanager
async def routed(
    endpoints: dict[str, str], attempts: int = 3
) -> AsyncIterator[tuple[str, RouterService, RecordList]]:
    """A router in this process over `endpoints` (name -> URL), its records kept."""
    settings = RouterSettings(
        discovery="static",
        auth=AuthSettings(enabled=False),
        endpoints={n: StaticEndpoint(url=u, model=MODEL) for n, u in endpoints.items()},
        routing=RoutingSettings(picker="round_robin"),
        attempts=attempts,
    )
    log = RecordList()
    async with Upstream() as upstream:
        svc = build_service(settings, upstream, observers=(log,))
        front = build_front(svc)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await front.start(sock)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", svc, log
        finally:
            await front.shutdown(1.0)


def dead() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: a connect error


def metric(svc: RouterService, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def of(records: list[Record], kind: type) -> list[Any]:
    return [r for r in records if isinstance(r, kind)]


async def complete(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    async with httpx.AsyncClient() as client:
        return await client.post(url + "/v1/completions", json=body, timeout=30)


async def test_a_retried_request_is_one_account_of_records(sim: str) -> None:
    async with routed({"a_sim": sim, "b_dead": dead()}) as (url, svc, log):
        resp = await complete(url)
    assert resp.status_code == 200
    assert log.kinds() == [
        "Asked", "Hashed", "Admitted",
        "Routed", "AttemptStarted", "AttemptEnded",  # the dead endpoint: picked first
        "Routed", "Retried", "AttemptStarted", "AttemptEnded",  # a retry once routed
        "Ended",
    ]  # fmt: skip
    first, second = of(log.records, AttemptEnded)
    assert (first.outcome, first.cause, first.first_byte_s) == ("failed", "connect", None)
    assert (second.outcome, second.cause, second.model) == ("ok", "", MODEL)
    assert second.first_byte_s is not None and second.usage is not None
    assert [s.endpoint for s in of(log.records, AttemptStarted)] == ["sim/b_dead", "sim/a_sim"]
    assert of(log.records, Retried) == [Retried(MODEL)]
    (ended,) = of(log.records, Ended)
    assert (ended.model, ended.outcome, ended.status, ended.error) == (MODEL, "ok", 200, "")
    assert ended.usage is not None and ended.usage.completion_tokens == 2
    assert ended.tenant == "anonymous"  # auth off: the one anonymous tenant
    # the metrics are one observer of these records
    assert metric(svc, "cgn_router_requests_total", model=MODEL, outcome="ok") == 1
    assert metric(svc, "cgn_router_errors_total", cause="connect") == 1
    assert metric(svc, "cgn_router_retries_total", model=MODEL) == 1
    assert metric(svc, "cgn_router_tokens_total", model=MODEL, kind="completion") == 2
    assert metric(svc, "cgn_router_ttft_seconds_count", model=MODEL) == 1
    tenant = {"tenant": "anonymous", "kind": "completion"}
    assert metric(svc, "cgn_router_tenant_tokens_total", **tenant) == 2


async def test_a_request_no_engine_answers_ends_once_as_upstream_error() -> None:
    async with routed({"b_dead": dead()}, attempts=1) as (url, svc, log):
        resp = await complete(url)
    assert resp.status_code == 502
    assert log.kinds() == [
        "Asked", "Hashed", "Admitted", "Routed", "AttemptStarted", "AttemptEnded", "Ended",
    ]  # fmt: skip
    (ended,) = of(log.records, Ended)
    assert (ended.outcome, ended.status, ended.error) == ("upstream_error", 502, "connect")
    assert metric(svc, "cgn_router_requests_total", model=MODEL, outcome="upstream_error") == 1


async def test_a_request_refused_before_routing_ends_uncounted(sim: str) -> None:
    """A 404 for a model nobody serves: one Ended, no outcome, no request counted."""
    async with routed({"a_sim": sim}) as (url, svc, log), httpx.AsyncClient() as client:
        body = {"model": "nope", "prompt": "x"}
        resp = await client.post(url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 404
    assert log.kinds() == ["Asked", "Ended"]
    (ended,) = of(log.records, Ended)
    assert (ended.model, ended.outcome, ended.status) == ("", "", 404)
    assert of(log.records, Routed) == []
    assert metric(svc, "cgn_router_requests_total", model="nope", outcome="ok") == 0


def test_tenant_token_series_are_bounded() -> None:
    """Past TENANT_LABELS tenants, a worker counts the rest as "other" (keys cannot grow
    the scrape without bound)."""
    svc_metrics = RouterMetrics()
    observer = MetricsObserver(svc_metrics)
    for i in range(TENANT_LABELS + 5):
        observer.observe(Ended(MODEL, "ok", 200, 0.1, Usage(10, 3, 0), "", f"t{i}"))
    observer.observe(Ended(MODEL, "ok", 200, 0.1, Usage(10, 3, 8), "", "t0"))
    reg = svc_metrics.registry

    def tokens(tenant: str, kind: str = "prompt") -> float:
        labels = {"tenant": tenant, "kind": kind}
        return reg.get_sample_value("cgn_router_tenant_tokens_total", labels) or 0.0

    assert tokens("t0") == 20 and tokens(f"t{TENANT_LABELS - 1}") == 10
    assert tokens(f"t{TENANT_LABELS}") == 0 and tokens("other") == 50
    assert tokens("t0", "cached") == 8  # its own hit rate: 8 of its 20 prompt tokens
