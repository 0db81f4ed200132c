"""A replica's speed, learned online from what the router sees of its answers (#57).

Fitted by recent-weighted least squares:

    time to first byte  =  overhead  +  prefill · work  +  per_other · (batch - 1)
    time per output token  =  decode  +  per_batch · (batch - 1)

`work` is the uncached prompt tokens the engine had to compute before this request's
first token: its own, plus those the router had routed there and not yet seen answered
(the queue it joined). `batch` is the requests the router had in flight there when it
sent this one, itself included: their decode steps share the engine's steps with this
one's prefill (a fit whose `per_other` comes out negative falls back to the line
without it). Nothing is configured: a replica starts from a prior (the median of its
model's warm replicas, else `DEFAULT`), which counts as `PRIOR_WEIGHT` samples alone
and fades as real ones arrive (as 1/their number); every sample's weight halves each
`half_life_s` against the newer ones, so a replica that got faster or slower is relearned
within minutes. The decay is relative: a replica left idle keeps what it learned (a slow
one does not drift back to its fast peers' median and win requests it then holds). A
sample that is not a finite, possible
observation is refused; a fit that comes out of bounds is clamped, and one that cannot
be solved is the prior. The router's workers each learn from the answers they see and
fit their sums together (`state`, `combined`: the same fit as one learner of them all).
Pure: no clock (`now` is passed in), no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cgn_router.types import DEFAULT_SPEED as DEFAULT
from cgn_router.types import Speed

__all__ = ["DEFAULT", "Sample", "Speed", "SpeedFit", "median_speed"]

HALF_LIFE_S = 60.0
PRIOR_WEIGHT = 1.0  # samples' worth
MAX_HALVINGS = 40.0  # older samples weigh at least 2**-40 of a new one at each (no underflow)
MAX_TTFT_S = 3600.0  # a first token later than this is not an observation of speed
MAX_TOKENS = 1 << 24
PREFILL_BOUNDS = (1e-7, 1.0)  # seconds per token
OVERHEAD_BOUNDS = (0.0, 60.0)  # seconds
DECODE_BOUNDS = (1e-5, 10.0)  # seconds per output token
PER_BATCH_BOUNDS = (0.0, 10.0)  # seconds per output token per other request
PER_OTHER_BOUNDS = (0.0, 60.0)  # seconds to the first token per other request in flight


@dataclass(frozen=True, slots=True)
class Sample:
    """One answered request on one replica."""

    work_tokens: int  # uncached prompt tokens it waited behind, its own included
    ttft_s: float  # the attempt's start to its first byte
    output_tokens: int
    decode_s: float  # first byte to the last
    batch: int  # requests in flight on the replica when it was sent, itself included

    def valid(self) -> bool:
        numbers = (self.ttft_s, self.decode_s)
        return (
            all(isinstance(x, float | int) and math.isfinite(x) and x >= 0 for x in numbers)
            and self.ttft_s <= MAX_TTFT_S
            and self.decode_s <= MAX_TTFT_S
            and 0 <= self.work_tokens <= MAX_TOKENS
            and 0 <= self.output_tokens <= MAX_TOKENS
            and 1 <= self.batch <= MAX_TOKENS
        )


@dataclass(slots=True)
class _Line:
    """Decayed sums for a weighted least-squares line y = a + b·x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def decay(self, factor: float) -> None:
        self.w, self.x, self.y = self.w * factor, self.x * factor, self.y * factor
        self.xx, self.xy = self.xx * factor, self.xy * factor

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.w += weight
        self.x += weight * x
        self.y += weight * y
        self.xx += weight * x * x
        self.xy += weight * x * y

    def plus_prior(self, a: float, b: float, at: float, weight: float) -> _Line:
        """These sums with the prior line as two points (x = 0 and x = `at`)."""
        out = _Line(self.w, self.x, self.y, self.xx, self.xy)
        out.add(0.0, a, weight / 2)
        out.add(at, a + b * at, weight / 2)
        return out

    def solve(self) -> tuple[float, float] | None:
        det = self.w * self.xx - self.x * self.x
        if not det > 0 or not math.isfinite(det):
            return None
        b = (self.w * self.xy - self.x * self.y) / det
        a = (self.y - b * self.x) / self.w
        return (a, b) if math.isfinite(a) and math.isfinite(b) else None


