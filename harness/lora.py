"""LoRA adapters for tests, written as llama.cpp's GGUF adapter files (cgn_core/lora.py says
the format) with the `gguf` package's writer: seeded random pairs for a base model's
matrices, made here rather than downloaded.

    write_adapter(smollm2(), tmp / "a.gguf", rank=8, targets=("attn_q", "attn_v"))

`transpose_a`, `arch` and `drop_b` make the broken files the checks must refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cgn_core.text.gguf_file import GGUFFile


def write_adapter(
    base: Path,
    out: Path,
    *,
    rank: int = 8,
    targets: Sequence[str] = ("attn_q", "attn_v"),
    layers: Sequence[int] | None = None,
    alpha: float = 16.0,
    seed: int = 0,
    std: float = 0.02,
    arch: str | None = None,
    transpose_a: bool = False,
    drop_b: bool = False,
) -> Path:
    """An adapter of `base` (a GGUF model) at `out`: for each block in `layers` (default
    all) and each of `targets`, A [rank, in] and B [out, rank] drawn from N(0, std)."""
    import gguf

    rng = np.random.default_rng(seed)
    with GGUFFile(base) as b:
        base_arch = str(b.require("general.architecture"))
        blocks = int(b.require(f"{base_arch}.block_count"))
        shapes = {name: info.shape for name, info in b.tensors.items()}
    writer = gguf.GGUFWriter(str(out), arch or base_arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for i in range(blocks) if layers is None else layers:
        for t in targets:
            name = f"blk.{i}.{t}.weight"
            rows, cols = shapes[name]
            a = rng.normal(0.0, std, (rank, cols)).astype(np.float32)
            writer.add_tensor(name + ".lora_a", a.T.copy() if transpose_a else a)
            if not drop_b:
                writer.add_tensor(name + ".lora_b", rng.normal(0.0, std, (rows, rank))
                                  .astype(np.float32))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_peft(base: Path, adapter: Path, out: Path, *, dtype: str = "F32", **config: Any) -> Path:
    """The GGUF `adapter` (of `base`) as a PEFT directory at `out`: the same pairs in HF's
    names and order (a llama base's q/k B rows un-permuted, as llama.cpp's converter would
    permute them back), `config` merged into adapter_config.json."""
    import json
    import struct

    from cgn_core.lora import load

    with GGUFFile(base) as b:
        arch = str(b.require("general.architecture"))
        heads = (int(b.require(f"{arch}.attention.head_count")),
                 int(b.require(f"{arch}.attention.head_count_kv")))  # fmt: skip
    checked, pairs = load(adapter, base)
    modules = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}  # fmt: skip
    tensors: dict[str, np.ndarray] = {}
    for tensor, (a, lb) in pairs.items():
        _, layer, target, _ = tensor.split(".")
        if arch == "llama" and target in ("attn_q", "attn_k"):
            n = heads[0] if target == "attn_q" else heads[1]
            lb = lb.reshape(n, lb.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(lb.shape)
        stem = f"base_model.model.model.layers.{layer}.{modules[target]}"
        tensors[stem + ".lora_A.weight"], tensors[stem + ".lora_B.weight"] = a, lb
    np_type = {"F32": np.float32, "F16": np.float16}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, np_type).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}  # fmt: skip
        blobs.append(blob)
        offset += len(blob)
    out.mkdir(parents=True, exist_ok=True)
    head = json.dumps(header).encode()
    (out / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head
                                                     + b"".join(blobs))  # fmt: skip
    rank = checked.rank
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": checked.alpha or rank,
           "target_modules": sorted({m.split(".")[1] for m in tensors}), "bias": "none",
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", **config}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out
