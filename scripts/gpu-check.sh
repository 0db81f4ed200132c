#!/bin/sh
# A device check on a machine with NVIDIA GPUs (issue #62): the real vLLM under Cognitora,
# from inventory to drain, one table; exit 0 all passed, 1 a check failed, 2 no GPU/vLLM.
#   sh scripts/setup-dev.sh && .venv/bin/pip install vllm   # once
#   sh scripts/gpu-check.sh --model /models/Qwen2.5-0.5B-Instruct
set -eu
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/gpu_check.py "$@"
