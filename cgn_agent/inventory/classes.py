"""Accelerator classes: one name per kind of device, derived from what the device reports.

class = <model>-<memory>g, where <memory> is the reported memory in GiB rounded
to the nearest integer and <model> is the vendor name shortened:

* NVIDIA: drop the vendor words (NVIDIA, Tesla, GeForce, Quadro), split on
  spaces and dashes, keep the words up to and including the first one with a
  digit, lower-case them and join without separator:
  "NVIDIA H100 80GB HBM3" (81559 MiB) -> h100-80g; "NVIDIA L40S" (46068 MiB)
  -> l40s-45g; "NVIDIA A100-SXM4-80GB" (81920 MiB) -> a100-80g;
  "NVIDIA GeForce RTX 4090" (24564 MiB) -> rtx4090-24g.
* Apple: the chip from the CPU brand string ("Apple M2 Ultra" -> m2-ultra)
  and the unified memory: m2-ultra-192g.
* No accelerator: cpu.

NOTE: the memory comes from the device, not from the marketing name, so two
cards that report the same model and memory always get the same class.
"""

from __future__ import annotations

import re

_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def gib(mib: float) -> int:
    return round(mib / 1024)


def nvidia_class(name: str, memory_mib: int) -> str:
    words = [w for w in re.split(r"[\s\-_]+", name.strip()) if w]
    words = [w for w in words if w.lower() not in _VENDOR_WORDS]
    model: list[str] = []
    for w in words:
        model.append(w.lower())
        if any(c.isdigit() for c in w):
            break
    short = "".join(model) or "nvidia"
    return f"{_slug(short)}-{gib(memory_mib)}g"


def apple_class(chip: str, memory_bytes: int) -> str:
    words = [w.lower() for w in chip.split() if w.lower() != "apple"]
    return f"{_slug('-'.join(words)) or 'apple'}-{round(memory_bytes / 2**30)}g"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9-]", "", s)
