"""Tokenized and hashed prompt prefixes, so that a conversation's next turn costs the router
what is new in it, not its whole history again.

Chat clients resend the system prompt and every earlier turn with each request, and many
conversations open with the same system prompt or document. A prompt is cut at the special
tokens its template writes (`GGUFTokenizer.split`): the pieces between them are tokenized
independently, so the token ids up to any such cut are the leading ids of the whole prompt,
whatever follows it. A prompt the router hashes leaves an entry at each of its cuts: the
block hashes completed since the previous cut (with their KV-index keys), the ids after the
last full block (fewer than a block) and the length in tokens, chained to the entry of the
cut before. The next prompt looks up its own cuts, longest first, and tokenizes and hashes
only what follows the longest one found: its own history, or another conversation's shared
opening.

A key is the BLAKE3 of the prompt's text up to the cut, under the hash namespace (the model,
salted per tenant and adapter), the tokenizer and template, and whether BOS leads (a chat's
template writes its own; a completion of the same text may get one): entries never cross
models, templates or tenants, and an edited earlier message changes every later key, so it
misses.

Entries are evicted least recently used first past a byte budget (`routing.prompt_cache_mib`,
per router worker). An entry is always touched after the entries it extends, so those go
last: an entry evicted has no descendant left, and its bytes are really freed.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cgn_core.kv.blockhash import BlockHash

KEY_DOMAIN = b"cognitora.prompt.v1\0"
# what one entry costs beyond its blocks: the key, the dict slot, the entry and its tuples'
# heads
ENTRY_BYTES = 400
# each block: its 32-byte hash as a bytes object, its index key as an int, and their slots
BLOCK_BYTES = sys.getsizeof(bytes(32)) + sys.getsizeof(1 << 62) + 16
ID_BYTES = 36  # an id after the last full block: a small int and its tuple slot


@dataclass(frozen=True, slots=True, eq=False)
class Prefix:
    """A prompt up to one of its cuts, tokenized and hashed: what its parent (the cut before,
    None: the start) holds, then `own`."""

    parent: Prefix | None
    key: bytes  # in the cache (b"": not kept)
    own: tuple[BlockHash, ...]  # the hashes of the full blocks completed since the parent
    own_keys: tuple[int, ...]  # their KV-index keys
    tail: tuple[int, ...]  # the ids after the last full block (fewer than a block)
    tokens: int  # its length in tokens
    last: BlockHash  # the hash of its last full block (ROOT: none), which the next chain on

    def cost(self) -> int:
        return ENTRY_BYTES + BLOCK_BYTES * len(self.own) + ID_BYTES * len(self.tail)

    def lineage(self) -> list[Prefix]:
        """This entry and those it extends, the start's first."""
        out: list[Prefix] = []
        p: Prefix | None = self
        while p is not None:
            out.append(p)
            p = p.parent
        out.reverse()
        return out

    def blocks(self) -> tuple[tuple[BlockHash, ...], list[int]]:
        """Every full block's hash up to here, and their KV-index keys."""
        line = self.lineage()
        hashes = tuple(itertools.chain.from_iterable(p.own for p in line))
        return hashes, list(itertools.chain.from_iterable(p.own_keys for p in line))


class PrefixCache:
    """Key → Prefix, least recently used out past `budget` bytes. Thread-safe: prompts are
    hashed on the event loop and, when big, on worker threads."""

    def __init__(self, budget: int):
        self.budget = max(0, budget)
        self.used = 0
        self._entries: OrderedDict[bytes, Prefix] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, keys: Sequence[bytes]) -> tuple[int, Prefix] | None:
        """The last of `keys` (ordered shortest prefix first) that is held, with its index;
        it and the entries it extends are touched."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                got = self._entries.get(keys[i])
                if got is not None:
                    self._touch(got)
                    return i, got
        return None

    def put(self, entries: Sequence[Prefix]) -> None:
        """Keep `entries`, a chain each extending the one before (the first extends a held
        entry or none), up to the first one that is held already (another thread's) or
        costs over a quarter of the budget (one huge message must not flush every
        conversation): what follows it would keep it alive uncounted. What they extend is
        touched after them, so it outlives them."""
        with self._lock:
            kept = 0
            for p in entries:
                if p.key in self._entries or p.cost() > self.budget // 4:
                    break
                kept += 1
            for p in reversed(entries[:kept]):  # the longest first: the oldest of the chain
                self._entries[p.key] = p
                self.used += p.cost()
            if entries and entries[0].parent is not None:
                self._touch(entries[0].parent)
            while self.used > self.budget and self._entries:
                _, gone = self._entries.popitem(last=False)
                self.used -= gone.cost()

    def _touch(self, p: Prefix | None) -> None:
        """`p`, then each entry it extends, to the most recent end."""
        entries = self._entries
        while p is not None:
            if entries.get(p.key) is p:
                entries.move_to_end(p.key)
            p = p.parent
