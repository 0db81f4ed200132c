"""cgn-infer's C kernels on GGUF's own blocks: exact unpacking, products that track float32,
results independent of the batch, the build cache, and the dequantized fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cgn_core.text.gguf_file import GGUFFile
from cgn_infer import kernels
from cgn_infer.backends.fused import FusedLayers
from cgn_infer.backends.paged import BatchItem, layout
from cgn_infer.backends.quantized import QuantMatrix
from cgn_infer.backends.torch_backend import Linear, TorchBackend
from cgn_infer.kernels.isa import ISAS, cpu_features
from cgn_infer.models import args_from_gguf
from cgn_infer.quants import dequantize
from cgn_infer.weights import RawPart

K, N = 512, 24


@pytest.fixture(scope="module")
def lib() -> kernels.Kernels:
    loaded = kernels.load()
    assert loaded is not None, kernels.failure()
    return loaded


def _blocks(qtype: Q, seed: int, n: int = N, k: int = K) -> np.ndarray:
    """[n, bytes per row] of `qtype`: quantized with gguf-py where it can, else random bits
    with sane float16 scales (the K-quants, which gguf-py only dequantizes)."""
    rng = np.random.default_rng(seed)
    try:
        return np.asarray(gguf.quants.quantize(rng.standard_normal((n, k), np.float32), qtype))
    except NotImplementedError:
        pass
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (n, k // values, 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d and dmin lead the block
        raw[..., 0:4] = scales.reshape(n, k // values, 4)
    else:  # Q6_K: d closes it
        raw[..., size - 2 : size] = scales[..., :2].reshape(n, k // values, 2)
    return raw.reshape(n, -1)


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _matrix(lib: kernels.Kernels, *parts: tuple[Q, np.ndarray]) -> QuantMatrix:
    return QuantMatrix(
        lib, [RawPart(f"w{i}", t.name, rows, K) for i, (t, rows) in enumerate(parts)]
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_unpack_exactly_as_gguf_dequantizes_them(lib: kernels.Kernels, qtype: Q) -> None:
    rows = _blocks(qtype, 1)
    ref = gguf.quants.dequantize(rows, qtype).reshape(N, K)
    ids = torch.tensor([5, 0, N - 1, 5])
    assert torch.equal(_matrix(lib, (qtype, rows)).rows(ids), torch.from_numpy(ref[ids.numpy()]))
    with pytest.raises(IndexError):
        _matrix(lib, (qtype, rows)).rows(torch.tensor([N]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_track_float32_and_ignore_the_batch(lib: kernels.Kernels, qtype: Q) -> None:
    rows = _blocks(qtype, 2)
    w = torch.from_numpy(gguf.quants.dequantize(rows, qtype).reshape(N, K).astype(np.float32))
    m = _matrix(lib, (qtype, rows))
    x = torch.randn(20, K)  # over 16 rows: the unpacked tiles; up to 16: straight from blocks
    y, ref = m(x), x @ w.T
    corr = np.corrcoef(y.flatten().numpy(), ref.flatten().numpy())[0, 1]
    assert corr > 0.9999 and (y - ref).abs().max() / ref.abs().max() < 0.02, corr
    alone = torch.cat([m(x[i : i + 1]) for i in range(20)])
    assert torch.equal(y, alone)  # one row's arithmetic whatever the batch
    assert torch.equal(m(x[:7]), y[:7])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_are_exact_where_the_activations_quantize_losslessly(
    lib: kernels.Kernels, qtype: Q
) -> None:
    """Activations that are int8 times a power of two, with 127 in every block, quantize
    without error; then each product is the exact sum up to float32 rounding (1e-5 here),
    so one wrong value, scale or min anywhere in a row shows as a whole quantization step."""
    rows = _blocks(qtype, 5)
    w = gguf.quants.dequantize(rows, qtype).reshape(N, K).astype(np.float64)
    rng = np.random.default_rng(6)
    q = rng.integers(-127, 128, (20, K))
    q[:, ::32] = 127  # every 32-value group (so every block of 256 too) reaches 127
    x = torch.from_numpy((q * 2.0**-7).astype(np.float32))
    y = _matrix(lib, (qtype, rows))(x).numpy().astype(np.float64)
    ref = x.numpy().astype(np.float64) @ w.T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_prompt_products_in_passes_and_row_blocks_equal_rows_alone(
    lib: kernels.Kernels, qtype: Q
) -> None:
    """A K-quant product of many rows takes its activation rows a pass at a time (as many
    as stay in L2: 24 rows of 8,192 values) and its weight rows in blocks of 8: 53 rows (two
    passes and a part, the last chunk short) against 13 weight rows (a block and a part)
    must equal every row alone, and the exact sum where the activations quantize losslessly."""
    n, k, m = 13, 8192, 53
    rows = _blocks(qtype, 7, n, k)
    w = gguf.quants.dequantize(rows, qtype).reshape(n, k).astype(np.float64)
    q = np.random.default_rng(8).integers(-127, 128, (m, k))
    q[:, ::32] = 127
    x = torch.from_numpy((q * 2.0**-7).astype(np.float32))
    mat = QuantMatrix(lib, [RawPart("w", qtype.name, rows, k)])
    y = mat(x)
    assert torch.equal(y, torch.cat([mat(x[i : i + 1]) for i in range(m)]))
    ref = x.numpy().astype(np.float64) @ w.T
    err = np.abs(y.numpy().astype(np.float64) - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), err


def _llamacpp_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, ...]:
    """ggml's quantize_row_q8_1 (block 32) and quantize_row_q8_K (block 256), in numpy."""
    v = x.reshape(-1, block)
    with np.errstate(over="ignore"):
        return _q8(v, block, x.shape)


