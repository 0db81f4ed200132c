"""The agent's bookkeeping: process fingerprints, the state file, the etcd publisher, the node id."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cgn_agent.drivers import Launch
from cgn_agent.inventory.nvidia import GpuProcess
from cgn_agent.node import stray_engine_pids
from cgn_agent.processes import EngineProcess, fingerprint, log_tail, matches, spawn
from cgn_agent.publisher import Publisher
from cgn_agent.runner import Probed, ReplicaRunner, RunnerContext
from cgn_agent.spec import EngineProfile, ReplicaId, ReplicaSpec
from cgn_agent.statefile import ReplicaRecord, StateStore
from cgn_agent.supervisor import Phase, Policy
from cgn_core.errors import ConfigError, EtcdUnavailable
from cgn_core.nodeid import node_id
from tests.support.disks import small_tmpfs

SPEC = ReplicaSpec(ReplicaId("r1"), "smol", "cgn_infer", "/m/smol.gguf", 8001,
                   profile=EngineProfile(threads=2, extra_args=("--max-batch", "4")))  # fmt: skip


def sleeper(tmp: Path) -> EngineProcess:
    return spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                 {"CGN_TEST": "1"}, tmp / "logs" / "r1.log")  # fmt: skip


async def test_spawned_process_fingerprint_log_and_group_stop(tmp_path: Path) -> None:
    proc = sleeper(tmp_path)
    try:
        fp = proc.fp
        assert fp.pid == proc.pid and fp.cmdline[0] == sys.executable and fp.start
        assert os.getpgid(proc.pid) == proc.pid  # its own process group
        assert matches(fp) and proc.poll() == (False, None)
        for _ in range(100):
            if log_tail(tmp_path / "logs" / "r1.log"):
                break
            await asyncio.sleep(0.05)
        assert log_tail(tmp_path / "logs" / "r1.log") == ["up"]
    finally:
        code = await proc.stop(grace_s=5)
    assert code == -15 and proc.poll() == (True, -15)
    assert not matches(fp)  # gone: never adopted again


async def test_adopted_handle_sees_the_exit_and_a_reused_pid_never_matches(tmp_path: Path) -> None:
    proc = sleeper(tmp_path)
    adopted = EngineProcess(proc.fp)  # as a restarted agent holds it: no Popen
    assert adopted.poll() == (False, None)
    other = fingerprint(os.getpid())
    assert other is not None
    assert not matches(replace(proc.fp, start=other.start))  # same pid, other start time
    # the command line is for reading only: a process that execs again is still ours
    assert matches(replace(proc.fp, cmdline=("vllm", "serve")))
    assert not matches(replace(proc.fp, boot="another-boot"))
    proc.popen.terminate()  # type: ignore[union-attr]
    proc.popen.wait()  # type: ignore[union-attr]
    assert adopted.poll() == (True, None)


def test_state_store_round_trip_and_damaged_records(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    fp = fingerprint(os.getpid())
    store.save(ReplicaRecord(SPEC, 8001, "http://10.0.0.5:8001", fp))
    ext = replace(SPEC, replica=ReplicaId("ext"), engine="openai_compat",
                  profile=EngineProfile(url="http://x:1"))  # fmt: skip
    store.save(ReplicaRecord(ext, 0, "http://x:1", None))
    assert oct(store.path("r1").stat().st_mode & 0o777) == "0o600"
    (store.dir / "broken.json").write_text("{not json")
    records = {r.spec.replica: r for r in store.load_all()}
    assert records["r1"] == ReplicaRecord(SPEC, 8001, "http://10.0.0.5:8001", fp)
    assert records["ext"].fingerprint is None
    assert (store.dir / "broken.bad").exists() and not (store.dir / "broken.json").exists()
    store.remove("r1")
    store.remove("r1")  # idempotent
    assert [r.spec.replica for r in store.load_all()] == ["ext"]


class FakeEtcd:
    def __init__(self) -> None:
        self.kv: dict[str, tuple[str, int]] = {}
        self.down = False
        self.puts = 0

    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        if self.down:
            raise EtcdUnavailable("etcd unreachable (127.0.0.1:2379: unavailable)")
        self.kv[key] = (str(value), lease)
        self.puts += 1
        return self.puts

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        if self.down:
            raise EtcdUnavailable("etcd unreachable")
        return int(self.kv.pop(key, None) is not None)


async def test_publisher_sends_changes_and_everything_after_an_outage() -> None:
    pub, etcd = Publisher(), FakeEtcd()
    pub.set("/a", {"x": 1})
    pub.set("/b", {"y": 2})
    await pub.flush(etcd, lease=7)
    assert etcd.kv == {"/a": ('{"x":1}', 7), "/b": ('{"y":2}', 7)} and etcd.puts == 2
    pub.set("/a", {"x": 1})  # unchanged: nothing to send
    await pub.flush(etcd, lease=7)
    assert etcd.puts == 2
    etcd.down = True
    pub.set("/a", {"x": 3})
    pub.delete("/b")
    with pytest.raises(EtcdUnavailable):
        await pub.flush(etcd, lease=7)
    assert pub.resync
    etcd.down = False
    etcd.kv["/b"] = ("stale", 7)  # the lease survived the outage: /b is still there
    await pub.flush(etcd, lease=7)
    assert etcd.kv == {"/a": ('{"x":3}', 7)} and not pub.resync and not pub.dirty
    pub.resync = True  # a new lease: every key again, under it
    await pub.flush(etcd, lease=9)
    assert etcd.kv == {"/a": ('{"x":3}', 9)}


def test_a_replica_whose_adapters_changed_says_so_as_it_stops() -> None:
    """#60: a new set of start-loaded adapters restarts the replica, and its status says
    why; any other change is a changed placement."""
    from cgn_agent.node import _changed
    from cgn_agent.spec import LoraFile

    lora = (LoraFile("sql", "/m/sql.gguf"),)
    adapted = dataclasses.replace(SPEC, profile=dataclasses.replace(SPEC.profile, lora=lora))
    assert _changed(SPEC, adapted).startswith("adapters changed: restarting with the new set")
    assert _changed(SPEC, dataclasses.replace(SPEC, port=8002)) == "placement changed"


def test_stray_engines_are_engines_holding_gpus_that_we_did_not_start() -> None:
    apps = [GpuProcess("GPU-a", 100, 70000), GpuProcess("GPU-b", 200, 1000),
            GpuProcess("GPU-c", 300, 500), GpuProcess("GPU-d", 100, 70000)]  # fmt: skip
    cmdlines = {100: "/opt/venv/bin/python /opt/venv/bin/vllm serve meta-llama/x",
                200: "python train.py", 300: "/usr/bin/llama-server -m x.gguf"}  # fmt: skip
    assert stray_engine_pids(apps, own_pids=[300], cmdlines=cmdlines) == [100]


def test_node_id_is_derived_once_and_kept(tmp_path: Path) -> None:
    first = node_id("", tmp_path)
    assert first and (tmp_path / "node_id").read_text().strip() == first
    (tmp_path / "node_id").write_text("renamed-host-kept\n")
    assert node_id("", tmp_path) == "renamed-host-kept"
    assert node_id("gpu-07", tmp_path) == "gpu-07"
    with pytest.raises(ConfigError, match="node_id"):
        node_id("bad/id", tmp_path)


def test_runner_module_refuses_bad_usage() -> None:
    out = subprocess.run([sys.executable, "-m", "cgn_agent.launchers.xllamacpp_server"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2 and "--model" in out.stderr


def test_a_fingerprint_taken_right_after_spawn_has_the_command_line(tmp_path: Path) -> None:
    """vfork + exec: /proc/<pid>/cmdline can read empty for a moment after Popen returns
    (seen with console scripts, whose shebang makes the kernel load an interpreter)."""
    script = tmp_path / "sleeper"
    script.write_text(f"#!{sys.executable} -E\nimport time\ntime.sleep(30)\n")
    script.chmod(0o755)
    for _ in range(200):  # the race hit 1-2 % of spawns here: 200 tries catch it
        proc = spawn([str(script), "arg"], {}, tmp_path / "sleeper.log")
        try:
            assert proc.fp.cmdline == (sys.executable, "-E", str(script), "arg")
            assert matches(proc.fp)
        finally:
            proc.popen.kill()  # type: ignore[union-attr]
            proc.popen.wait()  # type: ignore[union-attr]


def test_a_process_that_execs_again_is_still_the_one_we_started(tmp_path: Path) -> None:
    """pip's `/bin/sh` trampoline (used when the venv's path is too long for a shebang)
    execs python: the command line changes, the process does not."""
    from cgn_core.process import Fingerprint, cmdline

    proc = subprocess.Popen(["/bin/sh", "-c", f"read x; exec {sys.executable} -c 'import time; time.sleep(30)'"],
                            stdin=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        fp = fingerprint(proc.pid)
        assert fp is not None and fp.cmdline[0] == "/bin/sh"
        proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + 10

        def first() -> str:  # "" for a moment while the kernel swaps the image in
            return next(iter(cmdline(proc.pid)), "")

        while first() in ("", "/bin/sh") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first() == sys.executable
        assert matches(fp)
        assert not matches(Fingerprint(fp.pid, str(int(fp.start) + 1), fp.boot))  # a reused pid
        proc.kill()
        proc.wait(10)
        assert not matches(fp)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()  # type: ignore[union-attr]


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled: every write there fails with ENOSPC (as root only)."""
    with small_tmpfs(tmp_path / "full") as mnt:
        (mnt / "replicas").mkdir()
        with contextlib.suppress(OSError), (mnt / "fill").open("wb") as f:
            while True:
                f.write(b"\0" * 4096)
        yield mnt


