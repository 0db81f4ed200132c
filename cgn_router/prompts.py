"""A request body's prompt as block hashes, the way the engine will hash it.

Three methods, counted in `cgn_router_prompts_hashed_total{method}`:

* `token_ids`: a completion whose prompt is token ids: hashed as is (exact);
* `tokenizer`: the model's own tokenizer and chat template (cgn_core.text, the
  code cgn-infer runs), loaded from the GGUF named in the catalog (exact);
* `chars`: no tokenizer configured: blocks of `chars_per_block` characters,
  hashed in a separate namespace. Only the router's own approximate tracking
  can match these; an engine's KV events never do.

A body the shared validation refuses is not refused here (the engine has the
last word, and may accept more, e.g. image parts): it routes with no blocks.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cgn_core.errors import InvalidRequest
from cgn_core.kv.blockhash import BLOCK_SIZE, BlockHash, block_hashes, namespace, salted
from cgn_core.openai.tools import tool_fields
from cgn_core.text.prompt import PromptCodec, chat_messages, completion_prompt

Method = Literal["token_ids", "tokenizer", "chars", "none"]
CHARS_PER_TOKEN = 4  # for prompt-size estimates without a tokenizer


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    blocks: tuple[BlockHash, ...]
    tokens: int  # prompt length in tokens (estimated for `chars`)
    method: Method


class PromptHasher:
    """Block hashes of one model's prompts."""

    def __init__(self, model: str, codec: PromptCodec | None, chars_per_block: int = 64):
        self.ns = namespace(model)
        self.codec = codec
        self.chars_per_block = max(BLOCK_SIZE, chars_per_block)

    def hash(self, kind: str, body: Mapping[str, Any], salt: str | None = None) -> HashedPrompt:
        """The prompt's block hashes, in the namespace of `salt` (its tenant's) when set: what
        the engine's pool and the node's store hold under it (cgn_core/kv/blockhash.py)."""
        ns = salted(self.ns, salt)
        try:
            if kind == "chat":
                messages = chat_messages(body)
                if self.codec is not None:
                    tools = tool_fields(body).rendered  # part of the prompt the engine hashes
                    encoded = self.codec.encode_chat(messages, tools)
                    return self._tokens(encoded, "tokenizer", ns)
                joined = "".join(f"\x00{m['role']}\x00{m['content']}" for m in messages)
                return self._chars(joined, ns)
            if kind == "completion":
                text, ids = completion_prompt(body)
                if ids is not None:
                    return self._tokens(list(ids), "token_ids", ns)
                assert text is not None
                if self.codec is not None:
                    return self._tokens(self.codec.encode_text(text), "tokenizer", ns)
                return self._chars(text, ns)
        except InvalidRequest:
            pass
        return HashedPrompt((), 0, "none")

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
