"""Prefill/decode disaggregation between real engines: the two-leg protocol, real KV movement
over gRPC, and every failure ending in a served request.

SmolLM2 on the torch backend: a prefill engine (`--role prefill`) computes a prompt and
holds its blocks; a decode engine (`--role decode`) fetches them and continues; its
greedy output equals the aggregated run's and it computes only the prompt's last
partial block. Failures run on sim engines (cheap): an unreachable prefill engine, a
killed one, blocks whose lease ran out.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cgn_core.errors import InvalidRequest
from cgn_core.etcd.local import free_port
from cgn_core.http import KV_SALT_HEADER
from cgn_core.kv.transfer import TransferParams, parse_transfer_params
from cgn_core.readiness import wait_ready_file
from cgn_router.routing.disagg import Costs, costs, decide
from cgn_router.settings import PdSettings
from cgn_router.types import Endpoint, EndpointId, EndpointView, Speed
from harness import netns
from harness.metrics import metric
from harness.poll import until
from harness.procs import BIN, Engine, Router, cgn_infer, cgn_infer_engines, cgn_router, stop

pytestmark = pytest.mark.slow  # real multi-process runs: not in the fast loop

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PREFILL = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
PROMPTS = [
    "The history of the printing press begins in",
    "List three facts about octopuses. " * 6,
    "def fibonacci(n):\n    " + "# compute the nth number, iteratively\n    " * 12,
    " ".join(f"word{i}" for i in range(150)) + " and the next word is",
]


def post(url: str, body: dict[str, Any], timeout_s: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)


def two_legs(prefill: str, decode: str, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    """The router's protocol by hand: the prefill leg, then the decode leg with its params."""
    first = post(prefill, {**body, **PREFILL})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    return post(decode, {**body, "kv_transfer_params": params}), params


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("pd")
    with cgn_infer(tmp, "--role", "prefill") as prefill, cgn_infer(tmp, "--role", "decode") as d:
        yield prefill, d


def test_decode_leg_continues_the_prefill_legs_kv_with_identical_greedy_output(
    pair: tuple[str, str],
) -> None:
    prefill, decode = pair
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        aggregated = post(prefill, body).json()  # the prefill engine also serves whole requests
        computed0 = metric(decode, "cgn_infer_prefill_tokens_computed_total")
        resp, params = two_legs(prefill, decode, body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["choices"][0]["text"] == aggregated["choices"][0]["text"], prompt[:30]
        n = out["usage"]["prompt_tokens"]
        blocks = (n - 1) // 16
        assert params.get("remote_block_count", 0) == blocks
        assert resp.headers["x-cgn-kv-transfer"] == (
            f"fetched {blocks} blocks through shared memory"  # same host
            if blocks
            else "nothing to fetch (under one block)"
        )
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
        # the decode engine ran only what follows the fetched blocks: the last partial block
        computed = metric(decode, "cgn_infer_prefill_tokens_computed_total") - computed0
        assert computed == n - blocks * 16, (prompt[:30], computed, n)
    assert metric(decode, "cgn_infer_pd_fallbacks_total") == 0
    assert metric(prefill, "cgn_infer_kv_transfer_held_blocks_total") > 0


def test_roles_refuse_the_other_leg(pair: tuple[str, str]) -> None:
    prefill, decode = pair
    body = {"model": MODEL, "prompt": "hello there", **PREFILL}
    refused = post(decode, body)
    assert refused.status_code == 400
    assert "role is decode" in refused.json()["error"]["message"]
    leg = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}
    refused = post(prefill, {"model": MODEL, "prompt": "hi", "kv_transfer_params": leg})
    assert refused.status_code == 400 and "role is prefill" in refused.json()["error"]["message"]
    stream = post(prefill, {**body, "stream": True})
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"


# ---- failures: every one ends in a served request, within the fetch timeout ------------------

SIM = ("--backend", "sim", "--speed", "50", "--model-name", "sim", "--set", "transfer.timeout_s=2")


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    tmp = tmp_path_factory.mktemp("pd-sim")
    with cgn_infer_engines(tmp, 2, *SIM, "--set", "transfer.lease_s=3") as engines:
        yield engines


def sim_body(i: int) -> dict[str, Any]:
    return {"model": "sim", "prompt": f"case {i} " + "a long shared context " * 40,
            "max_tokens": 4, "temperature": 0}  # fmt: skip