def _q8(v: np.ndarray, block: int, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    if block == 32:
        amax = np.abs(v).max(axis=1)
        d = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(
            np.float32
        )
    else:
        big = v[np.arange(len(v)), np.abs(v).argmax(axis=1)]
        inv = np.where(big != 0, np.float32(-127) / np.where(big != 0, big, 1), 0).astype(
            np.float32
        )
        d = np.where(inv != 0, np.float32(1) / np.where(inv != 0, inv, 1), 0).astype(np.float32)
    inv[~np.isfinite(inv)] = d[~np.isfinite(inv)] = 0  # subnormal blocks: zeros
    q = np.minimum(np.rint(v * inv[:, None]), 127).astype(np.int8).reshape(-1, 32)
    d = np.repeat(d, block // 32).astype(np.float32)
    s = q.astype(np.int32).sum(axis=1).astype(np.float32)  # q8_K's bsums (per 32 here)
    if block == 32:  # q8_1 keeps d and s = d * sum in float16
        d, s = (a.astype(np.float16).astype(np.float32) for a in (d, d * s))
    return q.reshape(shape), d, s


@pytest.mark.parametrize("block", [32, 256])
def test_activations_are_quantized_as_llamacpp_stores_them(
    lib: kernels.Kernels, block: int
) -> None:
    """The int8 activations, their scales and sums match ggml's own blocks for the weight
    type (Q4_0..Q8_0 meet q8_1/q8_0 with float16 scales, the K-quants q8_K with float32),
    including rows of zeros, scales below float16's smallest subnormal and subnormal inputs."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, K)) * rng.choice([1e-9, 1e-5, 1.0, 300.0], (5, 1))
    x = x.astype(np.float32)
    x[2] = 0.0
    x[3, :block] *= np.float32(1e-30)
    got = [
        np.empty((5, K), np.int8),
        np.empty((5, K // 32), np.float32),
        np.empty((5, K // 32), np.float32),
    ]
    lib.lib.cgn_quantize_rows(x.ctypes.data, 5, K, block, *(a.ctypes.data for a in got))
    for mine, ref in zip(got, _llamacpp_activations(x, block), strict=True):
        np.testing.assert_array_equal(mine.reshape(-1), ref.reshape(-1))


def test_parts_of_different_types_fill_their_own_columns(lib: kernels.Kernels) -> None:
    a, b = _blocks(Q.Q5_0, 3), _blocks(Q.Q8_0, 4)
    x = torch.randn(3, K)
    fused = _matrix(lib, (Q.Q5_0, a), (Q.Q8_0, b))(x)
    assert fused.shape == (3, 2 * N) and fused.is_contiguous()
    assert torch.equal(fused[:, :N], _matrix(lib, (Q.Q5_0, a))(x))
    assert torch.equal(fused[:, N:], _matrix(lib, (Q.Q8_0, b))(x))


def test_the_library_is_rebuilt_when_its_cache_file_is_corrupt_or_its_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CGN_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "PREBUILT", tmp_path / "none")  # none prebuilt here
    compiler = kernels.compiler()
    assert compiler is not None
    path = kernels.library_path(compiler, kernels.current().isa)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")  # e.g. a crash mid-write by an older version
    loaded = kernels.load()
    assert loaded is not None and loaded.path == path and path.read_bytes()[:4] == b"\x7fELF"
    source = tmp_path / "layer.c"  # a new engine version: another library, not the old one
    source.write_text(kernels.SOURCES[-1].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(kernels, "SOURCES", (*kernels.SOURCES[:-1], source))
    assert kernels.library_path(compiler, kernels.current().isa) != path


def test_no_compiler_means_dequantized_weights_not_a_failure(
    smollm2_gguf: GGUFFile,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "PREBUILT", tmp_path / "none")  # none prebuilt here
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        backend = TorchBackend(smollm2_gguf, args_from_gguf(smollm2_gguf), threads=2)
    assert backend.weights == "float32" and isinstance(backend.w.layers[0].wo, Linear)
    assert "weights dequantized to float32" in caplog.text


def test_prebuilt_kernels_load_with_no_compiler_and_a_cpu_without_them_builds_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`python -m cgn_infer.kernels` (at install) builds this CPU's path into the package's
    prebuilt/; an engine then loads it with no compiler at all (CC names none: had it
    compiled, loading would have failed). Without a prebuilt path, the engine builds its own
    into the cache and says why in its log."""
    from cgn_infer.kernels.__main__ import main

    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    monkeypatch.setattr(kernels, "PREBUILT", prebuilt)
    monkeypatch.setenv("CGN_KERNEL_CACHE", str(cache))
    assert main([]) == 0
    here = kernels.current().isa
    assert [p.name for p in prebuilt.iterdir()] == [kernels.prebuilt_path(here).name]
    monkeypatch.setenv("CC", "/nonexistent/cc")
    for name in ("_loaded", "_failure"):
        monkeypatch.setattr(kernels, name, None)
    loaded = kernels.load()
    assert loaded is not None and loaded.path == kernels.prebuilt_path(here), kernels.failure()
    assert not cache.exists()  # nothing compiled
    kernels.prebuilt_path(here).unlink()  # another CPU's install: no prebuilt path for it
    monkeypatch.delenv("CC")
    for name in ("_loaded", "_failure"):
        monkeypatch.setattr(kernels, name, None)
    with caplog.at_level(logging.INFO, logger="cgn_infer.kernels"):
        loaded = kernels.load()
    assert loaded is not None and loaded.path.parent == cache
    assert f"no prebuilt kernels for the {here.name} path" in caplog.text


def _with_f16_matrix(src: Path, dst: Path, name: str) -> Path:
    """A copy of GGUF `src` with tensor `name` stored as F16 (a type without a kernel)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name == name:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_type_without_a_kernel_loads_dequantized_with_a_log_line(
    smollm2_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _with_f16_matrix(smollm2_path, tmp_path / "mixed.gguf", "blk.0.ffn_down.weight")
    with GGUFFile(path) as g, caplog.at_level(logging.INFO):
        backend = TorchBackend(g, args_from_gguf(g), threads=2)
        down = backend.w.layers[0].w_down
        assert isinstance(down, Linear) and down.kind in ("float32", "onednn")
        assert isinstance(backend.w.layers[0].wo, QuantMatrix)
        assert isinstance(backend.w.layers[1].w_down, QuantMatrix)
        x = torch.randn(2, down_in := g.tensors["blk.0.ffn_down.weight"].shape[-1])
        ref = x @ torch.from_numpy(dequantize(g, "blk.0.ffn_down.weight")).T
        assert down_in == 1536 and torch.allclose(down(x), ref, rtol=1e-4, atol=1e-4)
    assert "no quantized kernel for F16 (1 parts)" in caplog.text


@pytest.mark.skipif(
    not ISAS["avx512vnni"].needs <= cpu_features(), reason="this CPU has no AVX-512 VNNI"
)
def test_the_vnni_path_computes_the_avx2_paths_bits(
    smollm2_torch: TorchBackend, tmp_path: Path
) -> None:
    """avx512vnni makes avx2's integer sums in one instruction and keeps its 256-bit float
    code: every type's products (up to 16 rows straight from the blocks, more in tiles) and
    whole layers (norms, RoPE, the float16 KV write, attention) are the same bits."""
    vnni, avx2 = (
        kernels.build(ISAS[isa], tmp_path / f"{isa}.so") for isa in ("avx512vnni", "avx2")
    )
    x = torch.randn(20, K)
    for qtype in TYPES:
        rows = _blocks(qtype, 3)
        y = [_matrix(lib, (qtype, rows)) for lib in (vnni, avx2)]
        assert torch.equal(y[0](x), y[1](x)) and torch.equal(y[0](x[:3]), y[1](x[:3])), qtype
    b = smollm2_torch
    prompt = np.random.default_rng(4).integers(100, 20000, 20)
    x = b.embed(layout([BatchItem(prompt.tolist(), 0, [0, 1])]))
    paged = (np.array([[0, 1]]), np.zeros(20, np.int64), np.arange(1, 21, dtype=np.int64))
    out = []
    for lib in (vnni, avx2):
        kv = b.new_kv(2)
        layers = FusedLayers(lib, b.args, b.w.layers, torch.view_as_real(b.rope).numpy())
        run = layers.run(x.numpy(), np.arange(20), np.arange(20), paged, b.kv_pool(kv))
        out.append((torch.from_numpy(run), kv))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1].k, out[1][1].k)
