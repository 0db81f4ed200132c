"""What people and status fields read of a snapshot: node states, a model's replicas (pure).

`cgn-ctl` (nodes, models, status) and cgn-operator (a CognitoraModel's status) count
the same way: a multi-node replica counts once, as its head (the part routers see).
"""

from __future__ import annotations

from dataclasses import dataclass

from cgn_control.decide.adapters import AdapterSpec, adapters_profile
from cgn_control.decide.cluster import Snapshot
from cgn_control.decide.placement import NodeState


def node_states(snap: Snapshot) -> dict[str, NodeState]:
    """Without the reconciler's memory of when a node vanished: registered, or unreachable."""
    names = set(snap.nodes) | {n for n, _ in snap.placements}
    return {n: "ready" if n in snap.nodes else "unreachable" for n in names}


@dataclass(frozen=True, slots=True)
class ModelReplicas:
    placed: int  # replicas placed (heads of multi-node ones)
    ready: int  # of those, Ready
    failed: int  # of those, Failed
    reasons: tuple[str, ...]  # the failed ones' reasons, as the agents reported them


def model_replicas(snap: Snapshot, name: str) -> ModelReplicas:
    mine = [k for k, p in snap.placements.items() if p.model == name and p.part.part == 0]
    statuses = [st for k in mine if (st := snap.statuses.get(k)) is not None]
    failed = [st for st in statuses if st.phase == "Failed"]
    return ModelReplicas(
        placed=len(mine),
        ready=sum(st.ready for st in statuses),
        failed=len(failed),
        reasons=tuple(st.reason for st in failed if st.reason),
    )


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """Where one LoRA adapter of a model is loaded now, and the rule that put it there."""

    adapter: str
    source: str
    pin: bool
    held_by: tuple[str, ...]  # <node>/<replica> of each replica whose status lists it
    why: str


def adapter_residency(snap: Snapshot, name: str) -> list[AdapterResidency]:
    """Model `name`'s adapters (the catalog's), each with the replicas that hold it (their
    agents' status records) and why, per engine the model runs on (its placements', or
    its profiles' before any is placed)."""
    spec = snap.models.get(name)
    if spec is None:
        return []
    mine = {k: p for k, p in snap.placements.items() if p.model == name and p.part.part == 0}
    engines = sorted({p.engine for p in mine.values()} or {p.engine for p in spec.profiles})
    # what each engine's replicas load at start: the placements' own rule
    at_start = {e: {f["name"] for f in adapters_profile(spec, e).get("lora", [])} for e in engines}
    out = []
    for adapter, a in sorted(spec.adapters.items()):
        held = tuple(
            f"{node}/{replica}"
            for (node, replica) in sorted(mine)
            if (st := snap.statuses.get((node, replica))) is not None and adapter in st.adapters
        )
        why = "; ".join(_why(e, adapter in at_start[e], a, spec.max_adapters) for e in engines)
        out.append(AdapterResidency(adapter, a.source, a.pin, held, why))
    return out


def _why(engine: str, at_start: bool, a: AdapterSpec, max_adapters: int) -> str:
    """How replicas of `engine` come to hold adapter `a`: at start (adapters_profile), or
    for cgn-infer on demand (the router's cgn_router/adapters.py loads it)."""
    if at_start:
        pinned = "pinned, " if engine == "cgn_infer" else ""
        return f"{engine}: {pinned}loaded at start" + (" and never evicted" if pinned else "")
    if engine == "cgn_infer":
        return (
            "cgn_infer: loaded on demand where the router sends its requests; the least "
            f"recently used idle adapter is evicted past max_adapters {max_adapters}"
        )
    if engine in ("llama_cpp", "vllm", "sglang"):  # they load the other format only
        kind = "GGUF, not PEFT" if a.source.endswith(".gguf") else "PEFT, not GGUF"
        return f"{engine}: not loaded ({kind})"
    return f"{engine}: serves no adapters"
