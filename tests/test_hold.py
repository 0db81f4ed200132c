"""Requests held at the router for a replica that meets their TTFT SLO (cgn_router/hold.py):
when a request is held, the queue's order, its release, its expiry, a client that leaves."""

from __future__ import annotations

import asyncio
import time

import pytest

from cgn_router.hold import Holds, meets
from cgn_router.types import Endpoint, EndpointId, EndpointView, RequestInfo, Speed

SPEED = Speed(overhead_s=0.02, prefill_s=1e-3, samples=10)
REQ = RequestInfo("m", prompt_tokens=100)  # 0.12 s of its own work alone
SLO = 0.5


def view(predicted: float | None, in_flight: int = 3, **kw: object) -> EndpointView:
    ep = Endpoint(EndpointId("m/a"), "m", "http://a")
    return EndpointView(ep, in_flight=in_flight, speed=SPEED, predicted_ttft_s=predicted, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("v", "req", "goes"),
    [
        (view(0.4), REQ, True),  # the prediction meets the SLO
        (view(0.9), REQ, False),  # it misses it because of the queue: held
        (view(0.9, in_flight=0), REQ, True),  # nothing ahead of it there: waiting cannot help
        (view(9.0), RequestInfo("m", prompt_tokens=2000), True),  # its own 2 s alone miss it
        (view(9.0, lag=5.0), REQ, True),  # a replica 5x late: 0.6 s alone
        (view(None), REQ, True),  # nothing predicted: no time scorer
    ],
)
def test_when_a_request_is_held(v: EndpointView, req: RequestInfo, goes: bool) -> None:
    assert meets(v, req, SLO) is goes


class Fleet:
    """What the chain would pick now: a prediction the test changes."""

    def __init__(self, predicted: float) -> None:
        self.predicted = predicted
        self.checks = 0

    def best(self) -> EndpointView:
        self.checks += 1
        return view(self.predicted)


def test_held_requests_go_in_order_as_soon_as_a_replica_meets_the_slo() -> None:
    async def main() -> None:
        holds, fleet = Holds(recheck_s=0.01), Fleet(0.9)
        until = time.monotonic() + 30
        order: list[int] = []

        async def one(i: int) -> None:
            got = await holds.hold(REQ, view(0.9), SLO, until, fleet.best)
            assert got is not None and got[0] is not None and got[2] == "released"
            order.append(i)

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.02)
        assert holds.held("m") == 3 and not order
        # a request that would meet the SLO joins behind those held (no overtaking)
        late = asyncio.create_task(holds.hold(REQ, view(0.1), SLO, until, fleet.best))
        await asyncio.sleep(0.05)
        assert not late.done() and fleet.checks > 0
        fleet.predicted = 0.3
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        got = await late
        assert got is not None and got[2] == "released"
        assert holds.held("m") == 0
        # nobody held, a prediction that meets the SLO: not held at all
        assert await holds.hold(REQ, view(0.1), SLO, until, fleet.best) is None

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_hold_expires_to_the_best_replica_and_a_client_that_leaves_leaves_the_queue() -> None:
    async def main() -> None:
        holds, fleet = Holds(recheck_s=0.01), Fleet(0.9)
        started = time.monotonic()
        got = await holds.hold(REQ, view(0.9), SLO, started + 0.1, fleet.best)
        assert got is not None and got[2] == "expired" and got[1] >= 0.1
        assert got[0] == view(0.9)  # the best as it was: sent anyway
        first = asyncio.create_task(holds.hold(REQ, view(0.9), SLO, started + 30, fleet.best))
        second = asyncio.create_task(holds.hold(REQ, view(0.9), SLO, started + 30, fleet.best))
        await asyncio.sleep(0.05)
        first.cancel()  # its client left: the next one heads the queue and checks at once
        await asyncio.sleep(0.05)
        assert holds.held("m") == 1
        fleet.predicted = 0.2
        got = await second
        assert got is not None and got[2] == "released" and holds.held("m") == 0

    asyncio.run(asyncio.wait_for(main(), 20))


def test_holds_are_off_unless_the_router_is_told() -> None:
    """`routing.hold_for_slo` is off by default: a model's SLO (which also drives the
    autoscaler) holds nothing by itself."""
    from types import SimpleNamespace

    from cgn_router import legs
    from cgn_router.catalog import ModelEntry
    from cgn_router.settings import RouterSettings

    entry = ModelEntry("m", ttft_slo_s=0.1)
    svc = SimpleNamespace(settings=RouterSettings(), catalog=SimpleNamespace(entry=lambda m: entry),
                          holds=Holds())  # fmt: skip
    v = view(9.0)  # far past the SLO, with requests in flight
    got = asyncio.run(legs.held(svc, SimpleNamespace(band="gold"), REQ, v, None))  # type: ignore[arg-type]
    assert got == (v, {}) and svc.settings.routing.hold_for_slo is False
