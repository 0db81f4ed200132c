"""Attention metadata for one batched step over a paged KV pool (shared by every backend).

A step runs several sequences at once: all their new tokens are concatenated
into one [T, D] activation so that every weight matmul runs once. Each
sequence brings its block table; a token at position p of a sequence lives in
pool slot `table[p // 16] * 16 + p % 16`. Attention reads the pool through
the tables: single-token items (decode) as padded batches of similar context
width, multi-token items (prompt chunks) one by one with a causal mask.

Decode rows are grouped by width because padding is paid in full: one 2k-token
context padded into a batch of eight short chat rows made every row gather and
attend over 2k positions (a SmolLM2 step went from 0.2 s to 1.6 s while it
lasted). A group holds rows wider than half its widest row; contexts up to
`SHORT_BLOCKS` blocks share one group regardless, where another attention call
would cost more than the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cgn_core.kv.blockhash import BLOCK_SIZE

SHORT_BLOCKS = 8  # contexts up to this many blocks are padded together freely


@dataclass(frozen=True, slots=True)
class BatchItem:
    """Run `tokens` at positions start.. of one sequence whose blocks are `table`."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    lora: tuple[int, float] | None = None  # its LoRA adapter's slot and scale (adapters.py)


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
    decodes: tuple[DecodeGroup, ...]  # rows of similar width, each group in row order
    prefills: tuple[PrefillGroup, ...]
    # each row's adapter slot (-1: the base) and scale; None where no item has one
    lora: tuple[np.ndarray, np.ndarray] | None = None


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
    decodes = _decode_groups(dec_rows, dec_tables, dec_lengths)
    return BatchLayout(
        np.concatenate(ids),
        np.concatenate(positions),
        np.concatenate(slots),
        np.asarray(last_rows, dtype=np.int64),
        decodes,
        tuple(prefills),
        _lora_rows(items),
    )


def _lora_rows(items: Sequence[BatchItem]) -> tuple[np.ndarray, np.ndarray] | None:
    """Each row's adapter slot and scale, every token of an item alike (None: no item has
    an adapter, and the layers run as they always did)."""
    if all(item.lora is None for item in items):
        return None
    counts = [len(item.tokens) for item in items]
    slots = np.repeat([-1 if i.lora is None else i.lora[0] for i in items], counts)
    scales = np.repeat([0.0 if i.lora is None else i.lora[1] for i in items], counts)
    return slots.astype(np.int64), scales.astype(np.float32)


def _decode_groups(
    rows: list[int], tables: list[np.ndarray], lengths: list[int]
) -> tuple[DecodeGroup, ...]:
    widest_first = sorted(range(len(rows)), key=lambda i: -len(tables[i]))
    groups: list[list[int]] = []
    for i in widest_first:
        widest = len(tables[groups[-1][0]]) if groups else 0
        if not groups or (widest > SHORT_BLOCKS and 2 * len(tables[i]) <= widest):
            groups.append([])
        groups[-1].append(i)
    all_rows, all_lengths = np.asarray(rows, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    out = []
    for members in groups:
        width = len(tables[members[0]])
        members.sort()  # row order: a lone group of every row is the batch itself
        padded = np.zeros((len(members), width), dtype=np.int64)
        for j, i in enumerate(members):
            padded[j, : len(tables[i])] = tables[i]
        picked = np.asarray(members)
        out.append(DecodeGroup(all_rows[picked], padded, all_lengths[picked]))
    return tuple(out)


@dataclass(slots=True)
class SeqCache:
    """A private pool holding one sequence, for callers that run a single prompt
    (tests, tools): `Backend.forward` over it is `forward_batch` with one item."""

    kv: object
    table: list[int]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)
