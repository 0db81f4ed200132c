"""`cgn-operator run`: log in, campaign for the leader Lease, then run the kopf handlers
and the resync loop until stopped or the Lease is lost."""

from __future__ import annotations

import asyncio
import os
import socket

import kopf
import yaml

from cgn_core.errors import CognitoraError, ConfigError
from cgn_operator.handlers import build
from cgn_operator.kube import tls_context
from cgn_operator.lease import Lease
from cgn_operator.state import State


def _identity() -> str:
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def login() -> kopf.ConnectionInfo:
    settings = kopf.OperatorSettings()
    try:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
    except (kopf.LoginError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = os.environ.get("KUBECONFIG") or "the kubeconfig"
        raise ConfigError(f"{where}: not a usable kubeconfig ({first})") from None
    if info is None:
        raise ConfigError(
            "no Kubernetes credentials: not in a pod and no kubeconfig "
            "(--kubeconfig, $KUBECONFIG or ~/.kube/config)"
        )
    if info.server.startswith("https"):
        tls_context(info)  # NOTE: now, as one line: kopf's own client would fail with a traceback
    return info


async def start(
    state: State,
    *,
    liveness: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Campaign for the Lease (unless standalone), then run the handlers and the resync loop
    until `stop_flag` is set, the process is signalled, or the Lease is lost (LeaseLost)."""
    ns = state.settings.namespace
    stop = stop_flag or asyncio.Event()
    state.info = login()
    keeper: asyncio.Task[None] | None = None
    try:
        if not state.settings.standalone:
            lease = Lease(
                state.kube(),
                ns or "cognitora",
                state.settings.lease,
                _identity(),
                state.settings.lease_ttl_s,
            )
            await lease.campaign()
            keeper = asyncio.create_task(lease.keep())
            keeper.add_done_callback(lambda _: stop.set())
        await kopf.operator(
            registry=build(state),
            clusterwide=not ns,
            namespaces=[ns] if ns else (),
            standalone=True,
            liveness_endpoint=liveness,
            stop_flag=stop,
            ready_flag=ready_flag,
        )
    finally:
        lost = keeper is not None and keeper.done() and not keeper.cancelled()
        if keeper is not None:
            keeper.cancel()
        await state.close()
    if lost:
        raise LeaseLost("lost the leader Lease; exiting so that a fresh candidate campaigns")


class LeaseLost(CognitoraError):
    """This operator no longer leads."""
