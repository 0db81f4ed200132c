"""scripts/gpu-check.sh's pure parts (#62): what the CPU suite can check of a device check
that needs an NVIDIA GPU to run: its arguments, each verdict over recorded or real-shaped
inputs, the table and the exit status."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cgn_agent.inventory import nvidia
from cgn_agent.inventory.collect import collect

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).with_name("fixtures") / "agent"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load()


def test_arguments_are_checked_with_a_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    a = gc.parse_args(["--model", "/models/q"])
    assert (a.model, a.timeout, a.tokenizer) == ("/models/q", 540.0, "")
    for argv, words in (([], "--model"), (["--model", "m", "--timeout", "5"], "--timeout")):
        with pytest.raises(SystemExit) as exit_:
            gc.parse_args(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_the_inventory_verdict_reads_the_agents_own_inventory() -> None:
    """A real inventory (the agent's collector over nvidia-smi output recorded on an
    8 x H100 node, one GPU with uncorrected ECC errors)."""
    outputs = {q: (FIXTURES / f).read_text() for q, f in (
        (nvidia.GPUS_QUERY, "nvidia_smi_h100x8.csv"), (nvidia.APPS_QUERY, "nvidia_smi_apps_h100x8.csv"),
        (nvidia.CAPS_QUERY, "nvidia_smi_caps_h100x8.csv"))}  # fmt: skip
    inv = collect("n1", run=lambda argv: outputs[tuple(argv)], use_nvml=False)
    doc: dict[str, Any] = inv.to_json()
    got = gc.inventory(doc, 8)
    assert got.ok is False and got.detail.startswith("unhealthy: 1: ")
    healthy = {**doc, "accelerators": [{**a, "health": []} for a in doc["accelerators"]]}
    got = gc.inventory(healthy, 8)
    assert got.ok and got.detail.startswith("8 x h100-80g (sm 9.0)")
    assert gc.inventory(healthy, 9).ok is False  # nvidia-smi listed one the agent missed


def test_verdicts_on_what_the_cluster_answers() -> None:
    assert gc.gpus("0, NVIDIA H100 80GB HBM3, 9.0\n1, NVIDIA L40S, 8.9\n").detail == (
        "0: NVIDIA H100 80GB HBM3 (sm 9.0); 1: NVIDIA L40S (sm 8.9)")  # fmt: skip
    assert gc.gpus("").ok is False
    ready = {"replica": "r1", "node": "g1", "engine": "vllm", "devices": [0], "phase": "Ready"}
    assert gc.placement([ready]).ok and gc.placement([]).ok is False
    failed = {**ready, "phase": "Failed", "reason": "exit 1: CUDA out of memory"}
    assert "CUDA out of memory" in gc.placement([failed]).detail
    chunks = ['{"choices": [{"delta": {"content": "Hel"}}]}',
              '{"choices": [{"delta": {"content": "lo"}}]}', "[DONE]"]  # fmt: skip
    assert gc.streamed(chunks).detail == "2 chunks: 'Hello'"
    assert gc.streamed(chunks[:2]).ok is False and gc.streamed(["nope", "[DONE]"]).ok is False
    endpoint = {"engine": "vllm", "scrape_error": "", "kv_tracking": "approximate",
                "load": {"running": 1.0, "waiting": 0.0, "kv_usage": 0.02},
                "kv_blocks": {"exact": 0, "assumed": 12}}  # fmt: skip
    assert gc.metrics(endpoint).ok and "kv_usage 0.02" in gc.metrics(endpoint).detail
    assert gc.metrics({**endpoint, "load": None, "scrape_error": "503"}).ok is False
    assert gc.kv_events(endpoint).ok is None  # informational
    assert gc.drained([], 0).ok and gc.drained([], 1).ok is False
    assert gc.drained([ready], 0).ok is False
    doc = gc.model_doc("/models/q", "", "h100-80g")
    assert doc["profiles"] == [{"engine": "vllm", "accelerator": "h100-80g", "devices": 1,
                                "ctx": 2048}]  # fmt: skip


def test_the_table_and_the_exit_status() -> None:
    checks = [gc.Check("nvidia-smi", True, "0: H100", 0.1), gc.Check("kv events", None, "x"),
              gc.Check("placement", False, "r1: Failed", 301.5)]  # fmt: skip
    lines = gc.table(checks).splitlines()
    assert lines[0].split() == ["check", "result", "seconds", "detail"]
    assert lines[3].split()[:3] == ["placement", "FAIL", "301.5"]
    assert gc.verdict(checks) == 1 and gc.verdict(checks[:2]) == 0
    assert dataclasses.is_dataclass(checks[0])


def test_without_a_gpu_it_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gc.main(["--model", "/models/q"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
