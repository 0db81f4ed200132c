"""cgn-infer command line (typer; see cgn_core.cli for the shared parts)."""

from pathlib import Path
from typing import Annotated

from cgn_core.cli import fail, flag, load_service_settings, make_app, parse_overrides, run
from cgn_core.errors import ConfigError
from cgn_core.logs import setup_logging
from cgn_infer.settings import InferSettings

app = make_app(
    "infer", "Cognitora's native engine: GGUF models behind the OpenAI API.", InferSettings
)


@app.command()
def serve(
    model: Annotated[
        Path | None,
        flag(
            "--model",
            "GGUF file to serve, or a bundled model: smollm2, qwen2.5-coder-0.5b.",
            "CGN_INFER_MODEL",
        ),
    ] = None,
    host: Annotated[str | None, flag("--host", "Listen address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, flag("--port", "Listen port (0: any free port) (default 8001).")
    ] = None,
    ctx: Annotated[int | None, flag("--ctx", "Context length in tokens (default 4096).")] = None,
    threads: Annotated[int | None, flag("--threads", "CPU threads (0: one per core).")] = None,
    decode_threads: Annotated[
        int | None,
        flag("--decode-threads", "Threads for single-stream decode steps (0: --threads)."),
    ] = None,
    backend: Annotated[
        str | None,
        flag(
            "--backend",
            "torch | mlx | sim (modelled compute, deterministic tokens). With "
            "torch, GGUF weights whose every matrix has a C kernel run on the C kernels "
            "alone, without importing torch.",
        ),
    ] = None,
    max_batch: Annotated[
        int | None, flag("--max-batch", "Sequences running at once (default 8).")
    ] = None,
    prefill_chunk: Annotated[
        int | None, flag("--prefill-chunk", "Prompt tokens per step (default 512).")
    ] = None,
    kv_pool_tokens: Annotated[
        int | None,
        flag("--kv-pool-tokens", "KV pool size in tokens (default 16384; on CPU, memory as used)."),
    ] = None,
    kv_dtype: Annotated[
        str | None, flag("--kv-dtype", "KV pool: float16 | bfloat16 | float32 (default float16).")
    ] = None,
    speed: Annotated[
        float | None, flag("--speed", "sim backend: run this many times faster than modelled.")
    ] = None,
    sim_load_s: Annotated[
        float | None,
        flag("--sim-load-s", "sim backend: seconds its weights take to load (a cold start)."),
    ] = None,
    role: Annotated[
        str | None,
        flag(
            "--role",
            "both | prefill | decode: prefill/decode disaggregation (default both; "
            "docs/cgn-infer.md).",
        ),
    ] = None,
    engines: Annotated[
        int | None,
        flag(
            "--engines",
            "sim backend: host this many virtual engines, each on its own port "
            "(--port and the next ones; 0: any free ports) with its own scheduler and pool.",
        ),
    ] = None,
    device: Annotated[
        str | None, flag("--device", "torch device: cpu, cuda, cuda:1 (default cpu).")
    ] = None,
    weights: Annotated[
        str | None,
        flag(
            "--dtype",
            "Weight storage: gguf (default: the file's own quantized blocks, computed on by "
            "cgn-infer's C kernels; float32 for types without one) | float32 | auto (int4 "
            "where Q4_0/Q4_1, else float32) | bfloat16 | float16 | int8 | int4.",
        ),
    ] = None,
    model_name: Annotated[
        str | None, flag("--model-name", "Name clients use (default: the file's stem).")
    ] = None,
    kvcached: Annotated[
        str | None,
        flag("--kvcached", "cgn-kvcached address (host:port): offer blocks, restore prompts."),
    ] = None,
    stages: Annotated[
        str | None,
        flag(
            "--stages",
            "Layer pipeline head: the stages' host:port, comma-separated, in layer order "
            "(each a `cgn-infer stage`); this process keeps the layers before them.",
        ),
    ] = None,
    layers: Annotated[
        str | None,
        flag("--layers", "With --stages: this head's layers FIRST:END (default 0:first stage's)."),
    ] = None,
    activations: Annotated[
        str | None,
        flag(
            "--activations",
            "With --stages: f16 (default) | int8 (~0.27 of f32's bytes: each row's 4 largest "
            "values apart, a scale per 32 values) | f32 (exact: the same output as one process).",
        ),
    ] = None,
    micro_batches: Annotated[
        int | None,
        flag("--micro-batches", "With --stages: groups a step's rows go in (0: one per part)."),
    ] = None,
    lora: Annotated[
        list[str] | None,
        flag(
            "--lora",
            "A LoRA adapter to serve, NAME=PATH (a GGUF LoRA file, llama.cpp's format), "
            "repeatable: a request names it in `model` and may scale it with `lora_scale`.",
        ),
    ] = None,
    config: Annotated[
        Path | None, flag("--config", "YAML settings file.", "CGN_INFER_CONFIG")
    ] = None,
    set_: Annotated[list[str] | None, flag("--set", "Override a setting: --set ctx=8192.")] = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports} here once serving.")
    ] = None,
) -> None:
    """Serve a GGUF model over the OpenAI API (/v1/chat/completions, /v1/completions)."""
    flags = parse_overrides(set_)
    for key, value in {
        "model": model,
        "http.host": host,
        "http.port": port,
        "ctx": ctx,
        "threads": threads,
        "decode_threads": decode_threads,
        "max_batch": max_batch,
        "prefill_chunk": prefill_chunk,
        "kv_pool_tokens": kv_pool_tokens,
        "kv_dtype": kv_dtype,
        "sim.speed": speed,
        "sim.load_s": sim_load_s,
        "sim.engines": engines,
        "role": role,
        "backend": backend,
        "device": device,
        "weights": weights,
        "model_name": model_name,
        "kvcached.address": kvcached,
        "pipeline.stages": stages,
        "pipeline.layers": layers,
        "pipeline.activations": activations,
        "pipeline.micro_batches": micro_batches,
    }.items():
        if value is not None:
            flags[key] = str(value)
    if lora:
        if any("," in v for v in lora):
            fail("--lora: a path with a comma is not supported (settings split lists on it)")
        flags["lora"] = ",".join(lora)
    settings = load_service_settings(InferSettings, "infer", config, flags)
    settings.check_serve()
    setup_logging("infer", settings.log)
    _pin_cpu_path()
    from cgn_infer.daemon import run as run_daemon

    run_daemon(settings, ready_file)


