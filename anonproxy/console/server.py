"""The console's HTTP server: GET only, one database connection per request, as the login it was given.

Each section of a page is read on its own: a login that may not read one part
(InsufficientPrivilege) gets "this login may not read …" there and the rest of
the page. Any other failure is a one-line error page, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import psycopg

from . import flags, pages, queries
from .queries import TrailSearch

log = logging.getLogger("anonproxy.console")
T = TypeVar("T")


class Unreadable(Exception):
    """The login may not read a part of a page; the exception's text is that part's HTML."""


def read(what: str, reader: Callable[[], T]) -> T:
    """``reader()``, or Unreadable when the login lacks the privilege to read ``what``."""
    try:
        return reader()
    except psycopg.errors.InsufficientPrivilege as exc:
        raise Unreadable(pages.denied(what, exc.diag.message_primary or str(exc))) from exc


class BadRequest(ValueError):
    """A query string the console cannot read."""


def parse_search(query: dict[str, list[str]]) -> TrailSearch:
    def one(name: str) -> str | None:
        value = query.get(name, [""])[-1].strip()
        return value or None

    try:
        since, until = (datetime.fromisoformat(v).astimezone() if (v := one(name)) else None
                        for name in ("since", "until"))
        ids = tuple(int(i) for i in (one("ids") or "").split(",") if i.strip())
        page = int(one("page") or 1)
    except ValueError as exc:
        raise BadRequest(f"a search field is not understood: {exc}") from exc
    return TrailSearch(login=one("login"), since=since, until=until, table=one("table"), decision=one("decision"),
                       text=one("text"), ids=ids, page=max(page, 1))


def budgets_page(conn: psycopg.Connection, query: dict[str, list[str]]) -> str:
    rows = read("the budgets", lambda: queries.budgets(conn))
    histories = read("the budget ledger", lambda: {(r.role_name, r.domain): queries.spending_history(
        conn, r.role_name, r.domain) for r in rows})
    return pages.budgets_body(rows, histories)


def trail_page(conn: psycopg.Connection, query: dict[str, list[str]]) -> str:
    search = parse_search(query)
    found = read("the audit trail", lambda: queries.trail_page(conn, search))
    return pages.trail_body(found, search, queries.trail_logins(conn))


def flags_page(conn: psycopg.Connection, query: dict[str, list[str]]) -> str:
    search = parse_search(query)
    rows = read("the audit trail", lambda: queries.flag_rows(conn, search))
    identifiers = queries.identifying_columns(conn)
    budgets = read("the budgets", lambda: queries.budgets(conn))
    found = (flags.refusal_bursts(rows) + flags.identifying_columns(rows, identifiers)
             + flags.differencing_pairs(rows) + flags.budget_exhaustion([b.as_flag_input() for b in budgets], rows))
    return pages.flags_body(found, len(rows), queries.FLAG_ROWS)


def releases_page(conn: psycopg.Connection, query: dict[str, list[str]]) -> str:
    releases = read("the release registry", lambda: queries.releases(conn))
    measured: dict[int, dict[str, Any] | str] = {}
    for release in releases:
        try:
            measured[release["id"]] = queries.release_now(conn, release["id"])
        except psycopg.errors.InsufficientPrivilege as exc:
            measured[release["id"]] = f"this login may not measure it: {exc.diag.message_primary}"
    return pages.releases_body(releases, measured)


def policy_page(conn: psycopg.Connection, query: dict[str, list[str]]) -> str:
    return pages.policy_body(read("the policy history", lambda: queries.policy_history(conn)))


ROUTES: dict[str, tuple[str, Callable[[psycopg.Connection, dict[str, list[str]]], str]]] = {
    "/budgets": ("Privacy budgets", budgets_page),
    "/trail": ("Audit trail", trail_page),
    "/flags": ("Flags", flags_page),
    "/releases": ("Releases", releases_page),
    "/policy": ("Policy history", policy_page),
}


class Handler(BaseHTTPRequestHandler):
    dsn: str = ""  # set on the subclass serve() makes

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = "/budgets" if url.path in ("", "/") else url.path
        if path not in ROUTES:
            self._send(HTTPStatus.NOT_FOUND, "<!DOCTYPE html><p>No such page. <a href=\"/\">The console</a></p>")
            return
        title, render = ROUTES[path]
        try:
            with queries.connect(self.dsn) as conn:
                login, database = queries.who(conn)
                try:
                    body = render(conn, parse_qs(url.query))
                except Unreadable as exc:
                    body = str(exc)
            self._send(HTTPStatus.OK, pages.layout(path, title, login, database, body))
        except BadRequest as exc:
            self._send(HTTPStatus.BAD_REQUEST, f"<!DOCTYPE html><p>{pages.e(exc)}</p>")
        except psycopg.Error as exc:
            message = (exc.diag.message_primary if isinstance(exc, psycopg.DatabaseError) else None) or str(exc)
            log.warning("console page %s: %s", path, message.strip())
            self._send(HTTPStatus.SERVICE_UNAVAILABLE,
                       f"<!DOCTYPE html><p>the database refused: {pages.e(message.strip())}</p>")
        except Exception as exc:  # noqa: BLE001 (a page that cannot be made: one line to the log and the browser)
            log.error("console page %s failed: %s: %s", path, type(exc).__name__, exc)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                       f"<!DOCTYPE html><p>this page failed: {pages.e(type(exc).__name__)}: {pages.e(exc)}</p>")

    def _send(self, status: HTTPStatus, page: str) -> None:
        data = page.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        # The page is read from this server alone: no script, no other origin.
        self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)


def make_server(dsn: str, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("ConsoleHandler", (Handler,), {"dsn": dsn})
    return ThreadingHTTPServer((host, port), handler)
