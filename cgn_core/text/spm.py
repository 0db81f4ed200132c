"""SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`), as llama.cpp tokenizes them.

Algorithm (llama.cpp's SPM tokenizer): the text gets a leading space (when
`tokenizer.ggml.add_space_prefix`, at the start and after each special
token), spaces become "▁", and the text is split into UTF-8 characters.
Adjacent pairs whose concatenation is a vocabulary token enter a priority
queue keyed by that token's score (highest first; ties to the leftmost);
merges repeat until no pair is in the vocabulary. A piece that is not itself
a token is split back along the merges that built it, and what remains
unknown falls back to `<0xXX>` byte tokens.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

from cgn_core.text.gguf_file import GGUFFile

BYTE_TOKEN = 6
_BYTE_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class SpmCodec:
    def __init__(self, gguf: GGUFFile, tokens: list[str], special: set[int], types: Sequence[int]):
        scores = gguf.get("tokenizer.ggml.scores")
        self.scores = [float(s) for s in scores] if scores is not None else [0.0] * len(tokens)
        self.tokens = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.byte_ids: dict[int, int] = {}
        self.byte_of: dict[int, int] = {}
        for i, t in enumerate(tokens):
            if int(types[i]) == BYTE_TOKEN and (m := _BYTE_RE.match(t)):
                self.byte_ids[int(m.group(1), 16)] = i
                self.byte_of[i] = int(m.group(1), 16)
        self.add_space_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
        self.unk = int(gguf.get("tokenizer.ggml.unknown_token_id", 0))
        texts = sorted((tokens[i] for i in special if tokens[i]), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._special = {tokens[i]: i for i in special}

    def encode(self, text: str) -> list[int]:
        return self.encode_parts(self.split(text), 0, None)

    def split(self, text: str) -> list[str]:
        """`text` cut around the special tokens written in it: [segment, special, segment,
        ..., segment] (segments may be empty)."""
        parts, pos = [], 0
        for m in self._special_re.finditer(text) if self._special_re else ():
            parts += [text[pos : m.start()], m.group()]
            pos = m.end()
        parts.append(text[pos:])
        return parts

    def encode_parts(self, parts: Sequence[str], start: int, stop: int | None) -> list[int]:
        """The ids of `parts[start:stop]` of a `split`; `start` is a segment's index (even).
        Every segment starts the text or follows a special token: each gets the space prefix."""
        out: list[int] = []
        for i in range(start, len(parts) if stop is None else stop):
            if i % 2:
                out.append(self._special[parts[i]])
            elif parts[i]:
                out += self._fragment(parts[i], True)
        return out

    def _fragment(self, text: str, prefix: bool) -> list[int]:
        if prefix and self.add_space_prefix:
            text = " " + text
        symbols = list(text.replace(" ", "\u2581"))
        alive = [True] * len(symbols)
        nxt = list(range(1, len(symbols) + 1))
        prv = list(range(-1, len(symbols) - 1))
        built: dict[str, tuple[str, str]] = {}
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right >= len(symbols):
                return
            merged = symbols[left] + symbols[right]
            if (tid := self.vocab.get(merged)) is not None:
                heapq.heappush(heap, (-self.scores[tid], left, right, merged))
                built.setdefault(merged, (symbols[left], symbols[right]))

        for i in range(len(symbols) - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or symbols[left] + symbols[right] != merged:
                continue  # stale: one side changed since this pair was queued
            symbols[left], alive[right] = merged, False
            nxt[left] = nxt[right]
            if nxt[left] < len(symbols):
                prv[nxt[left]] = left
            push(prv[left], left)
            push(left, nxt[left])
        out: list[int] = []
        for i, sym in enumerate(symbols):
            if alive[i]:
                self._resegment(sym, built, out)
        return out

    def _resegment(self, piece: str, built: dict[str, tuple[str, str]], out: list[int]) -> None:
        if (tid := self.vocab.get(piece)) is not None:
            out.append(tid)
        elif piece in built:
            left, right = built[piece]
            self._resegment(left, built, out)
            self._resegment(right, built, out)
        else:
            for b in piece.encode("utf-8"):
                out.append(self.byte_ids.get(b, self.unk))

    def token_bytes(self, piece: str) -> bytes:
        """The bytes a vocabulary piece stands for (`<0xXX>` byte tokens included)."""
        i = self.vocab.get(piece)
        if i is not None and i in self.byte_of:
            return bytes([self.byte_of[i]])
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        buf = bytearray()
        for i in ids:
            if i in self.byte_of:
                buf.append(self.byte_of[i])
            else:
                buf += self.tokens[i].replace("\u2581", " ").encode("utf-8")
        return buf.decode("utf-8", errors="replace")
