"""Token sampling from one logits vector: penalties, temperature, top-k, top-p, min-p.

Order (as vLLM applies them): `logit_bias` and a grammar's mask (tokens it rules out
get -inf), repetition penalty (over prompt and output),
presence and frequency penalties (output only), then greedy if temperature is
0, else temperature scaling, top-k, top-p (nucleus), min-p, and a draw from
the renormalised distribution with the request's own seeded generator (so a
`seed` reproduces a generation). Log-probabilities reported to the client are
those of the model's distribution after bias, mask and penalties, before
temperature and truncation (OpenAI's and vLLM's convention): under a grammar they
are over the tokens it allowed.

Numerics: a temperature under `MIN_TEMPERATURE` samples greedily (vLLM's
cut-off; dividing by 1e-300 would overflow every logit to inf), a negative
seed is taken modulo 2**64, and a logits row holding NaN or +inf (a broken
model, not a request) is made finite before the draw, so no parameter in its
documented range can make a draw fail.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's only; n: plus top n
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Sampler:
    """Stateful per request: its random generator and its output-token counts."""

    params: SamplingParams
    prompt: Sequence[int] = ()
    # the loaded kernels' library (kernels/sample.c draws), or None: the same draw in numpy
    lib: ctypes.CDLL | None = None
    rng: np.random.Generator = field(init=False)
    counts: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        seed = self.params.seed
        self.rng = np.random.default_rng(None if seed is None else seed % (1 << 64))

    def resume(self, tokens: Sequence[int]) -> None:
        """Take `tokens` as sampled before (another engine's, a continuation): their counts
        for the penalties, and their draws from a seeded generator (one per sampled token),
        so the next token is drawn as it would have been."""
        self.counts.update(tokens)
        if not self.params.greedy and tokens:
            self.rng.random(len(tokens))

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> Sampled:
        """Pick the next token from float32 `logits` [vocab] and record it; `allowed` (bool
        [vocab], from a grammar) rules every other token out."""
        p = self.params
        x = logits.astype(np.float32, copy=True)
        if p.logit_bias:
            ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64)
            x[ids] += np.fromiter((b for _, b in p.logit_bias), dtype=np.float32)
        if allowed is not None:
            n = min(allowed.size, x.size)
            if not allowed[:n].any():
                raise ValueError("the grammar allows no next token")
            x[:n][~allowed[:n]] = -np.inf
            x[n:] = -np.inf
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(set(self.prompt) | set(self.counts), dtype=np.int64)
            if seen.size:
                vals = x[seen]
                x[seen] = np.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64)
            freq = np.fromiter(self.counts.values(), dtype=np.float32)
            x[ids] -= p.presence_penalty + p.frequency_penalty * freq
        logprobs = _log_softmax(x) if p.logprobs is not None else None
        token = int(np.argmax(x)) if p.greedy else self._draw(x)
        self.counts[token] += 1
        if logprobs is None:
            return Sampled(token)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            k = min(p.logprobs, x.size)
            idx = np.argpartition(-logprobs, k - 1)[:k]
            idx = idx[np.argsort(-logprobs[idx], kind="stable")]
            # NOTE: tokens a grammar or a bias of -100 ruled out are not alternatives
            top = tuple((int(i), float(logprobs[i])) for i in idx if np.isfinite(logprobs[i]))
        return Sampled(token, float(logprobs[token]), top)

    def _draw(self, x: np.ndarray) -> int:
        """Temperature, then top-k, top-p and min-p filters, then one draw by inverse CDF
        (`select`); one number from the generator per draw, whatever the row."""
        p = self.params
        return select(x, p.temperature, p.top_k, p.top_p, p.min_p, self.rng.random(), self.lib)


_FLOAT_MAX = float(np.finfo(np.float32).max)


def select(
    logits: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    u: float,
    lib: ctypes.CDLL | None = None,
) -> int:
    """The token a draw of `u` (in [0, 1)) picks from float32 `logits` at `temperature`
    once top-k, top-p and min-p have cut them, as kernels/sample.c defines it: in C with
    the kernels' `lib` (numpy's selection took 0.6-1.2 ms a token over a 151,936-token
    vocabulary), else in numpy here (`_select`); both pick the same token.
    A row with NaN or +inf (a broken model, not a request) is cleaned first: NaN never
    drawn, +inf the largest float."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    token = _select_row(lib, x, temperature, top_k, top_p, min_p, u)
    if token == -2:
        with np.errstate(invalid="ignore", over="ignore"):
            x = x / np.float32(temperature)
            x = np.nan_to_num(x, nan=-np.inf, posinf=_FLOAT_MAX, neginf=-np.inf)
        if not np.isfinite(x.max()):
            return int(np.argmax(x))  # every logit -inf: nothing to weigh
        token = _select_row(lib, x, 1.0, top_k, top_p, min_p, u)
    return token


