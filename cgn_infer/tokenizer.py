"""Tokenizers built from a GGUF file's own vocabulary (no hub access), matching llama.cpp.

`gpt2`-style byte-level BPE (SmolLM2, Qwen2, Llama 3): the vocabulary and
merges come from `tokenizer.ggml.tokens` / `tokenizer.ggml.merges`; the
pre-tokenizer regexes are llama.cpp's for the file's `tokenizer.ggml.pre`
(e.g. SmolLM2's `smollm` splits every digit first). Control and
user-defined tokens (token types 3 and 4) are matched as whole special tokens
in the text, as llama.cpp does for prompts. Built on the `tokenizers` library.

SentencePiece-style (`llama`) vocabularies are recognised but not supported
yet; loading one fails with a message saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from cgn_infer.gguf_file import GGUFError, GGUFFile

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

CONTROL, USER_DEFINED = 3, 4


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
        if kind != "gpt2":
            raise GGUFError(
                f"{gguf.path}: tokenizer model {kind!r} is not supported yet "
                "(supported: 'gpt2' byte-level BPE)"
            )
        pre = str(gguf.get("tokenizer.ggml.pre", "gpt2"))
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(
                f"{gguf.path}: pre-tokenizer {pre!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
        types = gguf.get("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in range(len(tokens))
            if types is not None and int(types[i]) in (CONTROL, USER_DEFINED)
        ]
        tk.add_special_tokens(special)
        self._tk = tk
        self.vocab_size = len(tokens)
        self.pieces = tokens
        self._control = {
            i for i in range(len(tokens)) if types is not None and int(types[i]) == CONTROL
        }

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
        return self._tk.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        ids: list[int] = self._tk.encode(text, add_special_tokens=False).ids
        bos = self.special.bos
        wants_bos = self.special.add_bos if add_bos is None else add_bos
        if wants_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens (BOS, EOS, ...) left out."""
        return str(
            self._tk.decode([i for i in ids if i not in self._control], skip_special_tokens=False)
        )
