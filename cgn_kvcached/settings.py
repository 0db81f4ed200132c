"""cgn-kvcached's settings tree."""

import os
from dataclasses import dataclass
from pathlib import Path

from cgn_core.errors import ConfigError
from cgn_core.settings import (
    EtcdSettings,
    ListenSettings,
    LogSettings,
    TlsSettings,
    TracingSettings,
    ranged,
)


@dataclass(frozen=True, slots=True)
class KvcachedSettings:
    grpc: ListenSettings = ListenSettings(port=7071)
    admin: ListenSettings = ListenSettings(port=9094)
    ram_bytes: int = ranged(4 << 30, 1 << 20, 1 << 44)  # the RAM tier's budget
    ssd_dir: Path | None = None  # the SSD tier's directory; None: RAM only
    ssd_bytes: int = ranged(0, 0, 1 << 50)  # the SSD tier's budget
    write_through: bool = False  # also write every block to the SSD at once (default: on eviction)
    # Same-node clients move blocks through files here instead of gRPC messages (a tmpfs;
    # made 0700 at start, so engines must run as the same user). None: not offered.
    shm_dir: Path | None = Path("/dev/shm/cognitora-kv")
    # /v1/kv/events on the admin listener needs `Authorization: Bearer <events_token>` (the
    # agent sets one and publishes it to routers); empty: open (development only).
    events_token: str = ""
    # The node secret (cgn_core/kv/identity.py: 64 hex digits, mode 0600, owned by this user):
    # engines need its client token, Evict/Clear its admin token, SSD blocks are sealed with
    # it. Unset: any local process may read and write blocks (development only; logged).
    secret_file: Path | None = None
    tls: TlsSettings = TlsSettings()
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
    tracing: TracingSettings = TracingSettings()  # spans for Get and Put (cgn_core/tracing.py)

    def check(self) -> None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.ram_bytes > memory:
            raise ConfigError(
                f"ram_bytes ({self.ram_bytes}) is more than this machine's memory ({memory})"
            )
        if self.ssd_dir is not None and self.ssd_bytes < 1 << 20:
            raise ConfigError(
                f"ssd_bytes must be at least 1 MiB with ssd_dir, got {self.ssd_bytes}"
            )
        if self.ssd_dir is None and self.ssd_bytes:
            raise ConfigError("ssd_bytes is set but ssd_dir is not")
