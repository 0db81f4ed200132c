"""Untrusted etcd records, checked once: one parser per kind, each returning a frozen value.

Every value read from etcd was written by some process on some node, and any node can
write; so no reader trusts one. Each parser here takes the decoded JSON of one kind of
record and returns a frozen dataclass holding every field its readers use, checked and
normalised (types, ranges), or raises `RecordError` (a `ValueError`) naming the field.
Readers use the value's attributes, never the document's keys, so a misspelt field is a
type error, not a silent None. Numbers go through one bounded reader: a value out of its
field's range, including a 400-digit integer or a NaN, is refused like any wrong type.
`RecordLog` remembers which bad records it has reported, so a bad value is logged once per
revision, not on every pass.

Kinds (the layout is in docs/architecture.md): replica status
(`/cognitora/replicas/<node>/<replica>`), placement (`/cognitora/placements/<node>/<replica>`),
node inventory (`/cognitora/nodes/<node>`), cordon (`/cognitora/cordon/<node>`), a node's
KV store (`/cognitora/kvcached/<node>`), node efficiency (`/cognitora/efficiency/<node>`,
written by cgn-metrics), a pool's autoscaler decision (`/cognitora/scaling/<model>[/<role>]`,
written by the leading router). The catalog, endpoints and API keys have their own parsers beside
the types they build (`cgn_control.decide.catalog.parse_model`, `cgn_router.registry.
endpoint_from_etcd`, `cgn_core.apikeys.parse_record`), on the readers below.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast, get_args

from cgn_core import keys, multinode
from cgn_core.errors import CognitoraError
from cgn_core.multinode import SINGLE, Part
from cgn_core.net import is_host_port, is_ip

log = logging.getLogger(__name__)

Phase = Literal["Starting", "Loading", "Ready", "Draining", "Failed", "Stopped"]
PHASES = frozenset(get_args(Phase))
MAX_TEXT = 64 << 10  # a log tail or a reason longer than this is cut, not refused
MAX_INT = 2**53  # the largest integer any field takes: exact in a float, JSON-safe
MAX_DEVICE = 4095  # accelerator indices per node
T = TypeVar("T")


class RecordError(ValueError):
    """A record that does not have the shape its kind requires."""


# ---- the bounded readers (every parser of untrusted JSON uses these) ----------------------


def obj(doc: Any, what: str = "record") -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def text(
    doc: Mapping[str, Any], name: str, default: str = "", *, required: bool = False,
    one_of: frozenset[str] = frozenset(),
) -> str:  # fmt: skip
    """`doc[name]`, a string (cut at MAX_TEXT); with `one_of`, one of those."""
    value = doc.get(name)
    if value is None:
        if required:
            raise RecordError(f"'{name}' is required")
        return default
    if not isinstance(value, str):
        raise RecordError(f"'{name}' must be a string, got {type(value).__name__}")
    if one_of and value not in one_of:
        raise RecordError(f"'{name}' must be one of {', '.join(sorted(one_of))}, got {value!r:.40}")
    return value[:MAX_TEXT]


def number(
    doc: Mapping[str, Any],
    name: str,
    default: float | None,
    lo: float = -float(MAX_INT),
    hi: float = float(MAX_INT),
) -> float | None:
    """A finite number in [lo, hi] (default: ±2^53); absent or null: `default`."""
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(f"'{name}' must be a number, got {type(value).__name__}")
    # NOTE: compare before converting: float() of a 400-digit integer raises OverflowError
    if not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
        raise RecordError(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {value!r:.40}")
    return float(value)


def integer(doc: Mapping[str, Any], name: str, default: int, lo: int = 0, hi: int = MAX_INT) -> int:
    """An integer in [lo, hi] (default: 0 to 2^53); absent or null: `default`."""
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RecordError(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def flag(doc: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RecordError(f"'{name}' must be true or false, got {value!r:.40}")
    return value


def strings(
    doc: Mapping[str, Any], name: str, most: int = MAX_INT, form: re.Pattern[str] | None = None
) -> tuple[str, ...]:
    """A list of strings (each cut at MAX_TEXT); with `most` and `form`, at most that many,
    each matching `form` whole."""
    value = doc.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecordError(f"'{name}' must be a list of strings")
    if len(value) > most or (form is not None and not all(form.match(v) for v in value)):
        raise RecordError(f"'{name}' must list at most {most} names")
    return tuple(v[:MAX_TEXT] for v in value)


# ---- the kinds ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """An agent's report on one replica: phase, reason, failures in a row, log tail."""

    phase: Phase
    model: str = ""  # "" where the agent refused the placement before knowing it
    reason: str = ""
    failures: int = 0
    restarts: int = 0
    url: str = ""
    log_tail: tuple[str, ...] = ()
    part: Part = SINGLE
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds now, as the agent last saw

    @property
    def ready(self) -> bool:
        return self.phase == "Ready"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "phase": self.phase,
            "model": self.model,
            "reason": self.reason,
            "failures": self.failures,
            "restarts": self.restarts,
            "url": self.url,
            "log_tail": list(self.log_tail),
        }
        if self.part.multi:
            doc["pipeline"] = self.part.to_json()
        if self.adapters:
            doc["adapters"] = list(self.adapters)
        return doc


