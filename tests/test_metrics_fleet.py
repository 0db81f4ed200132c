"""cgn-metrics' arithmetic and discovery as tables: rings, counter increases across restarts,
histogram quantiles, energy per token (and `unavailable`), targets from etcd records."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from cgn_core.fleet_view import FleetView
from cgn_core.records import RecordLog
from cgn_metrics.fleet import Scraped, history_points, summarize
from cgn_metrics.scrape import parse
from cgn_metrics.series import Ring, increase, quantile
from cgn_metrics.targets import Fleet, Target, file_sd, fleet_from_records, static_targets

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def test_ring_keeps_the_last_points_in_order() -> None:
    r = Ring(3)
    assert r.last() is None and len(r) == 0
    for i in range(5):
        r.append(float(i), 10.0 * i)
    t, v = r.points()
    assert t.tolist() == [2.0, 3.0, 4.0] and v.tolist() == [20.0, 30.0, 40.0]
    assert r.points(since=3.0)[0].tolist() == [3.0, 4.0]
    assert r.last() == (4.0, 40.0)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], 0.0),
        ([5.0], 0.0),
        ([1.0, 3.0, 6.0], 5.0),
        ([10.0, 12.0, 2.0, 5.0], 2.0 + 2.0 + 3.0),  # restarted at 12 -> 2: 2 counted from zero
        ([7.0, 0.0, 0.0, 1.0], 1.0),
    ],
)
def test_counter_increase_counts_restarts_from_zero(values: list[float], expected: float) -> None:
    assert increase(values) == expected


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, {0.1: 0.0, 0.2: 10.0, math.inf: 10.0}, 0.15),
        (0.99, {0.1: 50.0, 1.0: 100.0, math.inf: 100.0}, 0.1 + 0.9 * 49 / 50),
        (0.5, {0.1: 0.0, math.inf: 4.0}, 0.1),  # all in +Inf: its lower bound
        (0.5, {0.1: 0.0, math.inf: 0.0}, None),  # nothing counted
        (0.5, {}, None),
    ],
)
def test_histogram_quantile(q: float, buckets: dict[float, float], expected: float | None) -> None:
    got = quantile(q, buckets)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_parse_keeps_the_fleets_families_only() -> None:
    text = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="m"} 12.0\n'
        'vllm:generation_tokens_created{model_name="m"} 1.7e9\n'
        "# TYPE python_gc_objects_collected counter\n"
        'python_gc_objects_collected_total{generation="0"} 5.0\n'
    )
    assert parse(text) == {("vllm:generation_tokens_total", (("model_name", "m"),)): 12.0}
    with pytest.raises(ValueError):
        parse("not { prometheus")


def scraped(target: Target, series: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]],
            times: list[float]) -> Scraped:  # fmt: skip
    s = Scraped(target, capacity=32, state="up")
    for i, t in enumerate(times):
        s.record(t, {k: v[i] for k, v in series.items()})
    return s


M = (("model_name", "m"),)
TIMES = [0.0, 10.0, 20.0, 30.0]


def engine(node: str, tokens: list[float], replica: str = "r") -> Scraped:
    return scraped(
        Target("engine", f"http://{node}:8000", node=node, model="m", replica=f"{node}.{replica}"),
        {("vllm:generation_tokens_total", M): tokens,
         ("vllm:prompt_tokens_total", M): [0.0, 10.0, 20.0, 30.0],
         ("vllm:num_requests_running", M): [1.0, 1.0, 2.0, 2.0],
         ("vllm:kv_cache_usage_perc", M): [0.1, 0.2, 0.3, 0.4],
         ("vllm:time_to_first_token_seconds_bucket", (*M, ("le", "0.1"))): [0, 5, 10, 15],
         ("vllm:time_to_first_token_seconds_bucket", (*M, ("le", "+Inf"))): [0, 5, 10, 20]},
        TIMES,
    )  # fmt: skip


def agent(node: str, joules: list[float], source: str = "rapl") -> Scraped:
    return scraped(
        Target("agent", f"http://{node}:9093", node=node),
        {("cgn_agent_power_watts", (("source", source),)): [30.0, 30.0, 30.0, 30.0],
         ("cgn_agent_energy_joules_total", ()): joules},
        TIMES,
    )  # fmt: skip


def view(*s: Scraped, fleet: Fleet | None = None) -> dict[str, Any]:
    """The view's JSON, as the dashboard and `cgn-ctl top` get it."""
    v = summarize(fleet or Fleet((), {}, {}), {x.target.id: x for x in s}, 30.0, 60.0)
    assert FleetView.from_json(v.to_json()) == v  # read back whole
    return v.to_json()


