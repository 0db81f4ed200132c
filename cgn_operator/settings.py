"""cgn-operator's settings tree."""

from dataclasses import dataclass
from pathlib import Path

from cgn_core.settings import LogSettings, ranged


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    namespace: str = "cognitora"  # the namespace it watches ("" : every namespace)
    kubeconfig: Path | None = None  # None: in-cluster service account, else $KUBECONFIG
    image: str = "ghcr.io/cognitora/cognitora:0.1.0"  # components' image unless a cluster names one
    # every resource is reconciled again this often (level-triggered)
    resync_s: float = ranged(30.0, 1, 86400)
    # status reads share one etcd snapshot per cluster this long
    snapshot_ttl_s: float = ranged(2.0, 0, 3600)
    lease: str = "cgn-operator"  # the Lease (in `namespace`) candidates campaign for
    # a leader that cannot renew this long stops; another takes over
    lease_ttl_s: int = ranged(15, 1, 3600)
    standalone: bool = False  # no election: this is the only operator (tests, development)
    log: LogSettings = LogSettings()
