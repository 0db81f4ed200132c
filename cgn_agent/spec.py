"""The replica spec: what a placement asks this node to run.

A placement (`/cognitora/placements/<node>/<replica>`, written by the
reconciler or by hand) is a JSON object; this module turns it into a frozen
`ReplicaSpec` or a `ValueError` that names the bad field. The spec is also
what the agent's state file keeps for orphan adoption, so it round-trips
through `spec_to_json` / `parse_placement` unchanged.

    {"model": "smollm2", "engine": "cgn_infer", "source": "/models/smollm2.gguf",
     "port": 0, "devices": [], "role": "both",
     "profile": {"ctx": 4096, "threads": 2, "extra_args": ["--max-batch", "4"]}}

A replica that spans several nodes has one placement per node, all under the same replica
id, each naming its part: part 0 is the head (the only part the router sees).
* A cgn-infer layer pipeline: parts 1.. are stages. The head's placement gets the stages'
  addresses from the reconciler once every stage is Ready; until then the head waits.

     "pipeline": {"part": 0, "parts": 2, "head": "n1", "stages": ["10.0.0.2:40123"]}

* vLLM or SGLang (cgn_core/multinode.py): parts are ranks. Rank 0 starts at once and opens
  the rendezvous point; the other ranks' placements get its address from the reconciler
  (rank 0's status reports it), and they start then.

     "pipeline": {"part": 1, "parts": 2, "head": "n1", "rendezvous": "10.0.0.1:40555"}
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, get_args

from cgn_core.keys import NAME
from cgn_core.lora import MAX_PER_REPLICA
from cgn_core.multinode import LAUNCH_MODES, RANK_ENGINES

ReplicaId = NewType("ReplicaId", str)
Role = Literal["both", "prefill", "decode"]
KvConnector = Literal["none", "lmcache", "nixl", "hicache", "kvbm"]
ENGINES = ("cgn_infer", "llama_cpp", "vllm", "sglang", "mlx_lm", "trtllm", "openai_compat")
MAX_LORA = MAX_PER_REPLICA
MAX_LORA_SLOTS = 64  # cgn-infer's max_loras, at most (the catalog's max_adapters too)
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Engine options a placement may set; None leaves the engine's own default."""

    ctx: int | None = None  # context length in tokens
    threads: int | None = None  # CPU threads (cgn_infer, llama_cpp)
    tensor_parallel: int = 1  # GPUs one replica spans (vllm, sglang, trtllm)
    dtype: str | None = None
    gpu_memory_utilization: float | None = None  # vllm / sglang fraction of GPU memory
    kv_connector: KvConnector = "none"  # engine-side KV offload / transfer (vllm, sglang)
    backend: str | None = None  # cgn_infer: torch|mlx|sim; trtllm: pytorch|tensorrt
    launcher: str = "auto"  # llama_cpp: auto|llama_server|xllamacpp|llama_cpp_python
    url: str | None = None  # openai_compat: the external engine's base URL
    quantization: str | None = None  # vllm / sglang --quantization (fp8, awq, ...)
    launch_mode: str | None = None  # vllm across nodes: ray (default) | mp
    # a multi-node rank: how long rank 0's rendezvous point may take to accept a connection
    rendezvous_timeout_s: float | None = None
    extra_args: tuple[str, ...] = ()  # appended verbatim to the engine's argv
    env: Mapping[str, str] = field(default_factory=dict)
    # llama_cpp: the model's GGUF LoRA adapters, by adapter name order (a request's `lora`
    # id is its index), loaded at start and applied only where a request asks
    lora: tuple[LoraFile, ...] = ()
    # cgn_infer: adapters held at once (its max_loras, the catalog's max_adapters): with the
    # agent's model_dirs as its lora_dirs, the router loads the others at run time
    max_loras: int | None = None
    max_lora_rank: int | None = None  # vllm, sglang: the largest adapter rank (the catalog's)


