"""The proxy's deadlines against a deliberately slow real engine (cgn-infer sim, router-only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.procs import Router, cgn_infer, cgn_router

MODEL = "slow"


@pytest.fixture(scope="module")
def slow_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """One sim engine at 1/20 speed (a step takes over a second) behind tight deadlines."""
    tmp = tmp_path_factory.mktemp("slow")
    with cgn_infer(tmp, "--backend", "sim", "--speed", "0.05", "--model-name", MODEL) as engine:
        config = {
            "discovery": "static",
            "endpoints": {"only": {"url": engine, "model": MODEL}},
            "deadlines": {"first_token_s": 0.4, "idle_s": 0.4, "total_s": 30},
            "breaker": {"failures": 100},
        }
        with cgn_router(tmp, config) as router:
            yield router


def call(router: Router, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        router.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


def test_a_non_streaming_answer_is_bounded_by_the_total_not_the_first_token(
    slow_router: Router,
) -> None:
    status, body = call(slow_router, {"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_no_first_token_within_the_deadline_is_a_504(slow_router: Router) -> None:
    status, body = call(
        slow_router, {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
    )
    error = json.loads(body)["error"]
    assert status == 504 and error["code"] == "first_token_timeout" and error["type"] == "timeout"


def test_a_stalled_stream_ends_with_an_idle_timeout_event(slow_router: Router) -> None:
    """Chat streams open with a role chunk at once, then the next token takes over a second."""
    req = urllib.request.Request(
        slow_router.url + "/v1/chat/completions",
        data=json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True,
        }).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "idle_timeout" and b"data: [DONE]" not in events


def test_a_stalled_engine_moves_the_requests_queued_on_it_too() -> None:
    """SIGSTOP of an engine: its running streams go idle and move after idle_s; the requests
    queued on it (no first byte yet, bounded by first_token_s) move with them, at once,
    instead of waiting out the stall. Every stream completes while it is still stopped."""
    import os
    import signal
    import tempfile
    import threading
    import time
    from pathlib import Path

    import httpx

    from harness.metrics import metric
    from harness.poll import until
    from harness.procs import cgn_infer_engines

    tmp = Path(tempfile.mkdtemp(prefix="stall-"))
    sim = ("--backend", "sim", "--speed", "10", "--model-name", MODEL, "--max-batch", "1")
    with cgn_infer_engines(tmp, 2, *sim) as engines:
        endpoints = {f"e{i}": {"url": e.url, "model": MODEL} for i, e in enumerate(engines)}
        config = {"discovery": "static", "endpoints": endpoints, "breaker": {"failures": 100},
                  "deadlines": {"idle_s": 1.0, "first_token_s": 60.0}}  # fmt: skip
        with cgn_router(tmp, config) as router:
            done: list[float] = []

            def stream(i: int) -> None:
                body = {"model": MODEL, "prompt": f"story {i}", "max_tokens": 120,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                with httpx.stream("POST", router.url + "/v1/completions", json=body,
                                  timeout=60) as resp:  # fmt: skip
                    text = resp.read()
                assert resp.status_code == 200 and b"data: [DONE]" in text, text[-300:]
                done.append(time.monotonic())

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            # the engine about to stop runs a stream and queues others (the other engine's
            # share may come and go meanwhile: only this one's matters)
            until("engine 0 running a stream and queueing more", lambda: (
                metric(engines[0].url, "vllm:num_requests_running")
                and metric(engines[0].url, "vllm:num_requests_waiting")), 30)  # fmt: skip
            os.kill(engines[0].proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                for t in threads:
                    t.join(timeout=40)
                still_stopped = time.monotonic()
            finally:
                os.kill(engines[0].proc.pid, signal.SIGCONT)
            assert len(done) == 6 and max(done) <= still_stopped
            assert max(done) - stopped < 30  # the stall itself would never end
            assert metric(router.admin, "cgn_router_errors_total", cause="stalled") >= 1


@pytest.mark.etcd
def test_a_stream_on_a_withdrawn_endpoint_moves_once_it_goes_quiet(etcd_server: Any) -> None:
    """#59: an engine being stopped after its drain may keep its connections open and write
    nothing (llama.cpp's server on SIGTERM). Once its endpoint record is gone, a tracked
    stream on it that goes quiet moves after WITHDRAWN_IDLE_S, not after `deadlines.idle_s`
    (60 s here), and its client gets the undisturbed answer."""
    import os
    import signal
    import tempfile
    import time
    from pathlib import Path

    import httpx

    from cgn_router.proxy import WITHDRAWN_IDLE_S
    from harness.metrics import metric
    from harness.poll import until
    from harness.procs import cgn_infer_engines, etcd_put, etcd_run

    tmp = Path(tempfile.mkdtemp(prefix="withdrawn-"))
    model = f"sim{os.getpid()}"
    sim = ("--backend", "sim", "--speed", "2", "--model-name", model)
    body = {"model": model, "prompt": "story", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip

    def text_of(url: str, on_text: Any = None) -> tuple[str, list[Any]]:
        text, errors = "", []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            where = resp.headers.get("x-cognitora-endpoint", "")
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    errors += [chunk["error"]] if "error" in chunk else []
                    text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
                    if on_text is not None and text:
                        on_text(where, text)
        return text, errors

    with cgn_infer_engines(tmp, 2, *sim) as engines:
        keys = {f"/cognitora/endpoints/{model}/e{i}": e for i, e in enumerate(engines)}
        for key, e in keys.items():
            etcd_put(etcd_server.endpoint, key, {"url": e.url, "engine": "cgn-infer"})
        config = {"etcd": {"endpoints": [etcd_server.endpoint]}, "reconciler": {"enabled": False},
                  "deadlines": {"idle_s": 60.0}, "breaker": {"failures": 100}}  # fmt: skip
        with cgn_router(tmp, config) as router:
            until("both endpoints", lambda: len(json.loads(urllib.request.urlopen(
                router.admin + "/endpoints", timeout=5).read())) >= 2)  # fmt: skip
            whole, _ = text_of(engines[0].url)
            stopped: list[Any] = []

            def stop_and_withdraw(where: str, text: str) -> None:
                if not stopped and len(text) >= len(whole) // 3:
                    i = int(where.rsplit("/e", 1)[-1])
                    os.kill(engines[i].proc.pid, signal.SIGSTOP)  # silent, connections open
                    stopped.append((engines[i], time.monotonic()))
                    etcd_run(etcd_server.endpoint, lambda c: c.delete(
                        f"/cognitora/endpoints/{model}/e{i}"))  # fmt: skip

            try:
                cut, errors = text_of(router.url, stop_and_withdraw)
                took = time.monotonic() - stopped[0][1]
            finally:
                for engine, _ in stopped:
                    os.kill(engine.proc.pid, signal.SIGCONT)
            assert stopped and not errors, errors
            assert cut == whole
            assert WITHDRAWN_IDLE_S <= took < 30, took  # not the 60 s idle deadline
            assert metric(router.admin, "cgn_router_migrations_total", cause="withdrawn",
                          result="continued") == 1  # fmt: skip