@pytest.mark.parametrize(
    ("engine_name", "page", "published"),
    [
        ("cgn-infer", "metrics_cgn_infer.txt",
         {"running", "waiting", "kv_usage", "prompt_tokens", "generation_tokens", "prefix_hits",
          "prefix_queries", "ttft", "itl"}),  # recorded before a request had finished
        ("llamacpp", "metrics_llamacpp.txt",  # recorded from llama.cpp's server (xllamacpp)
         {"running", "waiting", "prompt_tokens", "generation_tokens", "prefix_hits"}),
        ("mlx_lm", "metrics_mlx_lm.txt",  # recorded from cgn-agent's mlx_lm runner
         {"running", "prompt_tokens", "generation_tokens", "prefix_hits", "requests_done"}),
    ],
)  # fmt: skip
def test_each_engines_vocabulary_reads_its_own_page(
    engine_name: str, page: str, published: set[str]
) -> None:
    """One table (cgn_core/engine_metrics.py) for router, agent and cgn-metrics: on a page
    recorded from the engine, exactly the signals it publishes are found; the rest are
    None (shown as "—"), never 0."""
    from cgn_core.engine_metrics import NameMap

    text = (FIXTURES / page).read_text()
    s = scraped(Target("engine", "http://e:1", engine=engine_name), {k: [v] for k, v in
                parse(text).items()}, [0.0])  # fmt: skip
    signals = [f for f in NameMap.__dataclass_fields__ if f != "prompt_excludes_cached"]
    found = {sig for sig in signals if s.signal(sig) or s.signal(sig, "_bucket")}
    assert found == published
    v = view(s)
    (replica,) = v["replicas"]
    running, waiting = (s.gauge(s.signal(x) or "") for x in ("running", "waiting"))
    assert (replica["running"], replica["waiting"]) == (running, waiting) != (None, None)
    assert (replica["kv_usage"] is None) == ("kv_usage" not in published)


def test_a_metric_the_vocabulary_names_but_the_engine_lacks_is_a_warning_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """llama.cpp's current builds have no KV-use gauge (the table names its old one): one
    warning for the replica, not one per scrape, and a line when it appears."""
    from cgn_metrics.scrape import Scraper

    scraper = Scraper(None, timeout_s=1, concurrency=1, capacity=4)  # type: ignore[arg-type]
    s = Scraped(Target("engine", "http://l:1", replica="n1.r", engine="llamacpp"), 4)
    page = parse((FIXTURES / "metrics_llamacpp.txt").read_text())
    with caplog.at_level("INFO", logger="cgn_metrics.scrape"):
        for samples in (page, page, {**page, ("llamacpp:kv_cache_usage_ratio", ()): 0.5}):
            s.record(0.0, samples)
            scraper._check_vocabulary(s)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "publishes no kv_usage" in lines[0], lines
    assert lines[1] == "engine:n1.r publishes kv_usage again"


