"""The node agent: desired replicas (placements) in, supervised runners out.

`set_placements` records what etcd asks for; `reconcile` starts runners for
new replicas (after the driver's validation), stops runners whose placement
went away, and replaces a runner whose spec changed once the old one has
stopped. `adopt_orphans` runs once at start: every state-file record whose
fingerprint still matches a live process becomes a runner in Loading (probes
bring it back to Ready); nothing is stopped before the first placement
listing arrives, so an agent that starts while etcd is down leaves its
engines serving.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgn_agent import supervisor as sv
from cgn_agent.drivers import DRIVERS, Launch, LaunchContext, PlacementRefused, Toolbox
from cgn_agent.drivers.base import check_adapters, check_source
from cgn_agent.inventory.nvidia import GpuProcess
from cgn_agent.inventory.types import Inventory
from cgn_agent.processes import EngineProcess, matches
from cgn_agent.runner import ReplicaRunner, RunnerContext
from cgn_agent.spec import ReplicaSpec
from cgn_core import engine_args, keys, multinode
from cgn_core.engine_args import ArgsRefused
from cgn_core.kv import shm
from cgn_core.process import group_members
from cgn_core.settings import TlsSettings

log = logging.getLogger(__name__)

# Command-line fragments by which an engine process is recognised.
ENGINE_MARKERS = (
    "vllm",
    "sglang.launch_server",
    "cgn-infer",
    "llama-server",
    "llama_cpp.server",
    "xllamacpp_server",
    "trtllm-serve",
    "mlx_lm.server",
)


SHOWN_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_HOST_IP", "RAY_ADDRESS")  # and NCCL_*, GLOO_*


def rank_log(spec: ReplicaSpec, launch: Launch) -> str:
    """A multi-node rank's launch as the agent logs it: its commands, what each waits for,
    and the environment that places it (never a secret)."""
    assert spec.pipeline is not None
    out = [f"rank {spec.pipeline.part}/{spec.pipeline.parts} of {spec.engine}"]
    for c in launch.commands:
        shown = {
            k: v for k, v in c.env.items() if k in SHOWN_ENV or k.startswith(("NCCL_", "GLOO_"))
        }
        wait = f" after {c.wait_for} accepts" if c.wait_for else ""
        env = " ".join(f"{k}={v}" for k, v in sorted(shown.items()))
        out.append(f"[{env}] {' '.join(c.argv)}{wait}")
    return "; ".join(out)


@dataclass(frozen=True, slots=True)
class Invalid:
    """A placement that could not be parsed; reported in the replica's status."""

    reason: str


def stray_engine_pids(
    apps: Iterable[GpuProcess], own_pids: Iterable[int], cmdlines: Mapping[int, str]
) -> list[int]:
    """Pids holding GPU memory that look like an engine but are not one of ours (to stop)."""
    own = set(own_pids)
    out = []
    for app in apps:
        cmd = cmdlines.get(app.pid, "")
        if app.pid not in own and any(m in cmd for m in ENGINE_MARKERS) and app.pid not in out:
            out.append(app.pid)
    return out


