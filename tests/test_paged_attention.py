"""One batched step over the paged pool (scattered block tables, prompt chunks and decode rows
mixed) gives each sequence the logits it gets alone, on torch and on MLX; decode rows are
padded in groups of similar context width."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cgn_infer.backends import paged
from cgn_infer.backends.paged import SHORT_BLOCKS, BatchItem, layout

LENGTHS = (5, 37, 16, 70)
TABLES = ([3, 4, 5, 6, 7], [10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35])


def check(backend: Any, tol: float, lengths: tuple[int, ...] = LENGTHS) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, n).tolist() for n in lengths]
    alone = [backend.forward(p, 0, backend.new_cache(len(p) + 1)) for p in prompts]
    kv = backend.new_kv(40)
    # Step 1: two whole prompts and two prompt heads; step 2: the heads' tails next to
    # single-token (decode-shaped) items for the first two.
    first = [BatchItem(p[:-1], 0, t) for p, t in zip(prompts[:2], TABLES[:2], strict=True)]
    first += [BatchItem(p[:9], 0, t) for p, t in zip(prompts[2:], TABLES[2:], strict=True)]
    backend.forward_batch(first, kv)
    second = [
        BatchItem(p[-1:], len(p) - 1, t) for p, t in zip(prompts[:2], TABLES[:2], strict=True)
    ]
    second += [BatchItem(p[9:], 9, t) for p, t in zip(prompts[2:], TABLES[2:], strict=True)]
    assert len(paged.layout(second).decodes) == 2
    batched = backend.forward_batch(second, kv)
    for want, got in zip(alone, batched, strict=True):
        assert int(got.argmax()) == int(want.argmax())
        assert np.abs(got - want).max() <= tol


@pytest.fixture
def two_decode_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # the decode-shaped rows (1 and 3 blocks) in groups of their own, without the long
    # prompts the real threshold needs (MLX on a Linux CPU takes ~0.2 s per prompt token)
    monkeypatch.setattr(paged, "SHORT_BLOCKS", 1)


def test_torch_paged_batch_equals_alone(smollm2_torch: Any, two_decode_groups: None) -> None:
    """Exactly, by default: the one-call C layers (quantized kernels, paged C attention)
    compute each row the same way whatever the batch and however its prompt was chunked."""
    assert smollm2_torch.weights == "gguf" and smollm2_torch._fused is not None
    check(smollm2_torch, tol=0.0)


def test_one_call_layers_track_the_torch_ops(smollm2_gguf: Any, smollm2_torch: Any) -> None:
    """kernels/layer.c computes what the op-by-op torch path computes, up to rounding (its
    norms sum in double, its silu is libm's): the same logits to 0.999 correlation over a
    prompt and its chunked continuation. A row outside the RoPE table or the pool is refused
    before the kernel reads it."""
    from cgn_infer.backends.torch_backend import TorchBackend
    from cgn_infer.models import args_from_gguf

    ops = TorchBackend(smollm2_gguf, args_from_gguf(smollm2_gguf), threads=2, fused=False)
    assert ops._fused is None
    prompt = np.random.default_rng(3).integers(100, 20000, 40).tolist()
    got = [
        b.forward_batch([BatchItem(prompt, 0, [0, 1, 2])], kv, all_logits=True)
        for b, kv in ((smollm2_torch, smollm2_torch.new_kv(4)), (ops, ops.new_kv(4)))
    ]
    assert np.corrcoef(got[0].ravel(), got[1].ravel())[0, 1] > 0.998  # 0.9990 on float16
    assert (got[0].argmax(-1) == got[1].argmax(-1)).mean() >= 0.9
    kv = smollm2_torch.new_kv(2)
    x = smollm2_torch.embed(layout([BatchItem([5], 0, [0])]))
    paged_rows = (np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.ones(1, np.int64))
    for positions, slots, what in (([0], [32], "KV slots"), ([10**7], [0], "positions")):
        with pytest.raises(ValueError, match=what):
            smollm2_torch._fused.run(
                x.numpy(), np.array(positions), np.array(slots), paged_rows,
                smollm2_torch.kv_pool(kv),
            )  # fmt: skip


def test_every_pool_type_takes_the_one_call_layers(
    smollm2_gguf: Any, smollm2_torch: Any, two_decode_groups: None
) -> None:
    """float16 (the default), bfloat16 and float32 pools all run the one-call layers. K and
    V are rounded to the nearest 16-bit value as layer.c writes them: the first layer's rows
    are exactly the float32 pool's, converted by torch (nothing before them depends on the
    pool). The logits track float32's, and every row is exactly the same batched as alone."""
    import torch

    from cgn_infer.backends.torch_backend import TorchBackend
    from cgn_infer.models import args_from_gguf

    args = args_from_gguf(smollm2_gguf)
    wide = TorchBackend(smollm2_gguf, args, threads=2, kv_dtype="float32")
    narrow = (smollm2_torch, TorchBackend(smollm2_gguf, args, threads=2, kv_dtype="bfloat16"))
    assert [b.kv_dtype for b in narrow] == [torch.float16, torch.bfloat16]
    prompt = np.random.default_rng(3).integers(100, 20000, 40).tolist()
    pools = [b.new_kv(4) for b in (wide, *narrow)]
    got = [
        b.forward_batch([BatchItem(prompt, 0, [0, 1, 2])], kv, all_logits=True)
        for b, kv in zip((wide, *narrow), pools, strict=True)
    ]
    for b, pool, logits in zip(narrow, pools[1:], got[1:], strict=True):
        assert b._fused is not None and pool.k.dtype == pool.v.dtype == b.kv_dtype
        assert torch.equal(pool.k[0, :3], pools[0].k[0, :3].to(b.kv_dtype))
        assert torch.equal(pool.v[0, :3], pools[0].v[0, :3].to(b.kv_dtype))
        # random tokens make jumpy logits: 16-bit K/V move them about as far as float32's
        # op-by-op path does (0.998-0.999)
        assert np.corrcoef(got[0].ravel(), logits.ravel())[0, 1] > 0.995
        assert (got[0].argmax(-1) == logits.argmax(-1)).mean() >= 0.8
    for b in (wide, narrow[1]):  # float16: test_torch_paged_batch_equals_alone
        check(b, tol=0.0)


