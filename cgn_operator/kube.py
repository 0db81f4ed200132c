"""The few Kubernetes API calls the handlers make beyond kopf's own: get, apply, list.

It logs in with the credentials kopf found (in-cluster service account or a kubeconfig;
`kopf.ConnectionInfo`), so the operator has one identity. Children are written by
server-side apply (`fieldManager=cgn-operator`, forced): Kubernetes merges and prunes
the fields this operator owns and leaves the rest to whoever set them. An API server
that does not create on apply (an emulator) gets a plain create after the 404.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import ssl
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from cgn_core.errors import CognitoraError, ConfigError

log = logging.getLogger(__name__)
MANAGER = "cgn-operator"
# The kinds the operator writes: (API group, plural). Its RBAC is made from this table.
KINDS = {
    "ConfigMap": ("", "configmaps"),
    "Secret": ("", "secrets"),
    "Service": ("", "services"),
    "Deployment": ("apps", "deployments"),
    "DaemonSet": ("apps", "daemonsets"),
    "StatefulSet": ("apps", "statefulsets"),
    # spec.gateway.mode epp (cgn_operator/gateway.py): the Gateway API Inference Extension's
    "InferencePool": ("inference.networking.k8s.io", "inferencepools"),
    "InferenceObjective": ("inference.networking.x-k8s.io", "inferenceobjectives"),
}


class KubeError(CognitoraError):
    """The API server refused a request; the message carries its status and reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def object_path(api_version: str, plural: str, namespace: str | None, name: str = "") -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


def path_of(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return object_path(
        obj["apiVersion"], KINDS[obj["kind"]][1], meta.get("namespace"), meta["name"]
    )


def tls_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    """The API server's TLS context from kopf's credentials; ConfigError when they do not load."""
    try:
        return _ssl(info)
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise ConfigError(
            f"the Kubernetes credentials do not load as TLS material: {exc}"
        ) from None


def _ssl(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context()
    if info.ca_path:
        ctx.load_verify_locations(cafile=str(info.ca_path))
    elif info.ca_data:
        ctx.load_verify_locations(cadata=_pem(info.ca_data).decode())
    if info.certificate_path and info.private_key_path:
        ctx.load_cert_chain(str(info.certificate_path), str(info.private_key_path))
    elif info.certificate_data and info.private_key_data:  # a kubeconfig's embedded pair
        with tempfile.TemporaryDirectory(prefix="cgn-operator-kube-") as d:
            cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
            cert.write_bytes(_pem(info.certificate_data))
            key.touch(mode=0o600)
            key.write_bytes(_pem(info.private_key_data))
            ctx.load_cert_chain(str(cert), str(key))  # read now; the files go with the dir
    return ctx


def _pem(data: str | bytes) -> bytes:
    """PEM bytes from a kubeconfig's `*-data` field (base64 of PEM) or PEM itself."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if b"BEGIN" in raw else base64.b64decode(raw)


class Kube:
    """One aiohttp session to the API server (close it with `close`)."""

    def __init__(self, info: kopf.ConnectionInfo):
        headers = {"Accept": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        self._server = info.server.rstrip("/")
        connector = None
        if self._server.startswith("https"):
            connector = aiohttp.TCPConnector(ssl=tls_context(info))
        self._session = aiohttp.ClientSession(
            headers=headers, connector=connector, timeout=aiohttp.ClientTimeout(total=30)
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **params: str,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with self._session.request(
                method, self._server + path, data=data, headers=headers, params=params
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise KubeError(resp.status, f"{method} {path}: {resp.status} {_reason(text)}")
                return json.loads(text) if text else None
        except aiohttp.ClientError as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from None

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return dict(await self._call("GET", path))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def items(self, path: str) -> list[dict[str, Any]]:
        doc = await self._call("GET", path)
        return [i for i in (doc or {}).get("items", []) if isinstance(i, dict)]

    async def apply(self, obj: Mapping[str, Any]) -> None:
        """Create `obj` or bring the fields this operator owns to `obj` (server-side apply)."""
        path = path_of(obj)
        try:
            await self._call(
                "PATCH",
                path,
                obj,
                "application/apply-patch+yaml",
                fieldManager=MANAGER,
                force="true",
            )
        except KubeError as exc:
            if exc.status != 404:
                raise
            ns = obj["metadata"].get("namespace")
            await self._call(
                "POST",
                object_path(obj["apiVersion"], KINDS[obj["kind"]][1], ns),
                obj,
                fieldManager=MANAGER,
            )

    async def create(self, collection: str, body: Mapping[str, Any]) -> None:
        await self._call("POST", collection, body, fieldManager=MANAGER)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> None:
        await self._call("PATCH", path, body, "application/merge-patch+json")

    async def patch_status(self, path: str, status: Mapping[str, Any]) -> None:
        await self.merge_patch(path + "/status", {"status": dict(status)})

    async def warn(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """A Warning Event on `obj` (what `kubectl describe` shows under Events)."""
        meta = obj.get("metadata") or {}
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ns = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name', 'object')}.{uuid.uuid4().hex[:16]}",
                "namespace": ns,
            },
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": ns,
                "uid": meta.get("uid"),
            },
            "type": "Warning",
            "reason": reason,
            "message": message[:1024],
            "source": {"component": MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.create(object_path("v1", "events", ns), event)
        except KubeError as exc:  # an Event is a courtesy: the status says the same
            log.warning("event %s on %s not posted: %s", reason, meta.get("name"), exc.message)


def _reason(text: str) -> str:
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:200]
    return str(doc.get("message") or doc.get("reason") or "")[:200] if isinstance(doc, dict) else ""