async def test_a_full_disk_stops_the_engine_it_cannot_record(
    tmp_path: Path, full_disk: Path
) -> None:
    """The engine starts, its state record cannot be written: it must not be left running
    (a restarted agent could never adopt it), and the replica fails with the reason."""
    marker = f"cgn-full-disk-{os.getpid()}"
    argv = (sys.executable, "-c", "import time; time.sleep(60)", marker)
    ctx = RunnerContext(node="n1", publisher=Publisher(), store=StateStore(full_disk),
                        prober=NeverReady(), policy=Policy(), log_dir=tmp_path / "logs",
                        advertise_url=lambda port: f"http://127.0.0.1:{port}", stop_grace_s=5,
                        probe_interval_s=1)  # fmt: skip
    runner = ReplicaRunner(SPEC, Launch(argv, url="http://127.0.0.1:1"), 1, ctx)
    await runner.begin()
    assert runner.state.phase == Phase.FAILED and "No space left" in runner.state.reason
    assert runner.proc is None and not running(marker)


def running(marker: str) -> bool:
    """Whether any process has `marker` in its command line."""
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker.encode() in path.read_bytes():
                return True
    return False


class NeverReady:
    async def probe(self, launch: Launch, served: str) -> Probed:
        return Probed(False, False, "not probed in this test")

    async def in_flight(self, launch: Launch) -> int | None:
        return None
