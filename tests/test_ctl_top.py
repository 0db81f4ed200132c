"""`cgn-ctl top`'s frame from cgn-metrics' fleet view: sums per node and model, "—" for a
figure nobody publishes, and a hostile view read without a crash (the live command runs
against a real cgn-metrics in tests/test_metrics_service.py and tests/test_install.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from rich.console import Console

from cgn_core.fleet_view import FleetView
from cgn_ctl.top import DASH, Frame, render
from cgn_ctl.top import frame as frame_of


def frame(view: Any, url: str) -> Frame:
    """A frame from the JSON cgn-metrics would serve (read back as `fetch` reads it)."""
    return frame_of(FleetView.from_json(view), url)


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
        {"model": "smollm2", "replica": "r1", "node": "n1", "state": "up", "running": 3,
         "waiting": 2, "kv_usage": 0.4, "tokens_per_s": 80.0, "prefill_ms_per_token": 0.21,
         "decode_ms_per_token": 18.5},
        {"model": "smollm2", "replica": "r2", "node": "n1", "state": "up", "running": 2,
         "waiting": 0, "kv_usage": 0.7, "tokens_per_s": 40.0, "prefill_ms_per_token": 2.4,
         "decode_ms_per_token": 190.0},
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


def test_each_replicas_learned_speed_is_shown_the_slowest_first() -> None:
    f = frame(VIEW, "http://m:9092")
    assert [(r.name, r.prefill_ms_per_token, r.decode_ms_per_token) for r in f.replicas] == [
        ("r2", 2.4, 190.0), ("r1", 0.21, 18.5), ("?", None, None)]  # fmt: skip
    console = Console(record=True, width=200)
    console.print(render(f))
    lines = console.export_text().splitlines()
    r2 = next(line for line in lines if line.lstrip("│ ").startswith("r2 "))
    assert "0.210" not in r2 and "2.400" in r2 and "190.0" in r2
    unlearned = next(line for line in lines if line.lstrip("│ ").startswith("? "))
    assert unlearned.count(DASH) >= 5  # running, waiting, tokens/s, prefill, decode


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


EVIL = "n\x1b]0;pwned\x07\x1b[2J[red]x[/red]\u202eevil\nforged line"


def _shown(renderable: Any) -> str:
    """What a terminal would receive (colours off: rich adds no escape code of its own, so
    any in the output came from the text)."""
    console = Console(record=True, width=300, force_terminal=True, color_system=None)
    with console.capture() as cap:
        console.print(renderable)
    return cap.get()


def test_a_views_text_reaches_the_terminal_without_escapes_or_markup() -> None:
    """cgn-metrics relays names from records: what top shows of them is the text itself."""
    view = {**VIEW, "nodes": [{"node": EVIL, "state": EVIL}],
            "replicas": [{"node": EVIL, "model": "smollm2", "state": "up"}],
            "targets": [{"id": EVIL, "state": "down", "error": EVIL}],
            "totals": {"energy_source": EVIL}}  # fmt: skip
    out = _shown(render(frame(view, "http://m:9092/" + EVIL), EVIL))
    assert "pwned" in out and "[red]x[/red]" in out  # shown as text: markup not read
    for code in ("\x1b", "\x07", "\u202e", "\nforged"):
        assert code not in out, repr(code)


def test_a_fleet_answer_past_the_bound_is_refused_not_read_whole() -> None:
    import http.server
    import threading

    from cgn_ctl.top import MAX_VIEW_BYTES, MetricsUnreachable, fetch

    class Huge(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            chunk = b" " * (1 << 20)
            try:
                for _ in range(MAX_VIEW_BYTES // len(chunk) + 8):
                    self.wfile.write(chunk)
            except OSError:
                pass  # the reader stopped: what this test wants

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Huge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(MetricsUnreachable, match="more than 16777216 bytes"):
            fetch(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


def test_a_forged_scaling_target_is_clamped_and_flagged() -> None:
    from cgn_core.terminal import for_terminal
    from cgn_ctl import render as ctl_render
    from cgn_ctl.cluster_ops import _bounded

    said = {"model": "m", "role": "", "desired": 4096, "current": 1, "direction": "up",
            "reason": EVIL, "demand": 3.0, "capacity": None, "at_unix": 1.79e9,
            "history": [{"desired": 4096, "current": 1, "direction": "up", "reason": "x",
                         "at_unix": 1.79e9}]}  # fmt: skip
    shown = _bounded(said, 1, 3)
    assert shown["desired"] == 3 and shown["recorded_desired"] == 4096
    assert shown["history"][0]["desired"] == 3
    doc = {"model": "m", "pools": [{"role": "", "min": 1, "max": 3, "decision": shown}],
           "policy": {"enabled": True, "utilization": 0.7, "hysteresis": 0.1,
                      "up_cooldown_s": 30, "max_step_up": 2, "down_cooldown_s": 300,
                      "stabilization_s": 300, "ttft_p90_ms": None, "itl_p90_ms": None}}  # fmt: skip
    console = Console(record=True, width=300, force_terminal=True, color_system=None)
    ctl_render.console, saved = console, ctl_render.console
    try:
        with console.capture() as cap:
            ctl_render.explain_scaling(for_terminal(doc))  # as cgn-ctl's _emit hands it over
    finally:
        ctl_render.console = saved
    out = cap.get()
    assert "target 3" in out and "the record says 4096: out of bounds" in out
    assert "\x1b" not in out and "\u202e" not in out and "[red]x[/red]" in out