@dataclass(frozen=True, slots=True)
class LoraFile:
    """One LoRA adapter a replica loads: the catalog's name for it and its GGUF file."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class PipelinePart:
    """This node's part of a multi-node replica (a cgn-infer layer pipeline, or a rank of a
    vLLM or SGLang replica)."""

    part: int  # 0: the head; 1..parts-1: the stages in layer order, or the ranks
    parts: int
    head: str  # the head's node id: stages serve only it (its certificate CN)
    stages: tuple[str, ...] = ()  # a pipeline's head only: each stage's host:port, once Ready
    rendezvous: str = ""  # a rank > 0 only: rank 0's rendezvous host:port, once it has one

    def status(self) -> dict[str, Any]:
        """Where this part stands in its replica, for the replica's status record."""
        return {"part": self.part, "parts": self.parts, "head": self.head}


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    replica: ReplicaId
    model: str  # the name clients use; the engine is told to serve under it
    engine: str  # one of ENGINES
    source: str = ""  # GGUF path, HF id or local directory, as the engine takes it
    port: int = 0  # 0: the agent picks a free port
    devices: tuple[int, ...] = ()  # accelerator indices (CUDA ordinals) this replica owns
    role: Role = "both"
    profile: EngineProfile = EngineProfile()
    owner: str = ""  # "reconciler" for the placements it manages; empty: written by hand
    pipeline: PipelinePart | None = None  # one part of a replica that spans several nodes


