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
