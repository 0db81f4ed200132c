"""Tokenized and hashed prompt prefixes, so that a conversation's next turn costs the router
what is new in it, not its whole history again.

Chat clients resend the system prompt and every earlier turn with each request. A prompt is
cut at the special tokens its template writes (`GGUFTokenizer.split`): the pieces between
them are tokenized independently, so the token ids up to any such cut are the leading ids
of the whole prompt, whatever follows it. Each prompt the router hashes leaves one entry at
its last cut: the block hashes of its full blocks, the ids after them (fewer than a block)
and its length in tokens. The next prompt looks up each of its own cuts, longest first, and
tokenizes and hashes only what follows the longest one found.

A key is the BLAKE3 of the prompt's text up to the cut, under the hash namespace (the model,
salted per tenant and adapter) and the tokenizer and template: entries never cross models,
templates or tenants, and an edited earlier message changes every later key, so it misses.
Entries are evicted least recently used first past a byte budget (`routing.prompt_cache_mib`,
per router worker).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

from cgn_core.kv.blockhash import BlockHash

KEY_DOMAIN = b"cognitora.prompt.v1\0"
# what one entry costs beyond its blocks: the key, the dict slot, the tuples' and the
# entry's own heads
ENTRY_BYTES = 320
# each block: its 32-byte hash as a bytes object, and its slot in the entry's tuple (an entry
# that extends another shares its hash objects; each is counted in full, so the budget holds)
BLOCK_BYTES = sys.getsizeof(bytes(32)) + 8
ID_BYTES = 36  # an id after the last full block: a small int and its tuple slot


@dataclass(frozen=True, slots=True)
class Prefix:
    """A prompt up to one of its cuts, tokenized and hashed."""

    blocks: tuple[BlockHash, ...]  # the hashes of its full blocks
    tail: tuple[int, ...]  # the ids after them (fewer than a block)
    tokens: int  # its length in tokens

    def cost(self) -> int:
        return ENTRY_BYTES + BLOCK_BYTES * len(self.blocks) + ID_BYTES * len(self.tail)


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

    def longest(self, keys: list[bytes]) -> tuple[int, Prefix] | None:
        """The last of `keys` (ordered shortest prefix first) that is held, with its index."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                got = self._entries.get(keys[i])
                if got is not None:
                    self._entries.move_to_end(keys[i])
                    return i, got
        return None

    def put(self, key: bytes, prefix: Prefix) -> None:
        cost = prefix.cost()
        if cost > self.budget // 4:  # one huge prompt must not flush every conversation
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old.cost()
            self._entries[key] = prefix
            self.used += cost
            while self.used > self.budget:
                _, gone = self._entries.popitem(last=False)
                self.used -= gone.cost()
