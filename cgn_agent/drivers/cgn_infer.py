"""cgn-infer, Cognitora's own engine: `cgn-infer serve` (docs/cgn-infer.md)."""

from __future__ import annotations

from cgn_agent.drivers.base import (
    Launch,
    LaunchContext,
    PlacementRefused,
    Toolbox,
    cuda_env,
    optional_flags,
    require_connector_none,
    require_gpus,
    require_source,
    url_for,
)
from cgn_agent.inventory.types import Inventory
from cgn_agent.spec import ReplicaSpec
from cgn_core.settings import TlsSettings

BUNDLED = ("smollm2", "qwen2.5-coder-0.5b")
BACKENDS = ("torch", "mlx", "sim")


class CgnInferDriver:
    name = "cgn_infer"

    def installed(self, tools: Toolbox) -> bool:
        return tools.which("cgn-infer") is not None

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        require_source(spec, self.name)
        require_connector_none(spec, self.name)
        if spec.source not in BUNDLED and not tools.is_file(spec.source):
            raise PlacementRefused(f"cgn_infer: model file {spec.source} does not exist")
        p = spec.profile
        backend = p.backend or "torch"
        if backend not in BACKENDS:
            raise PlacementRefused(f"cgn_infer: backend must be one of {', '.join(BACKENDS)}")
        if spec.devices:
            require_gpus(spec, node, self.name, 1)
        if backend == "mlx" and spec.devices:
            raise PlacementRefused("cgn_infer: the mlx backend takes no CUDA devices")
        if spec.pipeline is not None:
            if backend == "sim":
                raise PlacementRefused("cgn_infer: a layer pipeline runs torch or mlx, not sim")
            if spec.role != "both":
                raise PlacementRefused("cgn_infer: a layer pipeline serves role both")
            if spec.pipeline.part == 0 and len(spec.pipeline.stages) != spec.pipeline.parts - 1:
                raise PlacementRefused("cgn_infer: the head of a pipeline needs its stages")
        if p.lora and (
            backend != "torch" or spec.pipeline is not None or p.dtype not in (None, "gguf")
        ):
            raise PlacementRefused("cgn_infer: LoRA adapters run on the torch backend with "
                                   "gguf weights, every layer in one process")  # fmt: skip
        for f in p.lora:
            if not tools.is_file(f.path):
                raise PlacementRefused(
                    f"cgn_infer: LoRA adapter {f.name} ({f.path}) does not exist"
                )

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        p = spec.profile
        exe = tools.which("cgn-infer") or "cgn-infer"
        if spec.pipeline is not None and spec.pipeline.part > 0:
            return _stage(spec, ctx, exe)
        argv = [
            exe,
            "serve",
            "--model",
            spec.source,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--model-name",
            spec.model,
        ]
        if spec.pipeline is not None:  # the head: the stages' addresses, in layer order
            argv += ["--stages", ",".join(spec.pipeline.stages)]
        argv += optional_flags(("--ctx", p.ctx), ("--threads", p.threads), ("--backend", p.backend))
        argv += ["--device", "cuda"] if spec.devices else []
        argv += optional_flags(("--dtype", p.dtype))
        argv += ["--kvcached", ctx.kvcached] if ctx.kvcached else []
        argv += ["--role", spec.role] if spec.role != "both" else []
        argv += [a for f in p.lora for a in ("--lora", f"{f.name}={f.path}")]
        if p.max_loras is not None:  # the rest load at run time, from the model dirs only
            argv += ["--set", f"max_loras={p.max_loras}"]
            if ctx.model_dirs and not any("," in d for d in ctx.model_dirs):
                argv += ["--set", f"lora_dirs={','.join(ctx.model_dirs)}"]
        if spec.role != "decode":  # it holds prefill legs' KV for decode engines on any node
            argv += ["--set", f"transfer.host={ctx.host}"]
            argv += (
                ["--set", f"transfer.advertise={ctx.advertise_host}"] if ctx.advertise_host else []
            )
        # HTTPS (the router must present a certificate of the CA); a head's client certificate
        argv += _tls_flags(ctx.tls)
        env = {**(cuda_env(spec) if spec.devices else {}), **p.env}
        if ctx.token:  # NOTE: in the environment, not argv: argv is world-readable in ps
            env["CGN_INFER_API_TOKEN"] = ctx.token
        if ctx.kvcached and ctx.kvcached_token:
            env["CGN_INFER_KVCACHED__TOKEN"] = ctx.kvcached_token
        return Launch(
            tuple(argv + list(p.extra_args)),
            env,
            url_for(ctx, secure=ctx.tls is not None),
            metrics_dialect="cgn-infer",
            token=ctx.token,
        )


def _stage(spec: ReplicaSpec, ctx: LaunchContext, exe: str) -> Launch:
    """`cgn-infer stage`: part I of N (layers balanced by weight bytes, the same split every
    part computes from the same file), serving only the head's node (with TLS)."""
    assert spec.pipeline is not None
    p, part = spec.profile, spec.pipeline
    argv = [
        exe,
        "stage",
        "--model",
        spec.source,
        "--part",
        f"{part.part}/{part.parts}",
        "--host",
        ctx.host,
        "--port",
        str(ctx.port),
    ]
    argv += optional_flags(("--threads", p.threads), ("--dtype", p.dtype))
    argv += ["--set", f"backend={p.backend}"] if p.backend else []
    argv += ["--set", "device=cuda"] if spec.devices else []
    if ctx.tls is not None:  # the stage serves the head's certificate (CN = its node id) only
        argv += ["--head", part.head, *_tls_flags(ctx.tls)]
    env = {**(cuda_env(spec) if spec.devices else {}), **p.env}
    # NOTE: no extra_args: they are `serve` flags (the head gets them), which `stage` refuses
    return Launch(tuple(argv), env, f"tcp://{ctx.host}:{ctx.port}", probe="tcp", endpoint=False)


def _tls_flags(tls: TlsSettings | None) -> list[str]:
    """The node's certificate for `cgn-infer`'s `tls.*` settings (none without TLS)."""
    if tls is None:
        return []
    return [
        "--set",
        f"tls.ca_file={tls.ca_file}",
        "--set",
        f"tls.cert_file={tls.cert_file}",
        "--set",
        f"tls.key_file={tls.key_file}",
    ]
