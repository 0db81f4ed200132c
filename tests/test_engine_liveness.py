"""One request, one bad logits row or one broken invariant must not stop an engine silently.

In process: the real Engine over the sim backend and SmolLM2's real tokenizer, with faults
injected where a bug would strike. Over HTTP: a real `cgn-infer serve --backend sim` fed the
requests that used to kill its worker thread, then a normal request that must still work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from cgn_core.errors import Unavailable
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_infer.backends.sim_backend import SimBackend, SimCost, word_tokens
from cgn_infer.engine import MAX_LOOP_FAILURES, Engine, EngineConfig, Job
from cgn_infer.events import Event, FinishEvent, GenerationRequest
from cgn_infer.metrics import EngineMetrics
from cgn_infer.models import args_from_gguf
from cgn_infer.sampling import Sampler, SamplingParams
from harness.procs import cgn_infer

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WAIT_S = 30.0
IDLE_S = 1.0  # the HTTP engine's idle and body timeouts in these tests


def sim_engine(smollm2_path: Path) -> Engine:
    """The real engine over the sim backend and SmolLM2's tokenizer (not started)."""
    with GGUFFile(smollm2_path) as gguf:
        codec = PromptCodec.from_gguf(gguf)
        args = dataclasses.replace(args_from_gguf(gguf), ctx_len=512)
    backend = SimBackend(args, SimCost(speed=50.0), word_tokens(codec.tokenizer.pieces))
    config = EngineConfig(ctx=512, kv_pool_tokens=1024)
    return Engine(backend, codec.tokenizer, EngineMetrics("m"), config, namespace="m")


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[Engine]:
    eng = sim_engine(smollm2_path)
    eng.start()
    yield eng
    eng.stop()


def run(engine: Engine, params: SamplingParams, max_tokens: int = 4) -> FinishEvent:
    """Submit one request and return how it finished (bounded wait)."""
    events: queue.Queue[Event] = queue.Queue()
    engine.submit(Job(GenerationRequest((1, 2, 3, 4, 5), params, max_tokens), events.put))
    while True:
        ev = events.get(timeout=WAIT_S)
        if isinstance(ev, FinishEvent):
            return ev


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=-1),
        SamplingParams(seed=-(1 << 63)),
        SamplingParams(seed=(1 << 64) - 1),
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=5e-324, top_p=0.5, top_k=3, min_p=0.9),
        SamplingParams(temperature=2.0, repetition_penalty=0.01, presence_penalty=-2.0),
        SamplingParams(temperature=2.0, repetition_penalty=10.0, frequency_penalty=2.0),
    ],
    ids=lambda p: repr(p)[15:70],
)
def test_extreme_parameters_generate(engine: Engine, params: SamplingParams) -> None:
    done = run(engine, params)
    assert done.reason == "length" and done.completion_tokens == 4, done


@pytest.mark.parametrize(
    "row",
    [
        np.full(8, np.nan, np.float32),
        np.array([np.inf, 1, np.inf, 0, 0, 0, 0, 0], np.float32),
        np.array([np.nan, -np.inf, 2.0, 1.0, 0, 0, 0, 0], np.float32),
        np.full(8, -np.inf, np.float32),
    ],
)
def test_sampling_survives_non_finite_logits(row: np.ndarray) -> None:
    for params in (SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0)):
        token = Sampler(params).sample(row).token
        assert 0 <= token < row.size


def test_a_failing_sampler_fails_only_its_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Sampler.sample

    def sample(self: Sampler, logits: np.ndarray, allowed: np.ndarray | None = None) -> object:
        if self.params.seed == 666:
            raise FloatingPointError("poisoned")
        return real(self, logits, allowed)

    monkeypatch.setattr(Sampler, "sample", sample)
    bad = run(engine, SamplingParams(seed=666))
    assert bad.reason == "error" and "poisoned" in (bad.error or "")
    assert run(engine, SamplingParams(seed=1)).reason == "length"
    assert engine.failure is None


def test_a_request_whose_state_cannot_be_built_fails_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Sampler) -> None:
        raise ValueError("cannot seed")

    monkeypatch.setattr(Sampler, "__post_init__", broken)
    bad = run(engine, SamplingParams(seed=3))
    monkeypatch.undo()
    assert bad.reason == "error" and "cannot seed" in (bad.error or "")
    assert run(engine, SamplingParams()).reason == "length"


