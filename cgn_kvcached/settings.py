"""cgn-kvcached's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings


@dataclass(frozen=True, slots=True)
class KvcachedSettings:
    grpc: ListenSettings = ListenSettings(port=7071)
    admin: ListenSettings = ListenSettings(port=9094)
    ram_bytes: int = 4 << 30
    ssd_dir: Path | None = None
    ssd_bytes: int = 0
    tls: TlsSettings = TlsSettings()
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
