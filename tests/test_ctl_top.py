"""`cgn-ctl top`'s frame from cgn-metrics' fleet view: sums per node and model, "—" for a
figure nobody publishes, and a hostile view read without a crash (the live command runs
against a real cgn-metrics in tests/test_metrics_service.py and tests/test_install.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from rich.console import Console

from cgn_ctl.top import DASH, Frame, frame, render

VIEW: dict[str, Any] = {
    "time": 1_790_000_000.0,
    "totals": {"requests_per_s": 3.5, "tokens_per_s": 120.0, "running": 5, "waiting": 2,
               "ttft_s": {"p50": 0.1, "p95": 0.25, "p99": 0.4}, "watts": 35.0,
               "j_per_output_token": 0.29, "energy_source": "rapl"},
    "nodes": [
        {"node": "n1", "state": "Ready", "watts": 35.0, "j_per_output_token": 0.29},
        {"node": "n2", "state": "Cordoned", "watts": None, "j_per_output_token": None},
    ],
    "models": [{"model": "smollm2", "replicas": 3, "ready": 2, "j_per_output_token": 0.29},
               {"model": "llama", "replicas": 1, "ready": 0, "j_per_output_token": None}],
    "replicas": [
        {"model": "smollm2", "node": "n1", "state": "up", "running": 3, "waiting": 2,
         "kv_usage": 0.4, "tokens_per_s": 80.0},
        {"model": "smollm2", "node": "n1", "state": "up", "running": 2, "waiting": 0,
         "kv_usage": 0.7, "tokens_per_s": 40.0},
        # a llama.cpp replica: no KV figure published
        {"model": "llama", "node": "n2", "state": "down", "running": None, "waiting": None,
         "kv_usage": None, "tokens_per_s": None},
    ],
    "targets": [{"id": "engine:n2.r3", "state": "down", "error": "ConnectError: refused"},
                {"id": "agent:n1", "state": "up", "error": ""}],
}  # fmt: skip


def test_nodes_and_models_sum_their_replicas() -> None:
    f = frame(VIEW, "http://m:9092")
    n1, n2 = f.nodes
    assert (n1.name, n1.state, n1.ready, n1.replicas) == ("n1", "Ready", 2, 2)
    assert (n1.running, n1.waiting, n1.tokens_per_s, n1.kv_usage) == (5, 2, 120.0, 0.7)
    assert (n1.watts, n1.j_per_output_token) == (35.0, 0.29)
    assert (n2.running, n2.kv_usage, n2.watts, n2.replicas, n2.ready) == (None, None, None, 1, 0)
    smol, llama = f.models
    assert (smol.ready, smol.replicas, smol.running, smol.kv_usage) == (2, 3, 5, 0.7)  # 3 placed
    assert (llama.ready, llama.replicas, llama.tokens_per_s) == (0, 1, None)
    assert (f.tokens_per_s, f.ttft_p95_s, f.energy_source) == (120.0, 0.25, "rapl")
    assert f.down == ("engine:n2.r3: ConnectError: refused",)


def test_a_figure_nobody_publishes_is_a_dash_not_zero() -> None:
    console = Console(record=True, width=200)
    console.print(render(frame(VIEW, "http://m:9092")))
    text = console.export_text()
    n2 = next(line for line in text.splitlines() if "n2" in line and "Cordoned" in line)
    assert n2.count(DASH) >= 5 and " 0 " not in n2  # running, waiting, tokens/s, KV, watts, J
    llama = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("llama"))
    assert "0/1" in llama and DASH in llama
    assert "70 %" in text and "down: engine:n2.r3" in text


@pytest.mark.parametrize(
    "view",
    [
        {},
        {"nodes": "not a list", "models": None, "replicas": [1, "x", None], "totals": []},
        {"nodes": [{"node": 7}, {"node": "ok", "watts": math.nan, "state": ["x"]}],
         "replicas": [{"node": "ok", "running": True, "waiting": "3", "kv_usage": math.inf,
                       "tokens_per_s": -1e400}],
         "models": [{"model": "m", "replicas": "two"}], "time": "now",
         "totals": {"ttft_s": "fast", "watts": 10**400}},
    ],
)  # fmt: skip
def test_a_hostile_view_gives_a_frame_not_a_crash(view: dict[str, Any]) -> None:
    f = frame(view, "http://m:9092")
    assert isinstance(f, Frame)
    for row in (*f.nodes, *f.models):
        for v in (row.running, row.waiting, row.tokens_per_s, row.kv_usage, row.watts):
            assert v is None or math.isfinite(v)
    console = Console(record=True, width=200)
    console.print(render(f))  # renders too
    assert "cgn-ctl top" in console.export_text()