def test_sim_engines_transfer_and_the_lease_ends(sims: list[Engine]) -> None:
    prefill, decode = sims[0].url, sims[1].url
    resp, params = two_legs(prefill, decode, sim_body(1))
    assert resp.status_code == 200 and resp.headers["x-cgn-kv-transfer"].startswith("fetched")
    assert params["remote_block_count"] > 0
    # past transfer.lease_s the blocks are gone: the decode leg recomputes, and says so
    first = post(prefill, {**sim_body(2), **PREFILL}).json()["kv_transfer_params"]
    fallbacks0 = metric(decode, "cgn_infer_pd_fallbacks_total", reason="missing")
    assert metric(prefill, "cgn_infer_kv_transfer_holding_blocks") > 0
    until(  # lease_s 3, swept every second
        "the leases ended",
        lambda: metric(prefill, "cgn_infer_kv_transfer_holding_blocks") == 0,
        timeout_s=12,
    )
    late = post(decode, {**sim_body(2), "kv_transfer_params": first})
    assert late.status_code == 200 and late.headers["x-cgn-kv-transfer"] == "fallback: missing"
    assert late.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(decode, "cgn_infer_pd_fallbacks_total", reason="missing") == fallbacks0 + 1


def test_a_tenants_transferred_blocks_continue_its_own_requests_only(sims: list[Engine]) -> None:
    """P/D under tenant salts (#58): the prefill leg holds the blocks under the tenant's salt,
    so a decode leg of another salt finds none of them (it recomputes) and its own fetches."""
    prefill, decode = sims[0].url, sims[1].url

    def leg(url: str, body: dict[str, Any], salt: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=body, headers={KV_SALT_HEADER: salt},
                          timeout=60)  # fmt: skip

    body = sim_body(7)
    first = leg(prefill, {**body, **PREFILL}, "tenant-a")
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    other = leg(decode, {**body, "kv_transfer_params": params}, "tenant-b")
    assert other.status_code == 200 and other.headers["x-cgn-kv-transfer"] == "fallback: missing"
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    own = leg(decode, {**body, "kv_transfer_params": params}, "tenant-a")
    assert own.status_code == 200 and own.headers["x-cgn-kv-transfer"].startswith("fetched")
    assert own.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the lease outlived both decode legs: the other tenant's miss was not its end
    assert metric(prefill, "cgn_infer_kv_transfer_holding_blocks") > 0


def test_an_unreachable_prefill_engine_means_recompute_not_a_hang(sims: list[Engine]) -> None:
    decode = sims[1].url
    dead = TransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=free_port())
    started = time.monotonic()
    resp = post(decode, {**sim_body(3), "kv_transfer_params": dead.to_json()})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cgn-kv-transfer"] == "fallback: unreachable"
    assert time.monotonic() - started < 2 + 5  # the fetch timeout, plus the request itself
    assert metric(decode, "cgn_infer_pd_fallbacks_total", reason="unreachable") >= 1


