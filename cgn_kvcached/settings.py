"""cgn-kvcached's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings


@dataclass(frozen=True, slots=True)
class KvcachedSettings:
    grpc: ListenSettings = ListenSettings(port=7071)
    admin: ListenSettings = ListenSettings(port=9094)
    ram_bytes: int = 4 << 30  # the RAM tier's budget
    ssd_dir: Path | None = None  # the SSD tier's directory; None: RAM only
    ssd_bytes: int = 0  # the SSD tier's budget
    write_through: bool = False  # also write every block to the SSD at once (default: on eviction)
    tls: TlsSettings = TlsSettings()
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
