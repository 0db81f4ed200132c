"""cgn_core/safejson.py: JSON from strangers, parsed only within its bounds.

The bounds are measured on the text with its strings removed; a property test
checks that what is left is exactly the structure a parse finds (containers,
keys, items), whatever the strings hold: quotes, runs of backslashes, brackets.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_core import safejson
from cgn_core.errors import InvalidRequest

TRICKY = st.text(alphabet='ab"\\[]{},: \n\u00e9\U0001f600', max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
    max_leaves=40,
)


def structure(value: Any) -> tuple[int, int, int]:
    """(containers, keys, separating commas) of a parsed value."""
    if isinstance(value, list):
        parts = [structure(v) for v in value]
        commas = max(0, len(value) - 1)
    elif isinstance(value, dict):
        parts = [structure(v) for v in value.values()]
        commas = max(0, len(value) - 1)
    else:
        return 0, 0, 0
    keys = len(value) if isinstance(value, dict) else 0
    return (
        1 + sum(p[0] for p in parts),
        keys + sum(p[1] for p in parts),
        commas + sum(p[2] for p in parts),
    )


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans())
def test_what_is_left_outside_the_strings_is_exactly_the_structure(
    value: Any, ascii_only: bool
) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    text = safejson._outside_strings(data)
    assert text is not None and b'"' not in text
    containers, keys, commas = structure(json.loads(data))
    assert text.count(b"[") + text.count(b"{") == containers
    assert text.count(b":") == keys
    assert text.count(b",") == commas


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"x":[' + b",".join([b"[]"] * 300_000) + b"]}", "more than 262144 JSON values"),
        (b'{"x":[' + b",".join([b"1"] * 300_000) + b"]}", "more than 262144 JSON values"),
        (b'{"x":[' + b",".join([b'"a"'] * 300_000) + b"]}", "more than 262144 JSON strings"),
        (
            b"{" + b",".join(b'"k%d":1' % i for i in range(40_000)) + b"}",
            "more than 32768 object keys",
        ),
        (b"[" * 500 + b"]" * 500, "nests deeper than 400 levels"),
    ],
    ids=["arrays", "numbers", "strings", "keys", "depth"],
)
def test_bodies_past_a_bound_are_refused_before_they_are_parsed(body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        safejson.loads(body, "the request body")
    assert gc.isenabled()


def test_what_a_legitimate_body_holds_inside_its_strings_is_not_counted() -> None:
    """A long prompt of code (colons, brackets, commas and escaped quotes in every line) and
    a prompt of 250k token ids are within the bounds."""
    line = "def f(a, b):\n    return {\"k\": [a, b], 'v': a[0]}  # \\\n"
    prompt = {"messages": [{"role": "user", "content": line * 100_000}]}
    assert safejson.loads(json.dumps(prompt).encode(), "the request body") == prompt
    ids = {"prompt": list(range(250_000))}
    assert safejson.loads(json.dumps(ids), "the request body") == ids
    assert gc.isenabled()
