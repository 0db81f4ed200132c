"""The LoRA adapters a cgn-infer engine serves (#60): loaded at start, applied per row.

`cgn-infer serve --lora sql=/models/sql.gguf` (repeatable) loads each adapter
into a slot. A request names one in `model` (and may scale it with
`lora_scale`); its rows carry the slot and scale into every layer, where
layer.c adds `scale · alpha/rank · B (A x)` to each product the adapter adapts
(`lora_add`), row by row: requests of different adapters and of the base run in
one batch, each row with its own (no batch per adapter), and a base row pays
one test per matrix.

A file is checked against the base (`cgn_core/lora.py`: llama.cpp's format,
architecture, every pair's shape, rank, finite values) before anything is
kept. The q/k rows of a NEOX-layout model (qwen2) are reordered as the base's
are at load (`weights.neox_to_pairs`), so that an adapter's product lands on
the rows the base's does. Adapters run on the one-call C layers only (GGUF
weights with a kernel for every matrix, all of a model's layers in this
process): elsewhere `Adapters` refuses them at start.

NOTE: the set is fixed at start: a slot's arrays are read by the worker thread
at every step, and a request holds its slot from when it is parsed. Loading
and unloading at run time (vLLM's /v1/load_lora_adapter) is not built yet.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cgn_core.errors import InvalidRequest, NotFound
from cgn_core.keys import NAME
from cgn_core.lora import TARGETS, load
from cgn_infer.models.args import Args
from cgn_infer.weights import neox_to_pairs

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
MAX_SLOTS = 64  # adapters one engine holds (the catalog's max_adapters, at most)
_PAIR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


class LoraPair(ctypes.Structure):
    """layer.c's cgn_lora_pair."""

    _fields_ = (
        ("rank", _i64),
        ("out", _i64),
        ("a", _ptr),
        ("b", _ptr),
        ("factor", ctypes.c_float),
    )


class LoraLayer(ctypes.Structure):
    """layer.c's cgn_lora_layer: one pair per target (rank 0: not adapted)."""

    _fields_ = (("p", LoraPair * len(TARGETS)),)


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: Path
    slot: int
    rank: int
    arrays: tuple[np.ndarray, ...]  # what the layers' pointers point into (kept alive)


def parse_lora_flag(value: str) -> tuple[str, Path]:
    """`NAME=PATH` of `--lora`; ValueError says what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not NAME.match(name) or not path:
        raise ValueError(f"--lora expects NAME=PATH (a name of [A-Za-z0-9._:-]), got {value!r}")
    return name, Path(path)


class Adapters:
    """An engine's loaded adapters by name, and each layer's table of their pairs by slot
    (`tables`, what FusedLayers hands layer.c)."""

    def __init__(self, model: str, base: Path, args: Args, layers: int):
        self.model, self.base, self.args, self.layers = model, base, args, layers
        self.by_name: dict[str, Adapter] = {}
        self.tables: list[ctypes.Array[LoraLayer]] = []

    def load(self, name: str, path: Path) -> Adapter:
        """Read, check and hold `path` as adapter `name` in the next slot; LoraError (a 400
        InvalidRequest) names what is wrong with the file."""
        if name == self.model or name in self.by_name:
            raise InvalidRequest(f"adapter name {name!r} is taken (the model's or loaded)")
        if len(self.by_name) >= MAX_SLOTS:
            raise InvalidRequest(f"at most {MAX_SLOTS} adapters per engine")
        checked, weights = load(path, self.base)
        slot = len(self.by_name)
        layers = [LoraLayer() for _ in range(self.layers)]
        kept: list[np.ndarray] = []
        for tensor, (a, b) in weights.items():
            m = _PAIR.match(tensor)
            assert m is not None  # lora.load checked every name
            layer, target = int(m.group(1)), TARGETS.index(m.group(2))
            if layer >= self.layers:
                raise InvalidRequest(f"adapter {path}: {tensor} is past the model's "
                                     f"{self.layers} layers")  # fmt: skip
            a, b = np.ascontiguousarray(a), np.ascontiguousarray(self._rows(m.group(2), b))
            rank = a.shape[0]
            factor = checked.scale(rank)
            layers[layer].p[target] = LoraPair(rank, b.shape[0], a.ctypes.data, b.ctypes.data,
                                               factor)  # fmt: skip
            kept += [a, b]
        adapter = Adapter(name, path, slot, checked.rank, tuple(kept))
        self.by_name[name] = adapter
        self._rebuild(layers)
        return adapter

    def _rows(self, target: str, b: np.ndarray) -> np.ndarray:
        """B's rows in the order the base's rows of `target` were loaded in."""
        a = self.args
        if not a.rope_neox or target not in ("attn_q", "attn_k"):
            return b
        return neox_to_pairs(b, a.n_heads if target == "attn_q" else a.n_kv_heads, a.head_dim)

    def _rebuild(self, added: Sequence[LoraLayer]) -> None:
        """Each layer's table with the new slot's pairs appended (slots never move)."""
        slots = len(self.by_name)
        tables = []
        for i in range(self.layers):
            table = (LoraLayer * slots)()
            for s in range(slots - 1):
                table[s] = self.tables[i][s]
            table[slots - 1] = added[i]
            tables.append(table)
        self.tables = tables

    def resolve(self, name: str, scale: float) -> tuple[int, float]:
        """(slot, scale) of the adapter a request names; NotFound names the loaded ones."""
        adapter = self.by_name.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise NotFound(
                f"model '{name}' is not served here (this engine serves '{self.model}' and "
                f"the adapters {loaded})",
                code="model_not_found",
                param="model",
            )
        return adapter.slot, scale

    def listing(self) -> Mapping[str, Adapter]:
        return dict(self.by_name)
