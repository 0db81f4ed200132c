"""cgn-router in front of a real SmolLM2 cgn-infer (torch), router-only (static YAML, no etcd)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.metrics import metric
from harness.procs import Router, cgn_infer, cgn_router

MODEL = "smol"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[tuple[str, Router]]:
    tmp = tmp_path_factory.mktemp("smol")
    with cgn_infer(tmp, "--model-name", MODEL, "--kv-pool-tokens", "4096") as engine:
        config = {
            "discovery": "static",
            "endpoints": {"only": {"url": engine, "model": MODEL}},
            "models": {MODEL: {"tokenizer": str(smollm2_path)}},
        }
        with cgn_router(tmp, config) as router:
            yield engine, router


def test_greedy_answer_through_the_router_equals_the_engines(stack: tuple[str, Router]) -> None:
    engine, router = stack
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    def ask(base: str) -> str:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        stream = c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    direct = ask(engine)
    assert direct and ask(router.url) == direct


def test_router_predicts_the_engines_prefix_hits_exactly(stack: tuple[str, Router]) -> None:
    """Same tokenizer and template as the engine: predicted cached tokens == reported ones."""
    _, router = stack
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    system = "You are a careful assistant. " * 30
    for question in ("What is 2+2?", "What is the capital of France?"):
        c.chat.completions.create(
            model=MODEL, max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )  # fmt: skip
    assert (
        metric(router.admin, "cgn_router_prompts_hashed_total", model=MODEL, method="tokenizer")
        >= 2
    )
    assert metric(router.admin, "cgn_router_prompts_hashed_total", model=MODEL, method="chars") == 0
    predicted = metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model=MODEL)
    reported = metric(router.admin, "cgn_router_prefix_tokens_reported_total", model=MODEL)
    assert reported >= 160 and predicted == reported


@pytest.mark.slow
def test_structured_outputs_and_tools_pass_through_the_router(stack: tuple[str, Router]) -> None:
    """The router forwards the fields untouched (the engine enforces them), and its prompt
    hashes cover the tool definitions exactly as the engine tokenizes them."""
    engine, router = stack
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "paint", "parameters": schema}}]
    system = "You are a painter's assistant who answers tersely. " * 12

    def ask(base: str, **kw: object) -> tuple[str | None, list[tuple[str, str]]]:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=40,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "Pick a colour."}], **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        msg = r.choices[0].message
        return msg.content, [(t.function.name, t.function.arguments) for t in msg.tool_calls or ()]

    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    direct = ask(engine, response_format=fmt)
    assert ask(router.url, response_format=fmt) == direct
    assert json.loads(direct[0] or "")["colour"] in ("red", "green", "blue")
    before = metric(router.admin, "cgn_router_prefix_tokens_reported_total", model=MODEL)
    called = ask(router.url, tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert [name for name, _ in called[1]] == ["paint"]
    assert json.loads(called[1][0][1])["colour"] in ("red", "green", "blue")
    ask(router.url, tools=tools, tool_choice="auto")  # the same tools and system prompt again
    predicted = metric(router.admin, "cgn_router_prefix_tokens_predicted_total", model=MODEL)
    reported = metric(router.admin, "cgn_router_prefix_tokens_reported_total", model=MODEL)
    assert predicted == reported and reported >= before + 64  # the tools' prefix hit
