"""The reconciler's decisions on plain snapshots: expiry in two stages, rebuilds, drain, scale."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cgn_control.decide.catalog import ModelSpec, parse_model
from cgn_control.decide.reconciler import Delete, Memory, Put, Snapshot, explain, reconcile
from cgn_control.decide.scaling import ReplicaLoad, ReplicaSpeed
from cgn_core.records import placement
from cgn_router.settings import ReconcilerSettings

S = ReconcilerSettings(lost_after_s=30.0, max_local_failures=3, rebuild_base_s=2.0,
                       rebuild_cap_s=60.0, drain_grace_s=100.0)  # fmt: skip
CPU_NODE = {"accelerators": [], "engines": ["cgn_infer"]}


def model(name: str = "m", lo: int = 1, hi: int | None = None) -> ModelSpec:
    return parse_model({"name": name, "source": "smollm2", "replicas": {"min": lo, "max": hi or lo},
                        "profiles": [{"engine": "cgn_infer", "backend": "sim", "threads": 1}]})  # fmt: skip


def snap(
    *,
    models: list[ModelSpec] | None = None,
    nodes: tuple[str, ...] = ("a", "b", "c"),
    placed: dict[tuple[str, str], str] | None = None,
    status: dict[tuple[str, str], dict[str, Any]] | None = None,
    cordons: dict[str, dict[str, Any]] | None = None,
    wall: float = 1000.0,
) -> Snapshot:
    return Snapshot.of(
        models={m.name: m for m in (models if models is not None else [model()])},
        nodes={n: CPU_NODE for n in nodes},
        placements={
            k: {"model": m, "engine": "cgn_infer", "devices": [], "owner": "reconciler"}
            for k, m in (placed or {}).items()
        },
        statuses=status or {},
        cordons=cordons or {},
        wall=wall,
    )


def ready(*keys: tuple[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
    return {k: {"phase": "Ready"} for k in keys}


def test_places_one_replica_per_pass_with_the_agents_placement_document() -> None:
    mem = Memory()
    actions = reconcile(snap(models=[model("m", lo=2)]), mem, 0.0, S)
    assert len(actions) == 1 and isinstance(actions[0], Put)
    put = actions[0]
    assert put.node == "a" and put.replica.startswith("m-")
    assert put.doc == {"model": "m", "engine": "cgn_infer", "source": "smollm2", "devices": [],
                       "role": "both", "profile": {"tensor_parallel": 1, "kv_connector": "none",
                       "launcher": "auto", "extra_args": [], "env": {}, "threads": 1, "backend": "sim"},
                       "owner": "reconciler"}  # fmt: skip
    # next pass, with the first placement made: the second replica spreads to another node
    second = reconcile(
        snap(models=[model("m", lo=2)], placed={("a", put.replica): "m"}), mem, 1.0, S
    )
    assert [(a.node, type(a)) for a in second] == [("b", Put)]
    assert (
        reconcile(
            snap(models=[model("m", lo=2)], placed={("a", "x"): "m", ("b", "y"): "m"}), mem, 2.0, S
        )
        == []
    )


def test_a_placement_lists_the_adapters_its_engine_loads_at_start() -> None:
    """llama.cpp loads all of a model's LoRA adapters at start (a request's `lora` id is the
    adapter's index in name order); cgn-infer (torch on GGUF weights) the pinned ones, and
    holds max_adapters at once (the router loads the others at run time); the engines that
    cannot load them get none."""
    adapters = {"sql": {"source": "/m/sql.gguf"}, "fr": {"source": "/m/fr.gguf", "pin": True},
                "de": {"source": "/m/de-peft", "rank": 16}}  # fmt: skip
    named = [{"name": "fr", "path": "/m/fr.gguf"}, {"name": "sql", "path": "/m/sql.gguf"}]
    for profile, lora, slots in (
        ({"engine": "llama_cpp"}, named, None),  # GGUF files only
        ({"engine": "cgn_infer"}, named[:1], 3),
        ({"engine": "vllm", "accelerator": "h100-80g"}, [{"name": "de", "path": "/m/de-peft"}], 3),
        ({"engine": "cgn_infer", "backend": "sim"}, None, None),
        ({"engine": "cgn_infer", "dtype": "float32"}, None, None),
    ):
        engine = profile["engine"]
        spec = parse_model({"name": "m", "source": "/m/smol.gguf", "adapters": adapters,
                            "max_adapters": 3, "profiles": [profile]})  # fmt: skip
        gpus = [{"index": 0, "accel_class": "h100-80g", "health": []}] if engine == "vllm" else []
        nodes = {n: {"accelerators": gpus, "engines": [engine]} for n in ("a",)}
        state = Snapshot.of(models={"m": spec}, nodes=nodes, placements={}, statuses={},
                            cordons={}, wall=1000.0)  # fmt: skip
        (put,) = reconcile(state, Memory(), 0.0, S)
        assert isinstance(put, Put), profile
        got = put.doc["profile"]
        assert (got.get("lora"), got.get("max_loras")) == (lora, slots), profile
        assert got.get("max_lora_rank") == (16 if engine == "vllm" else None)


def test_replicas_that_load_adapters_at_start_roll_to_the_catalogs_new_set() -> None:
    """The catalog adds `de` and drops `fr`: the llama.cpp replicas (they load adapters at
    start only) get placements with the new set, one per pass and only while the other is
    Ready; a replica with the right set, or whose engine takes none, is left alone."""
    old = [{"name": "fr", "path": "/m/fr.gguf"}, {"name": "sql", "path": "/m/sql.gguf"}]
    spec = parse_model({"name": "m", "source": "/m/smol.gguf", "replicas": {"min": 2},
                        "adapters": {"sql": {"source": "/m/sql.gguf"},
                                     "de": {"source": "/m/de.gguf"}},
                        "profiles": [{"engine": "llama_cpp"}]})  # fmt: skip
    keys = [("a", "r1"), ("b", "r2")]

    def state(statuses: dict[tuple[str, str], Any], lora: dict[tuple[str, str], Any]) -> Snapshot:
        placed = {k: {"model": "m", "engine": "llama_cpp", "owner": "reconciler",
                      "profile": {"threads": 1, "lora": lora[k]}} for k in keys}  # fmt: skip
        return Snapshot.of(models={"m": spec}, nodes={n: CPU_NODE for n in "ab"},
                           placements=placed, statuses=statuses, cordons={}, wall=1.0)  # fmt: skip

    new = [{"name": "de", "path": "/m/de.gguf"}, {"name": "sql", "path": "/m/sql.gguf"}]
    (put,) = reconcile(state(ready(*keys), dict.fromkeys(keys, old)), Memory(), 0.0, S)
    assert isinstance(put, Put) and (put.node, put.replica) == keys[0]
    assert (
        put.doc["profile"] == {"threads": 1, "lora": new}
        and put.why == "adapters changed: +de, -fr"
    )
    # r1 restarts with the new set: r2 waits until r1 is Ready again
    rolled = {keys[0]: new, keys[1]: old}
    assert reconcile(state(ready(keys[1]), rolled), Memory(), 1.0, S) == []
    (put,) = reconcile(state(ready(*keys), rolled), Memory(), 2.0, S)
    assert (put.node, put.replica) == keys[1]
    assert reconcile(state(ready(*keys), dict.fromkeys(keys, new)), Memory(), 3.0, S) == []


def test_a_vanished_node_is_unreachable_first_and_lost_after_the_grace_period() -> None:
    mem = Memory()
    placed = {("a", "r1"): "m"}
    assert reconcile(snap(placed=placed, status=ready(("a", "r1"))), mem, 0.0, S) == []
    gone = snap(nodes=("b", "c"), placed=placed)
    assert reconcile(gone, mem, 10.0, S) == []  # unreachable: nothing torn down
    assert reconcile(gone, mem, 39.9, S) == []
    actions = reconcile(gone, mem, 40.0, S)  # lost: deleted, and rebuilt in the same pass
    assert actions[0] == Delete("a", "r1", "node a lost")
    assert isinstance(actions[1], Put) and actions[1].node == "b"
    # a node that comes back before the grace period is forgiven
    mem2 = Memory()
    reconcile(gone, mem2, 0.0, S)
    reconcile(snap(placed=placed), mem2, 20.0, S)
    assert reconcile(gone, mem2, 45.0, S) == []


def test_a_refused_engine_is_not_placed_on_that_node_again_until_its_profiles_change() -> None:
    """The agent on a refuses the model's engine: the next replica goes to b, and explain
    says why not a; after REFUSED_FOR_S, or once the catalog's profiles change, a is a
    candidate again."""
    from cgn_control.decide.reconciler import REFUSED_FOR_S

    mem = Memory()
    m = model("m")
    refused = {("a", "r1"): {"phase": "Failed", "reason": "refused: llama_cpp: no such file"}}
    reconcile(snap(models=[m], placed={("a", "r1"): "m"}, status=refused), mem, 0.0, S, rand=0.0)
    again = reconcile(snap(models=[m], nodes=("a", "b")), mem, 2.0, S)
    assert [(type(x), x.node) for x in again] == [(Put, "b")]
    why = {c.node: c.reason for c in explain(m, snap(models=[m]), mem, 3.0, S).candidates}
    assert why["a"].startswith("its agent refused it (refused: llama_cpp: no such file)")
    alone = snap(models=[m], nodes=("a",))
    assert reconcile(alone, mem, 5.0, S) == [] and "refused" in str(mem.unplaced["m"].explain())
    later = reconcile(alone, mem, REFUSED_FOR_S + 1, S)
    assert [(type(x), x.node) for x in later] == [(Put, "a")]
    mem2 = Memory()
    reconcile(snap(models=[m], placed={("a", "r1"): "m"}, status=refused), mem2, 0.0, S, rand=0.0)
    fixed = parse_model({**m.to_json(), "profiles": [{"engine": "cgn_infer", "threads": 2}]})
    assert [x.node for x in reconcile(snap(models=[fixed], nodes=("a",)), mem2, 5.0, S)] == ["a"]


def test_failed_replicas_are_rebuilt_with_backoff() -> None:
    mem = Memory()
    refused = {("a", "r1"): {"phase": "Failed", "reason": "refused: no GPU"}}
    actions = reconcile(snap(placed={("a", "r1"): "m"}, status=refused), mem, 0.0, S, rand=0.0)
    assert actions == [Delete("a", "r1", "replica failed: refused: no GPU")]  # no placement yet
    assert mem.rebuild_after["m"] == 2.0
    assert reconcile(snap(), mem, 1.9, S) == []
    assert isinstance(reconcile(snap(), mem, 2.0, S)[0], Put)
    crashing = {
        ("b", "r2"): {"phase": "Failed", "reason": "engine exited with code 1", "failures": 2}
    }
    assert (
        reconcile(snap(placed={("b", "r2"): "m"}, status=crashing), mem, 3.0, S) == []
    )  # the agent retries
    crashing[("b", "r2")]["failures"] = 3
    acts = reconcile(snap(placed={("b", "r2"): "m"}, status=crashing), mem, 4.0, S, rand=0.0)
    assert (
        acts[0].why == "replica failed: engine exited with code 1" and mem.rebuild_after["m"] == 8.0
    )


def test_rolling_drain_places_the_replacement_before_the_original_goes() -> None:
    mem = Memory()
    drain = {"a": {"drain": True, "since_unix": 1000.0}}
    placed = {("a", "r1"): "m"}
    first = reconcile(snap(placed=placed, status=ready(("a", "r1")), cordons=drain), mem, 0.0, S)
    assert len(first) == 1 and isinstance(first[0], Put) and first[0].node == "b"  # surge first
    placed[("b", first[0].replica)] = "m"
    loading = {("a", "r1"): {"phase": "Ready"}, ("b", first[0].replica): {"phase": "Loading"}}
    assert reconcile(snap(placed=placed, status=loading, cordons=drain), mem, 1.0, S) == []
    both = ready(("a", "r1"), ("b", first[0].replica))
    assert reconcile(snap(placed=placed, status=both, cordons=drain), mem, 2.0, S) == [
        Delete("a", "r1", "drained: 1 Ready replica(s) elsewhere")
    ]


def test_a_drain_that_cannot_be_replaced_ends_at_the_grace_period() -> None:
    mem = Memory()
    drain = {"a": {"drain": True, "since_unix": 1000.0, "grace_s": 50.0}}
    only_a = snap(nodes=("a",), placed={("a", "r1"): "m"}, status=ready(("a", "r1")), cordons=drain)
    assert reconcile(only_a, mem, 0.0, S) == []  # nowhere else to go: keeps serving
    assert "m" in mem.unplaced and "node is cordoned" in mem.unplaced["m"].explain()[0]
    late = snap(
        nodes=("a",),
        placed={("a", "r1"): "m"},
        status=ready(("a", "r1")),
        cordons=drain,
        wall=1050.0,
    )
    assert reconcile(late, mem, 1.0, S) == [Delete("a", "r1", "drain grace period over")]


def test_scale_down_and_removed_models() -> None:
    mem = Memory()
    placed = {("a", "r1"): "m", ("b", "r2"): "m", ("c", "r3"): "gone"}
    status = {("a", "r1"): {"phase": "Ready"}, ("b", "r2"): {"phase": "Loading"}}
    acts = reconcile(snap(placed=placed, status=status), mem, 0.0, S)
    assert acts == [Delete("c", "r3", "model gone is not in the catalog"),
                    Delete("b", "r2", "2 replicas, max 1")]  # fmt: skip


def test_explain_lists_every_candidate() -> None:
    s = snap(nodes=("a", "b"), placed={("b", "x"): "m"}, cordons={"a": {}})
    d = explain(model(), s, Memory(), 0.0, S)
    assert d.nodes == (("b", ()),)
    assert d.explain() == ["✗ profile 0 on a: node is cordoned", "✓ profile 0 on b: chosen (cpu)"]


def test_placements_written_by_hand_are_left_alone_but_their_devices_stay_taken() -> None:
    gpu_node = {"accelerators": [{"index": 0, "accel_class": "h100-80g", "health": []},
                                 {"index": 1, "accel_class": "h100-80g", "health": []}],
                "engines": ["vllm"]}  # fmt: skip
    m = parse_model({"name": "g", "source": "s",
                     "profiles": [{"engine": "vllm", "accelerator": "h100-80g", "devices": 1}]})  # fmt: skip
    s = Snapshot.of(
        models={"g": m},
        nodes={"a": gpu_node},
        placements={
            ("a", "manual"): {"model": "not-in-catalog", "devices": [0]},
            ("lost", "manual2"): {"model": "g", "devices": []},
        },
        statuses={},
        cordons={},
    )
    mem = Memory()
    reconcile(s, mem, 0.0, S)
    actions = reconcile(s, mem, 100.0, S)  # node "lost" is long gone
    assert [type(a) for a in actions] == [Put]  # no Delete of the hand-written placements
    assert actions[0].doc["devices"] == [1]  # device 0 is held by the manual placement


def pd_model(prefill: int = 1, decode: int = 2) -> ModelSpec:
    return parse_model({"name": "pd", "source": "smollm2", "pools": {"prefill": prefill, "decode": decode},
                        "profiles": [{"engine": "cgn_infer", "backend": "sim", "threads": 1}]})  # fmt: skip


def pd_snap(placed: dict[tuple[str, str], str], **kw: Any) -> Snapshot:
    """`placed`: key -> role of a placement of model pd."""
    s = snap(models=[pd_model()], **kw)
    s.placements.update(
        {
            k: placement({"model": "pd", "role": r, "devices": [], "owner": "reconciler"})
            for k, r in placed.items()
        }
    )  # type: ignore[attr-defined]
    return s


def test_a_disaggregated_model_gets_both_pools_and_keeps_them_when_a_node_dies() -> None:
    mem = Memory()
    placed: dict[tuple[str, str], str] = {}
    for now in (0.0, 1.0, 2.0):  # one placement per pass: prefill first, then two decode
        (put,) = reconcile(pd_snap(placed), mem, now, S)
        assert isinstance(put, Put) and put.doc["model"] == "pd"
        placed[(put.node, put.replica)] = put.doc["role"]
    assert sorted(placed.values()) == ["decode", "decode", "prefill"]
    assert {n for n, _ in placed} == {"a", "b", "c"}  # spread over the nodes
    assert reconcile(pd_snap(placed), mem, 3.0, S) == []  # both pools full
    # the prefill node dies: its replica is deleted once lost and a prefill one placed again
    (dead,) = [k for k, r in placed.items() if r == "prefill"]
    alive = tuple(n for n in ("a", "b", "c", "d") if n != dead[0])
    reconcile(pd_snap(placed, nodes=alive), mem, 4.0, S)
    actions = reconcile(pd_snap(placed, nodes=alive), mem, 40.0, S)
    assert actions[0] == Delete(dead[0], dead[1], f"node {dead[0]} lost")
    assert isinstance(actions[1], Put) and actions[1].doc["role"] == "prefill"
    assert "prefill pool" in actions[1].why


def test_each_pool_is_trimmed_to_its_own_count() -> None:
    placed = {("a", "p1"): "prefill", ("b", "p2"): "prefill", ("a", "d1"): "decode",
              ("b", "d2"): "decode"}  # fmt: skip
    actions = reconcile(pd_snap(placed), Memory(), 0.0, S)
    assert actions == [Delete("a", "p1", "2 prefill replicas, max 1")]  # decode: 2 of 2, kept


def test_a_pool_no_profile_can_serve_is_unplaced_under_its_own_name() -> None:
    spec = parse_model({"name": "pd", "source": "smollm2", "pools": {"prefill": 1, "decode": 1},
                        "profiles": [{"engine": "vllm", "accelerator": "h100-80g", "devices": 1,
                                      "role": "prefill"},
                                     {"engine": "cgn_infer", "role": "decode"}]})  # fmt: skip
    mem = Memory()
    actions = reconcile(snap(models=[spec]), mem, 0.0, S)  # cpu nodes: no h100 for prefill
    assert [a.doc["role"] for a in actions if isinstance(a, Put)] == ["decode"]
    assert "pd (prefill)" in mem.unplaced
    assert explain(spec, snap(models=[spec]), mem, 0.0, S, role="decode").ok


# ---- multi-node replicas: a cgn-infer layer pipeline ---------------------------------------

LAN_NODE = {"accelerators": [], "engines": ["cgn_infer"], "labels": {"fabric": "lan"}}


def pipeline_model(lo: int = 1) -> ModelSpec:
    return parse_model({"name": "big", "source": "smollm2", "replicas": {"min": lo, "max": lo},
                        "profiles": [{"engine": "cgn_infer", "nodes": 2, "threads": 1}]})  # fmt: skip


def pipeline_snap(
    placed: dict[tuple[str, str], dict[str, Any]],
    status: dict[tuple[str, str], dict[str, Any]] | None = None,
    nodes: tuple[str, ...] = ("a", "b", "c"),
) -> Snapshot:
    return Snapshot.of(
        models={"big": pipeline_model()},
        nodes={n: LAN_NODE for n in nodes},
        placements=placed,
        statuses=status or {},
        wall=1000.0,
    )


def test_a_multi_node_replica_is_placed_whole_and_its_head_learns_the_stages() -> None:
    mem = Memory()
    first = reconcile(pipeline_snap({}), mem, 0.0, S)
    assert [type(a) for a in first] == [Put, Put] and first[0].replica == first[1].replica
    head, stage = first
    assert head.doc["pipeline"] == {"part": 0, "parts": 2, "head": head.node}
    assert stage.doc["pipeline"] == {"part": 1, "parts": 2, "head": head.node}
    assert stage.node != head.node and "stage 1/2" in stage.why
    placed = {(p.node, p.replica): p.doc for p in first}
    # the stage is not Ready yet: nothing to do, and the replica counts once (min 1 is met)
    assert reconcile(pipeline_snap(placed), mem, 1.0, S) == []
    stage_ready = {(stage.node, stage.replica): {"phase": "Ready", "pipeline": {
        "part": 1, "parts": 2, "head": head.node, "address": "10.0.0.2:40123"}}}  # fmt: skip
    relay = reconcile(pipeline_snap(placed, stage_ready), mem, 2.0, S)
    assert [(a.node, type(a)) for a in relay] == [(head.node, Put)]
    assert relay[0].doc["pipeline"]["stages"] == ["10.0.0.2:40123"]
    placed[(head.node, head.replica)] = relay[0].doc
    assert reconcile(pipeline_snap(placed, stage_ready), mem, 3.0, S) == []  # told once
    bad_address = {k: {**v, "pipeline": {**v["pipeline"], "address": "nowhere"}}
                   for k, v in stage_ready.items()}  # fmt: skip
    assert reconcile(pipeline_snap(placed, bad_address), mem, 3.5, S) == []


def test_any_part_failing_or_lost_takes_the_whole_replica_down() -> None:
    def parts(head: str = "a", stage: str = "b") -> dict[tuple[str, str], dict[str, Any]]:
        base = {"model": "big", "engine": "cgn_infer", "devices": [], "owner": "reconciler"}
        return {(head, "r1"): {**base, "pipeline": {"part": 0, "parts": 2, "head": head}},
                (stage, "r1"): {**base, "pipeline": {"part": 1, "parts": 2, "head": head}}}  # fmt: skip

    failed = {("b", "r1"): {"phase": "Failed", "reason": "exit 1", "failures": 3}}
    acts = reconcile(pipeline_snap(parts(), failed), Memory(), 0.0, S)
    assert {(a.node, a.replica) for a in acts if isinstance(a, Delete)} == {
        ("a", "r1"),
        ("b", "r1"),
    }
    assert any("same replica" in a.why for a in acts)
    mem = Memory()
    reconcile(pipeline_snap(parts(), nodes=("a", "c")), mem, 0.0, S)  # b vanished
    acts = reconcile(pipeline_snap(parts(), nodes=("a", "c")), mem, 31.0, S)
    assert {(a.node, a.replica) for a in acts if isinstance(a, Delete)} == {
        ("a", "r1"),
        ("b", "r1"),
    }
    half = {k: v for k, v in parts().items() if k[0] == "a"}  # a part that never got written
    acts = reconcile(pipeline_snap(half), Memory(), 0.0, S)
    assert [(type(a), a.node) for a in acts][:1] == [(Delete, "a")]
    assert "1 of 2 parts" in acts[0].why


def test_the_autoscalers_target_is_placed_toward_and_the_least_loaded_replica_goes() -> None:
    """Targets between min and max: below one, a placement per pass; above one, the replica
    with the least to drain is removed (not-Ready ones before any); never beyond max."""
    m = model("m", lo=1, hi=4)
    placed = {("a", "r1"): "m", ("b", "r2"): "m"}
    up = reconcile(snap(models=[m], placed=placed), Memory(), 0.0, S, targets={"m": 3})
    assert [type(a) for a in up] == [Put]
    assert reconcile(snap(models=[m], placed=placed), Memory(), 0.0, S, targets={"m": 9}) != []
    beyond = {**placed, ("c", "r3"): "m", ("a", "r4"): "m"}
    assert reconcile(snap(models=[m], placed=beyond), Memory(), 0.0, S, targets={"m": 9}) == []
    three = {**placed, ("c", "r3"): "m"}
    busy = seen(r1=5.0, r2=0.0, r3=2.0)
    down = reconcile(snap(models=[m], placed=three, status=ready(*three)), Memory(), 0.0, S,
                     targets={"m": 2}, load=busy)  # fmt: skip
    assert down == [Delete("b", "r2", "3 replicas, the autoscaler's target 2")]
    loading = ready(("a", "r1"), ("b", "r2"))  # r3 is not Ready yet: it goes first
    down = reconcile(snap(models=[m], placed=three, status=loading), Memory(), 0.0, S,
                     targets={"m": 2}, load=busy)  # fmt: skip
    assert [a.replica for a in down] == ["r3"]
    floor = reconcile(snap(models=[m], placed={("a", "r1"): "m"}), Memory(), 0.0, S,
                      targets={"m": 0})  # fmt: skip
    assert floor == []  # never below min


def seen(
    cached: dict[str, int] | None = None, decode: dict[str, float] | None = None, **work: float
) -> dict[str, ReplicaLoad]:
    """The router's view of replicas: `work` requests on each, `cached` KV blocks, the
    `decode` seconds per token it learned (none: not learned)."""
    speeds = {r: ReplicaSpeed(0.05, 1e-4, d, 0.0) for r, d in (decode or {}).items()}
    return {r: ReplicaLoad("m", "both", r, w, 0, 0, 600, (cached or {}).get(r, 0), speeds.get(r))
            for r, w in work.items()}  # fmt: skip


@pytest.mark.parametrize(
    ("work", "cached", "tpj", "goes", "decode"),
    [
        ({"r1": 3, "r2": 1, "r3": 2}, {}, {}, "r1", {"r1": 0.2, "r2": 0.02, "r3": 0.02}),  # slowest
        (
            {"r1": 3, "r2": 1, "r3": 2},
            {},
            {},
            "r2",
            {"r1": 0.015, "r2": 0.02, "r3": 0.021},
        ),  # alike
        ({"r1": 0, "r2": 0, "r3": 0}, {}, {}, "r3", {"r1": 0.02, "r3": 0.05}),  # r2: not learned
    ],
)
def test_the_slowest_replica_goes_first(
    work: dict[str, float], cached: dict[str, int], tpj: dict[str, float], goes: str,
    decode: dict[str, float],
) -> None:  # fmt: skip
    """Its loss costs the fleet least: speeds learned by the routers, within a factor 1.5
    alike (then the least to drain), one not learned as the fastest."""
    assert removed(work, cached, tpj, decode) == [goes]


@pytest.mark.parametrize(
    ("work", "cached", "tpj", "goes"),
    [
        ({"r1": 3, "r2": 1, "r3": 2}, {"r2": 900}, {}, "r2"),  # least to drain, whatever it holds
        ({"r1": 1, "r2": 1, "r3": 1}, {"r1": 50, "r2": 10, "r3": 70}, {}, "r2"),  # least cached
        ({"r1": 0, "r2": 0, "r3": 0}, {}, {"a": 0.9, "b": 0.4, "c": 1.2}, "r2"),  # least efficient
        ({"r1": 0, "r2": 0, "r3": 0}, {}, {"a": 0.9, "c": 1.2}, "r1"),  # unmeasured b stays last
        ({"r1": 0, "r2": 0, "r3": 0}, {}, {}, "r1"),  # all equal: a stable order
    ],
)
def test_the_replica_that_goes_is_the_one_whose_loss_costs_least(
    work: dict[str, float], cached: dict[str, int], tpj: dict[str, float], goes: str
) -> None:
    """Requests to drain first, then the prefix the router routes to it, then tokens per
    joule of its node (measured by cgn-metrics, fresh)."""
    assert removed(work, cached, tpj) == [goes]


def removed(
    work: dict[str, float], cached: dict[str, int], tpj: dict[str, float],
    decode: dict[str, float] | None = None,
) -> list[str]:  # fmt: skip
    """The replica a scale-down from three to two deletes, each replica with `work` to
    drain, `cached` blocks, its node's tokens per joule `tpj`, its learned `decode` speed."""
    m = model("m", lo=1, hi=4)
    three = {("a", "r1"): "m", ("b", "r2"): "m", ("c", "r3"): "m"}
    s = snap(models=[m], placed=three, status=ready(*three))
    eff = {n: {"tokens_per_joule": v, "at_unix": s.wall - 5} for n, v in tpj.items()}
    s = Snapshot.of(s.models, {n: CPU_NODE for n in "abc"},
                    {k: {"model": "m", "devices": [], "owner": "reconciler"} for k in three},
                    ready(*three), {}, s.wall, eff)  # fmt: skip
    down = reconcile(s, Memory(), 0.0, S, targets={"m": 2}, load=seen(cached, decode, **work))
    return [a.replica for a in down]


