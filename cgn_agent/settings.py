"""cgn-agent's settings tree (flag > CGN_AGENT_* env > YAML > defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cgn_agent.supervisor import Policy
from cgn_core.errors import ConfigError
from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings, ranged


@dataclass(frozen=True, slots=True)
class EngineHostSettings:
    """Where engines listen, and the address the router is told to reach them at."""

    bind_host: str = ""  # empty: the advertised address (0.0.0.0 must be asked for)
    advertise_host: str = ""  # empty: this machine's primary address
    stop_grace_s: float = ranged(30.0, 0, 3600)  # SIGTERM, then SIGKILL after this long
    probe_interval_s: float = ranged(2.0, 0.01, 3600)  # readiness/liveness probes of Ready engines
    probe_timeout_s: float = ranged(3.0, 0.01, 3600)
    stop_on_exit: bool = False  # stop engines when the agent exits (default: keep serving)
    # cgn-infer engines serve HTTPS with this certificate (usually the node's) and require the
    # caller's from the same CA on /v1/*; the agent presents it when probing. Empty: HTTP.
    tls: TlsSettings = TlsSettings()
    # The engines this node offers placements for (empty: every one installed here). Several
    # agents on one machine, each offering one engine, make a mixed fleet there (cgn-ctl up
    # --engines); a placement for an engine not offered is refused.
    offer: tuple[str, ...] = ()

    def check(self) -> None:
        from cgn_agent.drivers import DRIVERS

        if unknown := [e for e in self.offer if e not in DRIVERS]:
            raise ConfigError(
                f"engines.offer: {', '.join(unknown)} is not an engine "
                f"(engines: {', '.join(DRIVERS)})"
            )


@dataclass(frozen=True, slots=True)
class PowerSettings:
    interval_s: float = ranged(5.0, 0.1, 3600)
    powermetrics: bool = False  # Apple: run `powermetrics` (needs root)


@dataclass(frozen=True, slots=True)
class NodeKvcachedSettings:
    """The node's KV store, cgn-kvcached (modes and flags: cgn_agent/kvcached.py)."""

    mode: Literal["off", "run", "external"] = "off"
    port: int = ranged(7071, 1, 65535)  # its gRPC listener
    admin_port: int = ranged(9094, 1, 65535)  # /metrics, /healthz, /v1/kv/events
    ram_bytes: int = ranged(4 << 30, 1 << 20, 1 << 44)
    ssd_dir: Path | None = None  # run mode; None: RAM only
    ssd_bytes: int = ranged(0, 0, 1 << 50)
    events_token: str = ""  # external mode: the token its unit was given (run: generated)
    # The node secret (cgn_core/kv/identity.py); engines get its client token. Run mode:
    # default <state_dir>/kvcached.secret, made on first start. External mode: the file the
    # unit's kvcached.yaml names (unset: the store must run without one; development only).
    secret_file: Path | None = None
    # vLLM/SGLang built-in CPU offload per engine; 0: none
    engine_offload_gib: float = ranged(0.0, 0, 65536)

    def check(self) -> None:
        if self.mode == "run" and (self.ssd_dir is None) != (self.ssd_bytes == 0):
            raise ConfigError("ssd_dir and ssd_bytes go together")


@dataclass(frozen=True, slots=True)
class AgentSettings:
    node_id: str = ""  # empty: derived once from the machine and kept in state_dir
    state_dir: Path = Path("/var/lib/cognitora/agent")
    admin: ListenSettings = ListenSettings(port=9093)
    admin_tls: TlsSettings = TlsSettings()  # HTTPS; management paths need a client certificate
    lease_ttl_s: int = ranged(10, 1, 3600)
    inventory_interval_s: float = ranged(30.0, 0.1, 86400)  # re-read GPU health and memory holders
    labels: dict[str, str] = field(default_factory=dict)
    # Where placements may load model files from (a placement naming any other path is
    # refused); bundled models and, for hub engines, Hugging Face repo ids need none.
    model_dirs: tuple[Path, ...] = ()
    engines: EngineHostSettings = EngineHostSettings()
    kvcached: NodeKvcachedSettings = NodeKvcachedSettings()  # the node's KV store (kvcached.py)
    supervisor: Policy = Policy()
    power: PowerSettings = PowerSettings()
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
