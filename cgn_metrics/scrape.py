"""Scraping: every target's /metrics each round, bounded in time and in concurrency.

A target that times out, refuses, answers non-200 or sends text the Prometheus
parser rejects is `down` with the reason, and keeps its history; a round never
waits longer than the timeout for it. Parsing (prometheus_client's parser) runs on
a worker thread so the HTTP side stays responsive with 100 targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cgn_core.http import bearer_header
from cgn_metrics.fleet import KEEP, Scraped, SeriesKey
from cgn_metrics.targets import Target

log = logging.getLogger(__name__)
MAX_BYTES = 8 << 20  # a /metrics page larger than this is refused


def parse(text: str) -> dict[SeriesKey, float]:
    """The kept samples of an exposition text (`_created` timestamps left out)."""
    out: dict[SeriesKey, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(KEEP):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


class Scraper:
    """The targets' states and rings; `round()` scrapes them all once."""

    def __init__(
        self, client: httpx.AsyncClient, *, timeout_s: float, concurrency: int, capacity: int
    ):
        self.client, self.timeout_s, self.capacity = client, timeout_s, capacity
        self.gate = asyncio.Semaphore(max(1, concurrency))
        self.scraped: dict[str, Scraped] = {}
        self.unpublished: dict[str, frozenset[str]] = {}  # engine target id → signals absent

    def set_targets(self, targets: list[Target]) -> None:
        """Track exactly `targets` (same id: history kept; gone: dropped)."""
        wanted = {t.id: t for t in targets}
        for gone in set(self.scraped) - set(wanted):
            del self.scraped[gone]
            self.unpublished.pop(gone, None)
        for tid, t in wanted.items():
            old = self.scraped.get(tid)
            if old is None or old.target != t:
                self.scraped[tid] = Scraped(t, self.capacity)

    async def round(self) -> None:
        await asyncio.gather(*(self._one(s) for s in list(self.scraped.values())))

    async def _one(self, s: Scraped) -> None:
        async with self.gate:
            started = time.monotonic()
            try:
                samples = await asyncio.wait_for(self._fetch(s.target), self.timeout_s)
            except TimeoutError:
                s.state, s.error = "down", f"no answer within {self.timeout_s:g} s"
            except (httpx.HTTPError, OSError) as exc:
                s.state, s.error = "down", f"{type(exc).__name__}: {str(exc)[:200]}"
            except ValueError as exc:  # not Prometheus text, or too big
                s.state, s.error = "down", f"bad /metrics: {str(exc)[:200]}"
            else:
                s.record(time.time(), samples)
                s.state, s.error, s.last_ok = "up", "", time.time()
                if s.target.kind == "engine":
                    self._check_vocabulary(s)
            s.duration_s = time.monotonic() - started

    def _check_vocabulary(self, s: Scraped) -> None:
        """A warning once when an engine's page lacks a metric its vocabulary names (its
        figure shows as "—"), and a line when it comes back."""
        tid, now = s.target.id, s.unpublished()
        before = self.unpublished.get(tid, frozenset())
        if gone := now - before:
            log.warning(
                "%s (%s) publishes no %s under the names its vocabulary gives "
                "(cgn_core/engine_metrics.py): shown as unknown",
                tid,
                s.target.engine or "vLLM's names",
                ", ".join(sorted(gone)),
            )
        if back := before - now:
            log.info("%s publishes %s again", tid, ", ".join(sorted(back)))
        self.unpublished[tid] = now

    async def _fetch(self, t: Target) -> Mapping[SeriesKey, float]:
        headers = {"Accept-Encoding": "gzip", **bearer_header(t.token)}
        async with self.client.stream("GET", t.url + "/metrics", headers=headers) as resp:
            if resp.status_code != 200:
                raise httpx.HTTPError(f"HTTP {resp.status_code}")
            body = await bounded_body(resp, MAX_BYTES)
        text = body.decode("utf-8", "replace")
        return await asyncio.to_thread(parse, text)


async def bounded_body(resp: httpx.Response, limit: int) -> bytes:
    """The response's body, decompressed, refused (ValueError) once past `limit` bytes: read
    as it streams and inflated at most `limit` bytes at a time, so neither a huge page nor
    a small gzip bomb is ever held whole."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise ValueError(f"content-encoding {encoding[:40]!r} is not gzip or deflate")
    inflate = None
    if encoding != "identity":
        inflate = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding == "gzip" else 0))
    out = bytearray()
    async for raw in resp.aiter_raw():
        if inflate is None:
            out += raw
        else:
            out += inflate.decompress(raw, limit + 1 - len(out))
            if inflate.unconsumed_tail:  # more output than the room left
                raise ValueError(f"over {limit} bytes once decompressed")
        if len(out) > limit:
            raise ValueError(f"over {limit} bytes")
    return bytes(out)