def test_scale_reads_the_routers_signals_per_pool() -> None:
    from cgn_control.decide.reconciler import scale
    from cgn_control.decide.scaling import Signals

    m = model("m", lo=1, hi=6)
    placed = {("a", "r1"): "m", ("b", "r2"): "m"}
    mem = Memory()
    busy = Signals(replicas=(ReplicaLoad("m", "both", "r1", 8, 12, 20, 600),
                             ReplicaLoad("m", "both", "r2", 8, 12, 20, 600),
                             ReplicaLoad("gone", "both", "x", 99, 99, 0, 600)))  # fmt: skip
    scale(snap(models=[m], placed=placed), mem, busy, -0.5)  # capacity: a queue on two passes
    got = scale(snap(models=[m], placed=placed), mem, busy, 0.0)
    assert set(got) == {"m"} and (got["m"].current, got["m"].desired) == (2, 6)
    assert got["m"].demand == 40  # the unknown model's replica is not counted
    # the replicas' learned speeds and the answers' shape: the same pool in tokens per second
    fast = ReplicaSpeed(0.05, 1e-4, 0.02, 0.0)
    timed = Signals(replicas=tuple(replace(r, speed=fast) for r in busy.replicas),
                    shape={"m": (1000.0, 200.0)})  # fmt: skip
    mem = Memory()
    scale(snap(models=[m], placed=placed), mem, timed, -0.5)
    got = scale(snap(models=[m], placed=placed), mem, timed, 0.0)
    assert (got["m"].unit, got["m"].desired) == ("tokens/s", 6), got["m"].reason
    assert got["m"].demand == pytest.approx(40 * 1200 / fast.request_s(1000, 200, 8))
