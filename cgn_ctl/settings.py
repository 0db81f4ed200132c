"""cgn-ctl's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import EtcdSettings, LogSettings


@dataclass(frozen=True, slots=True)
class CtlSettings:
    etcd: EtcdSettings = EtcdSettings()
    state_dir: Path = Path.home() / ".local/state/cognitora"
    log: LogSettings = LogSettings(level="error")  # a CLI: only errors on stderr
