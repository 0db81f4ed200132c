"""Structured outputs: a request's format as a grammar, and per-step token masks from it.

Sources of a grammar (at most one per request; anything else is a 400 naming it):

* `response_format` (OpenAI): `{"type": "json_object"}` (any JSON object) or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
  `{"type": "text"}` is no constraint. The schema is always enforced, strict or not.
* `structured_outputs` (vLLM's field, one key of): `json` (a schema), `json_object`
  (true), `regex`, `choice` (a list of strings), `grammar` (Lark, llguidance's dialect).
* `tool_choice` `required` or a named function (cgn_core.openai.tools): the answer is one
  or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks whose arguments
  match the function's `parameters` schema (the Hermes format, which Qwen2.5's template
  asks for and the fallback tool prompt uses).

The engine is llguidance (PyPI `llguidance`, no dependencies; chosen over xgrammar, which
needs transformers and triton installed and had a slower cold compile on our tokenizers:
bench/results/grammar_engines.md). Its tokenizer is built once per engine from the GGUF's
own vocabulary (`GGUFTokenizer.token_bytes`). A compiled grammar is kept per grammar text
(`cache_entries`, least recently used out) and each request gets a copy of it, so a schema
sent again costs a copy, not a compile. JSON is generated compact, `{"a": 1, "b": [2, 3]}`:
free whitespace lets small models emit newlines forever.

`Grammars.fill` computes the masks of a batch's constrained rows on llguidance's own
threads, with the GIL released, so the engine runs it alongside the forward pass.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import numpy as np

from cgn_core import safejson
from cgn_core.errors import InvalidRequest
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_core.openai.tools import ToolFields
from cgn_core.text.tokenizer import GGUFTokenizer

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's constraint as an llguidance grammar, and the field it came from."""

    grammar: str
    origin: str  # e.g. "response_format", for error messages

    @property
    def key(self) -> str:
        return hashlib.sha256(self.grammar.encode()).hexdigest()


def request_grammar(body: Mapping[str, Any], tools: ToolFields) -> GrammarSpec | None:
    """The grammar a chat or completion body asks for (None: free text)."""
    found = [
        spec
        for spec in (_response_format(body), _structured_outputs(body), tool_call_grammar(tools))
        if spec is not None
    ]
    if len(found) > 1:
        names = " and ".join(s.origin for s in found)
        raise InvalidRequest(f"{names} cannot be combined: pick one", param=found[1].origin)
    return found[0] if found else None


def _json(schema: Any, origin: str) -> GrammarSpec:
    if isinstance(schema, bool):  # JSON Schema's true (anything) and false (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{origin}' must be a JSON schema object", param=origin)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:  # not a schema llguidance can read
        raise InvalidRequest(f"'{origin}': {str(exc)[:300]}", param=origin) from None
    return GrammarSpec(grammar, origin)


def _response_format(body: Mapping[str, Any]) -> GrammarSpec | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequest(
                "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                param="response_format",
            )
        return _json(spec.get("schema", {}), "response_format.json_schema.schema")
    raise InvalidRequest(
        "'response_format.type' must be text, json_object or json_schema", param="response_format"
    )


def _structured_outputs(body: Mapping[str, Any]) -> GrammarSpec | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequest("'structured_outputs' must be an object", param="structured_outputs")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    if unknown := sorted(set(given) - set(STRUCTURED_KEYS)):
        raise InvalidRequest(
            f"unsupported structured_outputs field{'s' if len(unknown) > 1 else ''}: "
            f"{', '.join(unknown)} (supported: {', '.join(STRUCTURED_KEYS)})",
            code="unsupported_field",
            param=f"structured_outputs.{unknown[0]}",
        )
    if len(given) != 1:
        keys = ", ".join(STRUCTURED_KEYS)
        raise InvalidRequest(
            f"'structured_outputs' needs exactly one of {keys}", param="structured_outputs"
        )
    ((key, value),) = given.items()
    origin = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            value = safejson.loads(value, f"'{origin}'", param=origin)
        return _json(value, origin)
    if key == "json_object":
        return _json({"type": "object"}, origin)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequest(
                f"'{origin}' must be a non-empty list of non-empty strings", param=origin
            )
        return GrammarSpec(
            llg.LLMatcher.grammar_from_regex("|".join(map(re.escape, value))), origin
        )
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{origin}' must be a non-empty string", param=origin)
    _bounded(value, origin)
    if key == "regex":
        return GrammarSpec(llg.LLMatcher.grammar_from_regex(value), origin)
    return GrammarSpec(llg.LLMatcher.grammar_from_lark(value), origin)


