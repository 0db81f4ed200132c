"""The fleet view from scraped samples: traffic, latency, queues, KV, nodes, watts, joules.

Pure: `summarize` takes what was scraped (per target, rings of the samples kept)
and returns the typed view (cgn_core/fleet_view.py) whose JSON the dashboard draws;
the daemon calls it after each scrape round.
Rates and percentiles are over `window_s` (counter restarts count from zero, as in
Prometheus); rates divide by the part of the window the rings cover, so the first
minute after a start is not under-counted. Energy: a node's joules are the increase of its agent's
`cgn_agent_energy_joules` (the agent integrates its RAPL, NVML or powermetrics
readings, RAPL wrap-around included) over the window, divided by the tokens its
engines produced in the same window: per output token and per token (prompt plus
output). A node whose agent exports no power has source `unavailable` and no
figure: nothing is estimated. A model's joules are its nodes' joules shared by the
tokens it produced there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from cgn_core.engine_metrics import PREFIXES, NameMap, held_adapters, name_map
from cgn_core.fleet_view import (
    FleetView,
    ModelView,
    NodeView,
    ReplicaView,
    StoreView,
    TargetView,
    TenantView,
    Totals,
)
from cgn_core.keys import MAX_ADAPTERS
from cgn_metrics.series import Ring, increase, quantile
from cgn_metrics.targets import Fleet, Target

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # sample name, sorted labels
# Families kept per target (prefixes): what the fleet view and the federation use.
KEEP = (
    *PREFIXES,
    "cgn_infer_",
    "cgn_router_requests",
    "cgn_router_tokens",
    "cgn_router_tenant_tokens",
    "cgn_router_ttft_seconds",
    "cgn_router_queue_depth",
    "cgn_router_admission_rejections",
    "cgn_router_endpoint_prefill_seconds_per_token",  # the routers' learned speeds (#57)
    "cgn_router_endpoint_decode_seconds_per_token",
    "cgn_router_endpoint_speed_learned",
    "cgn_agent_power_watts",
    "cgn_agent_energy_joules",
    "cgn_kvcached_bytes",
    "cgn_kvcached_blocks",
    "cgn_kvcached_hits",
    "cgn_kvcached_misses",
    "cgn_kvcached_budget_bytes",
)
QUANTILES = (0.5, 0.95, 0.99)
# the signals an engine publishes from its start (labelled counters and histograms such as
# finished requests or TTFT appear with the first request that feeds them)
ALWAYS = ("running", "waiting", "kv_usage", "prompt_tokens", "generation_tokens")


@dataclass(slots=True)
class Scraped:
    """One target's state and the rings of its kept samples."""

    target: Target
    capacity: int
    state: str = "pending"  # pending | up | down
    error: str = ""
    last_ok: float = 0.0
    duration_s: float = 0.0
    rings: dict[SeriesKey, Ring] = field(default_factory=dict)
    latest: dict[SeriesKey, float] = field(default_factory=dict)  # the last scrape, all kept

    def record(self, t: float, samples: Mapping[SeriesKey, float]) -> None:
        for key, value in samples.items():
            ring = self.rings.get(key)
            if ring is None:
                ring = self.rings[key] = Ring(self.capacity)
            ring.append(t, value)
        for gone in set(self.rings) - set(samples):  # a series the target stopped exporting
            del self.rings[gone]
        self.latest = dict(samples)

    def series(self, name: str, **want: str) -> Iterable[tuple[dict[str, str], Ring]]:
        """The rings of sample `name` whose labels include `want`."""
        for (n, labels), ring in self.rings.items():
            if n == name:
                lb = dict(labels)
                if all(lb.get(k) == v for k, v in want.items()):
                    yield lb, ring

    def increase(self, name: str, since: float, **want: str) -> float:
        return sum(increase(ring.points(since)[1]) for _, ring in self.series(name, **want))

    def gauge(self, name: str, **want: str) -> float | None:
        found = [last[1] for _, r in self.series(name, **want) if (last := r.last()) is not None]
        return sum(found) if found else None

    def label(self, name: str, label: str) -> str:
        """`label`'s value on the first series of `name` ('' when none)."""
        return next((lb.get(label, "") for lb, _ in self.series(name)), "")

    def names(self) -> NameMap:
        """The engine's vocabulary (cgn_core/engine_metrics.py): vLLM's where unknown."""
        return name_map(self.target.engine)

    def signal(self, signal: str, suffix: str = "") -> str | None:
        """The name this target publishes `signal` under (`suffix`: `_bucket` for a
        histogram's); None when it publishes none."""
        present = {n for n, _ in self.rings}
        names: tuple[str, ...] = getattr(self.names(), signal)
        return next((n + suffix for n in names if n + suffix in present), None)

    def unpublished(self) -> frozenset[str]:
        """Of the signals an engine publishes from its start, those its vocabulary names but
        its last page lacked (an engine's rename, a build without it, a wrong mapping)."""
        names = self.names()
        return frozenset(x for x in ALWAYS if getattr(names, x) and self.signal(x) is None)

    def signal_gauge(self, signal: str) -> float | None:
        name = self.signal(signal)
        return None if name is None else self.gauge(name)

    def signal_increase(self, signal: str, since: float) -> float | None:
        name = self.signal(signal)
        return None if name is None else self.increase(name, since)

    def buckets(self, name: str, since: float) -> dict[float, float]:
        out: dict[float, float] = defaultdict(float)
        for labels, ring in self.series(name + "_bucket"):
            le = _le(labels.get("le", ""))
            if le is not None:
                out[le] += increase(ring.points(since)[1])
        return out


