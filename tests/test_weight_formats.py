"""Weight storage formats: Q4 groups are exact, int4/int8 backends track float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cgn_core.text.gguf_file import GGUFFile
from cgn_infer.backends.torch_backend import Linear, TorchBackend
from cgn_infer.models import args_from_gguf
from cgn_infer.quants import dequantize, q4_groups


def test_q4_groups_reproduce_the_dequantized_values_exactly(smollm2_gguf: GGUFFile) -> None:
    name = "blk.3.ffn_up.weight"  # Q4_1
    values = dequantize(smollm2_gguf, name)
    groups = q4_groups(smollm2_gguf, name)
    assert groups is not None and groups.shape == (values.shape[0], values.shape[1] // 32, 2)
    v = values.reshape(values.shape[0], -1, 32)
    q = (v - groups[..., 1:2]) / groups[..., 0:1]
    assert np.allclose(q, np.round(q), atol=1e-3) and q.min() > -0.01 and q.max() < 15.01
    assert q4_groups(smollm2_gguf, "token_embd.weight") is None  # Q8_0: no exact 4-bit form


def test_int4_linear_matches_float(smollm2_gguf: GGUFFile) -> None:
    name = "blk.0.attn_output.weight"
    w = torch.from_numpy(dequantize(smollm2_gguf, name).copy())
    lin = Linear(w, "int4", q4_groups(smollm2_gguf, name))
    assert lin.kind == "int4" and lin.nbytes() < w.numel()  # about half a byte per weight
    x = torch.randn(3, w.shape[1])
    ref = x @ w.T
    assert ((lin(x) - ref).abs().max() / ref.abs().max()) < 0.02
    assert Linear(w, "int4", None).kind == "int8"  # no exact groups: falls back


def _logits(backend: Any, ids: list[int]) -> np.ndarray:
    out: np.ndarray = backend.forward(ids, 0, backend.new_cache(len(ids)), all_logits=True)
    return out


@pytest.mark.slow
def test_compact_formats_track_float32(smollm2_gguf: GGUFFile) -> None:
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]
    args = args_from_gguf(smollm2_gguf)
    ref = _logits(TorchBackend(smollm2_gguf, args, weights="float32", threads=2), ids)
    formats = (("gguf", 0.998), ("auto", 0.999), ("int4", 0.998), ("int8", 0.995),
               ("bfloat16", 0.999))  # fmt: skip
    for fmt, floor in formats:
        backend = TorchBackend(smollm2_gguf, args, weights=fmt, threads=2)
        if fmt == "auto":  # SmolLM2's Q4_1 layers in int4, its Q8_0 embedding (LM head) float
            layer = backend.w.layers[0]
            kinds = {m.kind for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)}
            assert kinds == {"int4"} and backend.w.output.kind in ("float32", "onednn")
        ours = _logits(backend, ids)
        corr = np.mean([np.corrcoef(ours[i], ref[i])[0, 1] for i in range(len(ids))])
        assert corr >= floor, (fmt, corr)


def test_packed_formats_give_a_row_the_same_result_at_any_batch_size(
    smollm2_gguf: GGUFFile,
) -> None:
    """int8 and int4 use one kernel at every row count, so batching cannot change greedy
    output (an older int8 path switched to a float GEMM past 8 rows)."""
    name = "blk.0.ffn_up.weight"
    w = torch.from_numpy(dequantize(smollm2_gguf, name).copy())
    x = torch.randn(16, w.shape[1])
    for lin in (Linear(w, "int8"), Linear(w, "int4", q4_groups(smollm2_gguf, name))):
        alone = torch.cat([lin(x[i : i + 1]) for i in range(16)])
        assert torch.equal(lin(x), alone), lin.kind
