"""cgn-operator's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import LogSettings


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    namespace: str = "cognitora"  # the namespace it watches ("" : every namespace)
    kubeconfig: Path | None = None  # None: in-cluster service account, else $KUBECONFIG
    image: str = "ghcr.io/cognitora/cognitora:0.1.0"  # components' image unless a cluster names one
    resync_s: float = 30.0  # every resource is reconciled again this often (level-triggered)
    snapshot_ttl_s: float = 2.0  # status reads share one etcd snapshot per cluster this long
    lease: str = "cgn-operator"  # the Lease (in `namespace`) candidates campaign for
    lease_ttl_s: int = 15  # a leader that cannot renew this long stops; another takes over
    standalone: bool = False  # no election: this is the only operator (tests, development)
    log: LogSettings = LogSettings()
