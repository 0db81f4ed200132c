"""Untrusted etcd records, checked once: one validating function per kind of record.

Every value read from etcd was written by some process on some node, and
any node can write; so no reader trusts one. Each function here takes the
decoded JSON of one kind of record and returns it with every field its
readers use checked and normalised (types, ranges), or raises `RecordError`
(a `ValueError`) saying which field is wrong. Fields no reader uses pass
through untouched. `RecordLog` remembers which bad records it has reported,
so a bad value is logged once per revision, not on every pass.

Kinds (the layout is in docs/architecture.md): replica status
(`/cognitora/replicas/<node>/<replica>`), placement
(`/cognitora/placements/<node>/<replica>`), node inventory
(`/cognitora/nodes/<node>`), cordon (`/cognitora/cordon/<node>`), node efficiency
(`/cognitora/efficiency/<node>`, written by cgn-metrics). The
catalog, endpoints and API keys have their own parsers beside the types
they build (`cgn_control.catalog.parse_model`, `cgn_router.registry.
endpoint_from_etcd`, `cgn_core.apikeys.parse_record`); they raise
ValueError subclasses too.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from cgn_core.errors import CognitoraError
from cgn_core.net import is_host_port

log = logging.getLogger(__name__)

PHASES = frozenset({"Starting", "Loading", "Ready", "Draining", "Failed", "Stopped"})
MAX_TEXT = 64 << 10  # a log tail or a reason longer than this is cut, not refused


class RecordError(ValueError):
    """A record that does not have the shape its kind requires."""


def obj(doc: Any, what: str = "record") -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def text(doc: Mapping[str, Any], name: str, default: str = "", *, required: bool = False) -> str:
    value = doc.get(name)
    if value is None:
        if required:
            raise RecordError(f"'{name}' is required")
        return default
    if not isinstance(value, str):
        raise RecordError(f"'{name}' must be a string, got {type(value).__name__}")
    return value[:MAX_TEXT]


def number(
    doc: Mapping[str, Any], name: str, default: float | None, lo: float = -math.inf
) -> float | None:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError(f"'{name}' must be a finite number, got {value!r:.40}")
    if value < lo:
        raise RecordError(f"'{name}' must be at least {lo}, got {value}")
    return float(value)


def integer(doc: Mapping[str, Any], name: str, default: int, lo: int = 0) -> int:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise RecordError(f"'{name}' must be an integer >= {lo}, got {value!r:.40}")
    return value


def flag(doc: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RecordError(f"'{name}' must be true or false, got {value!r:.40}")
    return value


def strings(doc: Mapping[str, Any], name: str) -> list[str]:
    value = doc.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecordError(f"'{name}' must be a list of strings")
    return value


# ---- the kinds ----------------------------------------------------------------------------


def replica_status(doc: Any) -> dict[str, Any]:
    """An agent's report on one replica: phase, reason, failures in a row, log tail."""
    d = obj(doc, "replica status")
    phase = text(d, "phase", required=True)
    if phase not in PHASES:
        raise RecordError(f"'phase' must be one of {', '.join(sorted(PHASES))}, got {phase!r:.40}")
    return {**d, "phase": phase, "reason": text(d, "reason"), "failures": integer(d, "failures", 0),
            "log_tail": strings(d, "log_tail")}  # fmt: skip


def placement(doc: Any) -> dict[str, Any]:
    """The reconciler's (or an operator's) decision to run a replica on a node."""
    d = obj(doc, "placement")
    devices = d.get("devices", [])
    if not isinstance(devices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 4096 for i in devices
    ):
        raise RecordError("'devices' must be a list of device indices (0-4095)")
    if "profile" in d and not isinstance(d["profile"], dict):
        raise RecordError("'profile' must be an object")
    return {**d, "model": text(d, "model", required=True), "owner": text(d, "owner"),
            "devices": devices}  # fmt: skip


