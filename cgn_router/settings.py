"""cgn-router's settings tree (flag > CGN_ROUTER_* env > YAML > these defaults).

Each dataclass checks its own fields' ranges (`check`, run by the settings loader as it
builds the tree); `RouterSettings.check` holds the rules across settings. The routing
pipeline is checked where it is built from `routing` (its plugins own their parameters)."""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cgn_control.decide.reconciler import ReconcilerSettings
from cgn_core.errors import ConfigError
from cgn_core.settings import (
    EtcdSettings,
    ListenSettings,
    LogSettings,
    TlsSettings,
    TracingSettings,
    ranged,
)

Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """A catalog entry for router-only runs (etcd's `/cognitora/catalog/models/` adds more)."""

    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()  # tried in order when no endpoint of this model can serve
    # GGUF file (or bundled name: smollm2, qwen2.5-coder-0.5b) whose tokenizer and chat
    # template the router uses, so its block hashes equal the engine's. Unset: hashes
    # over character blocks (approximate; `cgn_router_prompts_hashed_total{method="chars"}`).
    tokenizer: Path | None = None
    # a broken stream may continue on an endpoint of another engine kind (cgn-infer,
    # llamacpp, vllm, sglang, trtllm) serving the same weights: one tokenizer (`tokenizer`)
    migrate_across_engines: bool = False
    # the TTFT SLO a request waits at the router for, with `routing.hold_for_slo` and a
    # `time` scorer (cgn_router/hold.py); 0: none (etcd's catalog: `slo.ttft_p90_ms`)
    ttft_slo_ms: float = ranged(0.0, 0, 3_600_000)
    # LoRA adapters of this model a client may name in `model`, each with its GGUF file (for
    # engines that load at run time; "" for none) (etcd's catalog: `adapters`). A request
    # for one goes to an endpoint holding it (`endpoints.<e>.adapters` or loaded at run time)
    adapters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StaticEndpoint:
    """An engine to route to without etcd."""

    url: str = ""  # base URL, e.g. http://10.0.0.5:8001
    model: str = ""
    engine: str = "cgn-infer"  # cgn-infer | vllm | sglang | llamacpp | trtllm (metric names)
    role: Role = "both"
    node: str = ""
    # Where the engine streams KV events ("" = none; cgn-infer's default is
    # <url>/v1/kv/events). Without events the router tracks KV approximately.
    kv_events_url: str | None = None
    # the LoRA adapters it has loaded, in its own order (llama.cpp: its `--lora` order)
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StaticStore:
    """A node's cgn-kvcached to follow without etcd (agents publish theirs in etcd)."""

    events_url: str = ""  # e.g. http://10.0.0.5:9094/v1/kv/events
    events_token: str = ""


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """One scorer of the routing chain: a registered type, its weight, its parameters."""

    type: str = ""  # prefix | load | kv_usage | affinity (cgn_router/routing/plugins/)
    weight: float = ranged(1.0, 0, 1e9)
    name: str = ""  # defaults to the type; two scorers of one type need two names
    params: dict[str, float] = field(default_factory=dict)  # the scorer's fields


