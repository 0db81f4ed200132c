"""Byte-level BPE (`tokenizer.ggml.model = gpt2`) from a GGUF vocabulary, via `tokenizers`.

The vocabulary and merges come from `tokenizer.ggml.tokens` / `.merges`; the
pre-tokenizer regexes are llama.cpp's for the file's `tokenizer.ggml.pre`
(SmolLM2's `smollm` splits every digit first; `qwen2` and `llama3` use their
own). Control and user-defined tokens are matched whole in the text, as
llama.cpp does for prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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

    def encode(self, text: str) -> list[int]:
        if len(text) < RELEASE_GIL_CHARS:
            return list(self._tk.encode(text, add_special_tokens=False).ids)
        # NOTE: `encode` holds the GIL for the whole call (2.4 s for 2 MiB here): the caller's
        # event loop would stall even with this on a worker thread. `encode_batch` releases it.
        (out,) = self._tk.encode_batch([text], add_special_tokens=False)
        return list(out.ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tk.decode(list(ids), skip_special_tokens=False))
