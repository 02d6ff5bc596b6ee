"""Logging set-up: one line per event, as text or as JSON."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """At most ``limit`` lines per ``period`` seconds, then one line saying how many were left out.

    For events a peer can cause at will (malformed packets), so that logging them cannot flood the log.
    """

    def __init__(self, logger: logging.Logger, limit: int = 20, period: float = 60.0) -> None:
        self._logger = logger
        self._limit = limit
        self._period = period
        self._window_start = time.monotonic()
        self._logged = 0
        self._left_out = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self._period:
            if self._left_out:
                self._logger.warning("%d more such lines in the last %.0f s were left out", self._left_out,
                                     now - self._window_start)
            self._window_start, self._logged, self._left_out = now, 0, 0
        if self._logged < self._limit:
            self._logged += 1
            self._logger.warning(message, *args)
        else:
            self._left_out += 1
