"""The router's pure state: breaker, metric scraping, registry, catalog, prompt hashing
(the KV index: test_kv_index.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cgn_core.kv.blockhash import block_hashes
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_router.catalog import entry_from_etcd
from cgn_router.daemon import scrape_plan
from cgn_router.endpoint_records import endpoint_from_etcd
from cgn_router.prompts import PromptHasher
from cgn_router.registry import LoadOrder, Registry
from cgn_router.routing.breaker import Breaker
from cgn_router.routing.chain import RoutingChain
from cgn_router.routing.kv_index import PrefixIndex
from cgn_router.scrape import engine_load, name_map, parse_samples
from cgn_router.sessions import Sessions
from cgn_router.settings import BreakerSettings, RoutingSettings, ScrapeSettings
from cgn_router.types import DEFAULT_SPEED, Endpoint, EndpointId, EngineLoad, RequestInfo

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]
E = EndpointId("m/r1")
H = [bytes([i]) * 32 for i in range(6)]

# ---- breaker ---------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_probes_once() -> None:
    b = Breaker(failures_to_open=2, open_s=5.0)
    b.on_failure(0.0)
    assert not b.blocks(0.1)
    b.on_success()  # resets the count
    b.on_failure(1.0)
    assert not b.blocks(1.0) and b.state(1.0) == "closed"
    b.on_failure(2.0)
    assert b.blocks(2.0) and b.state(6.9) == "open"
    assert not b.blocks(7.0) and b.state(7.0) == "half_open"
    b.on_attempt(7.0)  # the probe
    assert b.blocks(7.1)  # only one probe at a time
    b.on_failure(7.5)  # the probe failed: open again for open_s
    assert b.blocks(12.4) and not b.blocks(12.5)
    b.on_attempt(12.5)
    b.on_success()
    assert b.state(12.6) == "closed" and not b.blocks(12.6)


# ---- scraping (recorded /metrics pages) ------------------------------------------


def test_scrape_cgn_infer_page_recorded_under_load() -> None:
    text = (FIXTURES / "metrics_cgn_infer.txt").read_text()
    assert engine_load(text, name_map("cgn-infer"), now=5.0) == EngineLoad(
        2.0, 1.0, 0.00390625, 5.0
    )


def test_scrape_llamacpp_page_recorded_under_load() -> None:
    text = (FIXTURES / "metrics_llamacpp.txt").read_text()
    load = engine_load(text, name_map("llamacpp"), now=1.0)
    assert load == EngineLoad(running=2.0, waiting=1.0, kv_usage=0.0, scraped_at=1.0)


def test_scrape_sums_label_sets_and_takes_the_first_name_present() -> None:
    text = (
        "# HELP x\n"
        'sglang:num_running_reqs{tp_rank="0"} 3\n'
        'sglang:num_running_reqs{tp_rank="1"} 2\n'
        "sglang:num_queue_reqs 4\n"
        'sglang:token_usage{model_name="a b"} 0.5\n'
        "sglang:num_queue_reqs_total NaN\n"
    )
    assert engine_load(text, name_map("sglang"), now=0) == EngineLoad(5, 4, 0.5, 0)
    assert parse_samples('vllm:gpu_cache_usage_perc{a="}"} 0.7', {"vllm:gpu_cache_usage_perc"})
    v0 = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.7\n"  # vLLM v0's name
    assert engine_load(v0, name_map("vllm"), now=0) == EngineLoad(1, 0, 0.7, 0)
    assert engine_load("unrelated_metric 1\n", name_map("vllm"), now=0) is None


# ---- registry --------------------------------------------------------------------


def test_endpoint_from_etcd_defaults_and_errors() -> None:
    value = json.dumps({"url": "http://10.0.0.5:8001/", "engine": "cgn-infer", "node": "n1"})
    ep = endpoint_from_etcd("/cognitora/endpoints/m/r1", value.encode())
    assert ep == Endpoint(
        E, "m", "http://10.0.0.5:8001", node="n1", kv_events_url="http://10.0.0.5:8001/v1/kv/events"
    )
    vllm = endpoint_from_etcd(
        "/cognitora/endpoints/m/r2", b'{"url": "http://h:1", "engine": "vllm"}'
    )
    assert vllm.kv_events_url == ""  # approximate tracking
    agent = endpoint_from_etcd("/cognitora/endpoints/n1/m/r4", b'{"url": "http://h:1"}')
    assert (agent.id, agent.model, agent.node) == ("m/n1.r4", "m", "n1")  # an agent's layout
    odd = b'{"url": "http://h:1", "block_size": 32}'  # its hashes cannot be ours
    assert endpoint_from_etcd("/cognitora/endpoints/m/r3", odd).kv_events_url == ""
    for key, value_, message in [
        ("/cognitora/endpoints/r1", b"{}", "expected /cognitora/endpoints/<node>/<model>/<repl"),
        ("/cognitora/endpoints/n1/m/r/x", b"{}", "expected /cognitora/endpoints/<node>/<model>/"),
        (
            "/cognitora/endpoints/n1/m/r",
            b'{"url": "http://x", "node": "n2"}',
            "the record names node 'n2', the key 'n1'",
        ),
        ("/cognitora/endpoints/m/r", b"not json", "not JSON"),
        ("/cognitora/endpoints/m/r", b"[]", "must be a JSON object"),
        ("/cognitora/endpoints/m/r", b'{"url": "ftp://x"}', "'url' must be an http"),
        ("/cognitora/endpoints/m/r", b'{"url": "http://x", "role": "x"}', "'role' must be"),
        ("/cognitora/endpoints/m/r", b'{"url": "http://x", "block_size": "16"}', "block_size"),
    ]:
        with pytest.raises(ValueError, match=message):
            endpoint_from_etcd(key, value_)


def test_registry_keeps_live_state_across_updates() -> None:
    idx = PrefixIndex(60, 100, 1)
    reg = Registry(BreakerSettings(), idx, Sessions(60), stale_s=5)
    ep = Endpoint(E, "m", "http://a")
    assert reg.upsert(ep, "etcd")
    state = reg.states[E]
    state.in_flight, state.load = 3, EngineLoad(1, 0, 0, scraped_at=0)
    idx.snapshot(E, 0, H[:2])
    assert not reg.upsert(Endpoint(E, "m", "http://a", node="n2"), "etcd")  # a field changed
    assert reg.states[E] is state and state.in_flight == 3 and idx.match(E, H, 0) == 2
    reg.upsert(Endpoint(E, "m", "http://b"), "etcd")  # another engine behind the same id
    assert state.load is None and idx.match(E, H, 0) == 0
    # views: stale load is not trusted; cordon and session ownership are resolved
    state.load = EngineLoad(1, 0, 0, scraped_at=0)
    reg.cordoned = {"n9"}
    reg.sessions.record("s", E, now=0)
    (v,) = reg.views(RequestInfo("m", session="s"), now=4)
    assert v.load is not None and v.session_owner and not v.cordoned
    (v,) = reg.views(RequestInfo("m"), now=6)
    assert v.load is None and not v.session_owner
    assert reg.views(RequestInfo("other"), now=0) == []
    assert reg.replace_source("etcd", []) == [E] and reg.states == {}


@pytest.mark.parametrize(
    ("first_byte", "outcome", "failures"),
    [
        (True, "ok", 0),
        (True, "client_error", 0),
        (True, "client_disconnected", 0),
        (True, "upstream_error", 1),  # broke mid-stream: the engine's fault
        (False, "failed", 1),  # refused or dropped before the first byte
        (False, "busy", 0),  # 429: busy is not broken
        (False, "client_disconnected", 0),
    ],
)
def test_a_lease_holds_an_attempts_accounting_until_it_ends(
    first_byte: bool, outcome: str, failures: int
) -> None:
    idx = PrefixIndex(60, 100, 1)
    reg = Registry(BreakerSettings(failures=1, open_s=5), idx, Sessions(60), stale_s=5)
    reg.upsert(Endpoint(E, "m", "http://a"), "etcd")
    state = reg.states[E]
    req = RequestInfo("m", blocks=tuple(H[:4]), prompt_tokens=4 * 16 + 5, session="s")
    (view,) = reg.views(req, now=0)
    lease = reg.begin(view, req, now=0)
    assert (state.in_flight, state.pending_prefill) == (1, 4 * 16 + 5)  # nothing cached yet
    assert idx.match(E, req.blocks, 0.5) == 4 and reg.sessions.owner("s", 0.5) == E
    (again,) = reg.views(req, now=0.5)  # optimistic: the next one expects 4 blocks there
    second = reg.begin(again, req, now=0.5)
    assert (second.predicted, second.uncached) == (64, 5) and state.pending_prefill == 74
    second.end("ok", 0.6)
    if first_byte:
        lease.first_byte(1.0)
        lease.first_byte(1.5)  # once only
        assert lease.first_byte_at == 1.0 and state.pending_prefill == 0
    lease.end(outcome, 2.0)  # type: ignore[arg-type]
    lease.end(outcome, 2.0)  # type: ignore[arg-type]  # twice: counted once
    assert (state.in_flight, state.pending_prefill) == (0, 0)
    assert state.breaker.blocks(2.0) == (failures == 1)


def test_a_late_stream_says_its_replica_is_slower_than_learned() -> None:
    """`lag`: the oldest stream waiting for its first byte, its wait over what the replica's
    speed predicted for it; 1 when none is late, and back to 1 once it has its byte."""
    reg = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), stale_s=5)
    reg.upsert(Endpoint(E, "m", "http://a"), "etcd")
    req = RequestInfo("m", prompt_tokens=980)  # the default speed: 0.02 + 0.98 = 1 s
    whole = reg.begin(reg.views(req, now=0)[0], req, now=0)  # not streamed: not watched
    assert reg.views(req, now=5)[0].lag == 1.0
    whole.end("ok", 5)
    first = reg.begin(reg.views(req, now=10)[0], req, now=10, streamed=True)
    assert first.expected(DEFAULT_SPEED) == pytest.approx(1.0)
    second = reg.begin(reg.views(req, now=10.5)[0], req, now=10.5, streamed=True)
    # behind what is left of the first's prefill: 0.48 s
    assert second.expected(DEFAULT_SPEED) == pytest.approx(1.48 + DEFAULT_SPEED.ttft_per_other_s)
    assert [reg.views(req, now=t)[0].lag for t in (10.5, 13.0)] == pytest.approx([1.0, 3.0])
    first.first_byte(13.0)  # the second is the oldest now: 2.5 s waited of 1.48 predicted
    assert reg.views(req, now=13.0)[0].lag == pytest.approx(2.5 / 1.48)
    second.end("failed", 13.5)
    assert reg.views(req, now=20)[0].lag == 1.0 and not reg.states[E].waiting


def test_the_drain_clock_counts_what_is_left_to_compute() -> None:
    """Queued prefill drains as time passes at the replica's speed (pending_prefill, in
    tokens, only falls at first bytes); a first byte resets it to what came after."""
    reg = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), stale_s=5)
    reg.upsert(Endpoint(E, "m", "http://a"), "etcd")
    big, small = RequestInfo("m", prompt_tokens=4000), RequestInfo("m", prompt_tokens=1000)
    a = reg.begin(reg.views(big, now=0)[0], big, now=0, streamed=True)  # 4 s at 1 ms a token
    b = reg.begin(reg.views(small, now=1)[0], small, now=1, streamed=True)  # done at 5 s
    assert b.ahead == 3000  # a's 4000 tokens, one second of them computed
    queued = [reg.views(small, now=t)[0].queued_tokens for t in (1, 3, 4)]
    assert queued == pytest.approx([4000, 2000, 1000])
    # a late (6 s waited of 4.02 predicted): the clock drains that much slower
    assert reg.views(small, now=6)[0].queued_tokens == pytest.approx(4000 - 5000 * 4.02 / 6)
    assert reg.views(small, now=3)[0].pending_prefill == 5000  # tokens: until first bytes
    a.first_byte(2.0)  # twice as fast as predicted: b's 1000 tokens are what is left
    assert reg.views(small, now=2)[0].queued_tokens == pytest.approx(1000)
    b.end("client_disconnected", 2.5)  # never ran: its prefill leaves the clock
    assert reg.views(small, now=2.5)[0].queued_tokens == pytest.approx(0)


def test_workers_see_each_others_requests_on_an_endpoint() -> None:
    """Two workers' registries on one shared table: a lease in one is in the other's view
    (requests in flight, pending prefill) until it ends; a restarted worker's are gone."""
    import os

    from cgn_router.workers import shared

    fd = shared.create(shared.LOAD, 2)
    tables = [shared.SharedLoad(fd, 2, w) for w in (0, 1)]
    try:
        one, two = (Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), 5,
                             shared=t) for t in tables)  # fmt: skip
        for reg in (one, two):
            reg.upsert(Endpoint(E, "m", "http://a"), "etcd")
        req = RequestInfo("m", blocks=tuple(H[:2]), prompt_tokens=40)
        lease = one.begin(one.views(req, now=0)[0], req, now=0)
        (seen,) = two.views(req, now=0)
        assert (seen.in_flight, seen.pending_prefill) == (1, 40)
        assert two.states[E].in_flight == 0  # its own count: none
        lease.first_byte(0.1)
        assert two.views(req, now=0.1)[0].pending_prefill == 0
        again = two.begin(two.views(req, now=0.2)[0], req, now=0.2)
        assert one.views(req, now=0.2)[0].in_flight == 2
        lease.end("ok", 0.3)
        assert two.views(req, now=0.3)[0].in_flight == 1
        assert again.state.in_flight == 1  # worker 1 dies with it in flight, and restarts:
        tables.append(shared.SharedLoad(fd, 2, 1))
        assert one.views(req, now=0.4)[0].in_flight == 0
    finally:
        for t in tables:
            t.close()
        os.close(fd)


