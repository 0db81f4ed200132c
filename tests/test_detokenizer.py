"""Incremental detokenization: UTF-8 split across tokens, stop strings across tokens."""

from __future__ import annotations

from collections.abc import Sequence

from cgn_infer.detokenizer import IncrementalText

# A byte-level toy vocabulary: token i is one byte string.
PIECES = [b"Hel", b"lo", b" w", b"\xe6\x97", b"\xa5", b"END", b"or", b"ld", b"!"]


class Bytes:
    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def run(tokens: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    inc = IncrementalText(Bytes(), stop)
    out, hit = [], False
    for t in tokens:
        delta, hit = inc.add(t)
        out.append(delta)
        if hit:
            break
    return out, hit, inc.flush()


def test_text_streams_and_waits_for_whole_characters() -> None:
    out, hit, rest = run([0, 1, 2, 3, 4, 8])
    assert out == ["Hel", "lo", " w", "", "日", "!"] and not hit and rest == ""


def test_stop_string_across_tokens_is_cut_and_never_emitted() -> None:
    out, hit, rest = run([0, 1, 2, 6, 7, 8], stop=("world",))
    assert hit and "".join(out) + rest == "Hello "
    assert "w" not in "".join(out)


def test_held_back_tail_is_flushed_at_the_end() -> None:
    out, hit, rest = run([0, 1, 2], stop=("wxyz",))
    assert not hit and "".join(out) + rest == "Hello w"
    assert out[-1] != " w"  # " w" could still have become a stop string
