"""One rank of a multi-node replica as one process: its commands in order, stopped as a group.

    python -m cgn_agent.shard <replica>     (the plan in $CGN_SHARD_PLAN, JSON)

The agent starts this instead of the engine when a launch has more than one command or
must wait for a rendezvous point (drivers/base.py `Launch.commands`), in a session of its
own as every engine; every command it starts stays in that process group, so the agent's
stop (SIGTERM, grace, SIGKILL of the group) reaches the engine and every sidecar at once.
For each command, in order:

1. wait until its `wait_for` host:port accepts a TCP connection (polled every 0.2 s), at
   most `timeout_s` for the whole launch;
2. start it. Every command but the last is a sidecar (a Ray head or worker): it must keep
   running; the last one is the rank itself.

The shard ends when the last command exits (its exit code is the shard's), when a sidecar
exits first, when a wait runs out, or on SIGTERM/SIGINT. Then every other process of the
group gets SIGTERM, and SIGKILL after `grace_s`: no sidecar outlives its rank. A shard that
ends for a reason of its own (a wait ran out, a sidecar died) writes the reason to
`reason_file` and exits with EXIT_REASON; the agent reports that reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgn_core.files import atomic_write_text
from cgn_core.process import group_members

PLAN_ENV = "CGN_SHARD_PLAN"
EXIT_REASON = 75  # EX_TEMPFAIL: the reason is in the reason file
POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Step:
    argv: tuple[str, ...]
    env: dict[str, str]
    wait_for: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    steps: tuple[Step, ...]
    timeout_s: float
    reason_file: str
    grace_s: float = 10.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "steps": [
                    {"argv": list(s.argv), "env": s.env, "wait_for": s.wait_for} for s in self.steps
                ],
                "timeout_s": self.timeout_s,
                "reason_file": self.reason_file,
                "grace_s": self.grace_s,
            }
        )


def parse(text: str) -> Plan:
    doc: Any = json.loads(text)
    steps = tuple(
        Step(tuple(s["argv"]), dict(s.get("env", {})), s.get("wait_for", "")) for s in doc["steps"]
    )
    if not steps or not all(s.argv for s in steps):
        raise ValueError("a plan needs at least one command, each with an argv")
    return Plan(steps, float(doc["timeout_s"]), str(doc["reason_file"]), float(doc["grace_s"]))


class Shard:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.procs: list[subprocess.Popen[bytes]] = []  # started so far, in order
        self.stopping = False
        self.deadline = time.monotonic() + plan.timeout_s

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self._stop_group()

    def _run(self) -> int:
        for i, step in enumerate(self.plan.steps):
            if step.wait_for and not self._wait(step.wait_for):
                if self.stopping:
                    return 0
                return self._fail(
                    f"rank 0's rendezvous point {step.wait_for} did not accept a connection "
                    f"within {self.plan.timeout_s:g} s"
                )
            if self.stopping:
                return 0
            if dead := self._dead_sidecar():
                return self._fail(dead)
            _say(f"starting command {i + 1}/{len(self.plan.steps)}: {' '.join(step.argv)}")
            try:
                self.procs.append(subprocess.Popen(step.argv, env={**os.environ, **step.env}))
            except OSError as exc:
                return self._fail(f"cannot start {step.argv[0]}: {exc}")
        main = self.procs[-1]
        while not self.stopping:
            code = main.poll()
            if code is not None:
                return code if code >= 0 else 128 - code
            if dead := self._dead_sidecar():
                return self._fail(dead)
            time.sleep(POLL_S)
        return 0

    def _wait(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        started = time.monotonic()
        while not self.stopping and time.monotonic() < self.deadline:
            if self._dead_sidecar():
                return True  # the caller reports it
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            except OSError:
                time.sleep(POLL_S)
                continue
            waited = time.monotonic() - started
            if waited > POLL_S:  # it was not there yet: this rank waited for its head
                _say(f"{address} accepted a connection after {waited:.1f} s")
            return True
        return False

    def _dead_sidecar(self) -> str:
        n = len(self.plan.steps) - 1  # every command but the last is a sidecar
        for p in self.procs[:n]:
            code = p.poll()
            if code is not None:
                return f"sidecar {Path(str(p.args[0])).name} exited with code {code}"  # type: ignore[index]
        return ""

    def _fail(self, reason: str) -> int:
        _say(reason)
        with contextlib.suppress(OSError):
            atomic_write_text(Path(self.plan.reason_file), reason)
        return EXIT_REASON

    def _stop_group(self) -> None:
        """SIGTERM to every other process of our group, SIGKILL to what is left after grace."""
        me = os.getpid()
        pgrp = os.getpgrp()

        def others() -> list[int]:
            own = [p.pid for p in self.procs if p.poll() is None]
            # NOTE: only while we lead our group (the agent started us in a session of our own)
            grouped = group_members([pgrp]) if pgrp == me else []
            return [pid for pid in sorted(set(own) | set(grouped)) if pid != me]

        deadline = time.monotonic() + self.plan.grace_s
        sig = signal.SIGTERM
        while pids := others():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if time.monotonic() >= deadline:
                sig = signal.SIGKILL
            time.sleep(0.05)
            for p in self.procs:
                p.poll()  # reap


def _say(line: str) -> None:
    print(f"cgn-shard: {line}", flush=True)


def main() -> int:
    raw = os.environ.pop(PLAN_ENV, "")
    try:
        plan = parse(raw)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"cgn-shard: bad plan in ${PLAN_ENV}: {exc}", file=sys.stderr)
        return 2
    shard = Shard(plan)

    def stop(signum: int, frame: object) -> None:
        shard.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return shard.run()


if __name__ == "__main__":
    sys.exit(main())