def test_registry_groups_endpoints_by_model() -> None:
    reg = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), stale_s=5)
    a, b = Endpoint(E, "m", "http://a"), Endpoint(EndpointId("n/r1"), "n", "http://b")
    reg.replace_source("etcd", [a, b])
    assert reg.models() == {"m", "n"} and reg.serves("n")
    assert [v.id for v in reg.views(RequestInfo("n"), now=0)] == ["n/r1"]
    reg.remove(b.id)
    assert reg.models() == {"m"} and not reg.serves("n") and reg.views(RequestInfo("n"), 0) == []


def test_a_request_for_an_adapter_sees_only_the_endpoints_that_loaded_it() -> None:
    """#60: in the registry's views, not in a filter a routing policy could leave out; an
    endpoint record lists its adapters (bounded, distinct names) or is refused."""
    reg = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), stale_s=5)
    key = "/cognitora/endpoints/n1/m/"
    both = endpoint_from_etcd(key + "a", b'{"url": "http://a", "adapters": ["sql", "fr"]}')
    one = endpoint_from_etcd(key + "b", b'{"url": "http://b", "adapters": ["sql"]}')
    none = endpoint_from_etcd(key + "c", b'{"url": "http://c"}')
    reg.replace_source("etcd", [both, one, none])
    for adapter, seen in ((None, {both, one, none}), ("sql", {both, one}), ("fr", {both}),
                          ("de", set())):  # fmt: skip
        views = reg.views(RequestInfo("m", adapter=adapter), now=0)
        assert {v.endpoint for v in views} == seen, adapter
        assert len(reg.views(RequestInfo("m", adapter=adapter), now=0, picks=1)) <= len(seen)
    assert both.adapters == ("sql", "fr")  # its own order: llama.cpp's ids
    for bad in ('"sql"', '["sql", "sql"]', '["../x"]', "[1]", json.dumps(["a"] * 300)):
        with pytest.raises(ValueError, match="'adapters' must list"):
            endpoint_from_etcd(key + "d", b'{"url": "http://d", "adapters": %s}' % bad.encode())


