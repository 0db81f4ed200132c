"""Readiness: a real child process binds port 0 and reports its port through --ready-file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cgn_core.errors import ConfigError
from cgn_core.process import stop_group
from cgn_core.readiness import bind_tcp, sd_notify, wait_ready_file, write_ready_file

CHILD = textwrap.dedent(
    """
    import socket, sys
    from pathlib import Path
    from cgn_core.readiness import bind_tcp, write_ready_file
    sock = bind_tcp("127.0.0.1", 0)
    sock.setblocking(True)
    write_ready_file(Path(sys.argv[1]), ports={"http": sock.getsockname()[1]})
    conn, _ = sock.accept()
    conn.sendall(b"hello")
    conn.close()
    """
)


def test_child_reports_its_bound_port(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ready)])
    try:
        doc = wait_ready_file(ready, timeout_s=30, proc=proc)
        assert doc["pid"] == proc.pid
        with socket.create_connection(("127.0.0.1", doc["ports"]["http"]), timeout=5) as s:
            assert s.recv(5) == b"hello"
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_dead_child_fails_fast(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    with pytest.raises(RuntimeError, match="exited with 4 before ready"):
        wait_ready_file(tmp_path / "never.json", timeout_s=30, proc=proc)


def test_timeout(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not appear"):
        wait_ready_file(tmp_path / "never.json", timeout_s=0.1)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ready.json"
    write_ready_file(path, ports={"a": 1})
    write_ready_file(path, ports={"a": 2})
    assert json.loads(path.read_text())["ports"] == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["ready.json"]


def test_bind_tcp_port_zero_and_conflict() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(
            ConfigError, match=f"cannot listen on 127.0.0.1:{port}: Address already"
        ):
            bind_tcp("127.0.0.1", port)
    finally:
        sock.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_router_notifies_systemd_ready_then_stopping(tmp_path: Path, abstract: bool) -> None:
    """Under a Type=notify unit: READY=1 once serving, STOPPING=1 on SIGTERM, from the
    main pid, over the sd_notify datagram protocol (a socket path, or @ for abstract)."""
    name = f"cgn-test-notify-{tmp_path.name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name if abstract else str(tmp_path / "notify"))
        sock.settimeout(30)
        cfg = tmp_path / "router.yaml"
        cfg.write_text(
            "discovery: static\nauth: {enabled: false}\n"
            "endpoints: {e: {url: 'http://127.0.0.1:9', model: m}}\n"
        )
        env = {**os.environ, "NOTIFY_SOCKET": "@" + name if abstract else str(tmp_path / "notify")}
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "cgn-router"), "serve", "--config", str(cfg),
             "--port", "0", "--admin-port", "0"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            ready = sock.recv(4096).decode()
            assert ready.startswith("READY=1\nSTATUS=serving on port ")
            proc.send_signal(signal.SIGTERM)
            assert sock.recv(4096) == b"STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            stop_group(proc)


def test_sd_notify_without_systemd_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    assert sd_notify("READY=1") is False  # unreachable: logged, never raised
