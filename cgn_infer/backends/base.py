"""The narrow interface between the engine and a runtime (torch, MLX, and later `sim`).

The engine owns tokens, sampling and scheduling; a backend owns weights and
KV memory and turns token ids into logits. A KV cache is an opaque handle the
backend creates; the engine passes it back explicitly on every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from cgn_infer.models.args import Args


class Backend(Protocol):
    """A loaded model on one runtime."""

    name: str
    args: Args

    def new_cache(self, max_tokens: int) -> Any:
        """A KV cache able to hold `max_tokens` positions of one sequence."""

    def forward(
        self, tokens: Sequence[int], start_pos: int, cache: Any, *, all_logits: bool = False
    ) -> np.ndarray:
        """Run `tokens` at positions start_pos.. through the model, writing their KV into
        `cache`. Returns float32 logits: [vocab] for the last token, or [T, vocab]."""
