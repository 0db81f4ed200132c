"""Sampling: each processor's effect, seeds, and logprobs (pure, exact), through the C
selection (kernels/sample.c) and its numpy definition alike."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cgn_infer import kernels
from cgn_infer.sampling import Sampler, SamplingParams, _exp, _select

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


@pytest.fixture(params=["c", "numpy"])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL | None:
    """Each test that takes it runs once with the kernels' draw and once with numpy's."""
    if request.param == "numpy":
        return None
    loaded = kernels.load()
    assert loaded is not None, kernels.failure()
    return loaded.lib


def draws(
    params: SamplingParams, lib: ctypes.CDLL | None, n: int = 400, logits: np.ndarray = LOGITS
) -> set[int]:
    s = Sampler(params, lib=lib)
    return {s.sample(logits).token for _ in range(n)}


def test_greedy_takes_the_argmax() -> None:
    assert draws(SamplingParams(temperature=0.0), None, 5) == {1}


def test_top_k_and_top_p_and_min_p_bound_the_support(lib: ctypes.CDLL | None) -> None:
    assert draws(SamplingParams(top_k=2), lib) == {1, 2}
    # softmax(LOGITS): p(1)=.61 p(2)=.22 p(0)=.08 ...: top_p .7 keeps {1, 2}
    assert draws(SamplingParams(top_p=0.7), lib) == {1, 2}
    assert draws(SamplingParams(top_p=0.5), lib) == {1}
    # min_p .3 keeps tokens with p >= .3 * p(1) = .18: {1, 2}
    assert draws(SamplingParams(min_p=0.3), lib) == {1, 2}
    assert draws(SamplingParams(temperature=1.0), lib) == {0, 1, 2, 3, 4}


def test_draws_follow_the_renormalised_distribution(lib: ctypes.CDLL | None) -> None:
    """4,000 seeded draws under top-k 3: each kept token's share within 0.03 of its
    renormalised probability (about 4 standard deviations), the rest never drawn."""
    s = Sampler(SamplingParams(top_k=3, seed=11), lib=lib)
    counts = np.bincount([s.sample(LOGITS).token for _ in range(4000)], minlength=5)
    p = np.exp(LOGITS - LOGITS.max())
    p[[3, 4]] = 0
    assert np.abs(counts / 4000 - p / p.sum()).max() < 0.03, counts


def test_the_c_draw_picks_the_numpy_definitions_token() -> None:
    """kernels/sample.c against sampling._select on the same rows and numbers: vocabularies
    of 7 to Qwen's 151,936, spread and peaked logits, logits rounded to bfloat16's 8 bits
    (many exact ties, which both break toward the lower id), masked tokens (-inf), every
    filter alone and combined (top-k over most of the row, top-p near 0 and 1), and u at
    both ends."""
    lib = kernels.load()
    assert lib is not None, kernels.failure()
    rng = np.random.default_rng(3)
    params = [(1.0, 0, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.0, 40, 1.0, 0.0),
              (1.3, 5000, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0),
              (1.0, 0, 0.999999, 0.0), (1.0, 0, 1e-9, 0.0), (0.8, 0, 1.0, 0.05),
              (0.7, 50, 0.95, 0.0), (1.0, 40, 0.9, 0.1), (0.5, 0, 0.7, 0.02)]  # fmt: skip
    checked = 0
    for n in (7, 1000, 49_152, 151_936):
        for scale in (0.5, 3.0, 12.0):
            logits = (rng.standard_normal(n) * scale).astype(np.float32)
            if scale == 3.0:  # bfloat16's mantissa: ties
                logits = (logits.view(np.uint32) & 0xFFFF0000).view(np.float32)
            logits[rng.integers(0, n, n // 5)] = -np.inf  # a grammar's mask
            scratch = (np.empty(n, np.float32), np.empty(n, np.uint64), np.empty(n // 64 + 1))
            for temperature, top_k, top_p, min_p in params:
                for u in (0.0, rng.random(), 1 - 2**-53):
                    want = _select(logits, temperature, top_k, top_p, min_p, u)
                    args = (temperature, top_k, top_p, min_p, u)
                    got = lib.lib.cgn_sample(
                        logits.ctypes.data, n, *args, *(b.ctypes.data for b in scratch)
                    )
                    assert got == want >= 0, (n, scale, args)
                    checked += 1
    assert checked == 4 * 3 * len(params) * 3
    # top-p's prefix ends at the token whose running sum reaches the goal exactly: 2 of 4
    equal, scratch = (
        np.zeros(4, np.float32),
        (np.empty(4, np.float32), np.empty(4, np.uint64), np.empty(1)),
    )
    assert (
        lib.lib.cgn_sample(
            equal.ctypes.data, 4, 1.0, 0, 0.5, 0.0, 0.99, *(b.ctypes.data for b in scratch)
        )
        == 1
    )
    assert _select(equal, 1.0, 0, 0.5, 0.0, 0.99) == 1


def test_the_exponential_tracks_float64() -> None:
    """sample.c's polynomial (repeated in numpy) within 3 float32 ulps of exp, from 0 to
    -87, so the draw weighs tokens as softmax does."""
    d = np.linspace(-87.0, 0.0, 200_001, dtype=np.float32)
    ref = np.exp(d.astype(np.float64))
    ulps = np.abs(_exp(d) - ref) / np.spacing(ref.astype(np.float32))
    assert ulps.max() <= 3, ulps.max()


def test_broken_rows_still_draw(lib: ctypes.CDLL | None) -> None:
    """NaN and +inf logits (a broken model) are cleaned, not drawn from as NaN: +inf is the
    likeliest, NaN never drawn; every token -inf gives the first."""
    row = np.array([np.nan, 1.0, np.inf, 0.0], np.float32)
    s = Sampler(SamplingParams(seed=1), lib=lib)
    assert {s.sample(row).token for _ in range(50)} == {2}
    assert Sampler(SamplingParams(), lib=lib).sample(np.full(3, -np.inf, np.float32)).token == 0


def test_low_temperature_concentrates(lib: ctypes.CDLL | None) -> None:
    s = Sampler(SamplingParams(temperature=0.05, seed=1), lib=lib)
    assert {s.sample(LOGITS).token for _ in range(100)} == {1}


def test_seed_reproduces(lib: ctypes.CDLL | None) -> None:
    a = [Sampler(SamplingParams(seed=42), lib=lib).sample(LOGITS).token for _ in range(1)]
    s1, s2 = Sampler(SamplingParams(seed=7), lib=lib), Sampler(SamplingParams(seed=7), lib=lib)
    assert [s1.sample(LOGITS).token for _ in range(50)] == [
        s2.sample(LOGITS).token for _ in range(50)
    ]
    assert a == [Sampler(SamplingParams(seed=42), lib=lib).sample(LOGITS).token]


def test_penalties() -> None:
    # repetition penalty divides positive logits of seen tokens (prompt included)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[1])
    assert s.sample(LOGITS).token == 2  # 3.0/2 = 1.5 < 2.0
    # presence/frequency penalties act on generated tokens only
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.6), prompt=[2])
    assert [s.sample(LOGITS).token for _ in range(3)] == [1, 1, 2]  # 3.0 -> 2.4 -> 1.8 < 2.0
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.5))
    assert [s.sample(LOGITS).token for _ in range(2)] == [1, 2]


def test_logprobs_are_of_the_model_distribution() -> None:
    s = Sampler(SamplingParams(temperature=0.0, logprobs=2))
    out = s.sample(LOGITS)
    expected = LOGITS - np.log(np.exp(LOGITS).sum())
    assert out.token == 1
    assert out.logprob == pytest.approx(expected[1], abs=1e-5)
    assert [t for t, _ in out.top] == [1, 2]
    assert out.top[1][1] == pytest.approx(expected[2], abs=1e-5)
    assert Sampler(SamplingParams(logprobs=0)).sample(LOGITS).top == ()
    assert Sampler(SamplingParams()).sample(LOGITS).logprob is None
