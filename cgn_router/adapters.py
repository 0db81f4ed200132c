"""LoRA adapters' residency (#60): which replicas hold a request's adapter, and loading it
where it is needed.

A replica holds an adapter it loaded at start (its endpoint record's `adapters`) or
at run time: cgn-infer's `cgn_infer_lora_loaded{adapter}` as last scraped, plus what
this router loaded there since. The registry routes an adapter's request only to
holders (`Registry.views`); before that, `place` makes sure there is one:

* `residency` (the default): none holds it, so it is loaded on the replica that can
  load at run time with the fewest requests in flight (then the fewest adapters),
  and the request waits for it (at most `routing.adapter_load_s`, within its
  deadline; then 503 with Retry-After). Every holder has `adapter_widen_queue`
  requests or more while a replica that could load it has fewer: it is loaded there
  too, in the background (this request goes to a holder). So each adapter lives
  on as few replicas as its traffic needs, and an engine's own LRU (`max_loras`)
  drops the cold ones.
* `random`: a replica at random, loaded there if it does not hold it: what
  placement without residency costs (bench/lora_placement.py).

Loads are POST /v1/load_lora_adapter with vLLM's body and the engine's secret; one
per replica and adapter at a time (later requests wait on the first's); an answer
naming the adapter evicted (`x-cgn-evicted`) takes it off that replica here at once.
Each load ends in an `AdapterLoaded` record to the service's observers (the metrics).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping

from cgn_core.errors import Unavailable
from cgn_core.http import bearer_header
from cgn_core.keys import NAME
from cgn_router.registry import EndpointState
from cgn_router.routing.lifecycle import Account, AdapterLoaded
from cgn_router.service import RouterService
from cgn_router.types import EndpointId, queue_length
from cgn_router.upstream import UpstreamError

log = logging.getLogger(__name__)
RUNTIME_LORA_ENGINES = frozenset({"cgn-infer"})  # take POST /v1/load_lora_adapter
LOAD_PATH = "/v1/load_lora_adapter"
EVICTED_HEADER = "x-cgn-evicted"
MAX_ANSWER = 64 << 10


async def place(
    svc: RouterService, model: str, adapter: str, deadline: float
) -> frozenset[EndpointId]:
    """Make a replica of `model` hold `adapter` where the policy says (see above); the
    endpoints the request must not go to (the random policy's others). Unavailable when a
    load it needs fails or does not end in time."""
    peers = [st for st in svc.registry.by_model.get(model, {}).values() if _routable(svc, st)]
    source = _source(svc, model, adapter)
    loadable = [st for st in peers if st.endpoint.engine in RUNTIME_LORA_ENGINES and source]
    if svc.settings.routing.adapter_placement == "random":
        if not peers:
            return frozenset()
        pick = svc.rng.choice(peers)
        if not pick.holds(adapter) and pick in loadable:
            await _wait(svc, pick, adapter, source, deadline)
        return frozenset(st.endpoint.id for st in peers if st is not pick)
    holders = [st for st in peers if st.holds(adapter)]
    others = [st for st in loadable if not st.holds(adapter)]
    now = time.monotonic()
    for st in holders:
        st.adapter_used[adapter] = now
    if not holders:
        if others:
            target = _coldest(others, svc.loads.pending, svc.rng)
            await _wait(svc, target, adapter, source, deadline)
            target.adapter_used[adapter] = time.monotonic()
        return frozenset()
    busiest_free = min(_queue(st) for st in holders)
    if others and busiest_free >= svc.settings.routing.adapter_widen_queue:
        best = _least_busy(others, svc.loads.pending, svc.rng)
        if _queue(best) < busiest_free and (best.endpoint.id, adapter) not in svc.loads.pending:
            task = _start(svc, best, adapter, source)
            svc.loads.background.add(task)
            task.add_done_callback(svc.loads.background.discard)
    return frozenset()


def _start(svc: RouterService, st: EndpointState, adapter: str, source: str) -> asyncio.Task[bool]:
    """A load of `adapter` on `st`, known to later requests from now on."""
    task = asyncio.get_running_loop().create_task(_load(svc, st, adapter, source))
    key = (st.endpoint.id, adapter)
    svc.loads.pending[key] = task
    task.add_done_callback(lambda _: svc.loads.pending.pop(key, None))
    return task


def _routable(svc: RouterService, st: EndpointState) -> bool:
    """Whether a whole request could go to `st` now (role, breaker, cordon)."""
    return (
        st.endpoint.role == "both"
        and not st.breaker.blocks(time.monotonic())
        and st.endpoint.node not in svc.registry.cordoned
    )


def _queue(st: EndpointState) -> float:
    return queue_length(st.router_counts()[0], st.load)


def _coldest(
    states: Iterable[EndpointState], loading: Mapping[tuple[EndpointId, str], object],
    rng: random.Random,
) -> EndpointState:  # fmt: skip
    """Where to load an adapter none holds: the replica holding the fewest adapters (it has
    a slot free, or will evict least), then the one whose least recently asked-for adapter
    is the oldest (its engine evicts that one: a global LRU over every replica's slots,
    not one per replica), then the least busy."""
    busy = Counter(eid for eid, _ in loading)

    def victim(st: EndpointState) -> float:
        return min((st.adapter_used.get(a, -math.inf) for a in st.adapters), default=-math.inf)

    return min(
        states,
        key=lambda st: (
            len(st.adapters) + busy[st.endpoint.id],
            victim(st),
            _queue(st),
            rng.random(),
        ),
    )


def _least_busy(
    states: Iterable[EndpointState], loading: Mapping[tuple[EndpointId, str], object],
    rng: random.Random,
) -> EndpointState:  # fmt: skip
    """Fewest requests in flight and loads under way (an engine loads one at a time), then
    fewest adapters held, then at random."""
    busy = Counter(eid for eid, _ in loading)
    return min(
        states,
        key=lambda st: (_queue(st) + busy[st.endpoint.id], len(st.adapters), rng.random()),
    )


def _source(svc: RouterService, model: str, adapter: str) -> str:
    entry = svc.catalog.entry(model)
    return entry.adapter_files.get(adapter, "") if entry is not None else ""


async def _wait(
    svc: RouterService, st: EndpointState, adapter: str, source: str, deadline: float
) -> None:
    """`adapter` loaded on `st` (sharing a load already under way), or Unavailable."""
    task = svc.loads.pending.get((st.endpoint.id, adapter)) or _start(svc, st, adapter, source)
    wait = max(0.0, min(svc.settings.routing.adapter_load_s, deadline - time.monotonic()))
    try:
        done = await asyncio.wait_for(asyncio.shield(task), wait)
        why = "failed (the router's log says why)"
    except TimeoutError:
        done, why = False, f"did not finish within {wait:.0f} s"
    if not done:
        raise Unavailable(
            f"LoRA adapter '{adapter}' is loaded on no replica, and loading it on "
            f"{st.endpoint.id} {why}",
            code="adapter_load_failed",
            retry_after_s=5,
        )


async def _load(svc: RouterService, st: EndpointState, adapter: str, source: str) -> bool:
    """One load of `adapter` on `st`: True once it holds it (or already did)."""
    started = time.monotonic()
    result = "failed"
    try:
        ep = st.endpoint
        body = json.dumps({"lora_name": adapter, "lora_path": source}).encode()
        headers = {"Content-Type": "application/json", **bearer_header(ep.token)}
        connect = svc.settings.deadlines.connect_s
        timeout = svc.settings.routing.adapter_load_s
        async with asyncio.timeout(timeout):
            with await svc.proxy.upstream.post(ep.url, LOAD_PATH, body, headers, connect) as resp:
                text = (await resp.read(MAX_ANSWER)).decode("utf-8", "replace")
                evicted = resp.headers.get(EVICTED_HEADER, "")
        if resp.status == 200 or (resp.status == 400 and "already been loaded" in text):
            st.adapters.add(adapter)
            if NAME.match(evicted) and evicted != adapter:
                st.adapters.discard(evicted)
            result = "loaded" if resp.status == 200 else "present"
            return True
        log.warning("loading LoRA adapter %s on %s: %s %s", adapter, ep.id, resp.status,
                    text[:200])  # fmt: skip
        return False
    except (UpstreamError, TimeoutError, OSError) as exc:
        log.warning("loading LoRA adapter %s on %s: %s", adapter, st.endpoint.id, exc)
        return False
    finally:  # no request's account: a load may serve several, or none (in the background)
        seconds = time.monotonic() - started
        ep = st.endpoint
        Account(svc.observers).emit(AdapterLoaded(ep.model, ep.id, result, seconds))
