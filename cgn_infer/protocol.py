"""Validation of OpenAI request bodies into plain values (no I/O, no model).

Every problem is an `InvalidRequest` naming the offending parameter, which
the server turns into an OpenAI-style 400; nothing here can raise anything
else for any JSON value a client sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cgn_core.errors import InvalidRequest
from cgn_core.text.prompt import chat_messages, completion_prompt
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


def _get(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _tuple(types))
    if not ok:
        want = " or ".join(t.__name__ for t in _tuple(types))
        raise InvalidRequest(f"'{name}' must be {want}, got {type(value).__name__}", param=name)
    return value


def _tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int) -> int | None:
    value = _get(body, name, int, default)
    if value is not None and value < lo:
        raise InvalidRequest(f"'{name}' must be at least {lo}, got {value}", param=name)
    return value  # type: ignore[no-any-return]


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > 16:
        raise InvalidRequest("'stop' accepts at most 16 strings", param="stop")
    return tuple(stop)


def parse_request(kind: Kind, body: Any) -> ParsedRequest:
    """Validate an OpenAI chat or completion body."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", param="model")
    if _get(body, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    if _get(body, "echo", bool, False):
        raise InvalidRequest("'echo' is not supported", param="echo")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = bool(_get(options, "include_usage", bool, False))
    if kind == "chat":
        messages, text, ids = chat_messages(body), None, None
        max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(
            body, "max_tokens", None, 1
        )
        want_logprobs = _get(body, "logprobs", bool, False)
        top = _int(body, "top_logprobs", 0, 0) or 0
        if top > 20:
            raise InvalidRequest("'top_logprobs' must be at most 20", param="top_logprobs")
        logprobs = top if want_logprobs else None
    else:
        messages = ()
        text, ids = completion_prompt(body)
        max_tokens = _int(body, "max_tokens", 16, 1)
        lp = _int(body, "logprobs", None, 0)
        if lp is not None and lp > 20:
            raise InvalidRequest("'logprobs' must be at most 20", param="logprobs")
        logprobs = lp
    token_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise InvalidRequest("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=int(_number(body, "top_k", 0, -1, 1 << 20)),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_get(body, "seed", int, None),
        logprobs=logprobs,
    )
    return ParsedRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt_text=text,
        prompt_ids=ids,
        params=params,
        max_tokens=max_tokens,
        stop=_stop(body),
        stop_token_ids=frozenset(token_ids),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        stream=stream,
        include_usage=include_usage,
        priority=_get(body, "priority", int, 0),
    )