@app.command()
def stage(
    model: Annotated[
        Path | None,
        flag("--model", "The GGUF file the head serves (the same file).", "CGN_INFER_MODEL"),
    ] = None,
    layers: Annotated[
        str | None, flag("--layers", "The layers this stage serves, FIRST:END (END excluded).")
    ] = None,
    part: Annotated[
        str | None,
        flag(
            "--part",
            "Or: part I of an N-part pipeline, I/N (the head is part 0), layers balanced by "
            "weight bytes.",
        ),
    ] = None,
    host: Annotated[str | None, flag("--host", "Listen address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, flag("--port", "Listen port (0: any free port) (default 9101).")
    ] = None,
    head: Annotated[
        str | None,
        flag("--head", "The node id (certificate CN) of the only head this stage serves (TLS)."),
    ] = None,
    threads: Annotated[int | None, flag("--threads", "CPU threads (0: one per core).")] = None,
    weights: Annotated[
        str | None, flag("--dtype", "Weight storage, as for serve (default gguf).")
    ] = None,
    config: Annotated[
        Path | None, flag("--config", "YAML settings file.", "CGN_INFER_CONFIG")
    ] = None,
    set_: Annotated[
        list[str] | None, flag("--set", "Override a setting: --set tls.ca_file=ca.pem.")
    ] = None,
    ready_file: Annotated[
        Path | None, flag("--ready-file", "Write {pid, ports: {pipeline}} here once serving.")
    ] = None,
) -> None:
    """Serve layers FIRST:END of a model to a pipeline head (`serve --stages`) over gRPC."""
    flags = parse_overrides(set_)
    for key, value in {
        "model": model,
        "pipeline.layers": layers,
        "pipeline.part": part,
        "pipeline.host": host,
        "pipeline.port": port,
        "pipeline.head": head,
        "threads": threads,
        "weights": weights,
    }.items():
        if value is not None:
            flags[key] = str(value)
    settings = load_service_settings(InferSettings, "infer", config, flags)
    setup_logging("infer", settings.log)
    _pin_cpu_path()
    from cgn_infer.pipeline.stage import run as run_stage

    run_stage(settings, ready_file)


def _pin_cpu_path() -> None:
    """CGN_CPU_ISA, checked and applied before anything loads torch (kernels/isa.py)."""
    from cgn_infer.kernels.isa import IsaError, pin_torch

    try:
        pin_torch()
    except IsaError as exc:
        raise ConfigError(str(exc)) from None


main = run(app)
