"""Gather the node's inventory: the one place that runs nvidia-smi, sysctl and reads /proc.

Every probe is optional: a missing tool or a failing command leaves that part
empty and adds a note saying why, so `cgn-agent inventory` works on any box.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
from collections.abc import Callable, Collection, Sequence

from cgn_agent.inventory import apple, cpu, network, nvidia
from cgn_agent.inventory.types import Accelerator, Cpu, Inventory

Runner = Callable[[Sequence[str]], str]  # runs argv, returns stdout, raises OSError on failure
TIMEOUT_S = 10.0


def run_command(argv: Sequence[str]) -> str:
    """Run a probe with a deadline; OSError (with the reason) when it cannot give an answer."""
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(f"{argv[0]} not found on PATH")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(f"{argv[0]} did not answer within {TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()[:1]
        raise OSError(f"{argv[0]} exited {done.returncode}: {first[0] if first else ''}")
    return done.stdout


def collect(
    node: str,
    *,
    engines: Sequence[str] = (),
    own_pids: Collection[int] = (),
    labels: dict[str, str] | None = None,
    run: Runner = run_command,
    use_nvml: bool = True,
    address: str = "",
) -> Inventory:
    """`address`: the node's advertised address (its interface is the management one)."""
    notes: list[str] = []
    accelerators: list[Accelerator] = []
    driver = ""
    if platform.system() == "Darwin":
        try:
            profiler: str | None = None
            try:
                profiler = run(apple.PROFILER_QUERY)
            except OSError as exc:
                notes.append(f"system_profiler: {exc}")
            host_cpu, gpu = apple.apple_inventory(run(apple.SYSCTL_QUERY), profiler)
            accelerators += [gpu] if gpu else []
        except (OSError, KeyError, ValueError) as exc:
            notes.append(f"sysctl: {exc}")
            host_cpu = Cpu(platform.processor() or "unknown", cpu.usable_cores(), 0)
    else:
        host_cpu = cpu.linux_cpu()
        try:
            gpus, driver = nvidia.parse_gpus(run(nvidia.GPUS_QUERY))
            gpus = nvidia.flag_foreign(gpus, nvidia.parse_apps(run(nvidia.APPS_QUERY)), own_pids)
            if use_nvml and gpus:
                gpus = _with_topology(gpus, notes)
            if gpus:
                try:
                    gpus = nvidia.with_caps(gpus, nvidia.parse_caps(run(nvidia.CAPS_QUERY)))
                except (OSError, ValueError) as exc:
                    notes.append(f"nvidia-smi compute_cap: {exc}")
            accelerators += gpus
        except FileNotFoundError:
            pass  # no NVIDIA driver: a CPU node (or another vendor's), not an error
        except (OSError, ValueError) as exc:
            notes.append(f"nvidia-smi: {exc}")
    return Inventory(
        node=node,
        hostname=socket.gethostname(),
        cpu=host_cpu,
        accelerators=tuple(accelerators),
        network=tuple(network.rdma_links()),
        engines=tuple(engines),
        driver_version=driver,
        labels=dict(labels or {}),
        notes=tuple(notes),
        address=address,
        iface=network.iface_of(address) if address else "",
    )


def _with_topology(gpus: list[Accelerator], notes: list[str]) -> list[Accelerator]:
    from dataclasses import replace

    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return gpus
    try:
        pynvml.nvmlInit()
        try:
            topo = nvidia.nvml_topology(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        notes.append(f"NVML: {exc}")
        return gpus
    return [replace(g, topology=topo.get(g.uuid, {})) for g in gpus]
