"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) from a GGUF vocabulary, via `tokenizers`.

The vocabulary and merges come from `tokenizer.ggml.tokens` / `.merges`; the
pre-tokenizer regexes are llama.cpp's for the file's `tokenizer.ggml.pre`
(SmolLM2's `smollm` splits every digit first; `qwen2` and `llama3` use their
own). Control and user-defined tokens are matched whole in the text, as
llama.cpp does for prompts.

Segment cache: special tokens cut a text into segments that are tokenized
independently (`tokenizers` splits on added tokens before pre-tokenizing),
so the codec splits on them itself and keeps the ids of long segments in an
LRU (`SegmentCache`). A chat re-sends its system prompt and every earlier
turn with each request: those segments come from the cache and only the new
turn is tokenized. The regex pre-tokenizers cost ~0.3 µs per character here,
which made tokenizing the router's largest cost per request.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from cgn_core.text.gguf_file import GGUFError, GGUFFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer regex chains, applied in order, by `tokenizer.ggml.pre`.
PRE_TOKENIZERS: dict[str, list[str]] = {
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "qwen2": [_QWEN2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
}


RELEASE_GIL_CHARS = 16 << 10  # texts this long are encoded with the GIL released
CACHE_BYTES = 32 << 20  # the segment cache's budget: text, 4 bytes per id, ENTRY_BYTES each
ENTRY_BYTES = 160  # what one entry costs beyond its text and ids (dict slot, str and array heads)


class SegmentCache:
    """Segment text -> its token ids, least recently used out past `budget` bytes.

    Thread-safe: the router and the engine tokenize on the event loop and on worker threads."""

    def __init__(self, budget: int = CACHE_BYTES):
        self.budget = budget
        self.used = 0
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, segment: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get(segment)
            if ids is None:
                return None
            self._ids.move_to_end(segment)
        return ids.tolist()

    def put(self, segment: str, ids: list[int]) -> None:
        cost = _cost(segment, len(ids))
        if cost > self.budget // 4:  # one huge document must not flush everything else
            return
        with self._lock:
            if segment in self._ids:
                return
            self._ids[segment] = array("I", ids)
            self.used += cost
            while self.used > self.budget:
                old, old_ids = self._ids.popitem(last=False)
                self.used -= _cost(old, len(old_ids))


def _cost(segment: str, n_ids: int) -> int:
    return ENTRY_BYTES + len(segment) + 4 * n_ids


class BpeCodec:
    def __init__(self, gguf: GGUFFile, tokens: list[str], special: set[int]):
        pre = str(gguf.get("tokenizer.ggml.pre", "gpt2"))
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(
                f"{gguf.path}: pre-tokenizer {pre!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
        )
        self._tk = tk
        self._special = {tokens[i]: i for i in special}
        by_length = sorted(self._special, key=len, reverse=True)  # leftmost-longest, as tokenizers
        alternatives = "|".join(map(re.escape, by_length))
        self._split = re.compile(f"({alternatives})") if special else None
        self.cache = SegmentCache()

    def encode(self, text: str) -> list[int]:
        return self.encode_parts(self.split(text), 0, None)

    def split(self, text: str) -> list[str]:
        """`text` cut around the special tokens written in it: [segment, special, segment,
        ..., segment] (segments may be empty)."""
        return self._split.split(text) if self._split is not None else [text]

    def encode_parts(self, parts: Sequence[str], start: int, stop: int | None) -> list[int]:
        """The ids of `parts[start:stop]` of a `split`; `start` is a segment's index (even)."""
        out: list[int] = []
        for i in range(start, len(parts) if stop is None else stop):
            part = parts[i]
            if i % 2:  # the split keeps each special token between two segments
                out.append(self._special[part])
            elif part:
                out += self._segment(part)
        return out

    def _segment(self, text: str) -> list[int]:
        """The ids of text holding no special token, through the cache."""
        ids = self.cache.get(text)
        if ids is None:
            ids = self._encode(text)
            self.cache.put(text, ids)
        return ids

    def _encode(self, text: str) -> list[int]:
        if len(text) < RELEASE_GIL_CHARS:
            return list(self._tk.encode(text, add_special_tokens=False).ids)
        # NOTE: `encode` holds the GIL for the whole call (2.4 s for 2 MiB here): the caller's
        # event loop would stall even with this on a worker thread. `encode_batch` releases it.
        (out,) = self._tk.encode_batch([text], add_special_tokens=False)
        return list(out.ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tk.decode(list(ids), skip_special_tokens=False))

    def hf_json(self, bos: int | None) -> str:
        """This tokenizer as a `tokenizer.json` for Hugging Face loaders (mlx_lm's), with
        `bos` put before every encoded text when given (as the GGUF's add_bos_token asks)."""
        tk = Tokenizer.from_str(self._tk.to_str())  # a copy: the codec's own stays as it is
        if bos is not None:
            piece = tk.id_to_token(bos)
            tk.post_processor = processors.TemplateProcessing(
                single=f"{piece} $A", pair=f"{piece} $A {piece} $B", special_tokens=[(piece, bos)]
            )
        return str(tk.to_str())

    def token_bytes(self, piece: str) -> bytes:
        """The bytes a vocabulary piece stands for (byte-level BPE writes each byte as a
        printable character; a piece outside that alphabet is taken as UTF-8 text)."""
        try:
            return bytes(_UNICODE_BYTES[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the
    other 68 are shifted past U+0100 in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return table


_UNICODE_BYTES = _byte_alphabet()