@dataclass(slots=True)
class _Plane:
    """Decayed sums for a weighted least-squares plane y = a + b·u + c·v."""

    sums: list[float]  # w, u, v, uu, uv, vv, y, uy, vy

    @classmethod
    def empty(cls) -> _Plane:
        return cls([0.0] * 9)

    def decay(self, factor: float) -> None:
        self.sums = [x * factor for x in self.sums]

    def line(self) -> _Line:
        """The sums of y = a + b·u alone (v left out)."""
        w, u, _, uu, _, _, y, uy, _ = self.sums
        return _Line(w, u, y, uu, uy)

    def add(self, u: float, v: float, y: float, weight: float = 1.0) -> None:
        for i, x in enumerate((1.0, u, v, u * u, u * v, v * v, y, u * y, v * y)):
            self.sums[i] += weight * x

    def plus_prior(self, prior: Speed, at_u: float, at_v: float, weight: float) -> _Plane:
        out = _Plane(list(self.sums))
        a, b, c = prior.overhead_s, prior.prefill_s, prior.ttft_per_other_s
        for u, v in ((0.0, 0.0), (at_u, 0.0), (0.0, at_v)):
            out.add(u, v, a + b * u + c * v, weight / 3)
        return out

    def solve(self) -> tuple[float, float, float] | None:
        w, u, v, uu, uv, vv, y, uy, vy = self.sums
        m = [[w, u, v, y], [u, uu, uv, uy], [v, uv, vv, vy]]
        for col in range(3):  # Gaussian elimination with partial pivoting
            pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
            if not abs(m[pivot][col]) > 1e-12:
                return None
            m[col], m[pivot] = m[pivot], m[col]
            for r in range(3):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [x - f * p for x, p in zip(m[r], m[col], strict=True)]
        out = (m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2])
        return out if all(math.isfinite(x) for x in out) else None


STATE_FIELDS = 17  # a fit's sums as SpeedFit.state() gives them (the workers' table)


def _prior_weight(real: float) -> float:
    """The prior's weight beside `real` samples' worth: PRIOR_WEIGHT alone, fading as
    1/real once they outweigh it (a prior far off must not bias a warm fit)."""
    return PRIOR_WEIGHT * PRIOR_WEIGHT / (PRIOR_WEIGHT + real)


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


