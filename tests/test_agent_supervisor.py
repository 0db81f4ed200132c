"""The replica lifecycle state machine: observations in, exact actions out (no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgn_agent import supervisor as sv
from cgn_agent.supervisor import (
    Exited,
    Forget,
    Phase,
    Probe,
    PublishEndpoint,
    Report,
    Spawn,
    Spawned,
    SpawnFailed,
    State,
    Stop,
    Terminate,
    Tick,
    WithdrawEndpoint,
)

P = sv.Policy(backoff_base_s=1.0, backoff_cap_s=8.0, jitter=0.5, load_timeout_s=100.0,
              health_failures=3, stable_s=60.0, drain_s=2.0)  # fmt: skip


def run(state: State, *observations: sv.Observation) -> tuple[State, list[list[sv.Action]]]:
    out = []
    for obs in observations:
        state, actions = sv.step(state, obs, P)
        out.append(actions)
    return state, out


def ready_at(t: float) -> State:
    s, _ = sv.start(0.0)
    s, _ = run(s, Spawned(0.1, 42), Probe(t, True, True))
    assert s.phase == Phase.READY
    return s


def test_start_spawn_load_ready() -> None:
    s, actions = sv.start(0.0)
    assert s.phase == Phase.STARTING and actions == [Report(), Spawn()]
    s, acts = run(
        s,
        Spawned(0.1, 42),
        Probe(1.0, False, False, "connection refused"),
        Probe(2.0, True, False, "/v1/models does not list 'm'"),
        Probe(3.0, True, True),
    )
    assert acts == [[Report()], [], [], [PublishEndpoint(), Report()]]
    assert s.phase == Phase.READY and s.pid == 42 and s.since == 3.0


def test_exit_when_ready_withdraws_then_restarts_with_exponential_backoff() -> None:
    s = ready_at(5.0)
    s, acts = run(s, Exited(10.0, -9, rand=0.0))
    assert acts == [[WithdrawEndpoint(), Report()]]
    assert s.phase == Phase.FAILED and s.pid is None and s.retry_at == 11.0
    assert s.reason == "engine exited with code -9"
    s, acts = run(s, Tick(10.9), Tick(11.0))
    assert acts == [[], [Report(), Spawn()]] and s.phase == Phase.STARTING and s.restarts == 1
    # fails again while loading: the delay doubles (2 s), with jitter taking up to half off
    s, acts = run(s, Spawned(11.1, 43), Exited(12.0, 1, rand=0.5))
    assert acts[1] == [Report()] and s.retry_at == pytest.approx(12.0 + 2.0 * 0.75)
    delays = [sv.backoff_s(n, P, rand=0.0) for n in range(1, 7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # capped
    assert sv.backoff_s(3, P, rand=1.0) == 2.0  # full jitter takes half of 4 s


def test_a_stable_replica_forgets_its_failures() -> None:
    s = ready_at(5.0)
    s, _ = run(s, Exited(6.0, 1, rand=0.0), Tick(7.0), Spawned(7.1, 50), Probe(8.0, True, True))
    assert s.failures == 1 and s.phase == Phase.READY
    s, _ = run(s, Probe(30.0, True, True))
    assert s.failures == 1
    s, _ = run(s, Probe(68.0, True, True))
    assert s.failures == 0 and s.restarts == 1


def test_unhealthy_ready_replica_is_terminated_after_n_failed_probes() -> None:
    s = ready_at(5.0)
    s, acts = run(s, Probe(6.0, False, False, "503"), Probe(7.0, False, False, "503"))
    assert acts == [[], []] and s.bad_probes == 2
    s, acts = run(s, Probe(7.5, True, True))  # a good probe resets the count
    assert s.bad_probes == 0
    s, acts = run(s, *(Probe(8.0 + i, False, False, "timeout") for i in range(3)))
    assert acts[-1] == [WithdrawEndpoint(), Terminate(), Report()]
    assert s.phase == Phase.FAILED and s.terminating and s.reason == "unhealthy: timeout"
    s, acts = run(
        s, Probe(12.0, True, True), Tick(100.0)
    )  # no probes or restarts while terminating
    assert acts == [[], []]
    s, acts = run(s, Exited(100.5, -15), Tick(100.6))
    assert s.pid is None and acts[1] == [Report(), Spawn()]


def test_loading_timeout_fails_and_terminates() -> None:
    s, _ = sv.start(0.0)
    s, acts = run(s, Spawned(0.0, 7), Tick(100.0), Tick(100.1))
    assert acts[1] == [] and acts[2] == [Terminate(), Report()]
    assert s.phase == Phase.FAILED and s.reason == "not ready within 100s"


def test_spawn_failure_backs_off() -> None:
    s, _ = sv.start(0.0)
    s, acts = run(s, SpawnFailed(0.0, "No such file: vllm", rand=0.0))
    assert acts == [[Report()]] and s.phase == Phase.FAILED and s.retry_at == 1.0
    assert s.reason == "could not start: No such file: vllm"


def test_stop_drains_then_terminates_then_forgets() -> None:
    s = ready_at(5.0)
    s, acts = run(s, Stop(10.0), Tick(11.0), Tick(12.0), Stop(12.1), Exited(13.0, 0))
    assert acts == [[WithdrawEndpoint(), Report()], [], [Terminate()], [], [Forget()]]
    assert s.phase == Phase.STOPPED


def test_stop_without_a_process_forgets_at_once_and_failed_replicas_do_not_restart() -> None:
    s = ready_at(5.0)
    s, _ = run(s, Exited(6.0, 1, rand=0.0))
    s, acts = run(s, Stop(6.5), Tick(50.0))
    assert acts == [[Forget()], []] and s.phase == Phase.STOPPED


def test_adopted_engine_is_probed_back_to_ready_without_a_spawn() -> None:
    s, actions = sv.adopt(0.0, 4242)
    assert s.phase == Phase.LOADING and s.pid == 4242 and actions == [Report()]
    s, acts = run(s, Probe(0.5, True, True))
    assert acts == [[PublishEndpoint(), Report()]] and s.phase == Phase.READY
    s, acts = run(s, Exited(3.0, None, rand=0.0))
    assert s.reason == "engine exited" and acts == [[WithdrawEndpoint(), Report()]]


def test_observations_that_do_not_apply_change_nothing() -> None:
    s = ready_at(5.0)
    for obs in (Spawned(6.0, 9), SpawnFailed(6.0, "x")):
        assert sv.step(s, obs, P) == (s, [])
    stopped = State(Phase.STOPPED)
    assert sv.step(stopped, Exited(1.0, 0), P) == (stopped, [])


# ---- invariants over any sequence of observations (hypothesis) ------------------------


def observations() -> st.SearchStrategy[list[tuple[str, float, bool]]]:
    # weighted so that sequences reach Ready, fail, restart and stop often
    kinds = st.sampled_from(
        ["tick"] * 2 + ["spawned"] * 3 + ["spawn_failed", "exited", "exited"] + ["probe"] * 4
        + ["stop"]
    )  # fmt: skip
    return st.lists(st.tuples(kinds, st.floats(0, 5), st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(observations())
def test_endpoint_published_exactly_while_ready_and_one_process_at_a_time(
    seq: list[tuple[str, float, bool]],
) -> None:
    state, actions = sv.start(0.0)
    now, published, alive, next_pid = 0.0, False, False, 100
    spawns_pending = actions.count(Spawn())
    for kind, dt, ok in seq:
        now += dt
        if kind == "spawned" and spawns_pending:
            obs: sv.Observation = Spawned(now, next_pid)
            next_pid += 1
        elif kind == "spawn_failed" and spawns_pending:
            obs = SpawnFailed(now, "boom", rand=0.3)
        elif kind == "exited" and alive:
            obs = Exited(now, 1, rand=0.7)
        elif kind == "probe" and alive:
            obs = Probe(now, ok, ok)
        elif kind == "stop":
            obs = Stop(now)
        else:
            obs = Tick(now)
        if isinstance(obs, Spawned | SpawnFailed):
            spawns_pending -= 1
            alive = isinstance(obs, Spawned)
        if isinstance(obs, Exited):
            alive = False
        state, actions = sv.step(state, obs, P)
        for a in actions:
            if a == Spawn():
                assert not alive and spawns_pending == 0, "a second engine for one replica"
                spawns_pending += 1
            elif a == PublishEndpoint():
                assert not published
                published = True
            elif a in (WithdrawEndpoint(), Forget()):
                published = False
        assert published == (state.phase == Phase.READY), (state, actions)
        assert (state.pid is not None) == alive, "the state must know exactly when a process lives"
        if state.phase == Phase.STOPPED:
            assert not alive
            break


def test_drain_waits_for_requests_in_flight_then_for_the_timeout() -> None:
    s = ready_at(5.0)
    s, acts = run(s, Stop(10.0), sv.Load(10.5, 3), Tick(12.5), sv.Load(13.0, 1), Tick(13.0))
    assert acts == [[WithdrawEndpoint(), Report()], [], [], [], []]  # drain_s passed, 1 running
    s, acts = run(s, sv.Load(14.0, 0), Tick(14.0))
    assert acts == [[], [Terminate()]]
    busy, _ = run(ready_at(5.0), Stop(10.0), sv.Load(11.0, 5))
    _, acts = run(busy, Tick(10.0 + P.drain_timeout_s - 0.1), Tick(10.0 + P.drain_timeout_s))
    assert acts == [[], [Terminate()]]  # a stuck request does not hold the drain forever
