"""`anonproxy hierarchy …` and `anonproxy anonymize …`: the command-line side of anonymized views.

Wire into the main parser with ``register(subparsers)``. Each handler returns
the exit code: 0, or 1 with the server's message and hint on stderr (no
traceback) when the file, the connection or the database refuses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import psycopg

from . import hierarchies


def register(subparsers: Any) -> None:
    """Add the ``hierarchy`` and ``anonymize`` commands to an ``argparse`` subparsers object."""
    hierarchy = subparsers.add_parser("hierarchy", help="load, build or list generalization hierarchies")
    actions = hierarchy.add_subparsers(required=True, metavar="ACTION")

    load = actions.add_parser("load", help="store an ARX-style CSV file (one row per value, columns = levels)")
    load.add_argument("name", help="hierarchy name, e.g. adult.education")
    load.add_argument("file", type=Path, help="CSV file: value;level 1;…;*")
    load.add_argument("--delimiter", default=";", help="column separator (default ;)")
    _common_options(load)
    load.set_defaults(run=_load)

    intervals = actions.add_parser("build-intervals", help="build nested numeric ranges over an integer column")
    intervals.add_argument("name")
    intervals.add_argument("--source", required=True, help="table holding the values")
    intervals.add_argument("--column", required=True)
    intervals.add_argument("--widths", required=True, type=_int_list,
                           help="comma-separated widths, each a multiple of the one before, e.g. 5,10,20")
    _common_options(intervals)
    intervals.set_defaults(run=_build_intervals)

    prefix = actions.add_parser("build-prefix", help="build a hierarchy masking trailing characters (ZIP codes)")
    prefix.add_argument("name")
    prefix.add_argument("--source", required=True, help="table holding the values")
    prefix.add_argument("--column", required=True)
    prefix.add_argument("--levels", required=True, type=int, help="how many characters to mask, one per level")
    _common_options(prefix)
    prefix.set_defaults(run=_build_prefix)

    listing = actions.add_parser("list", help="list the stored hierarchies")
    listing.add_argument("--dsn", required=True, help="libpq connection string")
    listing.set_defaults(run=_list)

    drop = actions.add_parser("drop", help="delete a hierarchy")
    drop.add_argument("name")
    drop.add_argument("--dsn", required=True, help="libpq connection string")
    drop.set_defaults(run=_drop)


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", required=True, help="libpq connection string")
    parser.add_argument("--replace", action="store_true", help="replace a hierarchy of the same name")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, not {text!r}") from None


def _load(args: argparse.Namespace) -> int:
    try:
        rows = hierarchies.read_hierarchy_file(args.file, args.delimiter)
        with psycopg.connect(args.dsn) as conn:
            leaves = hierarchies.load_hierarchy(conn, args.name, rows, args.replace)
    except (hierarchies.HierarchyFileError, psycopg.Error, OSError) as exc:
        return fail("hierarchy", exc)
    print(f"hierarchy {args.name}: {leaves} values, {len(rows[0]) - 1} levels above them")
    return 0


def _build_intervals(args: argparse.Namespace) -> int:
    try:
        with psycopg.connect(args.dsn) as conn:
            leaves = hierarchies.build_interval_hierarchy(
                conn, args.name, args.source, args.column, args.widths, args.replace)
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    print(f"hierarchy {args.name}: {leaves} values, {len(args.widths) + 1} levels above them")
    return 0


def _build_prefix(args: argparse.Namespace) -> int:
    try:
        with psycopg.connect(args.dsn) as conn:
            leaves = hierarchies.build_prefix_hierarchy(
                conn, args.name, args.source, args.column, args.levels, args.replace)
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    print(f"hierarchy {args.name}: {leaves} values, {args.levels + 1} levels above them")
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        with psycopg.connect(args.dsn) as conn:
            found = hierarchies.hierarchy_summary(conn)
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    width = max((len(name) for name, *_ in found), default=4)
    print(f"{'name':<{width}}  kind      levels  values")
    for name, kind, levels, leaves in found:
        print(f"{name:<{width}}  {kind:<8}  {levels:>6}  {leaves:>6}")
    return 0


def _drop(args: argparse.Namespace) -> int:
    try:
        with psycopg.connect(args.dsn) as conn:
            conn.execute("select anonproxy.drop_hierarchy(%s)", (args.name,))
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    print(f"hierarchy {args.name} dropped")
    return 0


def fail(command: str, exc: Exception) -> int:
    """Print why a command failed, as ``anonproxy COMMAND: …`` lines on stderr; returns 1."""
    if isinstance(exc, psycopg.Error) and exc.diag.message_primary:
        lines = [f"{exc.diag.message_primary} (SQLSTATE {exc.diag.sqlstate})"]
        if exc.diag.message_detail:
            lines.append(f"detail: {exc.diag.message_detail}")
        if exc.diag.message_hint:
            lines.append(f"hint: {exc.diag.message_hint}")
    elif isinstance(exc, OSError) and exc.filename is not None:
        lines = [f"{exc.filename}: {exc.strerror}"]
    else:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
    for line in lines:
        print(f"anonproxy {command}: {line}", file=sys.stderr)
    return 1
