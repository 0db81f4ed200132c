"""The agent's state file: one JSON record per replica it runs, for orphan adoption.

`<state_dir>/replicas/<replica>.json` holds the full replica spec, the port
and URL it was given, and the engine's process fingerprint. It is written
atomically when an engine starts and removed when the replica is forgotten.
On restart the agent reads every record: a record whose fingerprint still
matches a live process is adopted; any other record is stale and dropped.
A damaged record is set aside as `<name>.bad` (never silently deleted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cgn_agent.processes import Fingerprint, fingerprint_from_json, fingerprint_to_json
from cgn_agent.spec import ReplicaSpec, parse_placement, spec_to_json
from cgn_core.files import atomic_write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    spec: ReplicaSpec
    port: int
    url: str
    fingerprint: Fingerprint | None  # None: nothing spawned (an external engine)
    token: str = ""  # the engine's API secret (the file is 0600), so an adopted one keeps it
    rendezvous_port: int = 0  # rank 0 of a multi-node replica: where its ranks join it


class StateStore:
    def __init__(self, state_dir: Path):
        self.dir = state_dir / "replicas"

    def path(self, replica: str) -> Path:
        return self.dir / f"{replica}.json"

    def save(self, rec: ReplicaRecord) -> None:
        doc = {
            "spec": spec_to_json(rec.spec),
            "port": rec.port,
            "url": rec.url,
            "fingerprint": rec.fingerprint and fingerprint_to_json(rec.fingerprint),
            "token": rec.token,
            "rendezvous_port": rec.rendezvous_port,
        }
        atomic_write_json(self.path(rec.spec.replica), doc, mode=0o600)

    def remove(self, replica: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(replica))

    def load_all(self) -> list[ReplicaRecord]:
        records: list[ReplicaRecord] = []
        if not self.dir.is_dir():
            return records
        for path in sorted(self.dir.glob("*.json")):
            try:
                doc = json.loads(path.read_text())
                fp = doc["fingerprint"]
                records.append(
                    ReplicaRecord(
                        parse_placement(path.stem, doc["spec"]),
                        int(doc["port"]),
                        str(doc["url"]),
                        None if fp is None else fingerprint_from_json(fp),
                        str(doc.get("token") or ""),
                        int(doc.get("rendezvous_port") or 0),
                    )
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("state file %s is damaged (%s); moved aside as .bad", path, exc)
                os.replace(path, path.with_suffix(".bad"))
        return records
