"""A real `cgn-metrics serve`: the fleet from a real etcd (with bad records in it), a real
sim engine under load, agents exporting power as the agent's own collector writes it
(one with a RAPL-style source, one with none), and the dashboard rendered by headless
Chromium, served and opened from disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cgn_core.etcd.local import LocalEtcd
from cgn_metrics.server import dashboard_html
from harness import browser
from harness.fake_agent import FakePower, fake_agent
from harness.poll import until
from harness.procs import cgn_infer, cgn_metrics, etcd_put, etcd_run

pytestmark = pytest.mark.etcd
MODEL = "smolsim"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Its own etcd: cgn-metrics reads the cluster's fixed keys, which no other test's
    agents or reconcilers may see."""
    tmp = tmp_path_factory.mktemp("metrics")
    etcd_server = LocalEtcd(tmp / "etcd")
    etcd_server.start()
    powered = FakePower(35.0)
    with (
        cgn_infer(tmp, "--backend", "sim", "--speed", "20", "--model-name", MODEL) as engine,
        fake_agent(powered) as agent1,
        fake_agent(FakePower(None)) as agent2,
    ):
        prefix = "/cognitora/"
        ep = etcd_server.endpoint
        etcd_put(ep, prefix + "nodes/m1", {"admin_url": agent1, "power": {"watts": 35.0},
                                           "engines": ["cgn_infer"]})  # fmt: skip
        etcd_put(ep, prefix + "nodes/m2", {"admin_url": agent2, "engines": ["cgn_infer"]})
        etcd_put(ep, prefix + "catalog/models/" + MODEL, {"name": MODEL, "source": "smollm2",
                 "profiles": [{"engine": "cgn_infer", "accelerator": "cpu"}]})  # fmt: skip
        etcd_put(ep, prefix + "nodes/m3", {"admin_url": ["not", "a", "url"]})  # bad: skipped
        etcd_put(ep, prefix + f"endpoints/m1/{MODEL}/r1", {"url": engine, "model": MODEL})
        etcd_put(ep, prefix + f"endpoints/m9/{MODEL}/r2", {"url": "http://127.0.0.1:1"})  # dead
        etcd_put(ep, prefix + "cordon/m2", {"drain": False})
        etcd_put(ep, prefix + "placements/m9/r2", {"model": MODEL})
        sd = tmp / "file_sd.json"
        with cgn_metrics(tmp, "--set", f"etcd.endpoints={ep}", "--set", "scrape_interval_s=0.5",
                         "--set", "window_s=20", "--set", "scrape_timeout_s=1",
                         "--set", "efficiency_publish_s=1",
                         "--file-sd", str(sd)) as url:  # fmt: skip
            yield {"url": url, "engine": engine, "sd": sd, "power": powered, "etcd": ep}
    etcd_server.stop()


