"""The speed fit (cgn_router/routing/speed.py): tables of what it learns from which samples."""

from __future__ import annotations

import math

import pytest

from cgn_router.routing.speed import HALF_LIFE_S, Sample, Speed, SpeedFit, median_speed


def feed(fit: SpeedFit, truth: Speed, n: int, start: float = 0.0, every_s: float = 1.0) -> float:
    """`n` exact samples of `truth` over a spread of prompt sizes and batches; the last time."""
    now = start
    for i in range(n):
        work = 64 + (i * 397) % 4000
        batch = 1 + i % 8
        out = 2 + i % 50
        ttft = truth.ttft(work, others=batch - 1)
        decode = truth.per_token(batch) * (out - 1)
        now = start + i * every_s
        assert fit.add(Sample(work, ttft, out, decode, batch), now)
    return now


FAST = Speed(overhead_s=0.05, prefill_s=2e-4, decode_s=0.02, per_batch_s=0.004)
SLOW = Speed(overhead_s=0.2, prefill_s=2e-3, decode_s=0.2, per_batch_s=0.01)


@pytest.mark.parametrize("truth", [FAST, SLOW, Speed(0.0, 5e-5, 0.005, 0.0)])
def test_it_converges_from_the_prior_to_the_truth(truth: Speed) -> None:
    fit = SpeedFit()
    now = feed(fit, truth, 60)
    got = fit.speed(now)
    assert got.warm
    assert got.prefill_s == pytest.approx(truth.prefill_s, rel=0.05)
    assert got.decode_s == pytest.approx(truth.decode_s, rel=0.1, abs=1e-3)
    assert got.per_batch_s == pytest.approx(truth.per_batch_s, rel=0.1, abs=5e-4)
    for work in (100, 1000, 4000):
        assert got.ttft(work) == pytest.approx(truth.ttft(work), rel=0.1, abs=0.005)


def test_cold_it_is_the_prior() -> None:
    prior = Speed(0.1, 3e-3, 0.05, 0.01)
    got = SpeedFit().speed(0.0, prior)
    assert (got.overhead_s, got.prefill_s, got.decode_s, got.per_batch_s) == pytest.approx(
        (prior.overhead_s, prior.prefill_s, prior.decode_s, prior.per_batch_s)
    )
    assert not got.warm


def test_a_step_change_is_relearned_within_minutes() -> None:
    fit = SpeedFit()
    now = feed(fit, FAST, 300)  # five minutes fast
    assert fit.speed(now).prefill_s == pytest.approx(FAST.prefill_s, rel=0.05)
    now = feed(fit, SLOW, 180, start=now + 1)  # three minutes ten times slower
    got = fit.speed(now)
    assert got.prefill_s == pytest.approx(SLOW.prefill_s, rel=0.2)
    assert got.ttft(2000) == pytest.approx(SLOW.ttft(2000), rel=0.2)


def test_an_idle_replica_keeps_what_it_learned() -> None:
    """A slow replica left idle must not drift back to the (fast) prior and win requests it
    then holds: decay weighs old samples against new ones, not against the prior."""
    fit = SpeedFit()
    now = feed(fit, SLOW, 10)
    before = fit.speed(now, prior=FAST)
    assert before.prefill_s == pytest.approx(SLOW.prefill_s, rel=0.15)
    for idle in (HALF_LIFE_S, 100 * HALF_LIFE_S, 1e6 * HALF_LIFE_S):
        assert fit.speed(now + idle, prior=FAST) == before
    # and after a day idle, the first new samples are what it is now
    feed(fit, FAST, 8, start=now + 86400)
    assert fit.speed(now + 86408, prior=SLOW).prefill_s == pytest.approx(FAST.prefill_s, rel=0.1)


def test_the_prior_fades_as_one_over_the_samples() -> None:
    """Three samples of a replica ten times slower than its peers: predicted within 10 %, not
    pulled towards the peers (their median is a cold replica's prior)."""
    fit = SpeedFit()
    for i, (work, batch) in enumerate([(500, 1), (3000, 1), (1500, 3)]):
        fit.add(Sample(work, SLOW.ttft(work, batch - 1), 2, SLOW.per_token(batch), batch), i)
    got = fit.speed(3.0, prior=FAST)
    for work in (1000, 4000):
        assert got.ttft(work) == pytest.approx(SLOW.ttft(work), rel=0.1)


@pytest.mark.parametrize(
    "poison",
    [
        Sample(100, math.nan, 5, 0.1, 1),
        Sample(100, -0.5, 5, 0.1, 1),
        Sample(100, 0.1, 5, math.inf, 1),
        Sample(100, 1e9, 5, 0.1, 1),
        Sample(-1, 0.1, 5, 0.1, 1),
        Sample(100, 0.1, 5, 0.1, 0),
        Sample(100, 0.1, 5, 0.1, -3),
        Sample(1 << 30, 0.1, 5, 0.1, 1),
    ],
)
def test_a_poison_sample_is_refused_and_changes_nothing(poison: Sample) -> None:
    fit = SpeedFit()
    now = feed(fit, FAST, 40)
    before = fit.speed(now)
    assert not fit.add(poison, now)
    assert fit.refused == 1 and fit.speed(now) == before