def test_torch_float32_paged_batch_equals_alone(smollm2_gguf: Any, two_decode_groups: None) -> None:
    from cgn_infer.backends.torch_backend import TorchBackend
    from cgn_infer.models import args_from_gguf

    args = args_from_gguf(smollm2_gguf)
    backend = TorchBackend(smollm2_gguf, args, weights="float32", kv_dtype="float32", threads=2)
    check(backend, tol=1e-3)  # SDPA over gathered blocks: batching moves the last bits


@pytest.mark.slow
def test_mlx_paged_batch_equals_alone(smollm2_mlx: Any, two_decode_groups: None) -> None:
    # shorter prompts, the same shapes (a prompt of one block, prompts over two and three
    # blocks, decode rows in two groups): MLX on a Linux CPU takes ~0.2 s per prompt token
    check(smollm2_mlx, tol=1e-3, lengths=(5, 20, 16, 35))


def test_a_table_too_short_is_an_error(smollm2_torch: Any) -> None:
    with pytest.raises(ValueError, match="needs 2 blocks"):
        smollm2_torch.forward_batch([BatchItem(list(range(20)), 0, [0])], smollm2_torch.new_kv(4))


@pytest.mark.parametrize(
    ("widths", "groups"),
    [
        ((1, 3, 8, 2), [[0, 1, 2, 3]]),  # short contexts pad together
        ((1, 125, 2, 3), [[1], [0, 2, 3]]),  # one long context alone
        ((9, 5, 4), [[0, 1], [2]]),  # over half the widest joins it
        ((40, 20, 21, 10, 11), [[0, 2], [1, 4], [3]]),  # 20 is not over half of 40
        ((64, 64, 1), [[0, 1], [2]]),
    ],
)
def test_decode_rows_group_by_width(widths: tuple[int, ...], groups: list[list[int]]) -> None:
    assert SHORT_BLOCKS == 8
    items = [BatchItem([7], w * 16 - 1, list(range(w))) for w in widths]
    lay = layout(items)
    assert sorted(g.rows.tolist() for g in lay.decodes) == sorted(groups)
    for g in lay.decodes:
        assert g.tables.shape == (len(g.rows), max(widths[r] for r in g.rows))
        assert g.lengths.tolist() == [widths[r] * 16 for r in g.rows]
