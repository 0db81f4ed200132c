"""The executor of one replica: turns supervisor actions into a process, probes and etcd keys.

Owns the replica's `State`, its `EngineProcess` (if any) and its `Launch`.
`observe` runs one observation through `supervisor.step` and carries out the
actions; the node agent calls `poll` on every tick (process exit, probes,
then a Tick). Nothing here decides anything: supervisor.py does.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from cgn_agent import shard
from cgn_agent import supervisor as sv
from cgn_agent.drivers import Launch
from cgn_agent.processes import EngineProcess, log_tail, spawn
from cgn_agent.publisher import Publisher
from cgn_agent.spec import ReplicaSpec
from cgn_agent.statefile import ReplicaRecord, StateStore
from cgn_core import keys
from cgn_core.kv import shm
from cgn_core.kv.blockhash import BLOCK_SIZE

log = logging.getLogger(__name__)


class Probed(NamedTuple):
    health: bool  # the health path answered 200
    models: bool  # /v1/models lists the served name
    detail: str = ""  # why not, when not
    adapters: frozenset[str] = frozenset()  # what /v1/models lists as its adapters (parent)


class Prober(Protocol):
    async def probe(self, launch: Launch, served: str) -> Probed: ...

    async def in_flight(self, launch: Launch) -> int | None:
        """Requests running + waiting on the engine, from its /metrics; None when unknown."""
        ...


@dataclass(frozen=True, slots=True)
class RunnerContext:
    node: str
    publisher: Publisher
    store: StateStore
    prober: Prober
    policy: sv.Policy
    log_dir: Path
    advertise_url: Callable[[int], str]  # port -> the URL the router should use
    stop_grace_s: float
    probe_interval_s: float
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random


class ReplicaRunner:
    def __init__(self, spec: ReplicaSpec, launch: Launch, port: int, ctx: RunnerContext):
        self.spec, self.launch, self.port, self.ctx = spec, launch, port, ctx
        self.policy = ctx.policy if launch.restart else replace(ctx.policy, restart=False)
        self.state = sv.State()
        self.proc: EngineProcess | None = None
        self.forgotten = False
        self._last_probe = 0.0
        self._stopping: asyncio.Task[Any] | None = None
        # the adapters it holds: those it loaded at start, and those the engine lists now
        self.started_with = tuple(f.name for f in spec.profile.lora)
        self.adapters = self.started_with

    # ---- keys ------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.ctx.log_dir / f"{self.spec.replica}.log"

    @property
    def status_key(self) -> str:
        return f"{keys.REPLICAS}{self.ctx.node}/{self.spec.replica}"

    @property
    def reason_path(self) -> Path:  # where a multi-node rank's shard says why it ended
        return self.ctx.log_dir / f"{self.spec.replica}.reason"

    @property
    def endpoint_key(self) -> str:
        # NOTE: under the node's own prefix, so etcd RBAC can confine a node to its endpoints;
        # the router's id for it is <model>/<node>.<replica> (two nodes' ids never collide).
        return f"{keys.ENDPOINTS}{self.ctx.node}/{self.spec.model}/{self.spec.replica}"

    @property
    def url(self) -> str:
        if not self.launch.spawn:
            return self.launch.url
        url = self.ctx.advertise_url(self.port)
        if self.launch.url.startswith("https://"):  # the engine serves HTTPS (engines.tls)
            url = "https://" + url.removeprefix("http://")
        return url

    def endpoint_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "url": self.url,
            "engine": self.launch.metrics_dialect or self.spec.engine,
            "role": self.spec.role,
            "node": self.ctx.node,
            "replica": self.spec.replica,
        }
        if self.launch.token:
            doc["api_token"] = self.launch.token
        if self.spec.profile.lora:  # loaded at start; a request's `lora` id is the index
            doc["adapters"] = [f.name for f in self.spec.profile.lora]
        if self.spec.engine == "cgn_infer":  # it streams KV events with our hash scheme
            doc |= {
                "block_size": BLOCK_SIZE,
                "hash_scheme": keys.HASH_SCHEME,
                "kv_events_url": self.url + "/v1/kv/events",
            }
        return doc

    def status_doc(self) -> dict[str, Any]:
        s = self.state
        return {
            "phase": str(s.phase),
            "model": self.spec.model,
            "engine": self.spec.engine,
            "pid": s.pid,
            "url": self.url,
            "restarts": s.restarts,
            "failures": s.failures,
            "reason": s.reason,
            "since_unix": time.time() - (self.ctx.clock() - s.since),
            "log_tail": log_tail(self.log_path) if self.launch.spawn else [],
            **({"adapters": list(self.adapters)} if self.adapters else {}),
            **self._pipeline_status(),
        }

    def _pipeline_status(self) -> dict[str, Any]:
        """A pipeline part's place in its replica; a stage's address for the head (the
        reconciler copies it into the head's placement once every stage is Ready)."""
        part = self.spec.pipeline
        if part is None:
            return {}
        doc = part.status()
        if self.launch.rendezvous:  # rank 0 of vLLM or SGLang: where the other ranks join
            doc["address"] = self.launch.rendezvous
        elif part.part > 0 and self.launch.probe == "tcp":  # a pipeline stage
            doc["address"] = self.url.split("://", 1)[-1]  # advertise host:port
        return {"pipeline": doc}

    # ---- lifecycle ---------------------------------------------------------------------

    async def begin(self, adopted: EngineProcess | None = None) -> None:
        now = self.ctx.clock()
        if adopted is not None:
            self.proc = adopted
            self.state, actions = sv.adopt(now, adopted.pid)
        else:
            self.state, actions = sv.start(now)
        await self._run(actions)

    async def observe(self, obs: sv.Observation) -> None:
        self.state, actions = sv.step(self.state, obs, self.policy)
        await self._run(actions)

    async def poll(self) -> None:
        """One supervision tick: exit check, probe when due, then time-based transitions."""
        now = self.ctx.clock()
        if self.proc is not None:
            exited, code = self.proc.poll()
            if exited:
                pid, self.proc = self.proc.pid, None
                # NOTE: an engine killed with SIGKILL leaves its KV transfer directory in
                # /dev/shm (memory); it is gone now, so is the directory
                await asyncio.to_thread(shm.reclaim, pid)
                why = await asyncio.to_thread(self._reason)
                await self.observe(sv.Exited(now, code, self.ctx.rand(), why))
        s = self.state
        if (
            s.pid is not None
            and not s.terminating
            and s.phase in (sv.Phase.LOADING, sv.Phase.READY)
        ):
            due = s.phase == sv.Phase.LOADING or now - self._last_probe >= self.ctx.probe_interval_s
            if due:
                self._last_probe = now
                got = await self.ctx.prober.probe(
                    self.launch, self.launch.served_name or self.spec.model
                )
                await self.observe(sv.Probe(self.ctx.clock(), got.health, got.models, got.detail))
                if got.models:  # a failed probe says nothing of them
                    self._adapters_seen(got.adapters)
        if s.phase == sv.Phase.DRAINING and not s.terminating and self.launch.metrics_dialect:
            await self.observe(sv.Load(now, await self.ctx.prober.in_flight(self.launch)))
        await self.observe(sv.Tick(self.ctx.clock()))

    def _adapters_seen(self, listed: frozenset[str]) -> None:
        """A Ready replica whose adapters changed (cgn-infer and vLLM load and evict them at
        run time) says so in its status: what `cgn-ctl replicas` shows."""
        adapters = tuple(sorted(set(self.started_with) | listed))[: keys.MAX_ADAPTERS]
        if adapters != self.adapters:
            self.adapters = adapters
            if self.state.phase == sv.Phase.READY:
                self.ctx.publisher.set(self.status_key, self.status_doc())

    async def _run(self, actions: list[sv.Action]) -> None:
        for action in actions:
            match action:
                case sv.Spawn():
                    await self._spawn()
                case sv.Terminate():
                    await self._terminate()
                case sv.PublishEndpoint():
                    if self.launch.endpoint:  # not a pipeline stage: only its head is routed to
                        self.ctx.publisher.set(self.endpoint_key, self.endpoint_doc())
                case sv.WithdrawEndpoint():
                    self.ctx.publisher.delete(self.endpoint_key)
                case sv.Report():
                    log.info(
                        "replica %s: %s%s",
                        self.spec.replica,
                        self.state.phase,
                        f" ({self.state.reason})" if self.state.reason else "",
                    )
                    self.ctx.publisher.set(self.status_key, self.status_doc())
                case sv.Forget():
                    self.ctx.publisher.delete(self.endpoint_key)
                    self.ctx.publisher.delete(self.status_key)
                    self.ctx.store.remove(self.spec.replica)
                    self.forgotten = True

    async def _spawn(self) -> None:
        now = self.ctx.clock()
        if not self.launch.spawn:
            self.ctx.store.save(ReplicaRecord(self.spec, self.port, self.url, None))
            await self.observe(sv.Spawned(now, 0))
            return
        argv, env = self.launch.argv, self.launch.env
        if self.launch.sidecars or self.launch.wait_for:  # a rank: cgn_agent/shard.py
            self._reason()  # NOTE: an earlier run's reason is not this one's
            plan = shard.Plan(
                tuple(shard.Step(c.argv, dict(c.env), c.wait_for) for c in self.launch.commands),
                self.launch.wait_timeout_s,
                str(self.reason_path),
                grace_s=max(1.0, self.ctx.stop_grace_s - 2.0),
            )
            argv = (sys.executable, "-m", "cgn_agent.shard", self.spec.replica)
            env = {shard.PLAN_ENV: plan.to_json()}
        try:
            proc = spawn(argv, env, self.log_path)
        except OSError as exc:
            await self.observe(sv.SpawnFailed(now, str(exc), self.ctx.rand()))
            return
        try:
            rendezvous = self.launch.rendezvous
            self.ctx.store.save(
                ReplicaRecord(
                    self.spec,
                    self.port,
                    self.url,
                    proc.fp,
                    self.launch.token,
                    int(rendezvous.rpartition(":")[2]) if rendezvous else 0,
                )
            )
        except OSError as exc:
            # NOTE: an engine the state file does not know could not be adopted after an agent
            # restart (an orphan on every restart): it is stopped, and the spawn retried later.
            log.error(
                "replica %s: cannot record the engine (%s); stopping it", self.spec.replica, exc
            )
            await proc.stop(self.ctx.stop_grace_s)
            await self.observe(sv.SpawnFailed(now, f"state file: {exc}", self.ctx.rand()))
            return
        self.proc = proc
        await self.observe(sv.Spawned(now, proc.pid))

    def _reason(self) -> str:
        """What a rank's shard wrote about why it ended (read once: the file goes)."""
        try:
            why = self.reason_path.read_text()[:1000]
        except OSError:
            return ""
        self.reason_path.unlink(missing_ok=True)
        return why

    async def _terminate(self) -> None:
        if not self.launch.spawn:  # an external engine: nothing to stop, it is "gone" at once
            await self.observe(sv.Exited(self.ctx.clock(), 0, self.ctx.rand()))
            return
        if self.proc is None:
            return
        if self._stopping is None or self._stopping.done():
            self._stopping = asyncio.create_task(self.proc.stop(self.ctx.stop_grace_s))

    async def close(self) -> None:
        """Stop the engine now (agent exit with engines.stop_on_exit)."""
        if self.proc is not None:
            await self.proc.stop(self.ctx.stop_grace_s)
