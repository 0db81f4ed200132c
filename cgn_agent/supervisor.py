"""The replica lifecycle as a pure state machine: `step(state, observation) -> (state, actions)`.

    STARTING --spawned--> LOADING --health+models ok--> READY
        |                    |  load timeout / exit        | health fails x N / exit
        v                    v                             v
      FAILED <---------------+-----------------------------+
        | retry_at reached (jittered exponential backoff; never with restart off)
        +--> STARTING
    any running phase --stop--> DRAINING --(drain_s, then no requests in flight
                                          or drain_timeout_s: terminate)--exit--> STOPPED

Readiness is three checks in order: the process is alive, `/health` answers
200, and `/v1/models` lists the model; the executor probes and reports a
`Probe`. Restarts back off as `min(cap, base * 2**n) * (1 - jitter * rand)`
for the n-th consecutive failure (`rand` comes with the observation, so tests
fix it); a replica that stays Ready for `stable_s` forgets its failures.
The endpoint is published on entering READY and withdrawn on leaving it.
No I/O here: the executor in runner.py turns actions into processes and keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from cgn_core.settings import ranged


class Phase(StrEnum):
    STARTING = "Starting"
    LOADING = "Loading"
    READY = "Ready"
    DRAINING = "Draining"
    FAILED = "Failed"
    STOPPED = "Stopped"


@dataclass(frozen=True, slots=True)
class Policy:
    backoff_base_s: float = ranged(1.0, 0.01, 3600)
    backoff_cap_s: float = ranged(60.0, 0.01, 86400)
    jitter: float = ranged(0.5, 0, 1)
    load_timeout_s: float = ranged(900.0, 1, 86400)  # Loading longer than this is a failure
    health_failures: int = ranged(3, 1, 1000)  # consecutive failed probes that fail a Ready replica
    stable_s: float = ranged(60.0, 0, 86400)  # Ready this long: consecutive-failure count resets
    drain_s: float = ranged(5.0, 0, 3600)  # endpoint withdrawn at least this long before SIGTERM
    # SIGTERM after this long even with requests in flight: the router continues what is
    # still streaming on another replica (request migration), so a drain takes seconds
    drain_timeout_s: float = ranged(30.0, 0, 86400)
    # False: a failure stays Failed (a rank of a multi-node replica: the control plane
    # rebuilds the replica whole, every rank at once, rather than one rank alone)
    restart: bool = True


@dataclass(frozen=True, slots=True)
class State:
    phase: Phase = Phase.STARTING
    since: float = 0.0  # when this phase began
    pid: int | None = None  # the engine process, while one exists
    failures: int = 0  # consecutive failures (drives the backoff)
    restarts: int = 0  # total restarts, for metrics
    retry_at: float | None = None  # Failed: when to start again
    bad_probes: int = 0
    terminating: bool = False  # a terminate was issued and the exit not yet seen
    in_flight: int | None = None  # Draining: requests the engine still runs (None: unknown)
    reason: str = ""  # why it last failed or stopped


# ---- observations ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tick:
    now: float


@dataclass(frozen=True, slots=True)
class Spawned:
    now: float
    pid: int


@dataclass(frozen=True, slots=True)
class Adopted:
    """A running engine from before the agent restarted, identified by its fingerprint."""

    now: float
    pid: int


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    now: float
    error: str
    rand: float = 0.5


@dataclass(frozen=True, slots=True)
class Exited:
    now: float
    code: int | None  # None: an adopted process (not our child), exit status unknown
    rand: float = 0.5
    reason: str = ""  # why, where the process said (a multi-node rank's wait ran out)


@dataclass(frozen=True, slots=True)
class Probe:
    now: float
    health_ok: bool
    models_ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Load:
    """Requests running and waiting on the engine (from its /metrics), while Draining."""

    now: float
    in_flight: int | None


@dataclass(frozen=True, slots=True)
class Stop:
    now: float
    reason: str = "placement removed"


Observation = Tick | Spawned | Adopted | SpawnFailed | Exited | Probe | Load | Stop

# ---- actions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spawn:
    pass


@dataclass(frozen=True, slots=True)
class Terminate:
    """Stop the engine's process group: SIGTERM, grace, SIGKILL."""


@dataclass(frozen=True, slots=True)
class PublishEndpoint:
    pass


@dataclass(frozen=True, slots=True)
class WithdrawEndpoint:
    pass


@dataclass(frozen=True, slots=True)
class Report:
    """The phase or reason changed: re-publish the replica's status."""


@dataclass(frozen=True, slots=True)
class Forget:
    """The replica is gone for good: drop its status key and state file."""


Action = Spawn | Terminate | PublishEndpoint | WithdrawEndpoint | Report | Forget

RUNNING = (Phase.STARTING, Phase.LOADING, Phase.READY)


def start(now: float) -> tuple[State, list[Action]]:
    """A new replica: spawn its engine."""
    return State(Phase.STARTING, since=now), [Report(), Spawn()]


