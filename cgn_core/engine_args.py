"""What a placement may add to an engine's command line and environment: an allow-list per engine.

A placement (or a catalog profile) is written by whoever can write to etcd,
and the agent runs what it says as its own user. So `extra_args` and `env`
are checked against the lists below before anything starts: a flag not
listed, a flag that names a file the engine would write or read code from
(`--ready-file`, `--trust-remote-code`, `--chat-template`, `--ssl-*`), a
positional argument, and any environment variable not listed are refused
with the reason in the replica's status. Names under `FORBIDDEN_ENV_PREFIXES`
(`LD_*`, `DYLD_*`, `PYTHON*`) are refused even if someone lists them. The
agent's own flags (`--host`, `--port`, `--model`, the served name, devices)
are never allowed here: the driver sets those.

`check(engine, extra_args, env)` is pure: `cgn-ctl models apply` runs it to
refuse a bad catalog early, and the agent runs it on every placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FORBIDDEN_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON")


@dataclass(frozen=True, slots=True)
class ArgPolicy:
    flags: Mapping[str, bool]  # flag -> whether it takes a value
    env: frozenset[str] = frozenset()


def _flags(valued: str = "", switches: str = "") -> dict[str, bool]:
    return {**{f: True for f in valued.split()}, **{f: False for f in switches.split()}}


_THREADS_ENV = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
_CUDA_ENV = frozenset(
    {
        "NCCL_DEBUG",
        "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE",
        "NCCL_SOCKET_IFNAME",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "PYTORCH_CUDA_ALLOC_CONF",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TOKENIZERS_PARALLELISM",
    }
)

POLICIES: dict[str, ArgPolicy] = {
    "cgn_infer": ArgPolicy(
        _flags(
            "--max-batch --prefill-chunk --kv-pool-tokens --kv-dtype --decode-threads "
            "--speed --sim-load-s"
        ),
        _THREADS_ENV,
    ),
    "llama_cpp": ArgPolicy(
        _flags(
            "--ctx-size -c --n-gpu-layers -ngl --batch-size -b --ubatch-size -ub --parallel -np "
            "--threads-batch -tb --cache-type-k -ctk --cache-type-v -ctv --flash-attn -fa "
            "--defrag-thold --rope-scaling --rope-freq-base --split-mode -sm --main-gpu -mg",
            "--cont-batching -cb --no-cont-batching --mlock --no-mmap --no-kv-offload",
        ),
        _THREADS_ENV | {"GGML_CUDA_NO_PINNED"},
    ),
    "vllm": ArgPolicy(
        _flags(
            "--max-num-seqs --max-num-batched-tokens --kv-cache-dtype --block-size --swap-space "
            "--cpu-offload-gb --quantization --seed --pipeline-parallel-size --max-logprobs "
            "--num-scheduler-steps --speculative-config --revision --tokenizer-mode "
            "--distributed-executor-backend",
            "--enable-prefix-caching --no-enable-prefix-caching --enable-chunked-prefill "
            "--no-enable-chunked-prefill --enforce-eager --disable-log-stats "
            "--disable-log-requests --disable-custom-all-reduce",
        ),
        _CUDA_ENV
        | {
            "VLLM_ATTENTION_BACKEND",
            "VLLM_USE_V1",
            "VLLM_LOGGING_LEVEL",
            "VLLM_WORKER_MULTIPROC_METHOD",
        },
    ),
    "sglang": ArgPolicy(
        _flags(
            "--max-running-requests --max-total-tokens --chunked-prefill-size --schedule-policy "
            "--kv-cache-dtype --quantization --random-seed --dp-size --attention-backend "
            "--schedule-conservativeness --revision",
            "--disable-radix-cache --disable-cuda-graph --enable-torch-compile "
            "--enable-mixed-chunk --disable-overlap-schedule",
        ),
        _CUDA_ENV,
    ),
    "trtllm": ArgPolicy(
        _flags(
            "--max_batch_size --max_num_tokens --max_beam_width "
            "--kv_cache_free_gpu_memory_fraction --pp_size --ep_size"
        ),
        _CUDA_ENV,
    ),
    "mlx_lm": ArgPolicy(_flags("--max-tokens --temp --top-p"), frozenset()),
    "openai_compat": ArgPolicy({}, frozenset()),  # nothing is started: nothing to add
}


class ArgsRefused(ValueError):
    """An extra argument or environment variable a placement may not set; says which."""


def check(engine: str, extra_args: Sequence[str], env: Mapping[str, str]) -> None:
    """Raise ArgsRefused when `extra_args` or `env` go beyond what `engine` allows."""
    policy = POLICIES.get(engine)
    if policy is None:
        raise ArgsRefused(f"no argument policy for engine {engine!r}")
    _check_env(engine, policy, env)
    i = 0
    while i < len(extra_args):
        arg = extra_args[i]
        name, eq, _ = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if not name.startswith("-"):
            raise ArgsRefused(f"{engine}: extra_args may hold flags only, got {arg!r}")
        if name not in policy.flags:
            raise ArgsRefused(
                f"{engine}: flag {name} is not allowed in extra_args "
                f"(allowed: {', '.join(sorted(policy.flags)) or 'none'})"
            )
        takes_value = policy.flags[name]
        if eq and not takes_value:
            raise ArgsRefused(f"{engine}: flag {name} takes no value")
        if takes_value and not eq:
            if i + 1 >= len(extra_args):
                raise ArgsRefused(f"{engine}: flag {name} needs a value")
            i += 1
        i += 1


def _check_env(engine: str, policy: ArgPolicy, env: Mapping[str, str]) -> None:
    for name in sorted(env):
        if name.upper().startswith(FORBIDDEN_ENV_PREFIXES):
            raise ArgsRefused(f"{engine}: environment variable {name} is never allowed")
        if name not in policy.env:
            allowed = ", ".join(sorted(policy.env)) or "none"
            raise ArgsRefused(
                f"{engine}: environment variable {name} is not allowed (allowed: {allowed})"
            )
