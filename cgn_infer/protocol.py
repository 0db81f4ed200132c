"""Validation of OpenAI request bodies into plain values (no I/O, no model).

Every problem is an `InvalidRequest` naming the offending parameter, which
the server turns into an OpenAI-style 400; nothing here can raise anything
else for any JSON value a client sends. The generation fields are checked by
`cgn_core.openai.request`, the same code the router runs; a field this engine
does not implement is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from cgn_core.errors import InvalidRequest
from cgn_core.kv.transfer import FIELD, TransferParams, parse_transfer_params
from cgn_core.openai.request import refuse_unsupported, sampling_fields, unsupported_fields
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_core.openai.resume import Resume, parse_resume
from cgn_core.openai.tools import NO_TOOLS, ToolFields, tool_fields
from cgn_core.text.prompt import chat_messages, completion_prompt
from cgn_infer.grammar import GrammarSpec, request_grammar
from cgn_infer.sampling import SamplingParams

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    model: str
    messages: tuple[dict[str, Any], ...]  # chat only
    prompt_text: str | None  # completion with a text prompt
    prompt_ids: tuple[int, ...] | None  # completion with token ids
    params: SamplingParams
    max_tokens: int | None  # None: as many as the context allows
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int = 0  # lower runs sooner (vLLM's meaning); the router's x-cgn-priority wins
    kv_transfer: TransferParams | None = None  # a prefill or decode leg (cgn_core.kv.transfer)
    tools: ToolFields = NO_TOOLS  # chat only
    grammar: GrammarSpec | None = None  # structured output or forced tool calls
    resume: Resume | None = None  # continue another engine's answer (router only)


def parse_request(kind: Kind, body: Any) -> ParsedRequest:
    """Validate an OpenAI chat or completion body."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", param="model")
    if unknown := unsupported_fields(kind, body):
        raise refuse_unsupported(unknown)
    f = sampling_fields(kind, body)
    tools = tool_fields(body) if kind == "chat" else NO_TOOLS
    if kind == "chat":
        messages, text, ids = chat_messages(body), None, None
    else:
        messages = ()
        text, ids = completion_prompt(body)
    # NOTE: every sampling parameter has its validated field of the same name
    params = SamplingParams(**{p.name: getattr(f, p.name) for p in fields(SamplingParams)})
    return ParsedRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt_text=text,
        prompt_ids=ids,
        params=params,
        max_tokens=f.max_tokens,
        stop=f.stop,
        stop_token_ids=f.stop_token_ids,
        ignore_eos=f.ignore_eos,
        stream=f.stream,
        include_usage=f.include_usage,
        priority=f.priority,
        kv_transfer=_transfer(body, f.stream),
        tools=tools,
        grammar=request_grammar(body, tools),
        resume=_resume(body, f.stream),
    )


def _resume(body: dict[str, Any], stream: bool) -> Resume | None:
    if (value := body.get(RESUME_FIELD)) is None:
        return None
    if not stream:
        why = f"'{RESUME_FIELD}' continues a stream: 'stream' must be true"
        raise InvalidRequest(why, param="stream")
    return parse_resume(value)


def _transfer(body: dict[str, Any], stream: bool) -> TransferParams | None:
    if (value := body.get(FIELD)) is None:
        return None
    params = parse_transfer_params(value)
    if params.do_remote_decode and stream:
        raise InvalidRequest(
            f"a prefill leg ('{FIELD}.do_remote_decode') answers once: 'stream' must be false",
            param="stream",
        )
    return params
