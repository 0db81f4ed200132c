"""Start and stop real server processes for tests: port 0, readiness, SIGTERM, only our pids."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml

from cgn_core.bundled_models import smollm2
from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import free_port
from cgn_core.kv.identity import StoreKeys, bearer, ensure_secret
from cgn_core.process import stop_group
from cgn_core.readiness import wait_ready_file
from cgn_core.settings import EtcdSettings

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
BIN = Path(sys.executable).parent


stop = stop_group  # SIGTERM our process group, SIGKILL after a grace period


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:  # not healthy yet (503 while loading)
            exc.close()  # NOTE: its socket, or a ResourceWarning fails some later test
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout_s}s")
        time.sleep(0.1)


@contextmanager
def http_process(
    argv: list[str], health: str, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` in a process group of its own, yielded once `health` answers 200, stopped after;
    its output goes to `log` (discarded without one)."""
    with log.open("wb") if log else open(os.devnull, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http_ok(health, proc, timeout_s=120)
        yield proc
    finally:
        stop(proc)


@contextmanager
def cgn_infer(tmp: Path, *args: str, model: Path | None = None) -> Iterator[str]:
    """A real `cgn-infer serve` on a free port; yields its base URL."""
    with cgn_infer_fleet(tmp, 1, *args, model=model) as urls:
        yield urls[0]


@dataclass(frozen=True, slots=True)
class Engine:
    url: str
    proc: subprocess.Popen[bytes]


@contextmanager
def cgn_infer_fleet(
    tmp: Path, n: int, *args: str, model: Path | None = None
) -> Iterator[list[str]]:
    """`n` real `cgn-infer serve` processes started together; yields their engines' base URLs
    (`--engines N` among `args`: N virtual sim engines per process)."""
    with cgn_infer_engines(tmp, n, *args, model=model) as engines:
        yield [e.url for e in engines]


def _start_ready(
    stack: ExitStack, tmp: Path, kind: str, argvs: list[Callable[[Path], list[str]]]
) -> list[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """Start one process per `argv(ready_file)` together (each in its own group, its output in
    a log beside the ready file, stopped with `stack`), then wait for every ready file."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for argv in argvs:
        ready = tmp / f"{kind}-{time.monotonic_ns()}.ready"
        log = stack.enter_context((tmp / f"{ready.name}.log").open("wb"))
        proc = subprocess.Popen(
            argv(ready), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        stack.callback(stop, proc)
        procs.append((proc, ready))
    return [(proc, wait_ready_file(ready, timeout_s=180, proc=proc)) for proc, ready in procs]


@contextmanager
def cgn_infer_engines(
    tmp: Path, n: int, *args: str, model: Path | None = None
) -> Iterator[list[Engine]]:
    """Like `cgn_infer_fleet`, with each engine's process (to kill one in a test)."""

    def argv(ready: Path) -> list[str]:
        return [str(BIN / "cgn-infer"), "serve", "--model", str(model or smollm2()),
                "--port", "0", "--threads", "2", "--ready-file", str(ready), *args]  # fmt: skip

    with ExitStack() as stack:
        engines = []
        for proc, doc in _start_ready(stack, tmp, "infer", [argv] * n):
            # a sim process with --engines N hosts N engines, each on its own port
            for port in doc.get("engines") or [doc["ports"]["http"]]:
                engines.append(Engine(f"http://127.0.0.1:{port}", proc))
        yield engines


@dataclass(frozen=True, slots=True)
class Stage:
    address: str  # host:port the head dials
    proc: subprocess.Popen[bytes]


@contextmanager
def cgn_infer_stages(
    tmp: Path, layers: list[str], *args: str, model: Path | None = None,
    host: str = "127.0.0.1", wrap: tuple[str, ...] = (),
) -> Iterator[list[Stage]]:  # fmt: skip
    """One real `cgn-infer stage --layers L` per entry of `layers` ("": no --layers, `args`
    say which part), started together on free ports of `host` (`wrap`: a command prefix,
    e.g. `ip netns exec NS`); yields them ready."""

    def argv(span: str) -> Callable[[Path], list[str]]:
        return lambda ready: [
            *wrap, str(BIN / "cgn-infer"), "stage", "--model", str(model or smollm2()),
            *(["--layers", span] if span else []), "--host", host, "--port", "0",
            "--threads", "2", "--ready-file", str(ready), *args,
        ]  # fmt: skip

    with ExitStack() as stack:
        started = _start_ready(stack, tmp, "stage", [argv(span) for span in layers])
        yield [Stage(f"{host}:{doc['ports']['pipeline']}", proc) for proc, doc in started]


@contextmanager
def llamacpp(
    model: Path,
    *,
    parallel: int = 1,
    ctx: int = 4096,
    threads: int = 2,
    flash_attn: str = "auto",
    lora: Sequence[Path] = (),
    lora_unapplied: bool = False,
) -> Iterator[str]:
    """llama.cpp's server (xllamacpp) on a free port; yields its base URL once /health is 200."""
    served = llamacpp_server(
        model,
        parallel=parallel,
        ctx=ctx,
        threads=threads,
        flash_attn=flash_attn,
        lora=lora,
        lora_unapplied=lora_unapplied,
    )
    with served as (url, _):
        yield url


@contextmanager
def llamacpp_server(
    model: Path,
    *,
    parallel: int = 1,
    ctx: int = 4096,
    threads: int = 2,
    flash_attn: str = "auto",
    port: int = 0,
    lora: Sequence[Path] = (),
    lora_unapplied: bool = False,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`llamacpp`, on `port` (0: a free one), with its process (a test may kill it);
    `lora`: GGUF adapters applied at scale 1, or with `lora_unapplied` at 0 (a request's
    `lora` field applies them)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "cgn_agent.launchers.xllamacpp_server", "--model", str(model),
            "--port", str(port), "--threads", str(threads), "--parallel", str(parallel),
            "--ctx", str(ctx), "--flash-attn", flash_attn,
            *(a for path in lora for a in ("--lora", str(path))),
            *(["--lora-init-without-apply"] if lora_unapplied else [])]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, timeout_s=180)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


def post(url: str, body: dict[str, object], timeout_s: float = 120) -> dict[str, object]:
    """POST JSON, return JSON (reference-engine calls in tests and benchmarks)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        doc: dict[str, object] = json.load(resp)
        return doc


@dataclass(frozen=True, slots=True)
class Kvcached:
    address: str  # host:port of the gRPC listener
    admin: str  # /metrics, /healthz
    shm_dir: Path
    proc: subprocess.Popen[bytes]
    keys: StoreKeys | None  # derived from its node secret; None: run without one

    @property
    def engine_args(self) -> tuple[str, ...]:
        """What a cgn-infer needs to use this store (the token as the agent would hand it)."""
        token = ("--set", f"kvcached.token={self.keys.client_token}") if self.keys else ()
        return ("--kvcached", self.address, *token)

    def channel(self, token: str | None = None) -> grpc.Channel:
        """A channel to its gRPC listener whose calls present `token` (default: the client
        token the node's engines hold; "" for none)."""
        if token is None:
            token = self.keys.client_token if self.keys else ""
        channel = grpc.insecure_channel(self.address)
        return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
):
    """Adds `authorization: Bearer <token>` to every call (what KvCacheClient sends)."""

    def __init__(self, token: str):
        self.pair = bearer(token)

    def _with(self, d: Any) -> _Details:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self.pair], d.credentials,
                        d.wait_for_ready, d.compression)  # fmt: skip

    def intercept_unary_unary(self, cont: Any, details: Any, request: Any) -> Any:
        return cont(self._with(details), request)

    def intercept_unary_stream(self, cont: Any, details: Any, request: Any) -> Any:
        return cont(self._with(details), request)

    def intercept_stream_unary(self, cont: Any, details: Any, requests: Any) -> Any:
        return cont(self._with(details), requests)


