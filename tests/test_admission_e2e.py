"""Admission end to end on a sim fleet: a batch job never starves interactive traffic (bench/admission.py).

500 concurrent bronze streams run without pause while platinum probes measure
their TTFT: with admission its median stays within 1.2× of its idle value (its
p99 within 1.6× on a shared 2-core machine; 1.06-1.08× in the bench); through
a router with admission and engine priorities switched off the same load
multiplies it (asserted too, so the test fails if the load stops being real);
engine priorities alone take most of that back. Two bronze tenants, one
sending 20× more, are served in alternation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.admission import Fleet, fleet, measure

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.exclusive, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # NOTE: twice the bench's sim speed (bench/results/admission.md runs at 4x): every TTFT
    # halves and so does the test, and each ratio compares phases of the same fleet.
    with fleet(tmp_path_factory.mktemp("admission"), speed=8.0) as f:
        yield f


def test_platinum_ttft_holds_under_500_bronze_streams_only_with_admission(
    sim_fleet: Fleet, tmp_path: Path
) -> None:
    r = asyncio.run(measure(sim_fleet, n_bronze=500, n_probes=60, settle_s=2.0))  # p99: 2nd worst
    print(f"\nidle p99 {r['idle']['p99'] * 1000:.0f} ms; with admission ×{r['ratio_on']:.2f}, "
          f"without ×{r['ratio_off']:.2f}, engine priority only ×{r['ratio_priority_only']:.2f}; "
          f"small tenant ranks {r['fairness']['small_ranks']}")  # fmt: skip
    assert r["idle"]["n"] == 60 and r["admission_on"]["n"] == 60
    # p99 of 60 probes is the second worst: one stalled probe does not decide it, two do.
    # Measured: 1.06-1.08x over three runs (bench/results/admission.md, 4x sim speed); 25x
    # without admission. NOTE: at this test's 8x the router streams bronze tokens twice as
    # fast on its one core, and on a 2-core CI machine its event loop (not admission) put
    # two probes 1.33x late once: the median holds the 1.2x line, the tail a looser one
    # that admission's absence (25x) and engine priorities alone (2.1x) still cross.
    assert r["admission_on"]["p50"] / r["idle"]["p50"] <= 1.2, r
    assert r["ratio_on"] <= 1.6, r
    assert r["ratio_off"] >= 3.0, r  # the load is real: without admission platinum waits
    # engine priorities alone (no admission) keep platinum out of the engines' queues: it
    # still shares full batches (2.1x measured) but no longer waits behind bronze (24x)
    assert r["ratio_priority_only"] * 4 <= r["ratio_off"], r
    assert r["admission_on"]["bronze_per_s"] > 0  # bronze is throttled, not starved
    fair = r["fairness"]
    assert fair["completed"] + fair["before_small"] == 210
    # alternation: sent once 100 of the big tenant's are queued, the small tenant's ten finish
    # among the first ~quarter of what completes from then on, not behind the queue (>1/2)
    assert fair["small_last_rank"] < 0.4 * fair["completed"], fair
