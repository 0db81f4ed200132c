"""A simulated backend: the real server, scheduler, paged pool and prefix cache, with the
forward pass replaced by a cost model and deterministic tokens.

Cost of one step (seconds, divided by `speed`):

    step_s + prefill_s_per_token * prompt tokens in the step
           + decode_s_per_seq * decoding sequences
           + decode_s_per_ctx_token * context tokens those sequences attend to

The thread sleeps for that long (no CPU), so many sim engines share a small
machine. Defaults are fitted to the torch backend on SmolLM2 (float32, 2 cores):
bench/sim_calibrate.py measures and fits them, docs/cgn-infer.md has the figures.

Tokens: the "KV pool" holds, per slot, a running 64-bit hash of the sequence's
tokens up to that position, written through the block table exactly as real
K/V would be; the next token is a function of the hash at the last position.
So the output depends on the whole context, is identical across batching,
chunking and preemption, and is wrong if a block table is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE
from cgn_infer.backends.base import Modelled, SingleSequence
from cgn_infer.backends.paged import BatchItem
from cgn_infer.models.args import Args

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3
_PEAK = 100.0  # logit of the chosen token; every other token gets 0, exp(-100) underflows


@dataclass(frozen=True, slots=True)
class SimCost:
    step_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_seq: float = 0.0
    decode_s_per_ctx_token: float = 0.0
    speed: float = 1.0  # >1 runs faster than modelled

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, decode_ctx: int) -> float:
        if self.speed <= 0:
            raise ValueError("sim speed must be positive")
        cost = (
            self.step_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.decode_s_per_ctx_token * decode_ctx
        )
        return cost / self.speed


class SimBackend(SingleSequence):
    name = "sim"

    def __init__(self, args: Args, cost: SimCost, choices: Sequence[int], kv_dtype_bytes: int = 4):
        if not choices:
            raise ValueError("the sim backend needs at least one token to emit")
        self.args, self.cost = args, cost
        self.choices = np.asarray(choices, dtype=np.int64)
        self._kv_dtype_bytes = kv_dtype_bytes

    @property
    def modelled(self) -> Modelled:
        return Modelled(self.cost.speed, self.cost.prefill_s_per_token)

    def kv_bytes_per_token(self) -> int:
        """What the modelled engine would hold per token (the sim itself keeps 8 bytes)."""
        a = self.args
        return 2 * a.n_layers * a.n_kv_heads * a.head_dim * self._kv_dtype_bytes

    def new_kv(self, num_blocks: int) -> np.ndarray:
        return np.zeros(num_blocks * BLOCK_SIZE, dtype=np.uint64)  # running hash per slot

    def kv_nbytes(self, kv: np.ndarray) -> int:
        return kv.nbytes

    def kv_layout(self) -> tuple[str, int, int, int]:
        return "int8", 1, 1, 4  # 8 bytes per token: the running hash, as stored in the pool

    def read_blocks(self, kv: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        blocks = kv.reshape(-1, BLOCK_SIZE)[np.asarray(ids, dtype=np.int64)]
        return blocks.view(np.uint8).reshape(len(ids), -1)

    def write_blocks(self, kv: np.ndarray, ids: Sequence[int], data: np.ndarray) -> None:
        rows = np.ascontiguousarray(data).view(np.uint64).reshape(len(ids), BLOCK_SIZE)
        kv.reshape(-1, BLOCK_SIZE)[np.asarray(ids, dtype=np.int64)] = rows

    def forward_batch(
        self, items: Sequence[BatchItem], kv: np.ndarray, *, all_logits: bool = False
    ) -> np.ndarray:
        started = time.monotonic()
        rows: list[int] = []
        prefill = decode = ctx = 0
        for item in items:
            pos = item.start
            h = int(kv[self._slot(item, pos - 1)]) if pos > 0 else 0
            for token in item.tokens:
                h = ((h ^ (token + 1)) * _PRIME) & _MASK
                kv[self._slot(item, pos)] = h
                if all_logits:
                    rows.append(h)
                pos += 1
            if not all_logits:
                rows.append(h)
            if len(item.tokens) == 1:
                decode, ctx = decode + 1, ctx + pos
            else:
                prefill += len(item.tokens)
        logits = np.zeros((len(rows), self.args.vocab_size), dtype=np.float32)
        picks = self.choices[np.asarray(rows, dtype=np.uint64) % np.uint64(len(self.choices))]
        logits[np.arange(len(rows)), picks] = _PEAK
        remaining = self.cost.step_seconds(prefill, decode, ctx) - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        return logits

    @staticmethod
    def _slot(item: BatchItem, pos: int) -> int:
        return int(item.table[pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


def word_tokens(pieces: Sequence[str], limit: int = 2048) -> list[int]:
    """Token ids that read as a space and a plain word (BPE's Ġ or SentencePiece's ▁ marker),
    for sim output: no special or stop token can be among them."""
    out = []
    for i, piece in enumerate(pieces):
        word = piece[1:]
        if piece[:1] in ("Ġ", "▁") and 3 <= len(word) <= 8 and word.isascii() and word.isalpha():
            out.append(i)
            if len(out) >= limit:
                break
    return out
