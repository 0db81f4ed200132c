"""Bounded polling for tests and benchmarks: wait for a condition, never sleep blindly."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def until(
    what: str, check: Callable[[], Any], timeout_s: float = 15.0, poll_s: float = 0.05
) -> Any:
    """Poll `check` until it returns something truthy, and return that; AssertionError naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(poll_s)


def get_json(url: str, timeout_s: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.load(resp)


def router_endpoints(admin_url: str) -> dict[str, dict[str, Any]]:
    """A router's registry as its admin API shows it, by endpoint id."""
    return {e["id"]: e for e in get_json(admin_url + "/endpoints")["endpoints"]}
