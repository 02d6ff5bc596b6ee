"""Progress of the long commands on stderr: a bar on a terminal, plain lines otherwise.

Commands call :meth:`ProgressBar.update` at each step (``install``: a migration,
``report``: a section, ``audit``: a group of releases) and :meth:`ProgressBar.say`
for a step without a count (``up`` starting and stopping).

``anonymize`` and ``release refresh`` are fed by the database:
``create_anonymized_view`` and the methods it calls raise an ``anonproxy progress N of M: phase`` NOTICE at each
phase or round (docs/views-internals.md); PostgreSQL sends it while the
statement runs, and psycopg hands it to :meth:`ProgressBar.notice`. On a
terminal the bar redraws one line; otherwise each notice becomes a line.
Warnings (e.g. the composition guard's) are printed; other notices are not.
"""

from __future__ import annotations

import re
import shutil
from typing import TextIO

from psycopg.errors import Diagnostic

PROGRESS_NOTICE = re.compile(r"anonproxy progress (\d+) of (\d+): (.*)", re.DOTALL)
_BAR_WIDTH = 30


class ProgressBar:
    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self.interactive = stream.isatty()
        self._line_open = False  # a bar is drawn and its line not ended

    def notice(self, diagnostic: Diagnostic) -> None:
        message = diagnostic.message_primary or ""
        match = PROGRESS_NOTICE.fullmatch(message)
        if match is not None:
            self.update(int(match[1]), int(match[2]), match[3])
        elif diagnostic.severity_nonlocalized == "WARNING":
            self.close()
            self.stream.write(f"{self.prefix}: warning: {message}\n")
            for label, text in (("detail", diagnostic.message_detail), ("hint", diagnostic.message_hint)):
                if text:
                    self.stream.write(f"{self.prefix}: {label}: {text}\n")
            self.stream.flush()

    def update(self, done: int, total: int, phase: str) -> None:
        if not self.interactive:
            self.stream.write(f"{self.prefix}: {done}/{total} {phase}\n")
            self.stream.flush()
            return
        filled = min(_BAR_WIDTH, round(_BAR_WIDTH * done / total)) if total > 0 else 0
        line = f"[{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] {done}/{total} {phase}"
        columns = shutil.get_terminal_size().columns
        self.stream.write("\r" + line[: columns - 1] + "\x1b[K")  # \x1b[K clears the rest of the old line
        self.stream.flush()
        self._line_open = True

    def say(self, message: str) -> None:
        """A line of its own, e.g. what starts now or what was done."""
        self.close()
        self.stream.write(f"{self.prefix}: {message}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line, so that what follows starts on a line of its own."""
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False
