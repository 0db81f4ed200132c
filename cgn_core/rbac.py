"""etcd roles for the cluster's identities: what each certificate may read and write (pure).

With etcd's `--client-cert-auth` and auth enabled, a client certificate's CN
is its etcd user. Cognitora's certificates carry the node id as CN, so:

* every node `N` gets role `cgn-node-N`: read and write its own inventory
  (`/cognitora/nodes/N`), replica statuses (`/cognitora/replicas/N/`) and
  endpoints (`/cognitora/endpoints/N/`); read its own placements
  (`/cognitora/placements/N/`) and the certificate deny-list
  (`/cognitora/revoked/`). Nothing else: a node cannot place work on
  another, publish endpoints for another, or read API keys.
* a node that runs a router also gets `cgn-router`: read all of
  `/cognitora/`, write placements (the reconciler), the leader keys, the
  tenants' usage counts (budgets) and who waits there (fair shares).
* a node that runs cgn-metrics gets `cgn-metrics`: read all of `/cognitora/`,
  write the measured node efficiencies (`/cognitora/efficiency/`).
* an operator identity (`cgn-ctl`) gets `root`; etcd requires a user named
  `root` before auth can be enabled, so `root` is always one of them.

`plan` returns the roles and users; `cgn-ctl pki rbac` applies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cgn_core import keys

Perm = Literal["read", "write", "readwrite"]
ROUTER_ROLE = "cgn-router"
METRICS_ROLE = "cgn-metrics"
ROOT = "root"


@dataclass(frozen=True, slots=True)
class Grant:
    key: str
    range_end: str  # "" for the key alone; prefix_end(key) for everything under it
    perm: Perm


@dataclass(frozen=True, slots=True)
class Plan:
    roles: dict[str, tuple[Grant, ...]]
    users: dict[str, tuple[str, ...]]  # user (a certificate CN) -> roles


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return "\0"  # every key
    raw[-1] += 1
    return raw.decode("latin-1")


def under(prefix: str, perm: Perm) -> Grant:
    return Grant(prefix, prefix_end(prefix), perm)


def node_role(node: str) -> tuple[Grant, ...]:
    return (
        Grant(keys.NODES + node, "", "readwrite"),
        under(f"{keys.REPLICAS}{node}/", "readwrite"),
        under(f"{keys.ENDPOINTS}{node}/", "readwrite"),
        Grant(keys.KVCACHED + node, "", "readwrite"),  # its KV store's record
        under(f"{keys.PLACEMENTS}{node}/", "read"),
        under(keys.REVOKED, "read"),  # its admin listener refuses revoked certificates
    )


ROUTER_GRANTS = (
    under(keys.ROOT, "read"),
    under(keys.PLACEMENTS, "readwrite"),
    under(keys.SCALING, "readwrite"),  # the autoscaler's decisions, for explain-scaling
    under(keys.LEADER, "readwrite"),
    under(keys.USAGE, "readwrite"),  # each worker's count of tenants' usage (budgets)
    under(keys.WAITING, "readwrite"),  # the tenants each worker has waiting (fair shares)
)
METRICS_GRANTS = (
    under(keys.ROOT, "read"),
    under(keys.EFFICIENCY, "readwrite"),
)


def plan(
    nodes: Iterable[str],
    routers: Iterable[str] = (),
    admins: Iterable[str] = (),
    metrics: Iterable[str] = (),
) -> Plan:
    """Roles and users for these node ids, the node ids that run routers (and cgn-metrics),
    and operators."""
    roles: dict[str, tuple[Grant, ...]] = {ROUTER_ROLE: ROUTER_GRANTS, METRICS_ROLE: METRICS_GRANTS}
    users: dict[str, list[str]] = {ROOT: [ROOT]}
    for node in nodes:
        roles[f"cgn-node-{node}"] = node_role(node)
        users.setdefault(node, []).append(f"cgn-node-{node}")
    for router in routers:
        users.setdefault(router, []).append(ROUTER_ROLE)
    for node in metrics:
        users.setdefault(node, []).append(METRICS_ROLE)
    for admin in admins:
        users.setdefault(admin, []).append(ROOT)
    return Plan(roles, {u: tuple(dict.fromkeys(r)) for u, r in users.items()})