def test_the_catalogs_adapters_are_names_clients_use_for_their_base() -> None:
    """cgn-ctl's `adapters` mapping as the router reads it back: names, checked; a name
    that is a model's or an alias means that model."""
    import asyncio

    from cgn_router.catalog import Catalog

    entry = entry_from_etcd("m", {"adapters": {"sql": {"source": "/a.gguf"}, "fr": {}}})
    assert entry.adapters == ("fr", "sql")
    for bad in ({"../x": {}}, {"m": {}}, ["a"] * 300, "sql"):
        with pytest.raises(ValueError, match="adapter"):
            entry_from_etcd("m", {"adapters": bad})

    async def mapped() -> dict[str, str]:
        cat = Catalog(64)
        cat.set_source("etcd", {"m": entry, "n": entry_from_etcd("n", {"aliases": ["fr"]})})
        return dict(cat.adapters())

    assert asyncio.run(mapped()) == {"sql": "m"}


def test_a_large_model_is_scored_over_a_short_list() -> None:
    """Past `limit` endpoints a request sees the ones holding most of its prompt, the least
    loaded and its session's owner; the pipeline's pick is the one full scoring makes."""
    reg = Registry(BreakerSettings(), PrefixIndex(60, 100, 1), Sessions(60), stale_s=5)
    eps = [Endpoint(EndpointId(f"m/e{i:03}"), "m", f"http://h{i}") for i in range(200)]
    reg.replace_source("etcd", eps)
    for i, ep in enumerate(eps):
        reg.states[ep.id].in_flight = 0 if i == 150 else 5 + i % 7  # every endpoint busy but one
        reg.requeue(reg.states[ep.id], now=0)  # as a scrape or a lease would
    reg.index.snapshot(EndpointId("m/e077"), 1, H[:4])  # one holds the prompt
    reg.index.snapshot(EndpointId("m/e033"), 1, H[:2])
    reg.sessions.record("s", EndpointId("m/e199"), now=0)
    req = RequestInfo("m", blocks=tuple(H), prompt_tokens=96, session="s")
    short = reg.views(req, now=1, picks=8)
    ids = [v.id for v in short]
    assert len(ids) <= 17 and {"m/e077", "m/e033", "m/e150", "m/e199"} <= set(ids)
    assert ids == [v.id for v in reg.views(req, now=1, picks=8)]  # the same list each time
    full = reg.views(req, now=1)
    assert len(full) == 200
    rng = random.Random(0)
    pipeline = RoutingChain.from_settings(RoutingSettings())
    assert (
        pipeline.route(req, short, rng).chosen == pipeline.route(req, full, rng).chosen == "m/e077"
    )
    # the load order follows leases: e150 is no longer among the least loaded holding six
    (e150,) = [v for v in full if v.id == "m/e150"]
    leases = [reg.begin(e150, req, now=1) for _ in range(6)]
    assert "m/e150" not in reg.load_order["m"].least(16)
    for lease in leases:
        lease.end("ok", now=2)
    assert reg.load_order["m"].least(1) == ["m/e150"]


