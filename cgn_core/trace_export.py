"""The export side of cgn_core/tracing.py: a span processor with a bounded queue and one
thread that sends batches over OTLP/gRPC. Imported only when tracing is on (it needs the
OpenTelemetry SDK and exporter, the `tracing` extra)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExportResult

from cgn_core.settings import TracingSettings

log = logging.getLogger(__name__)
BATCH = 512  # spans per export call


class Exporting(SpanProcessor):
    """A span processor: every sampled span that ends is queued for the export thread, or
    dropped and counted when `queue_spans` are already waiting."""

    def __init__(self, settings: TracingSettings):
        insecure = not settings.endpoint.startswith("https://")
        self.exporter = OTLPSpanExporter(
            endpoint=settings.endpoint, insecure=insecure, timeout=settings.export_timeout_s
        )
        self.capacity = settings.queue_spans
        self.every_s = settings.export_every_s
        self.queue: deque[ReadableSpan] = deque()
        self.dropped = 0
        self.exported = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="trace-export", daemon=True)
        self._thread.start()

    # ---- SpanProcessor ----

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self._put(span)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        deadline = time.monotonic() + timeout_millis / 1000
        while self.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.queue

    # ---- the export thread ----

    def _put(self, span: ReadableSpan) -> None:
        with self._lock:
            if len(self.queue) >= self.capacity:
                self.dropped += 1
                return
            self.queue.append(span)
            full = len(self.queue) >= BATCH
        if full:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.every_s)
            self._wake.clear()
            while True:
                with self._lock:
                    batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
                if not batch:
                    break
                try:
                    ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
                except Exception:  # NOTE: the export thread's top: a collector must not end it
                    log.exception("trace export failed")
                    ok = False
                with self._lock:
                    if ok:
                        self.exported += len(batch)
                    else:
                        self.dropped += len(batch)
            if self._stop:
                return
