"""Apple silicon: chip and unified memory from `sysctl`, GPU cores from `system_profiler`.

SYSCTL_QUERY prints "name: value" lines; the chip comes from
machdep.cpu.brand_string ("Apple M2 Ultra"), the unified memory from
hw.memsize (bytes). The GPU shares that memory, so the accelerator's memory
is all of it; placement decides how much a model may take.
"""

from __future__ import annotations

import json
from typing import Any

from cgn_agent.inventory.classes import apple_class
from cgn_agent.inventory.types import Accelerator, Cpu

SYSCTL_QUERY = ("sysctl", "machdep.cpu.brand_string", "hw.memsize", "hw.ncpu")
PROFILER_QUERY = ("system_profiler", "SPDisplaysDataType", "-json")


def parse_sysctl(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def apple_inventory(sysctl_text: str, profiler_json: str | None) -> tuple[Cpu, Accelerator | None]:
    """The CPU and, on Apple silicon, the GPU; an Intel Mac has no accelerator here."""
    s = parse_sysctl(sysctl_text)
    chip = s.get("machdep.cpu.brand_string", "unknown")
    memsize = int(s["hw.memsize"])
    cpu = Cpu(chip, int(s.get("hw.ncpu", "1")), memsize // 2**20)
    if not chip.startswith("Apple"):
        return cpu, None
    topology: dict[str, Any] = {}
    if profiler_json:
        for item in json.loads(profiler_json).get("SPDisplaysDataType", []):
            if "sppci_cores" in item:
                topology["gpu_cores"] = int(item["sppci_cores"])
    gpu = Accelerator(
        kind="apple",
        index=0,
        name=chip,
        accel_class=apple_class(chip, memsize),
        memory_mib=memsize // 2**20,
        topology=topology,
    )
    return cpu, gpu
