"""What a placement may make an agent run: the per-engine argument and environment allow-lists
and the model-source rule (pure table tests; the agent's refusals over etcd are in
test_agent.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgn_agent.drivers import PlacementRefused
from cgn_agent.drivers.base import check_adapters, check_source
from cgn_agent.spec import ReplicaId, ReplicaSpec
from cgn_control.decide.catalog import CatalogError, parse_model
from cgn_core import engine_args
from cgn_core.bundled_models import smollm2
from cgn_core.engine_args import ArgsRefused


@pytest.mark.parametrize(
    ("engine", "args", "env"),
    [
        ("cgn_infer", ["--max-batch", "4", "--kv-pool-tokens=4096"], {"OMP_NUM_THREADS": "2"}),
        ("llama_cpp", ["-ngl", "99", "--cont-batching", "-c", "4096"], {}),
        ("vllm", ["--enable-prefix-caching", "--max-num-seqs", "64"], {"NCCL_DEBUG": "INFO"}),
        ("sglang", ["--disable-radix-cache", "--chunked-prefill-size=4096"], {}),
        ("openai_compat", [], {}),
    ],
)
def test_listed_flags_and_variables_pass(engine: str, args: list[str], env: dict[str, str]) -> None:
    engine_args.check(engine, args, env)


@pytest.mark.parametrize(
    ("engine", "args", "env", "why"),
    [
        ("cgn_infer", ["--ready-file", "/etc/motd"], {}, "flag --ready-file is not allowed"),
        ("cgn_infer", ["--ready-file=/etc/motd"], {}, "flag --ready-file is not allowed"),
        ("cgn_infer", ["--port", "1"], {}, "flag --port is not allowed"),
        ("cgn_infer", ["--config", "/x.yaml"], {}, "flag --config is not allowed"),
        ("cgn_infer", ["--max-batch"], {}, "flag --max-batch needs a value"),
        ("cgn_infer", ["serve"], {}, "extra_args may hold flags only"),
        ("llama_cpp", ["--mlock=1"], {}, "flag --mlock takes no value"),
        ("llama_cpp", ["--log-file", "/tmp/x"], {}, "flag --log-file is not allowed"),
        ("vllm", ["--trust-remote-code"], {}, "flag --trust-remote-code is not allowed"),
        ("vllm", ["--chat-template", "/etc/shadow"], {}, "flag --chat-template is not allowed"),
        ("sglang", ["--ssl-keyfile", "/k"], {}, "flag --ssl-keyfile is not allowed"),
        ("openai_compat", ["--x"], {}, "allowed: none"),
        ("cgn_infer", [], {"LD_PRELOAD": "/tmp/evil.so"}, "LD_PRELOAD is never allowed"),
        ("vllm", [], {"ld_library_path": "/tmp"}, "ld_library_path is never allowed"),
        ("vllm", [], {"PYTHONPATH": "/tmp"}, "PYTHONPATH is never allowed"),
        ("llama_cpp", [], {"DYLD_INSERT_LIBRARIES": "x"}, "is never allowed"),
        (
            "cgn_infer",
            [],
            {"CGN_INFER_HTTP__HOST": "0.0.0.0"},
            "CGN_INFER_HTTP__HOST is not allowed",
        ),
        ("nope", [], {}, "no argument policy"),
    ],
)
def test_everything_else_is_refused(
    engine: str, args: list[str], env: dict[str, str], why: str
) -> None:
    with pytest.raises(ArgsRefused, match=why):
        engine_args.check(engine, args, env)


def test_the_catalog_refuses_the_same_at_apply_time() -> None:
    doc = {"name": "m", "source": "smollm2",
           "profiles": [{"engine": "cgn_infer", "env": {"LD_PRELOAD": "x"}}]}  # fmt: skip
    with pytest.raises(CatalogError, match="LD_PRELOAD is never allowed"):
        parse_model(doc)


def spec(engine: str, source: str) -> ReplicaSpec:
    return ReplicaSpec(ReplicaId("r1"), "m", engine, source)


@pytest.mark.parametrize(
    ("engine", "source"),
    [
        ("cgn_infer", "smollm2"),
        ("cgn_infer", "qwen2.5-coder-0.5b"),
        ("llama_cpp", "smollm2"),  # a bundled model is a GGUF llama.cpp loads as it is
        ("vllm", "meta-llama/Llama-3.1-8B-Instruct"),
        ("sglang", "Qwen/Qwen2.5-7B-Instruct"),
        ("openai_compat", ""),
    ],
)
def test_bundled_models_and_hub_ids_need_no_model_dir(engine: str, source: str) -> None:
    check_source(spec(engine, source), ())


def test_files_under_model_dirs_and_the_bundled_file_pass(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.gguf").write_bytes(b"GGUF")
    check_source(spec("llama_cpp", str(tmp_path / "models" / "a.gguf")), (tmp_path / "models",))
    check_source(spec("llama_cpp", str(smollm2())), ())


@pytest.mark.parametrize(
    ("engine", "source", "why"),
    [
        ("cgn_infer", "/etc/passwd", "not under a model directory"),
        ("cgn_infer", "models/../../etc/passwd", "must be an absolute path"),
        ("llama_cpp", "smol", "must be an absolute path under the agent's model_dirs"),
        ("vllm", "../etc", "or a Hugging Face repo id"),
        ("vllm", "org/../etc", "must be an absolute path"),
        ("mlx_lm", "/root/.ssh", "not under a model directory"),
    ],
)
def test_any_other_source_is_refused(engine: str, source: str, why: str) -> None:
    with pytest.raises(PlacementRefused, match=why):
        check_source(spec(engine, source), ())


def test_a_symlink_out_of_a_model_dir_is_refused(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "escape.gguf").symlink_to("/etc/passwd")
    with pytest.raises(PlacementRefused, match="not under a model directory"):
        check_source(spec("llama_cpp", str(models / "escape.gguf")), (models,))


def test_adapter_files_are_held_to_the_model_dirs_too(tmp_path: Path) -> None:
    """A placement's `profile.lora` files, as its source: under a model dir, symlinks
    resolved, never an arbitrary path."""
    from dataclasses import replace

    from cgn_agent.spec import EngineProfile, LoraFile

    models = tmp_path / "models"
    models.mkdir()
    (models / "sql.gguf").write_bytes(b"GGUF")
    (models / "escape.gguf").symlink_to("/etc/passwd")
    base = spec("llama_cpp", str(smollm2()))
    check_adapters(replace(base, profile=EngineProfile(lora=(LoraFile("sql", str(models / "sql.gguf")),))),
                   (models,))  # fmt: skip
    for bad in ("/etc/passwd", str(models / "escape.gguf"), "sql.gguf"):
        with pytest.raises(PlacementRefused, match="not under a model directory"):
            check_adapters(
                replace(base, profile=EngineProfile(lora=(LoraFile("x", bad),))), (models,)
            )
