"""The engine's side of cgn-kvcached: offer finished blocks, restore a prompt when it pays.

Offer (after a request ends, `offer` on the engine thread): the full blocks
of the sequence not offered before are copied out of the pool (one gather)
and queued; an offload thread sends them to kvcached. So the pool's own
eviction loses nothing the node store has, and the decode step never waits
on the network. The queue is bounded: when kvcached is slow, offers are
dropped (counted), never waited for.

Restore (before a request is queued, `prefetch` on a restore thread): the
prompt's full blocks past the pool's own prefix hit are looked up in
kvcached; `RestoreCost.plan` says how many of them are worth fetching; those
are fetched (shared memory on the same node) and handed to the scheduler
with the request (scheduler.Restored), which copies them into the pool at
admission. Any failure or timeout means no restore: the prompt is
recomputed and the output is the same.

The cost model (`RestoreCost`, pure): restoring k blocks costs a fixed
overhead plus their bytes over the measured bandwidth of the tier each
comes from; recomputing them costs their tokens at the measured prefill
rate. It fetches the prefix length that saves the most, none if nothing
saves. Every restore and every prefill step updates the estimates
(exponentially weighted), starting from the configured values.

The sim backend's blocks are 128 bytes; its restores are charged the time
the modelled engine's blocks (`kv_bytes_per_token`) would take at the
configured bandwidths, divided by the sim's `speed` like its compute (the
sim models a machine that much faster in everything), so a sim fleet sees
realistic restore costs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash, iter_block_hashes
from cgn_core.kv.client import KvCacheClient, KvCacheError
from cgn_infer.backends.base import Backend
from cgn_infer.block_pool import BlockPool
from cgn_infer.metrics import EngineMetrics
from cgn_infer.scheduler import Restored, Seq

log = logging.getLogger(__name__)

OFFER_QUEUE = 64  # offers waiting for the offload thread; more are dropped
OFFERED_MEMORY = 1 << 16  # block hashes remembered as already offered
RESTORE_THREADS = 4  # prompts looked up and fetched at once


@dataclass(slots=True)
class RestoreCost:
    """Restore-or-recompute, from measured rates (seconds)."""

    fixed_s: float = 0.005  # per restore: lookup, fetch set-up
    s_per_byte: dict[str, float] = field(default_factory=lambda: {"ram": 1 / 1e9, "ssd": 1 / 2e8})
    prefill_s_per_token: float = 1e-3
    alpha: float = 0.3  # weight of a new measurement

    def plan(self, start: int, tiers: Sequence[str], block_bytes: int) -> int:
        """The end (exclusive) of the blocks start.. worth fetching; `start` when none are.
        `tiers[i]` is where block i is stored (blocks before `start` are in the pool)."""
        best, best_gain = start, 0.0
        restore, recompute = self.fixed_s, 0.0
        for i in range(start, len(tiers)):
            restore += block_bytes * self.s_per_byte.get(tiers[i], self.s_per_byte["ssd"])
            recompute += BLOCK_SIZE * self.prefill_s_per_token
            if recompute - restore > best_gain:
                best, best_gain = i + 1, recompute - restore
        return best

    def observe_restore(self, tiers: Sequence[str], nbytes: int, seconds: float) -> None:
        """A fetch of `nbytes` took `seconds`; learn its tier's rate (single-tier fetches)."""
        if nbytes <= 0 or len(set(tiers)) != 1:
            return
        rate = max(seconds - self.fixed_s, 0.0) / nbytes
        tier = tiers[0]
        self.s_per_byte[tier] += self.alpha * (rate - self.s_per_byte.get(tier, rate))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            rate = seconds / tokens
            self.prefill_s_per_token += self.alpha * (rate - self.prefill_s_per_token)


@dataclass(frozen=True, slots=True)
class _Offer:
    hashes: tuple[BlockHash, ...]
    data: np.ndarray