def test_a_prefill_engine_killed_after_its_leg_means_recompute(tmp_path: Path) -> None:
    with cgn_infer_engines(tmp_path, 2, *SIM) as (prefill, decode):
        params = post(prefill.url, {**sim_body(4), **PREFILL}).json()["kv_transfer_params"]
        prefill.proc.kill()
        prefill.proc.wait(10)
        started = time.monotonic()
        resp = post(decode.url, {**sim_body(4), "kv_transfer_params": params})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cgn-kv-transfer"] == "fallback: unreachable"
        assert time.monotonic() - started < 2 + 5


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([], "kv_transfer_params"),
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        ({"remote_block_ids": [1, 2]}, "kv_transfer_params.remote_block_ids"),
        ({"do_remote_prefill": True, "remote_host": "h"}, "kv_transfer_params.remote_host"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": True},
         "kv_transfer_params.remote_port"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "kv_transfer_params"),
        ({"remote_block_count": -1}, "kv_transfer_params.remote_block_count"),
    ],
)  # fmt: skip
def test_transfer_params_are_checked(value: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_transfer_params(value)
    assert err.value.param == param


def test_transfer_params_round_trip() -> None:
    p = TransferParams(
        do_remote_prefill=True, remote_host="::1", remote_port=7, remote_block_count=3
    )
    assert parse_transfer_params(p.to_json()) == p and p.address == "[::1]:7"


# ---- through the router: the decision, the two legs, the fallbacks ---------------------------


def test_the_decision_rule() -> None:
    s = PdSettings(min_uncached_tokens=512, max_prefill_queue=4)
    table = [  # prefill pool?, uncached tokens, prefill queue -> split?, reason
        (False, 5000, 0, False, "no_prefill_pool"),
        (True, 511, 0, False, "short_prompt"),
        (True, 512, 0, True, "split"),
        (True, 5000, 4, True, "split"),
        (True, 5000, 5, False, "prefill_busy"),
        (True, 5000, None, False, "prefill_busy"),
    ]
    for pool, uncached, queue, split, reason in table:
        got = decide(s, prefill_pool=pool, uncached_tokens=uncached, prefill_queue=queue)
        assert (got.split, got.reason) == (split, reason), (pool, uncached, queue)
    off = decide(PdSettings(enabled=False), prefill_pool=True, uncached_tokens=9999,
                 prefill_queue=0)  # fmt: skip
    assert off.reason == "disabled"


SPEED = Speed(overhead_s=0.1, prefill_s=1e-3, samples=20)  # 2 s for a 2,000-token prompt


def replica(role: str, predicted: float, in_flight: int = 0, **kw: Any) -> EndpointView:
    ep = Endpoint(EndpointId(f"m/{role}"), "m", f"http://{role}", role=role)
    kw.setdefault("speed", SPEED)
    return EndpointView(endpoint=ep, in_flight=in_flight, predicted_ttft_s=predicted, **kw)


@pytest.mark.parametrize(
    ("decode", "prefill", "split"),
    [
        # an idle decode replica computes it as soon as the prefill one would, and keeps it
        (replica("decode", 2.1), replica("prefill", 2.1), False),
        # 8 streams on the decode replica would each stall 2 s: 2.1 + 16 against 2.2
        (replica("decode", 2.1, 8), replica("prefill", 2.1), True),
        # ... unless the prefill replica's wait outweighs every stall it saves
        (replica("decode", 2.1, 8), replica("prefill", 19.0), False),
        # a prefill replica twice as fast: splitting is sooner even beside an idle decoder
        (replica("decode", 2.1), replica("prefill", 1.1, speed=Speed(prefill_s=5e-4)), True),
        # a decode replica whose learned prefill is faster (from short prompts) computes no
        # faster than the prefill replica: 0.1 + 2 x 2 against 2.3 (at its own: 1.1 + 1)
        (
            replica("decode", 1.1, 1, speed=Speed(0.1, 5e-4, samples=9)),
            replica("prefill", 2.1),
            True,
        ),
        # a "both" replica taking the prefill stalls its own streams instead
        (replica("decode", 2.1, 2), replica("both", 2.1, 4), False),
    ],
)
def test_the_split_is_decided_by_predicted_time(
    decode: EndpointView, prefill: EndpointView, split: bool
) -> None:
    got = costs(decode, prefill, 2000, transfer_s_per_token=5e-5)
    assert got is not None
    # the transfer is 0.1 s; the decode replica starts in its prediction less its compute
    assert got.split_s == pytest.approx(
        prefill.predicted_ttft_s + 0.1 + 0.1
        + prefill.speed.prefill_s * 2000 * (prefill.in_flight if prefill.endpoint.role != "prefill" else 0)
    )  # fmt: skip
    d = decide(PdSettings(), prefill_pool=True, uncached_tokens=2000, prefill_queue=99,
               predicted=got)  # fmt: skip
    assert (d.split, d.reason) == (split, "split" if split else "predicted_slower")


def test_without_predictions_the_rule_decides() -> None:
    unpredicted = dataclasses.replace(replica("prefill", 1.0), predicted_ttft_s=None)
    assert costs(replica("decode", 1.0), unpredicted, 2000, 0) is None
    # the operator's floor holds either way
    short = decide(PdSettings(), prefill_pool=True, uncached_tokens=100, prefill_queue=0,
                   predicted=Costs(aggregated_s=9.0, split_s=1.0))  # fmt: skip
    assert short.reason == "short_prompt"


@pytest.fixture(scope="module")
def pd_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, list[Engine]]]:
    tmp = tmp_path_factory.mktemp("pd-router")
    with cgn_infer_engines(tmp, 2, *SIM) as engines:
        prefill, decode = engines
        config = {
            "discovery": "static",
            "models": {"sim": {"tokenizer": "smollm2"}},
            "endpoints": {"p": {"url": prefill.url, "model": "sim", "role": "prefill"},
                          "d": {"url": decode.url, "model": "sim", "role": "decode"}},
            "pd": {"min_uncached_tokens": 256, "prefill_timeout_s": 5},
            "attempts": 1,
        }  # fmt: skip
        with cgn_router(tmp, config) as router:
            yield router, engines


