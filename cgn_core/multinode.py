"""Multi-node GPU replicas of vLLM and SGLang: the rules both sides of the cluster apply.

A vLLM or SGLang replica that spans N nodes is N *ranks* of one distributed process
group. Rank 0 (the leader) opens the rendezvous point (a Ray head, vLLM's master port,
SGLang's `--dist-init-addr`) and alone serves HTTP; ranks 1.. join it. The agent that
launches a rank (`cgn_agent.drivers.gpu_engines`) and `cgn-ctl explain-placement` that
shows the launch use the functions here, so what is shown is what runs:

* `fabric_adapters`: the RDMA ports NCCL may use: every ACTIVE InfiniBand port of the
  node, or, where it has none, every ACTIVE RoCE port (link layer Ethernet); a port that is
  down, or of the other kind, is never listed (a storage RoCE port beside an InfiniBand
  fabric carries no collective traffic).
* `nccl_env`: `NCCL_IB_HCA` naming exactly those ports (or `NCCL_IB_DISABLE=1` where
  there are none, so NCCL uses the socket transport rather than an adapter nobody chose),
  and the bootstrap pinned to the management interface (the one holding the node's
  advertised address): `NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`.
* `fp8_field`: which profile field makes a profile FP8 (such profiles need compute
  capability 8.9 or newer: Ada, Hopper, Blackwell).
* `pipeline_parallel`: the pipeline stages of devices × nodes GPUs at a tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cgn_core.net import is_host_port

RANK_ENGINES = frozenset({"vllm", "sglang"})  # multi-node replicas as ranks of one group
LAUNCH_MODES = ("ray", "mp")  # vLLM: a Ray cluster, or its multiprocessing multi-node flags
DEFAULT_LAUNCH_MODE = "ray"  # every vLLM release that runs across nodes supports it
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True, slots=True)
class Link:
    """One RDMA port as the inventory reports it."""

    device: str
    port: int
    state: str  # ACTIVE, DOWN, ...
    link_layer: str  # InfiniBand | Ethernet (RoCE)


def fabric_adapters(links: Iterable[Link]) -> tuple[str, ...]:
    """`device:port` of the ports NCCL may use, in name order (see the module header)."""
    active = sorted((link for link in links if link.state == "ACTIVE"), key=_order)
    ib = [link for link in active if link.link_layer == "InfiniBand"]
    return tuple(f"{link.device}:{link.port}" for link in (ib or active))


def _order(link: Link) -> tuple[str, int]:
    return link.device, link.port


def nccl_env(adapters: Sequence[str], iface: str) -> dict[str, str]:
    """The collective libraries' network settings for one rank (see the module header)."""
    env = {"NCCL_IB_HCA": "=" + ",".join(adapters)} if adapters else {"NCCL_IB_DISABLE": "1"}
    if iface:  # NOTE: "=" makes NCCL match the name exactly, not as a prefix (eth1 vs eth10)
        env |= {"NCCL_SOCKET_IFNAME": "=" + iface, "GLOO_SOCKET_IFNAME": iface}
    return env


def rank_env(
    engine: str, devices: Sequence[int], nccl: Mapping[str, str], address: str
) -> dict[str, str]:
    """What places one rank: its devices, its node's `nccl_env`, and under vLLM the address
    its workers announce (`VLLM_HOST_IP`: the node's advertised one)."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)), **nccl}
    if engine == "vllm":
        env["VLLM_HOST_IP"] = address
    return env


def fp8_field(quantization: str | None, dtype: str | None, extra_args: Sequence[str]) -> str:
    """The profile field that makes it an FP8 profile, or "" when it is not one."""
    if quantization and quantization.lower().startswith("fp8"):
        return "quantization"
    if dtype and dtype.lower().startswith(("fp8", "float8")):
        return "dtype"
    flags = ("--quantization", "--kv-cache-dtype")
    for i, arg in enumerate(extra_args):
        flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        if flag in flags and value.lower().startswith("fp8"):
            return "extra_args"
    return ""


def capability(text: str) -> tuple[int, int] | None:
    """nvidia-smi's `compute_cap` ("8.9") as (8, 9); None when it is not one."""
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)


def fp8_refusal(field: str, caps: Mapping[int, str]) -> str:
    """Why devices with these compute capabilities (index: "8.0") cannot run an FP8 profile
    (its `field` made it one); "" when they can or a capability is unknown."""
    low = {i: c for i, c in caps.items() if (cap := capability(c)) and cap < FP8_MIN_CAPABILITY}
    if not field or not low:
        return ""
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    shown = ", ".join(f"{i}: {c}" for i, c in sorted(low.items()))
    return f"{field} asks for FP8, which needs compute capability {need} or newer ({shown})"


def pipeline_parallel(devices: int, nodes: int, tensor_parallel: int) -> int:
    """Pipeline stages of `devices` × `nodes` GPUs split into tensor-parallel groups."""
    return max(1, devices * nodes // max(1, tensor_parallel))


# ---- parts of a multi-node replica (records read them: replica status, placement) -----


@dataclass(frozen=True, slots=True)
class Part:
    """Where a replica's process stands in its replica: part `part` of `parts` (a layer
    pipeline, part 0 the head on node `head`); (0, 1) for a replica on one node. A head's
    placement names its stages' addresses once they are Ready; a stage's status its own."""

    part: int = 0
    parts: int = 1
    head: str = ""
    stages: tuple[str, ...] = ()  # a pipeline head's placement: each stage's host:port
    # a stage's status: where it listens; a vLLM or SGLang rank 0's: its rendezvous point
    address: str = ""
    rendezvous: str = ""  # the placement of a vLLM or SGLang rank > 0: rank 0's address

    @property
    def multi(self) -> bool:
        return self.parts > 1

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"part": self.part, "parts": self.parts, "head": self.head}
        if self.stages:
            doc["stages"] = list(self.stages)
        if self.address:
            doc["address"] = self.address
        if self.rendezvous:
            doc["rendezvous"] = self.rendezvous
        return doc


SINGLE = Part()


def part_of(doc: Mapping[str, Any]) -> Part:
    """A record's `pipeline` field; a malformed one reads as a single-node replica (the
    parts it names cannot be trusted to add up)."""
    p = doc.get("pipeline")
    if not isinstance(p, Mapping):
        return SINGLE
    part, parts = p.get("part"), p.get("parts")
    if not (isinstance(part, int) and isinstance(parts, int) and 0 <= part < parts <= 64):
        return SINGLE
    if parts == 1:
        return SINGLE
    stages = p.get("stages")
    address, rendezvous = p.get("address"), p.get("rendezvous")
    return Part(
        part,
        parts,
        str(p.get("head", ""))[:256],
        tuple(s for s in stages if is_host_port(s))[:64] if isinstance(stages, list) else (),
        str(address) if is_host_port(address) else "",
        str(rendezvous) if is_host_port(rendezvous) else "",
    )
