"""Placement records as an agent parses them (cgn_agent/spec.py): every field checked and
named when bad, and `spec_to_json` giving back what `parse_placement` reads."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from cgn_agent.spec import LoraFile, PipelinePart, parse_placement, spec_to_json


def test_pipeline_parts_parse_and_name_bad_fields() -> None:
    doc = {"model": "m", "engine": "cgn_infer", "source": "smollm2",
           "pipeline": {"part": 0, "parts": 3, "head": "n1", "stages": ["a:1", "10.0.0.3:9101"]}}  # fmt: skip
    s = parse_placement("r7", doc)
    assert s.pipeline == PipelinePart(0, 3, "n1", ("a:1", "10.0.0.3:9101"))
    assert parse_placement("r7", spec_to_json(s)) == s
    assert "pipeline" not in spec_to_json(replace(s, pipeline=None))
    base = {"model": "m", "engine": "cgn_infer"}
    for bad, message in [
        ({"part": 0, "parts": 1, "head": "n1"}, "'parts' must be an integer 2-64"),
        ({"part": 2, "parts": 2, "head": "n1"}, "'part' must be an integer 0-1"),
        ({"part": 1, "parts": 2, "head": "../x"}, "'head' must be a node id"),
        ({"part": 1, "parts": 2, "head": "n1", "stages": ["a:1"]}, "belongs to the head"),
        ({"part": 0, "parts": 3, "head": "n1", "stages": ["a:1"]}, "lists all 2 stages"),
        ({"part": 0, "parts": 2, "head": "n1", "stages": ["no port"]}, "host:port"),
        ({"part": 0, "parts": 2, "head": "n1", "rank": 1}, "unknown field(s) rank"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_placement("r7", {**base, "pipeline": bad})
    with pytest.raises(ValueError, match="only cgn_infer, sglang, vllm run across nodes"):
        parse_placement("r7", {"model": "m", "engine": "trtllm",
                               "pipeline": {"part": 0, "parts": 2, "head": "n1"}})  # fmt: skip


def test_placement_parsing_round_trips_and_names_bad_fields() -> None:
    doc = {"model": "m", "engine": "vllm", "source": "s", "port": 8001, "devices": [0, 1],
           "role": "prefill", "profile": {"tensor_parallel": 2, "kv_connector": "nixl",
           "extra_args": ["--x"], "env": {"A": "1"}, "gpu_memory_utilization": 0.5}}  # fmt: skip
    s = parse_placement("r7", doc)
    assert s.devices == (0, 1) and s.profile.env == {"A": "1"} and s.profile.extra_args == ("--x",)
    assert parse_placement("r7", spec_to_json(s)) == s
    lora = [{"name": "fr", "path": "/m/fr.gguf"}, {"name": "sql", "path": "/m/sql.gguf"}]
    s = parse_placement("r7", {"model": "m", "engine": "llama_cpp", "source": "/m/smol.gguf",
                               "profile": {"lora": lora}})  # fmt: skip
    assert s.profile.lora == (LoraFile("fr", "/m/fr.gguf"), LoraFile("sql", "/m/sql.gguf"))
    assert parse_placement("r7", spec_to_json(s)) == s
    for bad, message in [
        ({"engine": "vllm"}, "'model' must be a non-empty string"),
        ({"model": "m", "engine": "tgi"}, "engine must be one of"),
        ({"model": "m", "engine": "vllm", "port": 70000}, "'port' must be an integer 0-65535"),
        ({"model": "m", "engine": "vllm", "devices": [0, 0]}, "lists a device twice"),
        ({"model": "m", "engine": "vllm", "colour": 1}, "unknown field(s) colour"),
        (
            {"model": "m", "engine": "vllm", "profile": {"ctx": -1}},
            "'ctx' must be a positive integer",
        ),
        (
            {"model": "m", "engine": "vllm", "profile": {"kv_connector": "x"}},
            "'kv_connector' must be one of",
        ),
        ({"model": "m", "engine": "vllm", "profile": {"gpu_memory_utilization": 2}}, "in (0, 1]"),
        ([1, 2], "expected a JSON object"),
        *(
            ({"model": "m", "engine": "llama_cpp", "profile": {"lora": lora}}, "{name, path}")
            for lora in (
                ["/m/a.gguf"],
                [{"name": "a", "path": "m/a.gguf"}],
                [{"name": "../a", "path": "/m/a.gguf"}],
                [{"name": "a", "path": "/m/a.gguf"}, {"name": "a", "path": "/m/b.gguf"}],
            )
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_placement("r7", bad)
    with pytest.raises(ValueError, match="replica id"):
        parse_placement("../etc", {"model": "m", "engine": "vllm"})
