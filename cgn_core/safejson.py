"""JSON from strangers: parsed only when its nesting is bounded, refused with a 400 otherwise.

`json.loads` recurses once per nested array or object, so a string of a few
thousand brackets (a request body, a tool call's `arguments`, a
`structured_outputs.json` schema given as text) raises RecursionError, a 500
where a 400 belongs. `loads` measures the nesting first, in time linear in
the text and in C, and parses only what nests at most `MAX_DEPTH` levels.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from cgn_core.errors import InvalidRequest

MAX_DEPTH = 400  # arrays and objects nested in one another


def loads(raw: bytes | str, what: str, param: str | None = None) -> Any:
    """`raw` parsed as JSON; InvalidRequest naming `what` when it is not JSON, when it nests
    deeper than `MAX_DEPTH`, or when a string holds a lone UTF-16 surrogate (an escape like
    \\ud800 with no pair: valid JSON, but no UTF-8 text, so no tokenizer can take it)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    # NOTE: bytes.count runs at memory speed; only a text with that many brackets at all
    # is measured, before json.loads, whose recursion would fail far deeper and as a 500.
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _depth(data) > MAX_DEPTH:
        raise InvalidRequest(f"{what} nests deeper than {MAX_DEPTH} levels", param=param)
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest(f"{what} is not valid JSON", param=param) from None
    if b"\\u" in data or b"\\U" in data:  # a surrogate can only arrive as an escape
        _refuse_lone_surrogates(value, what, param)
    return value


# NOTE: two passes with no backtracking, each linear in the text: every escape (a backslash
# and the byte after it) goes first, so what remains of a string is `"` ... `"` with no
# quote inside, which the second pattern drops with one attempt per quote. (One pattern for
# strings with escapes backtracks: quadratic on a body of escaped quotes, a freeze before
# auth; and got `\"` wrong, counting brackets inside strings.)
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_PLAIN_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _depth(raw: bytes) -> int:
    """The deepest nesting of [ and { outside strings, in time linear in `raw`; every loop
    here runs in C."""
    text = _PLAIN_STRING.sub(b"", _ESCAPE.sub(b"", raw))
    brackets = text.translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _refuse_lone_surrogates(value: Any, what: str, param: str | None) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(
                    f"{what} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    "escape), which is not text",
                    param=param,
                ) from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
