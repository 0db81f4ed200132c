"""cgn-infer's settings tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.settings import ListenSettings, LogSettings


@dataclass(frozen=True, slots=True)
class InferSettings:
    http: ListenSettings = ListenSettings(port=8001)
    pipeline: ListenSettings = ListenSettings(port=9101)
    model: Path | None = None  # a GGUF file
    model_name: str = ""  # the name clients ask for; empty: the GGUF file's stem
    backend: Literal["torch", "mlx", "sim"] = "torch"
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...
    # Weight storage after dequantizing the GGUF: float32 tracks llama.cpp's logits
    # best; bfloat16 halves the memory; int8 and int4 (CPU) decode faster at a
    # fidelity cost (figures in docs/cgn-infer.md).
    weights: Literal["bfloat16", "float16", "float32", "int8", "int4"] = "float32"
    ctx: int = 4096
    threads: int = 0  # 0: torch's default (one per core); used for prompt processing
    decode_threads: int = 0  # 0: threads - 1 (at least 1), leaving a core to the server
    prefill_chunk: int = 512
    log: LogSettings = LogSettings()
