"""Model architectures cgn-infer runs, keyed by GGUF `general.architecture`."""

from __future__ import annotations

from collections.abc import Callable

from cgn_core.text.gguf_file import GGUFError, GGUFFile
from cgn_infer.models import llama, qwen2
from cgn_infer.models.args import Args

ARCHITECTURES: dict[str, Callable[[GGUFFile], Args]] = {
    "llama": llama.args_from_gguf,  # also Mistral GGUFs, which declare `llama`
    "qwen2": qwen2.args_from_gguf,
}


def args_from_gguf(gguf: GGUFFile) -> Args:
    """The model's hyper-parameters, or a clear error for an architecture we do not run."""
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return ARCHITECTURES[arch](gguf)