def test_energy_per_token_per_node_model_and_fleet() -> None:
    v = view(engine("a", [0, 100, 200, 300]), agent("a", [0, 300, 600, 900]),
             engine("b", [0, 50, 100, 150]), agent("b", [0, 100, 200, 300], source="nvidia"),
             engine("c", [0, 10, 20, 30]))  # fmt: skip
    nodes = {n["node"]: n for n in v["nodes"]}
    assert nodes["a"]["j_per_output_token"] == pytest.approx(900 / 300)
    assert nodes["a"]["j_per_token"] == pytest.approx(900 / 330)
    assert nodes["a"]["tokens_per_joule"] == pytest.approx(300 / 900)
    assert (nodes["a"]["source"], nodes["b"]["source"]) == ("rapl", "nvidia")
    # no agent on c: no figure, and it says so
    assert nodes["c"]["watts"] is None and nodes["c"]["source"] == "unavailable"
    assert nodes["c"]["j_per_output_token"] is None
    t = v["totals"]
    assert t["watts"] == 60.0 and t["energy_source"] == "nvidia+rapl"
    assert t["j_per_output_token"] == pytest.approx((900 + 300) / (300 + 150))  # measured nodes
    assert t["tokens_per_s"] == pytest.approx(480 / 30)
    (model,) = v["models"]
    assert model["j_per_output_token"] == pytest.approx((900 + 300) / 480)  # c's tokens count
    assert t["ttft_s"]["p50"] == pytest.approx(0.1 * 30 / 45)


def test_the_busiest_tenants_over_every_router_with_their_own_hit_rates() -> None:
    def router(host: str, acme: list[float], cached: list[float]) -> Scraped:
        def t(tenant: str, kind: str) -> tuple[str, tuple[tuple[str, str], ...]]:
            return "cgn_router_tenant_tokens_total", (("kind", kind), ("tenant", tenant))

        return scraped(
            Target("router", f"http://{host}:9091"),
            {t("acme", "prompt"): acme, t("acme", "completion"): [0, 10, 20, 30],
             t("acme", "cached"): cached, t("beta", "prompt"): [0, 1, 2, 3],
             t("beta", "completion"): [0, 0, 0, 0]},
            TIMES,
        )  # fmt: skip

    tenants = view(router("r1", [0, 100, 200, 300], [0, 50, 100, 150]),
                   router("r2", [0, 100, 200, 300], [0, 0, 0, 0]))["tenants"]  # fmt: skip
    assert [x["tenant"] for x in tenants] == ["acme", "beta"]  # busiest first
    acme = tenants[0]
    assert acme["tokens_per_s"] == pytest.approx((600 + 60) / 30)
    assert acme["hit_rate"] == pytest.approx(150 / 600)  # over both routers
    assert tenants[1]["hit_rate"] == 0.0


def test_each_replica_shows_the_speed_a_router_learned_of_it() -> None:
    """#57: the routers' learned speeds per endpoint (`<model>/<node>.<replica>`), in ms per
    token on the replica's row; a replica no router has learned yet shows no figure."""

    def router(host: str, learned: dict[str, float]) -> Scraped:
        series = {}
        for eid, flag in learned.items():
            lv = (("endpoint", eid), ("model", "m"))
            series[("cgn_router_endpoint_speed_learned", lv)] = [flag] * 4
            series[("cgn_router_endpoint_prefill_seconds_per_token", lv)] = [0.002] * 4
            series[("cgn_router_endpoint_decode_seconds_per_token", lv)] = [0.04] * 4
        return scraped(Target("router", f"http://{host}:9091"), series, TIMES)

    v = view(engine("a", [0, 1, 2, 3]), engine("b", [0, 1, 2, 3]),
             router("r1", {"m/a.r": 1.0, "m/b.r": 0.0}), router("r2", {"m/b.r": 0.0}))  # fmt: skip
    rows = {r["node"]: r for r in v["replicas"]}
    assert (rows["a"]["prefill_ms_per_token"], rows["a"]["decode_ms_per_token"]) == (
        pytest.approx(2.0), pytest.approx(40.0))  # fmt: skip
    assert rows["b"]["prefill_ms_per_token"] is None and rows["b"]["decode_ms_per_token"] is None


