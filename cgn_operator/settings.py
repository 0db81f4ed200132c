"""cgn-operator's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import LogSettings


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    namespace: str = "cognitora"
    kubeconfig: Path | None = None
    log: LogSettings = LogSettings()
