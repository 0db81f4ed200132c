"""Incremental detokenization and stop strings for streamed generations.

Text is emitted only once it is stable: a token that ends in the middle of a
UTF-8 character (the decoder yields U+FFFD) is held until the character is
complete, and the tail that could still grow into a stop string is held back
until it cannot. When a stop string appears, the text before it is the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(slots=True)
class IncrementalText:
    decoder: Decoder
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # all stable text decoded so far
    emitted: int = 0  # how much of `text` has been handed out
    _prefix: int = 0
    _read: int = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Append one token; return (new text safe to emit, whether a stop string was hit)."""
        self.tokens.append(token)
        before = self.decoder.decode(self.tokens[self._prefix : self._read])
        after = self.decoder.decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return self._take(len(self.text)), True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._take(max(self.emitted, len(self.text) - hold)), False

    def flush(self) -> str:
        """Everything not yet emitted (at the end of the generation)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out
