"""The model catalog: one model's fields and names across models, refused with the field path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cgn_control.decide.catalog import Bounds, CatalogError, ModelSpec, check_catalog, parse_model


def model(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": "m", "source": "/models/m.gguf",
                           "profiles": [{"engine": "cgn_infer"}]}  # fmt: skip
    doc.update(kw)
    return doc


def test_a_full_spec_parses_and_round_trips() -> None:
    doc = model(
        name="llama-8b",
        source="meta-llama/Llama-3.1-8B-Instruct",
        tokenizer="/models/llama.gguf",
        role="decode",
        replicas={"min": 2, "max": 4},
        scaling={"stabilization_s": 300, "max_step_up": 2, "enabled": True},
        slo={"ttft_p90_ms": 800},
        aliases=["llama"],
        fallbacks=["smollm2"],
        profiles=[
            {"engine": "vllm", "accelerator": "h100-80g", "devices": 2, "tensor_parallel": 2,
             "ctx": 8192, "kv_connector": "lmcache", "gpu_memory_utilization": 0.9},
            {"engine": "llama_cpp", "source": "/models/llama.Q4.gguf", "threads": 8},
        ],
    )  # fmt: skip
    m = parse_model(doc)
    assert (m.pools, m.role) == ({"decode": Bounds(2, 4)}, "decode")
    assert (m.scaling.stabilization_s, m.scaling.max_step_up, m.scaling.ttft_p90_ms) == (
        300,
        2,
        800,
    )
    gpu, cpu = m.profiles
    assert (gpu.devices, gpu.tensor_parallel, gpu.kv_connector) == (2, 2, "lmcache")
    assert cpu.on_cpu and cpu.devices == 0 and cpu.source == "/models/llama.Q4.gguf"
    assert parse_model(m.to_json()) == m


def test_migration_across_engines_needs_one_source_and_round_trips() -> None:
    """A cgn-infer and a llama.cpp profile of one GGUF: one tokenizer, so a stream of one
    may continue on the other; the router's catalog entry reads the flag back."""
    from cgn_router.catalog import entry_from_etcd

    m = parse_model(model(migrate_across_engines=True,
                          profiles=[{"engine": "cgn_infer"}, {"engine": "llama_cpp"}]))  # fmt: skip
    assert m.migrate_across_engines and parse_model(m.to_json()) == m
    assert entry_from_etcd("m", m.to_json()).across_engines
    assert not entry_from_etcd("m", parse_model(model()).to_json()).across_engines
    with pytest.raises(ValueError, match="'migrate_across_engines' must be true or false"):
        entry_from_etcd("m", {**m.to_json(), "migrate_across_engines": 1})


def test_the_routers_entry_reads_the_ttft_slo_it_holds_requests_for() -> None:
    """cgn-ctl's `slo.ttft_p90_ms`, as the router reads it back (cgn_router/hold.py)."""
    from cgn_router.catalog import entry_from_etcd

    m = parse_model(model(slo={"ttft_p90_ms": 800}))
    assert entry_from_etcd("m", m.to_json()).ttft_slo_s == 0.8
    assert entry_from_etcd("m", parse_model(model()).to_json()).ttft_slo_s is None
    for bad in ({"ttft_p90_ms": -1}, {"ttft_p90_ms": "800"}, {"ttft_p90_ms": float("nan")}, 5):
        with pytest.raises(ValueError, match="'slo"):
            entry_from_etcd("m", {**m.to_json(), "slo": bad})


