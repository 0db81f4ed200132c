"""What `cgn-ctl up` started, and `down` stopping exactly that.

`Starter` starts daemons in their own sessions, each with its log under
`<state_dir>/logs/`, and records each process's fingerprint in `<state_dir>/up.json`
(with what `up` reports: URLs, the etcd, its TLS files). `down` stops exactly those
(and the engines their agents ran), newest first, and never signals a pid that now
belongs to something else.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from cgn_core.errors import CognitoraError, Unavailable
from cgn_core.files import atomic_write_json
from cgn_core.process import (
    Fingerprint,
    fingerprint,
    fingerprint_from_json,
    fingerprint_to_json,
    matches,
    stop_pid_group,
)
from cgn_core.readiness import wait_ready_file


def record_path(state_dir: Path) -> Path:
    return state_dir / "up.json"


def read_record(state_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(record_path(state_dir).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CognitoraError(f"{record_path(state_dir)} is damaged ({exc}); remove it") from None
    return doc if isinstance(doc, dict) else None


def running(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The processes of an up record with whether each is still the one we started."""
    out = []
    for p in doc.get("processes", []):
        fp = fingerprint_from_json(p["fingerprint"])
        out.append({"name": p["name"], "pid": fp.pid, "alive": matches(fp), "log": p.get("log")})
    return out


class Starter:
    """Starts daemons in their own sessions and remembers them (for `down`)."""

    def __init__(self, state_dir: Path, say: Any):
        self.state_dir = state_dir
        self.say = say
        self.processes: list[dict[str, Any]] = []

    def start(self, name: str, argv: list[str], ready: Path | None, timeout_s: float = 120) -> Any:
        """Start one daemon; its ready document once `ready` is written (None: at once)."""
        proc = self.spawn(name, argv)
        return None if ready is None else self.wait(name, proc, ready, timeout_s)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        fp = fingerprint(proc.pid) or Fingerprint(proc.pid, "", "")
        self.processes.append(
            {"name": name, "fingerprint": fingerprint_to_json(fp), "log": str(log)}
        )
        self.save({})
        self.say(f"started {name} (pid {proc.pid}, log {log})")
        return proc

    def wait(
        self, name: str, proc: subprocess.Popen[bytes], ready: Path, timeout_s: float = 120
    ) -> Any:
        try:
            return wait_ready_file(ready, timeout_s, proc)
        except (RuntimeError, TimeoutError) as exc:
            log = self.state_dir / "logs" / f"{name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"{name} did not start ({exc}): {' | '.join(tail)}") from None

    def save(self, extra: dict[str, Any]) -> None:
        doc = read_record(self.state_dir) or {}
        doc.update(extra)
        doc["processes"] = self.processes
        atomic_write_json(record_path(self.state_dir), doc, mode=0o600)


def down(state_dir: Path, say: Any) -> list[str]:
    """Stop what `up` started (newest first) and the engines its agent ran; returns their names."""
    doc = read_record(state_dir)
    if doc is None:
        return []
    stopped = []
    for p in reversed(doc.get("processes", [])):
        fp = fingerprint_from_json(p["fingerprint"])
        if not matches(fp):
            if os.path.exists(f"/proc/{fp.pid}"):
                say(
                    f"not stopping pid {fp.pid}: it is not the {p['name']} up started "
                    "(its start time or command line differ)"
                )
            continue
        if matches(fp):
            ok = stop_pid_group(fp, grace_s=45.0 if p["name"] == "agent" else 10.0)
            say(
                f"stopped {p['name']} (pid {fp.pid})"
                if ok
                else f"{p['name']} (pid {fp.pid}) is still running"
            )
            stopped.append(p["name"])
    for rec in sorted(state_dir.glob("agent*/replicas/*.json")):  # engines left behind
        try:
            fp = fingerprint_from_json(json.loads(rec.read_text())["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if matches(fp) and stop_pid_group(fp):
            say(f"stopped engine {rec.stem} (pid {fp.pid})")
            stopped.append(f"engine {rec.stem}")
    os.unlink(record_path(state_dir))
    return stopped
