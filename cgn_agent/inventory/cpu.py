"""CPU model, usable cores and RAM, from /proc (Linux) or sysctl (macOS, see apple.py)."""

from __future__ import annotations

from cgn_agent.inventory.types import Cpu
from cgn_core import process


def parse_cpuinfo(text: str) -> str:
    """The CPU model name from /proc/cpuinfo (x86 'model name', Arm 'Model' or 'Hardware')."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Model", "Hardware", "cpu model"):
        if fields.get(key):
            return fields[key]
    return "unknown"


def parse_meminfo(text: str) -> int:
    """MemTotal from /proc/meminfo, in MiB."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024  # the kernel reports kB
    raise ValueError("/proc/meminfo has no MemTotal line")


usable_cores = process.usable_cores  # affinity, capped by a cgroup CPU quota


def linux_cpu(proc: str = "/proc") -> Cpu:
    with open(f"{proc}/cpuinfo") as fh:
        model = parse_cpuinfo(fh.read())
    with open(f"{proc}/meminfo") as fh:
        ram = parse_meminfo(fh.read())
    return Cpu(model, usable_cores(), ram)