def test_each_replica_shows_the_adapters_it_holds_in_its_engines_vocabulary() -> None:
    """#60: cgn-infer's `cgn_infer_lora_loaded{adapter}` 1s; vLLM's newest
    `vllm:lora_requests_info` (older label sets linger; the value is when it was set);
    and what the endpoint record says it loaded at start. Bad names are left out."""

    def info(running: str, waiting: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        labels = (("max_lora", "4"), ("running_lora_adapters", running),
                  ("waiting_lora_adapters", waiting))  # fmt: skip
        return "vllm:lora_requests_info", labels

    def loaded(name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return "cgn_infer_lora_loaded", (("adapter", name),)

    infer = scraped(
        Target("engine", "http://a:8000", node="a", model="m", replica="a.r", engine="cgn-infer",
               adapters=("pinned",)),
        {("vllm:num_requests_running", M): [0.0] * 4, loaded("sql"): [1.0] * 4,
         loaded("gone"): [1.0, 1.0, 1.0, 0.0], loaded("../x"): [1.0] * 4},
        TIMES,
    )  # fmt: skip
    vllm = scraped(
        Target("engine", "http://b:8000", node="b", model="m", replica="b.r", engine="vllm"),
        {("vllm:num_requests_running", M): [0.0] * 4, info("old", ""): [1.7e9] * 4,
         info("fr,de", "it"): [1.8e9] * 4, info("nan", ""): [float("nan")] * 4},
        TIMES,
    )  # fmt: skip
    rows = {r["node"]: list(r["adapters"]) for r in view(infer, vllm)["replicas"]}
    assert rows == {"a": ["pinned", "sql"], "b": ["de", "fr", "it"]}


def test_counter_restarts_do_not_make_negative_energy_or_tokens() -> None:
    v = view(engine("a", [500, 600, 20, 120]), agent("a", [1000, 1300, 100, 400]))
    (node,) = v["nodes"]
    assert node["joules"] == pytest.approx(300 + 100 + 300)
    assert node["j_per_output_token"] == pytest.approx(700 / (100 + 20 + 100))


def test_no_power_source_anywhere_is_unavailable_not_zero() -> None:
    idle = scraped(
        Target("agent", "http://a:9093", node="a"),
        {("cgn_agent_replicas", ()): [1, 1, 1, 1]},
        TIMES,
    )
    v = view(engine("a", [0, 10, 20, 30]), idle)
    t = v["totals"]
    assert t["watts"] is None and t["j_per_output_token"] is None
    assert t["energy_source"] == "unavailable"
    points = history_points(FleetView.from_json(v))
    assert "fleet:watts" not in points and points["fleet:tokens_per_s"] == pytest.approx(1.0)


def test_a_down_agent_gives_no_figure() -> None:
    a = agent("a", [0, 300, 600, 900])
    a.state = "down"
    (node,) = view(engine("a", [0, 100, 200, 300]), a)["nodes"]
    assert node["agent"] == "down" and node["j_per_output_token"] is None


def rec(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_targets_and_node_states_from_etcd_records() -> None:
    nodes = {
        "/cognitora/nodes/n1": rec({"admin_url": "http://10.0.0.1:9093", "power": {"watts": 40}}),
        "/cognitora/nodes/n2": rec({"admin_url": "http://10.0.0.2:9093"}),
        "/cognitora/nodes/n3": rec({"admin_url": "ftp://nope"}),  # bad: skipped
        "/cognitora/nodes/n4": b"{not json",  # bad: skipped
    }
    endpoints = {
        "/cognitora/endpoints/n1/smol/r1": rec(
            {"url": "http://10.0.0.1:8001", "model": "smol", "api_token": "s3"}
        ),
        "/cognitora/endpoints/n5/smol/r2": rec({"url": "http://10.0.0.5:8001"}),
        "/cognitora/endpoints/manual/r3": rec({"url": "http://10.0.0.9:8001/v1"}),
        "/cognitora/endpoints/n1/smol/bad": rec({"url": 5}),
        "/cognitora/endpoints/a/b/c/d": rec({"url": "http://x:1"}),
    }
    kv = {"/cognitora/kvcached/n1": rec({"address": "10.0.0.1:7071",
                                         "events_url": "http://10.0.0.1:9094/v1/kv/events"})}  # fmt: skip
    cordons = {"/cognitora/cordon/n2": rec({"drain": True}), "/cognitora/cordon/n9": rec({})}
    scaling = {"/cognitora/scaling/smol": rec({"model": "smol", "desired": 3}),  # targets
               "/cognitora/scaling/pd/prefill": rec({"model": "pd", "role": "prefill", "desired": 1}),
               "/cognitora/scaling/pd/decode": rec({"model": "pd", "role": "decode", "desired": 2}),
               # a ":" is part of a model's name, not a pool's separator
               "/cognitora/scaling/qwen:0.5b": rec({"model": "qwen:0.5b", "desired": 2}),
               "/cognitora/scaling/bad": rec({"model": "bad", "desired": 10**400})}  # fmt: skip
    warnings: list[str] = []
    fleet = fleet_from_records(
        nodes, endpoints, kv, cordons, ["n6"], RecordLog(on_bad=warnings.append), scaling=scaling
    )
    ids = sorted(t.id for t in fleet.targets)
    assert ids == sorted([
        "agent:http://10.0.0.1:9093", "agent:http://10.0.0.2:9093", "engine:n1.r1", "engine:n5.r2",
        "engine:r3", "kvcached:http://10.0.0.1:9094",
    ])  # fmt: skip
    assert fleet.nodes == {"n1": "Ready", "n2": "Draining", "n5": "Lost", "n6": "Lost"}
    guarded = next(t for t in fleet.targets if t.id == "engine:n1.r1")
    assert guarded.token == "s3"  # scraped with it; shown nowhere
    assert "s3" not in repr(guarded) + file_sd(fleet.targets)
    assert fleet.replicas == {"smol": 2, "manual": 1}
    assert fleet.desired == {"smol": 3, "pd": 3, "qwen:0.5b": 2}  # pools add up
    assert sorted(warnings) == ["/cognitora/endpoints/n1/smol/bad", "/cognitora/nodes/n3",
                                "/cognitora/nodes/n4", "/cognitora/scaling/bad"]  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "target"),
    [
        ("router=http://r:9090/", Target("router", "http://r:9090")),
        ("engine@n1=https://e:8000/v1", Target("engine", "https://e:8000", node="n1")),
        ("http://x:1", Target("other", "http://x:1")),
    ],
)
def test_static_targets(entry: str, target: Target) -> None:
    assert static_targets([entry]) == [target]


@pytest.mark.parametrize("entry", ["robot=http://r:1", "router=r:9090", "file:///etc/passwd"])
def test_bad_static_targets_say_why(entry: str) -> None:
    with pytest.raises(ValueError, match="target"):
        static_targets([entry])


def test_file_sd_lists_every_target_with_its_labels() -> None:
    doc = json.loads(file_sd([Target("engine", "https://e:8443", node="n1", model="m", replica="n1.r"),
                              Target("router", "http://r:9090")]))  # fmt: skip
    assert doc == [
        {"targets": ["e:8443"], "labels": {"cgn_kind": "engine", "__scheme__": "https",
                                           "node": "n1", "model": "m", "replica": "n1.r"}},
        {"targets": ["r:9090"], "labels": {"cgn_kind": "router", "__scheme__": "http"}},
    ]  # fmt: skip


def exported_names() -> set[str]:
    """Every sample name our components export: an engine (recorded), an agent with power,
    a router, a KV store, and cgn-metrics' own fleet series."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cgn_kvcached.metrics import registry_for as kvcached_registry
    from cgn_metrics.server import fleet_text
    from cgn_router.metrics import RouterMetrics
    from harness.fake_agent import FakePower, fake_agent

    texts = [(FIXTURES / "metrics_cgn_infer.txt").read_text()]
    with fake_agent(FakePower(10.0)) as url:
        import httpx

        texts.append(httpx.get(url + "/metrics", timeout=10).text)
    texts.append(generate_latest(RouterMetrics().registry).decode())
    from cgn_core.kv.ram_tier import RamTier
    from cgn_core.kv.store import BlockStore

    texts.append(generate_latest(kvcached_registry(BlockStore(RamTier(1 << 20), None))).decode())
    v = view(engine("a", [0, 100, 200, 300]), agent("a", [0, 300, 600, 900]))
    texts.append(fleet_text(FleetView.from_json(v)))
    names = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            # a labelled family with no child yet exports no sample: its names by its type
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names.update(family.name + x for x in suffixes.get(family.type, [""]))
            names.update(s.name for s in family.samples)
    return names


def test_the_grafana_dashboard_queries_series_that_exist() -> None:
    doc = json.loads((REPO / "configs" / "grafana" / "cognitora-fleet.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\b(?:vllm:|cgn_)[a-z_:]+", e)}
    assert used and used <= exported_names(), used - exported_names()


async def test_a_scrape_is_bounded_before_it_is_held_or_inflated() -> None:
    """A real HTTP target on loopback: a gzip bomb (a 64 MB page in 64 KB), an endless plain
    page and an unknown encoding are each `down` with the reason, at once and without the
    page ever being held; a gzip page within the bound is scraped."""
    import gzip
    import time
    import tracemalloc
    import zlib

    import httpx
    from aiohttp import web

    from cgn_core.etcd.local import free_port
    from cgn_metrics.scrape import MAX_BYTES, Scraper

    deflate = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    bomb = b"".join(deflate.compress(bytes(1 << 20)) for _ in range(64)) + deflate.flush()
    page = b"# TYPE cgn_infer_running gauge\ncgn_infer_running 3\n"

    async def handle(request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        if kind.startswith("guarded") and request.headers.get("Authorization") != "Bearer s3":
            return web.Response(status=401)  # as llama.cpp answers without its --api-key
        if kind == "endless":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(4096):  # 4 GB if read to the end
                await resp.write(b"#" * (1 << 20))
            return resp
        body, encoding = {"bomb": (bomb, "gzip"), "good": (gzip.compress(page), "gzip"),
                          "br": (page, "br"), "guarded": (page, "identity"),
                          "guarded-nokey": (page, "identity")}[kind]  # fmt: skip
        return web.Response(body=body, headers={"Content-Encoding": encoding})

    app = web.Application()
    app.router.add_get("/{kind}/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with httpx.AsyncClient() as client:
            scraper = Scraper(client, timeout_s=30, concurrency=4, capacity=8)
            scraper.set_targets([Target("other", f"http://127.0.0.1:{port}/{k}")
                                 for k in ("bomb", "endless", "br", "good", "guarded-nokey")]
                                + [Target("engine", f"http://127.0.0.1:{port}/guarded",
                                          token="s3")])  # fmt: skip
            tracemalloc.start()
            started = time.monotonic()
            await scraper.round()
            took = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        await runner.cleanup()
    got = {s.target.url.rsplit("/", 1)[1]: s for s in scraper.scraped.values()}
    assert got["bomb"].state == "down" and "once decompressed" in got["bomb"].error
    assert got["endless"].state == "down" and f"over {MAX_BYTES} bytes" in got["endless"].error
    assert got["br"].state == "down" and "is not gzip or deflate" in got["br"].error
    assert got["good"].state == "up" and got["good"].latest
    assert got["guarded"].state == "up" and "HTTP 401" in got["guarded-nokey"].error
    assert took < 20 and peak < 6 * MAX_BYTES, (took, peak)
