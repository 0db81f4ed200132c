"""Model names, aliases and fallbacks, and each model's prompt hasher.

Entries come from settings (`models:`) and from etcd's
`/cognitora/catalog/models/<model>` (JSON: `aliases`, `fallbacks`, and
`tokenizer`, `source.gguf`, or a `source` that is a GGUF path or bundled
model name: the GGUF whose tokenizer the router loads; `adapters`: the names of
its LoRA adapters, which clients use in `model` as they use the model's).
Tokenizers load in a worker thread; until one is ready the model's prompts
are hashed by characters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgn_core import bundled_models
from cgn_core.errors import CognitoraError
from cgn_core.keys import NAME
from cgn_core.lora import MAX_PER_REPLICA
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_router.prompt_cache import PrefixCache
from cgn_router.prompts import PromptHasher, codec_tag
from cgn_router.settings import ModelSettings

log = logging.getLogger(__name__)


MAX_SLO_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    tokenizer: Path | None = None
    scales_to_zero: bool = False  # replicas.min is 0: a request may wait for a cold start
    migration_limit: int | None = None  # continuations per stream; None: the router's setting
    # a stream may continue on a replica of another engine kind (cgn-ctl checked one source)
    across_engines: bool = False
    # the time to first token a request is held at the router for (hold.py); None: none
    ttft_slo_s: float | None = None
    adapters: tuple[str, ...] = ()  # its LoRA adapters' names
    # each adapter's GGUF file, where the catalog names one (an engine may load it at run time)
    adapter_files: Mapping[str, str] = field(default_factory=dict)


def entry_from_settings(name: str, s: ModelSettings) -> ModelEntry:
    return ModelEntry(
        name,
        s.aliases,
        s.fallbacks,
        s.tokenizer,
        across_engines=s.migrate_across_engines,
        ttft_slo_s=s.ttft_slo_ms / 1000 if s.ttft_slo_ms else None,
        adapters=_adapter_names(name, s.adapters),
        adapter_files=_adapter_files(name, s.adapters),
    )


def entry_from_etcd(name: str, data: Any) -> ModelEntry:
    """A catalog value as an entry; ValueError names the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"catalog entry {name}: expected a JSON object")

    def names(key: str) -> tuple[str, ...]:
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"catalog entry {name}: '{key}' must be a list of names")
        return tuple(value)

    tokenizer = data.get("tokenizer") or None
    source = data.get("source")
    if tokenizer is None and isinstance(source, dict):
        tokenizer = source.get("gguf")
    elif tokenizer is None and isinstance(source, str) and _is_gguf(source):
        tokenizer = source  # cgn-ctl's catalog: the model's own GGUF tokenizes for routing
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ValueError(f"catalog entry {name}: 'tokenizer' must be a path")
    replicas = data.get("replicas")
    zero = isinstance(replicas, dict) and replicas.get("min") == 0
    limit = data.get("migration_limit")
    if limit is not None and (type(limit) is not int or not 0 <= limit <= 16):
        raise ValueError(f"catalog entry {name}: 'migration_limit' must be an integer in [0, 16]")
    across = data.get("migrate_across_engines", False)
    if not isinstance(across, bool):
        raise ValueError(f"catalog entry {name}: 'migrate_across_engines' must be true or false")
    return ModelEntry(
        name,
        names("aliases"),
        names("fallbacks"),
        Path(tokenizer) if tokenizer else None,
        scales_to_zero=zero,
        migration_limit=limit,
        across_engines=across,
        ttft_slo_s=_ttft_slo_s(name, data.get("slo")),
        adapters=_adapter_names(name, data.get("adapters", {})),
        adapter_files=_adapter_files(name, data.get("adapters", {})),
    )


def _adapter_files(name: str, adapters: Any) -> dict[str, str]:
    """name → absolute file of the adapters that name one (cgn-ctl's {source: ...}, or a
    settings string); `_adapter_names` has checked the names."""
    out = {}
    for adapter, spec in adapters.items() if isinstance(adapters, dict) else ():
        source = spec.get("source") if isinstance(spec, dict) else spec
        if source in (None, ""):
            continue
        if not isinstance(source, str) or not source.startswith("/") or len(source) > 4096:
            raise ValueError(f"catalog entry {name}: adapter {adapter}'s source must be an "
                             "absolute path")  # fmt: skip
        out[adapter] = source
    return out


def _adapter_names(name: str, adapters: Any) -> tuple[str, ...]:
    """The names of a model's adapters (cgn-ctl's mapping of name to file, or a settings
    list), checked as cgn-ctl checks them; sorted."""
    if not isinstance(adapters, (dict, list)) or len(adapters) > MAX_PER_REPLICA:
        raise ValueError(f"catalog entry {name}: 'adapters' must name at most "
                         f"{MAX_PER_REPLICA} adapters")  # fmt: skip
    for adapter in adapters:
        if not isinstance(adapter, str) or not NAME.match(adapter) or adapter == name:
            raise ValueError(f"catalog entry {name}: adapter {str(adapter)[:40]!r} is not "
                             "a name (1-128 of [A-Za-z0-9._:-]) or is the model's own")  # fmt: skip
    return tuple(sorted(set(adapters)))


