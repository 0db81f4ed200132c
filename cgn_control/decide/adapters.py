"""A model's LoRA adapters in the catalog (#60): named, checked, and checked against the base.

    name: smollm2
    source: /models/SmolLM2-135M.Q4_1.gguf
    adapters:                                   # a request names one in `model`
      sql: {source: /models/sql.gguf, rank: 8}  # a GGUF LoRA file (llama.cpp's format)
      support-fr: {source: /models/fr.gguf, pin: true}   # pinned: loaded on every replica
    max_adapters: 4                             # loaded at once per replica (default 4)

An adapter's name is a name clients use, so it may be no model's name or alias
(`check_names`). Its source is an absolute path to a GGUF LoRA file (llama.cpp's
format) or a PEFT directory (`adapter_config.json` and `adapter_model.safetensors`,
read by `cgn_core/lora_peft.py`): llama.cpp replicas load the GGUF ones only, vLLM and
SGLang the PEFT ones, cgn-infer both. `rank`, where
given, is checked against the file's. The pinned adapters must fit in `max_adapters`.
`check_files` reads the adapter and base files where they are on this machine
(`cgn-ctl models apply`) and refuses an adapter of another base, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgn_control.decide.names import NAME, CatalogError
from cgn_core.keys import MAX_ADAPTERS as MAX_PER_REPLICA
from cgn_core.keys import MAX_LORA_RANK as MAX_RANK

if TYPE_CHECKING:
    from cgn_control.decide.catalog import ModelSpec
    from cgn_core.records import Placement

MAX_ADAPTERS = MAX_PER_REPLICA  # named per model (a llama.cpp replica loads them all)
MAX_LOADED = 64  # max_adapters, at most
DEFAULT_LOADED = 4


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    source: str
    rank: int | None = None
    pin: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            **({} if self.rank is None else {"rank": self.rank}),
            **({"pin": True} if self.pin else {}),
        }


def parse_adapters(doc: Mapping[str, Any], at: str) -> tuple[dict[str, AdapterSpec], int]:
    """The model document's `adapters` and `max_adapters` ({} and the default without);
    CatalogError names the field. `at`: the model's path prefix ("" or "model 2.")."""
    raw = doc.get("adapters", {}) or {}
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{at}adapters: expected a mapping of name to {{source, rank?, pin?}}")
    if len(raw) > MAX_ADAPTERS:
        raise CatalogError(f"{at}adapters: at most {MAX_ADAPTERS}, got {len(raw)}")
    adapters = {}
    for name, entry in raw.items():
        where = f"{at}adapters.{str(name)[:40]}"
        if not isinstance(name, str) or not NAME.match(name):
            raise CatalogError(f"{where}: a name is 1-128 of [A-Za-z0-9._:-]")
        if name == doc.get("name") or name in (doc.get("aliases") or []):
            raise CatalogError(f"{where}: the model's own name or alias")
        adapters[name] = _entry(entry, where)
    loaded = doc.get("max_adapters", DEFAULT_LOADED)
    if isinstance(loaded, bool) or not isinstance(loaded, int) or not 1 <= loaded <= MAX_LOADED:
        raise CatalogError(f"{at}max_adapters: expected an integer in [1, {MAX_LOADED}]")
    pinned = sorted(n for n, a in adapters.items() if a.pin)
    if len(pinned) > loaded:
        raise CatalogError(f"{at}adapters: {len(pinned)} pinned ({', '.join(pinned)}), "
                           f"more than max_adapters {loaded}")  # fmt: skip
    return adapters, loaded


def _entry(entry: Any, where: str) -> AdapterSpec:
    if not isinstance(entry, Mapping):
        raise CatalogError(f"{where}: expected {{source, rank?, pin?}}")
    unknown = sorted(set(entry) - {"source", "rank", "pin"})
    if unknown:
        raise CatalogError(f"{where}.{unknown[0]}: unknown field")
    source = entry.get("source")
    if not isinstance(source, str) or not source:
        raise CatalogError(f"{where}.source: required, a GGUF LoRA file or a PEFT directory")
    if not source.startswith("/") or len(source) > 4096 or "," in source:
        raise CatalogError(
            f"{where}.source: an absolute path to a GGUF LoRA file or a PEFT directory "
            f"(adapter_config.json and adapter_model.safetensors), got {source[:80]!r}"
        )
    rank = entry.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 1 <= rank <= MAX_RANK):  # fmt: skip
        raise CatalogError(f"{where}.rank: expected an integer in [1, {MAX_RANK}]")
    pin = entry.get("pin", False)
    if not isinstance(pin, bool):
        raise CatalogError(f"{where}.pin: expected true or false")
    return AdapterSpec(source, rank, pin)


