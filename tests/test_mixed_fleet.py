"""A mixed fleet on one machine: `cgn-ctl up --engines cgn_infer,llama_cpp,mlx_lm`.

Real processes end to end: etcd, the router, three agents (each offering one
engine), cgn-metrics, and SmolLM2 served by cgn-infer, llama.cpp's server
(xllamacpp) and mlx_lm's (MLX's CPU backend, from the GGUF converted once).
The official openai client talks to the router; every engine gets traffic,
each one's loss is survived by the others, cgn-metrics reads each in its own
vocabulary (its counters equal the engine's page) and the dashboard shows
them in headless Chromium.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from cgn_core.engine_metrics import name_map, parse_samples
from harness import browser
from harness.mixed_fleet import ENGINES, endpoint_records, engine_of_node, mixed_fleet
from harness.poll import get_json, until

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
DIALECT = {"cgn_infer": "cgn-infer", "llama_cpp": "llamacpp", "mlx_lm": "mlx_lm"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with mixed_fleet(tmp_path_factory.mktemp("mixed"), timeout_s=300) as doc:
        yield doc


def client(fleet: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["url"], api_key=fleet["key"], max_retries=0, timeout=120)


def engine_of(endpoint: str) -> str:
    """The engine behind a router endpoint id `<model>/<node>.<replica>`."""
    return engine_of_node(endpoint.split("/", 1)[1].rsplit(".", 1)[0])


def ask(fleet: dict[str, Any], i: int, stream: bool) -> str:
    """One request through the router (chat; streamed with usage or whole); the engine. Its
    own system prompt first: no engine holds its prefix (else the one that publishes KV
    events, cgn-infer, would be chosen for the shared default system prompt every time)."""
    messages = [
        {"role": "system", "content": f"{i} is your number."},
        {"role": "user", "content": "Name a colour."},
    ]
    c = client(fleet).chat.completions
    if stream:
        with c.with_streaming_response.create(
            model=fleet["model"], messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        ) as resp:  # fmt: skip
            chunks = list(resp.parse())
            where = resp.headers["x-cognitora-endpoint"]
        usage = chunks[-1].usage
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        raw = c.with_raw_response.create(model=fleet["model"], messages=messages, max_tokens=6)
        where, reply = raw.headers["x-cognitora-endpoint"], raw.parse()
        usage, text = reply.usage, reply.choices[0].message.content or ""
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 6
    assert text, where
    return engine_of(where)


def endpoints(fleet: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return endpoint_records(fleet["etcd"])


def test_every_engine_serves_the_openai_client_through_the_router(fleet: dict[str, Any]) -> None:
    """Requests three at a time (the router spreads load) until each engine has answered;
    every one succeeds, streamed or whole, with usage."""
    served: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for batch in range(8):
            jobs = [pool.submit(ask, fleet, 3 * batch + k, k % 2 == 0) for k in range(3)]
            for job in jobs:
                engine = job.result()
                served[engine] = served.get(engine, 0) + 1
            if len(served) == len(ENGINES):
                break
    assert set(served) == set(ENGINES), served


def test_cgn_metrics_reads_each_engine_as_its_own_page_says(fleet: dict[str, Any]) -> None:
    """cgn-metrics' federated samples equal each engine's own /metrics (read with the replica
    secret), in that engine's vocabulary; the dashboard (headless Chromium) shows every
    replica, with "—" for what an engine does not publish (mlx_lm has no queue figure)."""
    records = endpoints(fleet)
    assert set(records) == set(ENGINES)

    def own(engine: str) -> float:
        rec = records[engine]
        page = httpx.get(rec["url"] + "/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {rec['api_token']}"})  # fmt: skip
        assert page.status_code == 200, (engine, page.status_code)
        names = name_map(DIALECT[engine]).generation_tokens
        return parse_samples(page.text, set(names))[names[0]]

    def federated(engine: str) -> float | None:
        names = name_map(DIALECT[engine]).generation_tokens
        text = httpx.get(fleet["dashboard"] + "federate", timeout=10).text
        node = next(n for n in fleet["nodes"] if engine_of_node(n) == engine)
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(names[0] + "{") and f'node="{node}"' in line]  # fmt: skip
        return found[0] if found else None

    for engine in ENGINES:
        until(f"cgn-metrics' count of {engine}'s tokens", lambda e=engine: federated(e) == own(e),
              timeout_s=20, poll_s=0.5)  # fmt: skip
        assert own(engine) > 0, engine  # the first test's traffic reached it
    view = get_json(fleet["dashboard"] + "api/v1/fleet")
    reps = {engine_of_node(r["node"]): r for r in view["replicas"]}
    assert reps["mlx_lm"]["waiting"] is None and reps["mlx_lm"]["running"] is not None
    assert reps["llama_cpp"]["kv_usage"] is None  # llama.cpp's build has none
    assert all(r["running"] is not None for r in reps.values())
    if browser.chromium() is None:  # CI installs it (.ci/run): there, its absence is a failure
        assert not os.environ.get("CI"), "chromium is not installed"
        return
    page = browser.open_page(fleet["dashboard"], "Number(document.body.dataset.rendered) >= 2")
    assert page.errors == [], browser.as_json(page)
    table = page.dom.split('id="replicas"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>([^<]+)\.smollm2-[0-9a-f]+</td>(.*?)</tr>", table)
    shown = {engine_of_node(node): cells for node, cells in rows}
    assert set(shown) == set(ENGINES), page.dom[-3000:]
    assert "—" in shown["mlx_lm"]


def test_killing_any_one_engine_is_survived_by_the_others(fleet: dict[str, Any]) -> None:
    """SIGKILL each engine in turn: every request meanwhile is answered by another one."""
    order = ("mlx_lm", "llama_cpp", "cgn_infer")  # the slowest to load back last: not waited
    for engine in order:
        pid = engine_pid(fleet, engine)
        os.kill(pid, signal.SIGKILL)
        for i in range(2):  # one streamed, one whole
            assert ask(fleet, 100 + i, stream=i % 2 == 0) in ENGINES
        if engine == order[-1]:
            break  # the others are back (waited for below); this one's return is tested there
        until(f"{engine} restarted by its agent", lambda e=engine, p=pid: ready_again(fleet, e, p),
              timeout_s=60, poll_s=0.5)  # fmt: skip


def engine_pid(fleet: dict[str, Any], engine: str) -> int:
    suffix = "" if engine == ENGINES[0] else f"-{engine}"
    (rec,) = (fleet["state"] / f"agent{suffix}" / "replicas").glob("*.json")
    return int(json.loads(rec.read_text())["fingerprint"]["pid"])


def ready_again(fleet: dict[str, Any], engine: str, old_pid: int) -> bool:
    try:
        pid = engine_pid(fleet, engine)
    except (ValueError, KeyError, OSError):
        return False
    if pid == old_pid:
        return False
    rec = endpoints(fleet).get(engine)
    return bool(rec) and httpx.get(rec["url"] + "/health", timeout=5).status_code == 200
