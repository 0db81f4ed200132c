"""Leader election over a Kubernetes Lease (coordination.k8s.io/v1), as controllers do.

    campaign ──Lease free, expired or ours──> leading ──renew every ttl/3──> leading
        ^                                         │
        └──── held by another, not expired ───────┘ renew fails for a whole ttl: lost

Only the leader runs the kopf handlers and the resync loop; the others wait in
`campaign`. A leader that cannot renew for `ttl_s` stops (the process exits and its
Deployment restarts it as a candidate), so two operators never both act for longer
than one lease term. Writes carry the Lease's resourceVersion, so the API server
refuses a write based on a stale read (two candidates cannot both take a free Lease).

Why not kopf's peering: it pauses kopf's own handlers, not a loop of ours, and it
needs a KopfPeering resource type; why not our etcd election: each cluster has its own
etcd, and the embedded one does not exist until the operator has created it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from cgn_operator.kube import Kube, KubeError, object_path

log = logging.getLogger(__name__)
_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"  # MicroTime


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _time(raw: Any) -> dt.datetime | None:
    if not isinstance(raw, str):
        return None
    for fmt in (_FMT, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return dt.datetime.strptime(raw, fmt).replace(tzinfo=dt.UTC)
        except ValueError:
            continue
    return None


def free_for(spec: Mapping[str, Any], me: str, now: dt.datetime) -> bool:
    """Whether `me` may take or keep a Lease with this spec (pure): it is ours, unheld, or
    its holder has not renewed within its duration."""
    holder = spec.get("holderIdentity")
    if not holder or holder == me:
        return True
    renewed = _time(spec.get("renewTime")) or _time(spec.get("acquireTime"))
    ttl = spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(ttl, int):
        return True  # a malformed record holds nothing
    return now - renewed > dt.timedelta(seconds=ttl)


class Lease:
    def __init__(self, kube: Kube, namespace: str, name: str, me: str, ttl_s: int = 15):
        self.kube, self.me, self.ttl_s = kube, me, ttl_s
        self.path = object_path("coordination.k8s.io/v1", "leases", namespace, name)
        self.namespace, self.name = namespace, name

    async def try_take(self) -> bool:
        """One attempt to take or renew the Lease; True when this candidate holds it."""
        now = _now()
        current = await self.kube.get(self.path)
        spec = {
            "holderIdentity": self.me,
            "leaseDurationSeconds": self.ttl_s,
            "renewTime": now.strftime(_FMT),
        }
        if current is None:
            spec["acquireTime"] = spec["renewTime"]
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": spec,
            }
            try:
                await self.kube.create(self.path.rsplit("/", 1)[0], body)
            except KubeError as exc:
                if exc.status == 409:  # another candidate created it first
                    return False
                raise
            return True
        held = current.get("spec") or {}
        if not free_for(held, self.me, now):
            return False
        if held.get("holderIdentity") != self.me:
            spec["acquireTime"] = spec["renewTime"]
        version = (current.get("metadata") or {}).get("resourceVersion")
        patch: dict[str, Any] = {"spec": spec}
        if version:
            patch["metadata"] = {"resourceVersion": version}
        try:
            await self.kube.merge_patch(self.path, patch)
        except KubeError as exc:
            if exc.status == 409:  # the Lease changed since we read it: someone else won
                return False
            raise
        return True

    async def campaign(self) -> None:
        """Return once this candidate holds the Lease."""
        while True:
            try:
                if await self.try_take():
                    log.info("leading: Lease %s/%s held by %s", self.namespace, self.name, self.me)
                    return
            except KubeError as exc:
                log.warning("lease: %s", exc.message)
            await asyncio.sleep(self.ttl_s / 3)

    async def keep(self) -> None:
        """Renew every ttl/3; return when the Lease was lost (another holds it, or renewing
        failed for a whole term)."""
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                if not await self.try_take():
                    log.error(
                        "lease: %s/%s is held by another; stopping", self.namespace, self.name
                    )
                    return
                last = asyncio.get_running_loop().time()
            except KubeError as exc:
                if asyncio.get_running_loop().time() - last > self.ttl_s:
                    log.error("lease: not renewed for %ss (%s); stopping", self.ttl_s, exc.message)
                    return
                log.warning("lease: renewal failed (%s); retrying", exc.message)
