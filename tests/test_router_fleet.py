"""Routing at fleet scale, end to end: 200 sim engines behind one real router.

The engines are virtual: one `cgn-infer serve --backend sim --engines 200` process, each
engine on its own port with its own scheduler, paged pool, metrics and KV event stream
(the tokenizer shared). They are registered in etcd across 50 nodes the way agents
register them; the router follows all 200 event streams and routes among 200 endpoints of
one model, which takes its short-list path (more than 16 candidates).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from cgn_core import keys
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from harness.metrics import metric
from harness.poll import router_endpoints, until
from harness.procs import Router, cgn_infer_fleet, cgn_router, etcd_run

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(240)]
MODEL = f"fleet200-{uuid.uuid4().hex[:8]}"
ENGINES, NODES = 200, 50
SIM = ("--backend", "sim", "--speed", "20", "--kv-pool-tokens", "4096", "--max-batch", "8")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, etcd_server: LocalEtcd) -> Iterator[list[str]]:
    tmp = tmp_path_factory.mktemp("fleet200")
    with cgn_infer_fleet(tmp, 1, *SIM, "--engines", str(ENGINES), "--model-name", MODEL) as urls:
        assert len(urls) == ENGINES and len(set(urls)) == ENGINES

        async def register(c: EtcdClient) -> None:  # as each node's agent writes it
            for i, url in enumerate(urls):
                node = f"node-{i % NODES}"
                value = {"url": url, "engine": "cgn-infer", "role": "both", "node": node,
                         "block_size": 16}  # fmt: skip
                await c.put_json(f"{keys.ENDPOINTS}{node}/{MODEL}/r{i}", value)

        async def unregister(c: EtcdClient) -> None:
            for n in range(NODES):
                await c.delete(f"{keys.ENDPOINTS}node-{n}/{MODEL}/", prefix=True)

        etcd_run(etcd_server.endpoint, register)
        yield urls
    etcd_run(etcd_server.endpoint, unregister)


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: LocalEtcd, fleet: list[str]
) -> Iterator[Router]:
    config = {
        "etcd": {"endpoints": [etcd_server.endpoint]},
        "models": {MODEL: {"tokenizer": "smollm2"}},
        "routing": {"optimistic_ttl_s": 0.2},
        "scrape": {"interval_s": 1.0, "stale_s": 10.0},
    }
    with cgn_router(tmp_path_factory.mktemp("router200"), config) as r:

        def ready() -> bool:
            eps = [e for k, e in router_endpoints(r.admin).items() if MODEL in k]
            return len(eps) == ENGINES and all(e["load"] is not None for e in eps)

        until("the router follows and has scraped all 200 engines", ready, timeout_s=60)
        until(
            "a KV event stream from every engine",
            lambda: metric(r.admin, "cgn_router_kv_resyncs_total") >= ENGINES,
            timeout_s=60,
        )
        yield r


def long_prompt(topic: str, words: int = 300) -> str:
    return " ".join(f"{topic}{i % 17}" for i in range(words))


async def complete_all(url: str, prompts: list[str], concurrency: int) -> list[tuple[str, Any]]:
    """(endpoint that served it, usage) per prompt, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(prompt: str) -> tuple[str, Any]:
            async with sem:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers["x-cognitora-endpoint"], (await resp.json())["usage"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.slow
def test_two_hundred_engines_each_conversation_returns_to_its_engine(router: Router) -> None:
    """First turns spread over the fleet by load; every second turn lands on the engine whose
    KV events say it holds the first (the optimistic entries have expired by then)."""
    topics = [f"t{i}x" for i in range(60)]
    started = time.monotonic()
    first = asyncio.run(complete_all(router.url, [long_prompt(t) for t in topics], 16))
    homes = [eid for eid, _ in first]
    assert len(set(homes)) >= 30, f"60 new conversations went to {len(set(homes))} engines"
    time.sleep(0.3)  # past optimistic_ttl_s: only the engines' KV events can explain a hit
    follow = [long_prompt(t) + " and then something new" for t in topics]
    second = asyncio.run(complete_all(router.url, follow, 16))
    moved = [(t, h, eid) for t, h, (eid, _) in zip(topics, homes, second, strict=True) if h != eid]
    assert not moved, f"{len(moved)} conversations left their engine: {moved[:3]}"
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= 256 for _, u in second)
    elapsed = time.monotonic() - started
    assert metric(router.admin, "cgn_router_records_ignored_total") == 0
    assert metric(router.admin, "cgn_router_kv_streams_refused_total") == 0
    print(f"120 requests over {ENGINES} engines in {elapsed:.1f}s")


def test_cordoning_half_the_nodes_keeps_new_traffic_off_them(
    router: Router, etcd_server: LocalEtcd
) -> None:
    """The candidate sets follow a cordon of 25 nodes (100 endpoints) without a rescan."""
    cordoned = {f"node-{i}" for i in range(0, NODES, 2)}

    async def cordon(c: EtcdClient, on: bool) -> None:
        for node in cordoned:
            if on:
                await c.put_json(keys.CORDON + node, {"reason": "test"})
            else:
                await c.delete(keys.CORDON + node)

    etcd_run(etcd_server.endpoint, lambda c: cordon(c, True))
    try:
        until(
            "the router sees 25 cordoned nodes",
            lambda: sum(e["cordoned"] for e in router_endpoints(router.admin).values()) == 100,
        )
        landed = asyncio.run(
            complete_all(router.url, [long_prompt(f"c{i}y") for i in range(40)], 16)
        )
        nodes = {router_endpoints(router.admin)[eid]["node"] for eid, _ in landed}
        assert not nodes & cordoned, nodes & cordoned
        assert len({eid for eid, _ in landed}) >= 20
    finally:
        etcd_run(etcd_server.endpoint, lambda c: cordon(c, False))
