"""Sampling: each processor's effect, seeds, and logprobs (pure, exact)."""

from __future__ import annotations

import numpy as np
import pytest

from cgn_infer.sampling import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


def draws(params: SamplingParams, n: int = 400, logits: np.ndarray = LOGITS) -> set[int]:
    s = Sampler(params)
    return {s.sample(logits).token for _ in range(n)}


def test_greedy_takes_the_argmax() -> None:
    assert draws(SamplingParams(temperature=0.0), 5) == {1}


def test_top_k_and_top_p_and_min_p_bound_the_support() -> None:
    assert draws(SamplingParams(top_k=2)) == {1, 2}
    # softmax(LOGITS): p(1)=.61 p(2)=.22 p(0)=.08 ...: top_p .7 keeps {1, 2}
    assert draws(SamplingParams(top_p=0.7)) == {1, 2}
    assert draws(SamplingParams(top_p=0.5)) == {1}
    # min_p .3 keeps tokens with p >= .3 * p(1) = .18: {1, 2}
    assert draws(SamplingParams(min_p=0.3)) == {1, 2}
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}


def test_low_temperature_concentrates() -> None:
    s = Sampler(SamplingParams(temperature=0.05, seed=1))
    assert {s.sample(LOGITS).token for _ in range(100)} == {1}


def test_seed_reproduces() -> None:
    a = [Sampler(SamplingParams(seed=42)).sample(LOGITS).token for _ in range(1)]
    s1, s2 = Sampler(SamplingParams(seed=7)), Sampler(SamplingParams(seed=7))
    assert [s1.sample(LOGITS).token for _ in range(50)] == [
        s2.sample(LOGITS).token for _ in range(50)
    ]
    assert a == [Sampler(SamplingParams(seed=42)).sample(LOGITS).token]


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
