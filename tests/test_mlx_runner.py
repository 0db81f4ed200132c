"""The mlx_lm runner's pure parts: GGUF → Hugging Face names, llama's q/k un-permutation, the
quantization table, the served-name link, and its /metrics page read by the vocabulary table.
(The whole runner, conversion included, serves real requests in tests/test_mixed_fleet.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cgn_agent.launchers.mlx_convert import _quantization, hf_name, unpermute
from cgn_agent.launchers.mlx_lm_server import Counters, link_name
from cgn_core.engine_metrics import in_flight, name_map, parse_samples
from cgn_core.errors import CognitoraError


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
        ("blk.12.attn_output.biases", "model.layers.12.self_attn.o_proj.biases"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("rope_freqs.weight", None),  # MLX computes its own
        ("blk.0.attn_q", None),
    ],
)
def test_llama_cpp_names_map_to_hugging_face_names(gguf: str, hf: str | None) -> None:
    assert hf_name(gguf) == hf


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (convert_hf_to_gguf.py's permute)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(9 * 64, 576), (3 * 64, 18), (9 * 64,)])
def test_unpermute_inverts_llama_cpps_rotary_interleaving(shape: tuple[int, ...]) -> None:
    """On weights, packed quantized rows, scales and bias vectors alike (rows only move)."""
    heads = shape[0] // 64
    w = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    assert np.array_equal(unpermute(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, heads), w)


def test_the_quantization_table_names_only_layers_that_differ() -> None:
    bits = {"model.embed_tokens": 8, "model.layers.0.mlp.up_proj": 4, "lm_head": 4}
    assert _quantization(bits) == {
        "group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}
    }  # fmt: skip
    assert _quantization({"a": 8, "b": 8})["bits"] == 8


def test_the_served_name_links_in_the_replica_dir_and_never_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, replica = tmp_path / "converted", tmp_path / "replica"
    model.mkdir()
    replica.mkdir()
    monkeypatch.chdir(replica)
    link_name("org/smol", str(model))
    assert Path("org/smol").resolve() == model.resolve()
    link_name("org/smol", str(model))  # again (a restart): replaced, not an error
    for bad in ("../escape", "/etc/x", ""):
        with pytest.raises(CognitoraError):
            link_name(bad, str(model))


def test_the_runners_metrics_page_reads_in_the_mlx_lm_vocabulary() -> None:
    c = Counters()
    c.add(running=2, prompt_tokens=30, prompt_cached=12, generation_tokens=7)
    c.add(running=-1, requests=1)
    names = name_map("mlx_lm")
    page = c.page()
    assert in_flight(page, names) == 1  # running; it publishes no waiting figure
    got = parse_samples(page, {*names.prompt_tokens, *names.generation_tokens, *names.prefix_hits})
    assert got == {"mlx_lm:prompt_tokens_total": 30, "mlx_lm:generation_tokens_total": 7,
                   "mlx_lm:prompt_tokens_cached_total": 12}  # fmt: skip
