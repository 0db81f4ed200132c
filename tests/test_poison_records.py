"""Nothing read from etcd is trusted: every record parser, the router's followers and the
reconciler take arbitrary JSON without raising anything but a ValueError-kind refusal.

Property tests (hypothesis) feed arbitrary JSON into every parser; table tests replay the
records that used to kill every router (an API key whose `limits` is a string, a replica
status whose `failures` is not a number) through the real follower handlers and the real
reconciler, and check that the good records around them still apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgn_agent.spec import parse_placement
from cgn_control.decide.catalog import parse_model
from cgn_control.decide.cluster import Snapshot, node_views
from cgn_control.decide.placement import node_view
from cgn_control.decide.reconciler import Memory, reconcile
from cgn_core import records
from cgn_core.apikeys import ApiKeyError, Limits, create, parse_record
from cgn_core.budgets import parse_tenant, parse_usage
from cgn_core.errors import CognitoraError
from cgn_core.etcd.types import KeyValue, WatchEvent
from cgn_core.kv.blockhash import tenant_salt
from cgn_router import fleetshare
from cgn_router.catalog import entry_from_etcd
from cgn_router.daemon import build_service
from cgn_router.endpoint_records import endpoint_from_doc
from cgn_router.followers import EtcdFollowers, routing_policy
from cgn_router.kv_follow import KvFollowers
from cgn_router.settings import ReconcilerSettings, RouterSettings
from cgn_router.upstream import Upstream

T = TypeVar("T")
# NOTE: huge integers and non-finite floats on purpose: a 400-digit integer once made
# float() raise OverflowError past every parser's except clause
NUMBERS = st.integers() | st.floats() | st.sampled_from([10**400, -(10**400), 10**309, 2**64])
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20,
)  # fmt: skip
FIELDS = st.sampled_from([
    "address", "events_url", "events_token",
    "phase", "reason", "failures", "log_tail", "model", "owner", "devices", "profile", "drain",
    "since_unix", "grace_s", "accelerators", "index", "accel_class", "health", "engines",
    "labels", "power", "watts", "id", "hash", "tenant", "band", "models", "admin", "limits",
    "rps", "tokens_per_min", "concurrent", "expires_unix", "url", "engine", "role", "node",
    "block_size", "aliases", "fallbacks", "tokenizer", "source", "weights", "prefix", "load",
    "budget", "tokens_per_day", "tokens_per_month", "joules_per_day", "writer", "day", "month",
    "used", "updated_unix", "adapters",
])  # fmt: skip
# Objects whose keys are the fields parsers read: arbitrary values where they look.
RECORDS = st.recursive(
    JSON,
    lambda inner: st.dictionaries(FIELDS, inner, max_size=8) | st.lists(inner, max_size=3),
    max_leaves=30,
)
REFUSALS = (ValueError, CognitoraError)
# One valid record of each kind: the property tests also corrupt these a field at a time,
# the way a buggy or hostile writer would (random objects rarely hold every required field).
VALID: dict[str, dict[str, Any]] = {
    "replica_status": {"phase": "Ready", "reason": "", "failures": 2, "log_tail": ["x"],
                       "adapters": ["sql", "fr"]},
    "placement": {"model": "m", "engine": "cgn_infer", "devices": [0], "owner": "reconciler",
                  "profile": {"ctx": 512, "extra_args": [], "env": {}}},
    "cordon": {"drain": True, "since_unix": 1.0, "grace_s": 30.0},
    "node_inventory": {"accelerators": [{"index": 0, "accel_class": "cpu", "health": []}],
                       "engines": ["cgn_infer"], "labels": {"fabric": "f"},
                       "power": {"watts": 5.0}},
    "api_key": create("acme", "gold", limits=Limits(5, 100, 2))[1].to_json(),
    "catalog_model": {"name": "m", "source": "smollm2", "replicas": {"min": 1, "max": 2},
                      "profiles": [{"engine": "cgn_infer", "accelerator": "cpu"}]},
    "router_catalog_entry": {"aliases": ["a"], "fallbacks": ["b"], "tokenizer": "t.gguf"},
    "endpoint": {"url": "http://127.0.0.1:1", "engine": "cgn-infer", "role": "both",
                 "block_size": 16},
    "policy": {"weights": {"prefix": 1.0, "load": 0.5}},
    "agent_placement": {"model": "m", "engine": "cgn_infer", "devices": [0],
                        "profile": {"ctx": 512, "extra_args": ["-x"], "env": {"A": "b"}}},
    "kvcached": {"address": "10.0.0.1:7071", "events_url": "http://10.0.0.1:9094/v1/kv/events",
                 "events_token": "t"},
    "efficiency": {"tokens_per_joule": 2.5, "source": "rapl", "window_s": 60.0,
                   "at_unix": 1.7e9},
    "scaling": {"model": "m", "role": "decode", "desired": 3, "current": 2, "direction": "up",
                "reason": "demand 5", "demand": 5.0, "capacity": 2.0, "unit": "tokens/s", "at_unix": 1.7e9,
                "history": [{"desired": 2, "current": 1, "direction": "up", "at_unix": 1.6e9}]},
    "tenant": {"tenant": "acme", "budget": {"tokens_per_day": 1000, "joules_per_day": 2.5}},
    "usage": ["2026-12-06", 10, 20, 0.5],
    "waiting": {"queues": [["gold", "m", {"acme": 1.0, "beta": 2.0}]]},
}  # fmt: skip


@st.composite
def corrupted(draw: st.DrawFn, kind: str) -> Any:
    """A valid record of `kind` with one or two fields, top-level or nested, replaced."""
    doc = json.loads(json.dumps(VALID[kind]))
    for _ in range(draw(st.integers(1, 2))):
        if isinstance(doc, list):  # a record that is a list (a usage count): its items
            paths: list[tuple[Any, Any]] = [(doc, i) for i in range(len(doc))]
        else:
            paths = [(doc, k) for k in doc] + [
                (v, k2) for v in doc.values() if isinstance(v, dict) for k2 in v
            ]
        if not paths:
            break
        parent, key = draw(st.sampled_from(paths))
        parent[key] = draw(JSON)
    return doc


PARSERS: dict[str, Callable[[Any], object]] = {
    "replica_status": records.replica_status,
    "placement": records.placement,
    "cordon": records.cordon,
    "node_inventory": lambda d: node_view("n", records.node_inventory(d)),
    "api_key": parse_record,
    "catalog_model": parse_model,
    "router_catalog_entry": lambda d: entry_from_etcd("m", d),
    "endpoint": lambda d: endpoint_from_doc("/cognitora/endpoints/m/r", d),
    "policy": routing_policy,
    "agent_placement": lambda d: parse_placement("r1", d),
    "kvcached": records.kvcached,
    "efficiency": lambda d: records.fresh_efficiency(records.efficiency(d), 1.7e9),
    "scaling": records.scaling,
    "tenant": parse_tenant,
    "usage": lambda d: parse_usage(d, "gw.w0/acme"),
    "waiting": fleetshare.parse,
}


@pytest.mark.parametrize("kind", sorted(PARSERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=RECORDS)
def test_every_parser_refuses_arbitrary_json_cleanly(kind: str, doc: Any) -> None:
    with contextlib.suppress(REFUSALS):
        PARSERS[kind](doc)


@pytest.mark.parametrize("kind", sorted(PARSERS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_parser_refuses_corrupted_records_cleanly(kind: str, data: st.DataObject) -> None:
    PARSERS[kind](VALID[kind])  # the unspoilt record parses
    with contextlib.suppress(REFUSALS):
        PARSERS[kind](data.draw(corrupted(kind)))


@settings(max_examples=60, deadline=None)
@given(
    statuses=st.lists(RECORDS, max_size=3),
    placements=st.lists(RECORDS, max_size=3),
    nodes=st.lists(RECORDS, max_size=2),
    cordons=st.lists(RECORDS, max_size=2),
)
def test_reconciler_survives_whatever_passes_validation(
    statuses: list[Any], placements: list[Any], nodes: list[Any], cordons: list[Any]
) -> None:
    def valid(docs: list[Any], parse: Callable[[Any], T]) -> list[T]:
        out = []
        for d in docs:
            with contextlib.suppress(REFUSALS):
                out.append(parse(d))
        return out

    ok_nodes = {f"n{i}": d for i, d in enumerate(valid(nodes, records.node_inventory))}
    snap = Snapshot(
        models={},
        nodes=ok_nodes,
        placements={("n0", f"r{i}"): d for i, d in enumerate(valid(placements, records.placement))},
        statuses={
            ("n0", f"r{i}"): d for i, d in enumerate(valid(statuses, records.replica_status))
        },
        cordons={f"n{i}": d for i, d in enumerate(valid(cordons, records.cordon))},
        wall=1000.0,
    )
    reconcile(snap, Memory(), 10.0, ReconcilerSettings())
    node_views(snap, {n: "ready" for n in ok_nodes})


# ---- the router's followers, with recorded key-values ---------------------------------------


def kv(key: str, value: object, rev: int = 1) -> KeyValue:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KeyValue(key, raw, rev, rev, 1, 0)


@pytest.fixture
def followers() -> EtcdFollowers:
    return EtcdFollowers(build_service(RouterSettings(discovery="etcd"), Upstream()))


def test_a_key_whose_limits_is_a_string_is_skipped_and_the_rest_apply(
    followers: EtcdFollowers, caplog: pytest.LogCaptureFixture
) -> None:
    _, good = create("acme", "gold")
    bad = {**good.to_json(), "id": "0badbad0", "limits": "lots"}
    listing = [kv("/cognitora/keys/0badbad0", bad), kv(f"/cognitora/keys/{good.id}", good.to_json()),
               kv("/cognitora/keys/deep", b"[" * 5000 + b"]" * 5000),
               kv("/cognitora/keys/bytes", b"\xff\xfe")]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        followers.keys_list(listing)
        followers.keys_list(listing)  # the same revisions again: not logged again
    assert set(followers.svc.keys.records) == {good.id}
    warned = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warned) == 3 and "limits" in warned[0], warned


def test_budgets_and_usage_follow_etcd_and_a_bad_record_is_skipped(
    followers: EtcdFollowers, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = followers.svc.ledger
    assert ledger is not None
    day = ledger.period.day
    with caplog.at_level(logging.WARNING):
        followers.usage_list([kv(f"/cognitora/usage/{ledger.writer}/acme", [day, 5, 5, 0]),
                              kv("/cognitora/usage/b.w0/acme", [day, 7, 7, 0]),
                              kv("/cognitora/usage/c.w0/acme", [day, 10**400, 0, 0]),
                              kv("/cognitora/usage/d.w0", [day, 7, 7, 0])])  # fmt: skip
    assert ledger.used("acme").tokens_day == 12  # its own (taken up again) and b's
    warned = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warned) == 2 and "not a count" in warned[0] and "<writer>/<tenant>" in warned[1]
    followers.tenants_list([kv("/cognitora/tenants/acme", VALID["tenant"]),
                            kv("/cognitora/tenants/evil", {"tenant": "acme"})])  # fmt: skip
    assert set(ledger.budgets) == {"acme"}
    followers.usage_event(WatchEvent("put", kv("/cognitora/usage/b.w0/acme",
                                               [day, 9, 9, 0], rev=2)))  # fmt: skip
    assert ledger.used("acme").tokens_day == 14  # b's record replaced, in the kept sum
    bad_edit = {"tenant": "acme", "budget": {"tokens_per_day": -1}}
    followers.tenants_event(WatchEvent("put", kv("/cognitora/tenants/acme", bad_edit, rev=2)))
    assert ledger.budgets == {}  # a budget edited into garbage limits nothing
    followers.usage_event(WatchEvent("delete", kv("/cognitora/usage/b.w0/acme", b"")))
    followers.usage_event(WatchEvent("delete", kv("/cognitora/usage/nonsense", b"")))
    assert ledger.used("acme").tokens_day == 5


def test_a_key_edited_into_garbage_loses_its_access(followers: EtcdFollowers) -> None:
    _, good = create("acme", "gold")
    key = f"/cognitora/keys/{good.id}"
    followers.keys_event(WatchEvent("put", kv(key, good.to_json())))
    assert good.id in followers.svc.keys.records
    followers.keys_event(WatchEvent("put", kv(key, {**good.to_json(), "limits": "x"}, rev=2)))
    assert good.id not in followers.svc.keys.records


def test_poison_endpoints_catalog_and_policy_are_skipped(followers: EtcdFollowers) -> None:
    svc = followers.svc
    good = {"url": "http://127.0.0.1:9", "engine": "cgn-infer"}
    followers.endpoints_list([
        kv("/cognitora/endpoints/m/ok", good),
        kv("/cognitora/endpoints/m/bad-url", {**good, "url": 5}),
        kv("/cognitora/endpoints/m/bad-block", {**good, "block_size": "16"}),
        kv("/cognitora/endpoints/m/not-json", b"{"),
    ])  # fmt: skip
    assert list(svc.registry.states) == ["m/ok"]
    followers.endpoints_event(WatchEvent("put", kv("/cognitora/endpoints/m/x", [1, 2])))
    assert list(svc.registry.states) == ["m/ok"]

    followers.catalog_list([
        kv("/cognitora/catalog/models/a", {"aliases": ["alpha"]}),
        kv("/cognitora/catalog/models/b", {"aliases": "beta"}),
        kv("/cognitora/catalog/models/c", {"tokenizer": 7}),
    ])  # fmt: skip
    assert set(svc.catalog.names()) >= {"a", "alpha"} and "b" not in svc.catalog.names()

    before = dict(svc.chain.weights)
    for doc in ({"weights": {"prefix": "x"}}, {"weights": {"nope": 1}}, {"weights": []},
                {"weights": {"prefix": 1e300}}, "prefix", {"scorers": [{"type": "nope"}]},
                {"scorers": [{"type": "prefix", "params": {"ram_weight": 2}}]},
                {"scorers": [{"type": "prefix", "params": {"bogus": 1}}]},
                {"scorers": [{"type": "load"}, {"type": "load"}]}, {"scorers": "prefix"},
                {"picker": "best"}, {"filters": ["model", "x"]}, {"scorer": []}):  # fmt: skip
        followers.policy_event(WatchEvent("put", kv("/cognitora/policy/routing", doc)))
    assert svc.chain.weights == before
    followers.policy_event(WatchEvent("put", kv("/cognitora/policy/routing", {"load": 2})))
    assert svc.chain.weights["load"] == 2.0
    policy = {"scorers": [{"type": "load", "weight": 2}, {"type": "load", "name": "l2"}],
              "picker": "p2c"}  # fmt: skip
    followers.policy_event(WatchEvent("put", kv("/cognitora/policy/routing", policy)))
    assert svc.chain.weights == {"load": 2.0, "l2": 1.0} and svc.chain.picker.name == "p2c"
    followers.policy_event(WatchEvent("delete", kv("/cognitora/policy/routing", b"")))
    assert svc.chain.weights == before


def test_a_cordon_with_an_unreadable_value_still_cordons(followers: EtcdFollowers) -> None:
    followers.cordon_list([kv("/cognitora/cordon/n1", {"drain": "yes"}),
                           kv("/cognitora/cordon/n2", b"")])  # fmt: skip
    assert followers.svc.registry.cordoned == {"n1", "n2"}


def test_a_status_whose_failures_is_not_a_number_is_left_out() -> None:
    """The reconciler's snapshot reader: the bad status is dropped, the good one kept."""
    rec = records.RecordLog()
    bad = rec.parse("k1", 1, b'{"phase": "Failed", "failures": "many"}', records.replica_status)
    good = rec.parse("k2", 1, b'{"phase": "Failed", "failures": 4}', records.replica_status)
    assert bad is None and good is not None and good.failures == 4


