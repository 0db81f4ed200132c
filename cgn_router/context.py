"""The request context: one client request as the request path needs it, built once."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cgn_core.openai.request import LORA_SCALE_FIELD
from cgn_core.openai.resume import FIELD as RESUME_FIELD
from cgn_router.prompts import HashedPrompt


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One client request as the request path needs it, built once after admission."""

    kind: str  # chat | completion | embeddings
    asked: str  # the model name the client used
    chain: Sequence[str]  # the model it means, then its fallbacks in order
    body: Mapping[str, Any]
    raw: bytes
    stream: bool
    strip_usage: bool  # usage injected upstream for accounting, not relayed
    session: str | None
    band: str
    priority: int | None  # sent to engines as x-cgn-priority
    started: float  # monotonic
    deadline: float  # monotonic: started + deadlines.total_s
    prompt: HashedPrompt  # for chain[0]
    response_headers: Mapping[str, str]  # e.g. x-cgn-queue-ms
    request_id: str  # the client's x-request-id, when it is a clean header value
    # its tenant's block-hash salt (cgn_core/kv/blockhash.py), with its adapter's
    kv_salt: str | None = None
    adapter: tuple[str, float] | None = None  # the LoRA adapter it names, and its scale

    @property
    def model(self) -> str:
        return self.chain[0]

    def payload(self, served: str) -> bytes:
        """The upstream body: the client's bytes unless the model or stream options change."""
        if served == self.asked and not self.strip_usage:
            return self.raw
        return _encode(self._upstream_body(served))

    def _upstream_body(self, served: str) -> dict[str, Any]:
        changed = dict(self.body, model=served)
        changed.pop(LORA_SCALE_FIELD, None)  # an adapter's: the router writes the engine's
        if self.strip_usage:
            options = self.body.get("stream_options")
            changed["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
        return changed

    def prefill_leg(self, served: str) -> bytes:
        """A disaggregated request's first leg: compute the prompt, answer one token, hold
        the KV for a decode engine (cgn_core/kv/transfer.py)."""
        body = {
            k: v
            for k, v in self.body.items()
            if k not in ("stream_options", "max_completion_tokens")
        }
        body.update(
            model=served, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True}
        )
        return _encode(body)

    def resume_payload(self, served: str, resume: Mapping[str, Any]) -> bytes:
        """A continuation of this request's stream on another engine of model `served`
        (cgn_core/openai/resume.py): the upstream body with what was sent so far."""
        return _encode({**self._upstream_body(served), RESUME_FIELD: dict(resume)})

    def decode_leg(self, served: str, params: Mapping[str, Any]) -> bytes:
        """The second leg: the client's request, with where its prompt's KV waits."""
        return _encode({**self._upstream_body(served), "kv_transfer_params": dict(params)})


def _encode(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()