def test_noise_never_makes_a_negative_or_nan_speed() -> None:
    fit = SpeedFit()
    # times that fall as prompts grow (a cache the router does not know about): the slope
    # fitted is negative, and is clamped, never a negative prediction
    for i in range(50):
        fit.add(Sample(100 + 100 * i, max(0.0, 2.0 - 0.03 * i), 1, 0.0, 1), float(i))
    got = fit.speed(50.0)
    for value in (got.overhead_s, got.prefill_s, got.decode_s, got.per_batch_s):
        assert math.isfinite(value) and value >= 0
    assert got.ttft(0) >= 0 and got.ttft(1e6) >= got.ttft(0)


def test_one_prompt_size_is_still_solvable() -> None:
    fit = SpeedFit()
    for i in range(30):
        fit.add(Sample(1000, 0.5, 2, 0.05, 1), float(i))
    got = fit.speed(30.0)
    assert got.ttft(1000) == pytest.approx(0.5, rel=0.1)


def test_batch_dependence_is_learned() -> None:
    fit = SpeedFit()
    truth = Speed(0.05, 2e-4, 0.01, 0.005)
    now = feed(fit, truth, 80)
    got = fit.speed(now)
    assert got.per_token(8) / got.per_token(1) == pytest.approx(truth.per_token(8) / 0.01, rel=0.1)


def test_a_cold_replica_takes_its_models_median() -> None:
    warm = [Speed(0.1, 1e-3, 0.05, 0.0, samples=5), Speed(0.2, 3e-3, 0.07, 0.0, samples=5),
            Speed(0.3, 2e-3, 0.06, 0.0, samples=5), Speed(9.0, 9.0, 9.0, 9.0)]  # fmt: skip
    got = median_speed(warm)
    assert got is not None and (got.overhead_s, got.prefill_s) == (0.2, 2e-3)
    assert median_speed([Speed()]) is None  # none warm: the default prior


def test_the_other_streams_cost_to_a_first_token_is_learned() -> None:
    truth = Speed(0.03, 2e-4, 0.02, 0.004, ttft_per_other_s=0.05)
    fit = SpeedFit()
    now = feed(fit, truth, 120)
    got = fit.speed(now)
    assert got.ttft_per_other_s == pytest.approx(0.05, rel=0.1)
    assert got.ttft(1000, others=6) == pytest.approx(truth.ttft(1000, others=6), rel=0.05)
    # none: a fit with no such cost learns none (never a negative one)
    plain = SpeedFit()
    now = feed(plain, FAST, 120)
    assert plain.speed(now).ttft_per_other_s == pytest.approx(0.0, abs=1e-3)


def split_feed(parts: int, n: int) -> tuple[SpeedFit, list[SpeedFit]]:
    """`n` noisy samples of FAST, into one fit and dealt in turn among `parts` fits."""
    one, dealt = SpeedFit(), [SpeedFit() for _ in range(parts)]
    for i in range(n):
        work, batch, out = 64 + (i * 397) % 4000, 1 + i % 8, 2 + i % 50
        noise = 1.0 + 0.3 * math.sin(i * 1.7)
        s = Sample(work, FAST.ttft(work, batch - 1) * noise, out,
                   FAST.per_token(batch) * (out - 1) / noise, batch)  # fmt: skip
        now = i * 7.0  # over several half-lives: the decay matters
        assert one.add(s, now) and dealt[i % parts].add(s, now)
    return one, dealt


@pytest.mark.parametrize("parts", [2, 3])
def test_workers_fits_combined_are_the_fit_of_all_their_samples(parts: int) -> None:
    """Each router worker learns from the answers it saw; combined (the workers' shared
    table), their fits are the one fit of every sample: same speed, same count."""
    one, dealt = split_feed(parts, 90)
    both = dealt[0].combined([f.state() for f in dealt[1:]])
    alone, together = one.speed(630.0), both.speed(630.0)
    assert together.samples == alone.samples == 90
    for name in ("overhead_s", "prefill_s", "decode_s", "per_batch_s", "ttft_per_other_s"):
        assert getattr(together, name) == pytest.approx(getattr(alone, name), rel=1e-9, abs=1e-12)
    assert dealt[0].speed(630.0) != alone  # a third of the samples alone fit otherwise


@pytest.mark.parametrize(
    "state",
    [(), (math.nan,) * 17, (1.0, -5.0, 0.0, *([1.0] * 14)), (1.0, 2.0, 3.0, *([1.0] * 14)),
     (1.0, 2.0, 1.0, -1.0, *([1.0] * 13)), (1.0, 2.0, 1.0, *([math.inf] * 14))],
    ids=["short", "nan", "negative-count", "more-decoded-than-count", "negative-weight", "inf"],
)  # fmt: skip
def test_a_state_that_no_fit_could_have_is_left_out(state: tuple[float, ...]) -> None:
    one, _ = split_feed(1, 30)
    before = one.speed(210.0)
    assert one.combined([state]).speed(210.0) == before


def test_a_worker_with_nothing_learned_combines_the_others() -> None:
    _, (a, b) = split_feed(2, 40)
    empty = SpeedFit()
    got = empty.combined([a.state(), b.state(), SpeedFit().state()])
    assert got.speed(280.0) == a.combined([b.state()]).speed(280.0)
    assert empty.combined([SpeedFit().state()]).speed(0.0) == empty.speed(0.0)
