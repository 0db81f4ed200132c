"""Open a GGUF and build the backend, tokenizer and chat template it describes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cgn_core import bundled_models
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_infer.adapters import Adapters
from cgn_infer.backends.base import Backend
from cgn_infer.backends.build import build_part, build_sim
from cgn_infer.grammar import Grammars
from cgn_infer.models import args_from_gguf
from cgn_infer.models.args import Args
from cgn_infer.pipeline.head import connect
from cgn_infer.settings import InferSettings, parse_lora_flag


@dataclass(slots=True)
class LoadedModel:
    backend: Backend
    codec: PromptCodec
    grammars: Grammars  # structured outputs over this model's vocabulary
    gguf: GGUFFile  # open while the backend serves (its weights are views of the mmap)
    adapters: Adapters | None = None  # the LoRA adapters it serves (--lora)


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
        adapters = None
        if settings.backend == "torch" and (settings.lora or settings.lora_dirs):
            adapters = make_adapters(settings, gguf, args)
            set_lora = getattr(backend, "set_lora", None)
            if set_lora is None:  # a pipeline head's layers are not all here
                raise ConfigError("LoRA adapters run with every layer in one process")
            set_lora(adapters.tables)
    except BaseException:  # a failed load leaves no file open
        gguf.close()
        raise
    grammars = Grammars(codec.tokenizer, args.vocab_size)
    return LoadedModel(backend, codec, grammars, gguf, adapters)


def make_adapters(settings: InferSettings, gguf: GGUFFile, args: Args) -> Adapters:
    """An engine's adapter slots (`max_loras`) with the --lora adapters loaded, pinned, each
    checked against the model; a bad file is a ConfigError naming it. The torch backend's
    one engine gets one (its tables are the layers'); each sim engine its own."""
    name = settings.model_name or gguf.path.stem
    load_s = settings.sim.lora_load_s if settings.backend == "sim" else 0.0
    adapters = Adapters(name, gguf.path, args, args.n_layers, settings.max_loras, load_s)
    for value in settings.lora:
        adapter, path = parse_lora_flag(value)
        try:
            adapters.install(adapter, adapters.read(path), pin=True)
        except CognitoraError as exc:
            raise ConfigError(f"--lora {value}: {exc.message}") from None
    return adapters
