"""Hardware inventory: CPU, NVIDIA GPUs, Apple silicon, RDMA links, accelerator classes."""

from cgn_agent.inventory.types import Accelerator, Cpu, Inventory, NetLink

__all__ = ["Accelerator", "Cpu", "Inventory", "NetLink"]
