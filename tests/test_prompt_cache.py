"""The router's prompt prefix cache (cgn_router/prompt_cache.py): a prompt that resumes from a
cached prefix gets exactly the token count and block hashes of the whole computation, for
every bundled tokenizer and template (SmolLM2's and Qwen2.5-Coder's byte-level BPE, a
SentencePiece vocabulary), over random conversations that grow, fork and are edited in the
middle; entries never cross tenants or models; the byte budget holds under a flood.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cgn_core import bundled_models
from cgn_core.kv.blockhash import BLOCK_SIZE, block_hashes
from cgn_core.text.gguf_file import GGUFFile
from cgn_core.text.prompt import PromptCodec
from cgn_router.prompt_cache import PrefixCache
from cgn_router.prompts import HashedPrompt, PromptHasher
from tests.support.tiny_spm import write_tiny_spm

CODECS = ["smollm2", "qwen2.5-coder-0.5b", "tiny-spm"]


@pytest.fixture(scope="module")
def codecs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PromptCodec]]:
    paths = {name: bundled_models.BUNDLED[name]() for name in CODECS[:2]}
    paths["tiny-spm"] = write_tiny_spm(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    files = {name: GGUFFile(path) for name, path in paths.items()}
    yield {name: PromptCodec.from_gguf(f) for name, f in files.items()}
    for f in files.values():
        f.close()


def reference(codec: PromptCodec, kind: str, body: dict[str, Any], ns: str) -> HashedPrompt:
    """The whole computation, no cache: what the engine runs on, hashed."""
    if kind == "chat":
        ids = codec.encode_chat(body["messages"], body.get("tools"))
    else:
        ids = codec.encode_text(body["prompt"])
    return HashedPrompt(tuple(block_hashes(ids, ns)), len(ids), "tokenizer")


def same(got: HashedPrompt, want: HashedPrompt) -> None:
    assert (got.tokens, got.method) == (want.tokens, want.method)
    assert got.blocks == want.blocks


# Text with what breaks tokenizers: every model's special tokens written in the content,
# spaces and newlines at the edges, digits, accents, CJK, emoji, lone surrogate-free controls
PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<|fim_prefix|>",
          " ", "  ", "\n", "\n\n", "\t", "hello", " world", "123", "4567", "é", "日本語", "🤖",
          "'s", "don't", "{", "}", "x" * 40, "the cat sat on the mat. " * 3]  # fmt: skip
text = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(CODECS),
    start=st.lists(message, min_size=1, max_size=5),
    more=st.lists(message, min_size=1, max_size=4),
    edit=st.integers(min_value=0, max_value=8),
    edited=text,
    tools=st.booleans(),
)
def test_a_resumed_prompt_equals_the_whole_computation(
    codecs: dict[str, PromptCodec],
    name: str,
    start: list[dict[str, str]],
    more: list[dict[str, str]],
    edit: int,
    edited: str,
    tools: bool,
) -> None:
    codec = codecs[name]
    hasher = PromptHasher("m", codec, cache=PrefixCache(8 << 20))
    grown = start + more
    changed = [dict(m) for m in grown]
    changed[edit % len(changed)]["content"] = edited  # a message edited in the middle
    extra = {"tools": TOOLS} if tools else {}
    # a conversation, its next turns, a fork of its start, the edit, then all again (hits)
    for messages in [start, grown, start + more[:1], changed, grown, changed, start]:
        body = {"messages": messages, **extra}
        got = hasher.hash("chat", body)
        same(got, reference(codec, "chat", body, "m"))
        event("resumed" if got.reused else "hashed whole")
    # completions that extend an earlier prompt (special tokens written in them: cuts)
    prompts = [m["content"] for m in grown]
    for i in range(1, len(prompts) + 1):
        body = {"prompt": "<|im_start|>".join(prompts[:i])}
        if not body["prompt"]:
            continue  # refused: no prompt
        same(hasher.hash("completion", body), reference(codec, "completion", body, "m"))


def conversation(turns: int, words: int = 60) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You answer briefly. " * 20}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: " + "why is it so? " * words})
        messages.append({"role": "assistant", "content": f"answer {i}: " + "because. " * words})
    return messages


@pytest.mark.parametrize("name", CODECS[:2])
def test_the_next_turn_tokenizes_and_hashes_only_what_is_new(
    codecs: dict[str, PromptCodec], name: str
) -> None:
    codec = codecs[name]
    hasher = PromptHasher("m", codec, cache=PrefixCache(8 << 20))
    first = {"messages": conversation(3)[:-1]}  # ends with a question
    cold = hasher.hash("chat", first)
    assert cold.reused == 0
    turn = {"messages": [*conversation(3), {"role": "user", "content": "and then?"}]}
    warm = hasher.hash("chat", turn)
    same(warm, reference(codec, "chat", turn, "m"))
    # resumed at the last special token of the first prompt whose cut completed a block
    # (entries are kept where one did): only the answer and the new question were tokenized
    assert cold.tokens - BLOCK_SIZE < warm.reused <= cold.tokens  # type: ignore[operator]
    again = hasher.hash("chat", turn)
    assert again.reused is not None and warm.tokens - BLOCK_SIZE < again.reused < warm.tokens
    # an earlier message edited: resumes before it at most, and is still exact
    edited = [dict(m) for m in turn["messages"]]
    edited[3]["content"] = "an edited question"
    body = {"messages": edited}
    got = hasher.hash("chat", body)
    same(got, reference(codec, "chat", body, "m"))
    upto = {"messages": edited[:3]}
    assert got.reused is not None and got.reused <= reference(codec, "chat", upto, "m").tokens


@pytest.mark.parametrize("name", CODECS[:2])
def test_conversations_that_open_alike_share_their_opening(
    codecs: dict[str, PromptCodec], name: str
) -> None:
    """An entry is left at every cut: a new conversation with another's system prompt and
    document resumes after them, and a fork of an earlier turn resumes at the fork."""
    codec = codecs[name]
    hasher = PromptHasher("m", codec, cache=PrefixCache(8 << 20))
    opening = [{"role": "system", "content": "Answer from the document. " * 30},
               {"role": "user", "content": "The document: " + "clause and term. " * 200}]  # fmt: skip
    a = hasher.hash("chat", {"messages": [*opening, {"role": "user", "content": "Who signs?"}]})
    body = {"messages": [*opening, {"role": "user", "content": "When does it end?"}]}
    b = hasher.hash("chat", body)
    # up to the last cut within the opening that completed a block
    shared = len(codec.encode_chat(opening)) - BLOCK_SIZE
    assert a.reused == 0 and b.reused is not None and b.reused >= shared
    same(b, reference(codec, "chat", body, "m"))


def test_entries_never_cross_tenants_models_or_tokenizers(codecs: dict[str, PromptCodec]) -> None:
    cache = PrefixCache(8 << 20)
    smol = PromptHasher("m", codecs["smollm2"], cache=cache)
    body = {"messages": conversation(2)}
    assert smol.hash("chat", body, salt="a").reused == 0
    assert smol.hash("chat", body, salt="a").reused  # the same tenant: a hit
    assert smol.hash("chat", body, salt="b").reused == 0  # another tenant never
    assert smol.hash("chat", body).reused == 0  # nor the unsalted namespace
    assert PromptHasher("other", codecs["smollm2"], cache=cache).hash("chat", body).reused == 0
    # the same model name over another tokenizer and template
    qwen = PromptHasher("m", codecs["qwen2.5-coder-0.5b"], cache=cache)
    got = qwen.hash("chat", body, salt="a")
    assert got.reused == 0
    same(got, reference(codecs["qwen2.5-coder-0.5b"], "chat", body, "m|a"))


def held_bytes(cache: PrefixCache) -> int:
    """What the cache's entries take in memory, measured object by object (a block hash
    shared by two entries counted once)."""
    seen: set[int] = set()
    total = 0

    def once(x: object) -> int:
        if id(x) in seen:
            return 0
        seen.add(id(x))
        return sys.getsizeof(x)

    for key, p in cache._entries.items():
        total += once(key) + once(p) + once(p.own) + once(p.own_keys) + once(p.tail)
        total += sum(once(x) for x in (*p.own, *p.own_keys, *p.tail))
    return total


def test_the_byte_budget_holds_under_a_flood_of_distinct_conversations(
    codecs: dict[str, PromptCodec],
) -> None:
    budget = 1 << 20
    cache = PrefixCache(budget)
    hasher = PromptHasher("m", codecs["smollm2"], cache=cache)
    for i in range(300):  # each ~1,300 tokens, none like another
        messages = [{"role": "system", "content": f"tenant {i} " + "rules. " * 200},
                    {"role": "user", "content": f"q{i} " + "more words " * 150},
                    {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]  # fmt: skip
        hasher.hash("chat", {"messages": messages})
        assert cache.used <= budget
    assert len(cache) > 10  # it holds conversations, the oldest evicted first
    assert held_bytes(cache) <= cache.used <= budget
    # a message bigger than a quarter of the budget is hashed, exactly; neither it nor what
    # follows it is kept (what comes before it may be: the template's default system prompt)
    huge = {"messages": [{"role": "user", "content": "x y " * 40_000}, {"role": "assistant",
            "content": "z"}, {"role": "user", "content": "w"}]}  # fmt: skip
    before = len(cache)
    same(hasher.hash("chat", huge), reference(codecs["smollm2"], "chat", huge, "m"))
    assert len(cache) <= before + 1 and cache.used <= budget
    assert all(p.cost() <= budget // 4 for p in cache._entries.values())


@pytest.mark.parametrize("name", CODECS)
def test_a_completion_of_a_chats_own_text_does_not_take_the_chats_entries(
    codecs: dict[str, PromptCodec], name: str
) -> None:
    """A client that templates the chat itself sends its text to /v1/completions, where the
    tokenizer may put BOS first (the SentencePiece vocabulary does; a chat's template writes
    its own): the entries are not shared."""
    codec = codecs[name]
    hasher = PromptHasher("m", codec, cache=PrefixCache(8 << 20))
    # "</s>": a special token of the SentencePiece vocabulary, so its text has cuts too
    body = {"messages": [{"role": "system", "content": "Rules. </s> " * 40},
                         {"role": "user", "content": "A question </s> " * 40}]}  # fmt: skip
    hasher.hash("chat", body)
    text = {"prompt": codec.chat_text(body["messages"])}
    got = hasher.hash("completion", text)
    same(got, reference(codec, "completion", text, "m"))
    if codec.tokenizer.special.add_bos:
        assert got.reused == 0
    else:  # the same ids either way: the chat's entries serve
        assert got.reused


def test_a_prompt_without_a_special_token_is_hashed_whole(codecs: dict[str, PromptCodec]) -> None:
    cache = PrefixCache(8 << 20)
    hasher = PromptHasher("m", codecs["smollm2"], cache=cache)
    body = {"prompt": "plain text with no special token " * 30}
    got = hasher.hash("completion", body)
    assert got.reused is None and len(cache) == 0  # nowhere to resume: not looked up
    same(got, reference(codecs["smollm2"], "completion", body, "m"))
    off = PromptHasher("m", codecs["smollm2"], cache=PrefixCache(0))
    assert off.cache is None and off.hash("chat", {"messages": conversation(1)}).reused is None


def test_split_and_encode_parts_are_encode(codecs: dict[str, PromptCodec]) -> None:
    for name, codec in codecs.items():
        tk = codec.tokenizer
        text = "a<|im_start|>b c<s>d</s><|im_end|>\n<|endoftext|>"
        parts = tk.split(text)
        assert "".join(parts) == text and len(parts) % 2 == 1
        assert tk.encode_parts(parts) == tk.encode(text), name
        for cut in range(2, len(parts), 2):
            joined = tk.encode_parts(parts, 0, cut) + tk.encode_parts(parts, cut)
            assert joined == tk.encode(text), (name, cut)
        with pytest.raises(ValueError, match="even index"):
            tk.encode_parts(parts, 1)


def test_the_prefix_cache_lives_in_the_catalog_with_its_setting(tmp_path: Path) -> None:
    from cgn_router.catalog import Catalog
    from cgn_router.settings import RoutingSettings

    assert RoutingSettings().prompt_cache_mib == 64
    assert Catalog(64, 3).prompts.budget == 3 << 20
    assert Catalog(64).prompts.budget == 0
