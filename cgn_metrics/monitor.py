"""What cgn-metrics knows now, shared by its loop (which writes it) and its HTTP side (which
reads it): the latest fleet view, the history rings, the targets' scraped samples, and
whether the loop is still completing rounds."""

from __future__ import annotations

import time
from pathlib import Path

from cgn_core.files import atomic_write_text
from cgn_core.fleet_view import FleetView
from cgn_metrics.fleet import Scraped, history_points
from cgn_metrics.series import Ring
from cgn_metrics.settings import MetricsSettings
from cgn_metrics.targets import Fleet, Target, file_sd

EMPTY = Fleet((), {}, {})


class Monitor:
    """The state the HTTP side reads: the latest view, the history, the loop's health."""

    def __init__(self, settings: MetricsSettings, static: list[Target]):
        self.settings = settings
        self.static = static
        self.fleet = EMPTY
        self.etcd_error = ""
        self.view: FleetView | None = None  # before the first round
        self.points = max(2, int(settings.retention_s / settings.scrape_interval_s))
        self.history: dict[str, Ring] = {}
        self.last_round = 0.0
        self.rounds = 0
        self.scraped: dict[str, Scraped] = {}  # the scraper's, for /federate
        self._file_sd = ""

    def record(self, view: FleetView) -> None:
        self.view = view
        for name, value in history_points(view).items():
            ring = self.history.get(name)
            if ring is None:
                ring = self.history[name] = Ring(self.points)
            ring.append(view.time, value)
        self.last_round = time.monotonic()
        self.rounds += 1

    def healthy(self) -> tuple[bool, str]:
        stale = time.monotonic() - self.last_round
        if (
            self.rounds
            and stale > 3 * self.settings.scrape_interval_s + self.settings.scrape_timeout_s
        ):
            return False, f"no scrape round completed for {stale:.0f} s"
        return True, ""

    def write_file_sd(self, targets: list[Target]) -> None:
        path = self.settings.file_sd
        if path is None:
            return
        text = file_sd(targets)
        if text != self._file_sd:
            atomic_write_text(Path(path), text)
            self._file_sd = text
