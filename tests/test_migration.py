"""Request migration (cgn_core/openai/resume.py, docs/cgn-router.md "Migration").

Two real SmolLM2 engines on one cgn-kvcached, behind a router: an engine killed with
SIGKILL while it streams an answer, at its first tokens and in the middle of a
JSON-schema answer (the engine-level test covers every cut point, the last included);
the client's answer is the uninterrupted one (same text, one response id, true usage, no
chunk twice or missing), and the continuation restores the prompt the first engine had
offered to the node's store. Engine-level first: a continuation from any point of a
greedy, a seeded sampled, a JSON-schema and a tool-call answer is the rest of it.

Every comparison is between two runs on this machine (never a fixed answer).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cgn_core.etcd.local import free_port
from cgn_core.kv.blockhash import BLOCK_SIZE
from harness.metrics import metric
from harness.procs import Engine, Kvcached, Router, cgn_infer_engines, cgn_kvcached, cgn_router

MODEL = "SmolLM2-135M-Instruct.Q4_1"
NAMES = ("a", "b")
# a prompt of a few hundred tokens: worth restoring from the node's store, not recomputing
STORY = " ".join(
    f"Chapter {i}: the keeper lit the lamp at dusk and counted ships." for i in range(24)
)
CHAT = {"model": MODEL, "temperature": 0, "max_tokens": 32, "ignore_eos": True,
        "messages": [{"role": "user", "content": STORY + "\nRetell the story in detail."}]}  # fmt: skip
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "facts"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "facts": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "maxLength": 40}}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


@dataclass
class Fleet:
    tmp: Path
    kv: Kvcached
    ports: dict[str, int]
    router: Router
    engines: dict[str, Engine] = field(default_factory=dict)
    stacks: dict[str, ExitStack] = field(default_factory=dict)

    def start(self, name: str) -> None:
        stack = ExitStack()
        args = ("--ctx", "2048", "--port", str(self.ports[name]), *self.kv.engine_args)
        (engine,) = stack.enter_context(cgn_infer_engines(self.tmp, 1, *args))
        self.engines[name], self.stacks[name] = engine, stack

    def kill(self, name: str) -> None:
        os.killpg(self.engines[name].proc.pid, signal.SIGKILL)
        self.stacks.pop(name).close()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def stream_killing(
        self, url: str, body: dict[str, Any], when: Callable[[Answer], bool]
    ) -> tuple[Answer, list[str]]:
        """Stream `body` through `url`, SIGKILLing the engine writing it once `when` holds of
        the answer so far; (the answer, the engine killed, started again after)."""
        killed: list[str] = []

        def kill(answer: Answer) -> None:
            if not killed and when(answer):
                killed.append(answer.endpoint.rsplit("/", 1)[-1])
                self.kill(killed[0])

        try:
            return stream(url, body, on_text=kill), killed
        finally:
            for name in killed:
                self.start(name)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("migration")
    ports = {n: free_port() for n in NAMES}
    endpoints = {n: {"url": f"http://127.0.0.1:{p}", "model": MODEL} for n, p in ports.items()}
    config = {"discovery": "static", "endpoints": endpoints, "log": {"level": "info"},
              "deadlines": {"idle_s": 10.0}, "breaker": {"failures": 100}}  # fmt: skip
    with cgn_kvcached(tmp) as kv, cgn_router(tmp, config) as router:
        f = Fleet(tmp, kv, ports, router)
        try:
            for name in NAMES:
                f.start(name)
            yield f
        finally:
            for stack in f.stacks.values():
                stack.close()


@dataclass
class Answer:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    response_id: str = ""
    created: int = 0
    roles: int = 0  # role chunks
    finish: str | None = None
    usage: dict[str, Any] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    endpoint: str = ""
    # where a client may be cut off: before each ids line, (ids, text, tool calls) so far
    groups: list[tuple[int, int, int]] = field(default_factory=list)


def stream(
    url: str,
    body: dict[str, Any],
    *,
    with_ids: bool = False,
    on_text: Callable[[Answer], None] = lambda a: None,
    path: str = "/v1/chat/completions",
) -> Answer:
    """Stream one answer; `on_text` after each chunk with text (to kill an engine)."""
    out = Answer()
    headers = {"x-cgn-token-ids": "1"} if with_ids else {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        out.endpoint = resp.headers.get("x-cognitora-endpoint", "")
        for line in resp.iter_lines():
            if line.startswith(": ids "):
                out.groups.append((len(out.ids), len(out.text), len(out.calls)))
                out.ids += [int(t) for t in line[6:].split(",")]
                continue
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.errors.append(chunk["error"])
                continue
            out.response_id = out.response_id or chunk["id"]
            assert chunk["id"] == out.response_id, "one answer, one id"
            out.created = out.created or chunk["created"]
            out.usage = chunk.get("usage") or out.usage
            for choice in chunk["choices"]:
                piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
                out.roles += choice.get("delta", {}).get("role") == "assistant"
                out.calls += choice.get("delta", {}).get("tool_calls") or []
                out.finish = choice.get("finish_reason") or out.finish
                out.text += piece
                if piece:
                    on_text(out)
    return out


def resumed(fleet: Fleet, body: dict[str, Any], whole: Answer, cut: int) -> Answer:
    """The continuation of `whole` from its first `cut` token ids, on engine b."""
    state = {"token_ids": whole.ids[:cut], "id": whole.response_id, "created": whole.created}
    return stream(fleet.url("b"), {**body, "cgn_resume": state})


@pytest.mark.parametrize(
    "body",
    [
        CHAT,
        {**CHAT, "temperature": 1.0, "seed": 7, "max_tokens": 24},  # one draw per token
        {**CHAT, "max_tokens": 96, "ignore_eos": False,
         "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA}}},
        {**CHAT, "max_tokens": 64, "ignore_eos": False, "tools": TOOLS, "tool_choice": "required",
         "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]},
    ],
    ids=["greedy", "seeded", "json_schema", "tool_call"],
)  # fmt: skip
def test_a_continuation_from_any_point_is_the_rest_of_the_answer(
    fleet: Fleet, body: dict[str, Any]
) -> None:
    whole = stream(fleet.url("a"), body, with_ids=True)
    assert whole.usage is not None and whole.ids and not whole.errors
    n = whole.usage["completion_tokens"]
    ends = [*whole.groups, (len(whole.ids), len(whole.text), len(whole.calls))]
    # where a client can be cut off (before an ids line, or after the last): the first point
    # with tokens, the middle one, the last (only the finish missing)
    for ids, text, calls in {ends[1], ends[len(ends) // 2], ends[-1]}:
        rest = resumed(fleet, body, whole, ids)
        assert whole.text[:text] + rest.text == whole.text, ids
        assert rest.roles == 0 and (rest.response_id, rest.created) == (
            whole.response_id,
            whole.created,
        )
        assert rest.usage is not None
        assert rest.usage["prompt_tokens"] == whole.usage["prompt_tokens"]
        assert rest.usage["completion_tokens"] == n and rest.finish == whole.finish
        assert [c["function"] for c in rest.calls] == [c["function"] for c in whole.calls[calls:]]
        assert [c["index"] for c in rest.calls] == list(range(calls, len(whole.calls)))
    if "response_format" in body:
        assert set(json.loads(whole.text)) == {"city", "facts"}
    if "tools" in body:
        assert whole.calls and whole.finish == "tool_calls"


def test_a_continuation_is_refused_when_it_cannot_be_one(fleet: Fleet) -> None:
    """From a client through the router: refused by name; to an engine: checked."""
    state = {"token_ids": [1, 2], "id": "chatcmpl-x", "created": 1}
    r = httpx.post(fleet.router.url + "/v1/chat/completions", timeout=30,
                   json={**CHAT, "cgn_resume": state})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "cgn_resume"
    for bad, param in (({**state, "token_ids": [10**6]}, "cgn_resume.token_ids"),
                       ({**state, "token_ids": list(range(33))}, "cgn_resume.token_ids"),
                       ({**state, "id": 5}, "cgn_resume.id"),
                       ({**state, "extra": 1}, "cgn_resume.extra")):  # fmt: skip
        r = httpx.post(fleet.url("a") + "/v1/chat/completions", timeout=30,
                       json={**CHAT, "stream": True, "cgn_resume": bad})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(fleet.url("a") + "/v1/chat/completions", json={**CHAT, "cgn_resume": state})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def restored_tokens(url: str) -> float:
    return metric(url, "cgn_infer_kv_restored_tokens_total")


@pytest.mark.parametrize(
    ("at", "body"),
    [(0.05, CHAT),
     (0.5, {**CHAT, "max_tokens": 96, "ignore_eos": False,
            "messages": [{"role": "user", "content": "Describe Oslo as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "city", "schema": SCHEMA}}})],
    ids=["first_tokens", "json_schema_mid_object"],
)  # fmt: skip
def test_a_stream_survives_its_engine_killed_mid_answer(
    fleet: Fleet, at: float, body: dict[str, Any]
) -> None:
    router = fleet.router
    # a prompt of its own: the engine that continues has it only from the node's store
    messages = [{"role": "system", "content": f"Case {at} {len(body)}."}, *body["messages"]]
    body = {**body, "messages": messages}
    whole = stream(fleet.url("a"), body)  # the router then prefers a, which holds the prompt
    assert not whole.errors and whole.usage is not None
    before = {n: restored_tokens(fleet.url(n)) for n in NAMES}
    continued = metric(router.admin, "cgn_router_migrations_total", result="continued")
    cut, killed = fleet.stream_killing(
        router.url, body, lambda a: len(a.text) >= at * len(whole.text)
    )
    assert killed, "the answer ended before the kill point"
    assert not cut.errors, cut.errors
    assert cut.text == whole.text and cut.finish == whole.finish and cut.roles == 1
    assert cut.usage is not None
    assert (cut.usage["prompt_tokens"], cut.usage["completion_tokens"]) == (
        whole.usage["prompt_tokens"],
        whole.usage["completion_tokens"],
    )
    if "response_format" in body:
        doc = json.loads(cut.text)
        assert set(doc) == {"city", "facts"} and len(doc["facts"]) <= 3
    moved = metric(router.admin, "cgn_router_migrations_total", result="continued")
    if moved > continued:  # the kill landed before the engine had sent its finish
        # the prompt was not computed again: restored from the node's store (b has never
        # seen it), or from the pool of the engine that computed the reference (a)
        cached = cut.usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= whole.usage["prompt_tokens"] - 2 * BLOCK_SIZE, cut.usage
        other = next(n for n in NAMES if n != killed[0])
        if other == "b":
            assert restored_tokens(fleet.url("b")) > before["b"], "the prompt was recomputed"
    else:
        assert at >= 0.5, "an early kill must have needed a continuation"


def test_with_migration_off_a_broken_stream_ends_as_it_did(fleet: Fleet) -> None:
    endpoints = {n: {"url": fleet.url(n), "model": MODEL} for n in NAMES}
    config = {"discovery": "static", "endpoints": endpoints, "migration": {"limit": 0}}
    with cgn_router(fleet.tmp, config) as off:
        cut, killed = fleet.stream_killing(off.url, CHAT, lambda a: len(a.text) > 20)
    # as before migration existed: the stream is not tracked, and ends with the cause
    assert killed and cut.errors and cut.errors[0]["code"] == "disconnect_mid_stream"
    assert "disconnected mid-stream" in cut.errors[0]["message"] and cut.finish is None


def test_the_router_reads_a_tracked_stream_without_parsing_it() -> None:
    """What the proxy keeps of each event (cgn_router/tracked.py `track`): the ids line is
    cut off and kept as bytes, the first chunk kept, a finish noticed; an engine's error
    event ends the leg unless it is the request's own fault."""
    from cgn_router.tracked import Progress, track

    p = Progress(out=None)  # type: ignore[arg-type]
    role = b'data: {"id": "chatcmpl-1", "created": 7, "choices": [{"delta": {"role": "a"}}]}\n\n'
    assert track(p, role) == (role, "")
    tok = b'data: {"id": "chatcmpl-1", "choices": [{"finish_reason": null}]}\n\n'
    assert track(p, b": ids 5,6\n" + tok) == (tok, "")
    assert track(p, b": ids 7\n" + tok) == (tok, "")
    assert not p.finished and p.first == role
    assert p.resume_field() == {"token_ids": [5, 6, 7], "id": "chatcmpl-1", "created": 7}
    assert track(p, b'data: {"choices": [{"finish_reason": "stop"}]}\n\n')[1] == ""
    assert p.finished
    server = b'data: {"error": {"message": "the engine stopped", "type": "server_error"}}\n\n'
    assert track(Progress(out=None), server) == (b"", "the engine stopped")  # type: ignore[arg-type]
    theirs = b'data: {"error": {"message": "bad", "type": "invalid_request_error"}}\n\n'
    assert track(Progress(out=None), theirs) == (theirs, "")  # type: ignore[arg-type]
    assert track(Progress(out=None), b": ids 1,2")[1] == "a malformed token id line"  # type: ignore[arg-type]
    bad = Progress(out=None, ids=[b"1,x"], first=role)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        bad.resume_field()
    with pytest.raises(ValueError):
        Progress(out=None, ids=[b"1"]).resume_field()  # type: ignore[arg-type]