def _default_scorers() -> tuple[ScorerSpec, ...]:
    return (
        ScorerSpec("prefix", 3.0),
        ScorerSpec("load", 1.0),
        ScorerSpec("kv_usage", 0.5),
        ScorerSpec("affinity", 0.5),
        ScorerSpec("efficiency", 0.0),  # tokens per joule: off until a policy weighs it
    )


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The routing chain and its tunables (docs/cgn-router.md).

    `/cognitora/policy/routing` in etcd overrides filters, scorers, picker and weights live."""

    filters: tuple[str, ...] = ("model", "role", "ready", "cordon", "breaker")
    scorers: tuple[ScorerSpec, ...] = field(default_factory=_default_scorers)
    picker: str = "max"  # max | p2c | round_robin (a baseline only)
    # Approximate KV tracking (engines without a KV event stream): blocks assumed
    # cached on the chosen endpoint for this long, at most this many per endpoint.
    approx_ttl_s: float = ranged(300.0, 0, 86400)
    approx_blocks: int = ranged(65536, 1, 1 << 24)
    # Blocks of a request just routed to an event-publishing engine count as cached
    # there until its events confirm them (bursts of one prefix land together).
    optimistic_ttl_s: float = ranged(5.0, 0, 3600)
    chars_per_block: int = ranged(64, 1, 65536)  # character-block approximation (no tokenizer)
    # Tokenized and hashed prompt prefixes (cgn_router/prompt_cache.py), in MiB per router
    # worker: a conversation's next turn tokenizes and hashes only what is new. 0: off.
    prompt_cache_mib: int = ranged(64, 0, 1 << 16)
    # Memory for what the engines and KV stores say they hold (KV events), in MiB; past
    # it, each source's oldest blocks are forgotten first. 0: 1/16 of this machine's
    # memory, at most 4096.
    index_budget_mb: int = ranged(0, 0, 1 << 20)
    session_ttl_s: float = ranged(600.0, 0, 604800)
    session_header: str = "x-session-id"  # or the body's `user` field
    # With a `time` scorer: a request whose best predicted time to first token misses its
    # model's TTFT SLO waits at the router for a replica that meets it (cgn_router/hold.py).
    # Off by default: on the real mixed fleet, under load, it made TTFT p90 worse
    # (bench/results/mixed_fleet_held.md); the SLO alone also drives the autoscaler.
    hold_for_slo: bool = False
    # LoRA adapters (cgn_router/adapters.py): residency routes a request to a replica that
    # holds its adapter and loads it on one (the least busy) where none does, and on one
    # more when every holder has `adapter_widen_queue` requests or more; random loads it
    # wherever a random replica is (the baseline bench/lora_placement.py compares against)
    adapter_placement: Literal["residency", "random"] = "residency"
    adapter_widen_queue: int = ranged(4, 1, 1 << 20)
    adapter_load_s: float = ranged(30.0, 0.1, 600)  # the most a request waits for a load
    # an adapter's request count halves over this: a full replica unloads the adapter
    # with the fewest (residency; the engine's own LRU evicts with `random`)
    adapter_half_life_s: float = ranged(300.0, 1, 86400)

    def index_budget_bytes(self) -> int:
        if self.index_budget_mb:
            return self.index_budget_mb << 20
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(memory // 16, 4096 << 20)


@dataclass(frozen=True, slots=True)
class PdSettings:
    """Prefill/decode disaggregation, for models with prefill-role endpoints
    (cgn_router/routing/disagg.py has the rule)."""

    enabled: bool = True
    # shorter uncached prompts run whole on the decode replica
    min_uncached_tokens: int = ranged(512, 0, 1 << 24)
    max_prefill_queue: int = ranged(4, 0, 65536)  # a prefill replica busier than this is not used
    # the prefill leg's answer, at most (then recompute)
    prefill_timeout_s: float = ranged(60.0, 0.01, 3600)
    # moving a prompt token's KV from the prefill replica to the decode one, in seconds,
    # where the chain predicts time (disagg.py): 5e-5 is SmolLM2's 46 KB of float32 KV per
    # token over loopback (bench/results/pd_mixed.md: 92 ms for ~2,000 tokens)
    transfer_s_per_token: float = ranged(5e-5, 0, 1)


@dataclass(frozen=True, slots=True)
class DeadlineSettings:
    connect_s: float = ranged(3.0, 0.01, 300)
    first_token_s: float = ranged(120.0, 0.01, 86400)  # request sent → first response byte
    idle_s: float = ranged(60.0, 0.01, 86400)  # between two streamed chunks
    total_s: float = ranged(1800.0, 0.01, 604800)
    # A request for a model scaled to zero (catalog replicas.min 0, no replica) waits this
    # long (within total_s) for the autoscaler to start one, then gets 503 with Retry-After.
    cold_start_s: float = ranged(120.0, 0, 3600)


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """Request migration: a stream whose engine fails mid-answer continues on another
    replica of the same model (cgn_core/openai/resume.py; docs/cgn-router.md)."""

    # continuations per request; 0: off (a catalog model's migration_limit wins)
    limit: int = ranged(3, 0, 16)
    # prompt plus generated tokens beyond which a stream is not moved
    max_tokens: int = ranged(32768, 1, 1 << 24)


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failures: int = ranged(3, 1, 1000)  # consecutive failures that open the breaker
    open_s: float = ranged(5.0, 0.01, 3600)  # then one half-open probe request after this long


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    interval_s: float = ranged(1.0, 0.01, 3600)  # each engine's /metrics
    stale_s: float = ranged(5.0, 0.01, 86400)  # older load figures are not trusted
    # At most this many scrapes a second: a fleet larger than interval_s x max_per_s is
    # scraped less often (its figures then trusted for twice the longer period).
    max_per_s: float = ranged(100.0, 0.01, 100000)


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """API keys from etcd (/cognitora/keys/, written by `cgn-ctl keys`)."""

    enabled: bool = True  # switched off only explicitly; the router then says so everywhere
    anonymous_band: str = "gold"  # the band of every request while auth is off
    anonymous_tenant: str = "anonymous"
    # Each tenant's cached prompts are its own (or its keys' kv_share_group's): the router's
    # block hashes, the engines' pools and the node's KV store are salted by it, so no tenant
    # can time another's prompts. Off: every key's requests share one cache (as with auth off).
    kv_isolation: bool = True


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """Tenants' budgets (`cgn-ctl tenants set`): each worker publishes what it served at
    /cognitora/usage/<instance>.w<worker> and counts every other router's (cgn_router/ledger.py)."""

    enabled: bool = True  # with etcd only (router-only runs have no budgets)
    # this router's name among the writers, kept across its restarts; "": <host>-<http port>
    instance: str = ""
    # the most often a worker writes its count; others see it within this plus a watch delay
    publish_s: float = ranged(1.0, 0.05, 60)


