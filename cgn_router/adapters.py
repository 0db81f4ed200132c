"""LoRA adapters' residency (#60): which replicas hold a request's adapter, and loading it
where it is needed.

A replica holds an adapter it loaded at start (its endpoint record's `adapters`) or
at run time: cgn-infer's `cgn_infer_lora_loaded{adapter}` as last scraped, plus what
this router loaded there since. The registry routes an adapter's request only to
holders (`Registry.views`); before that, `place` makes sure there is one:

* `residency` (the default): none holds it, so it is loaded on a replica that can
  load at run time: one with a slot free (the fewest adapters first), else the one
  whose least asked-for adapter is asked for least, and the request waits for it (at
  most `routing.adapter_load_s`, within its deadline; then 503 with Retry-After).
  Every holder has `adapter_widen_queue` requests or more while a replica that could
  load it has fewer: it is loaded there too, in the background (this request goes to
  a holder). A load on a full replica first unloads its least asked-for adapter (not
  one it started with): the router sees every request, so it evicts by frequency,
  where the engine alone would evict by recency. So the fleet's slots hold the most
  asked-for adapters, each on as few replicas as its traffic needs.
* `random`: a replica at random, loaded there if it does not hold it: what
  placement without residency costs (bench/lora_placement.py).

Loads are POST /v1/load_lora_adapter with vLLM's body and the engine's secret; one
per replica and adapter at a time (later requests wait on the first's); an answer
naming the adapter evicted (`x-cgn-evicted`) takes it off that replica here at once.
An adapter's count of requests decays with half-life `routing.adapter_half_life_s`.
An unload the engine refuses (a request holds the adapter) leaves the choice to it.
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
UNLOAD_PATH = "/v1/unload_lora_adapter"
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
    _ask(svc, adapter, time.monotonic())
    if not holders:
        if others:
            await _wait(svc, _coldest(svc, others), adapter, source, deadline)
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


def _ask(svc: RouterService, adapter: str, now: float) -> None:
    """One more request for `adapter` (the count decays: `asked`)."""
    svc.loads.asked[adapter] = (_asked(svc, adapter, now) + 1.0, now)


def _asked(svc: RouterService, adapter: str, now: float) -> float:
    """`adapter`'s requests, each counted 2^-(its age / half-life)."""
    count, at = svc.loads.asked.get(adapter, (0.0, now))
    return count * math.exp2(-(now - at) / svc.settings.routing.adapter_half_life_s)


def _victim(
    svc: RouterService, st: EndpointState, now: float, adding: str = ""
) -> tuple[float, str] | None:
    """The adapter a load (of `adding`, or of one more) on a full `st` should unload, with
    its count: the least asked-for of those loaded at run time and not being loaded; None
    while a slot is free (or the number of slots is unknown) or nothing may go."""
    coming = {a for eid, a in svc.loads.pending if eid == st.endpoint.id} - {adding}
    if st.adapter_slots is None or len(st.adapters) + len(coming) < st.adapter_slots:
        return None
    movable = st.adapters - set(st.endpoint.adapters) - coming - {adding}
    return min(((_asked(svc, a, now), a) for a in movable), default=None)


def _coldest(svc: RouterService, states: Iterable[EndpointState]) -> EndpointState:
    """Where to load an adapter none holds: a replica with a slot free (the one holding
    the fewest adapters, counting loads under way), else one with the fewest loads under
    way (an engine loads one at a time: a request waits behind them) and of those the one
    whose victim is asked for least (a frequency-ranked eviction over every replica's
    slots), then the least busy."""
    now = time.monotonic()
    busy = Counter(eid for eid, _ in svc.loads.pending)

    def key(st: EndpointState) -> tuple[float, float, float, float, float]:
        eid = st.endpoint.id
        victim = _victim(svc, st, now)
        if victim is None:
            return (0.0, len(st.adapters) + busy[eid], 0.0, _queue(st), svc.rng.random())
        return (1.0, busy[eid], victim[0], _queue(st), svc.rng.random())

    return min(states, key=key)


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


async def _post(
    svc: RouterService, st: EndpointState, path: str, doc: dict[str, str]
) -> tuple[int, str, str]:
    """POST `doc` to `st`'s `path` with its secret: (status, answer, adapter it evicted)."""
    ep = st.endpoint
    body = json.dumps(doc).encode()
    headers = {"Content-Type": "application/json", **bearer_header(ep.token)}
    connect = svc.settings.deadlines.connect_s
    async with asyncio.timeout(svc.settings.routing.adapter_load_s):
        with await svc.proxy.upstream.post(ep.url, path, body, headers, connect) as resp:
            text = (await resp.read(MAX_ANSWER)).decode("utf-8", "replace")
            return resp.status, text, resp.headers.get(EVICTED_HEADER, "")


async def _unload_victim(svc: RouterService, st: EndpointState, adapter: str) -> None:
    """Make room for `adapter` on a full `st` by its least asked-for adapter (residency
    only). Routed nowhere from now; back where the engine keeps it."""
    if svc.settings.routing.adapter_placement != "residency":
        return
    victim = _victim(svc, st, time.monotonic(), adapter)
    if victim is None:
        return
    st.adapters.discard(victim[1])
    status, text, _ = await _post(svc, st, UNLOAD_PATH, {"lora_name": victim[1]})
    if status not in (200, 404):  # 404: gone already; else the engine's LRU chooses
        st.adapters.add(victim[1])
        log.info("unloading LoRA adapter %s on %s for %s: %s %s", victim[1], st.endpoint.id,
                 adapter, status, text[:200])  # fmt: skip


async def _load(svc: RouterService, st: EndpointState, adapter: str, source: str) -> bool:
    """One load of `adapter` on `st`: True once it holds it (or already did)."""
    started = time.monotonic()
    result = "failed"
    try:
        ep = st.endpoint
        await _unload_victim(svc, st, adapter)
        status, text, evicted = await _post(
            svc, st, LOAD_PATH, {"lora_name": adapter, "lora_path": source}
        )
        if status == 200 or (status == 400 and "already been loaded" in text):
            st.adapters.add(adapter)
            if NAME.match(evicted) and evicted != adapter:
                st.adapters.discard(evicted)
            result = "loaded" if status == 200 else "present"
            return True
        log.warning("loading LoRA adapter %s on %s: %s %s", adapter, ep.id, status, text[:200])
        return False
    except (UpstreamError, TimeoutError, OSError) as exc:
        log.warning("loading LoRA adapter %s on %s: %s", adapter, st.endpoint.id, exc)
        return False
    finally:  # no request's account: a load may serve several, or none (in the background)
        seconds = time.monotonic() - started
        ep = st.endpoint
        Account(svc.observers).emit(AdapterLoaded(ep.model, ep.id, result, seconds))
