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
        """Temperature, then top-k, top-p and min-p filters, then one draw by inverse CDF.
        Only tokens within e^-30 of the best are sorted: the rest carry under 1e-13 of
        the best token's probability each, below float32's resolution of the mass."""
        p = self.params
        x = x / p.temperature
        top = x.max()
        if not np.isfinite(top):  # NaN or +inf from the model: the max must be finite
            x = np.nan_to_num(x, nan=-np.inf, posinf=float(np.finfo(np.float32).max))
            top = x.max()
            if not np.isfinite(top):
                return int(np.argmax(x))  # every logit -inf: nothing to weigh
        probs = np.exp(x - top)
        idx = np.flatnonzero(probs > _NEGLIGIBLE)
        probs = probs[idx]
        if 0 < p.top_k < idx.size:
            keep = np.argpartition(-probs, p.top_k - 1)[: p.top_k]
            probs, idx = probs[keep], idx[keep]
        if p.top_p < 1.0:
            total, m = probs.sum(), 64
            # NOTE: sort only the m most likely tokens, growing m until they hold the
            # top_p mass: exact, and a few hundred tokens instead of the whole vocabulary.
            while m < idx.size:
                head = np.argpartition(-probs, m - 1)[:m]
                if probs[head].sum() >= p.top_p * total:
                    break
                m *= 8
            else:
                head = np.arange(idx.size)
            order = head[np.argsort(-probs[head], kind="stable")]
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            cut = int(np.searchsorted(np.cumsum(probs[order]), p.top_p * total)) + 1
            probs, idx = probs[order[:cut]], idx[order[:cut]]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()
            probs, idx = probs[keep], idx[keep]
        cdf = np.cumsum(probs, dtype=np.float64)
        pick = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(idx[min(pick, idx.size - 1)])


_NEGLIGIBLE = float(np.exp(-30.0))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    out: np.ndarray = x - m - np.log(np.exp(x - m).sum())
    return out
