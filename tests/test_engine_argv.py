"""Every argv our vLLM and SGLang drivers render, parsed by the engine's own parser (#62): its
options as recorded from the package by scripts/capture_engine_options.py (the version in
the file name: what the driver targets), and with the real parser where the package
imports (not on CI: SGLang's needs triton and IPython, vLLM's xgrammar and more). An
option the engine renamed, a choice it dropped, a flag that takes a value where ours
gives none: each fails here."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cgn_agent.drivers import DRIVERS, LaunchContext
from cgn_agent.spec import EngineProfile, LoraFile, PipelinePart, ReplicaId, ReplicaSpec

SGLANG = Path(__file__).with_name("fixtures") / "engines" / "sglang-0.5.23.json"
VLLM = Path(__file__).with_name("fixtures") / "engines" / "vllm-0.34.0.json"
CTX = LaunchContext("0.0.0.0", 8100, python="/venv/bin/python")
RANK_CTX = replace(CTX, advertise_host="10.0.0.1", rendezvous_port=29500)


class Tools:
    def which(self, name: str) -> str | None:
        return {"vllm": "/v/bin/vllm", "ray": "/v/bin/ray"}.get(name)

    def has_module(self, name: str) -> bool:
        return True

    def is_file(self, path: str) -> bool:
        return True


def recorded_parser(path: Path) -> tuple[argparse.ArgumentParser, str]:
    """The engine's parser rebuilt from its recorded options (flags, values, choices)."""
    doc = json.loads(path.read_text())
    # NOTE: no abbreviations: SGLang's parser takes a prefix of one option for it, and a
    # new option sharing the prefix would make it ambiguous; ours spell every flag whole
    p = argparse.ArgumentParser(
        prog=doc["engine"], exit_on_error=False, add_help=False, allow_abbrev=False
    )
    convert = {"int": int, "float": float}
    for o in doc["options"]:
        if not o["takes_value"]:
            p.add_argument(*o["flags"], dest=o["dest"], action="store_true")
            continue
        kw: dict[str, Any] = {"dest": o["dest"], "type": convert.get(o["type"] or "", str)}
        if o["nargs"] is not None:
            kw["nargs"] = o["nargs"]
        if o["choices"] is not None:
            kw["choices"] = [kw["type"](c) for c in o["choices"]]
        p.add_argument(*o["flags"], **kw)
    if doc["engine"] == "vllm":
        p.add_argument("model_tag", nargs="?")  # `vllm serve MODEL`
    return p, doc["version"]


def spec(**kw: Any) -> ReplicaSpec:
    base = ReplicaSpec(ReplicaId("r1"), "llama-8b", "sglang", "meta-llama/Llama-3.1-8B-Instruct",
                       devices=(0,))  # fmt: skip
    return replace(base, **kw)


PEFT = (LoraFile("sql", "/m/sql"), LoraFile("fr", "/m/fr"))
CASES: dict[str, tuple[ReplicaSpec, LaunchContext]] = {
    "single": (spec(profile=EngineProfile(ctx=4096, dtype="bfloat16",
                                          gpu_memory_utilization=0.85)), CTX),
    "tp4": (spec(devices=(0, 1, 2, 3), profile=EngineProfile(tensor_parallel=4)), CTX),
    "hicache": (spec(profile=EngineProfile(kv_connector="hicache")), CTX),
    "offloading": (spec(), replace(CTX, offload_gib=16.0)),
    "lmcache": (spec(profile=EngineProfile(kv_connector="lmcache")), CTX),
    "nixl prefill": (spec(role="prefill", profile=EngineProfile(kv_connector="nixl")), CTX),
    "nixl decode": (spec(role="decode", profile=EngineProfile(kv_connector="nixl")), CTX),
    "lora": (spec(profile=EngineProfile(lora=PEFT, max_loras=4, max_lora_rank=16)), CTX),
    "extra args": (spec(profile=EngineProfile(extra_args=("--chunked-prefill-size", "4096"))),
                   CTX),
    **{f"rank {r} of 2": (spec(devices=(0, 1, 2, 3),
                               profile=EngineProfile(tensor_parallel=4, ctx=8192),
                               pipeline=PipelinePart(r, 2, "n1", (), "10.0.0.1:29500" if r else "")),
                          replace(RANK_CTX, rendezvous_port=29500 if r == 0 else 0))
       for r in (0, 1)},
}  # fmt: skip


def argv_of(s: ReplicaSpec, ctx: LaunchContext) -> list[str]:
    """The arguments after `python -m sglang.launch_server` of the engine's own command."""
    launch = DRIVERS["sglang"].launch(s, ctx, Tools())  # type: ignore[arg-type]
    commands = [c.argv for c in launch.commands] if launch.commands else [launch.argv]
    (argv,) = [a for a in commands if "sglang.launch_server" in a]
    return list(argv[argv.index("sglang.launch_server") + 1 :])