def test_one_failed_iteration_fails_its_requests_and_the_loop_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def schedule() -> object:
        calls["n"] += 1
        if calls["n"] == 2:  # the request is active by then
            raise RuntimeError("a transient bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    bad = run(engine, SamplingParams(), max_tokens=20)
    assert bad.reason == "error" and "a transient bug" in (bad.error or "")
    assert run(engine, SamplingParams()).reason == "length"
    assert engine.failure is None


def test_a_dead_worker_fails_everything_it_holds_and_refuses_new_work(
    smollm2_path: Path,
) -> None:
    eng = sim_engine(smollm2_path)

    def schedule() -> object:
        raise AssertionError("the pool's free list is corrupt")

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    eng.start()
    for i in range(MAX_LOOP_FAILURES):  # each request meets the bug once; then the worker ends
        assert eng.failure is None
        events: queue.Queue[Event] = queue.Queue()
        eng.submit(Job(GenerationRequest((1, 2, 3), SamplingParams(), 4), events.put))
        ev = events.get(timeout=WAIT_S)
        assert isinstance(ev, FinishEvent) and ev.reason == "error", (i, ev)
    assert eng.failure is not None and "free list is corrupt" in eng.failure
    with pytest.raises(Unavailable, match="worker stopped"):
        eng.submit(Job(GenerationRequest((1, 2), SamplingParams(), 2), lambda _: None))
    eng.stop()


# ---- over HTTP: the reproductions from the issue --------------------------------------------


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ("--backend", "sim", "--speed", "50", "--set", f"http.idle_timeout_s={IDLE_S}",
            "--set", f"http.body_timeout_s={IDLE_S}")  # fmt: skip
    with cgn_infer(tmp_path_factory.mktemp("liveness"), *args) as url:
        yield url


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            **extra}  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": -1},
        {"temperature": 1e-300},
        {"seed": -1, "temperature": 1e-300, "stream": True},
        {"stream": None},
        {"stream_options": None},
    ],
)
def test_issue_reproductions_are_served(sim_url: str, extra: dict[str, object]) -> None:
    resp = httpx.post(sim_url + "/v1/chat/completions", json=chat(**extra), timeout=WAIT_S)
    assert resp.status_code == 200, resp.text
    assert httpx.get(sim_url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"seed": 1 << 64}, "'seed' must be at most"),
        ({"seed": 1.5}, "'seed' must be int"),
        ({"temperature": float("nan")}, "'temperature' must be between"),
        ({"stream_options": "yes", "stream": True}, "'stream_options' must be dict"),
        (
            {"stream_options": {"include_usage": "yes"}, "stream": True},
            "'stream_options.include_usage' must be bool",
        ),
        ({"stream_options": {"include_usage": True}}, "only allowed when 'stream' is true"),
        ({"functions": [], "audio": {}}, "unsupported fields: audio, functions"),
        (
            {f"x{i:05}": 1 for i in range(10_000)},
            "x00000, x00001, x00002, x00003, x00004, x00005, x00006, x00007 and 9992 more",
        ),  # not 150 KB of names
        ({"top_k": 1.5}, "'top_k' must be int"),  # it was truncated to 1
        ({"tools": []}, "'tools' must be a non-empty list"),
        ({"logit_bias": {"x": 1}}, "'logit_bias' keys must be token ids"),
        ({"priority": 1 << 40}, "'priority' must be at most"),
    ],
)
def test_out_of_range_fields_are_400_json(
    sim_url: str, extra: dict[str, object], fragment: str
) -> None:
    raw = json.dumps(chat(**extra)).encode()  # Python writes NaN, as some clients do
    resp = httpx.post(sim_url + "/v1/chat/completions", content=raw, timeout=WAIT_S)
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 400"),
        (b'{"model": "m", "x": ' + b"[" * 450 + b"]" * 450 + b"}", "nests deeper than 400"),
        (json.dumps(chat()).replace('"hi"', '"\\ud800 hi"').encode(), "lone UTF-16 surrogate"),
        # escaped quotes make brackets look like they are in strings: the depth still counts
        (
            b'{"model": "m", "x": "\\"", "y": ' + b"[" * 450 + b"]" * 450 + b"}",
            "nests deeper than 400",
        ),
    ],
)
def test_odd_json_is_400_json(sim_url: str, raw: bytes, fragment: str) -> None:
    resp = httpx.post(sim_url + "/v1/chat/completions", content=raw, timeout=WAIT_S)
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")
    assert fragment in resp.json()["error"]["message"]
    ok = httpx.post(sim_url + "/v1/chat/completions", json=chat(), timeout=WAIT_S)
    assert ok.status_code == 200


def test_brackets_and_escaped_quotes_cost_linear_time(sim_url: str) -> None:
    """The depth pre-check once took quadratic time on escaped quotes (a 300 KB body held
    the engine's event loop for minutes, before auth): now a 3 MB one is answered at once,
    and brackets inside a string with escapes are text, not nesting."""
    hostile = b'{"model": "m", "x": "' + b'[\\"' * 1_000_000 + b'"}'
    start = time.monotonic()
    resp = httpx.post(sim_url + "/v1/chat/completions", content=hostile, timeout=WAIT_S)
    assert resp.status_code == 400 and time.monotonic() - start < 5  # not a chat: refused
    text = '\\"[' * 600  # 600 brackets inside one string, after escaped quotes
    body = chat(messages=[{"role": "user", "content": text}], max_tokens=1)
    ok = httpx.post(sim_url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert ok.status_code == 200, ok.text  # valid: not "nests deeper than 400 levels"


# ---- the listener: slow and idle clients, malformed HTTP ------------------------------------


def raw_exchange(url: str, data: bytes, *, pause_s: float = 0.0, more: bytes = b"") -> bytes:
    """Send `data` on a fresh socket (then `more` after `pause_s`) and read until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(data)
        if pause_s:
            time.sleep(pause_s)
            with contextlib.suppress(OSError):
                sock.sendall(more)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_slow_request_head_is_cut_off(sim_url: str) -> None:
    start = time.monotonic()
    answer = raw_exchange(sim_url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert answer == b"" and time.monotonic() - start < IDLE_S + 5


def test_an_idle_keep_alive_connection_is_closed(sim_url: str) -> None:
    start = time.monotonic()
    answer = raw_exchange(sim_url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - start < IDLE_S + 5


@pytest.mark.slow
def test_a_trickled_body_gets_408_json(sim_url: str) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            b"Connection: close\r\n\r\n{")  # fmt: skip
    answer = raw_exchange(sim_url, head)
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:200]
    assert "did not arrive within" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
     b"GET /health HTTP/9.9\r\n\r\n",
     b"GET /health HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"],
)  # fmt: skip
def test_malformed_http_is_answered_as_json(sim_url: str, request_bytes: bytes) -> None:
    answer = raw_exchange(sim_url, request_bytes)
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.split()[1].startswith(b"4") and b"application/json" in status, answer[:300]
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
