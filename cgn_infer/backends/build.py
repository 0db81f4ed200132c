"""Which backend a model's settings ask for, built: torch or MLX over some layers (a whole
model, a pipeline head, or a stage), or the sim's cost model. The only place that chooses.

`--backend torch` with `--dtype gguf` on CPU, for a whole model whose every matrix has a C
kernel, builds the C backend (c_backend.py): the same layers without importing torch."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from cgn_core.errors import ConfigError
from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.models.args import Args
from cgn_infer.settings import KV_DTYPE_BYTES, InferSettings

log = logging.getLogger(__name__)


def build_part(
    gguf: GGUFFile,
    args: Args,
    settings: InferSettings,
    layers: tuple[int, int],
    *,
    ends: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """The torch or MLX backend over `layers` (and the embedding and LM head with `ends`):
    a whole model, a pipeline head, or a stage."""
    if settings.backend == "mlx":
        _require("mlx", "the mlx backend needs MLX: pip install 'cognitora-cluster[mlx]'")
        from cgn_infer.backends.mlx_backend import MlxBackend

        return MlxBackend(gguf, args, progress=progress, layers=layers, ends=ends)
    whole = layers == (0, args.n_layers) and ends
    if whole and settings.weights == "gguf" and settings.device == "cpu":
        from cgn_infer.backends import c_backend
        from cgn_infer.kernels import load

        if c_backend.applies(gguf, args) and (lib := load()) is not None:
            log.info("every matrix has a C kernel: the C backend runs the model (no torch)")
            return c_backend.CBackend(
                gguf,
                args,
                lib,
                kv_dtype=settings.kv_dtype,
                threads=settings.threads,
                decode_threads=settings.decode_threads,
                progress=progress,
            )
    _require("torch", "the torch backend needs PyTorch: pip install cognitora-infer")
    from cgn_infer.backends.torch_backend import TorchBackend

    return TorchBackend(
        gguf,
        args,
        device=settings.device,
        weights=settings.weights,
        kv_dtype=settings.kv_dtype,
        threads=settings.threads,
        decode_threads=settings.decode_threads,
        progress=progress,
        layers=layers,
        ends=ends,
    )


def _require(module: str, hint: str) -> None:
    """A missing runtime is a configuration error with the install line, not a traceback."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(hint)


def build_sim(args: Args, settings: InferSettings, pieces: Sequence[str]) -> Any:
    """The simulated backend: the model's shapes and vocabulary, compute replaced by the
    calibrated cost model in `settings.sim`, `speed` times faster."""
    from cgn_infer.backends.sim_backend import SimBackend, SimCost, word_tokens

    sim = settings.sim
    cost = SimCost(
        sim.step_s,
        sim.prefill_s_per_token,
        sim.decode_s_per_seq,
        sim.decode_s_per_ctx_token,
        sim.speed,
    )
    kv_bytes = KV_DTYPE_BYTES[settings.kv_dtype]
    if sim.load_s:  # NOTE: on the loading thread: the listener is up and says "loading"
        time.sleep(sim.load_s)
    # A simulated model has no position tables: its context is what --ctx asks for.
    sim_args = dataclasses.replace(args, ctx_len=max(args.ctx_len, settings.ctx))
    return SimBackend(sim_args, cost, word_tokens(pieces), kv_bytes)
