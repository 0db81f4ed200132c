"""A worker process of `cgn-router serve --workers N` (started by workers.Supervisor)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
from pathlib import Path

import typer

from cgn_core.cli import load_service_settings
from cgn_core.cli import run as run_cli
from cgn_core.logs import setup_logging
from cgn_router.daemon import run
from cgn_router.settings import RouterSettings
from cgn_router.workers import FLAGS_ENV, WorkerRole

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def worker_main() -> None:
    """A worker's process: the settings the supervisor was given, read again (a reload sees
    a changed config file), on the held ports."""
    role = WorkerRole.from_env()
    stop_with_parent(role.supervisor)
    flags = json.loads(os.environ[FLAGS_ENV])
    config = flags.pop("config") or None
    flags.update({"http.port": str(role.http_port), "workers": "1"})
    if role.primary:
        flags["admin.port"] = str(role.admin_port)
    else:  # NOTE: one reconciler per router host; the others need no vote
        flags.update({"admin.host": "127.0.0.1", "admin.port": "0", "reconciler.enabled": "false"})
    path = Path(config) if config else None
    settings = load_service_settings(RouterSettings, "router", path, flags)
    setup_logging("router", settings.log)
    run(settings, role.ready_file(), worker=role)


PR_SET_PDEATHSIG = 1


def stop_with_parent(supervisor: int) -> None:
    """SIGTERM this worker when its supervisor dies, even by SIGKILL (Linux), so no worker
    is left serving the port alone; elsewhere the supervisor's own shutdown stops them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != supervisor:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    run_cli(app)()  # an error is one line and an exit code, as from cgn-router itself
