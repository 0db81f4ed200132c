"""The router's state, as one object the HTTP handlers and the etcd followers share."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cgn_control.loop import ControlState
from cgn_core.revocation import RevocationList
from cgn_core.tracing import Tracer
from cgn_router.auth import KeyStore, Limiter, Principal
from cgn_router.catalog import Catalog
from cgn_router.gate import Gate
from cgn_router.hold import Holds
from cgn_router.learning import SpeedObserver
from cgn_router.ledger import Ledger, LedgerObserver
from cgn_router.load_signals import LoadObserver, LoadSignals
from cgn_router.metrics import MetricsObserver, RouterMetrics
from cgn_router.proxy import Proxy
from cgn_router.registry import Registry
from cgn_router.routing.chain import Decision, RoutingChain
from cgn_router.routing.lifecycle import Account, Observer
from cgn_router.settings import RouterSettings
from cgn_router.trace import RequestTrace
from cgn_router.types import Endpoint, EndpointId, RequestInfo

# Engines that continue another engine's stream from token ids (cgn_core/openai/resume.py):
# they name the ids they stream and take `cgn_resume` (the response id, the detokenizer's,
# parsers' and grammar's state advanced too).
RESUMABLE_ENGINES = frozenset({"cgn-infer"})
# stream text only, take a prompt of token ids on `/v1/completions` (SGLang's and
# trtllm-serve's make it the engine's input_ids): continued from their text, re-tokenized
# with the model's tokenizer where the router has it (cgn_core/openai/continuation.py)
TEXT_RESUMABLE_ENGINES = frozenset({"llamacpp", "sglang", "trtllm"})
# name their ids when asked (vLLM's return_token_ids, proxy.RETURN_IDS_ENGINES), take a
# prompt of token ids: continued from those ids, no tokenizer needed
IDS_RESUMABLE_ENGINES = frozenset({"vllm"})
# take a `/v1/completions` prompt of token ids: where a model allows it
# (`migrate_across_engines`), a stream of any of them may continue on any other
IDS_PROMPT_ENGINES = RESUMABLE_ENGINES | TEXT_RESUMABLE_ENGINES | IDS_RESUMABLE_ENGINES

# A model with more endpoints than SHORT_LIST is scored over a short list of them: the
# SHORT_PICKS holding most of the prompt, the SHORT_PICKS least loaded, ... (Registry.views),
# so routing costs the same at a thousand endpoints as at twenty.
SHORT_LIST = 16
SHORT_PICKS = 4


@dataclass
class AdapterLoads:
    """LoRA adapter loads in flight (cgn_router/adapters.py): one per (endpoint, adapter),
    which later requests wait on, and the background ones (kept from the collector)."""

    pending: dict[tuple[EndpointId, str], asyncio.Task[bool]] = field(default_factory=dict)
    background: set[asyncio.Task[bool]] = field(default_factory=set)
    # each adapter's requests, decayed: (count as of `at`, at); which one a load evicts
    asked: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class RouterService:
    settings: RouterSettings
    catalog: Catalog
    registry: Registry
    chain: RoutingChain
    proxy: Proxy
    metrics: RouterMetrics
    rng: random.Random = field(default_factory=random.Random)
    in_sync: asyncio.Event = field(default_factory=asyncio.Event)  # sources loaded once
    control: ControlState | None = None  # the reconciler, where this router runs one
    keys: KeyStore = field(default_factory=KeyStore)
    limiter: Limiter = field(default_factory=Limiter)
    gate: Gate | None = None  # admission; None when switched off
    holds: Holds = field(default_factory=Holds)  # requests waiting for a TTFT SLO (hold.py)
    loads: AdapterLoads = field(default_factory=lambda: AdapterLoads())  # adapters.py's
    tracer: Tracer | None = None  # OpenTelemetry spans; None when tracing is off
    ledger: Ledger | None = None  # tenants' usage against their budgets; None: no etcd
    revoked: RevocationList = field(default_factory=RevocationList)  # certificates refused
    created: int = field(default_factory=lambda: int(time.time()))
    # Who observes every request's records besides the metrics and the load signals (tests)
    observers: tuple[Observer, ...] = ()
    load: LoadSignals = field(init=False)  # what the autoscaler reads (cgn_router/load_signals)

    def __post_init__(self) -> None:
        self.load = LoadSignals(self.registry)
        ledger = self.ledger
        self.observers = (
            MetricsObserver(self.metrics),
            LoadObserver(self.load),
            SpeedObserver(self.registry),
            *((LedgerObserver(ledger, self.registry.tokens_per_joule),) if ledger else ()),
            *self.observers,
        )

    def account(self, kind: str, headers: Mapping[str, str]) -> Account:
        """A new request's account (cgn_router/routing/lifecycle.py): the service's observers, and
        the request's trace when tracing is on."""
        if self.tracer is None:
            return Account(self.observers)
        return Account((*self.observers, RequestTrace.start(self.tracer, kind, headers)))

    def principal(self, authorization: str | None) -> Principal:
        """Who is asking (from the request's Authorization header): the API key's principal,
        or the anonymous one while auth is off. Unauthorized otherwise."""
        auth = self.settings.auth
        if not auth.enabled:
            return Principal("", auth.anonymous_tenant, auth.anonymous_band)
        who = self.keys.authenticate(authorization)
        return who if auth.kv_isolation else dataclasses.replace(who, kv_salt=None)

    def known_models(self) -> dict[str, str]:
        """Every name a client may use → the model it means (catalog and registry)."""
        names = dict(self.catalog.names())
        for model in self.registry.models():
            names.setdefault(model, model)
        return names

    def model_for(self, name: str) -> str | None:
        """The model `name` means, or None when neither catalog nor registry knows it."""
        model = self.catalog.names().get(name)
        if model is None and self.registry.serves(name):
            model = name
        return model

    def engine_priority(self, band: str) -> int | None:
        """The priority engines should give a request of `band` (None: send none)."""
        adm = self.settings.admission
        spec = adm.bands.get(band)
        return spec.priority if adm.engine_priority and spec is not None else None

    def migration_limit(self, model: str) -> int:
        """Continuations a stream of `model` may have: its catalog entry's, else the setting."""
        entry = self.catalog.entry(model)
        if entry is not None and entry.migration_limit is not None:
            return entry.migration_limit
        return self.settings.migration.limit

    def can_resume(self, endpoint: Endpoint) -> bool:
        """Whether a stream to `endpoint` is tracked so that another engine may continue it."""
        if self.migration_limit(endpoint.model) <= 0:
            return False
        if endpoint.engine in RESUMABLE_ENGINES or endpoint.engine in IDS_RESUMABLE_ENGINES:
            return True
        return (
            endpoint.engine in TEXT_RESUMABLE_ENGINES
            and self.catalog.hasher(endpoint.model).codec is not None
        )

    def across_engines(self, model: str) -> bool:
        """Whether a stream of `model` may continue on another engine kind (its catalog
        entry's `migrate_across_engines`: one source, so one tokenizer)."""
        entry = self.catalog.entry(model)
        return entry is not None and entry.across_engines

    def text_resumed(self, endpoint: Endpoint) -> bool:
        """Whether a tracked stream to `endpoint` keeps its events, to be continued as a
        `/v1/completions` of its ids (read from its events, or its text re-tokenized): every
        engine but cgn-infer, and cgn-infer too where another kind may continue it."""
        engine = endpoint.engine
        if engine in TEXT_RESUMABLE_ENGINES or engine in IDS_RESUMABLE_ENGINES:
            return True
        return engine in RESUMABLE_ENGINES and self.across_engines(endpoint.model)

    def cannot_resume(
        self, model: str, engine: str = "cgn-infer", across: bool = False
    ) -> set[EndpointId]:
        """The endpoints of `model` that cannot take a continuation of a stream from `engine`:
        those of another engine kind (its continuation is in that kind's API); `across`
        (a continuation of token ids): those that take no prompt of token ids."""
        peers = self.registry.by_model.get(model, {})
        if across:
            return {e for e, st in peers.items() if st.endpoint.engine not in IDS_PROMPT_ENGINES}
        return {eid for eid, st in peers.items() if st.endpoint.engine != engine}

    def route(self, req: RequestInfo, tried: frozenset[EndpointId]) -> Decision:
        """The chain's decision over the live registry (the request path emits it: Routed).

        A model with more than SHORT_LIST endpoints is scored over a short list first
        (`Registry.views`); when the filters leave none of it, over all of them."""
        now = time.monotonic()
        by_model = self.registry.by_model.get(req.model, {})
        picks = SHORT_PICKS if len(by_model) > SHORT_LIST else None
        views = self.registry.views(req, now, tried, picks)
        decision = self.chain.route(req, views, self.rng)
        if decision.chosen is None and picks is not None:
            decision = self.chain.route(req, self.registry.views(req, now, tried), self.rng)
        return decision
