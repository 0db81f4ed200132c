"""LoRA adapters for tests, written as llama.cpp's GGUF adapter files (cgn_core/lora.py says
the format) with the `gguf` package's writer: seeded random pairs for a base model's
matrices, made here rather than downloaded.

    write_adapter(smollm2(), tmp / "a.gguf", rank=8, targets=("attn_q", "attn_v"))

`transpose_a`, `arch` and `drop_b` make the broken files the checks must refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