def replica_status(doc: Any) -> ReplicaStatus:
    d = obj(doc, "replica status")
    return ReplicaStatus(
        cast(Phase, text(d, "phase", required=True, one_of=PHASES)),
        model=text(d, "model"),
        reason=text(d, "reason"),
        failures=integer(d, "failures", 0),
        restarts=integer(d, "restarts", 0),
        url=text(d, "url"),
        log_tail=strings(d, "log_tail"),
        part=multinode.part_of(d),
        adapters=strings(d, "adapters", keys.MAX_ADAPTERS, keys.NAME),
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """The reconciler's (or an operator's) decision to run a replica on a node: what the
    agent there launches (`cgn_agent.spec` checks the engine-specific rest when it does)."""

    model: str
    engine: str = ""
    source: str = ""
    role: str = "both"
    devices: tuple[int, ...] = ()
    owner: str = ""  # "reconciler" for the placements it manages; "": written by hand
    profile: Mapping[str, Any] = field(default_factory=dict)  # engine settings, as written
    part: Part = SINGLE

    def to_json(self) -> dict[str, Any]:
        """The placement document (docs/architecture.md), as agents read it."""
        doc: dict[str, Any] = {
            "model": self.model,
            "engine": self.engine,
            "source": self.source,
            "devices": list(self.devices),
            "role": self.role,
            "profile": dict(self.profile),
            "owner": self.owner,
        }
        if self.part.multi:
            doc["pipeline"] = self.part.to_json()
        return doc


def placement(doc: Any) -> Placement:
    d = obj(doc, "placement")
    devices = d.get("devices", [])
    if not isinstance(devices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_DEVICE for i in devices
    ):
        raise RecordError(f"'devices' must be a list of device indices (0-{MAX_DEVICE})")
    profile = d.get("profile", {})
    if not isinstance(profile, dict):
        raise RecordError("'profile' must be an object")
    if not _finite(profile):  # NaN is not even equal to itself: no engine setting is one
        raise RecordError("'profile' holds a number that is not finite (NaN or infinity)")
    return Placement(
        model=text(d, "model", required=True),
        engine=text(d, "engine"),
        source=text(d, "source"),
        role=text(d, "role") or "both",
        devices=tuple(devices),
        owner=text(d, "owner"),
        profile=profile,
        part=multinode.part_of(d),
    )


def _finite(value: Any) -> bool:
    """Whether every number in a parsed JSON value is finite (its depth is bounded by the
    parser that made it: cgn_core/safejson.py, json's own recursion limit)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


@dataclass(frozen=True, slots=True)
class Cordon:
    """No new placements on the node; with `drain`, its replicas move away (at most
    `grace_s` after `since_unix`, wall clock, when set)."""

    drain: bool = False
    since_unix: float | None = None
    grace_s: float | None = None
    by: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"drain": self.drain, "by": self.by, "reason": self.reason}
        if self.since_unix is not None:
            doc["since_unix"] = self.since_unix
        if self.grace_s is not None:
            doc["grace_s"] = self.grace_s
        return doc


def cordon(doc: Any) -> Cordon:
    d = obj(doc, "cordon")
    return Cordon(
        drain=flag(d, "drain"),
        since_unix=number(d, "since_unix", None, lo=0.0),
        grace_s=number(d, "grace_s", None, lo=0.0, hi=365 * 86400.0),
        by=text(d, "by"),
        reason=text(d, "reason"),
    )


@dataclass(frozen=True, slots=True)
class KvStore:
    """A node's cgn-kvcached: its gRPC address and its KV event stream (http(s) URL)."""

    address: str
    events_url: str
    events_token: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "events_url": self.events_url,
            "events_token": self.events_token,
        }