def long_body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "sim", "prompt": f"topic {i}: " + "the context goes on and on " * 60,
            "max_tokens": 6, "temperature": 0, **extra}  # fmt: skip


def test_router_splits_a_long_prompt_and_the_decode_leg_streams(
    pd_router: tuple[Router, list[Engine]],
) -> None:
    router, (prefill, _) = pd_router
    # aggregated, on the prefill engine (the decode engine must not hold this prompt yet)
    direct = post(prefill.url, long_body(1)).json()["choices"][0]["text"]
    resp = post(router.url, long_body(2))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cognitora-pd"] == "disaggregated (prefill sim/p)"
    assert resp.headers["x-cgn-kv-transfer"].startswith("fetched ")
    assert resp.headers["x-cognitora-endpoint"] == "sim/d"
    # the same context gives the same words whichever way its KV was made
    again = post(router.url, long_body(1))
    assert again.headers["x-cognitora-pd"].startswith("disaggregated")
    assert again.json()["choices"][0]["text"] == direct
    with httpx.stream("POST", router.url + "/v1/completions", json=long_body(3, stream=True),
                      timeout=60) as stream:  # fmt: skip
        assert stream.headers["x-cognitora-pd"].startswith("disaggregated")
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert metric(router.admin, "cgn_router_pd_decisions_total", reason="split") >= 3
    short = post(router.url, {"model": "sim", "prompt": "hi", "max_tokens": 2})
    assert short.headers["x-cognitora-pd"] == "aggregated: short_prompt"
    assert short.headers["x-cognitora-endpoint"] == "sim/d"


def test_router_refuses_transfer_params_from_clients(
    pd_router: tuple[Router, list[Engine]],
) -> None:
    router, _ = pd_router
    leg = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 1}
    resp = post(router.url, {**long_body(4), "kv_transfer_params": leg})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"


def test_router_falls_back_when_the_prefill_engine_is_gone(
    pd_router: tuple[Router, list[Engine]],
) -> None:
    """Runs last in this module: it kills the prefill engine."""
    router, (prefill, _) = pd_router
    prefill.proc.kill()
    prefill.proc.wait(10)
    started = time.monotonic()
    resp = post(router.url, long_body(5))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cognitora-pd"].startswith("aggregated: prefill leg failed")
    assert time.monotonic() - started < 5 + 5
    assert metric(router.admin, "cgn_router_pd_fallbacks_total") >= 1


# ---- two "hosts": the prefill engine in a network namespace, over a veth pair ----------------


@pytest.fixture
def other_host() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, its address)."""
    try:
        with netns.other_host() as (ns, addr, _):
            yield ns, addr
    except netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))


def test_the_transfer_crosses_a_veth_pair_between_two_hosts(
    other_host: tuple[str, str], tmp_path: Path
) -> None:
    """The prefill engine runs in another network namespace, bound to its veth address; the
    decode engine here fetches its blocks across the pair."""
    ns, addr = other_host
    ready = tmp_path / "prefill.ready"
    argv = ["ip", "netns", "exec", ns, str(BIN / "cgn-infer"), "serve", "--model", "smollm2",
            "--host", addr, "--port", "0", "--role", "prefill", "--ready-file", str(ready),
            "--set", f"transfer.host={addr}", *SIM]  # fmt: skip
    with (tmp_path / "prefill.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        doc = wait_ready_file(ready, timeout_s=120, proc=proc)
        prefill = f"http://{addr}:{doc['ports']['http']}"
        # NOTE: a network namespace shares /dev/shm with this one; another host would not
        no_shm = ("--set", "transfer.shared_memory=false")
        with cgn_infer_engines(tmp_path, 1, *SIM, "--role", "decode", *no_shm) as (decode,):
            resp, params = two_legs(prefill, decode.url, sim_body(6))
            assert (
                params["remote_host"] == addr
                and params["remote_port"] == doc["ports"]["kv_transfer"]
            )
            assert resp.status_code == 200, resp.text
            assert (
                resp.headers["x-cgn-kv-transfer"]
                == f"fetched {params['remote_block_count']} blocks"
            )
            assert metric(decode.url, "cgn_infer_kv_transfer_fetched_blocks_total") > 0
    finally:
        stop(proc)
