"""Text from records and peers, made safe to show on a terminal.

A node name, a model name or a scaling reason comes from etcd or a peer's
answer, and whoever could write it could put escape sequences in it: a
terminal obeys them (retitle the window, clear the screen, move the cursor
to forge a line), and rich obeys markup (`[link=...]`, `[red]`). Every
string a CLI shows from such a source goes through `plain` (control and
bidirectional-override characters become U+FFFD, so a reader sees that
something was there) and, where rich reads markup, `for_markup`.
"""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape

# C0 (tab and newline too: a newline in a name forges a line), DEL, C1, and the
# bidirectional overrides and isolates that reorder what a reader sees
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
REPLACEMENT = "\ufffd"


def plain(text: str) -> str:
    """`text` with every control and direction-override character replaced by U+FFFD."""
    return _UNSAFE.sub(REPLACEMENT, text)


def for_markup(text: str) -> str:
    """`plain(text)`, its rich markup escaped (what rich then shows is the text itself)."""
    return escape(plain(text))


def for_terminal(value: Any) -> Any:
    """A JSON-shaped value with every string in it (keys too) passed through `for_markup`,
    for renderers that print its strings as rich markup."""
    if isinstance(value, str):
        return for_markup(value)
    if isinstance(value, dict):
        return {for_terminal(k): for_terminal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [for_terminal(v) for v in value]
    return value
