"""All seven executables: real console scripts, --help, --version, config, and honest stubs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cgn_core import __version__
from cgn_core.cli import EXIT_USAGE

from .conftest import REPO

SERVICES = ["router", "agent", "ctl", "kvcached", "metrics", "operator", "infer"]


def exe(service: str) -> str:
    found = shutil.which(f"cgn-{service}", path=str(Path(sys.executable).parent))
    assert found, f"cgn-{service} is not installed beside {sys.executable}"
    return found


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("service", SERVICES)
def test_help_and_version(service: str) -> None:
    help_ = run(exe(service), "--help")
    assert help_.returncode == 0, help_.stderr
    assert f"cgn-{service}" in help_.stdout and "config" in help_.stdout
    version = run(exe(service), "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"cgn-{service} {__version__}"


@pytest.mark.parametrize("service", SERVICES)
def test_config_shows_effective_settings(service: str) -> None:
    res = run(
        exe(service),
        "config",
        "--json",
        "-c",
        str(REPO / "configs" / f"{service}.yaml"),
        "--set",
        "log.level=debug",
        env={f"CGN_{service.upper()}_LOG__FORMAT": "json"},
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["log"] == {"level": "debug", "format": "json"}


def test_config_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("http: {port: nope}\n")
    res = run(exe("router"), "config", "-c", str(bad))
    assert res.returncode == EXIT_USAGE
    assert res.stderr.strip() == f"error: {bad}: http.port: expected an integer, got 'nope'"
    res = run(exe("router"), "config", env={"CGN_ROUTER_CONFIG": str(tmp_path / "none.yaml")})
    assert res.returncode == EXIT_USAGE and "cannot read settings file" in res.stderr
    res = run(exe("router"), "config", "--set", "novalue")
    assert res.returncode == EXIT_USAGE and "--set expects KEY=VALUE" in res.stderr


def test_a_fifo_a_device_or_a_directory_named_as_a_file_is_a_one_line_error(
    tmp_path: Path,
) -> None:
    """Every path a service reads from its command line or settings: opened non-blocking and
    checked to be a regular file before any read, so nothing hangs on a FIFO or reads
    /dev/zero forever (each run here has 60 s; they answer at once)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    kv_serve = [exe("kvcached"), "serve", "--port", "0", "--admin-port", "0"]
    cases = [
        ([exe("router"), "config", "-c", str(fifo)], "not a regular file"),
        ([exe("kvcached"), "config", "-c", "/dev/zero"], "not a regular file"),
        ([exe("agent"), "config", "-c", str(tmp_path)], "not a regular file (a directory)"),
        ([exe("ctl"), "models", "apply", "-f", "/dev/zero"], "not a regular file"),
        ([exe("ctl"), "models", "apply", "-f", str(fifo)], "not a regular file"),
        ([exe("infer"), "serve", "--model", str(fifo), "--port", "0"], "not a regular file"),
        ([*kv_serve, "--set", f"secret_file={fifo}"], "secret_file"),
        (
            [
                *kv_serve,
                *(a for f in ("ca", "cert", "key") for a in ("--set", f"tls.{f}_file={fifo}")),
            ],
            "not a regular file",
        ),
    ]
    for argv, fragment in cases:
        one_line_error(argv, fragment)


def test_out_of_range_numbers_on_command_lines_are_one_line_errors() -> None:
    """Caught before anything starts or any connection is made (no etcd at 127.0.0.1:1)."""
    from cgn_core.bundled_models import smollm2

    key = [exe("ctl"), "keys", "create", "--tenant", "t", "--band", "gold", "--etcd", "127.0.0.1:1"]
    sim = [exe("infer"), "serve", "--backend", "sim", "--model", str(smollm2()), "--port", "0"]
    cases = [
        ([*key, "--expires-in", "-5"], "expires in must be a positive number"),
        ([*key, "--expires-in", "nan"], "expires in must be a positive number"),
        ([*key, "--rps", "-1"], "limit rps must be positive"),
        ([*sim, "--threads", "-1"], "threads must be in [0, 1024], got -1"),
        ([*sim, "--kv-pool-tokens", str(10**12)], "kv_pool_tokens must be in [16, 67108864]"),
    ]
    for argv, fragment in cases:
        one_line_error(argv, fragment)


def one_line_error(argv: list[str], fragment: str) -> None:
    """`argv` fails with exactly one `error:` line holding `fragment`, and no traceback."""
    res = run(*argv)
    assert res.returncode != 0, argv
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], (argv, res.stderr[-500:])
    assert "Traceback" not in res.stderr, argv
