"""cgn-router as a real process: real etcd, real cgn-infer sim engines, the official openai client.

One router and a three-engine sim fleet per module; engines are registered in
etcd the way cgn-agent will register them. Tests that kill engines start
their own pair under another model name.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from cgn_core.etcd.local import LocalEtcd
from harness.metrics import metric
from harness.poll import get_json, router_endpoints, until
from harness.procs import Router, cgn_infer_engines, cgn_router, etcd_run

pytestmark = pytest.mark.etcd
FLEET = f"simfleet-{uuid.uuid4().hex[:8]}"  # the served model name (and hash namespace)
NODES = ("node-a", "node-b", "node-c")
SIM = ("--backend", "sim", "--speed", "20", "--kv-pool-tokens", "8192", "--max-batch", "16")
# the default scorers, the saturation guard tighter so a short test trips it
SCORERS_600 = [
    {"type": "prefix", "weight": 3.0, "params": {"saturation_tokens": 600}},
    {"type": "load", "weight": 1.0},
    {"type": "kv_usage", "weight": 0.5},
    {"type": "affinity", "weight": 0.5},
]


def register(endpoint: str, model: str, replica: str, url: str, node: str, lease: int = 0) -> None:
    value = {"url": url, "engine": "cgn-infer", "role": "both", "node": node, "block_size": 16}
    key = f"/cognitora/endpoints/{model}/{replica}"
    etcd_run(endpoint, lambda c: c.put_json(key, value, lease=lease))


def endpoints(router: Router) -> dict[str, dict[str, Any]]:
    return router_endpoints(router.admin)


def post(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.load(resp)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), json.load(err)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, etcd_server: LocalEtcd) -> Iterator[list[str]]:
    tmp = tmp_path_factory.mktemp("fleet")
    with cgn_infer_engines(tmp, 3, *SIM, "--model-name", FLEET) as engines:
        for i, e in enumerate(engines):
            register(etcd_server.endpoint, FLEET, f"r{i}", e.url, NODES[i])
        yield [e.url for e in engines]
    etcd_run(
        etcd_server.endpoint, lambda c: c.delete(f"/cognitora/endpoints/{FLEET}/", prefix=True)
    )


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: LocalEtcd, fleet: list[str]
) -> Iterator[Router]:
    config = {
        "etcd": {"endpoints": [etcd_server.endpoint]},
        "models": {
            FLEET: {"aliases": ["fleet-alias"], "tokenizer": "smollm2"},
            "ghost": {"fallbacks": [FLEET]},  # no endpoint serves it
        },
        "routing": {"optimistic_ttl_s": 0.2, "scorers": SCORERS_600},
        "scrape": {"interval_s": 0.2, "stale_s": 2.0},
        "breaker": {"failures": 1, "open_s": 60.0},
        "deadlines": {"first_token_s": 20.0, "idle_s": 10.0},
    }
    with cgn_router(tmp_path_factory.mktemp("router"), config) as r:
        until("router sees the fleet", lambda: len([e for e in endpoints(r) if FLEET in e]) == 3)
        yield r


@pytest.fixture
def client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def long_prompt(topic: str, words: int = 300) -> str:
    return " ".join(f"{topic}{i % 17}" for i in range(words))


# ---- the OpenAI surface ------------------------------------------------------------


def test_openai_client_through_the_router(client: openai.OpenAI) -> None:
    names = {m.id for m in client.models.list()}
    assert {FLEET, "fleet-alias", "ghost"} <= names
    raw = client.chat.completions.with_raw_response.create(
        model="fleet-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    chat = raw.parse()
    assert chat.model == FLEET and chat.usage is not None and chat.usage.completion_tokens == 4
    assert raw.headers["x-cognitora-model"] == FLEET
    assert raw.headers["x-cognitora-endpoint"].startswith(f"{FLEET}/r")
    comp = client.completions.create(model=FLEET, prompt="Once upon", max_tokens=3)
    assert comp.usage is not None and comp.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(
        model=FLEET, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_usage_chunk_is_read_but_not_relayed_when_not_asked(
    client: openai.OpenAI, router: Router
) -> None:
    before = metric(router.admin, "cgn_router_tokens_total", kind="completion", model=FLEET)
    chunks = list(client.completions.create(model=FLEET, prompt="Hello", max_tokens=6, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices
    after = metric(router.admin, "cgn_router_tokens_total", kind="completion", model=FLEET)
    assert after - before == 6  # accounted all the same


def test_fallback_model_serves_and_says_so(router: Router) -> None:
    status, headers, body = post(
        router.url + "/v1/completions", {"model": "ghost", "prompt": "a", "max_tokens": 2}
    )
    assert status == 200 and body["model"] == FLEET
    assert headers["x-cognitora-model"] == FLEET


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        ({"prompt": "x"}, 400, None, "'model' is required"),
        ({"model": "nope", "prompt": "x"}, 404, "model_not_found", "'nope' does not exist"),
        ({"model": FLEET, "prompt": "x", "stream": "yes"}, 400, None, "'stream' must be"),
        # the engine's own validation, relayed as it answered
        ({"model": FLEET, "prompt": "x", "max_tokens": 0}, 400, None, "max_tokens"),
        ({"model": FLEET, "prompt": ""}, 400, None, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    router: Router, body: Any, status: int, code: str | None, needle: str
) -> None:
    got, _, doc = post(router.url + "/v1/completions", body)
    assert got == status, doc
    assert needle in doc["error"]["message"] and doc["error"]["code"] == code


def test_oversized_body_and_unknown_path(router: Router) -> None:
    big = json.dumps({"model": FLEET, "prompt": "x" * (17 << 20)}).encode()
    status, _, doc = post(router.url + "/v1/completions", big)
    assert status == 413 and doc["error"]["type"] == "invalid_request_error"
    status, _, doc = post(router.url + "/v1/nothing", {})
    assert status == 404 and "error" in doc


def _arrivals(url: str, stop: threading.Event, out: list[float]) -> None:
    """Stream a long completion from `url`, noting when each event arrives, until `stop`."""
    body = {"model": FLEET, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                out.append(time.monotonic())
            if stop.is_set():
                return


@pytest.mark.exclusive  # its assertion is a gap between chunks: measured alone
def test_a_huge_prompt_stalls_no_other_stream(router: Router, fleet: list[str]) -> None:
    """A ~100k-token prompt is templated and tokenized off the event loop, in the router and in
    the engine: a stream in flight keeps flowing meanwhile. Measured against the huge request's
    own time, so the bound holds on a slow machine as on a fast one."""
    for topic, base in (("w", router.url), ("v", fleet[0])):  # via the router; at one engine
        # NOTE: a prompt of its own each time: the engine keeps tokenized text (the segment
        # cache), so the same one a second time would not be tokenized at all
        huge = {"model": FLEET, "max_tokens": 1,
                "messages": [{"role": "user", "content": long_prompt(topic, 50_000)}]}  # fmt: skip
        stop, arrivals = threading.Event(), list[float]()
        stream = threading.Thread(target=_arrivals, args=(base, stop, arrivals))
        stream.start()
        until("the stream flows", functools.partial(lambda got: len(got) >= 5, arrivals))
        t0 = time.monotonic()
        status, _, err = post(base + "/v1/chat/completions", huge)
        t1 = time.monotonic()
        stop.set()
        stream.join(30)
        assert status == 400 and "context" in err["error"]["message"], err  # counted, then refused
        during = [b - a for a, b in itertools.pairwise(arrivals) if t0 <= b <= t1 + 0.05]
        print(f"{base}: huge request {t1 - t0:.3f} s, {len(during)} events meanwhile, "
              f"longest gap {max(during, default=-1):.3f} s")  # fmt: skip
        assert len(during) >= 3 and max(during) < (t1 - t0) / 3


def test_a_conversations_next_turns_resume_from_the_prompt_cache(
    router: Router, client: openai.OpenAI
) -> None:
    """Each turn resends the history; the router tokenizes and hashes only what is new after
    the first (cgn_router/prompt_cache.py), and says so on /metrics."""
    lookups = "cgn_router_prompt_cache_lookups_total"
    hits0 = metric(router.admin, lookups, model=FLEET, result="hit")
    misses0 = metric(router.admin, lookups, model=FLEET, result="miss")
    reused0 = metric(router.admin, "cgn_router_prompt_cache_tokens_reused_total", model=FLEET)
    messages = [{"role": "system", "content": f"{uuid.uuid4()} " + long_prompt("s", 400)}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn}: " + long_prompt("q", 60)})
        out = client.chat.completions.create(model=FLEET, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": out.choices[0].message.content or "."})
    assert metric(router.admin, lookups, model=FLEET, result="miss") - misses0 == 1
    assert metric(router.admin, lookups, model=FLEET, result="hit") - hits0 == 3
    reused = metric(router.admin, "cgn_router_prompt_cache_tokens_reused_total", model=FLEET)
    assert reused - reused0 > 3 * 400  # the system prompt at least, three times over
    assert metric(router.admin, "cgn_router_prompt_cache_bytes") > 0


def test_embeddings_are_routed_and_the_engines_answer_relayed(router: Router) -> None:
    """cgn-infer serves no embeddings: its 404 comes back as it answered, from a routed endpoint."""
    status, headers, doc = post(router.url + "/v1/embeddings", {"model": FLEET, "input": "x"})
    assert status == 404 and "error" in doc
    assert headers["x-cognitora-endpoint"].startswith(f"{FLEET}/r")


def test_admin_endpoints(router: Router) -> None:
    assert get_json(router.admin + "/healthz") == {"status": "ok"}
    ready = get_json(router.admin + "/readyz")
    assert ready["status"] == "ready" and ready["synced"]
    eps = endpoints(router)
    assert {e["kv_tracking"] for k, e in eps.items() if FLEET in k} == {"exact"}
    assert all(e["load"] is not None for k, e in eps.items() if FLEET in k)  # scraped


# ---- routing -------------------------------------------------------------------------


def test_requests_land_on_the_replica_holding_their_prefix(router: Router) -> None:
    """Exact tracking from KV events: each conversation returns to the engine that holds it."""
    first: dict[str, str] = {}
    for topic in "abcdef":
        status, headers, _ = post(
            router.url + "/v1/completions",
            {"model": FLEET, "prompt": long_prompt(topic), "max_tokens": 2},
        )
        assert status == 200
        first[topic] = headers["x-cognitora-endpoint"]
    assert len(set(first.values())) >= 2  # spread by load while nothing is cached
    time.sleep(0.3)  # past optimistic_ttl_s: only the engines' KV events can explain a hit
    predicted0 = metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model=FLEET)
    reported0 = metric(router.admin, "cgn_router_prefix_tokens_reported_total", model=FLEET)
    for topic in "abcdef":
        prompt = long_prompt(topic) + " and then something new"
        status, headers, body = post(
            router.url + "/v1/completions", {"model": FLEET, "prompt": prompt, "max_tokens": 2}
        )
        assert headers["x-cognitora-endpoint"] == first[topic], topic
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    predicted = (
        metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model=FLEET) - predicted0
    )
    reported = (
        metric(router.admin, "cgn_router_prefix_tokens_reported_total", model=FLEET) - reported0
    )
    assert reported >= 6 * 256 and abs(predicted - reported) <= 6 * 16  # at most a block apart


def test_saturation_guard_spreads_a_shared_system_prompt(router: Router) -> None:
    """All requests share a long system prompt: they must not all pile onto its one holder."""
    system = long_prompt("sys", 400)
    post(router.url + "/v1/completions", {"model": FLEET, "prompt": system, "max_tokens": 1})
    guard0 = metric(router.admin, "cgn_router_saturation_guard_total", model=FLEET)

    async def burst() -> list[str]:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> str:
                body = {
                    "model": FLEET,
                    "prompt": f"{system} question {i} " + "more " * 60,
                    "max_tokens": 8,
                }
                async with s.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["x-cognitora-endpoint"]

            return await asyncio.gather(*(one(i) for i in range(24)))

    landed = asyncio.run(burst())
    counts = {e: landed.count(e) for e in set(landed)}
    assert len(counts) == 3 and max(counts.values()) <= 16, counts
    assert metric(router.admin, "cgn_router_saturation_guard_total", model=FLEET) > guard0


def test_cordoned_node_gets_no_traffic(router: Router, etcd_server: LocalEtcd) -> None:
    key = "/cognitora/cordon/node-a"
    etcd_run(etcd_server.endpoint, lambda c: c.put_json(key, {"reason": "test"}))
    try:
        until("cordon seen", lambda: endpoints(router)[f"{FLEET}/r0"]["cordoned"])
        for i in range(9):
            _, headers, _ = post(
                router.url + "/v1/completions", {"model": FLEET, "prompt": f"c{i}", "max_tokens": 1}
            )
            assert headers["x-cognitora-endpoint"] != f"{FLEET}/r0"
    finally:
        etcd_run(etcd_server.endpoint, lambda c: c.delete(key))
    until("cordon lifted", lambda: not endpoints(router)[f"{FLEET}/r0"]["cordoned"])


def test_routing_policy_from_etcd_is_applied_and_validated(
    router: Router, etcd_server: LocalEtcd
) -> None:
    key = "/cognitora/policy/routing"
    weights = lambda: get_json(router.admin + "/endpoints")["weights"]  # noqa: E731
    etcd_run(etcd_server.endpoint, lambda c: c.put_json(key, {"weights": {"kv_usage": 0.25}}))
    try:
        until("policy applied", lambda: weights()["kv_usage"] == 0.25)
        ignored = lambda: metric(router.admin, "cgn_router_records_ignored_total", kind="policy")  # noqa: E731
        before = ignored()
        etcd_run(etcd_server.endpoint, lambda c: c.put_json(key, {"weights": {"bogus": 1}}))
        until("the bad policy is counted as ignored", lambda: ignored() == before + 1)
        assert weights()["kv_usage"] == 0.25 and "bogus" not in weights()
        # a whole policy: the configured scorers replaced, the rest kept
        policy = {"scorers": [{"type": "load", "weight": 2.0}], "picker": "p2c"}
        etcd_run(etcd_server.endpoint, lambda c: c.put_json(key, policy))
        until("a whole policy applied", lambda: weights() == {"load": 2.0})
    finally:
        etcd_run(etcd_server.endpoint, lambda c: c.delete(key))
    until("policy reverted to the settings", lambda: weights()["kv_usage"] == 0.5)


def test_replica_removed_from_etcd_stops_receiving_traffic_within_its_ttl(
    router: Router, etcd_server: LocalEtcd, fleet: list[str]
) -> None:
    ttl = 2
    lease = etcd_run(etcd_server.endpoint, lambda c: c.lease_grant(ttl))
    granted = time.monotonic()
    register(etcd_server.endpoint, FLEET, "leased", fleet[0], "node-x", lease=lease)
    eid = f"{FLEET}/leased"
    until("leased endpoint seen", lambda: eid in endpoints(router))
    until("leased endpoint removed", lambda: eid not in endpoints(router), timeout_s=ttl + 5)
    assert (
        time.monotonic() - granted <= ttl + 1.5
    )  # etcd expires the lease; the watch removes it at once
    for i in range(12):
        _, headers, _ = post(
            router.url + "/v1/completions", {"model": FLEET, "prompt": f"l{i}", "max_tokens": 1}
        )
        assert headers["x-cognitora-endpoint"] != eid


def test_thousand_concurrent_streams_all_complete(router: Router) -> None:
    async def run() -> list[int]:
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

            async def one(i: int) -> int:
                body = {"model": FLEET, "prompt": f"stream {i}", "max_tokens": 4, "stream": True}
                tokens = 0
                async with s.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            tokens += bool(json.loads(line[6:])["choices"])
                        elif line.startswith(b"data: [DONE]"):
                            return tokens
                return -1  # no [DONE]

            return await asyncio.gather(*(one(i) for i in range(1000)))

    done = asyncio.run(run())
    assert done.count(4) + done.count(5) == 1000, {n: done.count(n) for n in set(done)}


# ---- failures ------------------------------------------------------------------------


@pytest.fixture
def victims(
    tmp_path: Path, etcd_server: LocalEtcd, router: Router
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Two slow sim engines under their own model name, for tests that kill one."""
    model = f"victims-{uuid.uuid4().hex[:6]}"
    with cgn_infer_engines(
        tmp_path, 2, "--backend", "sim", "--speed", "1", "--model-name", model
    ) as engines:
        for i, e in enumerate(engines):
            register(etcd_server.endpoint, model, f"v{i}", e.url, f"vnode-{i}")
        until("victims seen", lambda: len([k for k in endpoints(router) if model in k]) == 2)
        yield model, {f"{model}/v{i}": e for i, e in enumerate(engines)}
    etcd_run(
        etcd_server.endpoint, lambda c: c.delete(f"/cognitora/endpoints/{model}/", prefix=True)
    )