def _select_row(
    lib: ctypes.CDLL | None,
    x: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    u: float,
) -> int:
    if lib is None or x.size >= 1 << 31:  # sample.c keeps token ids in 32 bits
        return _select(x, temperature, top_k, top_p, min_p, u)
    p, keys, sums = (b.ctypes.data for b in _scratch(x.size))
    args = (temperature, top_k, top_p, min_p, u)
    return int(lib.cgn_sample(x.ctypes.data, x.size, *args, p, keys, sums))


_buffers = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sample.c's scratch for a row of n, kept per thread (the engine's thread samples)."""
    bufs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = getattr(_buffers, "b", None)
    if bufs is None or bufs[0].size < n:
        bufs = _buffers.b = (
            np.empty(n, np.float32), np.empty(n, np.uint64), np.empty(n // _BLOCK + 1, np.float64)
        )  # fmt: skip
    return bufs


# kernels/sample.c's definition, in numpy: the same float operations in the same order.
_NEGLIGIBLE = np.float32(np.exp(-30.0))
_BLOCK = 64
_BOUNDS = [np.float32(4.0**-level) for level in range(12)]  # sample.c's BOUNDS
_EXP = [np.float32(float.fromhex(h)) for h in (
    "0x1.715476p+0", "0x1.63p-1", "-0x1.bd0106p-13",  # log2(e), ln 2 in two parts
    "0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7", "0x1.555382p-5", "0x1.555554p-3",
    "0x1p-1")]  # fmt: skip


def _exp(d: np.ndarray) -> np.ndarray:
    """sample.c's expf_poly on float32 `d` <= 0."""
    d = np.maximum(d, np.float32(-87.0))
    n = np.rint(d * _EXP[0])
    r: np.ndarray = d - n * _EXP[1]
    r = r - n * _EXP[2]
    q: np.ndarray = np.full_like(d, _EXP[3])
    for c in _EXP[4:]:
        q = q * r + c
    y = q * (r * r) + r + np.float32(1.0)
    scale = ((n.astype(np.int32) + 127) << 23).view(np.float32)
    out: np.ndarray = y * scale
    return out


def _row_sum(p: np.ndarray) -> tuple[np.ndarray, float]:
    """sample.c's row_sum: each block of 64 summed in order, then the blocks in order."""
    padded = np.zeros(-(-p.size // _BLOCK) * _BLOCK, np.float32)
    padded[: p.size] = p
    sums = np.cumsum(padded.reshape(-1, _BLOCK), axis=1, dtype=np.float64)[:, -1]
    return sums, float(np.cumsum(sums)[-1])


def _select(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
            u: float) -> int:  # fmt: skip
    """kernels/sample.c's cgn_sample in numpy (its comment states each step)."""
    with np.errstate(over="ignore"):
        s = x / np.float32(temperature)
    top = s.max()
    if not np.isfinite(top):
        return -2
    p = _exp(s - top)
    p[p <= _NEGLIGIBLE] = 0.0
    left = np.flatnonzero(p)
    if 0 < top_k < left.size:
        kth = np.partition(p[left], left.size - top_k)[left.size - top_k]
        ties = left[p[left] == kth]  # the lowest ids of the k-th largest p fill the k
        p[left[p[left] < kth]] = 0.0
        p[ties[top_k - int((p[left] > kth).sum()) :]] = 0.0
        left = np.flatnonzero(p)
    if top_p < 1.0:
        goal = top_p * _row_sum(p)[1]
        for bound in (*_BOUNDS, 0.0):  # sort the fewest tokens that can hold the goal
            head = left[p[left] >= bound]
            if bound and head.size < left.size and p[head].sum(dtype=np.float64) < goal:
                continue
            order = head[np.lexsort((head, -p[head]))]  # p descending, then id
            cum = np.cumsum(p[order], dtype=np.float64)
            if cum[-1] >= goal or head.size == left.size:
                kept = np.zeros(p.size, bool)
                kept[order[: int(np.searchsorted(cum, goal)) + 1]] = True
                p[~kept] = 0.0
                break
    if min_p > 0.0:
        p[p < np.float32(min_p) * p.max()] = 0.0
    sums, total = _row_sum(p)
    target = u * total
    prefix = np.cumsum(sums)
    b = min(int(np.searchsorted(prefix, target, side="right")), sums.size - 1)
    block = p[b * _BLOCK : (b + 1) * _BLOCK].astype(np.float64)
    run = np.cumsum(np.concatenate(([prefix[b - 1] if b else 0.0], block)))[1:]
    hit = np.flatnonzero((run > target) & (block > 0))
    if hit.size:
        return b * _BLOCK + int(hit[0])
    return int(np.flatnonzero(p[: b * _BLOCK + block.size])[-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    out: np.ndarray = x - m - np.log(np.exp(x - m).sum())
    return out
