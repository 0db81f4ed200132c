"""Node power from the sources a machine has; "unknown" where it has none.

Sources, summed when several exist (each covers different parts):
* `rapl`: CPU package energy counters, /sys/class/powercap/intel-rapl:<n>/energy_uj
  (top-level zones only; sub-zones are contained in them). Watts come from the
  counter's delta between two reads, wrapping at max_energy_range_uj.
  Recent kernels make energy_uj root-readable only; then RAPL is unknown, and
  the reading says why.
* `nvidia`: per-GPU board power (NVML, or nvidia-smi's power.draw).
* `powermetrics`: Apple's "Combined Power (CPU + GPU + ANE): N mW" line
  (powermetrics needs root; the agent runs it only when configured to).

A reading never invents a figure: no source, or no second RAPL sample yet,
is `watts=None`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

POWERCAP_ROOT = Path("/sys/class/powercap")
POWERMETRICS_QUERY = ("powermetrics", "--samplers", "cpu_power,gpu_power", "-n", "1", "-i", "500")
_COMBINED = re.compile(r"Combined Power \(CPU \+ GPU \+ ANE\):\s*([\d.]+)\s*mW")


@dataclass(frozen=True, slots=True)
class PowerReading:
    watts: float | None
    source: str  # "rapl+nvidia", "powermetrics", "unknown"
    parts: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RaplZone:
    name: str
    energy_path: Path
    max_uj: int


def rapl_zones(
    root: Path = POWERCAP_ROOT, read: Callable[[Path], str] = Path.read_text
) -> tuple[list[RaplZone], list[str]]:
    """Readable top-level RAPL zones, and notes on the ones that are not."""
    zones: list[RaplZone] = []
    notes: list[str] = []
    if not root.is_dir():
        return zones, notes
    for zone in sorted(root.glob("intel-rapl:*")):
        if zone.name.count(":") != 1:
            continue  # a sub-zone (core, uncore, dram) is part of its package
        energy = zone / "energy_uj"
        try:
            int(read(energy))
            max_uj = int(read(zone / "max_energy_range_uj"))
        except PermissionError:
            notes.append(f"{energy} is not readable by this user (RAPL needs root or a udev rule)")
            continue
        except (OSError, ValueError):
            continue
        name = (zone / "name").read_text().strip() if (zone / "name").exists() else zone.name
        zones.append(RaplZone(f"{name}@{zone.name}", energy, max_uj))
    return zones, notes


def rapl_watts(prev_uj: int, cur_uj: int, max_uj: int, dt_s: float) -> float | None:
    """Average watts between two counter reads `dt_s` apart; the counter wraps at `max_uj`."""
    if dt_s <= 0:
        return None
    delta = cur_uj - prev_uj
    if delta < 0:
        delta += max_uj
    return delta / 1e6 / dt_s


def parse_powermetrics(text: str) -> float | None:
    """Watts from powermetrics' combined CPU+GPU+ANE line, or None when absent."""
    m = _COMBINED.search(text)
    return float(m.group(1)) / 1000 if m else None


class PowerMeter:
    """Keeps the previous RAPL sample so that each `read` reports watts since the last one."""

    def __init__(self, zones: Iterable[RaplZone], notes: Iterable[str] = ()):
        self.zones = list(zones)
        self.notes = tuple(notes)
        self._prev: dict[str, tuple[float, int]] = {}

    @property
    def sources(self) -> list[str]:
        return ["rapl"] if self.zones else []

    def read(
        self,
        now: float,
        gpu_watts: Mapping[str, float | None] | None = None,
        apple_watts: float | None = None,
    ) -> PowerReading:
        parts: dict[str, float] = {}
        sources: list[str] = []
        for z in self.zones:
            try:
                cur = int(z.energy_path.read_text())
            except (OSError, ValueError):
                continue
            prev = self._prev.get(z.name)
            self._prev[z.name] = (now, cur)
            if prev is not None:
                w = rapl_watts(prev[1], cur, z.max_uj, now - prev[0])
                if w is not None:
                    parts[z.name] = w
                    if "rapl" not in sources:
                        sources.append("rapl")
        for name, w in (gpu_watts or {}).items():
            if w is not None:
                parts[name] = w
                if "nvidia" not in sources:
                    sources.append("nvidia")
        if apple_watts is not None:
            parts["apple"] = apple_watts
            sources.append("powermetrics")
        if not parts:
            return PowerReading(None, "unknown", {}, self.notes)
        return PowerReading(sum(parts.values()), "+".join(sources), parts, self.notes)
