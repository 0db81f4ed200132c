"""Stand-ins for multi-node vLLM and SGLang ranks that really rendezvous (no GPU needed).

They behave like the real ranks at the process level, which is all the agent sees:

* a rendezvous point (vLLM's master port, SGLang's dist-init address) listens on its port;
  a worker connects, says `join`, and stays connected. A worker whose connection ends exits
  1 (its head went away).
* vLLM on Ray runs against real Ray (`ray start`, from the test extras): `vllm serve` asks
  Ray's own API (`ray.nodes()`) which nodes have joined and how many GPUs they declared,
  prints them, and serves once they hold tensor-parallel × pipeline-parallel GPUs.
* rank 0 serves `/health`, `/v1/models`, `/v1/chat/completions` and a vLLM-style `/metrics`
  only once every rank has joined (SGLang and vLLM-mp: N-1 workers; vLLM on Ray: the GPUs
  above), and exits 1 when a rank is lost afterwards (as NCCL's timeout would end the real
  one).
* every rank refuses to start (exit 2) when `CUDA_VISIBLE_DEVICES` does not name as many
  devices as it claims, or when `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` names an
  interface its network namespace does not have.
`STUB_RENDEZVOUS_DELAY_S` delays opening the rendezvous port (a slow head: workers wait).
Entry points: `bin/vllm`, `python -m sglang.launch_server` (this directory on PYTHONPATH),
`bin/nvidia-smi` (recorded H100 output for the agent's inventory).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def flag(argv: list[str], name: str, default: str = "") -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def say(what: str) -> None:
    print(f"rank-stub: {what}", flush=True)


def check_env(gpus: int) -> None:
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if len(visible) != gpus:
        say(f"CUDA_VISIBLE_DEVICES={visible} but {gpus} GPU(s) asked for")
        sys.exit(2)
    names = {name for _, name in socket.if_nameindex()}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        iface = os.environ.get(var, "").lstrip("=")
        if iface and iface not in names:
            say(f"{var}={iface}: no such interface here ({', '.join(sorted(names))})")
            sys.exit(2)


class Rendezvous:
    """The point workers join; `workers` counts those joined, `lost` those gone since."""

    def __init__(self, host: str, port: int):
        delay = float(os.environ.get("STUB_RENDEZVOUS_DELAY_S", "0"))
        if delay:
            say(f"opening the rendezvous point in {delay:g} s")
            time.sleep(delay)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.lock = threading.Lock()
        self.workers, self.lost = 0, 0
        threading.Thread(target=self._accept, daemon=True).start()
        say(f"rendezvous point open on {host}:{port}")

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as f:
            if f.readline().split()[:1] != ["join"]:
                return
            with self.lock:
                self.workers += 1
            f.write("ok\n")
            f.flush()
            f.read()  # until the worker goes
            with self.lock:
                self.workers, self.lost = self.workers - 1, self.lost + 1


def join(address: str) -> None:
    """Join the rendezvous point at `address` and stay until it goes away, then exit 1."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    sock.settimeout(None)
    with sock, sock.makefile("rw") as f:
        f.write("join\n")
        f.flush()
        if f.readline().strip() != "ok":
            sys.exit(1)
        say(f"joined {address}")
        f.read()
    say(f"the rendezvous point {address} went away")
    sys.exit(1)


def serve_http(host: str, port: int, model: str, gpus: int, token: str) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if token and self.headers.get("Authorization") != f"Bearer {token}":
                self._send(401, b'{"error": {"message": "bad token"}}')
                return False
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"{}")
            elif self.path == "/metrics":
                text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                self._send(200, text.encode(), "text/plain")
            elif self.path == "/v1/models" and self._authorized():
                self._send(200, json.dumps({"data": [{"id": model}]}).encode())

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not self._authorized():
                return
            text = f"served by {gpus} GPUs"
            message = {"role": "assistant", "content": text}
            usage = {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            doc = {"id": "x", "object": "chat.completion", "created": 0, "model": model,
                   "choices": [choice], "usage": usage}  # fmt: skip
            if not body.get("stream"):
                self._send(200, json.dumps(doc).encode())
                return
            delta = {"index": 0, "delta": message, "finish_reason": "stop"}
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [delta]}  # fmt: skip
            self._send(200, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
                       "text/event-stream")  # fmt: skip

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"serving {model} on {host}:{port}")


def head(argv: list[str], ready: Any, gpus: int) -> None:
    """Wait until `ready()`, serve HTTP, and exit 1 once a rank is lost."""
    while not ready():
        time.sleep(0.1)
    token = os.environ.get("VLLM_API_KEY", "")
    serve_http(flag(argv, "--host"), int(flag(argv, "--port")),
               flag(argv, "--served-model-name"), gpus, token)  # fmt: skip
    while ready():
        time.sleep(0.2)
    say("a rank was lost")
    sys.exit(1)


def ray_gpus(address: str, log: list[str]) -> int:
    """The GPUs of the live nodes in the Ray cluster at `address`, asked of Ray's own API;
    each new view of the nodes is printed (`ray cluster: 2 node(s) ...`)."""
    import ray  # real Ray, from the test extras

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    nodes = sorted((n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0))
                   for n in ray.nodes() if n["Alive"])  # fmt: skip
    view = ", ".join(f"{host} with {gpus:g} GPU(s)" for host, gpus in nodes)
    if view != (log[-1] if log else None):
        log.append(view)
        say(f"ray cluster: {len(nodes)} node(s): {view}")
    return int(sum(gpus for _, gpus in nodes))


def vllm(argv: list[str]) -> None:
    tp = int(flag(argv, "--tensor-parallel-size", "1"))
    pp = int(flag(argv, "--pipeline-parallel-size", "1"))
    if flag(argv, "--distributed-executor-backend") == "ray":  # Ray holds the GPUs
        address, seen = os.environ["RAY_ADDRESS"], []
        head(argv, lambda: ray_gpus(address, seen) >= tp * pp, tp * pp)
        return
    nnodes = int(flag(argv, "--nnodes", "1"))
    check_env(tp * pp // nnodes)
    multi(argv, nnodes, f"{flag(argv, '--master-addr')}:{flag(argv, '--master-port')}", tp * pp)


def sglang(argv: list[str]) -> None:
    tp = int(flag(argv, "--tp-size", "1"))
    pp = int(flag(argv, "--pp-size", "1"))
    nnodes = int(flag(argv, "--nnodes", "1"))
    check_env(tp * pp // nnodes)
    multi(argv, nnodes, flag(argv, "--dist-init-addr"), tp * pp)


def multi(argv: list[str], nnodes: int, address: str, gpus: int) -> None:
    """One process per rank: rank 0 opens the rendezvous point and serves, the others join."""
    rank = int(flag(argv, "--node-rank", "0"))
    if rank > 0:
        join(address)
    host, _, port = address.rpartition(":")
    point = Rendezvous(host.strip("[]"), int(port))
    head(argv, lambda: point.workers == nnodes - 1 and not point.lost, gpus)


def main(program: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    argv = sys.argv[1:]
    say(f"{program} {' '.join(argv)}")
    if program == "vllm" and argv[:1] == ["serve"]:
        vllm(argv[1:])
    elif program == "sglang":
        sglang(argv)
    else:
        say(f"unknown command: {program} {' '.join(argv)}")
        sys.exit(2)
