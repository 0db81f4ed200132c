"""cgn-agent end to end: real etcd, a real agent, real cgn-infer (SmolLM2) and llama.cpp (xllamacpp).

One private etcd and one state directory for the module (the outage test
stops etcd; the adoption test kills the agent). The tests run in file order
and each leaves the placements it needs in a known state.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import openai
import pytest

from cgn_agent.processes import EngineProcess
from cgn_agent.statefile import ReplicaRecord, StateStore
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd, free_port
from cgn_core.kv.identity import StoreKeys, bearer, read_secret
from cgn_core.settings import EtcdSettings
from harness.lora import write_adapter
from harness.procs import Agent, cgn_agent, cgn_router, runs

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]
T = TypeVar("T")
NODE = "n1"
PLACE = f"/cognitora/placements/{NODE}/"
INFER, LLAMA = "r-infer", "r-llama"


class Fleet:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.etcd = LocalEtcd(tmp / "etcd")
        self.state = tmp / "agent"
        self.stack = ExitStack()
        self.agent: Agent | None = None

    def start_agent(self) -> Agent:
        # stop_on_exit: the module's last agent stops its engines at teardown
        self.models = self.tmp / "models"  # what placements may load (LoRA adapters here)
        self.models.mkdir(exist_ok=True)
        sets = ("--set", "engines.stop_on_exit=true", "--set", f"model_dirs={self.models}")
        cm = cgn_agent(self.state, self.etcd.endpoint, *sets)
        self.agent = self.stack.enter_context(cm)
        return self.agent

    def settings(self) -> EtcdSettings:
        return EtcdSettings(endpoints=(self.etcd.endpoint,), timeout_s=2.0)

    def cleanup(self) -> None:
        self.stack.close()
        for rec in StateStore(self.state).load_all():  # a failed test may leave engines behind
            if rec.fingerprint is not None:
                EngineProcess(rec.fingerprint).signal_group(signal.SIGKILL)
        self.etcd.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("agent"))
    f.etcd.start()
    try:
        f.start_agent()
        yield f
    finally:
        f.cleanup()


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 90
) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def get(c: EtcdClient, key: str) -> Any:
    return await c.get_json(key)


def status_key(replica: str) -> str:
    return f"/cognitora/replicas/{NODE}/{replica}"


def endpoint_key(model: str, replica: str) -> str:
    return f"/cognitora/endpoints/{NODE}/{model}/{replica}"


async def ready(c: EtcdClient, model: str, replica: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        st = await get(c, status_key(replica))
        ep = await get(c, endpoint_key(model, replica))
        return {"status": st, "endpoint": ep} if ep and st and st["phase"] == "Ready" else None

    return await eventually(probe, f"{replica} Ready with its endpoint published")


def chat(url: str, model: str, token: str = "") -> str:
    """One chat completion straight to an engine (with its API secret, if it has one)."""
    with openai.OpenAI(base_url=url + "/v1", api_key=token or "unused", max_retries=0,
                       timeout=60) as client:  # fmt: skip  # NOTE: closed: no socket left to GC
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
            temperature=0,
        )  # fmt: skip
    assert out.choices[0].message.content
    return out.choices[0].message.content


def admin(agent: Agent, path: str) -> Any:
    with urllib.request.urlopen(agent.admin + path, timeout=5) as resp:
        body = resp.read().decode()
    return body if path == "/metrics" else json.loads(body)


async def test_placements_become_ready_engines_serving_through_their_endpoints(
    fleet: Fleet, smollm2_path: Path
) -> None:
    async with EtcdClient(fleet.settings()) as c:
        adapter = write_adapter(smollm2_path, fleet.models / "sql.gguf")
        await c.put_json(PLACE + INFER, {
            "model": "smol-infer", "engine": "cgn_infer", "source": str(smollm2_path),
            "profile": {"threads": 1, "ctx": 1024, "extra_args": ["--kv-pool-tokens", "4096"],
                        "lora": [{"name": "smol-fr", "path": str(adapter)}], "max_loras": 2},
        })  # fmt: skip
        await c.put_json(PLACE + LLAMA, {
            "model": "smol-llama", "engine": "llama_cpp", "source": str(smollm2_path),
            "profile": {"threads": 1, "ctx": 1024, "launcher": "xllamacpp",
                        "lora": [{"name": "smol-sql", "path": str(adapter)}]},
        })  # fmt: skip
        infer = await ready(c, "smol-infer", INFER)
        llama = await ready(c, "smol-llama", LLAMA)
        ep = infer["endpoint"]
        assert ep["engine"] == "cgn-infer" and ep["node"] == NODE and ep["role"] == "both"
        assert ep["kv_events_url"] == ep["url"] + "/v1/kv/events" and ep["block_size"] == 16
        assert (
            llama["endpoint"]["engine"] == "llamacpp" and "kv_events_url" not in llama["endpoint"]
        )
        assert llama["endpoint"]["adapters"] == ["smol-sql"] and ep["adapters"] == ["smol-fr"]
        # cgn-infer loads more at run time, from the agent's model dirs only (#60)
        auth = {"Authorization": f"Bearer {ep['api_token']}"}
        for path, status in ((adapter, 200), (smollm2_path, 403)):
            body = {"lora_name": f"x{status}", "lora_path": str(path)}
            r = await asyncio.to_thread(httpx.post, ep["url"] + "/v1/load_lora_adapter",
                                        json=body, headers=auth, timeout=60)  # fmt: skip
            assert r.status_code == status, r.text
        assert infer["status"]["adapters"] == ["smol-fr"]
        assert llama["status"]["adapters"] == ["smol-sql"]

        async def loaded() -> list[str] | None:  # the next probe sees what the engine holds
            adapters = (await get(c, status_key(INFER)))["adapters"]
            return adapters if "x200" in adapters else None

        assert await eventually(loaded, "the status to list x200", timeout_s=20) == [
            "smol-fr", "x200"
        ]  # fmt: skip
        assert infer["status"]["pid"] > 0 and infer["status"]["log_tail"]
        # The engine answers its router only: the secret is in its endpoint record.
        assert len(ep["api_token"]) > 30 and len(llama["endpoint"]["api_token"]) > 30
        with pytest.raises(openai.AuthenticationError, match="from its router only"):
            await asyncio.to_thread(chat, ep["url"], "smol-infer")
        await asyncio.to_thread(chat, ep["url"], "smol-infer", ep["api_token"])
        with pytest.raises(openai.AuthenticationError):  # llama.cpp refuses without it too
            await asyncio.to_thread(chat, llama["endpoint"]["url"], "smol-llama")
        await asyncio.to_thread(chat, llama["endpoint"]["url"], "smol-llama",
                                llama["endpoint"]["api_token"])  # fmt: skip
        node = await get(c, f"/cognitora/nodes/{NODE}")
        assert node["node_class"] == "cpu" and node["cpu"]["cores"] >= 1
        assert {r["replica"] for r in node["running"]} == {INFER, LLAMA}
        assert node["power"]["source"] in ("unknown", "rapl") and "engines" in node
        assert fleet.agent is not None
        metrics = admin(fleet.agent, "/metrics")
        assert 'cgn_agent_replicas{phase="Ready"} 2.0' in metrics
        assert "cgn_agent_etcd_connected 1.0" in metrics
        assert admin(fleet.agent, "/healthz") == {"status": "ok", "node": NODE, "etcd": True}


async def test_the_router_serves_the_agents_endpoints(fleet: Fleet, tmp_path: Path) -> None:
    """The endpoint records the agent writes are the ones cgn-router routes to (the contract)."""
    config = {"etcd": {"endpoints": [fleet.etcd.endpoint]}, "scrape": {"interval_s": 0.5}}
    with cgn_router(tmp_path, config) as router:

        async def listed() -> dict[str, Any] | None:
            doc = await asyncio.to_thread(admin_json, router.admin + "/endpoints")
            eps = {e["id"]: e for e in doc["endpoints"]}
            want = {f"smol-infer/{NODE}.{INFER}", f"smol-llama/{NODE}.{LLAMA}"}
            return eps if want <= set(eps) else None

        eps = await eventually(listed, "the router to list both endpoints", timeout_s=30)
        assert eps[f"smol-infer/{NODE}.{INFER}"]["engine"] == "cgn-infer"
        for model in ("smol-infer", "smol-llama"):
            await asyncio.to_thread(chat, router.url, model)


def admin_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


async def test_bad_placements_are_reported_not_started(fleet: Fleet) -> None:
    async with EtcdClient(fleet.settings()) as c:
        await c.put(PLACE + "r-bad", "{not json")
        await c.put_json(PLACE + "r-vllm", {"model": "llama-8b", "engine": "vllm",
                                            "source": "meta-llama/Llama-3.1-8B"})  # fmt: skip
        # What a writer of placements could once run as the agent's user:
        smol = {"model": "m", "engine": "cgn_infer", "source": "smollm2"}
        poison = {
            "r-preload": {**smol, "profile": {"env": {"LD_PRELOAD": "/tmp/evil.so"}}},
            "r-ready-file": {**smol, "profile": {"extra_args": ["--ready-file", "/etc/motd"]}},
            "r-passwd": {**smol, "source": "/etc/passwd"},
        }
        for replica, doc in poison.items():
            await c.put_json(PLACE + replica, doc)

        async def failed(replica: str) -> dict[str, Any] | None:
            st = await get(c, status_key(replica))
            return st if st and st["phase"] == "Failed" else None

        bad = await eventually(lambda: failed("r-bad"), "r-bad reported")
        assert bad["reason"].startswith(
            "invalid placement: placement r-bad: value is not JSON (Expecting property name"
        )
        vllm = await eventually(lambda: failed("r-vllm"), "r-vllm refused")
        assert vllm["reason"] == (
            "refused: vllm needs an NVIDIA GPU; node n1 is class cpu (no GPU found by nvidia-smi)"
        )
        reasons = {r: (await eventually(lambda r=r: failed(r), f"{r} refused"))["reason"]
                   for r in poison}  # fmt: skip
        assert reasons == {
            "r-preload": "refused: cgn_infer: environment variable LD_PRELOAD is never allowed",
            "r-ready-file": "refused: cgn_infer: flag --ready-file is not allowed in extra_args "
            "(allowed: --decode-threads, --kv-dtype, --kv-pool-tokens, --max-batch, "
            "--prefill-chunk, --sim-load-s, --speed)",
            "r-passwd": "refused: cgn_infer: source /etc/passwd is not under a model directory "
            f"({fleet.models})",
        }
        for replica in ("r-bad", "r-vllm", *poison):
            await c.delete(PLACE + replica)
        await eventually(lambda: _absent(c, status_key("r-vllm")), "r-vllm status removed")


def _transfer_dirs(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"cgn-kv-transfer-{pid}-*"))


async def _absent(c: EtcdClient, key: str) -> bool:
    return await c.get(key) is None


async def test_killed_engine_is_withdrawn_then_restarted_with_backoff(fleet: Fleet) -> None:
    async with EtcdClient(fleet.settings()) as c:
        before = (await ready(c, "smol-infer", INFER))["status"]
        key = endpoint_key("smol-infer", INFER)
        rev = await c.revision()
        shm = await asyncio.to_thread(_transfer_dirs, before["pid"])
        assert shm, "the engine's KV transfer directory"  # every non-decode engine has one
        os.killpg(before["pid"], signal.SIGKILL)
        withdrawn = False
        async with asyncio.timeout(15):
            async for batch in c.watch_prefix(key, start_revision=rev + 1):
                if any(ev.kind == "delete" for ev in batch.events):
                    withdrawn = True
                    break
        assert withdrawn
        after = await ready(c, "smol-infer", INFER)
        assert after["status"]["pid"] != before["pid"]
        assert after["status"]["restarts"] == before["restarts"] + 1
        assert not await asyncio.to_thread(_transfer_dirs, before["pid"])  # reclaimed
        await asyncio.to_thread(
            chat, after["endpoint"]["url"], "smol-infer", after["endpoint"]["api_token"]
        )


async def test_agent_killed_and_restarted_adopts_the_running_engines(fleet: Fleet) -> None:
    async with EtcdClient(fleet.settings()) as c:
        pids = {r: (await get(c, status_key(r)))["pid"] for r in (INFER, LLAMA)}
        token = (await get(c, endpoint_key("smol-infer", INFER)))["api_token"]
        assert fleet.agent is not None
        fleet.agent.proc.send_signal(signal.SIGKILL)
        fleet.agent.proc.wait(10)
        llama_ep = await get(c, endpoint_key("smol-llama", LLAMA))
        await asyncio.to_thread(chat, llama_ep["url"], "smol-llama",
                                llama_ep["api_token"])  # the engine outlived its agent  # fmt: skip
        agent = fleet.start_agent()
        replicas = await eventually(
            lambda: _all_ready(agent), "the new agent reports both replicas Ready", timeout_s=30
        )
        assert {r: replicas[r]["pid"] for r in (INFER, LLAMA)} == pids  # adopted, none started
        assert all(replicas[r]["restarts"] == 0 for r in (INFER, LLAMA))
        for r, model in ((INFER, "smol-infer"), (LLAMA, "smol-llama")):
            ep = await ready(c, model, r)
            assert ep["status"]["pid"] == pids[r]
        ep = (await ready(c, "smol-infer", INFER))["endpoint"]
        assert ep["api_token"] == token  # the adopted engine keeps its secret (state file)
        await asyncio.to_thread(chat, ep["url"], "smol-infer", ep["api_token"])


async def _all_ready(agent: Agent) -> dict[str, Any] | None:
    replicas = (await asyncio.to_thread(admin, agent, "/replicas"))["replicas"]
    ok = len(replicas) == 2 and all(r["phase"] == "Ready" for r in replicas.values())
    return replicas if ok else None


async def test_etcd_outage_engines_keep_serving_and_the_agent_registers_again(
    fleet: Fleet,
) -> None:
    assert fleet.agent is not None
    agent = fleet.agent
    async with EtcdClient(fleet.settings()) as c:
        infer = await ready(c, "smol-infer", INFER)
        node_before = await c.get(f"/cognitora/nodes/{NODE}")
        ep_before = await c.get(endpoint_key("smol-infer", INFER))
        await c.put_json(f"/cognitora/cordon/{NODE}", {"reason": "test"})
        assert node_before is not None and ep_before is not None
    await asyncio.to_thread(fleet.etcd.stop)
    outage_started = time.monotonic()
    try:
        await eventually(
            lambda: _etcd_flag(agent, False), "the agent to notice etcd is gone", timeout_s=15
        )
        url, token = infer["endpoint"]["url"], infer["endpoint"]["api_token"]
        await asyncio.to_thread(chat, url, "smol-infer", token)
        await asyncio.sleep(max(0.0, 20 - (time.monotonic() - outage_started)))
        await asyncio.to_thread(chat, url, "smol-infer", token)
        phases = {
            r["phase"]
            for r in (await asyncio.to_thread(admin, agent, "/replicas"))["replicas"].values()
        }
        assert phases == {"Ready"}  # nothing was stopped for lack of etcd
    finally:
        await asyncio.to_thread(fleet.etcd.start)
    await eventually(lambda: _etcd_flag(agent, True), "the agent back on etcd", timeout_s=30)
    async with EtcdClient(fleet.settings()) as c:

        async def resent() -> bool:
            node = await c.get(f"/cognitora/nodes/{NODE}")
            ep = await c.get(endpoint_key("smol-infer", INFER))
            return bool(node and ep and node.mod_revision > node_before.mod_revision
                        and ep.mod_revision > ep_before.mod_revision)  # fmt: skip

        await eventually(resent, "node and endpoint keys re-sent", timeout_s=30)
        await ready(c, "smol-llama", LLAMA)
        # re-registering never clears a cordon (only cgn-ctl uncordon does)
        assert await c.get_json(f"/cognitora/cordon/{NODE}") == {"reason": "test"}
        await c.delete(f"/cognitora/cordon/{NODE}")


async def _etcd_flag(agent: Agent, want: bool) -> bool:
    return (await asyncio.to_thread(admin, agent, "/healthz"))["etcd"] is want


async def test_changed_placement_replaces_the_engine(fleet: Fleet, smollm2_path: Path) -> None:
    async with EtcdClient(fleet.settings()) as c:
        before = (await ready(c, "smol-infer", INFER))["status"]
        old = _record(fleet, INFER).fingerprint
        assert old is not None and old.pid == before["pid"]
        await c.put_json(PLACE + INFER, {
            "model": "smol-infer", "engine": "cgn_infer", "source": str(smollm2_path),
            "profile": {"threads": 1, "ctx": 1024, "extra_args": ["--kv-pool-tokens", "2048"]},
        })  # fmt: skip

        async def replaced() -> dict[str, Any] | None:
            st = await get(c, status_key(INFER))
            ok = st and st["phase"] == "Ready" and st["pid"] != before["pid"]
            return st if ok else None

        after = await eventually(replaced, "the new engine Ready")
        assert EngineProcess(old).poll()[0]  # the old engine exited
        rec = _record(fleet, INFER)
        assert rec.spec.profile.extra_args == ("--kv-pool-tokens", "2048")
        assert rec.fingerprint is not None and rec.fingerprint.pid == after["pid"]
        await ready(c, "smol-infer", INFER)


def _record(fleet: Fleet, replica: str) -> ReplicaRecord:
    return next(r for r in StateStore(fleet.state).load_all() if r.spec.replica == replica)


async def test_removed_placement_stops_the_engine_and_withdraws_it(fleet: Fleet) -> None:
    async with EtcdClient(fleet.settings()) as c:
        pid = (await ready(c, "smol-llama", LLAMA))["status"]["pid"]
        rec = _record(fleet, LLAMA)
        assert rec.fingerprint is not None and rec.fingerprint.pid == pid
        await c.delete(PLACE + LLAMA)
        await eventually(
            lambda: _absent(c, endpoint_key("smol-llama", LLAMA)), "endpoint withdrawn"
        )
        await eventually(lambda: _absent(c, status_key(LLAMA)), "status removed")
        proc = EngineProcess(rec.fingerprint)
        await eventually(lambda: _gone(proc), "the llama.cpp engine to exit", timeout_s=30)
        assert LLAMA not in {r.spec.replica for r in StateStore(fleet.state).load_all()}
        assert await c.get(endpoint_key("smol-infer", INFER)) is not None  # the other one stays


async def _gone(proc: EngineProcess) -> bool:
    return proc.poll()[0]


async def test_the_agent_runs_the_nodes_kv_store_and_announces_it(fleet: Fleet) -> None:
    """kvcached.mode=run: a second agent (node n2) starts cgn-kvcached, publishes it under its
    lease for routers (events behind the published token), and stops it when it stops."""
    port, admin_port = free_port(), free_port()
    state = fleet.tmp / "agent-n2"
    args = ("--set", "kvcached.mode=run", "--set", f"kvcached.port={port}",
            "--set", f"kvcached.admin_port={admin_port}", "--set", "kvcached.ram_bytes=16777216")  # fmt: skip
    async with EtcdClient(fleet.settings()) as c:
        with cgn_agent(state, fleet.etcd.endpoint, *args, node="n2"):
            record = await eventually(lambda: get(c, "/cognitora/kvcached/n2"), "its record")
            assert record["address"] == f"127.0.0.1:{port}" and len(record["events_token"]) > 20
            assert record["events_url"] == f"http://127.0.0.1:{admin_port}/v1/kv/events"
            first = await asyncio.to_thread(_first_event_line, record)
            assert first.startswith(b'data: {"snapshot"')
            pid = json.loads((state / "kvcached.ready").read_text())["pid"]
            # it runs with the node secret the agent made: engines' token in, strangers out
            keys = StoreKeys.derive(read_secret(state / "kvcached.secret"))
            assert (
                await asyncio.to_thread(_stats_code, record["address"], keys.client_token) is None
            )
            code = await asyncio.to_thread(_stats_code, record["address"], "")
            assert code == grpc.StatusCode.UNAUTHENTICATED
        assert await eventually(lambda: _absent(c, "/cognitora/kvcached/n2"), "the record gone")
    assert not await asyncio.to_thread(runs, pid, "cgn-kvcached")  # stopped with its agent


def _stats_code(address: str, token: str) -> grpc.StatusCode | None:
    from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
    from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc

    meta = [bearer(token)] if token else []
    with grpc.insecure_channel(address) as ch:
        try:
            pb_grpc.KvCacheStub(ch).Stats(pb.StatsRequest(), timeout=10, metadata=meta)
        except grpc.RpcError as exc:
            return exc.code()
    return None


def _first_event_line(record: dict[str, str]) -> bytes:
    bearer = {"Authorization": f"Bearer {record['events_token']}"}
    req = urllib.request.Request(record["events_url"], headers=bearer)
    with urllib.request.urlopen(req, timeout=10) as stream:
        return bytes(stream.readline())