def _ttft_slo_s(name: str, slo: Any) -> float | None:
    """The `slo.ttft_p90_ms` cgn-ctl wrote (it checked it; the router checks again)."""
    if slo is None:
        return None
    if not isinstance(slo, dict):
        raise ValueError(f"catalog entry {name}: 'slo' must be an object")
    ms = slo.get("ttft_p90_ms")
    if ms is None:
        return None
    if type(ms) not in (int, float) or not 0 < ms <= MAX_SLO_MS:
        raise ValueError(f"catalog entry {name}: 'slo.ttft_p90_ms' must be in (0, {MAX_SLO_MS}]")
    return float(ms) / 1000


def _is_gguf(source: str) -> bool:
    return source.endswith(".gguf") or source in bundled_models.BUNDLED


class Catalog:
    def __init__(self, chars_per_block: int, prompt_cache_mib: int = 0):
        self.chars_per_block = chars_per_block
        self.prompts = PrefixCache(prompt_cache_mib << 20)  # shared by every model's hasher
        self.entries: dict[str, dict[str, ModelEntry]] = {}  # source → name → entry
        self._hashers: dict[str, PromptHasher] = {}
        self._codecs: dict[Path, PromptCodec | None] = {}  # None: loading or failed
        self._tags: dict[Path, bytes] = {}  # each codec's identity in the prefix cache's keys
        self._loading: set[asyncio.Task[None]] = set()
        self._merged: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}
        self._adapters: dict[str, str] = {}

    def set_source(self, source: str, entries: Mapping[str, ModelEntry]) -> None:
        self.entries[source] = dict(entries)
        self._hashers.clear()
        self._merged = self._merge()
        self._names = self._name_map()
        self._adapters = self._adapter_map()
        for entry in self._all().values():
            if entry.tokenizer is not None and entry.tokenizer not in self._codecs:
                self._codecs[entry.tokenizer] = None
                task = asyncio.get_running_loop().create_task(self._load(entry.tokenizer))
                self._loading.add(task)
                task.add_done_callback(self._loading.discard)

    def put(self, source: str, entry: ModelEntry) -> None:
        self.set_source(source, {**self.entries.get(source, {}), entry.name: entry})

    def delete(self, source: str, name: str) -> None:
        rest = dict(self.entries.get(source, {}))
        rest.pop(name, None)
        self.set_source(source, rest)

    def _all(self) -> dict[str, ModelEntry]:
        return self._merged

    def _merge(self) -> dict[str, ModelEntry]:
        out: dict[str, ModelEntry] = {}
        for source in sorted(self.entries, key=lambda s: s != "etcd"):  # settings win
            out.update(self.entries[source])
        return out

    def entry(self, model: str) -> ModelEntry | None:
        return self._all().get(model)

    def names(self) -> dict[str, str]:
        """Every name a client may use → the model it means (do not modify)."""
        return self._names

    def _name_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in self._all().values():
            out[entry.name] = entry.name
            for alias in entry.aliases:
                out.setdefault(alias, entry.name)
        return out

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter a client may name → its base model (do not modify). A name
        that is also a model's or an alias means that model (cgn-ctl refuses the clash)."""
        return self._adapters

    def _adapter_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in self._all().values():
            for adapter in entry.adapters:
                if adapter not in self._names:
                    out.setdefault(adapter, entry.name)
        return out

    def hasher(self, model: str) -> PromptHasher:
        got = self._hashers.get(model)
        if got is None:
            entry = self.entry(model)
            path = entry.tokenizer if entry else None
            codec = self._codecs.get(path) if path else None
            tag = self._tags.get(path) if path else None
            got = PromptHasher(model, codec, self.chars_per_block, self.prompts, tag)
            self._hashers[model] = got
        return got

    async def wait_loaded(self) -> None:
        """Until every tokenizer named so far has loaded (or failed)."""
        while self._loading:
            await asyncio.gather(*self._loading)

    async def _load(self, path: Path) -> None:
        try:
            codec, tag = await asyncio.to_thread(_load_codec, path)
        except (CognitoraError, OSError) as exc:
            log.warning("tokenizer %s not loaded (prompts hashed by characters): %s", path, exc)
            return
        self._codecs[path], self._tags[path] = codec, tag
        self._hashers.clear()
        log.info("tokenizer loaded from %s", path)


def _load_codec(path: Path) -> tuple[PromptCodec, bytes]:
    codec = PromptCodec.from_gguf(GGUFFile(bundled_models.resolve(path)))
    return codec, codec_tag(codec)
