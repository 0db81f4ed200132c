"""bin/install.sh's choice of torch build, without installing anything (`--show-torch-index`).

PyPI's Linux torch is the CUDA build; a machine without an NVIDIA GPU should get PyTorch's
CPU-only index instead, or PyPI when that index does not answer. The real CPU index is not
reachable from this machine, so a loopback HTTP server over a directory stands in for it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

INSTALL = Path(__file__).resolve().parent.parent / "bin" / "install.sh"


def show(tmp: Path, *args: str, gpu: bool = False, cpu_index: str | None = None) -> tuple[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    if gpu:
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    elif fake.exists():
        fake.unlink()
    # A PATH with the fake tools first and no real nvidia-smi (none on CI machines either).
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    if cpu_index is not None:
        env["CGN_TORCH_CPU_INDEX"] = cpu_index
    out = subprocess.run(["sh", str(INSTALL), "--show-torch-index", *args], env=env,
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return out.stdout.strip(), out.stderr


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A stand-in package index on loopback with a torch/ page."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="an NVIDIA driver here")
def test_no_gpu_gets_the_cpu_index_when_it_answers(tmp_path: Path, cpu_index: str) -> None:
    assert show(tmp_path, cpu_index=cpu_index) == (cpu_index, "")


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="an NVIDIA driver here")
def test_no_gpu_and_no_cpu_index_falls_back_to_pypi_with_a_warning(tmp_path: Path) -> None:
    out, err = show(tmp_path, cpu_index=(tmp_path / "missing").as_uri())
    assert out == "pypi" and "cannot be reached" in err


def test_a_gpu_gets_pypi(tmp_path: Path, cpu_index: str) -> None:
    assert show(tmp_path, gpu=True, cpu_index=cpu_index)[0] == "pypi"


def test_the_flag_wins(tmp_path: Path) -> None:
    assert show(tmp_path, "--torch-index", "https://mirror.example/torch-cpu")[0] == (
        "https://mirror.example/torch-cpu"
    )
    assert show(tmp_path, "--torch-index", "pypi", gpu=False)[0] == "pypi"