def check_names(models: Mapping[str, ModelSpec]) -> None:
    """Adapter names across the catalog: none is a model's name or alias, or another
    model's adapter (a request's `model` names exactly one thing)."""
    taken = {n: f"model {n}" for n in models}
    taken |= {a: f"an alias of {n}" for n, m in models.items() for a in m.aliases}
    for name, m in sorted(models.items()):
        for adapter in sorted(m.adapters):
            if adapter in taken:
                raise CatalogError(f"{name}: adapters.{adapter}: already {taken[adapter]}")
            taken[adapter] = f"an adapter of {name}"


def check_files(spec: ModelSpec) -> None:
    """Each adapter whose file and base GGUF are on this machine, read and checked against
    that base (LoraError's reason, naming both); the others are checked where they load."""
    from cgn_core.lora import LoraError, check  # numpy: only where a catalog is applied

    gguf = ("cgn_infer", "llama_cpp")
    named = {p.source or spec.source for p in spec.profiles if p.engine in gguf}
    bases = {b for b in named if b.endswith(".gguf") and Path(b).is_file()}
    for name, adapter in sorted(spec.adapters.items()):
        if not Path(adapter.source).exists():
            continue
        for base in sorted(bases):
            try:
                got = check(Path(adapter.source), Path(base))
            except LoraError as exc:
                raise CatalogError(f"{spec.name}: adapters.{name}: {exc.message}") from None
            if adapter.rank is not None and got.rank != adapter.rank:
                raise CatalogError(f"{spec.name}: adapters.{name}.rank: {adapter.rank}, the "
                                   f"file's is {got.rank}")  # fmt: skip


ADAPTER_KEYS = ("lora", "max_loras", "max_lora_rank")  # what adapters_profile writes


def adapters_profile(
    spec: ModelSpec, engine: str, backend: str | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The placement profile's adapter keys for a replica of `engine` ({} where it loads
    none): the adapters it loads at start, and how many it holds. llama.cpp all of the
    GGUF ones (it loads none at run time); vLLM and SGLang all of the PEFT ones
    (max_adapters in a batch); cgn-infer's torch backend on the GGUF weights the pinned
    ones, holding max_adapters (the router loads the others where they are needed)."""
    if not spec.adapters:
        return {}
    if engine == "cgn_infer" and not (backend in (None, "torch") and dtype in (None, "gguf")):
        return {}
    peft = {n for n, a in spec.adapters.items() if not a.source.endswith(".gguf")}
    if engine == "llama_cpp":
        start = sorted(set(spec.adapters) - peft)
    elif engine in ("vllm", "sglang"):
        start = sorted(peft)
    elif engine == "cgn_infer":
        start = sorted(n for n, a in spec.adapters.items() if a.pin)
    else:
        return {}
    doc: dict[str, Any] = {"lora": [{"name": n, "path": spec.adapters[n].source} for n in start]}
    if engine != "llama_cpp":
        doc["max_loras"] = spec.max_adapters
    ranks = [spec.adapters[n].rank for n in start]
    if engine in ("vllm", "sglang") and ranks and None not in ranks:
        doc["max_lora_rank"] = max(r for r in ranks if r is not None)
    return doc


def stale_adapters(spec: ModelSpec, placement: Placement) -> dict[str, Any] | None:
    """The profile `placement` should have now that the catalog's adapters changed (the
    engine loads them at start, so its agent restarts it with the new set), or None where
    it has the right ones already."""
    prof = placement.profile
    backend, dtype = prof.get("backend"), prof.get("dtype")
    want = adapters_profile(spec, placement.engine, backend, dtype)
    have = {k: prof[k] for k in ADAPTER_KEYS if k in prof}
    if have == want:
        return None
    return {**{k: v for k, v in prof.items() if k not in ADAPTER_KEYS}, **want}


def adapters_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What a profile change does to the adapters loaded at start, as people read it."""

    def names(prof: Mapping[str, Any]) -> set[str]:
        lora = prof.get("lora", [])
        return {str(f.get("name")) for f in lora if isinstance(f, Mapping)}

    was, now = names(old), names(new)
    parts = [f"+{n}" for n in sorted(now - was)] + [f"-{n}" for n in sorted(was - now)]
    return "adapters changed: " + (", ".join(parts) or "the same names, other files or slots")
