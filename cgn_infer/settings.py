"""cgn-infer's settings tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.settings import ListenSettings, LogSettings


@dataclass(frozen=True, slots=True)
class InferSettings:
    http: ListenSettings = ListenSettings(port=8001)
    pipeline: ListenSettings = ListenSettings(port=9101)
    model: Path | None = None
    backend: Literal["torch", "mlx", "sim"] = "torch"
    ctx: int = 4096
    threads: int = 0  # 0: one per physical core
    log: LogSettings = LogSettings()
