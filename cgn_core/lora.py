"""LoRA adapters as GGUF files, in llama.cpp's format, read and checked against their base (#60).

An adapter file holds

    general.type = "adapter", adapter.type = "lora"
    general.architecture     the base model's (llama, qwen2, ...)
    adapter.lora.alpha       float; the scale of a pair of rank r is alpha / r times the
                             request's scale (alpha 0: the request's scale alone)
    <base tensor>.lora_a     [rank, in]    (numpy order; GGUF stores the dims reversed)
    <base tensor>.lora_b     [out, rank]   for a base tensor of [out, in]

and adapts a layer's product y = W x into y + scale · B (A x). The checks are llama.cpp's
(src/llama-adapter.cpp: a pair's tensors both present, their shapes the base tensor's,
A's rank B's), plus what cgn-infer needs: the base tensors are the attention and MLP
matrices of the transformer blocks (`TARGETS`), a rank at most `MAX_RANK`, F32 or F16
values, and a finite alpha. Every refusal names the adapter and the base.

`check` reads only the headers (the catalog's check at `cgn-ctl models apply`, an
engine's before it loads anything); `load` returns the pairs as float32 arrays.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cgn_core import keys, lora_peft
from cgn_core.errors import InvalidRequest
from cgn_core.lora_peft import PeftError
from cgn_core.text.gguf_file import GGUFError, GGUFFile, dequantize

MAX_RANK = keys.MAX_LORA_RANK
MAX_PER_REPLICA = keys.MAX_ADAPTERS  # adapters one replica may list
MAX_PAIRS = 4096  # 7 matrices in each of up to ~585 blocks
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_TENSOR = re.compile(r"^blk\.(\d{1,4})\.([a-z_]+)\.weight\.lora_([ab])$")
_VALUE_TYPES = ("F32", "F16")


class LoraError(InvalidRequest):
    """An adapter file that is not a LoRA adapter of the given base (the message says why)."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One adapted matrix: `tensor` is the base's (blk.N.attn_q.weight), [out, in]."""

    tensor: str
    rank: int
    out: int
    inputs: int


@dataclass(frozen=True, slots=True)
class Adapter:
    path: Path
    architecture: str
    alpha: float
    pairs: tuple[Pair, ...]

    @property
    def rank(self) -> int:
        return max((p.rank for p in self.pairs), default=0)

    def scale(self, rank: int, requested: float = 1.0) -> float:
        """The factor on B (A x) for a pair of `rank` at the request's `requested` scale."""
        return requested * self.alpha / rank if self.alpha else requested


def check(path: Path, base: Path) -> Adapter:
    """The adapter at `path` (a GGUF file, or a PEFT directory), checked against the base
    model's GGUF at `base` (a GGUF's headers only); LoraError says why it is not one of
    that base's adapters."""
    if lora_peft.is_peft(path):
        return load(path, base)[0]
    try:
        with GGUFFile(path) as g, GGUFFile(base) as b:
            return _check(g, b)
    except GGUFError as exc:
        raise LoraError(f"adapter {path}: {exc.message}") from None


