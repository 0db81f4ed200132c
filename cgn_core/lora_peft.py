"""LoRA adapters as PEFT directories (`adapter_config.json` + `adapter_model.safetensors`),
read into llama.cpp's layout (#60): what `cgn_core/lora.py` gives for a GGUF file.

    adapter_config.json   peft_type "LORA", r, lora_alpha, target_modules
    adapter_model.safetensors
        base_model.model.model.layers.<i>.self_attn.<q|k|v|o>_proj.lora_<A|B>.weight
        base_model.model.model.layers.<i>.mlp.<gate|up|down>_proj.lora_<A|B>.weight

A (`lora_A`) is [r, in] and B (`lora_B`) [out, r], as GGUF's. Names map to the base's
tensors (`q_proj` → `blk.<i>.attn_q.weight`, ...). A llama base's q and k rows are
stored permuted in its GGUF (llama.cpp's converter pairs each head's halves for its
RoPE); its `convert_lora_to_gguf.py` permutes B of q and k alike, and so does this
reader (`_permute`, the converter's `LlamaModel.permute`). qwen2 keeps HF's order.
The scale is `lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`). What PEFT can say and
this reader cannot apply is refused by name: `fan_in_fan_out`, per-module ranks or
alphas (`rank_pattern`, `alpha_pattern`), DoRA, biases, embedding or head adapters.

The safetensors file is read without following links and bounded (its header, then
each tensor's extent checked against the file) before any tensor is copied.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from cgn_core.files import read_regular

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG = 1 << 20
MAX_HEADER = 16 << 20
MAX_FILE = 8 << 30
_MODULES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d{1,4})\.([a-z_]+\.[a-z_]+)\.lora_([AB])\.weight$"
)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


class PeftError(ValueError):
    """What is wrong with a PEFT directory (the message says; lora.py names the adapter)."""


def is_peft(path: Path) -> bool:
    return path.is_dir()


def read(path: Path, architecture: str, heads: tuple[int, int]) -> tuple[float, dict[str, Any]]:
    """(scale numerator alpha, {base tensor: (A, B)}) of the PEFT directory `path`, in
    llama.cpp's layout for a base of `architecture` with (heads, KV heads); every
    array float32. Only A's and B's names and shapes are checked here; lora.py checks
    them against the base."""
    cfg = _config(path)
    alpha = float(cfg["lora_alpha"])
    rank = int(cfg["r"])
    if cfg.get("use_rslora"):
        alpha = alpha * rank / math.sqrt(rank)  # alpha / sqrt(r) = (alpha · r / sqrt(r)) / r
    tensors = _safetensors(path / WEIGHTS)
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        m = _NAME.match(name)
        if m is None or m.group(2) not in _MODULES:
            raise PeftError(f"{WEIGHTS}: tensor {name!r} is not a LoRA pair of a transformer "
                            f"block's {', '.join(_MODULES)}")  # fmt: skip
        target = f"blk.{int(m.group(1))}.{_MODULES[m.group(2)]}.weight"
        halves.setdefault(target, {})[m.group(3)] = array
    pairs = {}
    for target, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise PeftError(f"{target}: lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise PeftError(f"{target}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                            "do not pair")  # fmt: skip
        if architecture == "llama" and target.endswith(("attn_q.weight", "attn_k.weight")):
            b = _permute(b, heads[0] if "attn_q" in target else heads[1])
        pairs[target] = (a, b)
    return alpha, pairs


def _config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(read_regular(path / CONFIG, MAX_CONFIG, follow_links=False))
    except (OSError, ValueError) as exc:
        raise PeftError(f"{CONFIG}: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise PeftError(f"{CONFIG}: not a LoRA adapter's (peft_type LORA expected)")
    for name in ("r", "lora_alpha"):
        v = cfg.get(name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v < math.inf:
            raise PeftError(f"{CONFIG}: '{name}' must be a positive number")
    unsupported = [
        k for k in ("fan_in_fan_out", "use_dora", "rank_pattern", "alpha_pattern",
                    "modules_to_save", "layers_pattern")
        if cfg.get(k) not in (None, False, {}, [], "")
    ]  # fmt: skip
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise PeftError(f"{CONFIG}: {', '.join(unsupported)} not supported")
    return cfg


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32, the file bounded before it is read."""
    try:
        data = read_regular(path, MAX_FILE, follow_links=False)
    except OSError as exc:
        raise PeftError(f"{WEIGHTS}: {exc}") from None
    if len(data) < 8:
        raise PeftError(f"{WEIGHTS}: truncated")
    (n,) = struct.unpack("<Q", data[:8])
    if not 2 <= n <= min(MAX_HEADER, len(data) - 8):
        raise PeftError(f"{WEIGHTS}: header of {n} bytes, past the file or {MAX_HEADER}")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as exc:
        raise PeftError(f"{WEIGHTS}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PeftError(f"{WEIGHTS}: header is not a JSON object")
    body, out = memoryview(data)[8 + n :], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(name, info, body)
    return out


def _tensor(name: str, info: Any, body: memoryview) -> np.ndarray:
    ok = isinstance(info, dict) and info.get("dtype") in _DTYPES
    shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
    if not (
        isinstance(shape, list) and len(shape) == 2
        and all(type(d) is int and 0 < d < 1 << 20 for d in shape)
        and isinstance(offsets, list) and len(offsets) == 2
        and all(type(o) is int for o in offsets)
    ):  # fmt: skip
        raise PeftError(f"{WEIGHTS}: {name}: a 2-d F32, F16 or BF16 tensor with offsets expected")
    width = 4 if info["dtype"] == "F32" else 2
    begin, end = offsets
    if not 0 <= begin <= end <= len(body) or end - begin != shape[0] * shape[1] * width:
        raise PeftError(f"{WEIGHTS}: {name}: data offsets outside the file or of the wrong size")
    raw = np.frombuffer(body[begin:end], dtype=np.uint16 if width == 2 else np.float32)
    if info["dtype"] == "BF16":
        array = (raw.astype(np.uint32) << 16).view(np.float32)
    elif info["dtype"] == "F16":
        array = raw.view(np.float16).astype(np.float32)
    else:
        array = raw.astype(np.float32)
    return array.reshape(shape)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` of rows: each head's two halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