def serving(router: Router, model: str) -> str:
    """The endpoint that has our one request in flight."""
    found: list[str] = []

    def check() -> bool:
        found[:] = [k for k, e in endpoints(router).items() if model in k and e["in_flight"]]
        return len(found) == 1

    until("the request is in flight", check)
    return found[0]


def test_engine_killed_before_the_first_byte_is_retried_elsewhere(
    router: Router, victims: tuple[str, dict[str, Any]]
) -> None:
    model, procs = victims
    # NOTE: the schema (a string no 60 tokens can finish) must reach the engine that retries
    long_string = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "minLength": 2000}}}  # fmt: skip
    body = {"model": model, "prompt": "a long answer", "max_tokens": 60, "ignore_eos": True,
            "response_format": long_string}  # fmt: skip
    result: list[Any] = []

    async def call() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=body) as r,
        ):
            result.append((r.status, r.headers.get("x-cognitora-endpoint"), await r.json()))

    async def scenario() -> None:
        task = asyncio.create_task(call())
        victim = await asyncio.to_thread(serving, router, model)
        procs[victim].proc.kill()  # non-streaming: nothing has reached the client yet
        await task
        result.append(victim)

    asyncio.run(scenario())
    (status, landed, doc), victim = result
    assert status == 200 and landed != victim and doc["usage"]["completion_tokens"] == 60
    assert doc["choices"][0]["text"].startswith('"')
    assert endpoints(router)[victim]["breaker"] == "open"