class NodeAgent:
    def __init__(
        self,
        node: str,
        ctx: RunnerContext,
        tools: Toolbox,
        bind_host: str,
        inventory: Callable[[], Inventory],
        free_port: Callable[[str], int],
        model_dirs: tuple[Path, ...] = (),
        engine_tls: TlsSettings | None = None,
    ):
        self.node, self.ctx, self.tools = node, ctx, tools
        self.model_dirs = model_dirs
        self.engine_tls = engine_tls
        self.bind_host = bind_host
        self.advertise_host = ""  # set by the daemon: where other nodes reach our engines
        self.inventory = inventory
        self.free_port = free_port
        self.runners: dict[str, ReplicaRunner] = {}
        self.desired: dict[str, ReplicaSpec | Invalid] | None = None  # None: not listed yet
        self.refused: dict[str, tuple[ReplicaSpec | Invalid, str]] = {}  # replica: (spec, why)
        self.kv_store, self.kv_offload_gib = "", 0.0  # the node's KV store, for launches
        self.kv_token = ""  # its client token, handed to engines in their environment

    # ---- inputs ----------------------------------------------------------------------

    def set_placements(self, desired: Mapping[str, ReplicaSpec | Invalid]) -> None:
        self.desired = dict(desired)

    def set_placement(self, replica: str, spec: ReplicaSpec | Invalid | None) -> None:
        if self.desired is None:
            self.desired = {}
        if spec is None:
            self.desired.pop(replica, None)
        else:
            self.desired[replica] = spec

    # ---- startup ---------------------------------------------------------------------

    async def adopt_orphans(self) -> list[str]:
        """Runners for the engines a previous agent left running; returns the adopted replicas.
        KV transfer directories of engines that are gone (killed with the last agent) go."""
        await asyncio.to_thread(shm.reclaim)
        adopted: list[str] = []
        for rec in self.ctx.store.load_all():
            replica = rec.spec.replica
            if rec.fingerprint is not None and not matches(rec.fingerprint):
                log.info(
                    "replica %s: pid %d is gone or reused; not adopted",
                    replica,
                    rec.fingerprint.pid,
                )
                self.ctx.store.remove(replica)
                continue
            launch = self._launch(rec.spec, rec.port, rec.token, rec.rendezvous_port)
            runner = ReplicaRunner(rec.spec, launch, rec.port, self.ctx)
            self.runners[replica] = runner
            if rec.fingerprint is None:
                await runner.begin()  # an external engine: nothing to adopt, probe it again
            else:
                await runner.begin(EngineProcess(rec.fingerprint))
                log.info("replica %s: adopted running engine pid %d", replica, rec.fingerprint.pid)
            adopted.append(replica)
        return adopted

    # ---- the loop ----------------------------------------------------------------------

    async def reconcile(self) -> None:
        if self.desired is None:
            return
        for replica, runner in list(self.runners.items()):
            want = self.desired.get(replica)
            if want is None:
                await runner.observe(sv.Stop(self.ctx.clock()))
            elif want != runner.spec:
                await runner.observe(sv.Stop(self.ctx.clock(), _changed(runner.spec, want)))
        for replica in list(self.refused):
            if replica not in self.desired:
                del self.refused[replica]
                self.ctx.publisher.delete(self._status_key(replica))
        for replica, want in self.desired.items():
            if replica in self.runners or self.refused.get(replica, (None,))[0] == want:
                continue  # running, or refused and unchanged since
            if isinstance(want, Invalid):
                self._refuse(replica, want, f"invalid placement: {want.reason}")
            else:
                await self._start(want)

    async def tick(self) -> None:
        for replica, runner in list(self.runners.items()):
            await runner.poll()
            if runner.forgotten:
                del self.runners[replica]
        await self.reconcile()

    async def _start(self, spec: ReplicaSpec) -> None:
        driver = DRIVERS[spec.engine]
        part = spec.pipeline
        ranks = spec.engine in multinode.RANK_ENGINES
        if part is not None and not ranks and part.part == 0 and not part.stages:
            # the head of a layer pipeline starts once the reconciler has written where its
            # stages listen (every stage Ready); until then it is Starting, not refused
            why = f"waiting for the pipeline's {part.parts - 1} stage(s) to be Ready"
            self._refuse(spec.replica, spec, why, phase=sv.Phase.STARTING)
            return
        if part is not None and ranks and part.part > 0 and not part.rendezvous:
            # a rank > 0 starts once the reconciler has written where rank 0 listens
            why = f"waiting for rank 0's rendezvous address (rank {part.part}/{part.parts})"
            self._refuse(spec.replica, spec, why, phase=sv.Phase.STARTING)
            return
        try:
            # NOTE: least privilege first: what a placement may run, then whether it can run
            engine_args.check(spec.engine, spec.profile.extra_args, spec.profile.env)
            check_source(spec, self.model_dirs)
            check_adapters(spec, self.model_dirs)
            node = self.inventory()
            driver.validate(spec, node, self.tools)  # what the engine needs, then whether offered
            if spec.engine not in node.engines and spec.engine != "openai_compat":
                raise PlacementRefused(
                    f"{spec.engine} is not installed or not offered on node {node.node} "
                    f"(engines here: {', '.join(node.engines) or 'none'})"
                )
        except ArgsRefused as exc:
            self._refuse(spec.replica, spec, f"refused: {exc}")
            return
        except PlacementRefused as exc:
            self._refuse(spec.replica, spec, f"refused: {exc.message}")
            return
        self.refused.pop(spec.replica, None)
        port = spec.port or (
            self.free_port(self.bind_host) if driver.name != "openai_compat" else 0
        )
        token = secrets.token_urlsafe(32)  # the router presents it; other peers cannot
        rank0 = part is not None and ranks and part.part == 0
        rendezvous = self.free_port(self.bind_host) if rank0 else 0
        launch = self._launch(spec, port, token, rendezvous)
        if part is not None and ranks:
            log.info("replica %s: %s", spec.replica, rank_log(spec, launch))
        runner = ReplicaRunner(spec, launch, port, self.ctx)
        self.runners[spec.replica] = runner
        await runner.begin()

    def _launch(self, spec: ReplicaSpec, port: int, token: str, rendezvous: int = 0) -> Launch:
        inv = self.inventory()
        links = [multinode.Link(n.device, n.port, n.state, n.link_layer) for n in inv.network]
        ctx = LaunchContext(
            self.bind_host,
            port,
            token=token,
            tls=self.engine_tls,
            kvcached=self.kv_store,
            kvcached_token=self.kv_token,
            offload_gib=self.kv_offload_gib,
            advertise_host=self.advertise_host,
            rendezvous_port=rendezvous,
            nccl=multinode.nccl_env(multinode.fabric_adapters(links), inv.iface),
            model_dirs=tuple(str(d) for d in self.model_dirs),
        )
        return DRIVERS[spec.engine].launch(spec, ctx, self.tools)

    def _refuse(
        self,
        replica: str,
        want: ReplicaSpec | Invalid,
        reason: str,
        phase: sv.Phase = sv.Phase.FAILED,
    ) -> None:
        """Not started, and not retried until its placement changes: refused (Failed), or a
        pipeline head waiting for its stages (Starting)."""
        (log.error if phase == sv.Phase.FAILED else log.info)("replica %s: %s", replica, reason)
        self.refused[replica] = (want, reason)
        doc: dict[str, Any] = {"phase": str(phase), "reason": reason}
        if isinstance(want, ReplicaSpec) and want.pipeline is not None:
            doc["pipeline"] = want.pipeline.status()
        self.ctx.publisher.set(self._status_key(replica), doc)

    def _status_key(self, replica: str) -> str:
        return f"{keys.REPLICAS}{self.node}/{replica}"

    # ---- views -------------------------------------------------------------------------

    def own_pids(self) -> list[int]:
        """Our engines' pids and every process in their groups (a multi-process engine's
        workers, a multi-node rank's sidecars): none of them is a stray or a foreign user."""
        pids = [r.state.pid for r in self.runners.values() if r.state.pid]
        return sorted(set(pids) | set(group_members(pids)))

    def running(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.spec.replica,
                "model": r.spec.model,
                "engine": r.spec.engine,
                "phase": str(r.state.phase),
                "url": r.url,
            }
            for r in self.runners.values()
        ]

    async def close(self) -> None:
        for r in self.runners.values():
            await r.close()


def _changed(was: ReplicaSpec, now: ReplicaSpec | Invalid) -> str:
    """Why a replica whose placement changed stops (its status says it while it drains)."""
    if isinstance(now, ReplicaSpec) and now.profile.lora != was.profile.lora:
        return "adapters changed: restarting with the new set (the engine loads them at start)"
    return "placement changed"
