"""Inventory and power parsers on fixtures (tests/fixtures/agent/README.md says where each came from)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cgn_agent.inventory import apple, classes, cpu, network, nvidia
from cgn_agent.inventory.collect import collect
from cgn_agent.inventory.types import Accelerator, Cpu, Inventory
from cgn_agent.power import PowerMeter, parse_powermetrics, rapl_watts, rapl_zones

FIX = Path(__file__).parent / "fixtures" / "agent"
BIN = Path(sys.executable).parent


def fixture(name: str) -> str:
    return (FIX / name).read_text()


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
        ("NVIDIA L40S", 46068, "l40s-45g"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx4090-24g"),
        ("Tesla V100-SXM2-16GB", 16160, "v100-16g"),
        ("NVIDIA H200", 143771, "h200-140g"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, "rtxpro6000-96g"),
    ],
)
def test_nvidia_class(name: str, mib: int, expected: str) -> None:
    assert classes.nvidia_class(name, mib) == expected


@pytest.mark.parametrize(
    ("chip", "mem", "expected"),
    [
        ("Apple M2 Ultra", 192 * 2**30, "m2-ultra-192g"),
        ("Apple M1", 16 * 2**30, "m1-16g"),
        ("Apple M3 Max", 128 * 2**30, "m3-max-128g"),
    ],
)
def test_apple_class(chip: str, mem: int, expected: str) -> None:
    assert classes.apple_class(chip, mem) == expected


def test_nvidia_smi_eight_h100_with_an_ecc_error_and_a_foreign_process() -> None:
    gpus, driver = nvidia.parse_gpus(fixture("nvidia_smi_h100x8.csv"))
    assert driver == "550.90.07"
    assert [g.index for g in gpus] == list(range(8))
    assert {g.accel_class for g in gpus} == {"h100-80g"}
    assert gpus[0].memory_mib == 81559 and gpus[0].power_w == pytest.approx(68.21)
    assert gpus[0].pci_bus_id == "00000000:1B:00.0" and gpus[0].power_limit_w == 700.0
    assert gpus[3].health == ("uncorrected ECC errors: 2",)
    apps = nvidia.parse_apps(fixture("nvidia_smi_apps_h100x8.csv"))
    assert apps == [nvidia.GpuProcess("GPU-8c2d1e44-7b90-4f3e-a1c5-2d9e6f0b7a13", 48213, 75104)]
    flagged = nvidia.flag_foreign(gpus, apps, own_pids=())
    assert flagged[1].health == ("memory held by foreign process 48213 (75104 MiB)",)
    assert [g.healthy for g in flagged] == [True, False, True, False, True, True, True, True]
    # the same process is ours: no flag
    assert nvidia.flag_foreign(gpus, apps, own_pids={48213})[1].healthy


def test_nvidia_smi_mixed_cards_and_unsupported_fields() -> None:
    gpus, _ = nvidia.parse_gpus(fixture("nvidia_smi_mixed.csv"))
    assert [g.accel_class for g in gpus] == ["l40s-45g", "rtx4090-24g", "a100-80g"]
    rtx, a100 = gpus[1], gpus[2]
    assert rtx.healthy  # ECC "[N/A]" is unknown, not an error count
    assert a100.power_w is None and a100.power_limit_w is None


def test_nvidia_smi_malformed_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected 10"):
        nvidia.parse_gpus("0, GPU-x, NVIDIA L40S, 46068\n")


def test_node_class_is_the_first_healthy_accelerator() -> None:
    gpus, _ = nvidia.parse_gpus(fixture("nvidia_smi_mixed.csv"))
    inv = Inventory("n", "h", Cpu("x", 1, 1), tuple(gpus))
    assert inv.node_class == "l40s-45g"
    sick = tuple(Accelerator(**{**_fields(g), "health": ("bad",)}) for g in gpus)
    assert Inventory("n", "h", Cpu("x", 1, 1), sick).node_class == "cpu"


def _fields(a: Accelerator) -> dict[str, object]:
    return {f: getattr(a, f) for f in a.__dataclass_fields__}


def test_nvml_topology_from_a_fake_module_shaped_like_pynvml() -> None:
    """nvidia-ml-py cannot load here (no driver); this fake answers as NVML does for 2 NVLinked GPUs."""

    class NVMLError(Exception):
        pass

    handles = ["h0", "h1"]
    fake = SimpleNamespace(
        NVMLError=NVMLError,
        NVML_NVLINK_MAX_LINKS=18,
        NVML_FEATURE_ENABLED=1,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetUUID=lambda h: {"h0": b"GPU-a", "h1": "GPU-b"}[h],
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 18 else 0,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 30,
    )
    topo = nvidia.nvml_topology(fake)
    assert topo == {
        "GPU-a": {"nvlinks": 18, "peers": {"GPU-b": "PHB"}},
        "GPU-b": {"nvlinks": 18, "peers": {"GPU-a": "PHB"}},
    }


def test_apple_silicon_and_intel_mac() -> None:
    host, gpu = apple.apple_inventory(
        fixture("apple_sysctl_m2_ultra.txt"), fixture("apple_system_profiler_m2_ultra.json")
    )
    assert host == Cpu("Apple M2 Ultra", 24, 196608)
    assert gpu is not None and gpu.accel_class == "m2-ultra-192g"
    assert gpu.topology == {"gpu_cores": 76} and gpu.memory_mib == 196608
    host, gpu = apple.apple_inventory(fixture("apple_sysctl_intel_mac.txt"), None)
    assert gpu is None and host.cores == 16


def test_cpu_and_memory_from_proc_recorded_here() -> None:
    assert cpu.parse_cpuinfo(fixture("cpuinfo_xeon_vm.txt")) == "Intel(R) Xeon(R) Processor"
    assert cpu.parse_meminfo(fixture("meminfo_vm.txt")) == 24105
    assert cpu.parse_cpuinfo("processor\t: 0\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n") == (
        "Raspberry Pi 4 Model B Rev 1.4"
    )
    with pytest.raises(ValueError, match="MemTotal"):
        cpu.parse_meminfo("MemFree: 1 kB\n")


def test_rdma_links_from_a_sysfs_tree(tmp_path: Path) -> None:
    def port(dev: str, n: int, state: str, rate: str, layer: str) -> None:
        d = tmp_path / dev / "ports" / str(n)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text(layer + "\n")

    port("mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    port("mlx5_1", 1, "1: DOWN", "100 Gb/sec (4X EDR)", "Ethernet")
    links = network.rdma_links(tmp_path)
    assert [(x.device, x.state, x.rate_gbps, x.link_layer) for x in links] == [
        ("mlx5_0", "ACTIVE", 400.0, "InfiniBand"),
        ("mlx5_1", "DOWN", 100.0, "Ethernet"),
    ]
    assert network.rdma_links(tmp_path / "absent") == []


def test_collect_on_a_gpu_node_with_a_fake_runner() -> None:
    outputs = {
        nvidia.GPUS_QUERY: fixture("nvidia_smi_h100x8.csv"),
        nvidia.APPS_QUERY: fixture("nvidia_smi_apps_h100x8.csv"),
        nvidia.CAPS_QUERY: fixture("nvidia_smi_caps_h100x8.csv"),
    }
    inv = collect("n1", run=lambda argv: outputs[tuple(argv)], use_nvml=False)
    assert inv.node_class == "h100-80g" and len(inv.accelerators) == 8
    assert not inv.accelerators[1].healthy and inv.driver_version == "550.90.07"
    assert {a.compute_capability for a in inv.accelerators} == {"9.0"} and not inv.notes

    def old_driver(argv: object) -> str:  # before 510, a query naming compute_cap is refused
        if argv == nvidia.CAPS_QUERY:
            raise OSError('nvidia-smi exited 2: Field "compute_cap" is not a valid field')
        return outputs[tuple(argv)]  # type: ignore[arg-type]

    inv = collect("n1", run=old_driver, use_nvml=False, address="127.0.0.1")
    assert len(inv.accelerators) == 8 and inv.accelerators[0].compute_capability == ""
    assert inv.notes == ('nvidia-smi compute_cap: nvidia-smi exited 2: Field "compute_cap" '
                         "is not a valid field",)  # fmt: skip
    assert (inv.address, inv.iface) == ("127.0.0.1", "lo")

    def broken(argv: object) -> str:
        raise OSError("nvidia-smi exited 9: NVIDIA-SMI has failed")

    inv = collect("n1", run=broken)
    assert inv.accelerators == () and inv.notes == (
        "nvidia-smi: nvidia-smi exited 9: NVIDIA-SMI has failed",
    )


def test_powermetrics_and_rapl(tmp_path: Path) -> None:
    assert parse_powermetrics(fixture("powermetrics_m2_ultra.txt")) == pytest.approx(4.392)
    assert parse_powermetrics("no power lines") is None
    assert rapl_watts(1_000_000, 3_000_000, 2**32, 2.0) == pytest.approx(1.0)
    assert rapl_watts(2**32 - 1_000_000, 1_000_000, 2**32, 1.0) == pytest.approx(2.0)  # wrapped
    zone = tmp_path / "intel-rapl:0"
    sub = tmp_path / "intel-rapl:0:0"  # a sub-zone: contained in the package, not summed
    for d, name in ((zone, "package-0"), (sub, "core")):
        d.mkdir()
        (d / "name").write_text(name + "\n")
        (d / "energy_uj").write_text("5000000\n")
        (d / "max_energy_range_uj").write_text("262143328850\n")
    zones, notes = rapl_zones(tmp_path)
    assert [z.name for z in zones] == ["package-0@intel-rapl:0"] and notes == []
    meter = PowerMeter(zones)
    first = meter.read(10.0)
    assert first.watts is None and first.source == "unknown"  # one sample is no rate
    (zone / "energy_uj").write_text("95000000\n")
    second = meter.read(12.0, gpu_watts={"gpu0": 300.0, "gpu1": None})
    assert second.source == "rapl+nvidia"
    assert second.parts == {"package-0@intel-rapl:0": pytest.approx(45.0), "gpu0": 300.0}
    assert second.watts == pytest.approx(345.0)


def test_unreadable_rapl_says_why(tmp_path: Path) -> None:
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "energy_uj").write_text("1\n")
    (zone / "max_energy_range_uj").write_text("2\n")

    def read(path: Path) -> str:  # as a non-root user sees energy_uj on kernels since 5.10
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return path.read_text()

    zones, notes = rapl_zones(tmp_path, read)
    assert zones == [] and len(notes) == 1 and "not readable by this user" in notes[0]
    reading = PowerMeter(zones, notes).read(1.0)
    assert reading.watts is None and reading.source == "unknown" and reading.notes == tuple(notes)


def test_cli_inventory_json_on_this_machine() -> None:
    out = subprocess.run(
        [str(BIN / "cgn-agent"), "inventory", "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    with open("/proc/meminfo") as fh:
        assert doc["cpu"]["ram_mib"] == cpu.parse_meminfo(fh.read())
    assert doc["node_class"] == (
        "cpu" if not doc["accelerators"] else doc["accelerators"][0]["accel_class"]
    )
    assert "cgn_infer" in doc["engines"] and "llama_cpp" in doc["engines"]
    assert doc["power_source"] in ("unknown", "rapl", "nvidia", "rapl+nvidia")
    table = subprocess.run(
        [str(BIN / "cgn-agent"), "inventory"], capture_output=True, text=True, timeout=60
    )
    assert table.returncode == 0 and "engines installed: cgn_infer" in table.stdout
