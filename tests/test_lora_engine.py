"""cgn-infer serves LoRA adapters (#60): per row in its C layers, checked against llama.cpp
with the same adapter files, mixed in one batch, named in `model`, in a KV namespace of
their own, and reached through the router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cgn_core.bundled_models import smollm2
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.adapters import Adapters
from cgn_infer.backends.paged import BatchItem, blocks_for
from cgn_infer.models import args_from_gguf
from harness.lora import write_adapter
from harness.metrics import metric
from harness.parity import PROMPTS, reference_top2
from harness.procs import cgn_infer, cgn_router, llamacpp

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# llama.cpp's margin under which its own Q8 activations decide the order (as for the base:
# tests/test_llamacpp_parity.py's NEAR_TIE_NATS)
NEAR_TIE_NATS = 0.4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of every matrix cgn-infer adapts, strong enough to change the greedy
    answers (std 0.05: visibly other text, not noise)."""
    tmp = tmp_path_factory.mktemp("lora")
    return {
        name: write_adapter(smollm2(), tmp / f"{name}.gguf", targets=TARGETS, std=0.05, seed=seed)
        for name, seed in (("a1", 1), ("a2", 2))
    }


@pytest.fixture(scope="module")
def adapted(smollm2_torch: Any, files: dict[str, Path]) -> Iterator[tuple[Any, Adapters]]:
    """The session's SmolLM2 backend with both adapters loaded (rows without one, as every
    other test's, run as before), unloaded again at the end."""
    gguf = GGUFFile(smollm2())
    args = args_from_gguf(gguf)
    adapters = Adapters("smol", gguf.path, args, args.n_layers)
    for name, path in files.items():
        adapters.load(name, path)
    smollm2_torch.set_lora(adapters.tables)
    try:
        yield smollm2_torch, adapters
    finally:
        smollm2_torch.set_lora([[] for _ in adapters.tables])
        gguf.close()


def logits(backend: Any, items: list[tuple[list[int], tuple[int, float] | None]]) -> np.ndarray:
    """Every position's logits of one batch of (prompt, adapter slot and scale)."""
    kv = backend.new_kv(sum(blocks_for(len(ids)) for ids, _ in items))
    batch, first = [], 0
    for ids, lora in items:
        n = blocks_for(len(ids))
        batch.append(BatchItem(ids, 0, list(range(first, first + n)), lora))
        first += n
    out: np.ndarray = backend.forward_batch(batch, kv, all_logits=True)
    return out


@pytest.mark.slow
def test_an_adapted_model_agrees_with_llama_cpp_with_the_same_adapter(
    adapted: tuple[Any, Adapters], files: dict[str, Path], smollm2_gguf: GGUFFile
) -> None:
    """Teacher-forced, every position of held prompts: where llama.cpp (the adapter applied
    at start) is decisive, cgn-infer's top token is its; and the adapter changes answers
    (else this would pass with adapters ignored)."""
    backend, adapters = adapted
    tokenizer = GGUFTokenizer(smollm2_gguf)
    for name, path in files.items():
        slot = adapters.resolve(name, 1.0)
        agree = decisive = total = changed = 0
        with llamacpp(smollm2(), threads=1, ctx=512, lora=[path]) as url:
            for prompt in PROMPTS:
                ids = tokenizer.encode(prompt)
                ours = logits(backend, [(ids, slot)])
                base = logits(backend, [(ids, None)])
                changed += int((ours.argmax(-1) != base.argmax(-1)).sum())
                for k in range(2, len(ids) + 1):
                    ref = reference_top2(url, ids[:k])
                    if ref is None:
                        continue
                    same = int(ours[k - 1].argmax() == ref[0])
                    agree, total = agree + same, total + 1
                    if ref[1] >= NEAR_TIE_NATS:
                        assert same, f"{name}: position {k} of {prompt!r}, margin {ref[1]:.2f}"
                        decisive += 1
        print(f"{name}: top-1 agreement {agree}/{total}, {decisive} decisive; {changed} "
              "positions' top token changed by the adapter")  # fmt: skip
        assert total >= 40 and decisive >= 25 and agree / total >= 0.9 and changed >= 5


def test_base_and_two_adapters_in_one_batch_give_what_each_gives_alone(
    adapted: tuple[Any, Adapters], smollm2_gguf: GGUFFile
) -> None:
    """Each row with its own adapter (or none) in one step: exactly its logits alone; a
    scale of 0 is the base, exactly."""
    backend, adapters = adapted
    tokenizer = GGUFTokenizer(smollm2_gguf)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    loras = [None, adapters.resolve("a1", 1.0), adapters.resolve("a2", 0.5)]
    together = logits(backend, list(zip(ids, loras, strict=True)))
    rows = np.cumsum([0, *(len(i) for i in ids)])
    for i, (prompt, lora) in enumerate(zip(ids, loras, strict=True)):
        alone = logits(backend, [(prompt, lora)])
        assert np.array_equal(together[rows[i] : rows[i + 1]], alone), i
    zero = logits(backend, [(ids[0], adapters.resolve("a1", 0.0))])
    assert np.array_equal(zero, together[: rows[1]])


@pytest.fixture(scope="module")
def engine(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lora-engine")
    loras = [a for name, path in files.items() for a in ("--lora", f"{name}={path}")]
    with cgn_infer(tmp, *loras, "--threads", "1", "--model-name", "smol", model=smollm2()) as url:
        yield url


def complete(url: str, model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.slow
def test_the_engine_serves_adapters_by_name_each_in_its_own_kv(engine: str, tmp_path: Path) -> None:
    listed = httpx.get(engine + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        ("smol", None), ("a1", "smol"), ("a2", "smol")
    ]  # fmt: skip
    prompt = "The history of the printing press " * 4  # a few blocks
    base = complete(engine, "smol", prompt)
    one = complete(engine, "a1", prompt)
    assert one["model"] == "a1" and one["choices"][0]["text"] != base["choices"][0]["text"]
    # no block of the base's is the adapter's: nothing cached the first time, then its own
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(engine, "a1", prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"] == one["choices"]
    two = complete(engine, "a2", prompt)
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (
        complete(engine, "a1", prompt, lora_scale=0)["choices"][0]["text"]
        == (base["choices"][0]["text"])
    )
    for body, status, param in (
        ({"model": "a3"}, 404, "model"),
        ({"model": "a1", "lora_scale": 5}, 400, "lora_scale"),
        ({"model": "smol", "lora_scale": 0.5}, 400, "lora_scale"),
        ({"model": "a1", "lora": []}, 400, "lora"),  # unsupported: ids are llama.cpp's
    ):
        r = httpx.post(engine + "/v1/completions", json={"prompt": "x", **body}, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    # Through the router: the name as the model, the scale passed on
    endpoint = {"url": engine, "model": "smol", "adapters": ["a2", "a1"]}
    config = {"models": {"smol": {"adapters": ["a1", "a2"], "tokenizer": str(smollm2())}},
              "endpoints": {"e": endpoint}}  # fmt: skip
    with cgn_router(tmp_path, config) as router:
        routed = complete(router.url, "a1", prompt)
        assert routed["choices"] == one["choices"]
        scaled = complete(router.url, "a1", prompt, lora_scale=0)
        assert scaled["choices"][0]["text"] == base["choices"][0]["text"]
        # usage per adapter (and tenant): both requests' completions
        labels = {"model": "smol", "adapter": "a1", "tenant": "anonymous"}
        done = routed["usage"]["completion_tokens"] + scaled["usage"]["completion_tokens"]
        got = metric(router.admin, "cgn_router_adapter_tokens_total", **labels, kind="completion")
        assert got == done
