"""What the scheduler sees of a node: plain, frozen values that serialize to JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

AcceleratorKind = Literal["nvidia", "apple"]


@dataclass(frozen=True, slots=True)
class Cpu:
    model: str
    cores: int  # logical CPUs this process may use
    ram_mib: int


@dataclass(frozen=True, slots=True)
class Accelerator:
    kind: AcceleratorKind
    index: int  # CUDA ordinal (nvidia); 0 for the one Apple GPU
    name: str  # as the vendor reports it
    accel_class: str  # h100-80g, l40s-45g, m2-ultra-192g: see classes.py
    memory_mib: int
    memory_used_mib: int = 0
    uuid: str = ""
    pci_bus_id: str = ""
    power_w: float | None = None
    power_limit_w: float | None = None
    health: tuple[str, ...] = ()  # reasons to keep it out of placement; empty = healthy
    topology: dict[str, Any] = dataclasses.field(default_factory=dict)
    compute_capability: str = ""  # "9.0" (nvidia-smi compute_cap); "" when unknown

    @property
    def healthy(self) -> bool:
        return not self.health


@dataclass(frozen=True, slots=True)
class NetLink:
    """One RDMA port from /sys/class/infiniband (InfiniBand; RoCE when link_layer is Ethernet)."""

    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT...
    rate_gbps: float | None
    link_layer: str  # InfiniBand | Ethernet


@dataclass(frozen=True, slots=True)
class Inventory:
    node: str
    hostname: str
    cpu: Cpu
    accelerators: tuple[Accelerator, ...] = ()
    network: tuple[NetLink, ...] = ()
    engines: tuple[str, ...] = ()  # engine drivers whose software is installed here
    driver_version: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what could not be read, and why
    address: str = ""  # where other nodes reach this one's engines (the advertised address)
    iface: str = ""  # the management interface: the one holding `address`

    @property
    def node_class(self) -> str:
        """The accelerator class placements match on: the first healthy device's, or 'cpu'."""
        for a in self.accelerators:
            if a.healthy:
                return a.accel_class
        return "cpu"

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["node_class"] = self.node_class
        out: dict[str, Any] = json.loads(json.dumps(doc))  # tuples become lists: plain JSON
        return out