def parse_placement(replica: str, data: Any) -> ReplicaSpec:
    """A placement's JSON value as a spec; ValueError says which field is wrong and why."""
    where = f"placement {replica}"
    if not _ID.match(replica):
        raise ValueError(f"{where}: replica id must be 1-128 of [A-Za-z0-9._-]")
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a JSON object")
    known = {f.name for f in dataclasses.fields(ReplicaSpec)} - {"replica"}
    _no_unknown(data, known, where)
    model = _str(data, "model", where, required=True) or ""
    engine = _str(data, "engine", where, required=True) or ""
    if engine not in ENGINES:
        raise ValueError(f"{where}: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    port = data.get("port", 0)
    if not _is_int(port) or not 0 <= port <= 65535:
        raise ValueError(f"{where}: 'port' must be an integer 0-65535")
    devices = data.get("devices", [])
    if not isinstance(devices, list) or not all(_is_int(d) and d >= 0 for d in devices):
        raise ValueError(f"{where}: 'devices' must be a list of device indices")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{where}: 'devices' lists a device twice")
    role = data.get("role", "both")
    if role not in get_args(Role):
        raise ValueError(f"{where}: 'role' must be both, prefill or decode")
    return ReplicaSpec(
        ReplicaId(replica),
        model,
        engine,
        _str(data, "source", where) or "",
        port,
        tuple(devices),
        role,
        _profile(data.get("profile", {}), f"{where}: profile"),
        _owner(data, where),
        _pipeline(data.get("pipeline"), f"{where}: pipeline", engine),
    )


MAX_PARTS = 64
_ADDRESS = re.compile(r"^[A-Za-z0-9._:\[\]-]{1,253}:\d{1,5}$")


def _pipeline(raw: Any, where: str, engine: str) -> PipelinePart | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a JSON object")
    _no_unknown(raw, {f.name for f in dataclasses.fields(PipelinePart)}, where)
    if engine != "cgn_infer" and engine not in RANK_ENGINES:
        engines = ", ".join(["cgn_infer", *sorted(RANK_ENGINES)])
        raise ValueError(f"{where}: only {engines} run across nodes, not {engine}")
    part: Any = raw.get("part")
    parts: Any = raw.get("parts")
    if not (_is_int(parts) and 2 <= parts <= MAX_PARTS):
        raise ValueError(f"{where}: 'parts' must be an integer 2-{MAX_PARTS}")
    if not (_is_int(part) and 0 <= part < parts):
        raise ValueError(f"{where}: 'part' must be an integer 0-{parts - 1}")
    head = _str(raw, "head", where, required=True) or ""
    if not _ID.match(head):
        raise ValueError(f"{where}: 'head' must be a node id")
    stages = raw.get("stages", [])
    if not isinstance(stages, list) or not all(
        isinstance(a, str) and _ADDRESS.match(a) for a in stages
    ):
        raise ValueError(f"{where}: 'stages' must be a list of host:port addresses")
    if stages and (part != 0 or len(stages) != parts - 1):
        raise ValueError(
            f"{where}: 'stages' belongs to the head (part 0) and lists all {parts - 1} stages"
        )
    rendezvous = raw.get("rendezvous", "")
    if rendezvous and (not isinstance(rendezvous, str) or not _ADDRESS.match(rendezvous)):
        raise ValueError(f"{where}: 'rendezvous' must be a host:port address")
    if engine == "cgn_infer" and rendezvous:
        raise ValueError(f"{where}: 'rendezvous' belongs to a vLLM or SGLang rank, not cgn_infer")
    if engine != "cgn_infer" and stages:
        raise ValueError(f"{where}: 'stages' belongs to a cgn_infer pipeline, not {engine}")
    if rendezvous and part == 0:
        raise ValueError(f"{where}: 'rendezvous' belongs to ranks 1..{parts - 1} (rank 0 opens it)")
    return PipelinePart(part, parts, head, tuple(stages), rendezvous)


def _owner(data: Mapping[str, Any], where: str) -> str:
    owner = data.get("owner", "")
    if not isinstance(owner, str):
        raise ValueError(f"{where}: 'owner' must be a string")
    return owner


def _profile(raw: Any, where: str) -> EngineProfile:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a JSON object")
    _no_unknown(raw, {f.name for f in dataclasses.fields(EngineProfile)}, where)
    out: dict[str, Any] = {}
    for name in ("ctx", "threads", "tensor_parallel", "max_loras", "max_lora_rank"):
        if raw.get(name) is not None:  # null: the engine's default
            if not _is_int(raw[name]) or raw[name] < 1:
                raise ValueError(f"{where}: '{name}' must be a positive integer")
            out[name] = raw[name]
    for name in ("dtype", "backend", "launcher", "url", "quantization", "launch_mode"):
        if raw.get(name) is not None:
            out[name] = _str(raw, name, where)
    if out.get("launch_mode", LAUNCH_MODES[0]) not in LAUNCH_MODES:
        raise ValueError(f"{where}: 'launch_mode' must be one of {', '.join(LAUNCH_MODES)}")
    if raw.get("rendezvous_timeout_s") is not None:
        t = raw["rendezvous_timeout_s"]
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t <= 86400:
            raise ValueError(f"{where}: 'rendezvous_timeout_s' must be in (0, 86400] seconds")
        out["rendezvous_timeout_s"] = float(t)
    if raw.get("gpu_memory_utilization") is not None:
        g = raw["gpu_memory_utilization"]
        if not isinstance(g, int | float) or isinstance(g, bool) or not 0 < g <= 1:
            raise ValueError(f"{where}: 'gpu_memory_utilization' must be in (0, 1]")
        out["gpu_memory_utilization"] = float(g)
    if "kv_connector" in raw:
        if raw["kv_connector"] not in get_args(KvConnector):
            options = ", ".join(get_args(KvConnector))
            raise ValueError(f"{where}: 'kv_connector' must be one of {options}")
        out["kv_connector"] = raw["kv_connector"]
    extra = raw.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ValueError(f"{where}: 'extra_args' must be a list of strings")
    out["extra_args"] = tuple(extra)
    env = raw.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError(f"{where}: 'env' must map names to strings")
    out["env"] = dict(env)
    out["lora"] = _lora(raw.get("lora", []), where)
    if out.get("max_loras", 0) > MAX_LORA_SLOTS:
        raise ValueError(f"{where}: 'max_loras' must be at most {MAX_LORA_SLOTS}")
    return EngineProfile(**out)


def _lora(raw: Any, where: str) -> tuple[LoraFile, ...]:
    """`profile.lora`: [{name, path}], distinct names, absolute .gguf paths."""
    bad = ValueError(f"{where}: 'lora' must list at most {MAX_LORA} {{name, path}} with "
                     "distinct names and absolute paths")  # fmt: skip
    if not isinstance(raw, list) or len(raw) > MAX_LORA:
        raise bad
    files = []
    for item in raw:
        if not isinstance(item, Mapping) or set(item) != {"name", "path"}:
            raise bad
        name, path = item["name"], item["path"]
        if not isinstance(name, str) or not NAME.match(name):
            raise bad
        if not isinstance(path, str) or not path.startswith("/") or "," in path:
            raise bad
        files.append(LoraFile(name, path))
    if len({f.name for f in files}) != len(files):
        raise bad
    return tuple(files)


def spec_to_json(spec: ReplicaSpec) -> dict[str, Any]:
    """The placement JSON that `parse_placement` turns back into `spec`."""
    doc = dataclasses.asdict(spec)
    del doc["replica"]
    doc["devices"] = list(spec.devices)
    doc["profile"]["extra_args"] = list(spec.profile.extra_args)
    doc["profile"]["env"] = dict(spec.profile.env)
    doc["profile"]["lora"] = [{"name": f.name, "path": f.path} for f in spec.profile.lora]
    if spec.pipeline is None:
        del doc["pipeline"]
    out: dict[str, Any] = json.loads(json.dumps(doc))  # plain JSON types only
    return out


def _str(data: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: '{key}' must be a non-empty string")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