def kvcached(doc: Any) -> KvStore:
    d = obj(doc, "kvcached")
    address = text(d, "address", required=True)
    if not is_host_port(address):
        raise RecordError(f"'address' must be host:port, got {address!r}")
    url = text(d, "events_url", required=True)
    if not url.startswith(("http://", "https://")):
        raise RecordError(f"'events_url' must be an http(s) URL, got {url!r}")
    return KvStore(address, url, text(d, "events_token"))


@dataclass(frozen=True, slots=True)
class Accelerator:
    index: int
    accel_class: str
    health: tuple[str, ...] = ()  # what is wrong with it; () when healthy
    compute_capability: str = ""  # "9.0"; "" when its agent could not read it


@dataclass(frozen=True, slots=True)
class Network:
    """Where a node's multi-node ranks talk: its advertised address, the interface holding it
    (the management network), and the RDMA ports NCCL may use (cgn_core/multinode.py)."""

    address: str = ""
    iface: str = ""
    fabric_adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """A node as its agent published it: what placement, cgn-ctl and cgn-metrics read."""

    accelerators: tuple[Accelerator, ...] = ()
    engines: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    watts: float | None = None  # None: no power source
    node_class: str = "?"
    admin_url: str = ""
    cpu: Mapping[str, Any] = field(default_factory=dict)  # shown by `cgn-ctl nodes`, as written
    network: Network = Network()

    def to_json(self) -> dict[str, Any]:
        accelerators = [
            {
                "index": a.index,
                "accel_class": a.accel_class,
                "health": list(a.health),
                "compute_capability": a.compute_capability,
            }
            for a in self.accelerators
        ]
        links = [
            {"device": d, "port": int(p), "state": "ACTIVE", "link_layer": "InfiniBand"}
            for d, _, p in (a.rpartition(":") for a in self.network.fabric_adapters)
        ]
        return {
            "address": self.network.address,
            "iface": self.network.iface,
            "network": links,
            "accelerators": accelerators,
            "engines": list(self.engines),
            "labels": dict(self.labels),
            "power": {"watts": self.watts},
            "node_class": self.node_class,
            "admin_url": self.admin_url,
            "cpu": dict(self.cpu),
        }


def node_inventory(doc: Any) -> NodeInventory:
    d = obj(doc, "node")
    raw = d.get("accelerators", [])
    if not isinstance(raw, list):
        raise RecordError("'accelerators' must be a list")
    accelerators = []
    for i, a in enumerate(raw):
        a = obj(a, f"accelerators[{i}]")
        index = integer(a, "index", -1, lo=-1, hi=MAX_DEVICE)
        if index < 0:
            raise RecordError(f"accelerators[{i}].index is required")
        accel_class = text(a, "accel_class", required=True)
        cap = text(a, "compute_capability")
        cap = cap if multinode.capability(cap) else ""
        accelerators.append(Accelerator(index, accel_class, strings(a, "health"), cap))
    labels = d.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise RecordError("'labels' must be an object of strings")
    power = obj(d.get("power") or {}, "power")
    cpu = d.get("cpu") or {}
    return NodeInventory(
        accelerators=tuple(accelerators),
        engines=strings(d, "engines"),
        labels=labels,
        watts=number(power, "watts", None, lo=0.0, hi=1e7),
        node_class=text(d, "node_class", "?"),
        admin_url=text(d, "admin_url"),
        cpu=cpu if isinstance(cpu, dict) else {},
        network=_network(d),
    )


_IFACE = re.compile(r"^[A-Za-z0-9._@:-]{1,15}$")  # Linux: IFNAMSIZ - 1
_RDMA = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _network(d: Mapping[str, Any]) -> Network:
    """The node's address, management interface and fabric ports; each part that is not
    well formed reads as unknown (an agent before these fields wrote none of them)."""
    address = text(d, "address")
    iface = text(d, "iface")
    raw = d.get("network")
    links = []
    for link in raw[:64] if isinstance(raw, list) else []:
        if not isinstance(link, dict):
            continue
        device, port = link.get("device"), link.get("port")
        if not (isinstance(device, str) and _RDMA.match(device)):
            continue
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 256):
            continue
        state, layer = link.get("state"), link.get("link_layer")
        links.append(multinode.Link(device, port, str(state), str(layer)))
    return Network(
        address if is_ip(address) else "",
        iface if _IFACE.match(iface) else "",
        multinode.fabric_adapters(links),
    )


EFFICIENCY_MAX_AGE_S = 600.0  # an efficiency figure older than this is not used


