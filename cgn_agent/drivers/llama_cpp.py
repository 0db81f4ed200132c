"""llama.cpp's server, launched one of three ways (profile.launcher):

* `llama_server`: the `llama-server` binary (`-m`, `--alias`, `--metrics`, `-c`, `-t`, `-ngl`);
* `xllamacpp`: llama.cpp's server in-process through the xllamacpp wheel
  (`python -m cgn_agent.launchers.xllamacpp_server`, same metrics);
* `llama_cpp_python`: `python -m llama_cpp.server` (`--model_alias`, `--n_ctx`,
  `--n_threads`, `--n_gpu_layers`); it has neither /health nor /metrics.

`auto` takes the first that is installed, in that order.
"""

from __future__ import annotations

from cgn_agent.drivers.base import (
    Launch,
    LaunchContext,
    PlacementRefused,
    Toolbox,
    cuda_env,
    model_file,
    optional_flags,
    require_connector_none,
    require_gpus,
    require_source,
    url_for,
)
from cgn_agent.inventory.types import Inventory
from cgn_agent.spec import ReplicaSpec

LAUNCHERS = ("llama_server", "xllamacpp", "llama_cpp_python")


def pick_launcher(wanted: str, tools: Toolbox) -> str | None:
    present = {
        "llama_server": tools.which("llama-server") is not None,
        "xllamacpp": tools.has_module("xllamacpp"),
        "llama_cpp_python": tools.has_module("llama_cpp"),
    }
    if wanted == "auto":
        return next((name for name in LAUNCHERS if present[name]), None)
    return wanted if present.get(wanted) else None


class LlamaCppDriver:
    name = "llama_cpp"

    def installed(self, tools: Toolbox) -> bool:
        return pick_launcher("auto", tools) is not None

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        require_source(spec, self.name)
        require_connector_none(spec, self.name)
        wanted = spec.profile.launcher
        if wanted != "auto" and wanted not in LAUNCHERS:
            raise PlacementRefused(
                f"llama_cpp: launcher must be auto or one of {', '.join(LAUNCHERS)}"
            )
        if pick_launcher(wanted, tools) is None:
            raise PlacementRefused(
                "llama_cpp: no llama.cpp server here (llama-server on PATH, "
                "pip install xllamacpp, or pip install 'llama-cpp-python[server]')"
                if wanted == "auto"
                else f"llama_cpp: launcher {wanted} is not installed"
            )
        if not tools.is_file(model_file(spec)):
            raise PlacementRefused(f"llama_cpp: model file {spec.source} does not exist")
        if spec.profile.lora and pick_launcher(wanted, tools) == "llama_cpp_python":
            raise PlacementRefused(
                "llama_cpp: the llama_cpp_python launcher loads no LoRA adapters "
                "(launcher: xllamacpp or llama_server)"
            )
        for f in spec.profile.lora:
            if not tools.is_file(f.path):
                why = f"llama_cpp: LoRA adapter {f.name} ({f.path}) does not exist"
                raise PlacementRefused(why)
        if spec.devices:
            require_gpus(spec, node, self.name, len(spec.devices))

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        p = spec.profile
        launcher = pick_launcher(p.launcher, tools) or "llama_server"
        gpu = bool(spec.devices)
        env = {**(cuda_env(spec) if gpu else {}), **p.env}
        if launcher == "llama_cpp_python":
            argv = _llama_cpp_python(spec, ctx, gpu) + list(p.extra_args)
            return Launch(tuple(argv), env, url_for(ctx), health_path="/v1/models")
        if launcher == "xllamacpp":
            argv = _xllamacpp(spec, ctx, gpu)
        else:
            argv = _llama_server(spec, ctx, gpu, tools.which("llama-server") or "llama-server")
        if ctx.token:  # llama-server (and our runner) read --api-key's LLAMA_API_KEY: not in ps
            env["LLAMA_API_KEY"] = ctx.token
        return Launch(
            tuple(argv + list(p.extra_args)),
            env,
            url_for(ctx),
            metrics_dialect="llamacpp",
            token=ctx.token,
        )


def _serving(ctx: LaunchContext) -> list[str]:
    return ["--host", ctx.host, "--port", str(ctx.port)]


def _adapters(spec: ReplicaSpec) -> list[str]:
    """Each adapter loaded at start and applied to no request but those that ask (llama.cpp's
    per-request `lora: [{id, scale}]`), for llama-server and our xllamacpp launcher alike."""
    paths = [a for f in spec.profile.lora for a in ("--lora", f.path)]
    return [*paths, "--lora-init-without-apply"] if paths else []


def _llama_cpp_python(spec: ReplicaSpec, ctx: LaunchContext, gpu: bool) -> list[str]:
    p = spec.profile
    argv = [ctx.python, "-m", "llama_cpp.server", "--model", model_file(spec)]
    argv += [*_serving(ctx), "--model_alias", spec.model]
    argv += optional_flags(("--n_ctx", p.ctx), ("--n_threads", p.threads))
    return argv + (["--n_gpu_layers", "-1"] if gpu else [])


def _xllamacpp(spec: ReplicaSpec, ctx: LaunchContext, gpu: bool) -> list[str]:
    p = spec.profile
    argv = [ctx.python, "-m", "cgn_agent.launchers.xllamacpp_server", "--model", model_file(spec)]
    argv += [*_serving(ctx), "--alias", spec.model]
    argv += optional_flags(("--ctx", p.ctx), ("--threads", p.threads))
    return argv + (["--n-gpu-layers", "999"] if gpu else []) + _adapters(spec)


def _llama_server(spec: ReplicaSpec, ctx: LaunchContext, gpu: bool, exe: str) -> list[str]:
    p = spec.profile
    argv = [exe, "-m", model_file(spec), *_serving(ctx), "--alias", spec.model, "--metrics"]
    argv += optional_flags(("-c", p.ctx), ("-t", p.threads))
    return argv + (["-ngl", "999"] if gpu else []) + _adapters(spec)
