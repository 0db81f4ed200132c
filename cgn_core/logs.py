"""Logging setup shared by every daemon: human text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from cgn_core.settings import LogSettings

# Attributes every LogRecord has; anything else came from `extra=` and is emitted.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, service, and any `extra=` fields."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(service: str, settings: LogSettings, stream: TextIO | None = None) -> None:
    """Configure the root logger once for a daemon; replaces any earlier handlers."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if settings.format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
    # grpc and aiohttp are chatty at debug level; keep them at warning unless asked.
    for noisy in ("grpc", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
