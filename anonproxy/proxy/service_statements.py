"""The named statements on one service connection: the clients' and the proxy's own.

A seen suppress statement's generated SQL is long; PostgreSQL spends a fixed part of its time on it parsing,
analysing and planning the text (0.3 to 3 ms of CPU at 30k rows: docs/performance.md). So the rewrite of a simple
Query runs as a prepared statement of the connection's: parsed once per (connection, SQL text), named by a hash
of the text and of the settings its constants are read with, then only bound and executed. A statement without
parameters always runs PostgreSQL's generic plan: reuse skips parse analysis and planning, and PostgreSQL plans it
again itself after DDL on what it reads. A new policy writes a new text, hence a new name. PostgreSQL reads a
constant such as '2025-06-01 00:00' (a timestamptz beside a timestamptz column) once, at Parse, under the session's
TimeZone, DateStyle and IntervalStyle: a statement prepared under one TimeZone answered the same text sent under
another as if it were still the first, so those settings are part of the name. At most ``LIMIT`` are kept per
connection; the least recently used is closed first.

The record lives with the connection (pooled connections outlive the sessions that borrow them): it also holds
the names the borrowing session prepared for its client's Parse messages, which the next session closes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

from ..wire import protocol as pg

LIMIT = 32  # the proxy's own statements per connection (each keeps its parse tree and plan in the backend)
PREFIX = b"anonproxy_"
# The settings PostgreSQL reads a statement's date, time and interval constants with, once, at Parse.
READ_WITH = ("DateStyle", "IntervalStyle", "TimeZone")


def name_of(sql: str, settings: Mapping[str, str]) -> bytes:
    """The name of the statement of ``sql`` parsed under ``settings`` (the session's: those of READ_WITH count)."""
    reading = "\0".join(settings.get(name, "") for name in READ_WITH)
    return PREFIX + hashlib.sha256(f"{reading}\0{sql}".encode()).hexdigest()[:32].encode()


def close_statement(name: bytes) -> bytes:
    """Close of a statement (no error where there is none)."""
    return pg.message(b"C", b"S" + name + b"\0")


class ServiceStatements:
    def __init__(self) -> None:
        self._ours: OrderedDict[bytes, None] = OrderedDict()  # the proxy's own, least recently used first
        self.clients: set[bytes] = set()  # prepared there for a client's Parse by the session that holds it

    def run(self, sql: str, name: bytes) -> tuple[bytes, tuple[bytes, ...]]:
        """The messages that run ``sql`` as the connection's prepared statement ``name`` (:func:`name_of`; closed
        and prepared first when new there), up to its Sync, and the answers to hide from the client: it then sees
        the answer of a Query."""
        first: list[bytes] = []
        hidden: list[bytes] = []
        if name in self._ours:
            self._ours.move_to_end(name)
        else:
            if len(self._ours) >= LIMIT:
                oldest, _ = self._ours.popitem(last=False)
                first.append(close_statement(oldest))
                hidden.append(b"3")  # CloseComplete
            # Closed first: a client's statement may have the same name (it is then prepared again at its next use).
            self.clients.discard(name)
            first += [close_statement(name), pg.parse_message(name, sql, b"\0\0")]
            hidden += [b"3", b"1"]  # CloseComplete, ParseComplete
            self._ours[name] = None
        run = (pg.message(b"B", b"\0" + name + b"\0" + b"\0\0\0\0\0\0")  # no parameters, text results
               + pg.message(b"D", b"P\0") + pg.message(b"E", b"\0\0\0\0\0") + pg.message(b"S"))
        return b"".join(first) + run, (*hidden, b"2")  # BindComplete

    def forget(self, name: bytes) -> None:
        """Statement ``name`` was closed or prepared for a client: not one of ours any more."""
        self._ours.pop(name, None)

    def failed(self, name: bytes) -> None:
        """Running statement ``name`` failed: prepared anew next time (its Parse may be what failed)."""
        self._ours.pop(name, None)
