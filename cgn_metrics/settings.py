"""cgn-metrics' settings tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.errors import ConfigError
from cgn_core.settings import EtcdSettings, ListenSettings, LogSettings, TlsSettings, ranged
from cgn_metrics.targets import static_targets


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    http: ListenSettings = ListenSettings(port=9092)
    # etcd: agents, engines and kvcached daemons from the cluster's records; static: only
    # `targets`
    discovery: Literal["etcd", "static"] = "etcd"
    # KIND=URL (KIND: router, agent, engine, kvcached, other) or URL; routers do not
    # register in etcd, so list them here
    targets: tuple[str, ...] = ()
    scrape_interval_s: float = ranged(5.0, 0.01, 3600)
    # a target slower than this is down for the round
    scrape_timeout_s: float = ranged(2.0, 0.01, 3600)
    scrape_concurrency: int = ranged(32, 1, 4096)  # targets scraped at once
    # rates, percentiles and energy per token are over this
    window_s: float = ranged(60.0, 0.1, 86400)
    retention_s: float = ranged(3600.0, 1, 604800)  # history kept for the dashboard's charts
    # Write a Prometheus file_sd target list here on every change (a site's own Prometheus
    # scrapes the fleet directly); None: off
    file_sd: Path | None = None
    # With discovery etcd: write each measured node's output tokens per joule to
    # /cognitora/efficiency/<node> this often (placement's tie-break and the router's
    # `efficiency` scorer read it); 0: never
    efficiency_publish_s: float = ranged(30.0, 1, 86400)
    tls: TlsSettings = TlsSettings()  # client certificate and CA for https targets
    etcd: EtcdSettings = EtcdSettings()
    log: LogSettings = LogSettings()

    def check(self) -> None:
        if self.window_s < 2 * self.scrape_interval_s:
            raise ConfigError("window_s must cover at least two scrape intervals")
        if self.retention_s < self.window_s:
            raise ConfigError("retention_s must be at least window_s")
        try:
            static_targets(self.targets)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
