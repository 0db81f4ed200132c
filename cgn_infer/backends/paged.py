"""Attention metadata for one batched step over a paged KV pool (shared by every backend).

A step runs several sequences at once: all their new tokens are concatenated
into one [T, D] activation so that every weight matmul runs once. Each
sequence brings its block table; a token at position p of a sequence lives in
pool slot `table[p // 16] * 16 + p % 16`. Attention reads the pool through
the tables: single-token items (decode) as one padded batch, multi-token items
(prompt chunks) one by one with a causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cgn_core.blockhash import BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class BatchItem:
    """Run `tokens` at positions start.. of one sequence whose blocks are `table`."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    rows: np.ndarray  # [B] the batch row of each single-token item
    tables: np.ndarray  # [B, NB] block ids, padded with block 0
    lengths: np.ndarray  # [B] tokens to attend to, the new one included


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    rows: slice  # the item's rows in the batch
    table: np.ndarray  # [NB] the blocks holding positions 0..length-1
    start: int
    length: int  # start + number of new tokens


@dataclass(frozen=True, slots=True)
class BatchLayout:
    ids: np.ndarray  # [T] token ids
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] flat pool slot receiving each token's K/V
    last_rows: np.ndarray  # [N] the row of each item's last token
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]


def layout(items: Sequence[BatchItem]) -> BatchLayout:
    ids, positions, slots, last_rows = [], [], [], []
    dec_rows, dec_tables, dec_lengths = [], [], []
    prefills = []
    row = 0
    for item in items:
        n = len(item.tokens)
        end = item.start + n
        nb = -(-end // BLOCK_SIZE)
        if n < 1 or len(item.table) < nb:
            raise ValueError(f"item needs {nb} blocks up to position {end}, has {len(item.table)}")
        table = np.asarray(item.table[:nb], dtype=np.int64)
        pos = np.arange(item.start, end, dtype=np.int64)
        ids.append(np.asarray(item.tokens, dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        if n == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lengths.append(end)
        else:
            prefills.append(PrefillGroup(slice(row, row + n), table, item.start, end))
        row += n
        last_rows.append(row - 1)
    decode = None
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        padded = np.zeros((len(dec_tables), width), dtype=np.int64)
        for i, t in enumerate(dec_tables):
            padded[i, : len(t)] = t
        decode = DecodeGroup(
            np.asarray(dec_rows, dtype=np.int64), padded, np.asarray(dec_lengths, dtype=np.int64)
        )
    return BatchLayout(
        np.concatenate(ids),
        np.concatenate(positions),
        np.concatenate(slots),
        np.asarray(last_rows, dtype=np.int64),
        decode,
        tuple(prefills),
    )


@dataclass(slots=True)
class SeqCache:
    """A private pool holding one sequence, for callers that run a single prompt
    (tests, tools): `Backend.forward` over it is `forward_batch` with one item."""

    kv: object
    table: list[int]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)