@pytest.mark.parametrize("case", sorted(CASES))
def test_sglang_takes_every_argv_our_driver_renders(case: str) -> None:
    parser, version = recorded_parser(SGLANG)
    args = argv_of(*CASES[case])
    try:
        parsed, unknown = parser.parse_known_args(args)
    except argparse.ArgumentError as exc:
        pytest.fail(f"SGLang {version} refuses {args}: {exc}")
    assert unknown == [], f"SGLang {version} has no option {unknown}"
    assert parsed.model_path == "meta-llama/Llama-3.1-8B-Instruct" and parsed.enable_metrics
    assert parsed.port == (None if case == "rank 1 of 2" else 8100)  # ranks 1.. serve no HTTP


def test_the_recorded_parser_refuses_what_sglang_refuses() -> None:
    """The check can fail: a renamed flag, a bad choice, a missing value."""
    parser, _ = recorded_parser(SGLANG)
    _, unknown = parser.parse_known_args(["--max-loras", "4"])  # vLLM's name, not SGLang's
    assert unknown == ["--max-loras", "4"]
    assert parser.parse_known_args(["--tensor-parallel-size", "2"])[0].tp_size == 2  # alias
    with pytest.raises(argparse.ArgumentError):
        parser.parse_known_args(["--disaggregation-mode", "both-ways"])
    with pytest.raises(argparse.ArgumentError):
        parser.parse_known_args(["--tp-size", "two"])


def test_where_sglang_imports_its_own_parser_takes_them_too() -> None:
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="SGLang is not installed (its recorded parser is used)"
    )
    p = argparse.ArgumentParser(exit_on_error=False)
    server_args.ServerArgs.add_cli_args(p)
    for _, (s, ctx) in sorted(CASES.items()):
        p.parse_args(argv_of(s, ctx))


def vspec(**kw: Any) -> ReplicaSpec:
    base = ReplicaSpec(ReplicaId("r1"), "llama-8b", "vllm", "meta-llama/Llama-3.1-8B-Instruct",
                       devices=(0,))  # fmt: skip
    return replace(base, **kw)


def rank_case(r: int, mode: str) -> tuple[ReplicaSpec, LaunchContext]:
    s = vspec(devices=(0, 1, 2, 3), profile=EngineProfile(tensor_parallel=4, ctx=8192,
              launch_mode=mode), pipeline=PipelinePart(r, 2, "n1", (), "10.0.0.1:29500" if r else ""))  # fmt: skip
    return s, replace(RANK_CTX, rendezvous_port=29500 if r == 0 else 0)


VLLM_CASES: dict[str, tuple[ReplicaSpec, LaunchContext]] = {
    "single": (vspec(profile=EngineProfile(ctx=8192, gpu_memory_utilization=0.9)), CTX),
    "tp2 lmcache": (vspec(devices=(0, 1), profile=EngineProfile(tensor_parallel=2,
                                                                  kv_connector="lmcache")), CTX),
    "nixl prefill": (vspec(role="prefill", profile=EngineProfile(kv_connector="nixl")), CTX),
    "nixl decode": (vspec(role="decode", profile=EngineProfile(kv_connector="nixl")), CTX),
    "offloading": (vspec(), replace(CTX, offload_gib=16.0)),
    "lora": (vspec(profile=EngineProfile(lora=PEFT, max_loras=4, max_lora_rank=16)), CTX),
    **{f"{mode} rank {r}": rank_case(r, mode) for mode in ("ray", "mp") for r in (0, 1)
       if not (mode == "ray" and r == 1)},  # a Ray rank 1 runs `ray start` only
}  # fmt: skip


def vllm_argv(s: ReplicaSpec, ctx: LaunchContext) -> list[str]:
    """The arguments after `vllm serve`."""
    launch = DRIVERS["vllm"].launch(s, ctx, Tools())  # type: ignore[arg-type]
    commands = [c.argv for c in launch.commands] if launch.commands else [launch.argv]
    (argv,) = [a for a in commands if "serve" in a]
    return list(argv[argv.index("serve") + 1 :])


@pytest.mark.parametrize("case", sorted(VLLM_CASES))
def test_vllm_takes_every_argv_our_driver_renders(case: str) -> None:
    parser, version = recorded_parser(VLLM)
    args = vllm_argv(*VLLM_CASES[case])
    try:
        parsed, unknown = parser.parse_known_args(args)
    except argparse.ArgumentError as exc:
        pytest.fail(f"vLLM {version} refuses {args}: {exc}")
    assert unknown == [], f"vLLM {version} has no option {unknown}"
    assert parsed.model_tag == "meta-llama/Llama-3.1-8B-Instruct"


def test_where_vllm_imports_its_own_parser_takes_them_too() -> None:
    cli = pytest.importorskip(
        "vllm.entrypoints.common.cli_args",
        reason="vLLM is not installed (its recorded parser is used)",
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = cli.make_arg_parser(FlexibleArgumentParser())
    for _, (s, ctx) in sorted(VLLM_CASES.items()):
        parser.parse_args(vllm_argv(s, ctx))