def test_a_disaggregated_model_has_two_pools_and_profiles_per_pool() -> None:
    m = parse_model(model(pools={"prefill": 1, "decode": 2}, profiles=[
        {"engine": "vllm", "accelerator": "h100-80g", "devices": 1, "role": "prefill"},
        {"engine": "vllm", "accelerator": "l40s-48g", "devices": 1, "role": "decode"},
        {"engine": "cgn_infer"},
    ]))  # fmt: skip
    assert m.wants() == [("prefill", 1, 1), ("decode", 2, 2)]
    assert [p.accelerator for p in m.for_role("prefill").profiles] == ["h100-80g", "cpu"]
    assert [p.accelerator for p in m.for_role("decode").profiles] == ["l40s-48g", "cpu"]
    assert parse_model(m.to_json()) == m
    assert parse_model(model()).wants() == [("both", 1, 1)]
    elastic = parse_model(model(pools={"prefill": 1, "decode": {"min": 1, "max": 4}}))
    assert elastic.wants() == [("prefill", 1, 1), ("decode", 1, 4)]
    assert parse_model(elastic.to_json()) == elastic


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (model(name=""), "name: expected a string"),
        (model(name="a/b"), "name: use 1-128 of"),
        (model(colour="red"), "colour: unknown field"),
        (model(role="both-ish"), "role: must be one of both, prefill, decode"),
        (model(scaling="fast"), "scaling: expected a mapping"),
        (model(scaling={"speed": 2}), "scaling.speed: unknown field"),
        (model(scaling={"stabilization_s": -5}), "scaling.stabilization_s must be in [0, 86400]"),
        (model(scaling={"utilization": "high"}), "scaling.utilization: expected a number"),
        (model(scaling={"hysteresis": 10**400}), "scaling.hysteresis must be in [0, 1)"),
        (model(scaling={"enabled": "yes"}), "scaling.enabled: expected true or false"),
        (model(scaling={"max_step_up": 0}), "scaling.max_step_up: expected an integer in [1, 1000]"),
        (model(slo={"ttft_p90_ms": 0}), "slo.ttft_p90_ms must be in (0, 3600000]"),
        (model(slo={"p99": 1}), "slo.p99: unknown field"),
        (model(pools={"prefill": 1, "decode": {"min": 3, "max": 2}}), "pools.decode: min 3 is above max 2"),
        (model(replicas={"min": 3, "max": 2}), "replicas: min 3 is above max 2"),
        (model(replicas={"min": -1}), "replicas.min: expected an integer in [0, 4096], got -1"),
        (model(replicas={"min": 10**400}), "replicas.min: expected an integer in [0, 4096], got 1000000000000000000000000000000000000000"),
        (model(profiles=[]), "profiles: at least one profile is required"),
        (model(profiles=[{"engine": "tgi"}]), "profiles[0].engine: must be one of"),
        (model(profiles=[{"engine": "vllm", "accelerator": "h100-80g", "devices": 2, "tensor_parallel": 4}]),
         "profiles[0].tensor_parallel: 4 does not divide devices × nodes = 2"),
        (model(profiles=[{"engine": "vllm", "accelerator": "h100-80g", "devices": 0}]),
         "profiles[0].devices: a h100-80g profile needs at least one device"),
        (model(profiles=[{"engine": "llama_cpp", "devices": 1}]),
         "profiles[0].devices: a cpu profile takes no devices, got 1"),
        (model(profiles=[{"engine": "cgn_infer"}, {"engine": "vllm", "accelerator": "H100"}]),
         "profiles[1].accelerator: an accelerator class such as h100-80g, or cpu"),
        (model(source=None), "profiles[0]: no source"),
        (model(profiles=[{"engine": "cgn_infer", "ctx": 0}]), "profiles[0].ctx: expected an integer in [1, 2147483648]"),
        (model(profiles=[{"engine": "cgn_infer", "kv_connector": "x"}]), "profiles[0].kv_connector: must be one of"),
        (model(aliases=["a", "a"]), "aliases: a name is listed twice"),
        (model(pools={"prefill": 1}), "pools.decode: expected an integer in [1, 4096], got 0"),
        (model(pools={"prefill": 1, "decode": 1, "both": 1}), "pools.both: unknown field"),
        (model(pools={"prefill": 1, "decode": 1}, replicas={"min": 1}),
         "pools: a model has pools or replicas, not both"),
        (model(pools={"prefill": 1, "decode": 1}, role="decode"),
         "role: a model with pools has role both, got decode"),
        (model(pools={"prefill": 1, "decode": 1}, profiles=[{"engine": "cgn_infer", "role": "decode"}]),
         "pools.prefill: no profile may serve it"),
        (model(profiles=[{"engine": "cgn_infer", "role": "mixed"}]),
         "profiles[0].role: must be one of both, prefill, decode"),
        ("just a string", "model: expected a mapping"),
        (model(migrate_across_engines="yes"), "migrate_across_engines: expected true or false"),
        (model(migrate_across_engines=True, profiles=[{"engine": "cgn_infer"}, {"engine": "mlx_lm"}]),
         "migrate_across_engines: profiles[1] (mlx_lm) cannot take a prompt of token ids"),
        (model(migrate_across_engines=True, profiles=[{"engine": "cgn_infer"},
                                                      {"engine": "llama_cpp", "source": "/models/other.gguf"}]),
         "migrate_across_engines: the profiles serve different sources (/models/m.gguf, /models/other.gguf)"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_with_their_path(doc: Any, message: str) -> None:
    with pytest.raises(CatalogError, match=re.escape(message)):
        parse_model(doc)


def cat(*docs: dict[str, Any]) -> dict[str, ModelSpec]:
    return {d["name"]: parse_model(d) for d in docs}


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (cat(model(name="a", fallbacks=["ghost"])), "a: fallbacks[0]: 'ghost' names no model in the catalog"),
        (cat(model(name="a", fallbacks=["a"])), "a: fallbacks[0]: a model cannot fall back to itself"),
        (cat(model(name="a"), model(name="b", aliases=["a"])), "b: aliases[0]: 'a' is the name of a model"),
        (cat(model(name="a", aliases=["x"]), model(name="b", aliases=["x"])), "b: aliases[0]: 'x' is already an alias of a"),
    ],
)  # fmt: skip
def test_names_across_the_catalog(models: dict[str, ModelSpec], message: str) -> None:
    with pytest.raises(CatalogError, match=re.escape(message)):
        check_catalog(models)


