"""JSON from strangers: parsed only when its nesting and its size in values are bounded,
refused with a 400 otherwise.

`json.loads` recurses once per nested array or object, so a string of a few
thousand brackets (a request body, a tool call's `arguments`, a
`structured_outputs.json` schema given as text) raises RecursionError, a 500
where a 400 belongs. And it holds the GIL from the first byte to the last:
a 15 MB body of five million empty arrays held the router's event loop 3 s
(a worker thread does not help: no other Python runs meanwhile). So `loads`
measures first, in time linear in the text and in C: the nesting (at most
`MAX_DEPTH`), the values outside strings (at most `MAX_VALUES`: arrays,
objects and their items) and the object keys (at most `MAX_KEYS`, the
costliest values), and parses only what is within them, with the cyclic
garbage collector paused (millions of fresh lists each made it scan again).
The worst body within the bounds parses in tens of milliseconds
(bench/results/hardening.md); a legitimate one, a long prompt as one string,
in a few.
"""

from __future__ import annotations

import gc
import itertools
import json
import re
from typing import Any

from cgn_core.errors import InvalidRequest

MAX_DEPTH = 400  # arrays and objects nested in one another
# Values outside strings (each `,` `:` `[` `{` opens at most one): a prompt of 256k token
# ids fits, as do 256k messages or content parts. Object keys cost ~10x an item each.
MAX_VALUES = 1 << 18
MAX_KEYS = 1 << 15


def loads(raw: bytes | str, what: str, param: str | None = None) -> Any:
    """`raw` parsed as JSON; InvalidRequest naming `what` when it is not JSON, when it nests
    deeper than `MAX_DEPTH`, or when a string holds a lone UTF-16 surrogate (an escape like
    \\ud800 with no pair: valid JSON, but no UTF-8 text, so no tokenizer can take it)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    # NOTE: bytes.count runs at memory speed; only a text with that many brackets, keys or
    # values at all (strings included) is measured outside its strings, before json.loads.
    opened = data.count(b"[") + data.count(b"{")
    keys = data.count(b":")
    if opened > MAX_DEPTH or keys > MAX_KEYS or opened + keys + data.count(b",") > MAX_VALUES:
        _measure(data, what, param)
    paused = gc.isenabled()
    gc.disable()  # NOTE: what json.loads builds holds no cycle; it is collected as usual after
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest(f"{what} is not valid JSON", param=param) from None
    finally:
        if paused:
            gc.enable()
    if _SURROGATE_ESCAPE.search(data):  # a surrogate can only arrive as an escape
        _refuse_lone_surrogates(value, what, param)
    return value


# \ud800-\udfff, in either case (JSON has no other escape for them). NOTE: a regular
# expression finds it 3x faster than `in` does here (0.14 against 0.47 ms in 480 KB)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]")
# NOTE: one attempt per quote, no backtracking (no quote is left inside a string).
_PLAIN_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _measure(data: bytes, what: str, param: str | None) -> None:
    """InvalidRequest unless `data`, outside its strings, holds at most MAX_VALUES values and
    MAX_KEYS keys and nests at most MAX_DEPTH deep. Linear in `data`, every loop in C."""
    text = _outside_strings(data)
    if text is None:
        raise InvalidRequest(f"{what} holds more than {MAX_VALUES} JSON strings", param=param)
    opened, keys = text.count(b"[") + text.count(b"{"), text.count(b":")
    if opened + keys + text.count(b",") > MAX_VALUES:
        raise InvalidRequest(f"{what} holds more than {MAX_VALUES} JSON values", param=param)
    if keys > MAX_KEYS:
        raise InvalidRequest(f"{what} holds more than {MAX_KEYS} object keys", param=param)
    if opened > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise InvalidRequest(f"{what} nests deeper than {MAX_DEPTH} levels", param=param)


def _outside_strings(data: bytes) -> bytes | None:
    """`data` without its strings; None when it holds more than MAX_VALUES of them (removing
    each costs ~0.2 us, so that many would cost more than the parse of the values allowed)."""
    # NOTE: only an escaped backslash or quote can move where a string ends, and pairing
    # backslashes from the left is how JSON reads a run of them: two replaces at memory speed
    # leave every string as `"` ... `"` with no quote inside (a regex over every escape took
    # 0.1 s on an 8 MB prompt of code, one escaped newline a line).
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    if plain.count(b'"') > 2 * MAX_VALUES:
        return None
    return _PLAIN_STRING.sub(b"", plain)


def _depth(text: bytes) -> int:
    """The deepest nesting of [ and { in `text`, whose strings are gone (`_measure`)."""
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