def _le(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _percentiles(buckets: Mapping[float, float]) -> dict[str, float | None]:
    return {f"p{round(q * 100)}": quantile(q, buckets) for q in QUANTILES}


def _merge(maps: Iterable[Mapping[float, float]]) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for m in maps:
        for le, n in m.items():
            out[le] += n
    return out


def _covered(scraped: Iterable[Scraped], since: float) -> float:
    """The longest stretch of the window any target's rings hold (0: under two scrapes)."""
    best = 0.0
    for s in scraped:
        for ring in s.rings.values():
            t, _ = ring.points(since)
            if t.size >= 2:
                best = max(best, float(t[-1] - t[0]))
            break  # a target's rings share their scrape times
    return best


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _per(joules: float | None, tokens: float) -> float | None:
    return None if joules is None else _ratio(joules, tokens)


def _latency(engines: Iterable[Scraped], signal: str, since: float) -> dict[str, float | None]:
    """Percentiles of a latency histogram `signal` over every engine that publishes one."""
    found = [(s, name[: -len("_bucket")]) for s in engines if (name := s.signal(signal, "_bucket"))]
    return _percentiles(_merge(s.buckets(name, since) for s, name in found))


def _tokens(s: Scraped, since: float) -> tuple[float, float, float | None]:
    """(output, prompt tokens, prefix hit rate) of an engine over the window, in its own
    vocabulary (0 tokens where it publishes no counter, the rate None)."""
    out = s.signal_increase("generation_tokens", since) or 0.0
    prompt = s.signal_increase("prompt_tokens", since) or 0.0
    hits = s.signal_increase("prefix_hits", since)
    queries = s.signal_increase("prefix_queries", since)
    if s.names().prompt_excludes_cached and hits is not None:
        prompt += hits
        queries = prompt
    rate = _ratio(hits, queries) if hits is not None and queries is not None else None
    return out, prompt, rate


@dataclass(slots=True)
class _Window:
    """What every section of one view shares: the window and each node's and model's
    tokens in it (summed from the engines)."""

    since: float
    span: float  # what the rings hold of the window
    node_tokens: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    model_tokens: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )

    def per_s(self, x: float) -> float | None:
        return x / self.span if self.span > 0 else None


