"""The OpenAI request fields router and engine both check, checked once, here.

`sampling_fields(kind, body)` validates every field of a chat or completion
body that changes how tokens are generated or delivered (stream and its
options, counts, sampling numbers in OpenAI's documented ranges, seed, stop,
priority) and returns them as plain values. The router calls it before it
tokenizes, hashes or queues anything, so a body it forwards is one cgn-infer
will not refuse for these reasons; cgn-infer calls it to build its sampling
parameters. The prompt itself (`messages`, `prompt`) is checked by
`cgn_core.text.prompt`.

`unsupported_fields(kind, body)` lists the body's fields cgn-infer does not
implement: the engine refuses them with a 400 naming them instead of silently
ignoring them. The router does not: other engines behind it (vLLM, SGLang)
implement more of the API, and they have the last word.

Ranges (NOTE: equal to OpenAI's where OpenAI documents one): temperature
0..2, top_p 0..1, presence/frequency penalty -2..2, logprobs/top_logprobs
0..20, n = 1, seed a signed or unsigned 64-bit integer, at most 16 stop
strings. vLLM's extensions: top_k -1 (off) up to 2**20, min_p 0..1,
repetition_penalty 0.01..10, stop_token_ids, ignore_eos, priority.
`logit_bias` maps token ids to -100..100 (at most `MAX_LOGIT_BIAS` of them).

`response_format`, `structured_outputs` (vLLM's field) and the tool fields are known
here but checked by their own modules: the engine's grammar (cgn_infer.grammar) and
`cgn_core.openai.tools`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgn_core.errors import InvalidRequest

_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "user",
        "priority",
        "logprobs",
        "kv_transfer_params",
        "cgn_resume",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "lora_scale",
    }
)
# A LoRA adapter's request: clients name the adapter in `model` and may scale it with
# LORA_SCALE_FIELD; LORA_FIELD is llama.cpp's per-request adapter list, which the router
# writes (an engine's adapter ids are its own) and refuses from a client.
LORA_FIELD = "lora"
LORA_SCALE_FIELD = "lora_scale"
MAX_LORA_SCALE = 4.0


def lora_scale(body: Mapping[str, Any]) -> float:
    """A request's `lora_scale` (default 1: the adapter as trained; 0: the base); a 400
    outside [0, MAX_LORA_SCALE]."""
    scale = body.get(LORA_SCALE_FIELD, 1.0)
    if type(scale) not in (int, float) or not 0 <= scale <= MAX_LORA_SCALE:
        raise InvalidRequest(f"'{LORA_SCALE_FIELD}' must be a number in [0, {MAX_LORA_SCALE:g}]",
                             param=LORA_SCALE_FIELD)  # fmt: skip
    return float(scale)


KNOWN_FIELDS = {
    "chat": _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    "completion": _COMMON | {"prompt", "echo"},
}
MAX_LOGIT_BIAS = 300  # entries; OpenAI documents no limit, vLLM's default is 300
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
PRIORITY_LIMIT = 1 << 31
MAX_STOP = 16


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The validated generation fields of one request (defaults filled in)."""

    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: as many as the context allows
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    logprobs: int | None  # None: none; 0: the sampled token's; n: plus the top n
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    priority: int
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit


def unsupported_fields(kind: str, body: Mapping[str, Any]) -> list[str]:
    """The body's top-level fields cgn-infer does not implement, sorted."""
    known = KNOWN_FIELDS.get(kind, frozenset())
    return sorted(str(k) for k in body if k not in known)


NAMED_FIELDS = 8  # an error lists this many unsupported fields, then counts the rest


def refuse_unsupported(unknown: list[str]) -> InvalidRequest:
    """The 400 for a body's `unknown` fields: the first few named (each cut to 64
    characters), the rest counted, so 10,000 of them cost an error line, not 150 KB."""
    named = ", ".join(name[:64] for name in unknown[:NAMED_FIELDS])
    more = f" and {len(unknown) - NAMED_FIELDS} more" if len(unknown) > NAMED_FIELDS else ""
    return InvalidRequest(
        f"unsupported field{'s' if len(unknown) > 1 else ''}: {named}{more}",
        code="unsupported_field",
        param=unknown[0][:64],
    )


def sampling_fields(kind: str, body: Mapping[str, Any]) -> SamplingFields:
    """Validate a chat (`kind="chat"`) or completion body's generation fields."""
    if _get(body, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    if _get(body, "echo", bool, False):
        raise InvalidRequest("'echo' is not supported", param="echo")
    stream = bool(_get(body, "stream", bool, False))
    options = _get(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise InvalidRequest(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    include_usage = bool(_get(options or {}, "include_usage", bool, False, "stream_options."))
    if kind == "chat":
        max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(
            body, "max_tokens", None, 1
        )
        top = _int(body, "top_logprobs", 0, 0, 20) or 0
        logprobs = top if _get(body, "logprobs", bool, False) else None
    else:
        max_tokens = _int(body, "max_tokens", 16, 1)
        logprobs = _int(body, "logprobs", None, 0, 20)
    token_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise InvalidRequest("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    return SamplingFields(
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),  # 0: the most likely token, as OpenAI
        top_k=_int(body, "top_k", 0, -1, 1 << 20) or 0,  # 1.5 is refused, not truncated
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_int(body, "seed", None, SEED_MIN, SEED_MAX),
        logprobs=logprobs,
        stop=_stop(body),
        stop_token_ids=frozenset(token_ids),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        priority=_int(body, "priority", 0, -PRIORITY_LIMIT, PRIORITY_LIMIT) or 0,
        logit_bias=_logit_bias(body),
    )


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias in -100..100."""
    bias = _get(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"'logit_bias' accepts at most {MAX_LOGIT_BIAS} tokens", param="logit_bias"
        )
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or not str(key).strip().lstrip("+").isdigit():
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids, got {str(key)[:40]!r}", param="logit_bias"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -100 <= value <= 100
        ):
            raise InvalidRequest(
                f"'logit_bias' values must be numbers in -100..100, got {str(value)[:40]}",
                param="logit_bias",
            )
        out.append((token, float(value)))
    return tuple(sorted(out))


def _get(
    body: Mapping[str, Any],
    name: str,
    types: type | tuple[type, ...],
    default: Any,
    prefix: str = "",
) -> Any:
    """`body[name]` when it has one of `types` (null means absent); bool is not an int."""
    value = body.get(name, default)
    if value is None:
        return default
    want = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
        kinds = " or ".join(t.__name__ for t in want)
        raise InvalidRequest(
            f"'{prefix}{name}' must be {kinds}, got {type(value).__name__}", param=prefix + name
        )
    return value


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = _get(body, name, (int, float), default)
    # NOTE: compared before float(): a 400-digit integer would raise OverflowError; NaN
    # compares false, so it is refused too
    if not lo <= value <= hi:
        raise InvalidRequest(
            f"'{name}' must be between {lo} and {hi}, got {str(value)[:40]}", param=name
        )
    return float(value)


def _int(
    body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    value = _get(body, name, int, default)
    if value is not None and value < lo:
        raise InvalidRequest(f"'{name}' must be at least {lo}, got {value}", param=name)
    if value is not None and hi is not None and value > hi:
        raise InvalidRequest(f"'{name}' must be at most {hi}, got {value}", param=name)
    return value  # type: ignore[no-any-return]


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP:
        raise InvalidRequest(f"'stop' accepts at most {MAX_STOP} strings", param="stop")
    return tuple(stop)
