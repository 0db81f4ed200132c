"""The direct GGUF reader against the gguf package, and clear errors for bad files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cgn_core.text.gguf_file import GGUFError, GGUFFile
from cgn_infer.models import args_from_gguf
from cgn_infer.quants import dequantize


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> gguf.GGUFReader:
    """The gguf package's own reader (slow to open: once per module)."""
    return gguf.GGUFReader(smollm2_path)


def test_reader_agrees_with_the_gguf_package(
    reference: gguf.GGUFReader, smollm2_gguf: GGUFFile
) -> None:
    ref = reference
    assert set(smollm2_gguf.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        ours = smollm2_gguf.tensors[t.name]
        assert ours.shape == tuple(int(d) for d in reversed(t.shape))
        assert ours.ggml_type == int(t.tensor_type)
        assert ours.offset == t.data_offset and ours.n_bytes == t.n_bytes
    assert smollm2_gguf.get("general.architecture") == "llama"
    assert smollm2_gguf.get("llama.block_count") == 30
    assert len(smollm2_gguf.get("tokenizer.ggml.tokens")) == 49152
    assert (
        smollm2_gguf.get("tokenizer.ggml.merges")[0]
        == ref.fields["tokenizer.ggml.merges"].contents()[0]
    )
    kinds = {i.type_name for i in smollm2_gguf.tensors.values()}
    assert kinds == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"]
)
def test_dequantize_matches_the_gguf_package(
    name: str, reference: gguf.GGUFReader, smollm2_gguf: GGUFFile
) -> None:
    ref = next(t for t in reference.tensors if t.name == name)
    expected = gguf.quants.dequantize(ref.data, ref.tensor_type)
    assert np.array_equal(dequantize(smollm2_gguf, name).reshape(expected.shape), expected)


def write_gguf(path: Path, arch: str = "llama", tensor_type: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tensor_type is None:
        w.add_tensor("t", np.zeros((4, 32), dtype=np.float32))
    else:  # raw bytes standing in for one block row of `tensor_type`
        qt = gguf.GGMLQuantizationType(tensor_type)
        _, size = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor("t", np.zeros((1, size), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_and_unsupported_tensor_types_name_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(
        GGUFError, match=r"tensor t has ggml type #16, which this reader does not know"
    ):
        GGUFFile(write_gguf(tmp_path / "iq.gguf", tensor_type=16))  # IQ2_XXS
    q8k = r"tensor t is Q8_K, which cgn-infer cannot load \(supported: F32"
    with (
        GGUFFile(write_gguf(tmp_path / "q8k.gguf", tensor_type=15)) as f,  # Q8_K
        pytest.raises(GGUFError, match=q8k),
    ):
        dequantize(f, "t")


def test_unsupported_architecture(tmp_path: Path) -> None:
    with (
        GGUFFile(write_gguf(tmp_path / "m.gguf", arch="mamba")) as f,
        pytest.raises(
            GGUFError, match=r"architecture 'mamba' is not supported \(supported: llama, qwen2\)"
        ),
    ):
        args_from_gguf(f)


def test_not_gguf_truncated_empty_missing(tmp_path: Path, smollm2_path: Path) -> None:
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(tmp_path / "text.gguf")
    (tmp_path / "cut.gguf").write_bytes(smollm2_path.read_bytes()[:200_000])
    with pytest.raises(GGUFError, match=r"truncated or corrupt|runs past the end"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file"):
        GGUFFile(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match="cannot open model file"):
        GGUFFile(tmp_path / "missing.gguf")


def test_serve_with_a_bad_model_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    res = subprocess.run(
        [str(Path(sys.executable).parent / "cgn-infer"), "serve", "--model", str(bad), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert f"error: {bad}: not a GGUF file" in res.stderr and "Traceback" not in res.stderr