@dataclass(frozen=True, slots=True)
class BandSettings:
    priority: int = ranged(1, 0, 1000)  # lower is served first
    # admitted while pool saturation stays at or below this (1.0: batch full)
    ceiling: float = ranged(1.0, 0.01, 100)
    queue: int = ranged(1000, 0, 1 << 20)  # waiting requests beyond this are refused at once (503)
    ttl_s: float = ranged(60.0, 0.01, 86400)  # a request waiting longer is refused (504)


def _default_bands() -> dict[str, BandSettings]:
    return {
        "platinum": BandSettings(priority=0, ceiling=1.5, queue=1000, ttl_s=30.0),
        "gold": BandSettings(priority=1, ceiling=1.0, queue=1000, ttl_s=60.0),
        "bronze": BandSettings(priority=2, ceiling=0.5, queue=5000, ttl_s=300.0),
    }


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """When a request may proceed: priority bands over per-model pool saturation."""

    enabled: bool = True
    bands: dict[str, BandSettings] = field(default_factory=_default_bands)
    # batch slots assumed per endpoint until its metrics show more
    default_capacity: int = ranged(8, 1, 65536)
    tick_s: float = ranged(0.05, 0.001, 10)  # queue expiry and re-dispatch when capacity changes
    # Send each request's band priority to the engine (x-cgn-priority): cgn-infer queues
    # and preempts by it, so a band keeps its rank in the engines' own queues too.
    engine_priority: bool = True

    def check(self) -> None:
        if not self.bands:
            raise ConfigError("bands: at least one band is needed")


MAX_WORKERS = 64
INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