def summarize(
    fleet: Fleet, scraped: Mapping[str, Scraped], now: float, window_s: float
) -> FleetView:
    """The whole fleet view (None where there is no figure)."""
    since = now - window_s
    w = _Window(since, _covered(scraped.values(), since))
    by_kind: dict[str, list[Scraped]] = defaultdict(list)
    for s in scraped.values():
        by_kind[s.target.kind].append(s)
    speeds = _learned_speeds(by_kind["router"])
    replicas = [_replica(s, w, speeds) for s in by_kind["engine"]]
    agents = {s.target.node: s for s in by_kind["agent"] if s.target.node}
    names = sorted(set(fleet.nodes) | set(agents) | {r.node for r in replicas if r.node})
    joules: dict[str, float] = {}  # by node, where measured
    nodes = [_node(node, fleet, agents.get(node), w, joules) for node in names]
    models = [
        _model(model, fleet, replicas, w, joules)
        for model in sorted(set(w.model_tokens) | set(fleet.replicas))
    ]
    targets = tuple(_target(s, now) for s in sorted(scraped.values(), key=lambda s: s.target.id))
    return FleetView(
        time=now,
        window_s=window_s,
        covered_s=w.span,
        totals=_totals(by_kind, replicas, nodes, w, joules),
        nodes=tuple(nodes),
        models=tuple(models),
        replicas=tuple(replicas),
        kvcached=tuple(_store(s, w) for s in by_kind["kvcached"]),
        targets=targets,
        tenants=_tenants(by_kind["router"], w),
    )


TOP_TENANTS = 10  # the dashboard's and the view's busiest tenants


def _tenants(routers: list[Scraped], w: _Window) -> tuple[TenantView, ...]:
    """The busiest tenants over every router's workers, in tokens over the window."""
    tokens: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in routers:
        for labels, ring in s.series("cgn_router_tenant_tokens_total"):
            kind = labels.get("kind", "")
            tokens[labels.get("tenant", "")][kind] += increase(ring.points(w.since)[1])
    rows = [
        TenantView(
            tenant=tenant,
            tokens_per_s=w.per_s(t["prompt"] + t["completion"]),
            prompt_tokens_per_s=w.per_s(t["prompt"]),
            hit_rate=_ratio(t["cached"], t["prompt"]) if t["prompt"] else None,
        )
        for tenant, t in tokens.items()
        if tenant
    ]
    rows.sort(key=lambda r: -(r.tokens_per_s or 0.0))
    return tuple(rows[:TOP_TENANTS])


def _learned_speeds(routers: list[Scraped]) -> dict[str, tuple[float, float]]:
    """Router endpoint id (`<model>/<node>.<replica>`) -> (prefill, decode) ms per token,
    where a router has learned them from the endpoint's answers (the first that has)."""
    out: dict[str, tuple[float, float]] = {}
    for s in routers:
        for labels, ring in s.series("cgn_router_endpoint_speed_learned"):
            eid, last = labels.get("endpoint", ""), ring.last()
            if not eid or eid in out or last is None or last[1] != 1.0:
                continue
            prefill = s.gauge("cgn_router_endpoint_prefill_seconds_per_token", endpoint=eid)
            decode = s.gauge("cgn_router_endpoint_decode_seconds_per_token", endpoint=eid)
            if prefill is not None and decode is not None:
                out[eid] = (prefill * 1e3, decode * 1e3)
    return out


