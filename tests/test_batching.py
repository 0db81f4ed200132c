"""Continuous batching on the real model: a real `cgn-infer serve` on SmolLM2 (torch, float32),
driven by the official openai client; prefix reuse in usage and metrics; KV events over SSE."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from cgn_core.kv.blockhash import block_hashes
from harness.metrics import metric
from harness.procs import cgn_infer

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Which planet is the largest?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What colour is the sky?",
    "Name a fruit that is yellow.",
    "What is frozen water called?",
    "Which animal says moo?",
    "What is the first letter of the alphabet?",
    "How many days are in a week?",
    "What do you use to write on paper?",
    "Where do fish live?",
]
SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence. "
    "The store sells hammers, nails, screws, drills, saws, paint, brushes, ladders, rope, "
    "glue, tape, light bulbs, batteries, extension cords, garden hoses, rakes, shovels and "
    "wheelbarrows. It opens at eight in the morning and closes at six in the evening, and on "
    "Sundays it opens at ten and closes at four. Returns are accepted within thirty days with "
    "a receipt. Staff can cut keys, mix paint and cut wood to size while the customer waits."
)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with cgn_infer(
        tmp_path_factory.mktemp("batching"),
        "--ctx", "2048", "--max-batch", "16", "--kv-pool-tokens", "8192",
    ) as url:  # fmt: skip
        yield url


async def tokens(client: openai.AsyncOpenAI, question: str, stream: bool) -> list[str]:
    """Greedy chat answer as token strings (from logprobs), streamed or not."""
    args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
    }
    if not stream:
        resp = await client.chat.completions.create(**args)  # type: ignore[call-overload]
        assert resp.choices[0].logprobs is not None
        return [t.token for t in resp.choices[0].logprobs.content]
    out: list[str] = []
    async for chunk in await client.chat.completions.create(**args, stream=True):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            out += [t.token for t in chunk.choices[0].logprobs.content]
    return out


@pytest.mark.slow
def test_sixteen_concurrent_streams_equal_sequential_greedy(base_url: str) -> None:
    async def run() -> tuple[list[list[str]], list[list[str]]]:
        async with openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            sequential = [await tokens(client, q, stream=False) for q in QUESTIONS]
            concurrent = await asyncio.gather(*(tokens(client, q, stream=True) for q in QUESTIONS))
            return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert all(len(t) > 0 for t in sequential)
    assert concurrent == sequential
    steps = metric(base_url, "cgn_infer_step_sequences_count")
    small = metric(base_url, "cgn_infer_step_sequences_bucket", le="8.0")
    assert steps - small > 0, "no step ran more than 8 sequences together"


def test_shared_system_prompt_is_served_from_the_prefix_cache(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    hits = metric(base_url, "vllm:prefix_cache_hits_total")
    queries = metric(base_url, "vllm:prefix_cache_queries_total")
    usages = []
    for question in ("Do you sell rope?", "When do you open on Sunday?"):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert resp.usage is not None
        usages.append(resp.usage)
    first, second = usages
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 96 and cached % 16 == 0  # the system prompt's blocks
    assert cached < second.prompt_tokens
    assert metric(base_url, "vllm:prefix_cache_hits_total") - hits == cached
    assert (
        metric(base_url, "vllm:prefix_cache_queries_total") - queries
        == first.prompt_tokens + second.prompt_tokens
    )


def test_kv_events_snapshot_then_stored_blocks(base_url: str) -> None:
    prompt = list(range(1000, 1040))  # token ids: 2 full blocks, then 8 more
    with (
        httpx.Client(base_url=base_url, timeout=60) as http,
        http.stream("GET", "/v1/kv/events") as events,
    ):
        lines = events.iter_lines()
        snapshot = json.loads(next(lines)[len("data: ") :])["snapshot"]
        assert snapshot["block_size"] == 16 and snapshot["namespace"] == MODEL
        held = {base64.b64decode(h) for h in snapshot.get("block_hashes", [])}
        seq = int(snapshot.get("seq", 0))
        http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        ).raise_for_status()
        want = set(block_hashes(prompt, MODEL))
        while not want <= held:
            line = next(lines)
            if not line:
                continue
            event = json.loads(line[len("data: ") :])["event"]
            assert int(event["seq"]) == seq + 1  # no gap, no repeat
            seq += 1
            hashes = {base64.b64decode(h) for h in event["block_hashes"]}
            if event["kind"] == "STORED":
                held |= hashes
            else:
                held -= hashes
    # A new subscriber's snapshot holds the same blocks at the same sequence number.
    with (
        httpx.Client(base_url=base_url, timeout=60) as http,
        http.stream("GET", "/v1/kv/events") as events,
    ):
        again = json.loads(next(events.iter_lines())[len("data: ") :])["snapshot"]
    assert int(again["seq"]) == seq
    assert {base64.b64decode(h) for h in again["block_hashes"]} == held
