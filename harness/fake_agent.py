"""An agent /metrics endpoint with a power source this machine lacks (no powercap here).

The text is produced by the agent's own collector (`cgn_agent.metrics.AgentCollector`),
fed a fixed RAPL-style reading instead of a measured one: `watts` constant, energy
integrated over wall time since start (as the agent does), and `reset()` to mimic an
agent restart (the counter starts again from zero). `watts=None` exports no power at
all, as an agent on a machine without a source does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from cgn_agent.metrics import AgentCollector, registry_for
from cgn_agent.power import PowerReading


class FakePower:
    def __init__(self, watts: float | None, source: str = "rapl"):
        self.watts, self.source = watts, source
        self.started = time.monotonic()

    def reset(self) -> None:
        self.started = time.monotonic()

    def __call__(self) -> tuple[PowerReading, float]:
        if self.watts is None:
            return PowerReading(None, "unknown"), 0.0
        joules = self.watts * (time.monotonic() - self.started)
        parts = {"package-0@intel-rapl:0": self.watts}
        return PowerReading(self.watts, self.source, parts), joules


@contextmanager
def fake_agent(power: FakePower) -> Iterator[str]:
    """Serve /metrics on a free loopback port; yields the base URL."""
    stub: Any = SimpleNamespace(runners={}, refused=[])
    registry = registry_for(AgentCollector(stub, lambda: SimpleNamespace(accelerators=[]),
                                           power, lambda: True))  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