def load(path: Path, base: Path) -> tuple[Adapter, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The checked adapter and its pairs as float32 (A [rank, in], B [out, rank]) by base
    tensor name, copied out of the file."""
    try:
        if lora_peft.is_peft(path):
            with GGUFFile(base) as b:
                adapter, weights = _peft(path, b)
        else:
            with GGUFFile(path) as g, GGUFFile(base) as b:
                adapter = _check(g, b)
                weights = _pairs(g, adapter)
    except GGUFError as exc:
        raise LoraError(f"adapter {path}: {exc.message}") from None
    for tensor, (lora_a, lora_b) in weights.items():
        if not (np.isfinite(lora_a).all() and np.isfinite(lora_b).all()):
            raise LoraError(f"adapter {path}: {tensor} holds a NaN or an infinity")
    return adapter, weights


def _pairs(g: GGUFFile, adapter: Adapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        p.tensor: (
            np.array(dequantize(g, p.tensor + ".lora_a"), np.float32),
            np.array(dequantize(g, p.tensor + ".lora_b"), np.float32),
        )
        for p in adapter.pairs
    }


def _check(g: GGUFFile, b: GGUFFile) -> Adapter:
    path, base = g.path, b.path
    if g.get("general.type") != "adapter" or g.get("adapter.type") != "lora":
        raise LoraError(f"{path} is not a LoRA adapter (general.type 'adapter' and "
                        "adapter.type 'lora' are expected)")  # fmt: skip
    arch, base_arch = g.get("general.architecture"), b.get("general.architecture")
    if arch != base_arch:
        raise LoraError(f"adapter {path} is for architecture {arch!r}, its base {base} is "
                        f"{base_arch!r}")  # fmt: skip
    alpha = g.get("adapter.lora.alpha", 0.0)
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha < 0:
        raise LoraError(f"adapter {path}: adapter.lora.alpha must be a finite number >= 0")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    if len(g.tensors) > 2 * MAX_PAIRS:
        raise LoraError(f"adapter {path}: {len(g.tensors)} tensors, at most {2 * MAX_PAIRS}")
    for name, info in g.tensors.items():
        m = _TENSOR.match(name)
        if m is None or m.group(2) not in TARGETS:
            raise LoraError(
                f"adapter {path}: tensor {name!r} is not one cgn-infer adapts (blk.N.<"
                f"{'|'.join(TARGETS)}>.weight.lora_a/lora_b)"
            )
        if info.type_name not in _VALUE_TYPES or len(info.shape) != 2:
            raise LoraError(f"adapter {path}: {name} must be a 2-d F32 or F16 tensor, is "
                            f"{info.type_name} {list(info.shape)}")  # fmt: skip
        halves.setdefault(name.removesuffix(".lora_" + m.group(3)), {})[m.group(3)] = info.shape
    pairs = []
    for tensor, ab in sorted(halves.items()):
        if set(ab) != {"a", "b"}:
            raise LoraError(f"adapter {path}: {tensor} has lora_{''.join(ab)} without its pair")
        pairs.append(_fit(path, b, tensor, ab["a"], ab["b"]))
    return _adapter(path, str(arch), float(alpha), pairs)


def _fit(path: Path, b: GGUFFile, tensor: str, a: tuple[int, ...], lb: tuple[int, ...]) -> Pair:
    """The pair of `tensor` with A of shape `a` and B of shape `lb`, checked to fit the
    base's matrix (A [rank, in], B [out, rank]) with a rank in bounds."""
    target = b.tensors.get(tensor)
    if target is None:
        raise LoraError(f"adapter {path}: {tensor} is not a tensor of its base {b.path}")
    if _TENSOR.match(tensor + ".lora_a") is None or tensor.split(".")[2] not in TARGETS:
        raise LoraError(f"adapter {path}: {tensor} is not a matrix cgn-infer adapts")
    (rank, inputs), (out, rank_b) = a, lb
    if (out, inputs) != tuple(target.shape) or rank != rank_b:
        raise LoraError(
            f"adapter {path}: {tensor} is lora_a {list(a)} and lora_b {list(lb)}, which do "
            f"not fit its base {b.path}'s {list(target.shape)}"
        )
    if not 1 <= rank <= MAX_RANK:
        raise LoraError(f"adapter {path}: {tensor} has rank {rank} (1 to {MAX_RANK})")
    return Pair(tensor, rank, out, inputs)


def _adapter(path: Path, arch: str, alpha: float, pairs: list[Pair]) -> Adapter:
    if not pairs:
        raise LoraError(f"adapter {path} adapts nothing")
    return Adapter(path, arch, alpha, tuple(pairs))


def _peft(path: Path, b: GGUFFile) -> tuple[Adapter, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A PEFT directory (lora_peft.py) read in llama.cpp's layout and checked against the
    base `b` as a GGUF adapter is."""
    arch = str(b.get("general.architecture"))
    keys = (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv")
    heads = tuple(int(b.get(k, 0) or 0) for k in keys)
    if not all(heads):
        raise LoraError(f"adapter {path}: its base {b.path} names no attention heads")
    try:
        alpha, weights = lora_peft.read(path, arch, (heads[0], heads[1]))
    except PeftError as exc:
        raise LoraError(f"adapter {path}: {exc}") from None
    if len(weights) > MAX_PAIRS:
        raise LoraError(f"adapter {path}: {len(weights)} pairs, at most {MAX_PAIRS}")
    pairs = [_fit(path, b, t, a.shape, lb.shape) for t, (a, lb) in weights.items()]
    return _adapter(path, arch, alpha, pairs), weights