def pipeline_part(doc: Mapping[str, Any]) -> tuple[int, int]:
    """(part, parts) of a placement or replica status: a part of a multi-node replica (a
    layer pipeline; part 0 is the head), or (0, 1) for a single-node one or a malformed
    field."""
    p = doc.get("pipeline")
    if isinstance(p, Mapping):
        part, parts = p.get("part"), p.get("parts")
        if isinstance(part, int) and isinstance(parts, int) and 0 <= part < parts:
            return part, parts
    return 0, 1


def cordon(doc: Any) -> dict[str, Any]:
    """A cordon: whether the node drains, since when (wall clock) and for how long at most."""
    d = obj(doc, "cordon")
    out: dict[str, Any] = {**d, "drain": flag(d, "drain")}
    for name in ("since_unix", "grace_s"):
        value = number(d, name, None, lo=0.0)
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def kvcached(doc: Any) -> dict[str, Any]:
    """A node's cgn-kvcached: its gRPC address and its KV event stream (http(s) URL)."""
    d = obj(doc, "kvcached")
    address = text(d, "address", required=True)
    if not is_host_port(address):
        raise RecordError(f"'address' must be host:port, got {address!r}")
    url = text(d, "events_url", required=True)
    if not url.startswith(("http://", "https://")):
        raise RecordError(f"'events_url' must be an http(s) URL, got {url!r}")
    return {"address": address, "events_url": url, "events_token": text(d, "events_token")}


def node_inventory(doc: Any) -> dict[str, Any]:
    """A node's inventory as its agent published it (only what placement reads is checked)."""
    d = obj(doc, "node")
    accelerators = d.get("accelerators", [])
    if not isinstance(accelerators, list):
        raise RecordError("'accelerators' must be a list")
    checked = []
    for i, a in enumerate(accelerators):
        a = obj(a, f"accelerators[{i}]")
        index = integer(a, "index", -1)
        if index < 0:
            raise RecordError(f"accelerators[{i}].index is required")
        checked.append({**a, "index": index, "accel_class": text(a, "accel_class", required=True),
                        "health": strings(a, "health")})  # fmt: skip
    labels = d.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise RecordError("'labels' must be an object of strings")
    power = obj(d.get("power") or {}, "power")
    return {**d, "accelerators": checked, "engines": strings(d, "engines"), "labels": labels,
            "power": {**power, "watts": number(power, "watts", None, lo=0.0)}}  # fmt: skip


EFFICIENCY_MAX_AGE_S = 600.0  # an efficiency figure older than this is not used


def efficiency(doc: Any) -> dict[str, Any]:
    """A node's measured efficiency (cgn-metrics): output tokens per joule over a window,
    its power source, and when it was measured (wall clock)."""
    d = obj(doc, "efficiency")
    tpj = number(d, "tokens_per_joule", None, lo=0.0)
    if tpj is None or tpj <= 0 or not math.isfinite(tpj):
        raise RecordError("'tokens_per_joule' must be a positive number")
    at = number(d, "at_unix", None, lo=0.0)
    if at is None:
        raise RecordError("'at_unix' is required")
    return {"tokens_per_joule": tpj, "at_unix": at, "source": text(d, "source", "unknown"),
            "window_s": number(d, "window_s", 0.0, lo=0.0)}  # fmt: skip


def fresh_efficiency(doc: Mapping[str, Any] | None, now_unix: float) -> float | None:
    """A validated efficiency record's tokens per joule, or None when absent or stale."""
    if doc is None or now_unix - float(doc["at_unix"]) > EFFICIENCY_MAX_AGE_S:
        return None
    return float(doc["tokens_per_joule"])


class RecordLog:
    """Parses records and reports each bad one once per (key, revision), then skips it."""

    def __init__(
        self, logger: logging.Logger = log, on_bad: Callable[[str], None] | None = None
    ) -> None:
        self.logger = logger
        self.on_bad = on_bad  # told each bad (key, revision) once, e.g. to count it
        self._reported: dict[str, int] = {}

    def parse(self, key: str, revision: int, raw: bytes, parse: Callable[[Any], Any]) -> Any | None:
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
