"""A tracked stream: what the proxy keeps of a stream that may migrate (#59).

A stream to an engine that another can continue (`Call.track`) keeps what a continuation
needs (`Progress`): the token ids the engine named (cgn-infer's `: ids` lines,
cgn_core/openai/resume.py), or, from an engine that names none, its events as relayed
(their text is re-tokenized if it breaks, cgn_core/openai/continuation.py); its first
chunk (the answer's id and creation time); whether its finish went out. `track` notes
each event; a `Watch` is its wait for the next one, which `Proxy.withdraw` shortens when
its endpoint is withdrawn.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from cgn_core.h1 import StreamReply
from cgn_core.openai import resume
from cgn_core.openai.continuation import MAX_EVENTS


@dataclass(slots=True, eq=False)
class Progress:
    """A tracked stream so far: its client response, the token ids the client has the text
    of, its first chunk (the answer's id and creation time), and whether its finish chunk
    went out. NOTE: ids and chunk are kept as bytes and parsed only for a continuation: a
    stream that never breaks (nearly all) pays a slice per event, not a parse."""

    out: StreamReply
    ids: list[bytes] = field(default_factory=list)  # "791,13,2" per ids line
    first: bytes = b""  # the first data event
    finished: bool = False
    why: str = ""  # how its last leg broke
    engine: str = ""  # the engine its first leg streamed from
    # its data events as relayed, where the engine names no ids (Call.keep_events); None
    # when it does
    events: list[bytes] | None = None
    overflowed: bool = False  # more events than continuation.MAX_EVENTS: not continued
    watch: Watch | None = None  # its current leg's, while it streams (Proxy.withdraw)

    def token_ids(self) -> list[int]:
        """ValueError for a malformed line (nothing from the network is trusted)."""
        return [int(t) for line in self.ids if line for t in line.split(b",")]

    def resume_field(self) -> dict[str, Any]:
        """The continuation's `cgn_resume`; ValueError when the stream does not say enough."""
        chunk = json.loads(self.first[6:]) if self.first else None
        rid = chunk.get("id") if isinstance(chunk, dict) else None
        created = chunk.get("created") if isinstance(chunk, dict) else None
        if not isinstance(rid, str) or type(created) is not int:
            raise ValueError("the stream named no response id")
        return resume.Resume(tuple(self.token_ids()), rid, created).to_json()


@dataclass(slots=True, eq=False)
class Watch:
    """A tracked stream's wait for its next event on one endpoint."""

    eid: str
    withdrawn: bool = False  # its endpoint is gone: a short silence moves it
    timeout: asyncio.Timeout | None = None  # the wait now, if it is waiting


def track(progress: Progress, event: bytes) -> tuple[bytes, str]:
    """Note what a tracked stream's event tells (its token ids, the answer's id, a finish)
    and return it without its ids line; or, for an engine's error event that another
    engine may do better than (not the request's own fault), (b"", its message)."""
    if event.startswith(resume.IDS_PREFIX):
        end = event.find(b"\n")
        if end < 0:
            return b"", "a malformed token id line"
        progress.ids.append(event[len(resume.IDS_PREFIX) : end])
        event = event[end + 1 :]
    elif event.startswith(b'data: {"error"'):
        try:
            error = json.loads(event[6:])["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        if isinstance(error, dict) and error.get("type") != "invalid_request_error":
            return b"", str(error.get("message") or "an error event")[:300]
    # a non-null finish reason, in cgn-infer's JSON (and Python's) or llama.cpp's
    if b'"finish_reason": "' in event or b'"finish_reason":"' in event:
        progress.finished = True
    if event.startswith(b"data: {"):
        if not progress.first:
            progress.first = event
        if progress.events is not None:  # NOTE: kept as bytes, parsed only if it breaks
            if len(progress.events) < MAX_EVENTS:
                progress.events.append(event)
            else:
                progress.overflowed = True
    return event, ""