@contextmanager
def cgn_kvcached(
    tmp: Path, *args: str, ram_bytes: int = 1 << 30, secret: bool = True
) -> Iterator[Kvcached]:
    """A real `cgn-kvcached serve` on free ports with its own shm_dir under `tmp`; with
    `secret` (as the agent runs it), the node secret `tmp/kvcached.secret`, kept across
    restarts in the same `tmp`."""
    ready = tmp / f"kvcached-{time.monotonic_ns()}.ready"
    shm = tmp / f"{ready.stem}-shm"
    keys, extra = None, []
    if secret:
        keys = StoreKeys.derive(ensure_secret(tmp / "kvcached.secret"))
        extra = ["--set", f"secret_file={tmp / 'kvcached.secret'}"]
    argv = [str(BIN / "cgn-kvcached"), "serve", "--port", "0", "--admin-port", "0",
            "--ram-bytes", str(ram_bytes), "--set", f"shm_dir={shm}",
            "--ready-file", str(ready), *extra, *args]  # fmt: skip
    with (tmp / f"{ready.stem}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ports = wait_ready_file(ready, timeout_s=60, proc=proc)["ports"]
        yield Kvcached(f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['admin']}",
                       shm, proc, keys)  # fmt: skip
    finally:
        stop(proc)


@dataclass(frozen=True, slots=True)
class Router:
    url: str  # the OpenAI surface
    admin: str  # /metrics, /healthz, /readyz, /endpoints
    proc: subprocess.Popen[bytes]
    ports: Mapping[str, int] = field(default_factory=dict)  # every listener's (epp: #61)