MAX_GRAMMAR_CHARS = 64 << 10  # a regex or Lark grammar; compiling 1 MB took 12-19 s of CPU
MAX_REPEAT = 10_000  # a{n}, a{n,m} and Lark's `item ~ n` / `item ~ n..m`
_COUNTS = re.compile(r"\{(\d+)(?:,(\d*))?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def _bounded(text: str, origin: str) -> None:
    """Refuse, before any compiling, a grammar too long or a repetition too large to build
    (a{1000000} compiles, then fails at the first token): a 400 naming the limit."""
    if len(text) > MAX_GRAMMAR_CHARS:
        why = f"'{origin}' is longer than {MAX_GRAMMAR_CHARS} characters ({len(text)})"
        raise InvalidRequest(why, param=origin)
    for match in _COUNTS.finditer(text):
        counts = [int(g[:9]) if len(g) < 10 else MAX_REPEAT + 1 for g in match.groups() if g]
        if max(counts, default=0) > MAX_REPEAT:
            why = f"'{origin}' repeats something more than {MAX_REPEAT} times ({match[0][:40]})"
            raise InvalidRequest(why, param=origin)


def tool_call_grammar(tools: ToolFields) -> GrammarSpec | None:
    """`tool_choice` required or named: the answer is only tool calls, each valid for its
    function; None for none and auto (the model's free answer is parsed instead)."""
    if tools.choice not in ("required", "named"):
        return None
    functions = [
        t["function"]
        for t in tools.tools
        if tools.choice == "required" or t["function"]["name"] == tools.name
    ]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = (
        f"{json.dumps(CALL_OPEN)} %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})} "
        f"{json.dumps(CALL_CLOSE)}"
    )
    repeat = '("\\n" call)*' if tools.parallel and tools.choice == "required" else ""
    lark = f"start: call {repeat}\ncall: {call}\n"
    return GrammarSpec(llg.LLMatcher.grammar_from_lark(lark), "tools")


class Constraint:
    """One sequence's grammar state: masks from it, sampled tokens into it."""

    __slots__ = ("key", "matcher")

    def __init__(self, matcher: llg.LLMatcher, key: str = ""):
        self.matcher = matcher
        self.key = key  # its grammar's, in the compile cache

    def advance(self, token: int) -> str | None:
        """Take the sampled token; an error message if the grammar refused it."""
        if self.matcher.consume_token(token):
            return None
        return self.matcher.get_error() or "the grammar refused the sampled token"

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """One engine's grammar compiler: its vocabulary, its compiled grammars, its mask threads."""

    def __init__(
        self,
        tokenizer: GGUFTokenizer,
        logits_size: int,
        *,
        cache_entries: int = 128,
        threads: int = 2,
    ):
        self.tokenizer = tokenizer
        self.size = max(logits_size, tokenizer.vocab_size)  # the model may have spare rows
        self.words = (self.size + 31) // 32
        self.threads = threads
        self._vocab: llg.LLTokenizer | None = None
        self._executor: llg.LLExecutor | None = None
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()

    @property
    def vocab(self) -> llg.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (0.2 s for SmolLM2's 49k
        tokens, 0.8 s for Qwen2.5's 152k): `warm()` builds it off the request path."""
        with self._build_lock:
            if self._vocab is None:
                tok = self.tokenizer
                pieces = tok.token_bytes()
                pieces += [b""] * (self.size - len(pieces))

                class Vocabulary:  # what llguidance's TokenizerWrapper reads
                    eos_token_id = min(tok.stop_ids, default=0)
                    bos_token_id = tok.special.bos
                    tokens = pieces

                    def __call__(self, text: str) -> list[int]:
                        return tok.encode(text, add_bos=False)

                self._vocab = llg.LLTokenizer(
                    llg.TokenizerWrapper(Vocabulary()),
                    n_vocab=self.size,
                    eos_token=sorted(tok.stop_ids) or None,
                )
                self._executor = llg.LLExecutor(self.threads)
            return self._vocab

    def warm(self) -> None:
        """Build the vocabulary now (the server calls this once it is ready)."""
        _ = self.vocab

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec.key in self._cache

    def constraint(
        self, spec: GrammarSpec, on_compile: Callable[[float], object] | None = None
    ) -> Constraint:
        """A fresh state of `spec`'s grammar, compiled on first use (the GIL is released
        meanwhile; `on_compile` gets the seconds it took); a grammar llguidance cannot build
        is a 400 naming why."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return Constraint(hit.deep_copy(), key)
        started = time.perf_counter()
        # NOTE: the matcher reports what validate_grammar would (unimplemented keywords, bad
        # regexes, dangling $refs) in its error state: one compile, not two
        try:
            compiled = llg.LLMatcher(self.vocab, spec.grammar, log_level=0)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(
                f"'{spec.origin}' is not supported: {_one_line([str(exc)])}", param=spec.origin
            ) from None
        if compiled.is_error():
            why = _one_line([compiled.get_error()])
            raise InvalidRequest(f"'{spec.origin}' is not supported: {why}", param=spec.origin)
        if on_compile is not None:
            on_compile(time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return Constraint(compiled.deep_copy(), key)

    def resumed(
        self,
        spec: GrammarSpec,
        tokens: Sequence[int],
        on_compile: Callable[[float], object] | None = None,
    ) -> Constraint:
        """`spec`'s constraint where a first engine left it after `tokens` (a continuation;
        none: a fresh one); a 400 when those tokens break the grammar."""
        constraint = self.constraint(spec, on_compile)
        for token in tokens:
            if (refused := constraint.advance(token)) is not None:
                self.forget(constraint.key)
                raise InvalidRequest(
                    f"the tokens to continue from break the request's grammar: {refused}",
                    code="constraint_failed",
                    param=f"{RESUME_FIELD}.token_ids",
                )
        return constraint

    def forget(self, key: str) -> None:
        """Drop a compiled grammar that failed while followed (llguidance's lexer limits are
        met lazily, and the copies share what was built): the next request compiles it
        afresh and fails the same way, instead of inheriting a broken lexer."""
        with self._lock:
            self._cache.pop(key, None)

    def fill(self, constraints: Sequence[Constraint]) -> np.ndarray:
        """The allowed-token bitmasks of `constraints`, one int32 row of `words` each."""
        masks = np.zeros((len(constraints), self.words), dtype=np.int32)
        pairs = [(c.matcher, i) for i, c in enumerate(constraints)]
        assert self._executor is not None  # a constraint exists: the vocabulary was built
        self._executor.unsafe_compute_mask_ptr(pairs, masks.ctypes.data, self.words * 4, len(pairs))
        return masks

    def allowed(self, mask: np.ndarray) -> np.ndarray:
        """One bitmask row as booleans over the vocabulary."""
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.size]
        return bits.astype(bool)


def _one_line(messages: Sequence[str]) -> str:
    """llguidance's (multi-line) reasons as one line of at most 300 characters."""
    text = " ".join(" ".join(messages).split()) or "llguidance refused it"
    return text[:300]
