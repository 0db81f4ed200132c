"""cgn-infer's settings tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.settings import ListenSettings, LogSettings, TlsSettings


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The sim backend's cost model (seconds). Defaults: fitted to the torch backend on
    SmolLM2-135M, float32, 2 cores (bench/results/sim_calibration.md)."""

    step_s: float = 0.060
    prefill_s_per_token: float = 0.00116
    decode_s_per_seq: float = 0.00037
    decode_s_per_ctx_token: float = 1.14e-5
    speed: float = 1.0  # >1: faster than modelled
    # Virtual engines in this one process, each with its own port (http.port and the next
    # ones; 0: any free ports), scheduler, KV pool, metrics and KV event stream, sharing
    # the tokenizer: a fleet of hundreds on a small machine, for tests and benchmarks.
    engines: int = 1


@dataclass(frozen=True, slots=True)
class KvcachedClientSettings:
    """The node's KV store (cgn-kvcached): finished requests' blocks are offered to it and
    prompts restored from it when the cost model says restoring beats recomputing. The
    rates below are starting points; the engine replaces them with what it measures."""

    address: str = ""  # host:port of cgn-kvcached's gRPC listener; empty: not used
    timeout_s: float = 2.0  # per call; a slower answer means recompute
    shared_memory: bool = True  # move blocks through kvcached's shm_dir when on the same host
    ram_mb_per_s: float = 1000.0  # restore bandwidth from its RAM tier
    ssd_mb_per_s: float = 200.0  # restore bandwidth from its SSD tier
    fixed_ms: float = 5.0  # overhead of one restore
    prefill_tokens_per_s: float = 1000.0  # this engine's prefill rate


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """Prefill/decode disaggregation (docs/cgn-infer.md, "Prefill and decode"): a prefill
    engine holds a prompt's KV blocks for a decode engine to fetch over gRPC."""

    host: str = "127.0.0.1"  # the KV source listener (engines whose role is not decode)
    port: int = 0  # 0: any free port (the ready file and the endpoint record say which)
    advertise: str = ""  # the host decode engines dial; empty: `host`
    ram_bytes: int = 1 << 30  # blocks held for transfers, at most (least recent dropped)
    lease_s: float = 30.0  # a transfer's blocks are dropped this long after the prefill
    timeout_s: float = 5.0  # decode side: a fetch slower than this is recomputed instead
    # same host: blocks cross through a file in /dev/shm instead of gRPC messages (a decode
    # engine on another host cannot open it and uses the messages)
    shared_memory: bool = True
    mb_per_s: float = 1000.0  # sim backend: the modelled link (transfer time = bytes / this)


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """The layer pipeline (docs/cgn-infer.md, "Layer pipeline"): a model split by layers
    across processes. A stage (`cgn-infer stage`) serves `layers` on host:port; the head
    (`cgn-infer serve` with `stages`) runs the rest and drives the stages in order."""

    host: str = "127.0.0.1"  # stage: listen address
    port: int = 9101  # stage: listen port (0: any free port; the ready file says which)
    # this part's layers, FIRST:END (END excluded); the head's default: every layer before
    # the first stage's
    layers: str = ""
    # stage: I/N, part I (1..N-1) of an N-part pipeline (the head is part 0), layers
    # balanced by weight bytes (every part computes the same split from the same file)
    part: str = ""
    stages: tuple[str, ...] = ()  # head: each stage's host:port, in layer order
    # what crosses the wire between parts: f32 (exact), f16 (half the bytes), int8 (a
    # quarter, one scale per row)
    activations: Literal["f32", "f16", "int8"] = "f16"
    micro_batches: int = 0  # head: a step's rows split in this many groups; 0: one per part
    # stage: the node id (certificate CN) of the one head it serves; required with TLS
    head: str = ""
    timeout_s: float = 60.0  # head: a stage that takes longer over one step is lost
    connect_timeout_s: float = 120.0  # head: how long to wait for the stages at start


@dataclass(frozen=True, slots=True)
class InferSettings:
    http: ListenSettings = ListenSettings(port=8001)
    pipeline: PipelineSettings = PipelineSettings()
    model: Path | None = None  # a GGUF file
    model_name: str = ""  # the name clients ask for; empty: the GGUF file's stem
    backend: Literal["torch", "mlx", "sim"] = "torch"
    # prefill: serves prefill legs and holds their KV for transfer; decode: fetches it;
    # both (default): either, and ordinary requests
    role: Literal["both", "prefill", "decode"] = "both"
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...
    # Weight storage: gguf keeps the file's quantized blocks (the memory the file takes, the
    # fastest decode; C kernels built once per machine, float32 where a type has none or no
    # C compiler exists); float32 dequantizes everything (4-8x the memory); the others are
    # compared in docs/cgn-infer.md.
    weights: Literal["gguf", "auto", "bfloat16", "float16", "float32", "int8", "int4"] = "gguf"
    ctx: int = 4096
    threads: int = 0  # 0: torch's default (one per core); used for prompt processing
    decode_threads: int = 0  # single-stream decode steps; 0: `threads`
    prefill_chunk: int = 512  # prompt tokens per step, shared with the decoding streams
    max_batch: int = 8  # sequences running at once
    kv_pool_tokens: int = 16384  # KV pool size (16-token blocks); on CPU resident as written
    # float32 keeps batched and sequential greedy output identical; bfloat16 halves the pool.
    kv_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    aging_steps: int = 8  # steps the head of the queue may be passed by smaller requests
    sim: SimSettings = SimSettings()
    kvcached: KvcachedClientSettings = KvcachedClientSettings()
    transfer: TransferSettings = TransferSettings()
    log: LogSettings = LogSettings()
    # Requests to /v1/* must carry `Authorization: Bearer <api_token>`; only they may set
    # x-cgn-priority. The agent sets it (CGN_INFER_API_TOKEN) for every engine it launches
    # and publishes it to the router; empty: no authentication (development only, logged).
    api_token: str = ""
    # HTTPS with client certificates (the cluster CA): /v1/* then also needs a verified
    # certificate (the router's); /health and /metrics need none. Empty: plain HTTP.
    tls: TlsSettings = TlsSettings()