@dataclass(frozen=True, slots=True)
class Efficiency:
    """A node's measured efficiency (cgn-metrics): output tokens per joule over a window,
    its power source, and when it was measured (wall clock)."""

    tokens_per_joule: float
    at_unix: float
    source: str = "unknown"
    window_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_joule": self.tokens_per_joule,
            "at_unix": self.at_unix,
            "source": self.source,
            "window_s": self.window_s,
        }

    def fresh(self, now_unix: float) -> float | None:
        """Its tokens per joule, or None once older than EFFICIENCY_MAX_AGE_S."""
        return None if now_unix - self.at_unix > EFFICIENCY_MAX_AGE_S else self.tokens_per_joule


def efficiency(doc: Any) -> Efficiency:
    d = obj(doc, "efficiency")
    tpj = number(d, "tokens_per_joule", None, lo=0.0, hi=1e9)
    if tpj is None or tpj <= 0:
        raise RecordError("'tokens_per_joule' must be a positive number")
    at = number(d, "at_unix", None, lo=0.0)
    if at is None:
        raise RecordError("'at_unix' is required")
    return Efficiency(
        tpj, at, text(d, "source", "unknown"), number(d, "window_s", 0.0, lo=0.0, hi=1e7) or 0.0
    )


def fresh_efficiency(record: Efficiency | None, now_unix: float) -> float | None:
    """A node's tokens per joule where its record is present and fresh, else None."""
    return None if record is None else record.fresh(now_unix)


SCALING_HISTORY = 20  # decisions a record keeps (the leader writes at most this many)


@dataclass(frozen=True, slots=True)
class Scaling:
    """The autoscaler's last decision for one pool (`/cognitora/scaling/<model>` or
    `<model>/<role>`), as the leading router wrote it, with its recent changes."""

    model: str
    role: str  # "" for an aggregated model's one pool
    desired: int
    current: int
    direction: str  # up | down | hold
    reason: str
    demand: float
    capacity: float | None  # per replica
    at_unix: float
    history: tuple[Scaling, ...] = ()
    unit: str = "requests"  # of demand and capacity: requests | tokens/s

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "role": self.role,
            "desired": self.desired,
            "current": self.current,
            "direction": self.direction,
            "reason": self.reason,
            "demand": self.demand,
            "capacity": self.capacity,
            "unit": self.unit,
            "at_unix": self.at_unix,
            "history": [h.to_json() for h in self.history],
        }


def scaling(doc: Any, nested: bool = False) -> Scaling:
    d = obj(doc, "scaling")
    history: tuple[Scaling, ...] = ()
    if not nested:  # one level: a history entry carries none of its own
        raw = d.get("history") or []
        if not isinstance(raw, list):
            raise RecordError("'history' must be a list")
        history = tuple(scaling(h, nested=True) for h in raw[-SCALING_HISTORY:])
    return Scaling(
        model=text(d, "model", required=not nested),
        role=text(d, "role"),
        desired=integer(d, "desired", 0, 0, 1 << 20),
        current=integer(d, "current", 0, 0, 1 << 20),
        direction=text(d, "direction", "hold", one_of=frozenset({"up", "down", "hold"})),
        reason=text(d, "reason"),
        demand=number(d, "demand", 0.0, lo=0.0) or 0.0,
        capacity=number(d, "capacity", None, lo=0.0),
        at_unix=number(d, "at_unix", 0.0, lo=0.0) or 0.0,
        history=history,
        unit=text(d, "unit", "requests", one_of=frozenset({"requests", "tokens/s"})),
    )


class RecordLog:
    """Parses records and reports each bad one once per (key, revision), then skips it."""

    def __init__(
        self, logger: logging.Logger = log, on_bad: Callable[[str], None] | None = None
    ) -> None:
        self.logger = logger
        self.on_bad = on_bad  # told each bad (key, revision) once, e.g. to count it
        self._reported: dict[str, int] = {}

    def parse(self, key: str, revision: int, raw: bytes, parse: Callable[[Any], T]) -> T | None:
        """`parse(json of raw)`, or None (logged once) when the value is not JSON or is bad."""
        try:
            value = parse(json.loads(raw))
        except (ValueError, RecursionError, CognitoraError) as exc:  # RecordError, bad JSON…
            if self._reported.get(key) != revision:
                self._reported[key] = revision
                why = exc.message if isinstance(exc, CognitoraError) else str(exc)
                self.logger.warning("ignoring %s: %s", key, why[:300])
                if self.on_bad is not None:
                    self.on_bad(key)
            return None
        self._reported.pop(key, None)
        return value
