"""What cgn-metrics scrapes: the fleet read from etcd, plus a static list.

From etcd (every record validated; a bad one is logged once and skipped):
* agents: `/cognitora/nodes/<node>`'s `admin_url` (its /metrics: power, energy);
* engines: `/cognitora/endpoints/<node>/<model>/<replica>`'s `url` (vLLM-named /metrics);
* kvcached: `/cognitora/kv/<node>`'s `events_url`, whose origin serves /metrics;
* node states: Ready (a live inventory), Cordoned / Draining (`/cognitora/cordon/`),
  Lost (named by a placement or an endpoint, no live inventory).

Routers do not register in etcd: list them in `targets` as `router=http://HOST:9090`
(any target is `KIND[@NODE]=URL` or a bare URL, kind `other`; NODE ties an engine and an
agent listed by hand to one node for energy per token). A target's URL is its base;
/metrics is appended.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cgn_core import keys, records
from cgn_core.records import RecordError, RecordLog

log = logging.getLogger(__name__)
KINDS = ("router", "agent", "engine", "kvcached", "other")


@dataclass(frozen=True, slots=True)
class Target:
    kind: str  # router | agent | engine | kvcached | other
    url: str  # the base URL; scraped at url + "/metrics"
    node: str = ""
    model: str = ""
    replica: str = ""
    engine: str = ""  # the endpoint record's engine family: which metric names it speaks
    # the engine's per-replica secret from its endpoint record, sent as a bearer token (an
    # engine the agent starts with one may guard /metrics too: llama.cpp does); never shown
    token: str = field(default="", repr=False, compare=False)
    adapters: tuple[str, ...] = ()  # the LoRA adapters its endpoint record says it loaded

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.replica or self.url}"


@dataclass(frozen=True, slots=True)
class Fleet:
    targets: tuple[Target, ...]
    nodes: Mapping[str, str]  # node -> Ready | Cordoned | Draining | Lost
    replicas: Mapping[str, int]  # model -> Ready endpoints
    desired: Mapping[str, int] = field(default_factory=dict)  # model -> the autoscaler's target


def base_url(url: str) -> str:
    """scheme://host:port of `url`, refusing anything but http(s) with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RecordError(f"not an http(s) URL: {url[:80]!r}")
    return f"{parts.scheme}://{parts.netloc}"


def static_targets(entries: Iterable[str]) -> list[Target]:
    """`KIND[@NODE]=URL` or `URL` entries from the settings; ValueError says what is wrong."""
    out = []
    for entry in entries:
        head, sep, url = entry.partition("=")
        if not sep or "://" in head:
            head, url = "other", entry
        kind, _, node = head.partition("@")
        if kind not in KINDS:
            raise ValueError(f"target {entry!r}: kind must be one of {', '.join(KINDS)}")
        try:
            out.append(Target(kind, base_url(url.rstrip("/")), node=node))
        except RecordError as exc:
            raise ValueError(f"target {entry!r}: {exc}") from None
    return out


def fleet_from_records(
    nodes: Mapping[str, bytes],
    endpoints: Mapping[str, bytes],
    kvcached: Mapping[str, bytes],
    cordons: Mapping[str, bytes],
    placed_nodes: Iterable[str],
    rec: RecordLog,
    revision: int = 0,
    scaling: Mapping[str, bytes] | None = None,
) -> Fleet:
    """Targets, node states and ready replicas from etcd's raw values, keyed by their full
    keys; every value is parsed and checked here."""
    targets: list[Target] = []
    live: set[str] = set()
    for key, raw in nodes.items():
        node = key.removeprefix(keys.NODES)
        admin = rec.parse(key, revision, raw, _agent)
        if admin is None:
            continue
        live.add(node)
        if admin:
            targets.append(Target("agent", admin, node=node))
    engines = _engines(endpoints, rec, revision)
    targets += engines
    replicas = Counter(t.model for t in engines)
    named = set(placed_nodes) | {t.node for t in engines}
    for key, raw in kvcached.items():
        node = key.removeprefix(keys.KVCACHED)
        doc = rec.parse(key, revision, raw, _kvcached)
        if doc is not None:
            targets.append(Target("kvcached", doc["url"], node=node))
    states = {n: "Lost" for n in named if n}
    states.update(dict.fromkeys(live, "Ready"))
    for key, raw in cordons.items():
        node = key.removeprefix(keys.CORDON)
        cordon = rec.parse(key, revision, raw, records.cordon)
        if cordon is not None and node in states and states[node] != "Lost":
            states[node] = "Draining" if cordon.drain else "Cordoned"
    desired: dict[str, int] = {}
    for key, raw in (scaling or {}).items():  # one per pool: a model's pools add up
        target = rec.parse(key, revision, raw, records.scaling)
        if target is not None:
            desired[target.model] = desired.get(target.model, 0) + target.desired
    return Fleet(tuple(targets), states, dict(replicas), desired)


def _engines(endpoints: Mapping[str, bytes], rec: RecordLog, revision: int) -> list[Target]:
    """The engines the endpoint records name: <node>/<model>/<replica> (written by agents)
    or <model>/<replica> (registered by hand, the node in the record)."""
    out = []
    for key, raw in endpoints.items():
        parts = key.removeprefix(keys.ENDPOINTS).split("/")
        if len(parts) not in (2, 3) or not all(parts):
            continue
        node, model, replica = parts if len(parts) == 3 else ("", *parts)
        doc = rec.parse(key, revision, raw, _endpoint)
        if doc is None:
            continue
        node = node or doc["node"]
        out.append(
            Target(
                "engine",
                doc["url"],
                node=node,
                model=model,
                replica=f"{node}.{replica}" if node else replica,
                token=doc["token"],
                engine=doc["engine"],
                adapters=doc["adapters"],
            )
        )
    return out


def _agent(doc: Any) -> str:
    """A node's agent admin URL ("": none) from its inventory, checked as every reader does."""
    url = records.node_inventory(doc).admin_url
    return base_url(url) if url else ""


def _endpoint(doc: Any) -> dict[str, Any]:
    d = records.obj(doc, "endpoint")
    return {
        "url": base_url(records.text(d, "url", required=True)),
        "node": records.text(d, "node"),
        "model": records.text(d, "model"),
        "token": records.text(d, "api_token"),
        "engine": records.text(d, "engine"),
        "adapters": records.strings(d, "adapters", keys.MAX_ADAPTERS, keys.NAME),  # at start
    }


def _kvcached(doc: Any) -> dict[str, Any]:
    return {"url": base_url(records.kvcached(doc).events_url)}


def file_sd(targets: Iterable[Target]) -> str:
    """Prometheus file_sd JSON for `targets` (one group per target, its labels attached)."""
    groups = []
    for t in sorted(targets, key=lambda t: t.id):
        parts = urlsplit(t.url)
        labels = {"cgn_kind": t.kind, "__scheme__": parts.scheme}
        labels.update(
            {k: v for k, v in (("node", t.node), ("model", t.model), ("replica", t.replica)) if v}
        )
        groups.append({"targets": [parts.netloc], "labels": labels})
    return json.dumps(groups, indent=1) + "\n"