def test_load_order_keeps_the_least_loaded_first() -> None:
    order = LoadOrder()
    for name, queue in (("a", 3), ("b", 0), ("c", 1), ("d", 0)):
        order.place(EndpointId(name), queue)
    assert order.least(3) == ["b", "d", "c"] and order.least(10) == ["b", "d", "c", "a"]
    order.place(EndpointId("b"), 5)  # busier now: to the back
    order.remove(EndpointId("d"))
    assert order.least(10) == ["c", "a", "b"] and order.least(0) == []


@pytest.mark.parametrize(
    ("endpoints", "period", "slices"),
    [
        (0, 1.0, 1),
        (4, 1.0, 4),  # a pass every interval, in slices 0.1 s apart
        (100, 1.0, 10),
        (1000, 10.0, 100),  # 100 scrapes a second at most: each endpoint every 10 s
        (5000, 50.0, 500),
    ],
)
def test_scrapes_are_spread_and_bounded_per_second(
    endpoints: int, period: float, slices: int
) -> None:
    assert scrape_plan(endpoints, ScrapeSettings()) == (period, slices)


def test_catalog_entry_from_etcd() -> None:
    entry = entry_from_etcd(
        "m", {"aliases": ["a"], "fallbacks": ["f"], "source": {"gguf": "/x.gguf"}}
    )
    assert (entry.aliases, entry.fallbacks, str(entry.tokenizer)) == (("a",), ("f",), "/x.gguf")
    with pytest.raises(ValueError, match="'aliases' must be a list of names"):
        entry_from_etcd("m", {"aliases": "a"})


