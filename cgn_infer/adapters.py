"""The LoRA adapters a cgn-infer engine serves (#60): loaded at start or at run time,
applied per row, evicted least recently used.

`cgn-infer serve --lora sql=/models/sql.gguf` (repeatable) loads each adapter at
start, pinned; `POST /v1/load_lora_adapter` (vLLM's body, `lora_api.py`) loads
one at run time from under `lora_dirs`. A request names one in `model` (and may
scale it with `lora_scale`); its rows carry the adapter's slot and scale into
every layer, where layer.c adds `scale · alpha/rank · B (A x)` to each product
the adapter adapts (`lora_add`), row by row: requests of different adapters and
of the base run in one batch, each row with its own, and a base row pays one test
per matrix.

Slots: each layer has one table of `slots` entries (`max_loras`), allocated once
and handed to the C layers at start, so their pointers never change. A load
reads and checks the file off the worker thread, then writes its pairs into a
free slot, which no row reads (a slot is free only while no request holds it);
when every slot is taken it first evicts the least recently used adapter that no
request holds and is not pinned, or refuses (503). A request holds its adapter
from when it is prepared until it ends (`acquire`/`release`), so a slot never
changes under a running row.

A file is checked against the base (`cgn_core/lora.py`: llama.cpp's format,
architecture, every pair's shape, rank, finite values) before anything is kept.
The q/k rows of a NEOX-layout model (qwen2) are reordered as the base's are at
load (`weights.neox_to_pairs`). The torch backend runs adapters on its one-call
C layers only (GGUF weights, every layer in one process); the sim backend holds
them (its load time modelled, `sim.lora_load_s`) and computes nothing with them.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cgn_core.errors import InvalidRequest, NotFound, Unavailable
from cgn_core.lora import TARGETS, load
from cgn_infer.models.args import Args
from cgn_infer.settings import MAX_LORAS
from cgn_infer.weights import neox_to_pairs

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
MAX_SLOTS = MAX_LORAS
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
class Read:
    """An adapter file read and checked, not yet in a slot: (layer, target, rank, A, B,
    factor) per pair."""

    path: Path
    rank: int
    pairs: tuple[tuple[int, int, int, np.ndarray, np.ndarray, float], ...]


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: Path
    slot: int
    rank: int
    pinned: bool
    read: Read  # what the slot's pointers point into (kept alive while it is loaded)


class Adapters:
    """An engine's loaded adapters by name, each layer's table of their pairs by slot
    (`tables`, what the C layers read), who holds them, and which to evict."""

    def __init__(
        self, model: str, base: Path, args: Args, layers: int, slots: int = 4,
        load_s: float = 0.0,
    ):  # fmt: skip
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"adapter slots must be 1-{MAX_SLOTS}, got {slots}")
        self.model, self.base, self.args, self.layers = model, base, args, layers
        self.load_s = load_s  # added to each read: the sim backend's modelled load time
        self.slots = slots
        self.tables = [(LoraLayer * slots)() for _ in range(layers)]
        self.by_name: dict[str, Adapter] = {}
        self.free = list(range(slots))
        self.holds: Counter[str] = Counter()  # requests holding each adapter
        self.used: dict[str, float] = {}  # when each was last acquired (monotonic)
        self.evictions = 0
        self._lock = threading.Lock()  # the event loop and the start's thread both call in

    # ---- loading --------------------------------------------------------------------

    def read(self, path: Path) -> Read:
        """Read and check `path` against the base (slow: off the event loop and off the
        worker); LoraError (a 400) says what is wrong with the file."""
        started = time.monotonic()
        checked, weights = load(path, self.base)
        pairs = []
        for tensor, (a, b) in weights.items():
            m = _PAIR.match(tensor)
            assert m is not None  # lora.load checked every name
            layer, target = int(m.group(1)), TARGETS.index(m.group(2))
            if layer >= self.layers:
                raise InvalidRequest(f"adapter {path}: {tensor} is past the model's "
                                     f"{self.layers} layers")  # fmt: skip
            a, b = np.ascontiguousarray(a), np.ascontiguousarray(self._rows(m.group(2), b))
            pairs.append((layer, target, a.shape[0], a, b, checked.scale(a.shape[0])))
        if (left := self.load_s - (time.monotonic() - started)) > 0:
            time.sleep(left)
        return Read(path, checked.rank, tuple(pairs))

    def check_free(self, name: str) -> None:
        """400 unless `name` may be loaded: not the model's, not loaded already."""
        if name == self.model:
            raise InvalidRequest(f"'{name}' is the model's own name", param="lora_name")
        if name in self.by_name:
            raise InvalidRequest(f"the LoRA adapter '{name}' has already been loaded",
                                 param="lora_name")  # fmt: skip

    def install(self, name: str, read: Read, *, pin: bool = False) -> tuple[Adapter, str | None]:
        """Put `read` in a slot as adapter `name`: a free one, else the least recently used
        one no request holds (returned: the adapter evicted). 400 for a name taken, 503
        when every slot is held or pinned."""
        with self._lock:
            self.check_free(name)
            evicted = None
            if not self.free:
                idle = [n for n, a in self.by_name.items() if not a.pinned and not self.holds[n]]
                if not idle:
                    raise Unavailable(
                        f"every one of the {len(self.by_name)} adapter slots is pinned or "
                        "serving a request",
                        code="adapter_slots_full",
                        retry_after_s=1,
                    )
                evicted = min(idle, key=lambda n: self.used.get(n, 0.0))
                self._drop(evicted)
                self.evictions += 1
            slot = self.free.pop(0)
            for layer, target, rank, a, b, factor in read.pairs:
                self.tables[layer][slot].p[target] = LoraPair(
                    rank, b.shape[0], a.ctypes.data, b.ctypes.data, factor
                )
            adapter = Adapter(name, read.path, slot, read.rank, pin, read)
            self.by_name[name] = adapter
            self.used[name] = time.monotonic()
            return adapter, evicted

    def load(self, name: str, path: Path, *, pin: bool = False) -> Adapter:
        """`read` then `install` (at start: nothing runs yet)."""
        return self.install(name, self.read(path), pin=pin)[0]

    def unload(self, name: str) -> None:
        """NotFound for an adapter not loaded; 400 for a pinned one, or while a request
        holds it."""
        with self._lock:
            if name not in self.by_name:
                raise NotFound(f"the LoRA adapter '{name}' is not loaded", param="lora_name")
            if self.by_name[name].pinned:
                raise InvalidRequest(f"the LoRA adapter '{name}' is pinned (--lora): it stays "
                                     "loaded", param="lora_name")  # fmt: skip
            if self.holds[name]:
                held = f"the LoRA adapter '{name}' is serving {self.holds[name]} request(s)"
                raise InvalidRequest(held, param="lora_name")
            self._drop(name)

    def _drop(self, name: str) -> None:
        """Empty `name`'s slot (no row reads it: nothing holds it) and free it."""
        adapter = self.by_name.pop(name)
        for layer in self.tables:
            layer[adapter.slot] = LoraLayer()
        self.free.append(adapter.slot)
        self.used.pop(name, None)
        self.holds.pop(name, None)

    def _rows(self, target: str, b: np.ndarray) -> np.ndarray:
        """B's rows in the order the base's rows of `target` were loaded in."""
        a = self.args
        if not a.rope_neox or target not in ("attn_q", "attn_k"):
            return b
        return neox_to_pairs(b, a.n_heads if target == "attn_q" else a.n_kv_heads, a.head_dim)

    # ---- requests -------------------------------------------------------------------

    def check(self, name: str) -> None:
        """NotFound, naming the loaded adapters, unless `name` is one."""
        if name not in self.by_name:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise NotFound(
                f"model '{name}' is not served here (this engine serves '{self.model}' and "
                f"the adapters {loaded})",
                code="model_not_found",
                param="model",
            )

    def acquire(self, name: str, scale: float) -> tuple[int, float]:
        """Hold `name` for one request: its (slot, scale), the slot fixed until `release`."""
        with self._lock:
            self.check(name)
            self.holds[name] += 1
            self.used[name] = time.monotonic()
            return self.by_name[name].slot, scale

    def release(self, name: str) -> None:
        with self._lock:
            if self.holds[name] > 0:
                self.holds[name] -= 1

    def resolve(self, name: str, scale: float) -> tuple[int, float]:
        """(slot, scale) of a loaded adapter, held by no request (callers that run batches
        themselves: tests and benchmarks, with nothing evicting)."""
        self.check(name)
        return self.by_name[name].slot, scale

    def listing(self) -> dict[str, Adapter]:
        with self._lock:
            return dict(self.by_name)
