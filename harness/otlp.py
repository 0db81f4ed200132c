"""An OTLP/gRPC trace receiver in the test process: the real collector protocol (the service
and messages of opentelemetry-proto), keeping every span it is sent as a flat `Span`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {1: "internal", 2: "server", 3: "client"}


@dataclass(frozen=True, slots=True)
class Span:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: str
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, which) if which else None


class Receiver(rpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.url = ""

    def Export(self, request: pb.ExportTraceServiceRequest, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=KINDS.get(s.kind, str(s.kind)),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            error=s.status.code == 2,  # STATUS_CODE_ERROR
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans += got
        return pb.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, what: str, found: Callable[[list[Span]], Any], timeout_s: float = 20) -> Any:
        """Poll the spans received until `found(spans)` is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if value := found(spans):
                return value
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"no {what} within {timeout_s} s; received: {names}")
            time.sleep(0.05)


@contextmanager
def receiver() -> Iterator[Receiver]:
    """A receiver listening on a free loopback port (`.url` is its OTLP endpoint)."""
    r = Receiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    rpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    r.url = f"http://127.0.0.1:{port}"
    try:
        yield r
    finally:
        server.stop(grace=None)