# ---- prompt hashing ------------------------------------------------------------------


def test_hashes_by_tokenizer_equal_the_engines(smollm2_gguf: GGUFFile) -> None:
    codec = PromptCodec.from_gguf(smollm2_gguf)
    hasher = PromptHasher("m", codec)
    body = {"messages": [{"role": "user", "content": "word " * 100}]}
    got = hasher.hash("chat", body)
    ids = codec.encode_chat(body["messages"])  # what cgn-infer runs on
    assert got.method == "tokenizer" and got.tokens == len(ids)
    assert list(got.blocks) == block_hashes(ids, "m") and len(got.blocks) == len(ids) // 16
    by_ids = hasher.hash("completion", {"prompt": ids})
    assert by_ids.method == "token_ids" and by_ids.blocks == got.blocks


def test_character_blocks_without_a_tokenizer() -> None:
    hasher = PromptHasher("m", None, chars_per_block=64)
    a = hasher.hash("completion", {"prompt": "x" * 200})
    b = hasher.hash("completion", {"prompt": "x" * 130 + "y" * 70})
    assert a.method == "chars" and len(a.blocks) == 3 and a.tokens == 50
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    chat = hasher.hash("chat", {"messages": [{"role": "user", "content": "hi " * 40}]})
    assert chat.method == "chars" and len(chat.blocks) == 1
    # bodies the engine will judge: routed without blocks
    assert hasher.hash("chat", {"messages": "nope"}).method == "none"
    assert hasher.hash("completion", {"prompt": [1.5]}).method == "none"