def _replica(s: Scraped, w: _Window, speeds: Mapping[str, tuple[float, float]]) -> ReplicaView:
    """An engine's row; its tokens counted to its node and model."""
    t = s.target
    if not t.model:  # listed by hand: the engine's metrics name its model
        t = replace(t, model=s.label(s.signal("running") or "", "model_name"))
    out_tokens, prompt_tokens, hit_rate = _tokens(s, w.since)
    node, model = w.node_tokens[t.node], w.model_tokens[t.model]
    node["output"] += out_tokens
    node["total"] += out_tokens + prompt_tokens
    model["output"] += out_tokens
    model["total"] += out_tokens + prompt_tokens
    model[f"node:{t.node}"] += out_tokens + prompt_tokens
    # NOTE: the routers name an agent's endpoint <model>/<node>.<replica>, its replica here
    speed = speeds.get(f"{t.model}/{t.replica}", (None, None))
    return ReplicaView(
        model=t.model,
        replica=t.replica,
        node=t.node,
        url=t.url,
        state=s.state,
        error=s.error,
        running=s.signal_gauge("running"),
        waiting=s.signal_gauge("waiting"),
        kv_usage=s.signal_gauge("kv_usage"),
        prefix_hit_rate=hit_rate,
        tokens_per_s=w.per_s(out_tokens) if s.signal("generation_tokens") else None,
        prefill_ms_per_token=speed[0],
        decode_ms_per_token=speed[1],
        adapters=_adapters(s),
    )


def _adapters(s: Scraped) -> tuple[str, ...]:
    """What an engine holds: its endpoint record's adapters and those its page names."""
    samples = ((name, dict(labels), value) for (name, labels), value in s.latest.items())
    held = held_adapters(samples, MAX_ADAPTERS) | set(s.target.adapters)
    return tuple(sorted(held))[:MAX_ADAPTERS]


def _node(
    node: str, fleet: Fleet, agent: Scraped | None, w: _Window, joules_by_node: dict[str, float]
) -> NodeView:
    """A machine's row: its power as its agent measured it (`joules_by_node` gets its
    joules over the window, where measured)."""
    watts = source = None
    if agent is not None and agent.state == "up":
        for labels, ring in agent.series("cgn_agent_power_watts"):
            last = ring.last()
            if last is not None:
                watts, source = (watts or 0.0) + last[1], labels.get("source", "unknown")
    joules = None
    if watts is not None and agent is not None:
        joules = agent.increase("cgn_agent_energy_joules_total", w.since)
    if joules is not None:
        joules_by_node[node] = joules
    tokens = w.node_tokens.get(node, {})
    up = agent is not None and agent.state == "up"
    return NodeView(
        node=node,
        state=fleet.nodes.get(node, "Ready" if up else "Unknown"),
        agent=agent.state if agent else "absent",
        watts=watts,
        source=source or "unavailable",
        joules=joules,
        j_per_output_token=_per(joules, tokens.get("output", 0.0)),
        j_per_token=_per(joules, tokens.get("total", 0.0)),
        tokens_per_joule=_ratio(tokens.get("output", 0.0), joules) if joules else None,
    )


def _model(
    model: str,
    fleet: Fleet,
    replicas: list[ReplicaView],
    w: _Window,
    joules_by_node: Mapping[str, float],
) -> ModelView:
    """A model's row: its nodes' joules shared by the tokens it produced there."""
    tok = w.model_tokens.get(model, {})
    joules, measured = 0.0, False
    for node, j in joules_by_node.items():
        here, all_here = tok.get(f"node:{node}", 0.0), w.node_tokens[node].get("total", 0.0)
        if here and all_here:
            joules += j * here / all_here
            measured = True
    mine = [r for r in replicas if r.model == model]
    return ModelView(
        model=model,
        replicas=fleet.replicas.get(model, len(mine)),
        ready=sum(1 for r in mine if r.state == "up"),
        desired=fleet.desired.get(model),
        tokens_per_s=w.per_s(tok.get("output", 0.0)),
        j_per_output_token=_ratio(joules, tok.get("output", 0.0)) if measured else None,
    )


