"""cgn-agent's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings


@dataclass(frozen=True, slots=True)
class AgentSettings:
    node_id: str = ""  # empty: derived once from the machine and kept in state_dir
    state_dir: Path = Path("/var/lib/cognitora/agent")
    admin: ListenSettings = ListenSettings(port=9093)
    lease_ttl_s: int = 10
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
