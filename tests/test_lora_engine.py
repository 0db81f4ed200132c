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
from cgn_core.errors import InvalidRequest, Unavailable
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.tokenizer import GGUFTokenizer
from cgn_infer.adapters import Adapters
from cgn_infer.backends.paged import BatchItem, blocks_for
from cgn_infer.models import args_from_gguf
from harness.lora import write_adapter, write_peft
from harness.metrics import metric
from harness.parity import PROMPTS, reference_top2
from harness.poll import until
from harness.procs import cgn_infer, cgn_infer_engines, cgn_router, llamacpp

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
    adapters.load("p1", write_peft(smollm2(), files["a1"], files["a1"].parent / "p1"))
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
    # a1 as a PEFT directory (HF's names and q/k row order): the same adapter, exactly
    assert np.array_equal(logits(backend, [(ids[1], adapters.resolve("p1", 1.0))]),
                          together[rows[1] : rows[2]])  # fmt: skip


@pytest.fixture(scope="module")
def engine(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lora-engine")
    loras = [a for name, path in files.items() for a in ("--lora", f"{name}={path}")]
    dirs = f"lora_dirs={files['a1'].parent}"  # where run-time loads may read from
    sets = ("--set", dirs, "--set", "max_loras=3", "--threads", "1", "--model-name", "smol")
    with cgn_infer(tmp, *loras, *sets, model=smollm2()) as url:
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
    config = {"models": {"smol": {"adapters": {"a1": "", "a2": ""}, "tokenizer": str(smollm2())}},
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


def test_adapters_load_and_unload_at_run_time_least_recently_used_out(
    engine: str, files: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's paths and bodies; the start's adapters are pinned, a full set evicts the least
    recently used one nothing holds; a bad file, a path outside lora_dirs, a name taken: a
    clear refusal, and the engine keeps serving."""
    here = files["a1"].parent
    for i in (3, 4):
        write_adapter(smollm2(), here / f"a{i}.gguf", targets=("attn_q", "attn_v"), seed=i)

    def post(path: str, **body: Any) -> httpx.Response:
        return httpx.post(engine + path, json=body, timeout=60)

    def loaded() -> set[str]:
        return {m["id"] for m in httpx.get(engine + "/v1/models", timeout=30).json()["data"]}

    ok = post("/v1/load_lora_adapter", lora_name="a3", lora_path=str(here / "a3.gguf"))
    assert ok.status_code == 200 and "a3" in ok.text and loaded() == {"smol", "a1", "a2", "a3"}
    assert complete(engine, "a3", "Hello")["model"] == "a3"
    assert metric(engine, "cgn_infer_lora_loaded", model_name="smol", adapter="a3") == 1
    # a full set: a3 (not pinned, idle) makes room for a4
    assert post("/v1/load_lora_adapter", lora_name="a4", lora_path=str(here / "a4.gguf")).is_success
    assert loaded() == {"smol", "a1", "a2", "a4"}
    assert metric(engine, "cgn_infer_lora_evictions_total", model_name="smol") == 1
    assert metric(engine, "cgn_infer_lora_load_seconds_count", model_name="smol") == 2
    (here / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for body, status, words in (
        ({"lora_name": "a5", "lora_path": str(here / "junk.gguf")}, 400, "corrupt"),
        ({"lora_name": "a5", "lora_path": str(smollm2())}, 403, "lora_dirs"),
        ({"lora_name": "a5", "lora_path": "/etc/passwd"}, 403, "lora_dirs"),
        ({"lora_name": "a4", "lora_path": str(here / "a3.gguf")}, 400, "already been loaded"),
        ({"lora_name": "smol", "lora_path": str(here / "a3.gguf")}, 400, "model's own"),
        ({"lora_name": "../x", "lora_path": str(here / "a3.gguf")}, 400, "lora_name"),
        ({"lora_name": "a5", "lora_path": str(here / "a3.gguf"), "x": 1}, 400, "unsupported"),
    ):
        r = post("/v1/load_lora_adapter", **body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert post("/v1/load_lora_adapter", lora_name="a5", lora_path=str(here / "a3.gguf")).is_success
    assert loaded() == {"smol", "a1", "a2", "a5"}  # a4, idle, went
    assert post("/v1/unload_lora_adapter", lora_name="a5").is_success
    r = post("/v1/unload_lora_adapter", lora_name="a5")
    assert r.status_code == 404 and loaded() == {"smol", "a1", "a2"}
    assert complete(engine, "smol", "Hello")["choices"][0]["text"]  # serving throughout
    peft = write_peft(smollm2(), here / "a3.gguf", here / "a7-peft")  # a PEFT directory too
    assert post("/v1/load_lora_adapter", lora_name="a7", lora_path=str(peft)).is_success
    assert complete(engine, "a7", "Hello")["model"] == "a7"
    # The router loads an adapter no replica holds, once, on the replica, and routes to it
    adapters = {"a1": "", "a2": "", "a6": str(here / "a3.gguf")}
    config = {"models": {"smol": {"adapters": adapters, "tokenizer": str(smollm2())}},
              "endpoints": {"e": {"url": engine, "model": "smol", "adapters": ["a2", "a1"]}}}  # fmt: skip
    with cgn_router(tmp_path, config) as router:
        for _ in range(2):
            assert complete(router.url, "a6", "Hello")["model"] == "a6"
        loads = metric(router.admin, "cgn_router_adapter_loads_total", model="smol",
                       result="loaded")  # fmt: skip
        assert loads == 1 and "a6" in loaded()


def test_a_full_set_of_pinned_or_held_adapters_refuses_a_load(
    files: dict[str, Path], smollm2_gguf: GGUFFile
) -> None:
    args = args_from_gguf(smollm2_gguf)
    adapters = Adapters("smol", smollm2(), args, args.n_layers, slots=2)
    adapters.load("a1", files["a1"], pin=True)
    adapters.load("a2", files["a2"])
    adapters.acquire("a2", 1.0)  # a request holds it
    with pytest.raises(Unavailable, match="pinned or serving a request"):
        adapters.install("a3", adapters.read(files["a1"]))
    with pytest.raises(InvalidRequest, match="serving 1 request"):
        adapters.unload("a2")
    with pytest.raises(InvalidRequest, match="pinned"):
        adapters.unload("a1")
    adapters.release("a2")
    _, evicted = adapters.install("a3", adapters.read(files["a1"]))
    assert evicted == "a2" and set(adapters.listing()) == {"a1", "a3"}
    assert adapters.resolve("a3", 0.5) == (1, 0.5)  # a2's slot, emptied and reused


def test_requests_go_where_their_adapter_is_and_load_where_it_is_not(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """Two sim engines (a load takes 0.3 s, modelled): an adapter is loaded once, on one
    replica, and its requests follow it there; another adapter goes to the other replica
    (it holds fewer)."""
    sim = ("--backend", "sim", "--engines", "2", "--speed", "20", "--model-name", "smol",
           "--set", "max_loras=1", "--set", "sim.lora_load_s=0.3",
           "--set", f"lora_dirs={files['a1'].parent}")  # fmt: skip
    with cgn_infer_engines(tmp_path, 1, *sim) as engines:
        endpoints = {f"e{i}": {"url": e.url, "model": "smol"} for i, e in enumerate(engines)}
        adapters = {name: str(path) for name, path in files.items()}
        config = {"models": {"smol": {"adapters": adapters, "tokenizer": str(smollm2())}},
                  "endpoints": endpoints}  # fmt: skip
        with cgn_router(tmp_path, config) as router:

            def where(model: str) -> str:
                r = httpx.post(router.url + "/v1/completions", timeout=60,
                               json={"model": model, "prompt": "Hi", "max_tokens": 2})  # fmt: skip
                assert r.status_code == 200, r.text
                return r.headers["x-cognitora-endpoint"]

            first = where("a1")
            assert {where("a1") for _ in range(4)} == {first}  # it stays where it is loaded
            second = where("a2")
            assert second != first  # the other replica held fewer adapters
            loads = metric(router.admin, "cgn_router_adapter_loads_total", model="smol",
                           result="loaded")  # fmt: skip
            assert loads == 2


def test_a_full_replica_makes_room_by_its_least_asked_for_adapter(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """One engine with two slots: a1 asked for 3 times, then a2 once. A third adapter
    unloads a2, asked for least, where the engine's own LRU would have evicted a1."""
    here = files["a1"].parent
    sim = ("--backend", "sim", "--speed", "20", "--model-name", "smol",
           "--set", "max_loras=2", "--set", "sim.lora_load_s=0.1", "--set", f"lora_dirs={here}")  # fmt: skip
    with cgn_infer_engines(tmp_path, 1, *sim) as [engine]:
        adapters = {"a1": str(files["a1"]), "a2": str(files["a2"]), "a3": str(files["a1"])}
        config = {"models": {"smol": {"adapters": adapters, "tokenizer": str(smollm2())}},
                  "endpoints": {"e": {"url": engine.url, "model": "smol"}}}  # fmt: skip
        with cgn_router(tmp_path, config) as router:
            for model in ("a1", "a1", "a1", "a2"):
                assert complete(router.url, model, "Hi")["model"] == model

            def scraped() -> bool:  # the router knows the engine is full
                [ep] = httpx.get(router.admin + "/endpoints", timeout=10).json()["endpoints"]
                return bool(ep["adapter_slots"] == 2 and ep["adapters"] == ["a1", "a2"])

            until("the router to scrape the engine's slots", scraped, timeout_s=20)
            assert complete(router.url, "a3", "Hi")["model"] == "a3"
            held = {
                m["id"] for m in httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
            }
            assert held == {"smol", "a1", "a3"}
            assert metric(engine.url, "cgn_infer_lora_evictions_total", model_name="smol") == 0
