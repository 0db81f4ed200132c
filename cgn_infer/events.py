"""What a generation asks of the engine and what it hands back: plain values, shared by the
engine (engine.py), the HTTP side that relays them (server.py, responses.py) and the P/D
transfer (transfer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cgn_core.kv.blockhash import BlockHash
from cgn_infer.grammar import Constraint
from cgn_infer.sampling import Sampled, SamplingParams
from cgn_infer.stats import JobStats

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0  # lower runs sooner
    salt: str | None = None  # the tenant's KV salt (the router's x-cgn-kv-salt): no sharing
    export_kv: bool = False  # a prefill leg: hand back the prompt's full KV blocks at the end
    constraint: Constraint | None = None  # a grammar the output must follow (its own state)
    # a continuation (cgn_core/openai/resume.py): tokens another engine generated, computed
    # after the prompt and counted as output; max_tokens is what is left to generate
    resumed: tuple[int, ...] = ()
    lora: tuple[int, float] | None = None  # its LoRA adapter's slot and scale (adapters.py)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One decoded token: the text it completed (maybe ''), and how it was sampled."""

    text: str
    sampled: Sampled


@dataclass(frozen=True, slots=True)
class FinishEvent:
    reason: FinishReason
    text: str  # the last held-back text, emitted at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None
    # the error is the request's: its grammar hit llguidance's limits (a 400, not a 500)
    client_fault: bool = False
    exported: Exported | None = None  # export_kv: the prompt's blocks, read before release
    stats: JobStats | None = None  # None: the job never started (its engine stopped first)


@dataclass(frozen=True, slots=True)
class Exported:
    """A prompt's full blocks (all but the block holding its last token, which the decode
    engine computes itself), as the backend serializes them."""

    hashes: tuple[BlockHash, ...]
    data: Any  # [blocks, block bytes] uint8


Event = TokenEvent | FinishEvent
