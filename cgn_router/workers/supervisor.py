"""`cgn-router serve --workers N`: N router processes on one port, and the supervisor
that starts, watches, reloads and stops them.

Each worker is a whole router (etcd and KV-event followers, admission, scrapes)
listening on the same port with SO_REUSEPORT, so the kernel spreads
connections over them and no process is in the request path but the worker
that serves it. What they share, and how:

* a key's limits: one table in shared memory (shared.py), counted once;
* each endpoint's requests in flight and pending prefill: a table in which
  each worker writes its own counts and reads the others' (the load scorer
  sees the whole router's requests, not a worker's share);
* admission: each worker counts the others' requests on an engine as another
  router's (the engine's running + waiting beyond its own), as two routers do;
* each endpoint's learned speed: each worker writes the fit of the answers it saw, and
  fits its own and the others' together, so every worker predicts the same times;
* the KV index: each worker follows every engine's KV events itself; its own
  optimistic guesses stay its own until the events confirm them;
* the admin port: worker 0, the primary, serves it (and runs the reconciler);
  its /metrics sums the other workers' pages, read from their loopback-only
  listeners, and its /healthz reads the supervisor's record of the workers.

The supervisor holds the ports (bound, not listening, so no connection waits
on it) so a worker restarted on port 0 gets the same port back; writes the one
ready file and tells systemd once every worker is serving; restarts a worker
that dies (backing off when it keeps dying), and one that hangs: each worker's
event loop writes a heartbeat every `BEAT_S` into a shared table, and a
serving worker whose heartbeat is older than `HUNG_S` (stopped by SIGSTOP, a
debugger or a frozen cgroup, or stuck) is killed and replaced, because the
kernel keeps handing it its share of new connections while it lives; on
SIGHUP starts a new worker for each old one, in turn, and stops the old one
once the new one is serving (the config file is read again: a reload); on
SIGTERM stops them all, each draining its requests as a single router does. A
worker that fails before the first ready signal fails the whole start (its
log line says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgn_core.errors import ConfigError
from cgn_core.files import atomic_write_text
from cgn_core.readiness import announce_ready, announce_stopping
from cgn_router.workers import shared

log = logging.getLogger(__name__)
ENV = "CGN_WORKER_ROLE"  # the worker's role, JSON (set by the supervisor only)
FLAGS_ENV = "CGN_WORKER_FLAGS"  # the config file and flags the supervisor was given, JSON
STATUS_FILE = "workers.json"
POLL_S = 0.1
START_TIMEOUT_S = 120.0  # a worker not serving by then has failed
STOP_GRACE_S = 35.0  # a worker's drain is capped at 30 s (daemon.DRAIN_CAP_S)
STEADY_S = 30.0  # a worker that lived this long restarts at once; one dying sooner backs off
BEAT_S = 0.25  # each worker's event loop writes its heartbeat this often
HUNG_S = 1.5  # a serving worker whose heartbeat is older is killed and replaced
_BEAT = struct.Struct("=qd")  # per worker index: (its pid, CLOCK_MONOTONIC of the last beat)


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """What makes a worker one of several: its index, the ports, the shared state."""

    index: int
    count: int
    run_dir: Path
    http_port: int
    admin_port: int
    usage_fd: int  # shared.USAGE
    load_fd: int  # shared.LOAD
    speed_fd: int  # shared.SPEED
    beat_fd: int  # the heartbeats (Heartbeat)
    supervisor: int  # its pid

    @property
    def primary(self) -> bool:
        return self.index == 0

    @classmethod
    def from_env(cls) -> WorkerRole:
        doc = json.loads(os.environ[ENV])
        return cls(**{**doc, "run_dir": Path(doc["run_dir"])})

    def ready_file(self) -> Path:
        return self.run_dir / f"worker-{self.index}-{os.getpid()}.json"


def sibling_admin_urls(role: WorkerRole) -> list[str]:
    """The loopback admin listeners of the secondary workers serving now (a rolling reload
    may briefly show an old and a new one of an index). Never a primary's: that is the
    public admin port, whose /metrics is this sum (during a reload the old primary's file
    is still there, and reading it could land on this very handler)."""
    urls = []
    for path in sorted(role.run_dir.glob("worker-*.json")):
        if path.name.startswith("worker-0-"):
            continue
        try:
            doc = json.loads(path.read_text())
            pid, port = int(doc["pid"]), int(doc["ports"]["admin"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or its worker is gone
        if pid != os.getpid() and _alive(pid):
            urls.append(f"http://127.0.0.1:{port}")
    return urls


def workers_status(role: WorkerRole) -> dict[str, Any]:
    """The supervisor's record of every worker: {"workers": [{index, pid, running, ...}]}."""
    try:
        doc: dict[str, Any] = json.loads((role.run_dir / STATUS_FILE).read_text())
        return doc
    except (OSError, ValueError):
        return {"workers": []}


