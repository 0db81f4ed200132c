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
from cgn_core.openai.request import (
    lora_scale,
    refuse_unsupported,
    sampling_fields,
    unsupported_fields,
)
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
    kv_salt: str | None = None  # the router's x-cgn-kv-salt: the tenant's block namespace
    kv_transfer: TransferParams | None = None  # a prefill or decode leg (cgn_core.kv.transfer)
    tools: ToolFields = NO_TOOLS  # chat only
    grammar: GrammarSpec | None = None  # structured output or forced tool calls
    resume: Resume | None = None  # continue another engine's answer (router only)
    lora_scale: float = 1.0  # a LoRA adapter's scale, where `model` names one


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
        lora_scale=lora_scale(body),
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


def check_vocabulary(req: ParsedRequest, prompt: list[int], vocab_size: int) -> None:
    """Refuse token ids this model does not have: in `logit_bias`, a prompt of ids, the
    tokens to continue from."""
    if bad := [t for t, _ in req.params.logit_bias if t >= vocab_size]:
        raise InvalidRequest(
            f"'logit_bias' names token {bad[0]}; this model's vocabulary has {vocab_size} tokens",
            param="logit_bias",
        )
    if req.prompt_ids is not None and any(not 0 <= t < vocab_size for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if req.resume is not None and any(t >= vocab_size for t in req.resume.token_ids):
        raise InvalidRequest(
            f"'{RESUME_FIELD}.token_ids' must be in [0, {vocab_size})",
            param=f"{RESUME_FIELD}.token_ids",
        )


def token_budget(req: ParsedRequest, prompt: int, resumed: int, ctx: int, kv_capacity: int) -> int:
    """The tokens `req` may still generate after its `prompt` tokens (a continuation's
    `resumed` tokens included: the room left is what the first engine had, less what it
    produced), within the context and the KV slots one request may use; a 400 when none."""
    if req.max_tokens is not None and resumed > req.max_tokens:
        raise InvalidRequest(
            f"{resumed} tokens to continue from are more than max_tokens={req.max_tokens}",
            param=f"{RESUME_FIELD}.token_ids",
        )
    room = ctx - prompt
    kv_room = kv_capacity + 1 - prompt  # the last token's K/V is never stored
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt} tokens; this model's context is {ctx}",
            code="context_length_exceeded",
            param="messages" if req.kind == "chat" else "prompt",
        )
    left = None if req.max_tokens is None else req.max_tokens - resumed
    if left is not None and left > room:
        raise InvalidRequest(
            f"max_tokens={req.max_tokens} plus the {prompt}-token prompt exceeds "
            f"the context of {ctx} tokens",
            code="context_length_exceeded",
            param="max_tokens",
        )
    if kv_room < 1 or (left or 1) > kv_room:
        raise InvalidRequest(
            f"the {prompt}-token prompt plus max_tokens={req.max_tokens or 1} can never "
            f"fit this engine's KV pool of {kv_capacity} tokens (--kv-pool-tokens)",
            code="kv_capacity_exceeded",
            param="max_tokens" if kv_room >= 1 else "messages",
        )
    return min(room, kv_room) if left is None else left