def test_engine_killed_after_the_first_byte_the_stream_goes_on_elsewhere(
    router: Router, client: openai.OpenAI, victims: tuple[str, dict[str, Any]]
) -> None:
    """The other sim engine continues the answer (request migration: tests/test_migration.py
    checks the text on real engines); the client sees one stream with the true usage."""
    model, procs = victims
    before = metric(router.admin, "cgn_router_migrations_total", model=model, result="continued")
    stream = client.completions.create(
        model=model,
        prompt="stream then die",
        max_tokens=100,  # ~6 s at sim speed 1: the kill lands mid-answer even on a busy machine
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)  # the first byte reached the client
    procs[serving(router, model)].proc.kill()
    rest = list(it)
    assert {c.id for c in rest} == {first.id}
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 100
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    after = metric(router.admin, "cgn_router_migrations_total", model=model, result="continued")
    assert after == before + 1


def test_client_disconnect_cancels_the_generation_upstream(
    router: Router, victims: tuple[str, dict[str, Any]]
) -> None:
    model, engines = victims
    before = metric(
        router.admin, "cgn_router_requests_total", model=model, outcome="client_disconnected"
    )
    body = {
        "model": model,
        "prompt": "go on",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }

    async def read_one_chunk_and_leave() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=body) as resp,
        ):
            await resp.content.readline()

    asyncio.run(read_one_chunk_and_leave())
    started = time.monotonic()
    until("the router's request ended", lambda: not any(
        e["in_flight"] for k, e in endpoints(router).items() if model in k
    ))  # fmt: skip
    for e in engines.values():  # 400 tokens at sim speed 1 would take ~25 s
        until("the engine stopped generating", lambda e=e: engine_running(e.url) == 0)
    assert time.monotonic() - started < 10
    after = metric(
        router.admin, "cgn_router_requests_total", model=model, outcome="client_disconnected"
    )
    assert after == before + 1


