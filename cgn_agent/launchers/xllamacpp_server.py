"""llama.cpp's own server, run in-process through the xllamacpp wheel (no compiler, no binary).

    python -m cgn_agent.launchers.xllamacpp_server --model M.gguf --port 8002 --alias smollm2

Serves /health, /v1/models (listing --alias), the OpenAI endpoints and
Prometheus /metrics (as `llama-server --metrics`) until SIGTERM, then exits at
once: the agent sends SIGTERM when a drain has outlasted its grace, and a
stream still open is the router's to continue elsewhere. (The wheel's server
teardown waits up to 30 s for each open stream's handler, holding the GIL: a
router saw those streams stall for 30 s before they broke.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="xllamacpp_server", description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--alias", default="")
    ap.add_argument("--ctx", type=int, default=4096, help="context per sequence")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="0: llama.cpp's default")
    ap.add_argument("--n-gpu-layers", type=int, default=None, help="default: llama.cpp's")
    ap.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp's flash-attention kernel (auto: where supported)",
    )
    ap.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH",
        help="a GGUF LoRA adapter applied at scale 1 (repeatable), as llama-server's --lora",
    )
    ap.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        help="load the adapters at scale 0: a request applies them with its `lora` field",
    )
    args = ap.parse_args(argv)

    import xllamacpp  # type: ignore[import-untyped]

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    if args.alias:
        params.model_alias = {args.alias}  # a set of names /v1/models lists
    if args.threads:
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx * args.parallel
    if args.n_gpu_layers is not None:
        params.n_gpu_layers = args.n_gpu_layers
    fa = xllamacpp.llama_flash_attn_type
    params.flash_attn_type = {
        "auto": fa.LLAMA_FLASH_ATTN_TYPE_AUTO,
        "on": fa.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off": fa.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[args.flash_attn]
    params.endpoint_metrics = True
    adapters = []
    for path in args.lora:
        info = xllamacpp.CommonAdapterLoraInfo()
        # NOTE: the wheel's server reads each adapter's scale as the requests' default;
        # the flag alone left them applied (a test saw the base answer change)
        info.path, info.scale = path, 0.0 if args.lora_init_without_apply else 1.0
        adapters.append(info)
    params.lora_adapters = adapters
    params.lora_init_without_apply = args.lora_init_without_apply
    if key := os.environ.get("LLAMA_API_KEY"):  # as llama-server reads it: never on argv
        params.api_keys = [key]
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    _server = xllamacpp.Server(params)  # held until the exit: dropped, it would stop
    done.wait()
    # NOTE: no teardown: the kernel closes every connection and frees the model; nothing
    # here is kept across a restart (a slot saved to disk is saved by request)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
