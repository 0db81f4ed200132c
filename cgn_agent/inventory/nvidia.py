"""NVIDIA GPUs from `nvidia-smi --query-gpu` CSV, plus NVML topology where nvidia-ml-py imports.

Two queries, both `--format=csv,noheader,nounits`:

* GPUS_QUERY: one row per GPU with the fields in GPU_FIELDS;
* APPS_QUERY: one row per process holding GPU memory (gpu uuid, pid, MiB).

Health flags that keep a device out of placement:
* uncorrected ECC errors since the driver loaded (volatile count > 0);
* GPU memory held by a process the agent did not start (a foreign process).
Fields a GPU does not support come back as "[N/A]" or "[Not Supported]" and
are read as unknown, never as zero.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

from cgn_agent.inventory.classes import nvidia_class
from cgn_agent.inventory.types import Accelerator

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "memory.total",
    "memory.used",
    "ecc.errors.uncorrected.volatile.total",
    "power.draw",
    "power.limit",
    "driver_version",
)
GPUS_QUERY = ("nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits")
# NOTE: a query of its own: drivers older than 510 do not know the field, and refuse the
# whole query that names it (the inventory then lacks only the capabilities)
CAPS_QUERY = ("nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv,noheader,nounits")
APPS_QUERY = (
    "nvidia-smi",
    "--query-compute-apps=gpu_uuid,pid,used_memory",
    "--format=csv,noheader,nounits",
)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    used_mib: int | None


def _value(raw: str) -> str | None:
    v = raw.strip()
    return None if not v or v.startswith("[") or v in ("N/A", "Not Supported") else v


def _num(raw: str) -> float | None:
    v = _value(raw)
    return None if v is None else float(v)


def _rows(text: str) -> Iterable[list[str]]:
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if row and any(c.strip() for c in row):
            yield row


def parse_gpus(text: str) -> tuple[list[Accelerator], str]:
    """Rows of GPUS_QUERY output as accelerators, and the driver version."""
    gpus: list[Accelerator] = []
    driver = ""
    for row in _rows(text):
        if len(row) != len(GPU_FIELDS):
            raise ValueError(f"nvidia-smi row has {len(row)} fields, expected {len(GPU_FIELDS)}")
        f = dict(zip(GPU_FIELDS, row, strict=True))
        total = int(_num(f["memory.total"]) or 0)
        name = (_value(f["name"]) or "unknown").strip()
        health: list[str] = []
        ecc = _num(f["ecc.errors.uncorrected.volatile.total"])
        if ecc:
            health.append(f"uncorrected ECC errors: {int(ecc)}")
        gpus.append(
            Accelerator(
                kind="nvidia",
                index=int(f["index"]),
                name=name,
                accel_class=nvidia_class(name, total),
                memory_mib=total,
                memory_used_mib=int(_num(f["memory.used"]) or 0),
                uuid=_value(f["uuid"]) or "",
                pci_bus_id=_value(f["pci.bus_id"]) or "",
                power_w=_num(f["power.draw"]),
                power_limit_w=_num(f["power.limit"]),
                health=tuple(health),
            )
        )
        driver = _value(f["driver_version"]) or driver
    return gpus, driver


def parse_caps(text: str) -> dict[int, str]:
    """Rows of CAPS_QUERY output: device index -> compute capability ("9.0")."""
    out = {}
    for row in _rows(text):
        if len(row) != 2:
            raise ValueError(f"nvidia-smi compute_cap row has {len(row)} fields, expected 2")
        cap = _value(row[1])
        if cap is not None:
            out[int(row[0])] = cap
    return out


def with_caps(gpus: Iterable[Accelerator], caps: dict[int, str]) -> list[Accelerator]:
    return [replace(g, compute_capability=caps.get(g.index, "")) for g in gpus]


def parse_apps(text: str) -> list[GpuProcess]:
    """Rows of APPS_QUERY output."""
    out = []
    for row in _rows(text):
        if len(row) != 3:
            raise ValueError(f"nvidia-smi compute-apps row has {len(row)} fields, expected 3")
        used = _num(row[2])
        out.append(GpuProcess(row[0].strip(), int(row[1]), None if used is None else int(used)))
    return out


def flag_foreign(
    gpus: Iterable[Accelerator], apps: Iterable[GpuProcess], own_pids: Collection[int]
) -> list[Accelerator]:
    """Mark GPUs whose memory is held by a process outside `own_pids` (the agent's engines)."""
    foreign: dict[str, list[GpuProcess]] = {}
    for app in apps:
        if app.pid not in own_pids:
            foreign.setdefault(app.gpu_uuid, []).append(app)
    out = []
    for g in gpus:
        held = foreign.get(g.uuid, [])
        reasons = [
            f"memory held by foreign process {p.pid}"
            + (f" ({p.used_mib} MiB)" if p.used_mib is not None else "")
            for p in held
        ]
        out.append(replace(g, health=g.health + tuple(reasons)) if reasons else g)
    return out


def nvml_topology(nvml: Any) -> dict[str, dict[str, Any]]:
    """Per GPU uuid: active NVLink count and the PCIe/NVLink relation to every other GPU.

    `nvml` is the imported `pynvml` module (nvidia-ml-py); the caller has
    called nvmlInit. Relations use nvidia-smi topo's vocabulary (NV#, PIX,
    PXB, PHB, NODE, SYS).
    """
    level_names = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    links: list[int] = []
    for h in handles:
        n = 0
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                n += int(nvml.nvmlDeviceGetNvLinkState(h, link) == nvml.NVML_FEATURE_ENABLED)
            except nvml.NVMLError:
                break
        links.append(n)
    topo: dict[str, dict[str, Any]] = {}
    for i, h in enumerate(handles):
        peers = {}
        for j, other in enumerate(handles):
            if i != j:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(h, other)
                peers[uuids[j]] = level_names.get(int(level), str(level))
        topo[uuids[i]] = {"nvlinks": links[i], "peers": peers}
    return topo


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
