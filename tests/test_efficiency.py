"""Power-aware decisions: the measured tokens per joule per node, from cgn-metrics' view to
the etcd record, the router's `efficiency` scorer, and placement's tie-break and its
explanation."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from cgn_control.decide.catalog import parse_model
from cgn_control.decide.cluster import Snapshot, node_views
from cgn_control.decide.placement import NodeView, place
from cgn_core import rbac, records
from cgn_core.etcd.types import KeyValue, WatchEvent
from cgn_core.fleet_view import FleetView
from cgn_metrics.daemon import efficiency_records
from cgn_router.daemon import build_service
from cgn_router.followers import EtcdFollowers
from cgn_router.routing.plugins.efficiency import EfficiencyScorer
from cgn_router.settings import RouterSettings
from cgn_router.types import Endpoint, EndpointId, EndpointView, RequestInfo
from cgn_router.upstream import Upstream

REQ = RequestInfo("m")


def view(name: str, tpj: float | None) -> EndpointView:
    ep = Endpoint(EndpointId(f"m/{name}"), "m", f"http://{name}", node=name)
    return EndpointView(endpoint=ep, tokens_per_joule=tpj)


@pytest.mark.parametrize(
    ("figures", "expected"),
    [
        ({"a": 4.0, "b": 2.0, "c": 1.0}, {"a": 1.0, "b": 0.5, "c": 0.25}),
        ({"a": 4.0, "b": None}, {"a": 1.0, "b": 1.0}),  # unmeasured: the measured mean
        ({"a": 4.0, "b": 2.0, "c": None}, {"a": 1.0, "b": 0.5, "c": 0.75}),
        ({"a": None, "b": None}, {"a": 0.0, "b": 0.0}),  # nothing measured: no effect
    ],
)
def test_efficiency_scorer(figures: dict[str, float | None], expected: dict[str, float]) -> None:
    got = EfficiencyScorer().score(REQ, [view(n, f) for n, f in figures.items()]).values
    assert {k.split("/")[1]: v for k, v in got.items()} == expected


def test_the_scorer_is_in_the_default_policy_with_weight_zero() -> None:
    svc = build_service(RouterSettings(), Upstream())
    assert svc.chain.weights["efficiency"] == 0.0
    svc.chain.set_weights({"efficiency": 2.0})
    assert svc.chain.weights["efficiency"] == 2.0


CPU = parse_model({"name": "m", "source": "s",
                   "profiles": [{"engine": "cgn_infer", "accelerator": "cpu"}]})  # fmt: skip


def node(name: str, tpj: float | None = None, watts: float | None = None, **kw: Any) -> NodeView:
    return NodeView(name, (), frozenset({"cgn_infer"}), tokens_per_joule=tpj, watts=watts, **kw)


def test_placement_breaks_ties_by_tokens_per_joule_then_watts_and_says_so() -> None:
    d = place(CPU, [node("a", 1.0, watts=10), node("b", 3.0, watts=90), node("c", watts=5)])
    assert d.nodes == (("b", ()),)
    reasons = {c.node: c.reason for c in d.candidates}
    assert reasons["b"] == "chosen (cpu); 3 output tokens/J"
    assert reasons["a"].startswith("fits; as loaded as b, which wins the tie-break")
    assert reasons["a"].endswith("; 1 output tokens/J") and "tokens/J" not in reasons["c"]
    # unmeasured everywhere: watts decide, as before
    assert place(CPU, [node("x", watts=50), node("y", watts=20)]).nodes == (("y", ()),)
    # the load comes first: an efficient node already running the model loses
    busy = node("b", 3.0, replicas={"m": 1})
    assert place(CPU, [node("a", 1.0), busy]).nodes == (("a", ()),)


def test_snapshots_carry_fresh_figures_only() -> None:
    now = 1_000_000.0
    fresh = records.efficiency({"tokens_per_joule": 2.0, "at_unix": now - 60})
    stale = records.efficiency({"tokens_per_joule": 9.0, "at_unix": now - 3600})
    snap = Snapshot.of({}, {"a": {}, "b": {}}, wall=now)
    snap = dataclasses.replace(snap, efficiency={"a": fresh, "b": stale})
    got = {v.name: v.tokens_per_joule for v in node_views(snap, {"a": "ready", "b": "ready"})}
    assert got == {"a": 2.0, "b": None}


@pytest.mark.parametrize(
    "doc",
    [{"tokens_per_joule": 0, "at_unix": 1}, {"tokens_per_joule": "2", "at_unix": 1},
     {"tokens_per_joule": 2.0}, {"tokens_per_joule": float("inf"), "at_unix": 1}, [2.0]],
)  # fmt: skip
def test_bad_efficiency_records_are_refused(doc: Any) -> None:
    with pytest.raises(records.RecordError):
        records.efficiency(doc)


def test_cgn_metrics_publishes_measured_nodes_only() -> None:
    view_ = {"window_s": 60.0, "nodes": [
        {"node": "a", "tokens_per_joule": 2.5, "source": "rapl"},
        {"node": "b", "tokens_per_joule": None, "source": "unavailable"},
    ]}  # fmt: skip
    out = efficiency_records(FleetView.from_json(view_), 1234.5)
    assert out == {"/cognitora/efficiency/a": {"tokens_per_joule": 2.5, "source": "rapl",
                                               "window_s": 60.0, "at_unix": 1234.5}}  # fmt: skip
    records.efficiency(out["/cognitora/efficiency/a"])  # what it writes, readers accept


def test_the_metrics_role_writes_efficiency_and_nothing_else() -> None:
    plan = rbac.plan(["n1"], metrics=["n1"])
    assert plan.users["n1"] == ("cgn-node-n1", rbac.METRICS_ROLE)
    writes = [g for g in plan.roles[rbac.METRICS_ROLE] if g.perm != "read"]
    assert [g.key for g in writes] == ["/cognitora/efficiency/"]


def kv(key: str, value: object, rev: int = 1) -> KeyValue:
    return KeyValue(key, json.dumps(value).encode(), rev, rev, 1, 0)


def test_the_router_follows_figures_into_its_views(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    svc = build_service(RouterSettings(discovery="etcd"), Upstream())
    f = EtcdFollowers(svc)
    f.endpoints_list([kv("/cognitora/endpoints/n1/m/r", {"url": "http://127.0.0.1:9"}),
                      kv("/cognitora/endpoints/n2/m/r", {"url": "http://127.0.0.1:8"})])  # fmt: skip
    now = time.time()
    f.efficiency_list([kv("/cognitora/efficiency/n1", {"tokens_per_joule": 3.0, "at_unix": now}),
                       kv("/cognitora/efficiency/n2", {"tokens_per_joule": "lots"})])  # fmt: skip
    figures = {v.endpoint.node: v.tokens_per_joule for v in svc.registry.views(REQ, now)}
    assert figures == {"n1": 3.0, "n2": None}  # the bad record skipped
    f.efficiency_event(WatchEvent("delete", kv("/cognitora/efficiency/n1", {})))
    assert svc.registry.efficiency == {}