def engine_running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    return -1.0


def test_kv_view_resyncs_when_an_engine_restarts(
    tmp_path: Path, router: Router, etcd_server: LocalEtcd
) -> None:
    """The engine comes back empty on the same URL: the router must drop what it knew."""
    from cgn_core.etcd.local import free_port

    model, port = f"restart-{uuid.uuid4().hex[:6]}", free_port()
    args = (*SIM, "--model-name", model, "--port", str(port))
    eid = f"{model}/r0"
    try:
        with cgn_infer_engines(tmp_path, 1, *args) as (engine,):
            register(etcd_server.endpoint, model, "r0", engine.url, "node-r")
            until("endpoint seen", lambda: eid in endpoints(router))
            post(
                router.url + "/v1/completions",
                {"model": model, "prompt": long_prompt("r"), "max_tokens": 1},
            )
            until("blocks known", lambda: endpoints(router)[eid]["kv_blocks"]["exact"] >= 16)
            resyncs = metric(router.admin, "cgn_router_kv_resyncs_total", endpoint=eid)
        with cgn_infer_engines(tmp_path, 1, *args):  # same port, an empty KV pool
            until(
                "fresh snapshot",
                lambda: metric(router.admin, "cgn_router_kv_resyncs_total", endpoint=eid) > resyncs,
            )
            assert endpoints(router)[eid]["kv_blocks"]["exact"] == 0
    finally:
        etcd_run(
            etcd_server.endpoint, lambda c: c.delete(f"/cognitora/endpoints/{model}/", prefix=True)
        )
