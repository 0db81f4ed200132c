"""A request body's prompt as block hashes, the way the engine will hash it.

Three methods, counted in `cgn_router_prompts_hashed_total{method}`:

* `token_ids`: a completion whose prompt is token ids: hashed as is (exact);
* `tokenizer`: the model's own tokenizer and chat template (cgn_core.text, the
  code cgn-infer runs), loaded from the GGUF named in the catalog (exact);
* `chars`: no tokenizer configured: blocks of `chars_per_block` characters,
  hashed in a separate namespace. Only the router's own approximate tracking
  can match these; an engine's KV events never do.

With a tokenizer, a prompt whose leading part was hashed before (a conversation's history,
resent with every turn) resumes from the prefix cache (prompt_cache.py) and tokenizes and
hashes only what follows: the same ids and hashes as the whole computation, at the cost of
what is new.

A body the shared validation refuses is not refused here (the engine has the
last word, and may accept more, e.g. image parts): it routes with no blocks.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from blake3 import blake3

from cgn_core.errors import InvalidRequest
from cgn_core.kv.blockhash import (
    BLOCK_SIZE,
    ROOT,
    BlockHash,
    block_hashes,
    namespace,
    salted,
)
from cgn_core.openai.tools import tool_fields
from cgn_core.text.prompt import PromptCodec, chat_messages, completion_prompt
from cgn_router.prompt_cache import KEY_DOMAIN, Prefix, PrefixCache
from cgn_router.routing.kv_index import KeyedBlocks
from cgn_router.routing.kv_index import key as index_key

Method = Literal["token_ids", "tokenizer", "chars", "none"]
CHARS_PER_TOKEN = 4  # for prompt-size estimates without a tokenizer
MAX_CUTS = 256  # a prompt's last cuts looked up in the prefix cache (a conversation's turns)


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    blocks: tuple[BlockHash, ...]
    tokens: int  # prompt length in tokens (estimated for `chars`)
    method: Method
    reused: int | None = None  # tokens taken from the prefix cache (None: not looked up)


class PromptHasher:
    """Block hashes of one model's prompts; `cache` (shared by a router worker's hashers)
    holds the prefixes of those hashed by a tokenizer."""

    def __init__(
        self,
        model: str,
        codec: PromptCodec | None,
        chars_per_block: int = 64,
        cache: PrefixCache | None = None,
        tag: bytes | None = None,
    ):
        self.ns = namespace(model)
        self.codec = codec
        self.chars_per_block = max(BLOCK_SIZE, chars_per_block)
        self.cache = cache if codec is not None and cache is not None and cache.budget else None
        self.tag = b""  # the codec's identity in the cache's keys (`codec_tag`)
        if self.cache is not None and codec is not None:
            self.tag = tag or codec_tag(codec)

    def hash(self, kind: str, body: Mapping[str, Any], salt: str | None = None) -> HashedPrompt:
        """The prompt's block hashes, in the namespace of `salt` (its tenant's) when set: what
        the engine's pool and the node's store hold under it (cgn_core/kv/blockhash.py)."""
        ns = salted(self.ns, salt)
        try:
            if kind == "chat":
                messages = chat_messages(body)
                if self.codec is not None:
                    tools = tool_fields(body).rendered  # part of the prompt the engine hashes
                    return self._text(self.codec.chat_text(messages, tools), False, ns)
                joined = "".join(f"\x00{m['role']}\x00{m['content']}" for m in messages)
                return self._chars(joined, ns)
            if kind == "completion":
                text, ids = completion_prompt(body)
                if ids is not None:
                    return self._tokens(list(ids), "token_ids", ns)
                assert text is not None
                if self.codec is not None:
                    return self._text(text, None, ns)
                return self._chars(text, ns)
        except InvalidRequest:
            pass
        return HashedPrompt((), 0, "none")

    def _text(self, text: str, add_bos: bool | None, ns: str) -> HashedPrompt:
        """`text` through the tokenizer, resuming at the longest of its cuts (just after a
        special token) the prefix cache holds, and leaving an entry at each cut after it that
        completes a block."""
        assert self.codec is not None
        tk = self.codec.tokenizer
        parts = tk.split(text)
        if self.cache is None or len(parts) < 3:  # no cut to resume at
            return self._tokens(tk.encode_parts(parts, add_bos=add_bos), "tokenizer", ns)
        bos = tk.special.add_bos if add_bos is None else add_bos  # a chat's template writes its own
        first, keys = self._keys(parts, ns, bos)
        hit = self.cache.longest(keys)
        run = _Run(hit[1] if hit else None, ns)
        done, pos = (hit[0] + 1, first + 2 * hit[0]) if hit else (0, 0)
        made: list[Prefix] = []
        for i in range(done, len(keys)):  # the cuts after the one resumed at
            cut = first + 2 * i
            run.add(tk.encode_parts(parts, pos, cut, add_bos=add_bos))
            if run.own:  # a block completed since the last entry: an entry here
                made.append(run.keep(keys[i]))
            pos = cut
        self.cache.put(made)
        run.add(tk.encode_parts(parts, pos, add_bos=add_bos))
        hashes, index_keys = run.keep(b"").blocks()
        blocks = KeyedBlocks.of(hashes, index_keys)
        return HashedPrompt(blocks, run.tokens, "tokenizer", hit[1].tokens if hit else 0)

    def _keys(self, parts: list[str], ns: str, bos: bool) -> tuple[int, list[bytes]]:
        """The keys of the prompt up to each of its last MAX_CUTS cuts (shortest first), and
        the index in `parts` of the first of those cuts. `bos`: whether the tokenizer puts
        BOS first (a completion's text may be a chat's, templated by the client)."""
        first = max(2, len(parts) - 1 - 2 * (MAX_CUTS - 1))
        head = KEY_DOMAIN + self.tag + b"\0" + ns.encode("utf-8") + (b"\0B" if bos else b"\0-")
        h = blake3(head)
        _feed(h, "".join(parts[: first - 1]))
        keys = []
        for i in range(first - 1, len(parts) - 1):
            _feed(h, parts[i])
            if i % 2:  # a special token: a cut after it
                keys.append(h.copy().digest())
        return first, keys

    def _tokens(self, ids: list[int], method: Method, ns: str) -> HashedPrompt:
        return HashedPrompt(tuple(block_hashes(ids, ns)), len(ids), method)

    def _chars(self, text: str, ns: str) -> HashedPrompt:
        step = self.chars_per_block // BLOCK_SIZE  # characters per pseudo-token
        pseudo = [
            zlib.crc32(text[i : i + step].encode("utf-8", "surrogatepass"))
            for i in range(0, len(text) - len(text) % step, step)
        ]
        hashes = block_hashes(pseudo, ns + "|chars")
        return HashedPrompt(tuple(hashes), len(text) // CHARS_PER_TOKEN, "chars")


class _Run:
    """A prompt tokenized and hashed so far, from `start` (a cached entry; None: the
    beginning): the blocks completed since the last entry made (`own`), the ids after them."""

    def __init__(self, start: Prefix | None, ns: str):
        self.ns, self.parent = ns, start
        self.own: list[BlockHash] = []
        self.tail: list[int] = list(start.tail) if start else []
        self.tokens = start.tokens if start else 0
        self.last = start.last if start else ROOT

    def add(self, ids: list[int]) -> None:
        self.tail += ids
        self.tokens += len(ids)
        full = len(self.tail) - len(self.tail) % BLOCK_SIZE
        if full:
            made = block_hashes(self.tail[:full], self.ns, self.last)
            self.own += made
            self.last = made[-1]
            del self.tail[:full]

    def keep(self, key: bytes) -> Prefix:
        """An entry for the prompt so far under `key`; the next extends it."""
        own = tuple(self.own)
        p = Prefix(self.parent, key, own, tuple(map(index_key, own)), tuple(self.tail),
                   self.tokens, self.last)  # fmt: skip
        self.parent, self.own = p, []
        return p


# NOTE: blake3 (as hashlib) releases the GIL for an input over ~2 KiB, and a thread then
# waits up to the interpreter's switch interval (5 ms) to take it back from a busy event
# loop: on a worker thread (a big body), one message at a time cost the router ~47 % of its
# CPU profile at c=64 on Mooncake's conversations. Fed in slices, it keeps the GIL.
FEED_BYTES = 1024


def _feed(h: Any, text: str) -> None:
    data = memoryview(text.encode("utf-8", "surrogatepass"))
    for i in range(0, len(data), FEED_BYTES):
        h.update(data[i : i + FEED_BYTES])


def codec_tag(codec: PromptCodec) -> bytes:
    """What tells one tokenizer and template from another in the prefix cache's keys."""
    h = blake3(codec.template.source.encode("utf-8", "surrogatepass") + b"\0")
    h.update("\0".join(codec.tokenizer.pieces).encode("utf-8", "surrogatepass"))
    return h.digest()