def test_node_stores_follow_etcd_and_a_bad_record_withdraws_one(followers: EtcdFollowers) -> None:
    reg = followers.svc.registry
    good = {"address": "10.0.0.1:7071", "events_url": "http://10.0.0.1:9094/v1/kv/events"}
    followers.stores_list([
        kv("/cognitora/kvcached/n1", good),
        kv("/cognitora/kvcached/n2", {**good, "address": "no-port"}),
        kv("/cognitora/kvcached/n3", {**good, "events_url": "file:///etc/passwd"}),
    ])  # fmt: skip
    assert reg.stores == {"n1": (good["events_url"], "")}
    reg.tiers.snapshot("n1", 1, 1, [b"h" * 32], first=True)
    followers.stores_event(WatchEvent("put", kv("/cognitora/kvcached/n1", {"address": 5})))
    assert reg.stores == {} and reg.tiers.size("n1") == 0  # its tiers no longer count


async def test_one_endpoint_event_restarts_only_that_endpoints_kv_stream() -> None:
    """A fleet's etcd events each touch one follower task: no rescan of every endpoint."""
    svc = build_service(RouterSettings(discovery="etcd"), Upstream())
    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tg:
        kvf = KvFollowers(svc, session, tg)
        followers = EtcdFollowers(svc, on_endpoints=kvf.reconcile)
        good = {"url": "http://127.0.0.1:9", "engine": "cgn-infer"}  # refused: backoff
        followers.endpoints_list([kv(f"/cognitora/endpoints/n{i % 5}/m/e{i}", good)
                                  for i in range(50)])  # fmt: skip
        before = {key: task for key, (_, task) in kvf.tasks.items()}
        assert len(before) == 50

        def rescan() -> None:
            raise AssertionError("an event about one endpoint rebuilt every stream")

        kvf.wanted = rescan  # type: ignore[method-assign]
        followers.endpoints_event(WatchEvent("put", kv("/cognitora/endpoints/n2/m/e7",
                                                       {**good, "api_token": "t2"}, rev=2)))  # fmt: skip
        followers.endpoints_event(WatchEvent("put", kv("/cognitora/endpoints/n3/m/e8", good, 2)))
        followers.endpoints_event(WatchEvent("delete", kv("/cognitora/endpoints/n4/m/e9", b"")))
        followers.endpoints_event(WatchEvent("put", kv("/cognitora/endpoints/n0/m/new", good)))
        followers.endpoints_event(WatchEvent("delete", kv("/cognitora/endpoints/bad", b"")))
        after = {key: task for key, (_, task) in kvf.tasks.items()}
        assert (
            kvf.tasks["m/n2.e7", None][0].token == "t2"
            and after["m/n2.e7", None] is not before["m/n2.e7", None]
        )
        assert ("m/n4.e9", None) not in after and ("m/n0.new", None) in after
        unchanged = set(before) - {("m/n2.e7", None), ("m/n4.e9", None)}
        assert all(after[k] is before[k] for k in unchanged)  # e8's same record: same task
        await asyncio.sleep(0)
        assert before["m/n2.e7", None].cancelled() and before["m/n4.e9", None].cancelled()
        for _, task in kvf.tasks.values():
            task.cancel()