def test_a_consistent_catalog_passes() -> None:
    check_catalog(cat(model(name="a", aliases=["x"], fallbacks=["b"]), model(name="b")))


# ---- LoRA adapters (#60) ------------------------------------------------------------------


def test_adapters_parse_and_round_trip() -> None:
    m = parse_model(model(max_adapters=2, adapters={
        "sql": {"source": "/models/sql.gguf", "rank": 8},
        "support-fr": {"source": "/models/fr.gguf", "pin": True}}))  # fmt: skip
    assert m.max_adapters == 2 and m.adapters["support-fr"].pin and m.adapters["sql"].rank == 8
    assert parse_model(m.to_json()) == m
    assert "adapters" not in parse_model(model()).to_json()  # none: the entry is as before


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"adapters": ["sql"]}, "adapters: expected a mapping"),
        ({"adapters": {"bad name": {"source": "/a.gguf"}}}, "adapters.bad name: a name is"),
        ({"adapters": {"m": {"source": "/a.gguf"}}}, "adapters.m: the model's own name"),
        ({"adapters": {"a": {}}}, "adapters.a.source: required"),
        ({"adapters": {"a": {"source": "a.gguf"}}}, "adapters.a.source: an absolute path"),
        ({"adapters": {"a": {"source": "/a,b"}}}, "adapters.a.source: an absolute path"),
        ({"adapters": {"a": {"source": "/a.gguf", "rank": 0}}}, "adapters.a.rank: expected"),
        ({"adapters": {"a": {"source": "/a.gguf", "pin": "yes"}}}, "adapters.a.pin: expected"),
        ({"adapters": {"a": {"source": "/a.gguf", "alpha": 1}}}, "adapters.a.alpha: unknown"),
        ({"max_adapters": 0}, "max_adapters: expected an integer in [1, 64]"),
        ({"max_adapters": 1, "adapters": {"a": {"source": "/a.gguf", "pin": True},
                                          "b": {"source": "/b.gguf", "pin": True}}},
         "2 pinned (a, b), more than max_adapters 1"),
    ],
)  # fmt: skip
def test_a_bad_adapter_entry_is_refused_with_its_field(kw: dict[str, Any], error: str) -> None:
    with pytest.raises(CatalogError) as err:
        parse_model(model(**kw))
    assert error in str(err.value)


def test_an_adapter_name_is_no_other_models_name_alias_or_adapter() -> None:
    a = parse_model(model(name="a", aliases=["alpha"],
                          adapters={"sql": {"source": "/s.gguf"}}))  # fmt: skip
    for other, error in [
        ({"adapters": {"alpha": {"source": "/x.gguf"}}}, "already an alias of a"),
        ({"adapters": {"a": {"source": "/x.gguf"}}}, "already model a"),
        ({"adapters": {"sql": {"source": "/x.gguf"}}}, "already an adapter of a"),
    ]:
        b = parse_model(model(name="b", **other))
        with pytest.raises(CatalogError, match=error):
            check_catalog({"a": a, "b": b})


def test_apply_reads_the_adapter_files_it_has_against_their_base(tmp_path: Path) -> None:
    """`cgn-ctl models apply`'s check: an adapter of another base is refused, naming both;
    files this machine does not have are left to the engine that loads them."""
    from cgn_control.decide.adapters import check_files
    from cgn_core.bundled_models import smollm2
    from harness.lora import write_adapter, write_peft

    good = write_adapter(smollm2(), tmp_path / "good.gguf", layers=(0,))
    foreign = write_adapter(smollm2(), tmp_path / "qwen.gguf", layers=(0,), arch="qwen2")
    base = str(smollm2())
    check_files(parse_model(model(source=base, adapters={"a": {"source": str(good)}})))
    check_files(parse_model(model(source=base, adapters={"a": {"source": "/elsewhere.gguf"}})))
    with pytest.raises(CatalogError) as err:
        check_files(parse_model(model(source=base, adapters={"b": {"source": str(foreign)}})))
    assert f"adapters.b: adapter {foreign} is for architecture 'qwen2'" in str(err.value)
    assert base in str(err.value)  # both named
    ranked = parse_model(model(source=base, adapters={"a": {"source": str(good), "rank": 4}}))
    with pytest.raises(CatalogError) as err:
        check_files(ranked)
    assert "adapters.a.rank: 4, the file's is 8" in str(err.value)
    peft = write_peft(smollm2(), good, tmp_path / "peft")  # a PEFT directory, checked alike
    check_files(parse_model(model(source=base, adapters={"p": {"source": str(peft)}})))
    (peft / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "use_dora": true}')
    with pytest.raises(
        CatalogError, match=r"adapters\.p: adapter .*: adapter_config\.json: use_dora"
    ):
        check_files(parse_model(model(source=base, adapters={"p": {"source": str(peft)}})))