def adopt(now: float, pid: int) -> tuple[State, list[Action]]:
    """A replica whose engine survived the agent: probe it back to Ready, start nothing."""
    return State(Phase.LOADING, since=now, pid=pid), [Report()]


def backoff_s(failures: int, policy: Policy, rand: float) -> float:
    ceiling = min(policy.backoff_cap_s, policy.backoff_base_s * 2.0 ** max(0, failures - 1))
    return ceiling * (1 - policy.jitter * rand)


def step(s: State, obs: Observation, policy: Policy) -> tuple[State, list[Action]]:
    """The next state and what to do, given one observation."""
    match obs:
        case Spawned(now, pid) if s.phase == Phase.STARTING:
            return replace(s, phase=Phase.LOADING, since=now, pid=pid, bad_probes=0), [Report()]
        case SpawnFailed(now, error, rand) if s.phase == Phase.STARTING:
            return _fail(s, now, f"could not start: {error}", rand, policy, [])
        case Exited(now, code, rand, reason):
            return _exited(s, now, code, rand, policy, reason)
        case Probe() if s.pid is not None and not s.terminating:
            return _probe(s, obs, policy)
        case Stop(now, reason):
            return _stop(s, now, reason)
        case Load(_, in_flight) if s.phase == Phase.DRAINING:
            return replace(s, in_flight=in_flight), []
        case Tick(now):
            return _tick(s, now, policy)
    return s, []


def _fail(
    s: State, now: float, reason: str, rand: float, policy: Policy, actions: list[Action]
) -> tuple[State, list[Action]]:
    failures = s.failures + 1
    retry_at = now + backoff_s(failures, policy, rand) if policy.restart else None
    withdraw: list[Action] = [WithdrawEndpoint()] if s.phase == Phase.READY else []
    new = replace(
        s, phase=Phase.FAILED, since=now, failures=failures, retry_at=retry_at, reason=reason
    )
    return new, [*withdraw, *actions, Report()]


def _exited(
    s: State, now: float, code: int | None, rand: float, policy: Policy, reason: str = ""
) -> tuple[State, list[Action]]:
    if s.phase == Phase.DRAINING:
        return replace(s, phase=Phase.STOPPED, since=now, pid=None, terminating=False), [Forget()]
    if s.phase == Phase.FAILED:  # the exit of a process we were terminating
        return replace(s, pid=None, terminating=False), []
    if s.phase not in RUNNING:
        return s, []
    why = reason or "engine exited" + ("" if code is None else f" with code {code}")
    failed, actions = _fail(s, now, why, rand, policy, [])
    return replace(failed, pid=None, terminating=False), actions


def _probe(s: State, p: Probe, policy: Policy) -> tuple[State, list[Action]]:
    ok = p.health_ok and p.models_ok
    if s.phase == Phase.LOADING:
        if ok:
            return replace(s, phase=Phase.READY, since=p.now, bad_probes=0, reason=""), [
                PublishEndpoint(),
                Report(),
            ]
        return s, []
    if s.phase != Phase.READY:
        return s, []
    if ok:
        if s.failures and p.now - s.since >= policy.stable_s:
            return replace(s, bad_probes=0, failures=0), []
        return (replace(s, bad_probes=0), []) if s.bad_probes else (s, [])
    bad = s.bad_probes + 1
    if bad < policy.health_failures:
        return replace(s, bad_probes=bad), []
    failed, actions = _fail(
        s, p.now, f"unhealthy: {p.detail or 'probe failed'}", 0.5, policy, [Terminate()]
    )
    return replace(failed, terminating=True), actions


def _stop(s: State, now: float, reason: str) -> tuple[State, list[Action]]:
    if s.phase in (Phase.DRAINING, Phase.STOPPED):
        return s, []
    if s.pid is None:
        return replace(s, phase=Phase.STOPPED, since=now, reason=reason), [Forget()]
    withdraw: list[Action] = [WithdrawEndpoint()] if s.phase == Phase.READY else []
    new = replace(s, phase=Phase.DRAINING, since=now, reason=reason, retry_at=None)
    return new, [*withdraw, Report()]


def _tick(s: State, now: float, policy: Policy) -> tuple[State, list[Action]]:
    if s.phase == Phase.LOADING and now - s.since > policy.load_timeout_s and not s.terminating:
        why = f"not ready within {policy.load_timeout_s:.0f}s"
        failed, actions = _fail(s, now, why, 0.5, policy, [Terminate()])
        return replace(failed, terminating=True), actions
    # NOTE: requests in flight finish first; an engine without load metrics gets drain_s.
    drained = not s.in_flight or now - s.since >= policy.drain_timeout_s
    if (
        s.phase == Phase.DRAINING
        and not s.terminating
        and now - s.since >= policy.drain_s
        and drained
    ):
        return replace(s, terminating=True), [Terminate()]
    if s.phase == Phase.FAILED and s.pid is None and s.retry_at is not None and now >= s.retry_at:
        new = replace(s, phase=Phase.STARTING, since=now, retry_at=None, restarts=s.restarts + 1)
        return new, [Report(), Spawn()]
    return s, []
