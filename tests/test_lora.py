"""LoRA adapters as llama.cpp's GGUF files (#60, part 1): what cgn_core/lora.py accepts and
refuses against a base, and that real llama.cpp loads the adapters the tests write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cgn_core.bundled_models import qwen_coder_05b, smollm2
from cgn_core.lora import LoraError, check, load
from harness.lora import write_adapter, write_peft
from harness.procs import cgn_router, llamacpp

RANK = 8


def test_an_adapter_of_the_base_is_read_with_its_pairs_and_scale(tmp_path: Path) -> None:
    path = write_adapter(smollm2(), tmp_path / "a.gguf", rank=RANK, layers=(0, 3))
    adapter = check(path, smollm2())
    assert adapter.architecture == "llama" and adapter.rank == RANK
    assert [p.tensor for p in adapter.pairs] == [
        "blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.3.attn_q.weight",
        "blk.3.attn_v.weight",
    ]  # fmt: skip
    q = adapter.pairs[0]
    assert (q.out, q.inputs) == (576, 576) and adapter.pairs[1].out == 192  # 3 KV heads x 64
    assert adapter.scale(RANK) == 2.0 and adapter.scale(RANK, 0.5) == 1.0  # alpha 16 / rank 8
    _, weights = load(path, smollm2())
    a, b = weights["blk.3.attn_v.weight"]
    assert a.shape == (RANK, 576) and b.shape == (192, RANK) and a.dtype.name == "float32"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"arch": "qwen2"}, "is for architecture 'qwen2', its base"),
        ({"transpose_a": True}, "which do not fit its base"),
        ({"drop_b": True}, "has lora_a without its pair"),
        ({"rank": 600}, "has rank 600"),
        ({"std": float("nan")}, "holds a NaN or an infinity"),
    ],
)
def test_an_adapter_that_is_not_one_of_the_base_is_refused_naming_both(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    path = write_adapter(smollm2(), tmp_path / "bad.gguf", layers=(0,), **kw)
    with pytest.raises(LoraError, match=message) as err:
        load(path, smollm2())
    assert str(path) in err.value.message


def test_a_model_file_or_no_file_is_not_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="is not a LoRA adapter"):
        check(smollm2(), smollm2())
    with pytest.raises(LoraError, match="cannot open"):
        check(tmp_path / "missing.gguf", smollm2())
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(LoraError, match="truncated or corrupt"):
        check(tmp_path / "junk.gguf", smollm2())


def complete(url: str, prompt: str, **extra: Any) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "seed": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.slow
def test_real_llama_cpp_loads_the_adapters_the_tests_write(tmp_path: Path) -> None:
    """The files are llama.cpp's format: its server lists the adapter and its answers
    change (large random pairs on every matrix cgn-infer adapts). Loaded unapplied (as the
    agent starts llama.cpp for a model's adapters), it answers as the base until a
    request's `lora` field applies it."""
    targets = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_adapter(smollm2(), tmp_path / "loud.gguf", targets=targets, std=0.2)
    check(path, smollm2())
    prompt = "The capital of France is"
    with llamacpp(smollm2(), threads=1, ctx=512) as base:
        plain = complete(base, prompt)
    with llamacpp(smollm2(), threads=1, ctx=512, lora=[path]) as adapted:
        listed = httpx.get(adapted + "/lora-adapters", timeout=30).json()
        changed = complete(adapted, prompt)
    assert [a["path"] for a in listed] == [str(path)] and listed[0]["scale"] == 1.0
    assert changed != plain
    quiet = write_adapter(smollm2(), tmp_path / "quiet.gguf", seed=1)  # id 0, loud is 1
    with llamacpp(smollm2(), threads=1, ctx=512, lora=[quiet, path], lora_unapplied=True) as lazy:
        assert complete(lazy, prompt, cache_prompt=False) == plain
        assert complete(lazy, prompt, lora=[{"id": 1, "scale": 1.0}]) == changed
        # Through the router: the adapter is a model name; llama.cpp gets its index (and no
        # prompt cache: it reuses one adapter's KV for another's prompt, llama.cpp#26207)
        endpoint = {"url": lazy, "model": "smol", "engine": "llamacpp"}
        config = {
            "models": {
                "smol": {"adapters": {"loud": "", "quiet": ""}, "tokenizer": str(smollm2())}
            },
            "endpoints": {"l": {**endpoint, "adapters": ["quiet", "loud"]}},
        }
        with cgn_router(tmp_path, config) as router:
            _routes_adapters(router.url, prompt, plain, changed)
            for model, candidates in (("loud", ["smol/l"]), ("nope", None)):
                body = {"model": model, "prompt": prompt}
                r = httpx.post(router.admin + "/debug/route", json=body, timeout=30)
                got = [c["id"] for c in r.json()["candidates"]] if candidates else None
                assert (r.status_code, got) == (200 if candidates else 404, candidates)


def _routes_adapters(url: str, prompt: str, plain: str, changed: str) -> None:
    assert complete(url, prompt, model="smol") == plain
    assert complete(url, prompt, model="loud") == changed  # id 1 on this endpoint
    assert complete(url, prompt, model="loud", lora_scale=0) == plain
    listed = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    parents = {m["id"]: m.get("parent") for m in listed}
    assert parents == {"smol": None, "loud": "smol", "quiet": "smol"}
    for extra, status, param in (
        ({"model": "loud", "lora": [{"id": 0, "scale": 1}]}, 400, "lora"),
        ({"model": "smol", "lora_scale": 0.5}, 400, "lora_scale"),
        ({"model": "loud", "lora_scale": 9}, 400, "lora_scale"),
        ({"model": "loud", "lora_scale": True}, 400, "lora_scale"),
        ({"model": "nope"}, 404, "model"),
    ):
        body = {"prompt": prompt, "max_tokens": 2, **extra}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (extra, r.text)


def test_a_peft_directory_reads_as_the_gguf_file_of_the_same_adapter(tmp_path: Path) -> None:
    """PEFT's names and layout (a llama base's q/k B rows as HF keeps them) read into
    llama.cpp's: the same pairs, the same scale, F16 too; rsLoRA's scale is alpha/sqrt(r)."""
    targets = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    gguf = write_adapter(smollm2(), tmp_path / "a.gguf", targets=targets, layers=(0, 5))
    want, pairs = load(gguf, smollm2())
    got, read = load(write_peft(smollm2(), gguf, tmp_path / "peft"), smollm2())
    assert (got.pairs, got.alpha, got.rank) == (want.pairs, want.alpha, want.rank)
    for tensor, (a, b) in pairs.items():
        assert np.array_equal(read[tensor][0], a) and np.array_equal(read[tensor][1], b), tensor
    half = load(write_peft(smollm2(), gguf, tmp_path / "f16", dtype="F16"), smollm2())[1]
    a16 = pairs["blk.0.attn_q.weight"][0].astype(np.float16).astype(np.float32)
    assert np.array_equal(half["blk.0.attn_q.weight"][0], a16)
    rs = check(write_peft(smollm2(), gguf, tmp_path / "rs", use_rslora=True), smollm2())
    assert rs.scale(RANK) == pytest.approx(16 / RANK**0.5)


def test_a_peft_directory_that_is_not_one_of_the_bases_is_refused_by_name(
    tmp_path: Path,
) -> None:
    gguf = write_adapter(smollm2(), tmp_path / "a.gguf", layers=(0,))
    for i, (config, why) in enumerate((
        ({"fan_in_fan_out": True}, "fan_in_fan_out not supported"),
        ({"use_dora": True}, "use_dora not supported"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern not supported"),
        ({"peft_type": "IA3"}, "not a LoRA adapter"),
        ({"r": 0}, "'r' must be a positive number"),
    )):  # fmt: skip
        with pytest.raises(LoraError, match=why):
            check(write_peft(smollm2(), gguf, tmp_path / f"bad{i}", **config), smollm2())
    peft = write_peft(smollm2(), gguf, tmp_path / "p")
    weights = peft / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(LoraError, match="data offsets outside the file"):
        check(peft, smollm2())
    weights.unlink()
    weights.symlink_to(tmp_path / "p" / "adapter_config.json")
    with pytest.raises(LoraError, match="symlink"):
        check(peft, smollm2())
    qwen = write_peft(smollm2(), gguf, tmp_path / "q")
    with pytest.raises(LoraError, match="do not fit its base"):
        check(qwen, qwen_coder_05b())
