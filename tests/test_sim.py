"""The sim backend: eight real `cgn-infer serve --backend sim` processes side by side on this
machine, deterministic output, preemption under a tiny pool, admission errors, the cost model."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cgn_core.errors import ConfigError
from cgn_infer.backends.sim_backend import SimCost
from cgn_infer.settings import InferSettings
from harness.metrics import metric
from harness.procs import BIN, cgn_infer_fleet

MODEL = "SmolLM2-135M-Instruct.Q4_1"
POOL_TOKENS = 128  # 8 blocks: a handful of sequences at once, then preemption


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")


@pytest.fixture(scope="module")
def fleet(fleet_dir: Path) -> Iterator[list[str]]:
    args = ("--backend", "sim", "--kv-pool-tokens", str(POOL_TOKENS), "--speed", "20")
    with cgn_infer_fleet(fleet_dir, 8, *args) as urls:
        yield urls


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7}
    resp = await client.post(url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length"  # sim output never contains a stop token
    return str(choice["text"])


def test_eight_sim_engines_serve_side_by_side_deterministically(fleet: list[str]) -> None:
    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            jobs = [complete(client, url, "The fleet says", 12) for url in fleet for _ in range(2)]
            return list(await asyncio.gather(*jobs))

    texts = asyncio.run(run())
    assert len(set(texts)) == 1 and len(texts[0].split()) == 12  # same words everywhere
    for url in fleet:
        assert metric(url, "vllm:generation_tokens_total") >= 24


def test_sim_engines_stay_small(fleet: list[str], fleet_dir: Path) -> None:
    """The sim keeps no weights and no real KV memory: each process stays well under the
    ~1 GB a torch engine of the same model holds, so a fleet fits a small machine."""
    pids = [json.loads(f.read_text())["pid"] for f in fleet_dir.glob("infer-*.ready")]
    assert len(pids) == len(fleet) == 8
    per_engine = sum(rss_mib(pid) for pid in pids) / len(pids)
    assert per_engine < 300, f"{per_engine:.0f} MiB per sim engine"


def test_preemption_under_a_tiny_pool_keeps_outputs_identical(fleet: list[str]) -> None:
    url = fleet[0]
    prompts = [f"Request number {i} asks the fleet a question about" for i in range(6)]

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient() as client:
            solo = [await complete(client, url, p, 40) for p in prompts]
            together = await asyncio.gather(*(complete(client, url, p, 40) for p in prompts))
            return solo, list(together)

    before = metric(url, "vllm:num_preemptions_total")
    solo, together = asyncio.run(run())
    assert together == solo
    assert metric(url, "vllm:num_preemptions_total") > before


def test_a_request_that_can_never_fit_is_refused_at_admission(fleet: list[str]) -> None:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": POOL_TOKENS}
    resp = httpx.post(fleet[1] + "/v1/completions", json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "kv_capacity_exceeded" and err["param"] == "max_tokens"
    assert f"KV pool of {POOL_TOKENS} tokens" in err["message"]
    # A chat without max_tokens is bounded by what the pool can hold.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    resp = httpx.post(fleet[1] + "/v1/chat/completions", json=chat, timeout=60)
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == POOL_TOKENS + 1


def test_cost_model_arithmetic() -> None:
    cost = SimCost(step_s=0.05, prefill_s_per_token=0.001, decode_s_per_seq=0.002,
                   decode_s_per_ctx_token=1e-5, speed=2.0)  # fmt: skip
    assert cost.step_seconds(100, 4, 1000) == pytest.approx((0.05 + 0.1 + 0.008 + 0.01) / 2)
    with pytest.raises(ValueError, match="positive"):
        SimCost(speed=0).step_seconds(1, 0, 0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--max-batch", "0"), "max_batch must be in [1, 4096], got 0"),
        (("--kv-pool-tokens", "8"), "kv_pool_tokens must be in [16, 67108864], got 8"),
        (("--speed", "-1"), "sim.speed must be in [0.001, 1000], got -1.0"),
        (("--engines", "0"), "sim.engines must be in [1, 256], got 0"),
        (("--engines", "100000"), "sim.engines must be in [1, 256], got 100000"),
        (("--engines", "3", "--backend", "torch"),
         "sim.engines=3: only the sim backend hosts several engines in one process "
         "(--backend sim)"),
        (("--engines", "10", "--port", "65530"),
         "sim.engines=10 from port 65530 runs past 65535"),
    ],
)  # fmt: skip
def test_bad_engine_settings_are_one_line_errors(flags: tuple[str, ...], message: str) -> None:
    argv = [str(BIN / "cgn-infer"), "serve", "--model", "smollm2", "--backend", "sim", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {message}"


def test_a_pool_whose_bookkeeping_the_host_cannot_hold_is_refused() -> None:
    """Simulated KV takes no host memory, but its blocks' bookkeeping does (256 B a block)."""
    from cgn_infer.daemon import check_pool_fits

    class Modelled:  # a stand-in for the sim backend: only what the check reads
        modelled = object()

        def kv_bytes_per_token(self) -> int:
            raise AssertionError("a modelled pool holds no KV in host memory")

    settings = InferSettings(backend="sim", kv_pool_tokens=1 << 20)  # 65,536 blocks: 16 MiB
    with pytest.raises(ConfigError, match=r"needs 0\.0 GiB of host memory \(its blocks'"):
        check_pool_fits(settings, Modelled(), available=1 << 20)  # type: ignore[arg-type]
    check_pool_fits(settings, Modelled(), available=1 << 30)  # type: ignore[arg-type]


def test_a_bundled_model_is_served_under_its_own_name(tmp_path: Path) -> None:
    from cgn_infer.daemon import model_name

    assert model_name(InferSettings(model=Path("qwen2.5-coder-0.5b"))) == "qwen2.5-coder-0.5b"
    assert model_name(InferSettings(model=Path("smollm2"))) == "smollm2"
    gguf = tmp_path / "my.model.q4.gguf"
    gguf.write_bytes(b"")
    assert model_name(InferSettings(model=gguf)) == "my.model.q4"
    assert model_name(InferSettings(model=gguf, model_name="x")) == "x"