@contextmanager
def cgn_router(
    tmp: Path, config: dict[str, Any], *args: str, src: Path | None = None
) -> Iterator[Router]:
    """A real `cgn-router serve` with `config` as its YAML file, on free ports; with `src`,
    the router of that source tree (another checkout, for benchmarks against it).

    API keys are off unless `config` says otherwise (tests of keys set `auth:`); one
    process unless `config` sets `workers` (tests of workers do).
    """
    config = {"auth": {"enabled": False}, "workers": 1, **config}
    cfg = tmp / f"router-{time.monotonic_ns()}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    ready = cfg.with_suffix(".ready")
    exe, env = [str(BIN / "cgn-router")], None
    if src is not None:  # NOTE: -P: modules from the tree, not from the current folder
        exe = [sys.executable, "-P", "-c", "import sys; from cgn_router.cli import main; "
               "sys.argv[0] = 'cgn-router'; main()"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [*exe, "serve", "--port", "0", "--admin-port", "0",
            "--config", str(cfg), "--ready-file", str(ready), *args]  # fmt: skip
    with (tmp / f"{cfg.stem}.log").open("wb") as log:
        # NOTE: from `src` (its workers run `python -m cgn_router.cli worker`, which imports from
        # the current folder first)
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=src
        )
    try:
        ports = wait_ready_file(ready, timeout_s=60, proc=proc)["ports"]
        yield Router(
            f"http://127.0.0.1:{ports['http']}", f"http://127.0.0.1:{ports['admin']}", proc, ports
        )
    finally:
        stop(proc)


@dataclass(frozen=True, slots=True)
class Agent:
    admin: str  # /metrics, /healthz, /replicas, /inventory
    node: str
    proc: subprocess.Popen[bytes]


@contextmanager
def cgn_agent(
    state_dir: Path,
    etcd_endpoint: str,
    *args: str,
    node: str = "n1",
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[Agent]:
    """A real `cgn-agent run` for node `node`, engines on loopback, quick backoff and drain;
    `prefix` runs it under another command (`ip netns exec <ns>`: another host)."""
    ready = state_dir.parent / f"agent-{time.monotonic_ns()}.ready"
    argv = [*prefix, str(BIN / "cgn-agent"), "run", "--etcd", etcd_endpoint, "--node-id", node,
            "--state-dir", str(state_dir), "--admin-port", "0", "--ready-file", str(ready),
            "--set", "engines.bind_host=127.0.0.1", "--set", "engines.probe_interval_s=0.5",
            "--set", "engines.stop_grace_s=10", "--set", "supervisor.drain_s=0.2",
            "--set", "supervisor.backoff_base_s=0.5", "--set", "supervisor.backoff_cap_s=2",
            *args]  # fmt: skip
    with (state_dir.parent / f"{ready.stem}.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        doc = wait_ready_file(ready, timeout_s=60, proc=proc)
        yield Agent(f"http://127.0.0.1:{doc['ports']['admin']}", node, proc)
    finally:
        stop(proc, grace_s=30)


def etcd_run(endpoint: str, fn: Callable[[EtcdClient], Awaitable[T]]) -> T:
    """Run one async etcd operation from synchronous test code."""

    async def go() -> T:
        async with EtcdClient(EtcdSettings(endpoints=(endpoint,))) as client:
            return await fn(client)

    return asyncio.run(go())


def etcd_put(endpoint: str, key: str, value: Any, lease: int = 0) -> None:
    etcd_run(endpoint, lambda c: c.put_json(key, value, lease=lease))


def runs(pid: int, program: str) -> bool:
    """Whether `pid` is alive and runs `program` (a pid reused by another program: False)."""
    try:
        return program.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


@contextmanager
def cgn_metrics(tmp: Path, *args: str) -> Iterator[str]:
    """A real `cgn-metrics serve` on a free port; yields its base URL once /health is 200."""
    port = free_port()
    exe = str(Path(sys.executable).parent / "cgn-metrics")
    argv = [exe, "serve", "--port", str(port), *args]
    with http_process(argv, f"http://127.0.0.1:{port}/health", tmp / "cgn-metrics.log"):
        yield f"http://127.0.0.1:{port}"
