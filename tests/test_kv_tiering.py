"""cgn-infer with cgn-kvcached: the restore-or-recompute cost model, the block serialization of
every backend, and real processes on SmolLM2 (a 2,048-token prompt gives the same tokens and
log-probabilities recomputed, restored from RAM and restored from SSD; only the prompt's tail
is computed after a restore; with kvcached down the engine serves by recomputing)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from cgn_core.etcd.local import free_port
from cgn_core.http import KV_SALT_HEADER
from cgn_core.kv.identity import StoreKeys, ensure_secret
from cgn_infer.backends.sim_backend import SimBackend, SimCost
from cgn_infer.kv_tiering import RestoreCost
from cgn_infer.models.args import Args
from cgn_proto.cognitora.v1 import kvcached_pb2 as pb
from cgn_proto.cognitora.v1 import kvcached_pb2_grpc as pb_grpc
from harness.procs import cgn_infer, cgn_kvcached, post

pytestmark = pytest.mark.slow  # real multi-process runs: not in the fast loop

MB = 1e6
COMPUTED = "cgn_infer_prefill_tokens_computed_total"
RESTORED = "cgn_infer_kv_restored_tokens_total"


@pytest.mark.parametrize(
    ("start", "tiers", "block_bytes", "cost", "end"),
    [
        # RAM at 1 GB/s vs prefill at 1 ms/token: every block pays
        (0, ["ram"] * 8, 700_000, RestoreCost(), 8),
        # only what lies past the pool's own hit is fetched
        (3, ["ram"] * 8, 700_000, RestoreCost(), 8),
        (8, ["ram"] * 8, 700_000, RestoreCost(), 8),
        # a slow tier loses to a fast prefill: recompute (nothing fetched)
        (0, ["ssd"] * 8, 700_000, RestoreCost(prefill_s_per_token=1e-4, s_per_byte={"ram": 1e-9, "ssd": 1 / (50 * MB)}), 0),
        # a short prefix does not cover the fixed overhead; a long one does
        (0, ["ram"], 700_000, RestoreCost(fixed_s=0.05), 0),
        (0, ["ram"] * 8, 700_000, RestoreCost(fixed_s=0.05), 8),
        # mixed tiers: the RAM head pays, the SSD tail does not (so the fetch stops there)
        (0, ["ram"] * 4 + ["ssd"] * 4, 700_000,
         RestoreCost(fixed_s=0.0, prefill_s_per_token=1e-4, s_per_byte={"ram": 1e-10, "ssd": 1e-7}), 4),
    ],
)  # fmt: skip
def test_the_cost_model_fetches_the_prefix_that_saves_most(
    start: int, tiers: list[str], block_bytes: int, cost: RestoreCost, end: int
) -> None:
    assert cost.plan(start, tiers, block_bytes) == end


def test_the_cost_model_learns_rates_from_what_it_measures() -> None:
    cost = RestoreCost(fixed_s=0.0, alpha=1.0)
    cost.observe_restore(["ssd"] * 4, 4_000_000, 0.4)  # 10 MB/s measured
    assert cost.s_per_byte["ssd"] == pytest.approx(1e-7)
    cost.observe_restore(["ram", "ssd"], 2_000_000, 99.0)  # mixed: not attributable, ignored
    assert cost.s_per_byte["ram"] == pytest.approx(1e-9)
    cost.observe_prefill(512, 0.256)
    assert cost.prefill_s_per_token == pytest.approx(5e-4)
    assert cost.plan(0, ["ssd"] * 4, 700_000) == 0  # 70 ms a block beats 8 ms of prefill: no


def _roundtrip(backend: Any, kv: Any) -> np.ndarray:
    width = len(backend.read_blocks(kv, [0])[0])
    data = np.random.default_rng(1).integers(0, 256, (2, width), dtype=np.uint8)
    if backend.kv_layout()[0] in ("float32", "float16", "bfloat16"):  # finite values only
        dt = {"float32": np.float32, "float16": np.float16}.get(backend.kv_layout()[0], np.float16)
        data = np.random.default_rng(1).standard_normal(width // np.dtype(dt).itemsize * 2)
        data = data.astype(dt).view(np.uint8).reshape(2, width)
    backend.write_blocks(kv, [5, 2], data)
    assert np.array_equal(backend.read_blocks(kv, [5, 2]), data)
    assert np.array_equal(backend.read_blocks(kv, [2]), data[1:])
    return data


def test_backends_serialize_blocks_as_the_layout_says(smollm2_torch: Any) -> None:
    torch_kv = smollm2_torch.new_kv(8)
    dtype, layers, heads, dim = smollm2_torch.kv_layout()
    assert (dtype, layers, heads, dim) == ("float16", 30, 3, 64)
    data = _roundtrip(smollm2_torch, torch_kv)
    # K then V, each [layers, 16, KV heads, head dim]: layer 7, position 3, head 2 of block 5
    block = data[0].view(np.float16).reshape(2, layers, 16, heads, dim)
    assert np.array_equal(torch_kv.k[7, 5, 3, 2].numpy(), block[0, 7, 3, 2])
    assert np.array_equal(torch_kv.v[29, 5, 15, 0].numpy(), block[1, 29, 15, 0])
    assert (
        smollm2_torch.read_blocks(torch_kv, [0]).shape[1] == 16 * smollm2_torch.kv_bytes_per_token()
    )

    sim = SimBackend(Args("llama", 64, 8, 1, 1, 1, 8, 8, 1e-5, 1e4, 8, False, False, 4096, True),
                     SimCost(), choices=[1, 2])  # fmt: skip
    _roundtrip(sim, sim.new_kv(8))

    mlx_backend = pytest.importorskip("cgn_infer.backends.mlx_backend")
    import mlx.core as mx

    mlx = object.__new__(mlx_backend.MlxBackend)  # the block format needs only the shapes
    mlx.args, mlx.dtype = smollm2_torch.args, mx.float32
    mlx.n_local = smollm2_torch.args.n_layers  # a whole model (not a pipeline part)
    mlx_kv = mlx.new_kv(8)
    assert mlx.kv_layout() == ("float32", 30, 3, 64)
    mlx_block = _roundtrip(mlx, mlx_kv)[0].view(np.float32).reshape(2, layers, 16, heads, dim)
    assert np.array_equal(np.array(mlx_kv.k[7][5 * 16 + 3, 2]), mlx_block[0, 7, 3, 2])


# ---- real processes -----------------------------------------------------------------------


def _prompt(tag: int, n: int = 2048) -> list[int]:
    rng = np.random.default_rng(tag)
    return [int(t) for t in rng.integers(100, 40_000, n)]


def metric(url: str, name: str, label: str = "") -> float:
    """The value of `name` (total over its lines, or the line carrying `label`)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name + "{") and label in line)  # fmt: skip


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_restored_prefix_gives_the_recomputed_tokens_and_logprobs(tmp_path: Path) -> None:
    port = free_port()
    store = ("--port", str(port), "--ssd-dir", str(tmp_path / "ssd"), "--ssd-bytes", str(1 << 30),
             "--set", "write_through=true")  # fmt: skip
    a, b = _prompt(1, 512), _prompt(2, 512)
    # A pool of 576 tokens (36 blocks) holds one 512-token prompt (32 blocks): each prompt
    # evicts the other's blocks.
    keys = StoreKeys.derive(ensure_secret(tmp_path / "kvcached.secret"))  # what the agent hands
    engine_args = ("--kvcached", f"127.0.0.1:{port}", "--kv-pool-tokens", "576",
                   "--set", f"kvcached.token={keys.client_token}")  # fmt: skip
    with cgn_infer(tmp_path, *engine_args) as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]

        def complete(prompt: list[int]) -> dict[str, Any]:
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "logprobs": 3}  # fmt: skip
            return post(url + "/v1/completions", body)

        def same_as(ref: dict[str, Any], got: dict[str, Any]) -> None:
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
            want = ref["choices"][0]["logprobs"]["token_logprobs"]
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=2e-3)

        with cgn_kvcached(tmp_path, *store):
            ref = complete(a)  # recomputed: nothing stored anywhere yet
            assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            complete(b)  # evicts a's blocks from the pool; both offered to kvcached
            wait_for(lambda: metric(url, "cgn_infer_kv_offloaded_blocks_total") >= 64,
                     "both prompts' blocks stored")  # fmt: skip
            before = metric(url, COMPUTED)
            got = complete(a)
            same_as(ref, got)
            cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == 496  # 31 blocks: the pool's leftover head plus the RAM tier
            assert metric(url, COMPUTED) - before == 512 - cached  # nothing recomputed past it
            assert metric(url, RESTORED, 'tier="ram"') > 350
        with cgn_kvcached(tmp_path, *store):  # restarted: RAM empty, the SSD tier intact
            complete(b)  # b back from SSD, evicting a again
            got = complete(a)
            same_as(ref, got)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 496
            assert metric(url, RESTORED, 'tier="ssd"') > 350
        # Poisoning: every block on disk altered, and a process without the node's token
        # tries to put its own bytes; nothing of either is restored, the answer is the same
        for f in (tmp_path / "ssd").glob("*.blk"):
            raw = bytearray(f.read_bytes())
            raw[-100:] = b"\0" * 100
            f.write_bytes(raw)
        with cgn_kvcached(tmp_path, *store) as kv, kv.channel("") as stranger:
            forged = pb.PutRequest(layout=pb.KvLayout(dtype="float32", layers=1, kv_heads=1,
                                                      head_dim=1, block_size=16, engine="x"),
                                   block=pb.KvBlock(hash=bytes(32), data=bytes(64)))  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KvCacheStub(stranger).Put(iter([forged]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            restored = metric(url, RESTORED, 'tier="ssd"')
            complete(b)
            same_as(ref, complete(a))
            assert metric(url, RESTORED, 'tier="ssd"') == restored  # nothing altered restored
            with kv.channel() as ch:
                assert pb_grpc.KvCacheStub(ch).Stats(pb.StatsRequest()).checksum_failures >= 1
        # kvcached is gone: the engine still serves, recomputing
        c = complete(_prompt(3, 300))
        assert c["usage"]["completion_tokens"] == 6
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(url, "cgn_infer_kv_restore_failures_total") >= 1


def test_the_sim_backend_restores_too_and_charges_the_modelled_time(tmp_path: Path) -> None:
    """Sim engines (the fleet benchmarks' stand-ins) go through the same offer and restore
    path; their output is a function of every KV slot, so a wrong restore would change it.
    A tenant's salted blocks are restored for that tenant only."""
    sim = ("--backend", "sim", "--model-name", "sim", "--kv-pool-tokens", "1024", "--speed", "50")
    with cgn_kvcached(tmp_path) as kv, cgn_infer(tmp_path, *sim, *kv.engine_args) as url:

        def complete(prompt: list[int], salt: str | None = None) -> dict[str, Any]:
            body = {"model": "sim", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            headers = {"Content-Type": "application/json"}
            if salt is not None:  # the router's, for a tenant (#58)
                headers[KV_SALT_HEADER] = salt
            req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         headers)  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                doc: dict[str, Any] = json.load(resp)
            return doc

        a, b = _prompt(4, 900), _prompt(5, 900)
        ref = complete(a)
        complete(b)  # the pool holds one of them
        wait_for(lambda: metric(url, "cgn_infer_kv_offloaded_blocks_total") >= 112, "offers")
        got = complete(a)
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 800
        assert metric(url, RESTORED, 'tier="ram"') >= 700
        assert metric(url, "cgn_infer_kv_restore_seconds_sum") > 0

        # A tenant's blocks, in the pool and in the node's store, are its own (#58): the same
        # prompt under another tenant's salt is recomputed, under its own it is restored
        c = _prompt(6, 900)
        offered = metric(url, "cgn_infer_kv_offloaded_blocks_total")
        assert complete(c, "tenant-a")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        complete(b)  # c's blocks leave the pool
        wait_for(lambda: metric(url, "cgn_infer_kv_offloaded_blocks_total") >= offered + 56,
                 "c's blocks stored")  # fmt: skip
        restored = metric(url, RESTORED)
        for other in (None, "tenant-b"):  # unsalted (a direct client) and another tenant
            assert complete(c, other)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(url, RESTORED) == restored
        complete(b)
        got = complete(c, "tenant-a")  # its owner: restored from the store
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 800
        assert metric(url, RESTORED) >= restored + 700
        body = json.dumps({"model": "sim", "prompt": "x", "max_tokens": 1}).encode()
        bad = urllib.request.Request(url + "/v1/completions", body, {KV_SALT_HEADER: "a b"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=10)
        with refused.value as err:
            assert err.code == 400 and KV_SALT_HEADER in json.load(err)["error"]["message"]