# ---- the command line ------------------------------------------------------------------


def _router(*argv: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "cgn-router")
    return subprocess.run([exe, *argv], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("yaml_text", "extra", "message"),
    [
        ("", ("--static",), "discovery is 'static' but no endpoints are configured"),
        ("endpoints: {a: {url: 'ftp://x', model: m}}\n", (), "endpoints.a: 'url' must be an http"),
        ("endpoints: {a: {url: 'http://x'}}\n", (), "endpoints.a.model is required"),
        (
            "routing: {scorers: [{type: prefix, weight: -1}]}\n",
            (),
            "routing.scorers.weight must be in [0, 1000000000], got -1.0",
        ),
        (
            "routing: {scorers: [{type: prefix, params: {ram_weight: 2}}]}\n",
            (),
            "routing: scorer 'prefix': ram_weight must be between 0 and 1",
        ),
        (
            "routing: {scorers: [{type: cache}]}\n",
            (),
            "routing: unknown scorer 'cache' (known: affinity, efficiency, kv_usage, load, prefix, time)",
        ),
        ("routing: {picker: best}\n", (), "routing: unknown picker 'best'"),
        ("routing: {prefix: 3}\n", (), "routing.prefix: unknown key"),
        ("deadlines: {idle_s: 0}\n", (), "deadlines.idle_s must be in [0.01, 86400], got 0.0"),
        (
            "epp: {enabled: true}\nworkers: 4\n",
            (),
            "epp.enabled: the endpoint picker runs in a single router process",
        ),
        ("epp: {port: 70000}\n", ("--epp",), "epp.port must be in [0, 65535]"),
    ],
)
def test_bad_router_settings_are_one_line_exit_2(
    tmp_path: Path, yaml_text: str, extra: tuple[str, ...], message: str
) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml_text)
    res = _router("serve", "--port", "0", "--admin-port", "0", "-c", str(cfg), *extra)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_shipped_router_configs_load() -> None:
    for name in ("router.yaml", "single-node.yaml"):
        res = _router("config", "--json", "-c", str(REPO / "configs" / name))
        assert res.returncode == 0, res.stderr
    single = json.loads(
        _router("config", "--json", "-c", str(REPO / "configs/single-node.yaml")).stdout
    )
    assert single["endpoints"]["local"]["url"] == "http://127.0.0.1:8001"


def test_router_without_etcd_is_alive_but_not_ready(tmp_path: Path) -> None:
    """etcd unreachable at start: /healthz 200, /readyz 503, requests a clear error; no crash."""
    from cgn_core.etcd.local import free_port
    from harness.procs import cgn_router

    dead = f"127.0.0.1:{free_port()}"
    with cgn_router(tmp_path, {"etcd": {"endpoints": [dead], "timeout_s": 0.5}}) as r:
        with urllib.request.urlopen(r.admin + "/healthz", timeout=5) as health:
            assert health.status == 200
        with pytest.raises(urllib.error.HTTPError) as ready:
            urllib.request.urlopen(r.admin + "/readyz", timeout=5)
        with ready.value as resp:
            assert resp.code == 503 and json.load(resp)["synced"] is False
        body = json.dumps({"model": "m", "prompt": "x"}).encode()
        req = urllib.request.Request(r.url + "/v1/completions", data=body)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        with err.value as resp:
            message = json.load(resp)["error"]["message"]
            assert resp.code == 404 and "'m' does not exist" in message
        assert r.proc.poll() is None
