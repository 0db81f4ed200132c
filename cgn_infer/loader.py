"""Open a GGUF and build the backend, tokenizer and chat template it describes."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cgn_core import bundled_models
from cgn_core.errors import ConfigError
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_infer.backends.base import Backend
from cgn_infer.grammar import Grammars
from cgn_infer.models import args_from_gguf
from cgn_infer.models.args import Args
from cgn_infer.settings import InferSettings


@dataclass(slots=True)
class LoadedModel:
    backend: Backend
    codec: PromptCodec
    grammars: Grammars  # structured outputs over this model's vocabulary
    gguf: GGUFFile  # open while the backend serves (its weights are views of the mmap)


def load_model(
    settings: InferSettings, progress: Callable[[int, int], None] | None = None
) -> LoadedModel:
    """Everything needed to serve `settings.model`; errors name the file and the problem."""
    if settings.model is None:
        raise ConfigError("no model given: pass --model PATH (a GGUF file)")
    gguf = GGUFFile(bundled_models.resolve(settings.model))
    try:
        args = args_from_gguf(gguf)
        codec = PromptCodec.from_gguf(gguf)  # before the weights: a bad vocabulary fails fast
        backend: Backend
        if settings.backend in ("torch", "mlx"):

            def part(layers: tuple[int, int]) -> Any:
                return build_part(gguf, args, settings, layers, progress=progress)

            if settings.pipeline.stages:  # the head of a layer pipeline
                from cgn_infer.pipeline.head import connect

                backend = connect(gguf, args, settings, part)
            else:
                backend = part((0, args.n_layers))
        else:
            from cgn_infer.backends.sim_backend import SimBackend, SimCost, word_tokens

            sim = settings.sim
            cost = SimCost(
                sim.step_s, sim.prefill_s_per_token, sim.decode_s_per_seq,
                sim.decode_s_per_ctx_token, sim.speed,
            )  # fmt: skip
            kv_bytes = 4 if settings.kv_dtype == "float32" else 2
            # A simulated model has no position tables: its context is what --ctx asks for.
            sim_args = dataclasses.replace(args, ctx_len=max(args.ctx_len, settings.ctx))
            backend = SimBackend(sim_args, cost, word_tokens(codec.tokenizer.pieces), kv_bytes)
    except BaseException:  # a failed load leaves no file open
        gguf.close()
        raise
    return LoadedModel(backend, codec, Grammars(codec.tokenizer, args.vocab_size), gguf)


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
    _require("torch", "the torch backend needs PyTorch: pip install cognitora-infer")
    from cgn_infer.backends.torch_backend import TorchBackend

    return TorchBackend(
        gguf, args, device=settings.device, weights=settings.weights, kv_dtype=settings.kv_dtype,
        threads=settings.threads, decode_threads=settings.decode_threads, progress=progress,
        layers=layers, ends=ends,
    )  # fmt: skip


def _require(module: str, hint: str) -> None:
    """A missing runtime is a configuration error with the install line, not a traceback."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(hint)