class Heartbeat:
    """The heartbeat table: `count` slots of (pid, time), one per worker index, in a memfd
    the supervisor creates and every worker inherits. A slot's writes are 16 bytes that a
    reader may see torn: a torn one holds this pid and the last time or the one before."""

    def __init__(self, fd: int, count: int):
        self.mem = mmap.mmap(fd, count * _BEAT.size, mmap.MAP_SHARED)

    @staticmethod
    def create(count: int) -> int:
        fd = os.memfd_create("cgn-router-beats", 0)
        os.ftruncate(fd, count * _BEAT.size)
        os.set_inheritable(fd, True)
        return fd

    def beat(self, index: int) -> None:
        _BEAT.pack_into(self.mem, index * _BEAT.size, os.getpid(), time.monotonic())

    def last(self, index: int, pid: int) -> float | None:
        """When worker `pid` at `index` last beat (None: it has not yet)."""
        held, at = _BEAT.unpack_from(self.mem, index * _BEAT.size)
        return at if held == pid else None

    async def run(self, index: int) -> None:
        """A worker's beats, from its event loop: a loop that stops beats no more."""
        while True:
            self.beat(index)
            await asyncio.sleep(BEAT_S)

    def close(self) -> None:
        self.mem.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the supervisor --------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    restarts: int = 0
    hangs: int = 0  # times it stopped beating and was replaced
    replaced: bool = False  # killed for a hang: restarted at once (not a crash loop)
    failures: int = 0  # deaths in a row, each within STEADY_S of its start
    due: float | None = None  # dead: restart at this time
    last_exit: int | None = None
    metrics: tuple[int, str] = (0, "")  # (pid, URL) of its own /metrics, once known


