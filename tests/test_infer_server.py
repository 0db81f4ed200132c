"""A real `cgn-infer serve` on SmolLM2, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness.procs import cgn_infer

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with cgn_infer(tmp_path_factory.mktemp("infer"), "--ctx", "2048") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_models_health_metrics(base_url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = httpx.get(base_url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "cgn_infer_model_load_seconds",
    ):
        assert name in text, name


def test_chat_sync_greedy_is_deterministic(client: openai.OpenAI) -> None:
    """The same greedy request twice (the second from the prefix cache) gives the same text.
    NOTE: what the text is depends on the CPU's path (docs/cgn-infer.md, "Portability"):
    SmolLM2 answers this with "Paris" on AVX2 and "L'Étoile, …" where torch runs AVX-512."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content  # a real answer, not an empty one
    assert a.usage is not None and a.usage.completion_tokens <= 12 and a.usage.prompt_tokens > 10
    assert a.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to five."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    )  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason


async def test_async_client_concurrent_requests(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    prompts = ["Once upon a time", "The sky is", "def add(a, b):"]
    outs = await asyncio.gather(
        *(
            client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
            for p in prompts
        )
    )
    for p, out in zip(prompts, outs, strict=True):
        solo = await client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        assert out.choices[0].text == solo.choices[0].text
    await client.close()


def test_completion_stop_seed_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"]
    )
    assert out.choices[0].finish_reason == "stop" and " 7" not in out.choices[0].text
    assert "5" in out.choices[0].text
    seeded = [
        client.completions.create(
            model=MODEL, prompt="Tell me a story", max_tokens=10, seed=11, temperature=1.0
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    lp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=3
    )
    info = lp.choices[0].logprobs
    assert info is not None and len(info.tokens or []) == 3 and len(info.top_logprobs or []) == 3
    assert all(len(t) == 3 for t in info.top_logprobs or [])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1,2]", 400, "JSON object"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": []},
            400,
            "'messages' must be a non-empty list",
        ),
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "not served here",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "content must be a string",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"},
            400,
            "'max_tokens' must be int",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
            "exceeds the context",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 5},
            400,
            "between 0.0 and 2.0",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2},
            400,
            "only n=1",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "priority": "high"},
            400,
            "'priority' must be int",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "must not be empty"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "token ids must be in"),
        ("/v1/completions", {"model": MODEL}, 400, "'prompt' must be"),
        ("/v1/completions", {"prompt": "x"}, 400, "'model' is required"),
        ("/v1/nothing", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_openai_errors(
    base_url: str, path: str, body: object, status: int, fragment: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(base_url + path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_priority_comes_from_the_routers_header_or_the_body(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": -3}
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 200
    ok = httpx.post(base_url + "/v1/completions", json=body, headers={"x-cgn-priority": "2"})
    assert ok.status_code == 200
    bad = httpx.post(base_url + "/v1/completions", json=body, headers={"x-cgn-priority": "top"})
    assert bad.status_code == 400 and "x-cgn-priority must be an integer" in bad.text


def test_oversized_body_is_413(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/completions", content=b"x" * (9 << 20))
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_stops_generation(base_url: str, client: openai.OpenAI) -> None:
    """Abandon a long stream after a few chunks; the engine must be free again quickly."""
    body = {"model": MODEL, "prompt": "Write a very long essay about the sea.", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 6:
                break
    start = time.monotonic()
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    # Generating the abandoned 1500 tokens would take a minute; a cancelled one takes none.
    assert time.monotonic() - start < 15 and out.choices[0].text is not None
    metrics = httpx.get(base_url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort"' in metrics


def test_health_is_503_while_loading(tmp_path: Path, smollm2_path: Path) -> None:
    import subprocess
    import sys

    from cgn_core.etcd.local import free_port
    from harness.procs import stop

    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "cgn-infer"), "serve", "--model", str(smollm2_path), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        seen = set()
        deadline = time.monotonic() + 120
        while 200 not in seen and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            time.sleep(0.05)
        assert seen == {503, 200}
    finally:
        assert stop(proc) == 0  # SIGTERM: clean exit
