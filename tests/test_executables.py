"""Finding sibling executables across Cognitora's two venvs (cgn_core.executables)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cgn_core import executables


def exe(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_directory_started_from_comes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, on_path = tmp_path / "shared-bin", tmp_path / "on-path"
    monkeypatch.setattr(sys, "argv", [str(shared / "cgn-agent")])
    monkeypatch.setenv("PATH", str(on_path))
    assert executables.bin_dirs()[0] == str(shared)
    assert executables.bin_dirs()[1] == str(Path(sys.executable).parent)
    assert executables.find("cgn-test-engine") is None
    path_copy = exe(on_path, "cgn-test-engine")
    assert executables.find("cgn-test-engine") == str(path_copy)  # PATH as the last resort
    shared_copy = exe(shared, "cgn-test-engine")
    assert executables.find("cgn-test-engine") == str(shared_copy)
    (shared / "not-executable").write_text("")
    assert executables.find("not-executable") is None


def test_an_engine_without_torch_says_what_to_install_where_it_needs_it(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cgn_core.errors import ConfigError
    from cgn_infer import loader
    from cgn_infer.backends import build
    from cgn_infer.settings import InferSettings

    real = build.importlib.util.find_spec
    monkeypatch.setattr(
        build.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a)
    )
    with pytest.raises(
        ConfigError, match="torch backend needs PyTorch: pip install cognitora-infer"
    ):
        loader.load_model(InferSettings(model=smollm2_path, backend="torch", weights="float32"))
    # its GGUF weights all have C kernels: the C backend serves it without torch
    loaded = loader.load_model(InferSettings(model=smollm2_path, backend="torch"))
    try:
        assert loaded.backend.name == "c"
    finally:
        loaded.gguf.close()
