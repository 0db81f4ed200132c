"""The head of a layer pipeline: a Backend whose layers are split across processes.

The engine does not know it is driving a pipeline: `PipelineBackend` is a Backend. One
step, for each micro-batch of the step's rows in turn:

    head: embed + its layers ──> stage 1 ──> head ──> stage 2 ──> ... ──> head: LM head
                                 (reply forwarded as it came, not decoded at the head)

The head computes micro-batch g+1's layers while the stages work on g, and every stage
answers its stream in order, so with k micro-batches up to k parts work at once. Only the
last stage's reply for the last micro-batch is waited on at the end of the step.

A stage that closes its stream, errors, or takes longer than `pipeline.timeout_s` over a
step is lost: the step raises `BackendLost` and the engine stops (its /health says which
stage and why), so the agent restarts the replica. Nothing is retried inside the head: a
stage's pool state after a failed step is unknown.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from cgn_core.errors import ConfigError
from cgn_core.settings import TlsSettings
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.tls import channel, warn_if_plaintext
from cgn_infer.backends.base import BackendLost, SingleSequence
from cgn_infer.backends.paged import BatchItem, layout
from cgn_infer.models.args import Args
from cgn_infer.pipeline import wire
from cgn_infer.settings import InferSettings
from cgn_proto.cognitora.v1 import pipeline_pb2 as pb
from cgn_proto.cognitora.v1 import pipeline_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StageLost(BackendLost):
    pass


class StageClient:
    """One stage: its channel, its Run stream, and the replies still owed (in order)."""

    def __init__(self, address: str, tls: TlsSettings):
        self.address = address
        self._stub = pb_grpc.StageStub(channel(address, tls, wire.GRPC_OPTIONS))
        self._lock = threading.Lock()
        self._pending: collections.deque[Future[pb.StageReply]] = collections.deque()
        self._requests: queue.Queue[pb.StageRequest | None] | None = None
        self._call: Any = None
        self.lost: str | None = None
        self.sent_bytes = 0  # activation bytes sent to this stage / received from it
        self.received_bytes = 0
        self.steps = 0  # steps answered
        self.compute_s = 0.0  # time the stage reported in its layers

    def describe(self, wait_s: float) -> pb.StageInfo:
        """What the stage serves, waiting up to `wait_s` for it to come up."""
        try:
            info: pb.StageInfo = self._stub.Describe(
                pb.DescribeRequest(), timeout=wait_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConfigError(
                    f"pipeline stage {self.address} did not answer within {wait_s:.0f}s"
                ) from None
            raise ConfigError(f"pipeline stage {self.address}: {exc.details()}") from None
        return info

    def open(self, request: pb.Open, timeout_s: float) -> None:
        """A new stream (the stage allocates a fresh pool); the previous one is closed."""
        self.close()
        self.lost = None
        requests: queue.Queue[pb.StageRequest | None] = queue.Queue()
        opened: Future[pb.StageReply] = Future()
        with self._lock:
            self._pending = collections.deque([opened])
            self._requests = requests
        self._call = self._stub.Run(iter(requests.get, None))
        requests.put(pb.StageRequest(open=request))
        threading.Thread(
            target=self._read, args=(self._call,), name=f"stage-{self.address}", daemon=True
        ).start()
        try:
            opened.result(timeout_s)
        except FutureTimeout:
            raise StageLost(f"stage {self.address} did not open within {timeout_s:.0f}s") from None

    def submit(self, step: pb.Step) -> Future[pb.StageReply]:
        fut: Future[pb.StageReply] = Future()
        with self._lock:
            if self.lost is not None or self._requests is None:
                raise StageLost(f"stage {self.address} is lost: {self.lost or 'not open'}")
            self._pending.append(fut)
            self._requests.put(pb.StageRequest(step=step))
        self.sent_bytes += _payload(step.hidden)
        return fut

    def _read(self, call: Any) -> None:
        """The stream's replies, matched to the steps in the order they were sent."""
        why = "the stage closed the stream"
        try:
            for reply in call:
                with self._lock:
                    fut = self._pending.popleft() if self._pending else None
                if fut is None:
                    why = "the stage sent a reply nobody asked for"
                    break
                if reply.HasField("step"):
                    self.received_bytes += _payload(reply.step.hidden)
                    self.steps += 1
                    self.compute_s += reply.step.compute_s
                fut.set_result(reply)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # NOTE: the reader must fail the waiters, whatever broke
            why = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if self._call is not call:  # a newer stream replaced this one
                return
            self.lost = why
            waiting, self._pending = list(self._pending), collections.deque()
        log.error("pipeline stage %s lost: %s", self.address, why)
        for fut in waiting:
            fut.set_exception(StageLost(f"stage {self.address}: {why}"))

    def close(self) -> None:
        with self._lock:
            call, requests = self._call, self._requests
            self._call, self._requests = None, None
        if requests is not None:
            requests.put(None)
        if call is not None:
            call.cancel()