class SpeedFit:
    """One replica's learner: `add` samples as they come, read `speed(now)`."""

    def __init__(self, half_life_s: float = HALF_LIFE_S):
        self.half_life_s = half_life_s
        self._ttft = _Plane.empty()
        self._decode = _Line()
        self._at = -math.inf  # when the sums were last decayed
        self.count = 0  # samples learned, undecayed: what the prior's share fades with
        self._decoded = 0  # those with a decode time (two tokens or more)
        self.refused = 0  # samples refused as impossible
        self.diverged = 0  # fits that could not be solved (the prior was used)

    def _decay_to(self, now: float) -> None:
        """Age the sums to `now` (on a new sample only: a least-squares fit is the same for
        sums scaled alike, so reading needs none, and idle time cannot underflow them)."""
        if self._at != -math.inf and now > self._at:
            halvings = min((now - self._at) / self.half_life_s, MAX_HALVINGS)
            factor = 0.5**halvings
            self._ttft.decay(factor)
            self._decode.decay(factor)
        self._at = max(self._at, now)

    def add(self, sample: Sample, now: float) -> bool:
        """Learn from `sample`; False (and nothing learned) when it is not a possible one."""
        if not sample.valid():
            self.refused += 1
            return False
        self._decay_to(now)
        self._ttft.add(float(sample.work_tokens), float(sample.batch - 1), sample.ttft_s)
        if sample.output_tokens >= 2:  # the first token's time is the prefill's
            per_token = sample.decode_s / (sample.output_tokens - 1)
            self._decode.add(float(sample.batch - 1), per_token)
            self._decoded += 1
        self.count += 1
        return True

    def state(self) -> tuple[float, ...]:
        """What this fit learned, as STATE_FIELDS numbers: when its sums were last decayed,
        its samples, those with a decode time, and the sums (for the other router workers,
        who fit their samples and these together: `combined`)."""
        at = self._at if math.isfinite(self._at) else 0.0
        line = self._decode
        return (at, float(self.count), float(self._decoded), *self._ttft.sums,
                line.w, line.x, line.y, line.xx, line.xy)  # fmt: skip

    def combined(self, others: list[tuple[float, ...]]) -> SpeedFit:
        """A fit of this one's samples and those behind `others` (states of fits of the same
        replica, each learned once): every sum decayed to the latest of their times, then
        added, as if one fit had learned them all. A state no fit could have (not
        STATE_FIELDS finite numbers; a negative time, count or weight) is left out."""
        mine = self.state()
        parts = [p for p in (mine, *others) if _possible(p) and p[1] > 0]  # learned
        if not parts or parts == [mine]:
            return self
        latest = max(p[0] for p in parts)
        out = SpeedFit(self.half_life_s)
        out._at = latest
        sums = [0.0] * (STATE_FIELDS - 3)
        for p in parts:
            factor = 0.5 ** min((latest - p[0]) / self.half_life_s, MAX_HALVINGS)
            for i, x in enumerate(p[3:]):
                sums[i] += x * factor
            out.count += int(p[1])
            out._decoded += int(p[2])
        out._ttft = _Plane(sums[:9])
        out._decode = _Line(*sums[9:])
        out.refused, out.diverged = self.refused, self.diverged
        return out

    @staticmethod
    def _pull(weight: float, count: int) -> float:
        """The prior's weight beside `count` samples whose decayed weight is `weight`:
        PRIOR_WEIGHT samples' worth with none, fading as 1/`count`, in the decayed sums'
        units (their mean weight), so idle time alone does not bring the prior back."""
        if count == 0 or not weight > 0:
            return PRIOR_WEIGHT
        return _prior_weight(count) * weight / count

    def speed(self, now: float, prior: Speed = DEFAULT) -> Speed:
        """The fitted speed, pulled towards `prior` by PRIOR_WEIGHT samples' worth fading as
        1/their number. (`now` is kept for the callers' symmetry with `add`.)"""
        first = self._ttft.line()  # the first token's time against the work alone
        at_work = first.x / first.w if first.w > 0 else 512.0
        pull = self._pull(first.w, self.count)
        prefill = first.plus_prior(
            prior.overhead_s, prior.prefill_s, max(at_work, 64.0), pull
        ).solve()
        at_batch = self._decode.x / self._decode.w if self._decode.w > 0 else 4.0
        pull = self._pull(self._decode.w, self._decoded)
        decode = self._decode.plus_prior(
            prior.decode_s, prior.per_batch_s, max(at_batch, 1.0), pull
        ).solve()
        if prefill is None or decode is None:
            self.diverged += 1
            return prior
        overhead, per_prompt_token = prefill
        per_other = 0.0
        at_others = self._ttft.sums[2] / self._ttft.sums[0] if self._ttft.sums[0] > 0 else 1.0
        pull = self._pull(self._ttft.sums[0], self.count)
        plane = self._ttft.plus_prior(prior, max(at_work, 64.0), max(at_others, 1.0), pull)
        fitted = plane.solve()
        if fitted is not None and fitted[0] >= 0 and fitted[1] > 0 and fitted[2] >= 0:
            overhead, per_prompt_token, per_other = fitted  # else the line without it
        alone, per_batch = decode
        # NOTE: a negative intercept or slope is noise around a small one: clamped, with the
        # other term refitted through the clamped point (the mean must stay on the line)
        if overhead < OVERHEAD_BOUNDS[0]:
            overhead = 0.0
            per_prompt_token = self._through_origin(first, prior.prefill_s)
        if per_batch < PER_BATCH_BOUNDS[0]:
            per_batch = 0.0
            alone = self._mean(self._decode, prior.decode_s)
        return Speed(
            overhead_s=_clamp(overhead, OVERHEAD_BOUNDS),
            prefill_s=_clamp(per_prompt_token, PREFILL_BOUNDS),
            decode_s=_clamp(alone, DECODE_BOUNDS),
            per_batch_s=_clamp(per_batch, PER_BATCH_BOUNDS),
            samples=float(self.count),
            ttft_per_other_s=_clamp(per_other, PER_OTHER_BOUNDS),
        )

    @staticmethod
    def _through_origin(line: _Line, prior: float) -> float:
        return line.xy / line.xx if line.xx > 0 else prior

    @staticmethod
    def _mean(line: _Line, prior: float) -> float:
        return line.y / line.w if line.w > 0 else prior


def _possible(state: tuple[float, ...]) -> bool:
    """Whether `state` could be a SpeedFit's (it comes from another process's memory)."""
    if len(state) != STATE_FIELDS or not all(math.isfinite(x) for x in state):
        return False
    at, count, decoded, w, _, _, uu, _, vv, _, _, _, lw, _, _, lxx, _ = state
    counts_ok = 0 <= decoded <= count <= MAX_TOKENS
    return at >= 0 and counts_ok and min(w, uu, vv, lw, lxx) >= 0


def median_speed(speeds: list[Speed]) -> Speed | None:
    """The typical warm replica of a model (each figure's median): a cold replica's prior."""
    warm = [s for s in speeds if s.warm]
    if not warm:
        return None

    def mid(values: list[float]) -> float:
        values = sorted(values)
        n = len(values)
        return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2

    return Speed(
        overhead_s=mid([s.overhead_s for s in warm]),
        prefill_s=mid([s.prefill_s for s in warm]),
        decode_s=mid([s.decode_s for s in warm]),
        per_batch_s=mid([s.per_batch_s for s in warm]),
        ttft_per_other_s=mid([s.ttft_per_other_s for s in warm]),
    )
