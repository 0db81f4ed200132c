"""Multi-node ranks of vLLM and SGLang: what each rank runs, with what environment, checked first.

A replica over N nodes is N ranks (cgn_core/multinode.py). Rank 0 opens the rendezvous
point on `ctx.rendezvous_port` of its advertised address and alone serves HTTP; ranks 1..
wait (up to the profile's `rendezvous_timeout_s`) for that address to accept a connection,
then join. Per engine and launch mode:

* vLLM, `launch_mode: ray` (the default): rank 0 runs a Ray head as a sidecar
  (`ray start --head --port P --node-ip-address A --num-gpus G --block`) and then
  `vllm serve ... --distributed-executor-backend ray` against it; ranks 1.. only join the
  head (`ray start --address A:P --node-ip-address B --num-gpus G --block`): Ray runs
  vLLM's workers there.
* vLLM, `launch_mode: mp`: one `vllm serve` per rank with `--nnodes N --node-rank r
  --master-addr A --master-port P`, and `--headless` (no HTTP server) on ranks 1...
* SGLang: one `sglang.launch_server` per rank with `--nnodes N --node-rank r
  --dist-init-addr A:P`; ranks 1.. serve no HTTP.
Every rank gets its devices (`CUDA_VISIBLE_DEVICES`), the node's collective-library
settings (`ctx.nccl`) and, under vLLM, its own address as `VLLM_HOST_IP`. Tensor-parallel
size is the profile's; pipeline stages make up the rest (devices × nodes / TP).
"""

from __future__ import annotations

from dataclasses import replace

from cgn_agent.drivers.base import (
    Command,
    Launch,
    LaunchContext,
    PlacementRefused,
    Toolbox,
)
from cgn_agent.inventory.types import Inventory
from cgn_agent.spec import ReplicaSpec
from cgn_core import multinode


def check(spec: ReplicaSpec, node: Inventory, engine: str) -> None:
    """A rank's devices form whole tensor-parallel groups of one GPU type, and its profile's
    fields are ones this engine takes across nodes."""
    part, p = spec.pipeline, spec.profile
    assert part is not None
    if not spec.devices:
        raise PlacementRefused(f"{engine}: a rank across nodes needs its devices (devices: [])")
    total = len(spec.devices) * part.parts
    if total % p.tensor_parallel:
        raise PlacementRefused(
            f"{engine}: profile.tensor_parallel {p.tensor_parallel} does not divide "
            f"{len(spec.devices)} device(s) × {part.parts} nodes = {total}"
        )
    names = {a.index: a.name for a in node.accelerators if a.index in spec.devices}
    if len(set(names.values())) > 1:
        shown = ", ".join(f"{i}: {n}" for i, n in sorted(names.items()))
        raise PlacementRefused(
            f"{engine}: devices mix GPU types in one tensor-parallel group ({shown})"
        )
    if p.launch_mode is not None and engine != "vllm":
        raise PlacementRefused(f"{engine}: profile.launch_mode is vLLM's (ray or mp)")


def check_fp8(spec: ReplicaSpec, node: Inventory, engine: str) -> None:
    """An FP8 profile only on devices of compute capability 8.9 or newer."""
    p = spec.profile
    field = multinode.fp8_field(p.quantization, p.dtype, p.extra_args)
    caps = {a.index: a.compute_capability for a in node.accelerators if a.index in spec.devices}
    if why := multinode.fp8_refusal(field, caps):
        raise PlacementRefused(f"{engine}: profile.{why}")


def master(spec: ReplicaSpec, ctx: LaunchContext) -> tuple[str, int]:
    """Rank 0's rendezvous point: its own advertised address and rendezvous port on rank 0,
    the address its placement names on every other rank."""
    part = spec.pipeline
    assert part is not None
    if part.part == 0:
        return ctx.advertise_host or ctx.host, ctx.rendezvous_port
    host, _, port = part.rendezvous.rpartition(":")
    return host.strip("[]"), int(port)


def env(spec: ReplicaSpec, ctx: LaunchContext) -> dict[str, str]:
    own = ctx.advertise_host or ctx.host
    return {**multinode.rank_env(spec.engine, spec.devices, ctx.nccl, own), **spec.profile.env}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def launch(
    spec: ReplicaSpec,
    ctx: LaunchContext,
    tools: Toolbox,
    serve: Launch,
    model_args: list[str],
) -> Launch:
    """Rank `spec.pipeline.part`'s launch: `serve` is the engine's single-node launch
    (rank 0's HTTP server), `model_args` its argv without the HTTP flags and extra_args."""
    part, p, engine = spec.pipeline, spec.profile, spec.engine
    assert part is not None
    host, port = master(spec, ctx)
    rendezvous = _address(host, port)
    base = env(spec, ctx)
    pp = multinode.pipeline_parallel(len(spec.devices), part.parts, p.tensor_parallel)
    pp_flag = "--pipeline-parallel-size" if engine == "vllm" else "--pp-size"
    stages = [pp_flag, str(pp)] if pp > 1 else []
    own = ctx.advertise_host or ctx.host
    timeout = p.rendezvous_timeout_s or multinode.DEFAULT_RENDEZVOUS_TIMEOUT_S

    def rank(argv: tuple[str, ...], rank_env: dict[str, str], **kw: object) -> Launch:
        if part.part > 0:  # no HTTP server: judged by staying alive, never routed to
            kw |= {"probe": "alive", "endpoint": False, "wait_for": rendezvous}
        else:
            kw |= {"metrics_dialect": serve.metrics_dialect, "token": serve.token}
            kw |= {"rendezvous": rendezvous}
        launch = Launch(argv, rank_env, serve.url, wait_timeout_s=timeout, restart=False)
        return replace(launch, **kw)  # type: ignore[arg-type]

    if engine == "vllm" and (p.launch_mode or multinode.DEFAULT_LAUNCH_MODE) == "ray":
        ray = tools.which("ray") or "ray"
        # NOTE: real Ray (2.60, #62) enables usage stats on its own when its terminal is not
        # interactive (an agent's never is), reporting the cluster to Anyscale: off
        gpus = ["--num-gpus", str(len(spec.devices)), "--disable-usage-stats", "--block"]
        # NOTE: on SIGTERM real Ray drains its node for up to 30 s first (for Ray Serve's
        # replicas) and leaves its daemons running meanwhile; a rank is torn down whole
        ray_env = {**base, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        if part.part > 0:  # Ray runs vLLM's workers here: nothing else to start
            join = (ray, "start", "--address", rendezvous, "--node-ip-address", own, *gpus)
            return rank(join, ray_env)
        head = (ray, "start", "--head", "--port", str(port), "--node-ip-address", own, *gpus)
        argv = (*serve.argv, *stages, "--distributed-executor-backend", "ray")
        # NOTE: vLLM may start before the head has every node: it waits for the GPUs it needs
        return rank(argv, {**serve.env, **base, "RAY_ADDRESS": rendezvous},
                    sidecars=(Command(head, ray_env),), wait_for=rendezvous)  # fmt: skip
    if engine == "vllm":  # multiprocessing across nodes
        ranks = ["--nnodes", str(part.parts), "--node-rank", str(part.part),
                 "--master-addr", host, "--master-port", str(port)]  # fmt: skip
    else:
        ranks = ["--nnodes", str(part.parts), "--node-rank", str(part.part),
                 "--dist-init-addr", rendezvous]  # fmt: skip
    if part.part > 0:
        headless = ["--headless"] if engine == "vllm" else []
        return rank((*model_args, *stages, *ranks, *headless, *p.extra_args), base)
    return rank((*serve.argv, *stages, *ranks), {**serve.env, **base})