class KvTiering:
    def __init__(
        self,
        client: KvCacheClient,
        backend: Backend,
        pool: BlockPool,
        metrics: EngineMetrics,
        cost: RestoreCost,
        *,
        modelled_block_bytes: int | None = None,
    ):
        self.client, self.backend, self.pool, self.metrics = client, backend, pool, metrics
        self.cost = cost
        # What the cost model charges per block (the sim's own blocks are tiny).
        self.block_bytes = modelled_block_bytes or client.layout.block_bytes
        self._sleep_for_model = modelled_block_bytes is not None
        # the configured rates, kept fixed: what a modelled (sim) restore is charged (the
        # daemon has already divided them by the sim's speed)
        self._model_s_per_byte = dict(cost.s_per_byte)
        self._model_fixed_s = cost.fixed_s
        self._offered: OrderedDict[BlockHash, None] = OrderedDict()  # engine thread only
        self._offers: queue.Queue[_Offer | None] = queue.Queue(OFFER_QUEUE)
        self._offloader = threading.Thread(target=self._offload, name="kv-offload", daemon=True)
        self._offloader.start()
        # NOTE: several: a lookup that waits on the store must not queue the requests behind it
        self.restorer = ThreadPoolExecutor(RESTORE_THREADS, thread_name_prefix="kv-restore")
        self._lock = threading.Lock()  # the cost model is read and updated by two threads

    def close(self) -> None:
        self._offers.put(None)
        self._offloader.join(timeout=5)
        self.restorer.shutdown(wait=False)
        self.client.close()

    # ---- restore (on the restore thread) ----------------------------------------------------

    def prefetch(
        self,
        prompt: Sequence[int],
        trace: Mapping[str, str] | None = None,
        salt: str | None = None,
    ) -> Restored | None:
        """The prompt's blocks past the pool's hit that are worth fetching, fetched; None when
        nothing is (or anything failed: the prompt is then recomputed). `trace`: the request's
        trace context, passed to kvcached (its Get span joins the request's trace); `salt`:
        its tenant's, whose blocks alone it may find."""
        full = (len(prompt) - 1) // BLOCK_SIZE  # the last token is always computed
        if full == 0:
            return None
        hashes = list(iter_block_hashes(prompt[: full * BLOCK_SIZE], self.pool.salted(salt)))
        start = self.pool.cached_prefix_hint(hashes)
        if start >= full:
            return None
        try:
            tiers = self.client.lookup(hashes, trace)
            if len(tiers) <= start:
                return None  # the store holds nothing past the pool's own hit
            with self._lock:
                end = self.cost.plan(start, tiers, self.block_bytes)
            if end <= start:
                self.metrics.kv_restore_skipped.inc()
                return None
            began = time.monotonic()
            data, got = self.client.get(hashes[start:end], trace)
            if self._sleep_for_model and got:
                self._model_delay(got, time.monotonic() - began)
            elapsed = time.monotonic() - began
        except KvCacheError as exc:
            self.metrics.kv_restore_failures.inc()
            log.warning("restore from cgn-kvcached failed, recomputing: %s", exc)
            return None
        except Exception:  # NOTE: a restore is an optimisation: never the request's failure
            self.metrics.kv_restore_failures.inc()
            log.exception("restore from cgn-kvcached failed unexpectedly, recomputing")
            return None
        if not got:
            return None
        with self._lock:
            self.cost.observe_restore(got, len(got) * self.block_bytes, elapsed)
        self.metrics.kv_restore_seconds.observe(elapsed)
        return Restored(start, data, tuple(got))

    def _model_delay(self, tiers: Sequence[str], spent: float) -> None:
        """Sleep out what the modelled blocks would take at the configured (not the learned)
        rates: learning from its own delays would only ever raise them."""
        rates = self._model_s_per_byte
        want = self._model_fixed_s + sum(self.block_bytes * rates[t] for t in tiers)
        if want > spent:
            time.sleep(want - spent)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.cost.observe_prefill(tokens, seconds)

    # ---- offer (engine thread) and offload (its own thread) ---------------------------------

    def offer(self, kv: Any, seq: Seq) -> None:
        """Queue the sequence's full blocks that were never offered (engine thread, before the
        sequence's blocks are released)."""
        pairs = list(zip(seq.hashes, seq.table, strict=False))
        for h, _ in pairs[: seq.stored_blocks]:  # restored from the store: it has them
            self._offered[h] = None
        new = [(h, bid) for h, bid in pairs[seq.stored_blocks :] if h not in self._offered]
        for h, _ in new:
            self._offered[h] = None
        while len(self._offered) > OFFERED_MEMORY:
            self._offered.popitem(last=False)
        if not new:
            return
        data = self.backend.read_blocks(kv, [bid for _, bid in new])
        try:
            self._offers.put_nowait(_Offer(tuple(h for h, _ in new), data))
        except queue.Full:
            self.metrics.kv_offload_dropped.inc(len(new))
            for h, _ in new:
                self._offered.pop(h, None)

    def _offload(self) -> None:
        while (offer := self._offers.get()) is not None:
            try:
                stored = self.client.put(offer.hashes, offer.data)
            except KvCacheError as exc:
                self.metrics.kv_offload_dropped.inc(len(offer.hashes))
                log.warning("offering %d blocks to cgn-kvcached failed: %s", len(offer.hashes), exc)
                continue
            except Exception:  # NOTE: top of the offload thread: one bad offer must not end it
                log.exception("offering blocks to cgn-kvcached failed")
                continue
            self.metrics.kv_offloaded_blocks.inc(stored)
            self.metrics.kv_offload_dropped.inc(len(offer.hashes) - stored)
