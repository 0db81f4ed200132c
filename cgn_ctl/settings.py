"""cgn-ctl's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import EtcdSettings, LogSettings


@dataclass(frozen=True, slots=True)
class CtlSettings:
    # Without --etcd (or an etcd set here, by CGN_CTL_ETCD__ENDPOINTS or in YAML), commands
    # use the etcd that `cgn-ctl up` started, as recorded in state_dir/up.json.
    etcd: EtcdSettings = EtcdSettings()
    state_dir: Path = Path.home() / ".local/state/cognitora"
    log: LogSettings = LogSettings(level="error")  # a CLI: only errors on stderr
    # cgn-metrics' base URL for `top` ("": the one `cgn-ctl up` started, else 127.0.0.1:9092).
    metrics_url: str = ""
    # The routers' admission bands (their admission.bands): `keys create` refuses others.
    bands: tuple[str, ...] = ("platinum", "gold", "bronze")
