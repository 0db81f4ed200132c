"""The router's plain values: endpoints, their load, a request as routing sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from cgn_core import keys
from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash

EndpointId = NewType("EndpointId", str)  # "<model>/<replica>" as in the etcd key


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A routable engine, as registered under `/cognitora/endpoints/<model>/<replica>`."""

    id: EndpointId
    model: str
    url: str  # base URL without a trailing slash
    engine: str = "cgn-infer"
    role: str = "both"  # both | prefill | decode
    node: str = ""
    block_size: int = BLOCK_SIZE
    hash_scheme: str = keys.HASH_SCHEME
    kv_events_url: str = ""  # "" when the engine publishes no KV events
    # the LoRA adapters it has loaded, by catalog name, in its own order (llama.cpp: a
    # request's `lora` id is the index)
    adapters: tuple[str, ...] = ()
    # The engine's API secret from its endpoint record (sent as Authorization: Bearer);
    # "" for engines that take none. Never shown by /endpoints.
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Load figures scraped from an engine's /metrics (vLLM's meaning, any engine's names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    scraped_at: float = 0.0  # monotonic seconds
    own_in_flight: int = 0  # this router's requests at the engine when the page was read


@dataclass(frozen=True, slots=True)
class Usage:
    """An answer's token counts, as the engine reported them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def queue_length(in_flight: int, load: EngineLoad | None) -> float:
    """An endpoint's queue as best known: the router's count or the engine's, whichever is
    more (the load scorer scores by it; the registry's load order keeps endpoints by it)."""
    engine = load.running + load.waiting if load is not None else 0.0
    return max(float(in_flight), engine)


@dataclass(frozen=True, slots=True)
class Speed:
    """A replica's speed as the router learned it (cgn_router/routing/speed.py), or the
    prior it starts from."""

    overhead_s: float = 0.02
    prefill_s: float = 1e-3  # per uncached prompt token
    decode_s: float = 0.03  # per output token, alone
    per_batch_s: float = 0.002  # per output token, per other request in its batch
    samples: float = 0.0  # the real samples behind it; 0: the prior alone
    # added to the first token's time per other request in flight (their decode steps share
    # the engine's steps with this one's prefill)
    ttft_per_other_s: float = 0.0

    def ttft(self, work_tokens: float, others: float = 0.0) -> float:
        """Seconds to the first byte behind `work_tokens` of prefill (its own included), with
        `others` requests in flight beside it."""
        return (
            self.overhead_s
            + self.prefill_s * max(0.0, work_tokens)
            + self.ttft_per_other_s * max(0.0, others)
        )

    def per_token(self, batch: float) -> float:
        """Seconds per output token in a batch of `batch` requests."""
        return self.decode_s + self.per_batch_s * max(0.0, batch - 1)

    @property
    def warm(self) -> bool:
        return self.samples >= 1.0


DEFAULT_SPEED = Speed()  # a replica nothing is known of (routing/speed.py learns the rest)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What routing needs from a request; the body itself is never looked at again."""

    model: str
    role: str = "both"  # the role an endpoint must be able to play
    blocks: tuple[BlockHash, ...] = ()  # the prompt's full-block hashes, in order
    prompt_tokens: int = 0  # estimated where the router has no tokenizer
    session: str | None = None
    adapter: str | None = None  # the LoRA adapter it names; None: the base model


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One endpoint as the plugins see it at one instant (a snapshot, no live objects)."""

    endpoint: Endpoint
    ready: bool = True
    cordoned: bool = False
    breaker_open: bool = False
    in_flight: int = 0  # requests this router has on it now
    pending_prefill: int = 0  # uncached prompt tokens routed here and not yet answered
    # of those, the ones still to compute, as the registry's drain clock estimates them
    queued_tokens: float = 0.0
    load: EngineLoad | None = None  # None: never scraped, stale or unreachable
    matched_blocks: int = 0  # leading prompt blocks this endpoint is known to hold
    # the blocks right after those that its node's cgn-kvcached holds: in RAM, on SSD only
    node_ram_blocks: int = 0
    node_ssd_blocks: int = 0
    session_owner: bool = False  # the request's session last went here
    # its node's measured output tokens per joule (cgn-metrics); None: not measured
    tokens_per_joule: float | None = None
    speed: Speed = DEFAULT_SPEED  # learned from its answers (cgn_router/routing/speed.py)
    # its oldest waiting stream's wait over what `speed` predicted for it, at least 1
    # (`EndpointState.lag`): how much slower than learned it is running now
    lag: float = 1.0
    # the chain's predicted seconds to first token here (a time scorer); None: none
    predicted_ttft_s: float | None = None

    @property
    def id(self) -> EndpointId:
        return self.endpoint.id
