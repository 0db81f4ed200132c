"""cgn-router's settings tree."""

from dataclasses import dataclass, field

from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings


@dataclass(frozen=True, slots=True)
class RouterSettings:
    http: ListenSettings = ListenSettings(port=8080)  # the OpenAI surface
    admin: ListenSettings = ListenSettings(port=9091)  # /metrics, /healthz, /readyz
    tls: TlsSettings = TlsSettings()  # HTTPS on the OpenAI surface when set
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()
    # Engines to route to without etcd (router-only runs): name -> base URL.
    static_endpoints: dict[str, str] = field(default_factory=dict)
