"""cgn-infer's settings tree.

Each dataclass checks its own fields' ranges (`check`, run by the settings loader as it
builds the tree, its errors prefixed with the path); `InferSettings.check` holds the rules
that span several settings. The daemon validates nothing itself.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cgn_core.errors import ConfigError
from cgn_core.keys import NAME
from cgn_core.net import is_host_port
from cgn_core.settings import (
    ListenSettings,
    LogSettings,
    TlsSettings,
    TracingSettings,
    ranged,
)

MAX_LORAS = 64  # adapters one engine holds at once (the catalog's max_adapters, at most)


def parse_lora_flag(value: str) -> tuple[str, Path]:
    """`NAME=PATH` of `--lora`; ValueError says what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not NAME.match(name) or not path:
        raise ValueError(f"--lora expects NAME=PATH (a name of [A-Za-z0-9._:-]), got {value!r}")
    return name, Path(path)


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The sim backend's cost model (seconds). Defaults: fitted to the torch backend on
    SmolLM2-135M, float32, 2 cores (bench/results/sim_calibration.md)."""

    step_s: float = ranged(0.060, 0, 60)
    prefill_s_per_token: float = ranged(0.00116, 0, 10)
    decode_s_per_seq: float = ranged(0.00037, 0, 10)
    decode_s_per_ctx_token: float = ranged(1.14e-5, 0, 1)
    speed: float = ranged(1.0, 0.001, 1000)  # >1: faster than modelled
    # Virtual engines in this one process, each with its own port (http.port and the next
    # ones; 0: any free ports), scheduler, KV pool, metrics and KV event stream, sharing
    # the tokenizer: a fleet of hundreds on a small machine, for tests and benchmarks.
    engines: int = ranged(1, 1, 256)
    # Seconds the weights take to load, slept at start (not scaled by speed): a fleet's cold
    # start, for autoscaling benchmarks; /health says "loading" meanwhile.
    load_s: float = ranged(0.0, 0, 3600)
    # Seconds a LoRA adapter takes to load at run time (not scaled by speed): residency
    # benchmarks (cgn_infer/adapters.py)
    lora_load_s: float = ranged(0.0, 0, 600)


@dataclass(frozen=True, slots=True)
class KvcachedClientSettings:
    """The node's KV store (cgn-kvcached): finished requests' blocks are offered to it and
    prompts restored from it when the cost model says restoring beats recomputing. The
    rates below are starting points; the engine replaces them with what it measures."""

    address: str = ""  # host:port of cgn-kvcached's gRPC listener; empty: not used
    token: str = ""  # the store's client token (the agent sets CGN_INFER_KVCACHED__TOKEN)
    timeout_s: float = ranged(2.0, 0.01, 300)  # per call; a slower answer means recompute
    shared_memory: bool = True  # move blocks through kvcached's shm_dir when on the same host
    ram_mb_per_s: float = ranged(1000.0, 0.001, 1000000.0)  # restore bandwidth from its RAM tier
    ssd_mb_per_s: float = ranged(200.0, 0.001, 1000000.0)  # restore bandwidth from its SSD tier
    fixed_ms: float = ranged(5.0, 0, 60000)  # overhead of one restore
    prefill_tokens_per_s: float = ranged(1000.0, 0.001, 1000000000.0)  # this engine's prefill rate

    def check(self) -> None:
        if self.address and ":" not in self.address:
            raise ConfigError(f"address must be host:port, got {self.address!r}")


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """Prefill/decode disaggregation (docs/cgn-infer.md, "Prefill and decode"): a prefill
    engine holds a prompt's KV blocks for a decode engine to fetch over gRPC."""

    host: str = "127.0.0.1"  # the KV source listener (engines whose role is not decode)
    # 0: any free port (the ready file and the endpoint record say which)
    port: int = ranged(0, 0, 65535)
    advertise: str = ""  # the host decode engines dial; empty: `host`
    # blocks held for transfers, at most (least recent dropped)
    ram_bytes: int = ranged(1 << 30, 1 << 20, 1 << 40)
    # a transfer's blocks are dropped this long after the prefill
    lease_s: float = ranged(30.0, 0.01, 86400)
    # decode side: a fetch slower than this is recomputed instead
    timeout_s: float = ranged(5.0, 0.01, 3600)
    # same host: blocks cross through a file in /dev/shm instead of gRPC messages (a decode
    # engine on another host cannot open it and uses the messages)
    shared_memory: bool = True
    # sim backend: the modelled link (transfer time = bytes / this)
    mb_per_s: float = ranged(1000.0, 0.001, 1000000.0)


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """The layer pipeline (docs/cgn-infer.md, "Layer pipeline"): a model split by layers
    across processes. A stage (`cgn-infer stage`) serves `layers` on host:port; the head
    (`cgn-infer serve` with `stages`) runs the rest and drives the stages in order."""

    host: str = "127.0.0.1"  # stage: listen address
    # stage: listen port (0: any free port; the ready file says which)
    port: int = ranged(9101, 0, 65535)
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
    # head: a step's rows split in this many groups; 0: one per part
    micro_batches: int = ranged(0, 0, 1024)
    # stage: the node id (certificate CN) of the one head it serves; required with TLS
    head: str = ""
    # head: a stage that takes longer over one step is lost
    timeout_s: float = ranged(60.0, 0.01, 3600)
    # head: how long to wait for the stages at start
    connect_timeout_s: float = ranged(120.0, 0.01, 86400)

    def check(self) -> None:
        if bad := [s for s in self.stages if not is_host_port(s)]:
            raise ConfigError(f"stages: expected host:port, got {', '.join(bad)}")


KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # per value of each --kv-dtype


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
    ctx: int = ranged(4096, 2, 1 << 20)
    # 0: torch's default (one per core); used for prompt processing
    threads: int = ranged(0, 0, 1024)
    decode_threads: int = ranged(0, 0, 1024)  # single-stream decode steps; 0: `threads`
    # prompt tokens per step, shared with the decoding streams
    prefill_chunk: int = ranged(512, 1, 65536)
    max_batch: int = ranged(8, 1, 4096)  # sequences running at once
    # KV pool size (16-token blocks); on CPU resident as written
    kv_pool_tokens: int = ranged(16384, 16, 1 << 26)
    # float16 (as llama.cpp keeps its cache) holds the parity bars at half float32's memory;
    # with the gguf kernels every type keeps batched and sequential output identical.
    kv_dtype: Literal["float32", "bfloat16", "float16"] = "float16"  # bytes: KV_DTYPE_BYTES
    # steps the head of the queue may be passed by smaller requests
    aging_steps: int = ranged(8, 0, 1 << 20)
    # LoRA adapters loaded at start (pinned), as NAME=PATH (a GGUF LoRA file): a request names
    # one in `model` (cgn_infer/adapters.py); torch backend with GGUF weights, or sim
    lora: tuple[str, ...] = ()
    max_loras: int = ranged(4, 1, MAX_LORAS)  # adapters held at once (start's and run time's)
    # where POST /v1/load_lora_adapter may read adapter files from; empty: no run-time loads
    lora_dirs: tuple[Path, ...] = ()
    sim: SimSettings = SimSettings()
    kvcached: KvcachedClientSettings = KvcachedClientSettings()
    transfer: TransferSettings = TransferSettings()
    log: LogSettings = LogSettings()
    tracing: TracingSettings = TracingSettings()  # OpenTelemetry spans (cgn_core/tracing.py)
    # Requests to /v1/* must carry `Authorization: Bearer <api_token>`; only they may set
    # x-cgn-priority. The agent sets it (CGN_INFER_API_TOKEN) for every engine it launches
    # and publishes it to the router; empty: no authentication (development only, logged).
    api_token: str = ""
    # HTTPS with client certificates (the cluster CA): /v1/* then also needs a verified
    # certificate (the router's); /health and /metrics need none. Empty: plain HTTP.
    tls: TlsSettings = TlsSettings()

    def check(self) -> None:
        """The rules across settings (every field's range has been checked already)."""
        engines = self.sim.engines
        if engines > 1 and self.backend != "sim":
            raise ConfigError(
                f"sim.engines={engines}: only the sim backend hosts several engines in one "
                "process (--backend sim)"
            )
        if self.http.port and self.http.port + engines - 1 > 65535:
            raise ConfigError(f"sim.engines={engines} from port {self.http.port} runs past 65535")
        self._check_pipeline_head()
        self._check_lora()

    def _check_lora(self) -> None:
        if not self.lora and not self.lora_dirs:
            return
        torch = self.backend == "torch" and not self.pipeline.stages and self.weights == "gguf"
        if not torch and self.backend != "sim":
            raise ConfigError("LoRA adapters run on the torch backend with gguf weights and "
                              "every layer in one process (no --stages), or on sim")  # fmt: skip
        if len(self.lora) > self.max_loras:
            raise ConfigError(f"{len(self.lora)} LoRA adapters (--lora), more than max_loras "
                              f"{self.max_loras}")  # fmt: skip
        names = []
        for value in self.lora:
            try:
                names.append(parse_lora_flag(value)[0])
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora names an adapter twice: {sorted(names)}")

    def check_serve(self) -> None:
        """What only `cgn-infer serve` refuses (a stage is these same settings with layers)."""
        if self.pipeline.layers and not self.pipeline.stages:
            raise ConfigError(
                "pipeline.layers without pipeline.stages: a single process serves "
                "every layer (a stage is `cgn-infer stage --layers A:B`)"
            )

    def _check_pipeline_head(self) -> None:
        """A head (`pipeline.stages`) runs torch or MLX without block export: its KV lives on
        several processes, so block export (kvcached, prefill/decode transfers) does not apply."""
        if not self.pipeline.stages:
            return
        if self.backend not in ("torch", "mlx"):
            raise ConfigError(f"a pipeline head runs the torch or mlx backend, not {self.backend}")
        if self.kvcached.address:
            raise ConfigError("a pipeline head cannot use cgn-kvcached (its KV is on the stages)")
        if self.role != "both":
            raise ConfigError(
                "a pipeline head serves role both (prefill/decode transfers move "
                "whole-model blocks, which no one process of a pipeline holds)"
            )
