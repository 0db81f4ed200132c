"""A page in headless Chromium, driven over the DevTools protocol: its DOM once rendered, every
console error and uncaught exception, and a screenshot.

One browser per `open_page`, on a DevTools port of its own and an empty profile, started with
the flags this machine's closed network needs (no background traffic, no component update).
The page is loaded, then polled with `ready` (a JavaScript expression) until it is truthy or
the timeout passes; everything the page logged at error level until then is in `errors`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from cgn_core.process import stop_group

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


def chromium() -> str | None:
    """Debian's `chromium` (or `chromium-browser`) on PATH; None where there is none."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Page:
    dom: str = ""
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed loads
    png: bytes = b""


class _Session:
    """One DevTools websocket: numbered calls, and the events that arrive between them."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, page: Page) -> None:
        self.ws, self.page, self.ids = ws, page, itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self._event(msg.get("method", ""), msg.get("params", {}))

    def _event(self, method: str, p: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            self.page.errors.append(f"console.{p['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.page.errors.append(
                f"exception: {d.get('exception', {}).get('description') or d.get('text')}"
            )
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            self.page.errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}")


async def _drive(port: int, url: str, ready: str, timeout_s: float, size: tuple[int, int]) -> Page:
    page = Page()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        async with http.ws_connect(ws_url, max_msg_size=64 << 20) as ws:
            s = _Session(ws, page)
            for domain in ("Runtime", "Log", "Page"):
                await s.call(f"{domain}.enable")
            await s.call(
                "Emulation.setDeviceMetricsOverride",
                width=size[0],
                height=size[1],
                deviceScaleFactor=1,
                mobile=False,
            )
            await s.call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout_s
            while True:
                done = await s.call("Runtime.evaluate", expression=ready, returnByValue=True)
                if done.get("result", {}).get("value") or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            dom = await s.call(
                "Runtime.evaluate",
                expression="document.documentElement.outerHTML",
                returnByValue=True,
            )
            page.dom = dom["result"]["value"]
            shot = await s.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            page.png = base64.b64decode(shot["data"])
    return page


def open_page(
    url: str, ready: str, *, timeout_s: float = 30.0, size: tuple[int, int] = (1400, 1000)
) -> Page:
    """Load `url` in a fresh headless Chromium, wait until `ready` is truthy (or `timeout_s`),
    and return its DOM, its errors and a full-page screenshot."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    with (
        # NOTE: a child Chromium forked (crashpad, a renderer) can be writing into the profile
        # until the SIGKILL stop_group sends it lands: its removal must not fail the test
        tempfile.TemporaryDirectory(prefix="cgn-chromium-", ignore_cleanup_errors=True) as profile,
        tempfile.TemporaryFile("w+") as log,
    ):
        proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        try:
            port = _devtools_port(proc, Path(profile), log, time.monotonic() + 60)
            return asyncio.run(_drive(port, url, ready, timeout_s, size))
        finally:
            stop_group(proc)


def _devtools_port(
    proc: subprocess.Popen[bytes], profile: Path, log: IO[str], deadline: float
) -> int:
    """The port Chromium chose (the first line of its DevToolsActivePort file)."""
    active = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if active.exists() and (first := active.read_text().split("\n", 1)[0]).isdigit():
            return int(first)
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"chromium exited with {proc.returncode}: {log.read()[-1000:]}")
        time.sleep(0.05)
    raise TimeoutError("chromium did not open its DevTools port within 60 s")


def errors_except(page: Page, *allowed: str) -> list[str]:
    """The page's errors but those matching one of the `allowed` regular expressions."""
    return [e for e in page.errors if not any(re.search(a, e) for a in allowed)]


def as_json(page: Page) -> str:  # for a failing assertion's message
    return json.dumps({"errors": page.errors, "dom_tail": page.dom[-1500:]}, indent=1)
