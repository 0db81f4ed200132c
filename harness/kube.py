"""A Kubernetes API for tests and benchmarks: kmock's emulator (by kopf's author), served on
loopback, knowing the built-in kinds (its bundled discovery documents) and our CRDs.

No kube-apiserver runs on these machines (nothing in Debian or PyPI ships one), so this
is the closest: a stateful in-memory API with real list/watch streams over HTTP. What it
does not do, and what tests must therefore not claim: schema validation or pruning,
server-side apply's field ownership (PATCH merges), resourceVersion conflicts, owner
references' garbage collection, admission. Two things are added here: a core-group
discovery fix (kmock 0.8 names the group version "/v1", which kubectl cannot map) and
the uid, generation and creationTimestamp a real server stamps on create.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import yaml

from cgn_operator.crds import GROUP, VERSION, crds


class Emulator(kmock.KubernetesEmulator):
    async def _serve_version(self, request: Any) -> Any:  # type: ignore[override]
        doc = await super()._serve_version(request)
        if isinstance(doc, dict) and isinstance(doc.get("groupVersion"), str):
            doc["groupVersion"] = doc["groupVersion"].lstrip("/")
        return doc

    async def _handle(self, request: Any) -> Any:  # type: ignore[override]
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            meta.setdefault(
                "creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            )
        elif (
            request.action == kmock.action.UPDATE
            and isinstance(request.data, dict)
            and request.subresource is None
            and "spec" in request.data
        ):
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                gen = int(self.objects[key].get("metadata", {}).get("generation") or 1)
                request.data.setdefault("metadata", {})["generation"] = gen + 1
        return await super()._handle(request)


def declare(emu: kmock.KubernetesEmulator) -> None:
    with warnings.catch_warnings():  # kmock 0.8 reads its data with a deprecated importlib call
        warnings.simplefilter("ignore", DeprecationWarning)
        emu.resources.load_bundled()
    for crd in crds():
        names = crd["spec"]["names"]
        emu.resources[f"{GROUP}/{VERSION}/{names['plural']}"] = kmock.ResourceInfo(
            kind=names["kind"],
            singular=names["singular"],
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            subresources={"status"},
        )
    emu.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
        kind="KopfPeering", singular="kopfpeering", namespaced=True,
        verbs={"get", "list", "watch", "create", "patch"},
    )  # fmt: skip


@contextlib.asynccontextmanager
async def serve() -> AsyncIterator[tuple[Emulator, str]]:
    """An emulator on a free loopback port: (emulator, base URL)."""
    async with Emulator() as emu, kmock.Server(emu) as server:
        declare(emu)
        yield emu, str(server.url).rstrip("/")


def kubeconfig(path: Path, url: str) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def wait_for(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    """Poll an async or plain `check` until it returns something truthy (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        await asyncio.sleep(0.05)


async def _serve_forever(url_file: Path) -> None:
    async with serve() as (_, url):
        await asyncio.to_thread(url_file.write_text, url)
        await asyncio.Event().wait()


if __name__ == "__main__":  # `python -m harness.kube URL_FILE`: serve until killed (benchmarks)
    import sys

    asyncio.run(_serve_forever(Path(sys.argv[1])))