def _store(s: Scraped, w: _Window) -> StoreView:
    return StoreView(
        node=s.target.node or s.target.url,
        state=s.state,
        bytes={
            lb.get("tier", "?"): last[1]
            for lb, r in s.series("cgn_kvcached_bytes")
            if (last := r.last()) is not None
        },
        hits_per_s=w.per_s(s.increase("cgn_kvcached_hits_total", w.since)),
        misses_per_s=w.per_s(s.increase("cgn_kvcached_misses_total", w.since)),
    )


def _totals(
    by_kind: Mapping[str, list[Scraped]],
    replicas: list[ReplicaView],
    nodes: list[NodeView],
    w: _Window,
    joules_by_node: Mapping[str, float],
) -> Totals:
    engines, routers = by_kind["engine"], by_kind["router"]
    out_tokens = sum(t["output"] for t in w.node_tokens.values())
    all_tokens = sum(t["total"] for t in w.node_tokens.values())
    measured_tokens = sum(w.node_tokens[n]["output"] for n in joules_by_node)
    if routers:
        requests = sum(s.increase("cgn_router_requests_total", w.since) for s in routers)
    else:
        requests = sum(s.signal_increase("requests_done", w.since) or 0.0 for s in engines)
    bands: dict[str, float] = defaultdict(float)
    rejected: dict[str, float] = defaultdict(float)
    for s in routers:
        for labels, ring in s.series("cgn_router_queue_depth"):
            last = ring.last()
            bands[labels.get("band", "")] += last[1] if last else 0.0
        for labels, ring in s.series("cgn_router_admission_rejections_total"):
            rejected[labels.get("band", "")] += increase(ring.points(w.since)[1])
    node_watts = [n.watts for n in nodes if n.watts is not None]
    fleet_joules = sum(joules_by_node.values())
    return Totals(
        requests_per_s=w.per_s(requests),
        tokens_per_s=w.per_s(out_tokens),
        prompt_tokens_per_s=w.per_s(all_tokens - out_tokens),
        ttft_s=_latency(engines, "ttft", w.since),
        itl_s=_latency(engines, "itl", w.since),
        waiting=sum(r.waiting or 0 for r in replicas),
        running=sum(r.running or 0 for r in replicas),
        queue_by_band=dict(bands),
        rejected_per_s_by_band={band: w.per_s(n) for band, n in rejected.items()},
        watts=sum(node_watts) if node_watts else None,
        power_nodes=len(node_watts),
        j_per_output_token=_ratio(fleet_joules, measured_tokens) if joules_by_node else None,
        energy_source="+".join(sorted({n.source for n in nodes if n.watts is not None}))
        or "unavailable",
    )


def _target(s: Scraped, now: float) -> TargetView:
    return TargetView(
        id=s.target.id,
        kind=s.target.kind,
        url=s.target.url,
        node=s.target.node,
        model=s.target.model,
        state=s.state,
        error=s.error,
        age_s=None if not s.last_ok else round(now - s.last_ok, 1),
        scrape_ms=round(1e3 * s.duration_s, 1),
    )


def history_points(view: FleetView) -> dict[str, float]:
    """The scalars of a view that are kept as history (name -> value; None left out)."""
    t = view.totals
    points: dict[str, float | None] = {
        "fleet:requests_per_s": t.requests_per_s,
        "fleet:tokens_per_s": t.tokens_per_s,
        "fleet:waiting": t.waiting,
        "fleet:watts": t.watts,
        "fleet:j_per_output_token": t.j_per_output_token,
    }
    for name, quantiles in (("ttft_s", t.ttft_s), ("itl_s", t.itl_s)):
        for q, v in quantiles.items():
            points[f"fleet:{name}:{q}"] = v
    for n in view.nodes:
        points[f"node:{n.node}:watts"] = n.watts
        points[f"node:{n.node}:j_per_output_token"] = n.j_per_output_token
    for m in view.models:
        points[f"model:{m.model}:tokens_per_s"] = m.tokens_per_s
    return {k: float(v) for k, v in points.items() if v is not None and math.isfinite(v)}
