"""The narrow interface between the engine and a runtime (torch, MLX, sim).

The engine owns tokens, sampling and scheduling; a backend owns weights and
KV memory and turns token ids into logits. KV memory is one pool of 16-token
blocks (`new_kv`); every step passes each sequence's block table explicitly
(`paged.BatchItem`), so the backend keeps no per-sequence state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from prometheus_client.registry import Collector

from cgn_infer.backends.paged import BatchItem, SeqCache, blocks_for
from cgn_infer.models.args import Args


class BackendLost(RuntimeError):
    """A part of the backend outside this process is gone (a pipeline stage): the engine
    cannot step any more, so it stops at once and says why on /health."""


@dataclass(frozen=True, slots=True)
class Modelled:
    """A simulated backend's clock: it computes nothing and waits what its cost model says,
    `speed` times faster than modelled; moving or restoring its KV is charged the same way."""

    speed: float
    prefill_s_per_token: float  # the modelled prefill rate, before `speed`


class Backend(Protocol):
    """A loaded model on one runtime, with what it can and cannot do declared below (the
    engine and the daemon read these; they never probe a backend for attributes)."""

    name: str
    args: Args

    @property
    def lost(self) -> str | None:
        """Why a part of this backend outside the process is gone (a pipeline stage), so the
        engine cannot step; None while it is whole."""

    @property
    def collector(self) -> Collector | None:
        """Prometheus metrics of its own for the engine's /metrics (a pipeline head: its
        stages' traffic); None: none."""

    @property
    def modelled(self) -> Modelled | None:
        """A simulated backend's timing model; None: real compute, its pool in real memory."""

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes in the pool, all layers together."""

    def new_kv(self, num_blocks: int) -> Any:
        """A KV pool of `num_blocks` blocks of BLOCK_SIZE tokens (an opaque handle)."""

    def kv_nbytes(self, kv: Any) -> int:
        """Bytes the pool's memory actually takes."""

    def kv_layout(self) -> tuple[str, int, int, int]:
        """What one token's K/V is in `read_blocks` bytes: (dtype, layers, KV heads, head dim),
        the cgn-kvcached layout descriptor's fields."""

    def read_blocks(self, kv: Any, ids: Sequence[int]) -> np.ndarray:
        """Blocks `ids` of the pool as [len(ids), block bytes] uint8, each block K then V of
        every layer ([2, layers, BLOCK_SIZE, KV heads, head dim] in the pool's dtype)."""

    def write_blocks(self, kv: Any, ids: Sequence[int], data: np.ndarray) -> None:
        """The inverse of `read_blocks`: fill blocks `ids` from `data` (may be read-only)."""

    def forward_batch(
        self, items: Sequence[BatchItem], kv: Any, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run every item's tokens through the model in one step, writing their K/V into
        `kv` at the slots their tables give. Returns float32 logits: [items, vocab] for
        each item's last token, or [all tokens, vocab] with `all_logits`."""

    def new_cache(self, max_tokens: int) -> SeqCache:
        """A private pool for one sequence of up to `max_tokens` tokens."""

    def forward(
        self, tokens: Sequence[int], start_pos: int, cache: SeqCache, *, all_logits: bool = False
    ) -> np.ndarray:
        """One sequence's step: [vocab] logits for the last token, or [T, vocab]."""


class SingleSequence:
    """`new_cache`/`forward` for one sequence, on top of a backend's paged batch step; and
    the capabilities of a backend that is whole, real and has no metrics of its own."""

    @property
    def lost(self) -> str | None:
        return None

    @property
    def collector(self) -> Collector | None:
        return None

    @property
    def modelled(self) -> Modelled | None:
        return None

    def new_kv(self, num_blocks: int) -> Any:
        raise NotImplementedError

    def forward_batch(
        self, items: Sequence[BatchItem], kv: Any, *, all_logits: bool = False
    ) -> np.ndarray:
        raise NotImplementedError

    def new_cache(self, max_tokens: int) -> SeqCache:
        n = blocks_for(max_tokens)
        return SeqCache(self.new_kv(n), list(range(n)))

    def forward(
        self, tokens: Sequence[int], start_pos: int, cache: SeqCache, *, all_logits: bool = False
    ) -> np.ndarray:
        out = self.forward_batch(
            [BatchItem(tokens, start_pos, cache.table)], cache.kv, all_logits=all_logits
        )
        return out if all_logits else out[0]