# ---- typed records round-trip -----------------------------------------------------------

TYPED: dict[str, Callable[[Any], Any]] = {
    "replica_status": records.replica_status,
    "placement": records.placement,
    "cordon": records.cordon,
    "node_inventory": records.node_inventory,
    "kvcached": records.kvcached,
    "efficiency": records.efficiency,
    "scaling": records.scaling,
    "api_key": parse_record,
    "tenant": parse_tenant,
    "usage": lambda d: parse_usage(d, "gw.w0/acme"),
}


def test_a_keys_share_group_and_weight_are_checked_where_written_and_where_read() -> None:
    with pytest.raises(ApiKeyError, match="kv share group"):
        create("acme", "gold", kv_share_group="no spaces")
    _, record = create("acme", "gold", kv_share_group="acme-public")
    doc = record.to_json()
    assert parse_record(doc).kv_salt == tenant_salt("group", "acme-public")
    assert create("acme", "gold")[1].kv_salt == tenant_salt("tenant", "acme")
    with pytest.raises(ApiKeyError, match="kv_share_group"):
        parse_record({**doc, "kv_share_group": "x" * 65})
    for weight in (0.0, -1.0, float("nan"), 1e-9, 1e4):  # NaN fails every comparison
        with pytest.raises(ApiKeyError, match="weight"):
            create("acme", "gold", weight=weight)
    with pytest.raises(ApiKeyError, match="weight"):
        parse_record({**doc, "weight": 10**400})  # a 400-digit number: refused, not a crash
    assert parse_record({**doc, "weight": 2}).weight == 2.0