@dataclass(slots=True)
class PipelineKV:
    """The head's own pool, and which opening of the stages' pools it goes with."""

    local: Any
    opening: int


class PipelineBackend(SingleSequence):
    """A Backend over the head's part (embedding, first layers, LM head) and its stages."""

    name = "pipeline"

    def __init__(
        self,
        local: Any,  # a torch or MLX backend with layers [0, A) and the ends
        stages: Sequence[tuple[StageClient, pb.StageInfo]],
        model: str,
        *,
        activations: str = "f16",
        micro_batches: int = 0,
        timeout_s: float = 60.0,
    ):
        self.local, self.stages, self.model = local, list(stages), model
        self.args: Args = local.args
        self.activations = wire.ACTIVATIONS[activations]
        self.micro_batches = micro_batches or len(self.stages) + 1
        self.timeout_s = timeout_s
        self._opening = 0
        self._ids = itertools.count()

    @property
    def lost(self) -> str | None:
        """The first lost stage and why (its stream broke, even with no step in flight);
        the engine then reports itself failed, so the agent restarts the replica."""
        for client, _ in self.stages:
            if client.lost is not None:
                return f"stage {client.address}: {client.lost}"
        return None

    @property
    def collector(self) -> Collector:
        return self  # collect(): its stages' traffic and time

    def weight_bytes(self) -> int:
        return int(self.local.weight_bytes())

    def kv_bytes_per_token(self) -> int:
        return int(self.local.kv_bytes_per_token())  # this process's share

    def kv_nbytes(self, kv: PipelineKV) -> int:
        return int(self.local.kv_nbytes(kv.local))

    def kv_layout(self) -> tuple[str, int, int, int]:
        dtype, _, kv_heads, head_dim = self.local.kv_layout()
        return dtype, self.args.n_layers, kv_heads, head_dim

    def new_kv(self, num_blocks: int) -> PipelineKV:
        """The head's pool, and a fresh pool of the same size on every stage."""
        local = self.local.new_kv(num_blocks)
        for client, info in self.stages:
            request = pb.Open(
                model=self.model,
                pool_blocks=num_blocks,
                first_layer=info.first_layer,
                end_layer=info.end_layer,
            )
            try:
                client.open(request, self.timeout_s)
            except StageLost as exc:  # at start: a stage that changed since Describe, or died
                raise ConfigError(f"pipeline {exc}") from None
        self._opening += 1
        return PipelineKV(local, self._opening)

    def read_blocks(self, kv: PipelineKV, ids: Sequence[int]) -> np.ndarray:
        raise NotImplementedError("a pipeline's KV lives on its stages: no block export")

    def write_blocks(self, kv: PipelineKV, ids: Sequence[int], data: np.ndarray) -> None:
        raise NotImplementedError("a pipeline's KV lives on its stages: no block import")

    def forward_batch(
        self, items: Sequence[BatchItem], kv: PipelineKV, *, all_logits: bool = False
    ) -> np.ndarray:
        if kv.opening != self._opening:
            raise ValueError("this KV pool belongs to an earlier opening of the stages")
        flights = []
        for group in _split(items, self.micro_batches):
            lay = layout(group)
            x = self.local.run_layers(self.local.embed(lay), lay, kv.local)
            flights.append(self._through_stages(self.local.to_numpy(x), group, all_logits))
        out = []
        for fut in flights:
            try:
                hidden = fut.result(self.timeout_s)
            except FutureTimeout:
                raise StageLost(
                    f"a pipeline step took over {self.timeout_s:.0f}s "
                    f"(stages {', '.join(c.address for c, _ in self.stages)})"
                ) from None
            out.append(self.local.logits(self.local.from_numpy(hidden), None, kv.local))
        return np.concatenate(out)

    def _through_stages(
        self, x: np.ndarray, group: Sequence[BatchItem], all_logits: bool
    ) -> Future[np.ndarray]:
        """Send the head's output through every stage in turn; resolves with the last
        stage's hidden states (only each sequence's last row unless `all_logits`)."""
        result: Future[np.ndarray] = Future()
        rows = wire.items_to_rows(group)
        step_id = next(self._ids)
        last = len(self.stages) - 1

        def send(i: int, hidden: pb.Hidden) -> None:
            step = pb.Step(
                id=step_id,
                rows=rows,
                hidden=hidden,
                reply_dtype=self.activations,
                last_rows_only=i == last and not all_logits,
            )
            self.stages[i][0].submit(step).add_done_callback(_then(i))

        def _then(i: int) -> Callable[[Future[pb.StageReply]], None]:
            def done(f: Future[pb.StageReply]) -> None:
                try:
                    reply = f.result()
                    if not reply.HasField("step") or reply.step.id != step_id:
                        raise StageLost(f"stage {self.stages[i][0].address} answered out of turn")
                    if i < last:
                        send(i + 1, reply.step.hidden)
                    else:
                        result.set_result(wire.decode(reply.step.hidden, self.args.dim))
                except BaseException as exc:  # NOTE: a callback: hand every failure to the waiter
                    if not result.done():
                        result.set_exception(
                            exc
                            if isinstance(exc, StageLost)
                            else StageLost(
                                f"stage {self.stages[i][0].address}: {type(exc).__name__}: {exc}"
                            )
                        )

            return done

        try:
            send(0, wire.encode(x, self.activations))
        except StageLost as exc:
            result.set_exception(exc)
        return result

    def close(self) -> None:
        for client, _ in self.stages:
            client.close()

    def collect(self) -> Iterator[Metric]:
        """Per-stage traffic and time, for the engine's /metrics (a prometheus collector)."""
        sent = CounterMetricFamily(
            "cgn_infer_pipeline_bytes",
            "Activation bytes on the wire, per stage and direction.",
            labels=["stage", "direction"],
        )
        steps = CounterMetricFamily(
            "cgn_infer_pipeline_steps", "Steps a stage answered.", labels=["stage"]
        )
        busy = CounterMetricFamily(
            "cgn_infer_pipeline_stage_compute_seconds",
            "Time stages report in their layers.",
            labels=["stage"],
        )
        for client, _ in self.stages:
            sent.add_metric([client.address, "out"], client.sent_bytes)
            sent.add_metric([client.address, "in"], client.received_bytes)
            steps.add_metric([client.address], client.steps)
            busy.add_metric([client.address], client.compute_s)
        yield from (sent, steps, busy)


