"""`anonproxy console --dsn DSN [--host H] [--port P]`: serve the console until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import psycopg

from . import queries
from .server import make_server

DEFAULT_PORT = 6480


def register(subparsers: Any) -> None:
    """Add the ``console`` command to an ``argparse`` subparsers object."""
    console = subparsers.add_parser("console", help="serve a read-only web page of the audit trail, budgets, flags, "
                                                    "releases and policy history")
    console.add_argument("--dsn", required=True,
                         help="libpq connection string of the login the page reads as (a member of "
                              "anonproxy_auditor)")
    console.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    console.add_argument("--port", type=int, default=DEFAULT_PORT,
                         help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one)")
    console.set_defaults(run=_console)


def _console(args: argparse.Namespace) -> int:
    try:
        with queries.connect(args.dsn) as conn:
            login, database = queries.who(conn)
    except psycopg.Error as exc:
        print(f"anonproxy console: cannot log in: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    try:
        server = make_server(args.dsn, args.host, args.port)
    except OSError as exc:
        print(f"anonproxy console: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _stop)
    print(f"anonproxy console: http://{args.host}:{server.server_port}/ reads database {database} as {login}; Ctrl-C stops it",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _stop(signum: int, frame: object) -> None:
    """SIGTERM stops the console as Ctrl-C does."""
    raise KeyboardInterrupt
