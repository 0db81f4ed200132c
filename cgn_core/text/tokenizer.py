"""Tokenizers built from a GGUF file's own vocabulary (no hub access), matching llama.cpp.

Two vocabulary families, each in its own module: byte-level BPE (`gpt2`:
SmolLM2, Qwen2, Llama 3; `bpe.py`) and SentencePiece-style (`llama`: Llama 2,
Mistral; `spm.py`). This facade adds what both share: special tokens, BOS,
the stop set, and decoding that leaves control tokens out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cgn_core.text.bpe import BpeCodec
from cgn_core.text.gguf_file import GGUFError, GGUFFile
from cgn_core.text.spm import SpmCodec

CONTROL, USER_DEFINED = 3, 4


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def split(self, text: str) -> list[str]: ...
    def encode_parts(self, parts: Sequence[str], start: int, stop: int | None) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_bytes(self, piece: str) -> bytes: ...


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    bos: int | None
    eos: int | None
    eot: int | None  # end-of-turn, where the model has one distinct from EOS
    add_bos: bool


class GGUFTokenizer:
    """Encode/decode with the vocabulary stored in a GGUF file."""

    def __init__(self, gguf: GGUFFile):
        kind = gguf.require("tokenizer.ggml.model")
        tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
        types = gguf.get("tokenizer.ggml.token_type")
        if types is None:
            types = [1] * len(tokens)
        special = {i for i, t in enumerate(types) if int(t) in (CONTROL, USER_DEFINED)}
        self._codec: Codec
        if kind == "gpt2":
            self._codec = BpeCodec(gguf, tokens, special)
        elif kind == "llama":
            self._codec = SpmCodec(gguf, tokens, special, types)
        else:
            raise GGUFError(
                f"{gguf.path}: tokenizer model {kind!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
            )
        self.vocab_size = len(tokens)
        self.pieces = tokens
        self._control = {i for i, t in enumerate(types) if int(t) == CONTROL}

        def opt(key: str) -> int | None:
            value = gguf.get(key)
            return None if value is None else int(value)

        self.special = SpecialTokens(
            bos=opt("tokenizer.ggml.bos_token_id"),
            eos=opt("tokenizer.ggml.eos_token_id"),
            eot=opt("tokenizer.ggml.eot_token_id"),
            add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        )

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end generation (EOS and end-of-turn)."""
        return frozenset(t for t in (self.special.eos, self.special.eot) if t is not None)

    def token_text(self, token_id: int) -> str:
        """The text a single token stands for ('' for control tokens)."""
        if token_id in self._control:
            return ""
        return self._codec.decode([token_id])

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id; a control token (BOS, EOS, <|im_end|>) is its name
        behind a 0xFF byte, which no text contains (llguidance's and llama.cpp's convention),
        so a grammar over text can never produce one."""
        return [
            b"\xff" + piece.encode("utf-8")
            if i in self._control
            else self._codec.token_bytes(piece)
            for i, piece in enumerate(self.pieces)
        ]

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        return self.encode_parts(self.split(text), add_bos=add_bos)

    def split(self, text: str) -> list[str]:
        """`text` cut around the special tokens written in it: [segment, special, segment,
        ..., segment]. Segments are tokenized independently (as llama.cpp and `tokenizers`
        do), so where `i` is even (just after a special token) the ids of `parts[:i]` are
        the leading ids of the whole text's, whatever follows: a safe place to resume."""
        return self._codec.split(text)

    def encode_parts(
        self,
        parts: Sequence[str],
        start: int = 0,
        stop: int | None = None,
        *,
        add_bos: bool | None = None,
    ) -> list[int]:
        """The ids of `parts[start:stop]` of a `split` (`start` even); BOS is only ever put
        first, where `start` is 0."""
        if start % 2 or start < 0:
            raise ValueError(f"parts resume at a segment (an even index), got {start}")
        ids = self._codec.encode_parts(parts, start, stop)
        if start:
            return ids
        bos = self.special.bos
        wants_bos = self.special.add_bos if add_bos is None else add_bos
        if wants_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def hf_json(self) -> str:
        """The vocabulary as a Hugging Face `tokenizer.json` (an MLX model directory's
        tokenizer); byte-level BPE only."""
        if not isinstance(self._codec, BpeCodec):
            raise GGUFError(
                "only byte-level BPE vocabularies ('gpt2') convert to a tokenizer.json; "
                "this file's is SentencePiece-style ('llama')"
            )
        return self._codec.hf_json(self.special.bos if self.special.add_bos else None)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens (BOS, EOS, ...) left out."""
        return self._codec.decode([i for i in ids if i not in self._control])
