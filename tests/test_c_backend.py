"""The C backend (cgn_infer/backends/c_backend.py): the torch backend's C layers without
torch. It is chosen where it applies, starts a served engine with torch never imported,
computes the torch backend's layers bit for bit and its logits up to the final norm's
rounding, and moves KV blocks in the torch backend's format."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cgn_core.text.gguf_file import GGUFFile
from cgn_infer import kernels
from cgn_infer.backends import c_backend
from cgn_infer.backends.build import build_part
from cgn_infer.backends.c_backend import CBackend
from cgn_infer.backends.paged import BatchItem, layout
from cgn_infer.models import args_from_gguf
from cgn_infer.settings import InferSettings


@pytest.fixture(scope="module")
def smollm2_c(smollm2_gguf: GGUFFile) -> CBackend:
    lib = kernels.load()
    assert lib is not None, kernels.failure()
    return CBackend(smollm2_gguf, args_from_gguf(smollm2_gguf), lib, threads=2)


def test_it_is_chosen_where_every_matrix_has_a_kernel(smollm2_gguf: GGUFFile) -> None:
    """--dtype gguf on CPU for a whole model: the C backend; float32 weights or a pipeline
    part: the torch backend. A model with a matrix type that has no kernel does not apply."""
    args = args_from_gguf(smollm2_gguf)
    whole = (0, args.n_layers)
    assert c_backend.applies(smollm2_gguf, args)
    gguf = InferSettings(model="x", threads=2)
    assert isinstance(build_part(smollm2_gguf, args, gguf, whole), CBackend)
    dense = InferSettings(model="x", threads=2, weights="float32")
    assert build_part(smollm2_gguf, args, dense, whole).name == "torch"
    assert build_part(smollm2_gguf, args, gguf, (0, 2), ends=True).name == "torch"
    info = smollm2_gguf.tensors["blk.3.ffn_down.weight"]
    smollm2_gguf.tensors["blk.3.ffn_down.weight"] = dataclasses.replace(info, ggml_type=1)  # F16
    try:
        assert not c_backend.applies(smollm2_gguf, args)
    finally:
        smollm2_gguf.tensors["blk.3.ffn_down.weight"] = info


def test_the_layers_are_the_torch_backends_bits_and_the_logits_track_them(
    smollm2_c: CBackend, smollm2_torch: Any
) -> None:
    """A prompt and its chunked continuation, batched with a decode row: the residual stream
    after every layer equals the torch backend's exactly (the same C layers over the same
    embedding), and the logits match to float rounding (the final norm: C's sum in double
    against torch's), with the same argmax everywhere."""
    prompt = np.random.default_rng(5).integers(100, 20000, 40).tolist()
    outs = []
    for b in (smollm2_c, smollm2_torch):
        kv = b.new_kv(8)
        first = b.forward_batch([BatchItem(prompt[:30], 0, [0, 1])], kv, all_logits=True)
        items = [BatchItem(prompt[30:], 30, [0, 1, 2]), BatchItem([7], 0, [5])]
        lay = layout(items)
        x = b.run_layers(b.embed(lay), lay, kv)
        rest = b.forward_batch(
            [BatchItem(prompt[35:], 40, [0, 1, 2, 3]), BatchItem([9], 1, [5])], kv
        )
        outs.append((first, np.asarray(x), rest, b.read_blocks(kv, [0, 1, 2, 5])))
    (c_first, c_x, c_rest, c_blocks), (t_first, t_x, t_rest, t_blocks) = outs
    assert np.array_equal(c_x, t_x)
    assert np.array_equal(c_blocks, t_blocks)  # the same KV, in the same format
    for c, t in ((c_first, t_first), (c_rest, t_rest)):
        assert np.array_equal(c.argmax(-1), t.argmax(-1))
        assert np.abs(c - t).max() <= 1e-4 * np.abs(t).max()


def test_blocks_move_between_the_c_and_torch_backends(
    smollm2_c: CBackend, smollm2_torch: Any
) -> None:
    """A prompt's blocks read from one backend and written into the other continue the same
    generation (what a prefill/decode transfer or the node's store does)."""
    prompt = np.random.default_rng(6).integers(100, 20000, 33).tolist()
    src = smollm2_torch.new_kv(4)
    smollm2_torch.forward_batch([BatchItem(prompt[:32], 0, [0, 1])], src)
    dst = smollm2_c.new_kv(4)
    smollm2_c.write_blocks(dst, [2, 3], smollm2_torch.read_blocks(src, [0, 1]))
    assert smollm2_c.kv_layout() == smollm2_torch.kv_layout()
    moved = smollm2_c.forward_batch([BatchItem(prompt[32:], 32, [2, 3, 0])], dst)
    here = smollm2_torch.forward_batch([BatchItem(prompt[32:], 32, [0, 1, 2])], src)
    assert np.array_equal(moved.argmax(-1), here.argmax(-1))
    with pytest.raises(IndexError):
        smollm2_c.read_blocks(dst, [4])


def test_a_served_engine_never_imports_torch(smollm2_path: Path) -> None:
    """The load path of `cgn-infer serve` on the bundled model, in a fresh interpreter: the
    model loads, answers a step, and torch is not among the modules imported."""
    code = f"""
import sys
from pathlib import Path
from cgn_infer.loader import load_model
from cgn_infer.settings import InferSettings
from cgn_infer.backends.paged import BatchItem
loaded = load_model(InferSettings(model=Path({str(smollm2_path)!r}), threads=2))
b = loaded.backend
logits = b.forward_batch([BatchItem([1, 2, 3], 0, [0])], b.new_kv(1))
print(b.name, logits.shape, "torch" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["c", "(1,", "49152)", "False"], done.stdout