@dataclass
class Supervisor:
    count: int
    config: Path | None
    flags: dict[str, str]
    ready_file: Path | None
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cgn-router.")))
    workers: list[_Worker] = field(default_factory=list)
    retiring: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stopping: bool = False
    reload_asked: bool = False
    role: dict[str, Any] = field(default_factory=dict)  # what every worker is told
    beats: Heartbeat | None = None
    _status: dict[str, Any] = field(default_factory=dict)

    def run(self, host: str, http_port: int, admin_host: str, admin_port: int) -> int:
        """Serve until SIGTERM/SIGINT; the exit code (a worker's, when the start failed)."""
        held: list[socket.socket] = []
        fds: list[int] = []
        try:
            held = [_hold(host, http_port), _hold(admin_host, admin_port)]
            ports = {"http": held[0].getsockname()[1], "admin": held[1].getsockname()[1]}
            fds = [
                shared.create(shared.USAGE, self.count),
                shared.create(shared.LOAD, self.count),
                shared.create(shared.SPEED, self.count),
                Heartbeat.create(self.count),
            ]
            self.beats = Heartbeat(fds[3], self.count)
            self.role = dict(
                count=self.count,
                run_dir=str(self.run_dir),
                usage_fd=fds[0],
                load_fd=fds[1],
                speed_fd=fds[2],
                beat_fd=fds[3],
                supervisor=os.getpid(),
                http_port=ports["http"],
                admin_port=ports["admin"],
            )
            signal.signal(signal.SIGTERM, self._stop)
            signal.signal(signal.SIGINT, self._stop)
            signal.signal(signal.SIGHUP, self._reload)
            self.workers = [self._spawn(i) for i in range(self.count)]
            code = self._until_ready()
            if code is not None:
                return code
            announce_ready(
                self.ready_file,
                f"serving on port {ports['http']} ({self.count} workers)",
                ports=ports,
                workers=self.count,
            )
            log.info("%d workers serving on port %d", self.count, ports["http"])
            while not self.stopping:
                if self.reload_asked:
                    self.reload_asked = False
                    self._rolling_restart()
                self._tend()
                time.sleep(POLL_S)
            return 0
        finally:
            announce_stopping()
            self._stop_all()
            for sock in held:
                sock.close()
            if self.beats is not None:
                self.beats.close()
            for fd in fds:
                os.close(fd)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.ready_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.ready_file.unlink()

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _reload(self, signum: int, frame: object) -> None:
        self.reload_asked = True

    def _spawn(self, index: int) -> _Worker:
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # one READY=1
        env[ENV] = json.dumps({**self.role, "index": index})
        env[FLAGS_ENV] = json.dumps({"config": str(self.config or ""), **self.flags})
        proc = subprocess.Popen(
            [sys.executable, "-m", "cgn_router.cli", "worker"],
            env=env,
            pass_fds=tuple(self.role[k] for k in ("usage_fd", "load_fd", "speed_fd", "beat_fd")),
        )
        return _Worker(index, proc, time.monotonic())

    def _ready_path(self, proc: subprocess.Popen[bytes], index: int) -> Path:
        return self.run_dir / f"worker-{index}-{proc.pid}.json"

    def _serving(self, proc: subprocess.Popen[bytes], index: int) -> bool:
        return self._ready_path(proc, index).exists()

    def _metrics_url(self, w: _Worker) -> str | None:
        """A secondary worker's own page (its loopback listener; read from its ready file
        once per process, not on every tick); the primary's /metrics is the sum of all."""
        if w.index == 0 or w.due is not None:
            return None
        if w.metrics[0] != w.proc.pid:
            try:
                doc = json.loads(self._ready_path(w.proc, w.index).read_text())
                w.metrics = (w.proc.pid, f"http://127.0.0.1:{doc['ports']['admin']}/metrics")
            except (OSError, ValueError, KeyError, TypeError):
                return None  # not serving yet
        return w.metrics[1]

    def _until_ready(self) -> int | None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(self._serving(w.proc, w.index) for w in self.workers):
            for w in self.workers:
                if w.proc.poll() is not None:
                    log.error("worker %d exited with %s before serving", w.index, w.proc.returncode)
                    return w.proc.returncode or 1
            if self.stopping:
                return 0
            if time.monotonic() > deadline:
                log.error("workers not serving after %.0f s", START_TIMEOUT_S)
                return 1
            time.sleep(POLL_S)
        self._write_status()
        return None

    def _tend(self) -> None:
        """Replace the workers that hang, restart the ones that died (backing off), reap the
        retired ones."""
        now = time.monotonic()
        for w in self.workers:
            if w.due is None and w.proc.poll() is None:
                self._unless_hung(w, now)
            if w.due is None and w.proc.poll() is not None:
                w.last_exit = w.proc.returncode
                self._ready_path(w.proc, w.index).unlink(missing_ok=True)  # SIGKILLed: left
                crashed = now - w.started < STEADY_S and not w.replaced
                w.failures, w.replaced = (w.failures + 1 if crashed else 0), False
                w.due = now + min(30.0, 0.5 * 2 ** max(0, w.failures - 1)) if w.failures else now
                log.error(
                    "worker %d (pid %d) exited with %s; restarting",
                    w.index,
                    w.proc.pid,
                    w.last_exit,
                )
            if w.due is not None and now >= w.due:
                fresh = self._spawn(w.index)
                w.proc, w.started, w.due, w.restarts = fresh.proc, now, None, w.restarts + 1
        self.retiring = [p for p in self.retiring if p.poll() is None]
        self._write_status()

    def _unless_hung(self, w: _Worker, now: float) -> None:
        """Kill a serving worker whose loop stopped beating (`_tend` restarts it at once:
        its share of new connections goes to the others as its socket closes)."""
        last = self.beats.last(w.index, w.proc.pid) if self.beats else None
        if last is None or now - last <= HUNG_S or not self._serving(w.proc, w.index):
            return
        w.hangs += 1
        log.error(
            "worker %d (pid %d) has not run its event loop for %.1f s (stopped or stuck); "
            "replacing it",
            w.index,
            w.proc.pid,
            now - last,
        )
        w.proc.kill()
        w.proc.wait()
        w.replaced = True

    def _write_status(self) -> None:
        """workers.json for the primary's /healthz, rewritten when it changes."""
        doc = {
            "workers": [
                {
                    "index": w.index,
                    "pid": w.proc.pid,
                    "running": w.due is None and self._serving(w.proc, w.index),
                    "restarts": w.restarts,
                    "hangs": w.hangs,
                    "last_exit": w.last_exit,
                    "metrics": self._metrics_url(w),
                }
                for w in self.workers
            ]
        }
        if doc != self._status:
            atomic_write_text(self.run_dir / STATUS_FILE, json.dumps(doc))
            self._status = doc

    def _rolling_restart(self) -> None:
        """Each worker in turn: a new one started; the old one stopped once it serves."""
        log.info("reload: restarting %d workers one by one", self.count)
        for w in self.workers:
            fresh = self._spawn(w.index)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._serving(fresh.proc, w.index):
                if fresh.proc.poll() is not None or time.monotonic() > deadline or self.stopping:
                    log.error("reload: the new worker %d did not start; the old one stays", w.index)
                    _terminate(fresh.proc)
                    self.retiring.append(fresh.proc)
                    return
                time.sleep(POLL_S)
            _terminate(w.proc)
            self.retiring.append(w.proc)
            w.proc, w.started = fresh.proc, time.monotonic()
            self._write_status()
        log.info("reload: done")

    def _stop_all(self) -> None:
        procs = [w.proc for w in self.workers] + self.retiring
        for p in procs:
            _terminate(p)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()


def _hold(host: str, port: int) -> socket.socket:
    """`port` held for the workers: bound with SO_REUSEPORT, never listening (port 0: a
    free one, the same for every worker and every restart). A port someone listens on is
    refused first: with SO_REUSEPORT alone, a second router started by mistake on the same
    port would silently share its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


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
