"""The NVIDIA serving engines: vLLM, SGLang and TensorRT-LLM, each with its documented flags.

* vLLM: `vllm serve <model> --host --port --served-model-name
  --tensor-parallel-size [--max-model-len] [--dtype] [--gpu-memory-utilization]
  [--kv-transfer-config JSON] [--enable-lora --max-loras [--max-lora-rank]
  --lora-modules NAME=DIR...]` (and VLLM_ALLOW_RUNTIME_LORA_UPDATING, so adapters also
  load at run time); Prometheus /metrics in vLLM's names.
* SGLang: `python -m sglang.launch_server --model-path --host --port
  --served-model-name --tp-size [--context-length] [--dtype]
  [--mem-fraction-static] --enable-metrics [KV connector flags] [--enable-lora
  --max-loras-per-batch --max-loaded-loras [--max-lora-rank] --lora-paths NAME=DIR...]`.
* TensorRT-LLM: `trtllm-serve <model> --host --port --backend --tp_size
  [--max_seq_len] --served_model_name`; its /metrics is JSON iteration
  statistics, not Prometheus, so no dialect is published.
All three need NVIDIA GPUs: a placement without them is refused up front, and so is an
FP8 profile (`quantization: fp8`, an fp8 `dtype`, or fp8 in extra_args) on GPUs older than
compute capability 8.9. vLLM and SGLang also run one replica across nodes, as ranks
(drivers/ranks.py); `quantization` is their `--quantization`.
"""

from __future__ import annotations

from cgn_agent.drivers import kv_connectors, ranks
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


def _check(spec: ReplicaSpec, node: Inventory, engine: str) -> None:
    require_source(spec, engine)
    if spec.pipeline is not None:  # a rank: its devices are part of the tensor-parallel size
        ranks.check(spec, node, engine)
        require_gpus(spec, node, engine, len(spec.devices))
    else:
        require_gpus(spec, node, engine, spec.profile.tensor_parallel)
        if spec.profile.launch_mode is not None:
            raise PlacementRefused(f"{engine}: profile.launch_mode applies across nodes only")
    ranks.check_fp8(spec, node, engine)


def _multi_node(
    spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox, serve: Launch, model_args: list[str]
) -> Launch:
    """`serve` as it is on one node, or this node's rank of a replica across nodes
    (`model_args`: the engine's argv without its HTTP flags and extra_args)."""
    if spec.pipeline is None:
        return serve
    return ranks.launch(spec, ctx, tools, serve, model_args)


class VllmDriver:
    name = "vllm"

    def installed(self, tools: Toolbox) -> bool:
        return tools.which("vllm") is not None

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        _check(spec, node, self.name)
        kv_connectors.vllm_args(spec.profile.kv_connector)

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        p = spec.profile
        exe = [tools.which("vllm") or "vllm", "serve", spec.source]
        http = ["--host", ctx.host, "--port", str(ctx.port), "--served-model-name", spec.model]
        argv = ["--tensor-parallel-size", str(p.tensor_parallel)]
        argv += optional_flags(("--max-model-len", p.ctx))
        argv += ["--dtype", p.dtype] if p.dtype else []
        argv += optional_flags(("--quantization", p.quantization))
        if p.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(p.gpu_memory_utilization)]
        argv += kv_connectors.vllm_args(p.kv_connector)
        argv += kv_connectors.offload_args("vllm", p.kv_connector, ctx.offload_gib)
        env = {**cuda_env(spec), **p.env}
        if p.lora or p.max_loras:  # the router loads the others at run time
            argv += ["--enable-lora", "--max-loras", str(p.max_loras or len(p.lora))]
            argv += optional_flags(("--max-lora-rank", p.max_lora_rank))
            argv += ["--lora-modules", *(f"{f.name}={f.path}" for f in p.lora)] if p.lora else []
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if ctx.token:  # vLLM's server reads it (as --api-key) and guards /v1/* with it
            env["VLLM_API_KEY"] = ctx.token
        serve = Launch(
            (*exe, *http, *argv, *p.extra_args),
            env,
            url_for(ctx),
            metrics_dialect="vllm",
            token=ctx.token,
        )
        return _multi_node(spec, ctx, tools, serve, exe + argv)


class SglangDriver:
    name = "sglang"

    def installed(self, tools: Toolbox) -> bool:
        return tools.has_module("sglang")

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        _check(spec, node, self.name)
        kv_connectors.sglang_args(spec.profile.kv_connector, spec.role)

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        p = spec.profile
        exe = [ctx.python, "-m", "sglang.launch_server", "--model-path", spec.source]
        http = ["--host", ctx.host, "--port", str(ctx.port), "--served-model-name", spec.model]
        argv = ["--tp-size", str(p.tensor_parallel)]
        argv += optional_flags(("--context-length", p.ctx))
        argv += ["--dtype", p.dtype] if p.dtype else []
        argv += optional_flags(("--quantization", p.quantization))
        if p.gpu_memory_utilization is not None:
            argv += ["--mem-fraction-static", str(p.gpu_memory_utilization)]
        argv += ["--enable-metrics", *kv_connectors.sglang_args(p.kv_connector, spec.role)]
        argv += kv_connectors.offload_args("sglang", p.kv_connector, ctx.offload_gib)
        if p.lora or p.max_loras:
            batch = p.max_loras or len(p.lora)
            argv += ["--enable-lora", "--max-loras-per-batch", str(batch)]
            argv += ["--max-loaded-loras", str(max(batch, len(p.lora)))]
            argv += optional_flags(("--max-lora-rank", p.max_lora_rank))
            argv += ["--lora-paths", *(f"{f.name}={f.path}" for f in p.lora)] if p.lora else []
        serve = Launch(
            (*exe, *http, *argv, *p.extra_args),
            {**cuda_env(spec), **p.env},
            url_for(ctx),
            metrics_dialect="sglang",
        )
        return _multi_node(spec, ctx, tools, serve, exe + argv)


class TrtllmDriver:
    name = "trtllm"
    BACKENDS = ("pytorch", "tensorrt", "_autodeploy")

    def installed(self, tools: Toolbox) -> bool:
        return tools.which("trtllm-serve") is not None

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        _check(spec, node, self.name)
        require_connector_none(spec, self.name)
        if spec.pipeline is not None:
            raise PlacementRefused("trtllm: agents do not launch it across nodes")
        if (spec.profile.backend or "pytorch") not in self.BACKENDS:
            raise PlacementRefused(f"trtllm: backend must be one of {', '.join(self.BACKENDS)}")

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        p = spec.profile
        argv = [
            tools.which("trtllm-serve") or "trtllm-serve",
            spec.source,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--backend",
            p.backend or "pytorch",
            "--tp_size",
            str(p.tensor_parallel),
        ]
        argv += optional_flags(("--max_seq_len", p.ctx))
        argv += ["--served_model_name", spec.model]
        return Launch(tuple(argv + list(p.extra_args)), {**cuda_env(spec), **p.env}, url_for(ctx))