@dataclass(frozen=True, slots=True)
class EppSettings:
    """The endpoint picker for a Kubernetes gateway (cgn_router/epp.py, issue #61): Envoy's
    ext_proc over gRPC, beside the OpenAI surface. Off unless enabled (`serve --epp`);
    GIE's default ports."""

    enabled: bool = False
    host: str = "127.0.0.1"  # 0.0.0.0 in a pod: the gateway dials it
    port: int = ranged(9002, 0, 65535)  # ext_proc (0: any free port)
    health_port: int = ranged(9003, 0, 65535)  # grpc.health.v1: liveness, readiness
    body_timeout_s: float = ranged(60.0, 0.01, 3600)  # a request body must end within this
    metadata_namespace: str = "envoy.lb"  # of the destination (and the served endpoint)
    subset_namespace: str = "envoy.lb.subset_hint"  # of the gateway's subset hint
    fallbacks: int = ranged(2, 0, 16)  # endpoints the gateway may retry after the chosen one
    max_streams: int = ranged(4096, 1, 1 << 20)  # ext_proc streams (requests) at once
    # x-gateway-inference-objective -> admission band (an objective named as a band needs
    # no entry); cgn-operator writes its InferenceObjectives' here
    objectives: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    http: ListenSettings = ListenSettings(port=8080)  # the OpenAI surface
    admin: ListenSettings = ListenSettings(port=9091)  # /metrics, /healthz, /readyz
    tls: TlsSettings = TlsSettings()  # HTTPS on the OpenAI surface when cert_file is set
    admin_tls: TlsSettings = TlsSettings()  # HTTPS admin; management paths need a client cert
    # Engines served over HTTPS (agent `engines.tls`): the CA to verify them and the client
    # certificate the router presents, which those engines require on /v1/*.
    engine_tls: TlsSettings = TlsSettings()
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
    # etcd: watch /cognitora/endpoints/, cordon/, catalog/ and policy/ (plus `endpoints`);
    # static: only the endpoints and models below (router-only runs, no etcd).
    discovery: Literal["etcd", "static"] = "etcd"
    endpoints: dict[str, StaticEndpoint] = field(default_factory=dict)
    stores: dict[str, StaticStore] = field(default_factory=dict)  # node -> its KV store
    models: dict[str, ModelSettings] = field(default_factory=dict)
    routing: RoutingSettings = RoutingSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    pd: PdSettings = PdSettings()
    breaker: BreakerSettings = BreakerSettings()
    scrape: ScrapeSettings = ScrapeSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()
    auth: AuthSettings = AuthSettings()
    admission: AdmissionSettings = AdmissionSettings()
    budgets: BudgetSettings = BudgetSettings()
    # endpoints tried per request before the first byte reaches the client
    attempts: int = ranged(3, 1, 16)
    migration: MigrationSettings = MigrationSettings()  # and after it, for a broken stream
    max_body_bytes: int = ranged(8 << 20, 1024, 1 << 30)
    # Worker processes sharing the listening port (SO_REUSEPORT), each a whole router;
    # 0: one per core. 1: a single process, no supervisor.
    workers: int = ranged(0, 0, MAX_WORKERS)
    # A non-streamed answer larger than this is not relayed (tried elsewhere): it is held in
    # memory whole. Streamed answers are relayed line by line (one line: at most 16 MiB).
    max_response_bytes: int = ranged(64 << 20, 1024, 1 << 34)
    tracing: TracingSettings = TracingSettings()  # OpenTelemetry spans (cgn_core/tracing.py)
    epp: EppSettings = EppSettings()  # the endpoint picker for a Kubernetes gateway (#61)
    # mutual TLS on the endpoint picker (the gateway presents a client certificate)
    epp_tls: TlsSettings = TlsSettings()

    def check(self) -> None:
        """The root's own ranges, then the rules across settings."""
        if not self.auth.enabled and self.auth.anonymous_band not in self.admission.bands:
            raise ConfigError(
                f"auth.anonymous_band {self.auth.anonymous_band!r} is not in admission.bands"
            )
        if self.discovery == "static" and not self.endpoints:
            raise ConfigError(
                "discovery is 'static' but no endpoints are configured (endpoints: in YAML)"
            )
        if self.auth.enabled and self.discovery == "static":
            raise ConfigError(
                "auth.enabled needs etcd (API keys live in /cognitora/keys/); "
                "set auth.enabled: false for a router-only run"
            )
        if self.epp.enabled and self.workers != 1:
            raise ConfigError(
                "epp.enabled: the endpoint picker runs in a single router process; set "
                "workers: 1 (--workers 1)"
            )
        instance = self.budgets.instance
        if instance and not INSTANCE.match(instance):
            raise ConfigError(f"budgets.instance {instance!r}: use 1-100 of [A-Za-z0-9._:-]")
