"""Placement: where the next replica of a model goes, and why every other candidate was not chosen.

Pure code over plain values (the router's reconciler and `cgn-ctl
explain-placement` both call it). For each profile of the model, in priority
order, every node is a candidate; it is rejected, with the reason, when it is
unreachable or lost, cordoned, lacks the profile's engine, or has too few
free healthy devices of the profile's class, and everywhere for a multi-node
profile of an engine agents do not launch across nodes (TensorRT-LLM, llama.cpp, MLX),
and where the profile is FP8 and the node's devices are older than compute capability
8.9: explain and reconcile are one decision. The first profile with an
accepted node wins, with one exception: a CPU profile whose every accepted node
already runs a replica of the model gives way to a later profile with a node
that runs none (replicas spread over nodes before doubling up on one, so the
loss of a node costs one replica; a fleet of nodes each offering another
engine serves a model on each of them). Among the winning profile's accepted nodes:

* GPU profiles bin-pack: the node left with the fewest free devices of the
  class after the allocation goes first (partly used nodes before whole ones,
  so whole nodes stay free for large models);
* CPU profiles spread: the node with the fewest replicas of this model, then
  the fewest replicas overall;
* multi-node replicas (`nodes > 1`) take the emptiest nodes of one fabric
  (the `fabric` label; never two fabrics, never an unlabelled node);
* ties go to the node making more output tokens per joule where cgn-metrics
  measured it (`/cognitora/efficiency/<node>`), then to the one drawing less power
  where its power is known, then by name; the explanation shows each fitting
  node's figure.
Devices are the lowest free indices of the class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cgn_control.decide.catalog import ModelSpec, Profile
from cgn_core import multinode
from cgn_core.records import NodeInventory

EMPTY = NodeInventory()

NodeState = Literal["ready", "unreachable", "lost"]
TIE_BREAK = "more output tokens per joule, then fewer watts, then the name"


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    accel_class: str
    healthy: bool = True
    reason: str = ""
    compute_capability: str = ""  # "9.0"; "" when unknown


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    devices: tuple[Device, ...] = ()
    engines: frozenset[str] = frozenset()
    fabric: str = ""
    cordoned: bool = False
    state: NodeState = "ready"
    watts: float | None = None
    tokens_per_joule: float | None = None  # measured by cgn-metrics; None: not measured
    used: frozenset[int] = frozenset()  # device indices held by existing placements
    replicas: Mapping[str, int] = field(default_factory=dict)  # model -> replicas here

    def free(self, accel_class: str) -> list[int]:
        return sorted(
            d.index
            for d in self.devices
            if d.accel_class == accel_class and d.healthy and d.index not in self.used
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    profile: int
    ok: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    profile: int | None  # the profile used; None: nothing fits
    nodes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (node, devices) per node of the replica
    candidates: tuple[Candidate, ...] = ()

    @property
    def ok(self) -> bool:
        return self.profile is not None

    def explain(self) -> list[str]:
        lines = []
        for c in self.candidates:
            mark = "✓" if c.ok else "✗"
            lines.append(f"{mark} profile {c.profile} on {c.node}: {c.reason}")
        return lines


def node_view(
    name: str,
    inventory: NodeInventory,
    *,
    cordoned: bool = False,
    state: NodeState = "ready",
    used: frozenset[int] = frozenset(),
    replicas: Mapping[str, int] | None = None,
    tokens_per_joule: float | None = None,
) -> NodeView:
    """A node as placement sees it, from its `/cognitora/nodes/<node>` record."""
    devices = tuple(
        Device(a.index, a.accel_class, not a.health, "; ".join(a.health), a.compute_capability)
        for a in inventory.accelerators
    )
    return NodeView(
        name=name,
        devices=devices,
        engines=frozenset(inventory.engines),
        fabric=inventory.labels.get("fabric", ""),
        cordoned=cordoned,
        state=state,
        watts=inventory.watts,
        tokens_per_joule=tokens_per_joule,
        used=used,
        replicas=dict(replicas or {}),
    )


def place(
    model: ModelSpec, nodes: Sequence[NodeView], refused: Mapping[tuple[str, str], str] = {}
) -> Decision:
    """The nodes and devices for one more replica of `model`, with every candidate's verdict;
    `refused`: (node, engine) → why its agent refused this model's placement lately (such a
    pair is not a candidate: placing it again would only be refused again)."""
    spread = _place(model, nodes, refused, spread=True)
    return spread if spread.profile is not None else _place(model, nodes, refused, spread=False)


def _place(
    model: ModelSpec,
    nodes: Sequence[NodeView],
    refused: Mapping[tuple[str, str], str],
    spread: bool,
) -> Decision:
    candidates: list[Candidate] = []
    for i, profile in enumerate(model.profiles):
        fits: list[NodeView] = []
        for node in sorted(nodes, key=lambda n: n.name):
            why = _reject(node, profile, i) or refused.get((node.name, profile.engine), "")
            if not why and spread and profile.on_cpu and node.replicas.get(model.name, 0):
                why = f"runs a replica of {model.name} already (a node that runs none goes first)"
            if why:
                candidates.append(Candidate(node.name, i, False, why))
            else:
                fits.append(node)
        chosen = _choose(model.name, profile, fits, i, candidates)
        if chosen:
            picked = {name for name, _ in chosen}
            for node in fits:
                if node.name in picked:
                    devs = dict(chosen)[node.name]
                    what = f"devices {list(devs)}" if devs else "cpu"
                    candidates.append(
                        Candidate(node.name, i, True, f"chosen ({what}){_figure(node)}")
                    )
            return Decision(model.name, i, tuple(chosen), tuple(candidates))
    return Decision(model.name, None, (), tuple(candidates))


# Engines whose replicas agents launch across nodes (a cgn-infer layer pipeline, vLLM and
# SGLang ranks); another engine's multi-node profile is described and explained, never
# placed (docs/control-plane.md)
MULTI_NODE_ENGINES = frozenset({"cgn_infer"}) | multinode.RANK_ENGINES


def _reject(node: NodeView, p: Profile, i: int) -> str:
    if p.nodes > 1 and p.engine not in MULTI_NODE_ENGINES:
        engines = ", ".join(sorted(MULTI_NODE_ENGINES))
        return f"{p.engine} across {p.nodes} nodes is not launched by agents ({engines} are)"
    if node.state != "ready":
        return f"node is {node.state}"
    if node.cordoned:
        return "node is cordoned"
    if p.engine not in node.engines and p.engine != "openai_compat":
        return f"{p.engine} is not installed on this node"
    if p.on_cpu:
        return ""
    of_class = [d for d in node.devices if d.accel_class == p.accelerator]
    if not of_class:
        classes = sorted({d.accel_class for d in node.devices}) or ["cpu"]
        return f"no {p.accelerator} devices (node has {', '.join(classes)})"
    fp8 = multinode.fp8_field(p.quantization, p.dtype, p.extra_args)
    if why := multinode.fp8_refusal(fp8, {d.index: d.compute_capability for d in of_class}):
        return f"profiles[{i}].{why}"
    free = node.free(p.accelerator)
    if len(free) < p.devices:
        sick = [d for d in of_class if not d.healthy]
        held = [d for d in of_class if d.healthy and d.index in node.used]
        detail = f"{len(free)} free of {len(of_class)} {p.accelerator}"
        if held:
            detail += f", {len(held)} allocated"
        if sick:
            detail += f", {len(sick)} unhealthy ({sick[0].reason or 'unhealthy'})"
        return f"needs {p.devices} free {p.accelerator} device(s): {detail}"
    return ""


def _watts(n: NodeView) -> float:
    return n.watts if n.watts is not None else float("inf")


def _waste(n: NodeView) -> float:
    """Joules per token as a sort key: measured nodes first, the most efficient first."""
    return 1.0 / n.tokens_per_joule if n.tokens_per_joule else float("inf")


def _figure(n: NodeView) -> str:
    return f"; {n.tokens_per_joule:.3g} output tokens/J" if n.tokens_per_joule else ""


def _choose(
    model: str, p: Profile, fits: list[NodeView], i: int, candidates: list[Candidate]
) -> list[tuple[str, tuple[int, ...]]]:
    if not fits:
        return []
    if p.nodes > 1:
        return _choose_multi(p, fits, i, candidates)
    if p.on_cpu:

        def load(n: NodeView) -> tuple[int, int]:
            return n.replicas.get(model, 0), sum(n.replicas.values())

        ranked = sorted(fits, key=lambda n: (*load(n), _waste(n), _watts(n), n.name))
        best = ranked[0]
        for n in ranked[1:]:
            why = f"fits; {best.name} runs fewer replicas of {model}"
            if load(n) == load(best):
                why = f"fits; as loaded as {best.name}, which wins the tie-break ({TIE_BREAK})"
            candidates.append(Candidate(n.name, i, False, why + _figure(n)))
        return [(best.name, ())]

    def fit(n: NodeView) -> tuple[int, int]:
        return len(n.free(p.accelerator)) - p.devices, 0 if n.used else 1

    ranked = sorted(fits, key=lambda n: (*fit(n), _waste(n), _watts(n), n.name))
    best = ranked[0]
    for n in ranked[1:]:
        why = f"fits; {best.name} packs tighter"
        if fit(n) == fit(best):
            why = f"fits; packs as tight as {best.name}, which wins the tie-break ({TIE_BREAK})"
        candidates.append(Candidate(n.name, i, False, why + _figure(n)))
    return [(best.name, tuple(best.free(p.accelerator)[: p.devices]))]


def _choose_multi(
    p: Profile, fits: list[NodeView], i: int, candidates: list[Candidate]
) -> list[tuple[str, tuple[int, ...]]]:
    by_fabric: dict[str, list[NodeView]] = {}
    for n in fits:
        if not n.fabric:
            candidates.append(
                Candidate(n.name, i, False, "no fabric label (multi-node replicas need one)")
            )
        else:
            by_fabric.setdefault(n.fabric, []).append(n)
    best: list[NodeView] = []
    too_small: set[str] = set()
    for fabric, group in sorted(by_fabric.items()):
        if len(group) < p.nodes:
            why = f"fabric {fabric} has {len(group)} fitting node(s), needs {p.nodes}"
            candidates.extend(Candidate(n.name, i, False, why) for n in group)
            too_small.update(n.name for n in group)
            continue
        emptiest = sorted(
            group, key=lambda n: (-len(n.free(p.accelerator)), _waste(n), _watts(n), n.name)
        )
        pick = emptiest[: p.nodes]
        if not best or sum(len(n.free(p.accelerator)) for n in pick) > sum(
            len(n.free(p.accelerator)) for n in best
        ):
            best = pick
    chosen = {n.name for n in best}
    for n in fits:
        if n.fabric and n.name not in chosen and n.name not in too_small and best:
            candidates.append(Candidate(n.name, i, False, "fits; emptier nodes chosen"))
    return [(n.name, tuple(n.free(p.accelerator)[: p.devices])) for n in best]


def rank_plan(
    model: ModelSpec, d: Decision, nodes: Mapping[str, NodeInventory]
) -> list[dict[str, Any]]:
    """How a decided vLLM or SGLang replica across nodes would launch, rank by rank: what
    each rank runs and the environment its agent gives it (cgn_core/multinode.py, the rules
    the agents apply); [] for any other decision. Rank 0's rendezvous port is picked by its
    agent at launch, so it is shown as such."""
    if d.profile is None or len(d.nodes) < 2:
        return []
    p = model.profiles[d.profile]
    if p.engine not in multinode.RANK_ENGINES:
        return []
    mode = p.launch_mode or multinode.DEFAULT_LAUNCH_MODE
    head = nodes.get(d.nodes[0][0], EMPTY).network.address or d.nodes[0][0]
    out = []
    for rank, (name, devices) in enumerate(d.nodes):
        net = nodes.get(name, EMPTY).network
        nccl = multinode.nccl_env(net.fabric_adapters, net.iface)
        env = multinode.rank_env(p.engine, devices, nccl, net.address or "?")
        if p.engine == "sglang":
            runs = "sglang.launch_server (serves HTTP)" if rank == 0 else "sglang.launch_server"
        elif mode == "ray":
            runs = "ray head, then vllm serve (serves HTTP)" if rank == 0 else "ray worker"
        else:
            runs = "vllm serve (serves HTTP)" if rank == 0 else "vllm serve --headless"
        out.append(
            {
                "rank": rank,
                "node": name,
                "runs": runs,
                "rendezvous": f"{head}:<port picked by rank 0's agent>",
                "env": env,
            }
        )
    return out
