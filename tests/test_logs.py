"""Logging: text and JSON-lines output shared by every daemon."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from cgn_core.logs import setup_logging
from cgn_core.settings import LogSettings


@pytest.fixture(autouse=True)
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_json_lines() -> None:
    out = io.StringIO()
    setup_logging("router", LogSettings(level="info", format="json"), stream=out)
    log = logging.getLogger("cgn_router.proxy")
    log.debug("hidden")
    log.info("routed %s", "req-1", extra={"endpoint": "e1", "score": 0.5})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["msg"] == "routed req-1" and lines[0]["level"] == "info"
    assert lines[0]["service"] == "router" and lines[0]["logger"] == "cgn_router.proxy"
    assert lines[0]["endpoint"] == "e1" and lines[0]["score"] == 0.5
    assert lines[0]["ts"].endswith("Z")
    assert "ValueError: boom" in lines[1]["exc"]


def test_text() -> None:
    out = io.StringIO()
    setup_logging("agent", LogSettings(level="debug", format="text"), stream=out)
    logging.getLogger("x").debug("hello")
    assert out.getvalue().rstrip().endswith("DEBUG   agent x: hello")
