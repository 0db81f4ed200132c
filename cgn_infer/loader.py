"""Open a GGUF and build the backend, tokenizer and chat template it describes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cgn_core import bundled_models
from cgn_core.errors import ConfigError
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_infer.backends.base import Backend
from cgn_infer.backends.build import build_part, build_sim
from cgn_infer.grammar import Grammars
from cgn_infer.models import args_from_gguf
from cgn_infer.pipeline.head import connect
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
                backend = connect(gguf, args, settings, part)
            else:
                backend = part((0, args.n_layers))
        else:
            backend = build_sim(args, settings, codec.tokenizer.pieces)
    except BaseException:  # a failed load leaves no file open
        gguf.close()
        raise
    return LoadedModel(backend, codec, Grammars(codec.tokenizer, args.vocab_size), gguf)
