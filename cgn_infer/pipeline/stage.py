"""`cgn-infer stage --layers A:B`: one part of a layer pipeline, serving its layers over gRPC.

    load layers A..B-1 (nothing else) ──> listen ──> Describe / Run streams from the head
                                                         │
        Run:  Open (model, pool size, range) ──> a fresh KV pool for these layers
              Step (rows + hidden) ──> layers ──> StepDone (hidden), in order, until the
              stream ends or another head stream replaces it

The stage keeps no per-sequence state: every step names each row's positions and block
table, so its pool mirrors the head's bookkeeping by construction. All compute runs on one
thread (the one that loaded the weights: torch's thread team belongs to it). A malformed
step ends that stream with INVALID_ARGUMENT and the message; the stage keeps serving.

Security: with TLS (tls.*), the server requires a client certificate from the cluster CA
whose CN is `pipeline.head` (the head's node id); any other caller is PERMISSION_DENIED.
Without TLS anyone who reaches the port can drive it (logged: development only).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from cgn_core import bundled_models
from cgn_core.errors import CognitoraError, ConfigError
from cgn_core.readiness import announce_ready, announce_stopping
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.tls import grpc_peer_cn, server_credentials, warn_if_plaintext
from cgn_infer.backends.build import build_part
from cgn_infer.backends.paged import layout
from cgn_infer.models import args_from_gguf
from cgn_infer.pipeline import wire
from cgn_infer.settings import InferSettings
from cgn_proto.cognitora.v1 import pipeline_pb2 as pb
from cgn_proto.cognitora.v1 import pipeline_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_POOL_BLOCKS = 1 << 20  # 16M tokens: a head asking for more is refused


class StageService(pb_grpc.StageServicer):  # type: ignore[misc]
    """The gRPC side of a stage over a loaded part (a TorchBackend with layers, no ends)."""

    def __init__(
        self, backend: Any, info: pb.StageInfo, compute: ThreadPoolExecutor, *, head: str, tls: bool
    ):
        self.backend, self.info, self.compute = backend, info, compute
        self.head, self.tls = head, tls
        self._gate = threading.Lock()
        self._stream = 0  # the newest stream; older ones end at their next message

    def _refusal(self, context: grpc.ServicerContext) -> str | None:
        if not self.tls:
            return None
        cn = grpc_peer_cn(context)
        if cn != self.head:
            return f"this stage serves head {self.head!r}; the caller's certificate is {cn!r}"
        return None

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.StageInfo:
        if why := self._refusal(context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return self.info

    def Run(
        self, requests: Iterator[pb.StageRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StageReply]:
        if why := self._refusal(context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        first = next(requests, None)
        if first is None:
            return
        try:
            kv, pool_blocks = self._open(first)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        with self._gate:
            self._stream += 1
            me = self._stream
        log.info("a head opened the pipeline (%d pool blocks)", pool_blocks)
        yield pb.StageReply(opened=self.info)
        for req in requests:
            if me != self._stream:
                context.abort(grpc.StatusCode.ABORTED, "another head stream replaced this one")
            try:
                done = self._step(req, kv, pool_blocks)
            except ValueError as exc:  # WireError, or a block table too short for its rows
                log.warning("a malformed pipeline step: %s", exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # NOTE: this stream ends; the stage serves the next one
                log.exception("a pipeline step failed")
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            yield pb.StageReply(step=done)

    def _open(self, req: pb.StageRequest) -> tuple[Any, int]:
        if req.WhichOneof("kind") != "open":
            raise wire.WireError("a stream must start with Open")
        o = req.open
        if o.model != self.info.model:
            raise wire.WireError(
                f"the head serves model {o.model}, this stage {self.info.model} "
                "(both must load the same GGUF file)"
            )
        if (o.first_layer, o.end_layer) != (self.info.first_layer, self.info.end_layer):
            raise wire.WireError(
                f"the head expects layers {o.first_layer}:{o.end_layer} here, this stage "
                f"serves {self.info.first_layer}:{self.info.end_layer}"
            )
        if not 1 <= o.pool_blocks <= MAX_POOL_BLOCKS:
            raise wire.WireError(f"pool of {o.pool_blocks} blocks: expected 1..{MAX_POOL_BLOCKS}")
        kv = self.compute.submit(self.backend.new_kv, o.pool_blocks).result()
        return kv, o.pool_blocks

    def _step(self, req: pb.StageRequest, kv: Any, pool_blocks: int) -> pb.StepDone:
        if req.WhichOneof("kind") != "step":
            raise wire.WireError("Open may only start a stream")
        step = req.step
        items = wire.rows_to_items(step.rows, pool_blocks, self.backend.args.ctx_len)
        x = wire.decode(step.hidden, self.info.hidden_size)
        lay = layout(items)  # ValueError: a table too short for its rows
        if x.shape[0] != len(lay.ids):
            raise wire.WireError(f"{x.shape[0]} activation rows for {len(lay.ids)} tokens")
        out, took = self.compute.submit(self._forward, x, lay, kv, step.last_rows_only).result()
        return pb.StepDone(id=step.id, hidden=wire.encode(out, step.reply_dtype), compute_s=took)

    def _forward(self, x: np.ndarray, lay: Any, kv: Any, last_only: bool) -> tuple[Any, float]:
        started = time.perf_counter()
        b = self.backend
        y = b.to_numpy(b.run_layers(b.from_numpy(x), lay, kv), lay.last_rows if last_only else None)
        return y, time.perf_counter() - started


def check_stage_settings(settings: InferSettings) -> None:
    """ConfigError for settings a stage cannot run with (before anything loads)."""
    p = settings.pipeline
    if bool(p.layers) == bool(p.part):
        raise ConfigError(
            "a stage needs its layers: --layers FIRST:END (e.g. 15:30) or "
            "--part I/N (part I of N, layers balanced by weight; the head is 0)"
        )
    if p.part:
        wire.parse_part(p.part)
    elif (span := wire.parse_layers(p.layers))[0] == span[1]:
        raise ConfigError(f"layers {p.layers}: a stage must serve at least one layer")
    if settings.backend not in ("torch", "mlx"):
        raise ConfigError(f"a stage runs the torch or mlx backend, not {settings.backend}")
    if settings.tls.enabled and not p.head:
        raise ConfigError("with TLS a stage serves one head: --head NODE_ID (its certificate CN)")
    if not 0 <= p.port <= 65535:
        raise ConfigError(f"pipeline.port must be in 0..65535, got {p.port}")


def load_stage(settings: InferSettings) -> tuple[Any, pb.StageInfo]:
    """The part's backend (only its layers' tensors are read) and what it serves."""
    if settings.model is None:
        raise ConfigError("no model given: pass --model PATH (a GGUF file)")
    p = settings.pipeline
    gguf = GGUFFile(bundled_models.resolve(settings.model))
    args = args_from_gguf(gguf)
    if p.part:
        i, n = wire.parse_part(p.part)
        first, end = wire.balanced_split(gguf, args.n_layers, n)[i]
    else:
        first, end = wire.parse_layers(p.layers)
    if end > args.n_layers:
        raise ConfigError(f"layers {first}:{end}: {gguf.path.name} has {args.n_layers} layers")
    backend = build_part(gguf, args, settings, (first, end), ends=False)
    info = pb.StageInfo(
        first_layer=first,
        end_layer=end,
        n_layers=args.n_layers,
        model=wire.fingerprint(gguf),
        backend=settings.backend,
        weight_bytes=backend.weight_bytes(),
        hidden_size=args.dim,
    )
    return backend, info


def run(settings: InferSettings, ready_file: Path | None) -> None:
    """Load, listen, announce ready, serve until SIGTERM/SIGINT."""
    check_stage_settings(settings)
    p = settings.pipeline
    compute = ThreadPoolExecutor(1, thread_name_prefix="cgn-infer-stage")
    started = time.monotonic()
    try:
        backend, info = compute.submit(load_stage, settings).result()
    except CognitoraError as exc:
        raise ConfigError(exc.message) from None
    service = StageService(backend, info, compute, head=p.head, tls=settings.tls.enabled)
    server = grpc.server(
        ThreadPoolExecutor(4, thread_name_prefix="cgn-infer-grpc"), options=wire.GRPC_OPTIONS
    )
    pb_grpc.add_StageServicer_to_server(service, server)
    address = f"{p.host}:{p.port}"
    if settings.tls.enabled:
        port = server.add_secure_port(address, server_credentials(settings.tls))
    else:
        warn_if_plaintext(log, "pipeline stage", settings.tls)
        port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot listen on {address} (in use, or not an address here)")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    first, end = info.first_layer, info.end_layer
    log.info(
        "stage: layers %d:%d of %d (%.1f MiB of weights) loaded in %.1fs; serving on %s:%d",
        first,
        end,
        info.n_layers,
        info.weight_bytes / 2**20,
        time.monotonic() - started,
        p.host,
        port,
    )
    announce_ready(
        ready_file,
        f"stage {first}:{end} on port {port}",
        ports={"pipeline": port},
        layers=[first, end],
    )
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        announce_stopping()
        server.stop(grace=0.5).wait(5)  # a step in flight ends; the head sees the stage go
        compute.shutdown(wait=False)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