def _payload(h: pb.Hidden) -> int:
    """The activation bytes a message carries (values, scales, outliers)."""
    return len(h.data) + len(h.scales) + len(h.outliers)


def _split(items: Sequence[BatchItem], k: int) -> list[Sequence[BatchItem]]:
    """`items` in up to `k` contiguous groups of near-equal size (in order)."""
    k = max(1, min(k, len(items)))
    size, extra = divmod(len(items), k)
    groups, at = [], 0
    for g in range(k):
        n = size + (1 if g < extra else 0)
        groups.append(items[at : at + n])
        at += n
    return groups


def connect(
    gguf: GGUFFile,
    args: Args,
    settings: InferSettings,
    build_local: Callable[[tuple[int, int]], Any],
) -> PipelineBackend:
    """Reach every stage, check that the parts tile the model, load the head's part."""
    p = settings.pipeline
    if settings.tls.enabled:
        if settings.tls.cert_file is None:
            raise ConfigError("a pipeline head with TLS needs its certificate (tls.cert_file)")
    else:
        warn_if_plaintext(log, "pipeline head", settings.tls)
    model = wire.fingerprint(gguf)
    stages = []
    for address in p.stages:
        client = StageClient(address, settings.tls)
        info = client.describe(p.connect_timeout_s)
        if info.model != model:
            raise ConfigError(
                f"pipeline stage {address} serves another model file than "
                f"{gguf.path.name} (every part must load the same GGUF)"
            )
        if info.n_layers != args.n_layers or info.hidden_size != args.dim:
            raise ConfigError(
                f"pipeline stage {address}: a model of {info.n_layers} layers, "
                f"{info.hidden_size} wide; this one has {args.n_layers}, {args.dim}"
            )
        stages.append((client, info))
    head = wire.parse_layers(p.layers) if p.layers else (0, stages[0][1].first_layer)
    parts = [("the head", head)]
    parts += [(f"stage {c.address}", (i.first_layer, i.end_layer)) for c, i in stages]
    wire.check_tiling(args.n_layers, parts)
    local = build_local(head)
    log.info(
        "pipeline: head layers %d:%d, %s; activations %s",
        *head,
        ", ".join(f"{c.address} {i.first_layer}:{i.end_layer}" for c, i in stages),
        p.activations,
    )
    return PipelineBackend(
        local,
        stages,
        model,
        activations=p.activations,
        micro_batches=p.micro_batches,
        timeout_s=p.timeout_s,
    )