def load(engine: str, n: int = 12) -> None:
    for _ in range(n):
        r = httpx.post(engine + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello there", "max_tokens": 16})  # fmt: skip
        assert r.status_code == 200


def fleet(url: str) -> dict[str, Any]:
    return httpx.get(url + "/api/v1/fleet", timeout=10).json()


def test_fleet_view_from_etcd_with_energy_per_token(stack: dict[str, Any]) -> None:
    url = stack["url"]
    load(stack["engine"])

    def measured() -> dict[str, Any] | None:
        v = fleet(url)
        nodes = {n["node"]: n for n in v.get("nodes", [])}
        m1 = nodes.get("m1")
        return v if m1 and m1["j_per_output_token"] and v["totals"]["tokens_per_s"] else None

    v = until("energy per token on m1", measured, timeout_s=30)
    nodes = {n["node"]: n for n in v["nodes"]}
    assert {n: x["state"] for n, x in nodes.items()} == {
        "m1": "Ready",
        "m2": "Cordoned",
        "m9": "Lost",
    }
    m1 = nodes["m1"]
    assert m1["source"] == "rapl" and m1["watts"] == 35.0
    # joules over the window (35 W x seconds covered) over the tokens made in it
    assert m1["j_per_output_token"] > 0 and m1["j_per_token"] <= m1["j_per_output_token"]
    assert nodes["m2"]["source"] == "unavailable" and nodes["m2"]["j_per_output_token"] is None
    t = v["totals"]
    assert t["energy_source"] == "rapl" and t["watts"] == 35.0 and t["ttft_s"]["p50"] is not None
    (model,) = v["models"]
    assert model["model"] == MODEL and (model["replicas"], model["ready"]) == (2, 1)
    states = {x["id"]: x["state"] for x in v["targets"]}
    assert states["engine:m9.r2"] == "down" and states["engine:m1.r1"] == "up"
    assert not any(x["node"] == "m3" for x in v["targets"])  # its bad record was skipped
    dead = next(x for x in v["targets"] if x["id"] == "engine:m9.r2")
    assert "ConnectError" in dead["error"] and dead["scrape_ms"] < 1500  # bounded


def test_the_measured_figure_reaches_etcd_and_explain_placement(stack: dict[str, Any]) -> None:
    """cgn-metrics publishes m1's tokens per joule; placement's explanation shows it."""
    load(stack["engine"])
    ep = stack["etcd"]
    doc = until("m1's efficiency record", lambda: etcd_run(
        ep, lambda c: c.get_json("/cognitora/efficiency/m1")), timeout_s=30)  # fmt: skip
    assert doc["source"] == "rapl" and doc["tokens_per_joule"] > 0
    assert etcd_run(ep, lambda c: c.get_json("/cognitora/efficiency/m2")) is None  # no source
    ctl = str(Path(sys.executable).parent / "cgn-ctl")
    out = subprocess.run([ctl, "explain-placement", MODEL, "--etcd", ep], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "output tokens/J" in out.stdout and "m1" in out.stdout, out.stdout


def test_metrics_federation_file_sd_and_history(stack: dict[str, Any]) -> None:
    url = stack["url"]
    until("a fleet view", lambda: fleet(url).get("totals"), timeout_s=30)
    text = httpx.get(url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"cgn_fleet_tokens_per_second", "cgn_node_power_watts", "cgn_metrics_target_up"} <= set(
        families
    )
    power = {s.labels["node"]: s.value for s in families["cgn_node_power_watts"].samples}
    assert power == {"m1": 35.0}  # m2 has no source: absent, not 0
    federated = list(text_string_to_metric_families(httpx.get(url + "/federate", timeout=10).text))
    tokens = [s for f in federated for s in f.samples if s.name == "vllm:generation_tokens_total"]
    assert tokens and tokens[0].labels["cgn_kind"] == "engine" and tokens[0].labels["node"] == "m1"
    sd = until(
        "file_sd written", lambda: stack["sd"].exists() and stack["sd"].read_text(), timeout_s=10
    )
    assert '"cgn_kind": "agent"' in sd and '"node": "m1"' in sd
    hist = httpx.get(url + "/api/v1/history", params={"prefix": "fleet:"}, timeout=10).json()
    assert len(hist["fleet:tokens_per_s"]) >= 2
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}


def test_an_agent_restart_does_not_make_negative_energy(stack: dict[str, Any]) -> None:
    load(stack["engine"], 4)
    stack["power"].reset()  # the agent's energy counter starts again from zero
    reset_at = time.time()
    # a view summarized from a scrape after the reset (an agent target scraped since)
    v = until(
        "a view after the reset",
        lambda: (f := fleet(stack["url"]))["time"] > reset_at + 0.2 and f,
        timeout_s=15,
    )
    m1 = next(n for n in v["nodes"] if n["node"] == "m1")
    assert m1["joules"] is not None and m1["joules"] >= 0


def test_ctl_top_shows_the_live_fleet(stack: dict[str, Any]) -> None:
    """`cgn-ctl top` against this cgn-metrics: one frame as JSON (parsed), one rendered."""
    url = stack["url"]
    load(stack["engine"], 4)
    until("tokens/s in the view", lambda: fleet(url)["totals"]["tokens_per_s"], timeout_s=30)
    ctl = str(Path(sys.executable).parent / "cgn-ctl")
    out = subprocess.run([ctl, "top", "--metrics", url, "--json"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert nodes["m1"]["state"] == "Ready" and nodes["m1"]["watts"] == 35.0
    assert nodes["m1"]["ready"] == 1 and nodes["m1"]["running"] is not None
    assert nodes["m2"]["watts"] is None  # no power source: no figure, not 0
    (model,) = doc["models"]
    assert (model["name"], model["ready"], model["replicas"]) == (MODEL, 1, 2)
    assert model["kv_usage"] is not None and doc["energy_source"] == "rapl"
    assert any(d.startswith("engine:m9.r2: ") for d in doc["down"])
    frame = subprocess.run([ctl, "top", "--metrics", url, "--once"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert frame.returncode == 0, frame.stderr
    assert "nodes" in frame.stdout and "Cordoned" in frame.stdout and MODEL in frame.stdout
    dead = subprocess.run([ctl, "top", "--metrics", "http://127.0.0.1:1", "--json"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert dead.returncode == 1 and dead.stdout == ""
    assert dead.stderr.startswith("error: cannot read the fleet from cgn-metrics at")
    assert len(dead.stderr.strip().splitlines()) == 1


# the figures the dashboard shows: its screenshot is docs/images/dashboard.png
SCREENSHOTS = os.environ.get("CGN_SCREENSHOTS")  # a directory to copy screenshots into


def test_dashboard_renders_in_chromium_served_and_from_disk(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """Served and opened from disk: the page draws the fleet, logs no console error or
    uncaught exception, and its screenshot is saved (docs/images/dashboard.png is one)."""
    if browser.chromium() is None:  # CI installs it (.ci/run): there, its absence is a failure
        why = "chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    url = stack["url"]
    load(stack["engine"], 8)
    until(
        "a measured view",
        lambda: fleet(url).get("totals", {}).get("j_per_output_token"),
        timeout_s=30,
    )
    for name, page_url in (("served", url + "/"), ("from-disk", None)):
        if page_url is None:  # the same file opened from disk against the service
            copy = tmp_path / "dashboard.html"
            copy.write_text(dashboard_html())
            page_url = f"file://{copy}?api={url}"
        page = browser.open_page(page_url, "Number(document.body.dataset.rendered) >= 2")
        dom = page.dom
        assert page.errors == [], browser.as_json(page)
        status = re.search(r'<span id="status"[^>]*>([^<]*)</span>', dom)
        assert status and "cannot reach" not in status.group(1), dom[-2000:]
        assert re.search(r'<body data-rendered="[1-9]', dom), status.group(1)
        assert 'data-figure="J / output token"' in dom
        assert ">m1<" in dom and ">m2<" in dom and ">Cordoned<" in dom and ">Lost<" in dom
        m1 = re.search(r"<tr><td>m1</td>.*?</tr>", dom)
        m2 = re.search(r"<tr><td>m2</td>.*?</tr>", dom)
        assert m1 and m2 and "rapl" in m1.group(0) and "unavailable" not in m1.group(0)
        assert "unavailable" in m2.group(0)  # m2's energy: said, not invented
        assert f">{MODEL}<" in dom and "engine:m9.r2" in dom
        assert page.png.startswith(b"\x89PNG") and len(page.png) > 20_000  # drawn, not blank
        shot = tmp_path / f"dashboard-{name}.png"
        shot.write_bytes(page.png)
        if SCREENSHOTS:
            shutil.copy(shot, Path(SCREENSHOTS) / shot.name)


PAYLOAD = '<img src=x onerror="document.body.dataset.pwned=1">'


def _hostile(value: Any) -> Any:
    """The same shape with every leaf (text or number) replaced by markup that runs script."""
    if isinstance(value, dict):
        return {k: _hostile(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hostile(v) for v in value]
    return PAYLOAD


def test_the_dashboard_shows_a_hostile_api_as_text(stack: dict[str, Any], tmp_path: Path) -> None:
    """Opened with ?api= pointing anywhere: every field the page draws is escaped text, a
    number only when it is a finite number, a list only when it is one; the page renders
    (no exception, no console error) and no markup from the answer runs."""
    import http.server
    import threading

    if browser.chromium() is None:
        why = "chromium is not installed (Debian: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    url = stack["url"]
    until("a measured view", lambda: fleet(url).get("totals"), timeout_s=30)
    tenant = {"tenant": "t", "tokens_per_s": 1.0, "prompt_tokens_per_s": 1.0, "hit_rate": 0.5}
    now = fleet(url)
    replicas = [{**r, "adapters": ["a", 5]} for r in now["replicas"]]  # hostile names too
    view = {**_hostile({**now, "tenants": [tenant], "replicas": replicas}), "rounds": 5,
            "models": PAYLOAD}  # fmt: skip
    history = _hostile(httpx.get(url + "/api/v1/history?prefix=fleet:", timeout=10).json())
    answers = {"/api/v1/fleet": view, "/api/v1/history": history}

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answers.get(self.path.split("?")[0], {})).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        copy = tmp_path / "dashboard.html"
        copy.write_text(dashboard_html())
        api = f"http://127.0.0.1:{server.server_address[1]}"
        page = browser.open_page(
            f"file://{copy}?api={api}", "document.body.dataset.rendered === '5'"
        )
    finally:
        server.shutdown()
        server.server_close()
    assert page.errors == [], browser.as_json(page)
    assert "data-pwned" not in page.dom and '<img src="x"' not in page.dom  # never ran
    assert "&lt;img src=x" in page.dom  # shown, as text