@pytest.mark.parametrize("kind", sorted(TYPED))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_record_round_trips_through_its_typed_value(kind: str, data: st.DataObject) -> None:
    """What a parser accepts, written back by its value's to_json, parses to the same value:
    a record's writer and its readers agree on one shape (cgn_core/records.py)."""
    doc = data.draw(st.just(VALID[kind]) | corrupted(kind) | RECORDS)
    try:
        value = TYPED[kind](doc)
    except REFUSALS:
        return
    assert TYPED[kind](json.loads(json.dumps(value.to_json()))) == value


def test_a_snapshot_of_written_records_equals_the_one_read() -> None:
    """Snapshot.of (tools, tests) and the values the records hold describe one cluster."""
    spec = parse_model(VALID["catalog_model"])
    docs = {k: VALID[k] for k in ("node_inventory", "placement", "replica_status", "cordon")}
    snap = Snapshot.of({"m": spec}, {"n0": docs["node_inventory"]},
                       {("n0", "r"): docs["placement"]}, {("n0", "r"): docs["replica_status"]},
                       {"n0": docs["cordon"]}, wall=5.0, efficiency={"n0": VALID["efficiency"]})  # fmt: skip
    again = Snapshot.of({"m": spec}, {n: v.to_json() for n, v in snap.nodes.items()},
                        {k: v.to_json() for k, v in snap.placements.items()},
                        {k: v.to_json() for k, v in snap.statuses.items()},
                        {n: v.to_json() for n, v in snap.cordons.items()}, wall=5.0,
                        efficiency={n: v.to_json() for n, v in snap.efficiency.items()})  # fmt: skip
    assert again == snap
    assert snap.placements[("n0", "r")].devices == (0,) and snap.nodes["n0"].watts == 5.0


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("cordon", "grace_s", 10**400), ("cordon", "since_unix", -(10**400)),
     ("efficiency", "tokens_per_joule", 10**400), ("replica_status", "failures", 10**400),
     ("efficiency", "at_unix", float("nan")), ("scaling", "desired", 10**400),
     ("scaling", "demand", float("inf")), ("tenant", "budget", {"tokens_per_day": 10**400}),
     ("placement", "profile", {"": float("nan")}),  # found by the round-trip property
     ("scaling", "unit", "furlongs"),  # not a number, but one of two units
     ],
)  # fmt: skip
def test_a_huge_or_non_finite_number_is_a_bad_record_not_a_crash(
    kind: str, field: str, value: Any
) -> None:
    rec = records.RecordLog()
    raw = json.dumps({**VALID[kind], field: value}).encode()
    assert rec.parse("/k", 1, raw, TYPED[kind]) is None  # logged and skipped
