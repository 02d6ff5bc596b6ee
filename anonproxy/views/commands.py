"""`anonproxy hierarchy|anonymize|release …`: the command-line side of anonymized views.

Wire into the main parser with ``register(subparsers)``. Each handler returns
the exit code: 0, or 1 with the server's message and hint on stderr (no
traceback) when the file, the connection or the database refuses. A login the
proxy gates is refused before anything is sent (:mod:`anonproxy.login`, exit 2).
``release list`` also shows what combining each release with the other releases
of its source reveals (:mod:`.combined`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .. import login
from . import combined, hierarchies
from .progress import ProgressBar
from .words import number


def register(subparsers: Any) -> None:
    """Add the ``hierarchy``, ``anonymize`` and ``release`` commands to an ``argparse`` subparsers object."""
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

    _register_anonymize(subparsers)
    _register_release(subparsers)


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
    except (hierarchies.HierarchyFileError, OSError) as exc:
        return fail("hierarchy", exc)
    return _store(args, lambda conn: hierarchies.load_hierarchy(conn, args.name, rows, args.replace), len(rows[0]) - 1)


def _build_intervals(args: argparse.Namespace) -> int:
    return _store(args, lambda conn: hierarchies.build_interval_hierarchy(
        conn, args.name, args.source, args.column, args.widths, args.replace), len(args.widths) + 1)


def _build_prefix(args: argparse.Namespace) -> int:
    return _store(args, lambda conn: hierarchies.build_prefix_hierarchy(
        conn, args.name, args.source, args.column, args.levels, args.replace), args.levels + 1)


def _store(args: argparse.Namespace, store: Callable[[psycopg.Connection], int], levels: int) -> int:
    """Run ``store`` (which returns the number of values) in one transaction and report it."""
    try:
        with login.connect(args.dsn, "hierarchy") as conn:
            leaves = store(conn)
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    print(f"hierarchy {args.name}: {leaves} values, {levels} levels above them")
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        with login.connect(args.dsn, "hierarchy") as conn:
            found = hierarchies.hierarchy_summary(conn)
    except psycopg.Error as exc:
        return fail("hierarchy", exc)
    width = max((len(name) for name, *_ in found), default=4)
    print(f"{'name':<{width}}  kind      levels  values")
    for name, kind, levels, leaves in found:
        print(f"{name:<{width}}  {kind:<8}  {levels:>6}  {leaves:>6}")
    return 0


def _drop(args: argparse.Namespace) -> int:
    return _call("hierarchy", args.dsn, "select anonproxy.drop_hierarchy(%s)", args.name, f"hierarchy {args.name} dropped")


def _call(command: str, dsn: str, query: str, argument: str, done: str) -> int:
    """Run a one-argument function call in its own transaction; print ``done`` if it succeeds."""
    try:
        with login.connect(dsn, command) as conn:
            conn.execute(query, (argument,))
    except psycopg.Error as exc:
        return fail(command, exc)
    print(done)
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


# anonymize ------------------------------------------------------------------------------------------

# Options passed to anonproxy.create_anonymized_view under the same name; unset ones keep its defaults.
_VIEW_OPTIONS = ("sensitive", "k", "l", "l_kind", "c", "t", "t_distance", "method", "suppression_limit", "unit")


def _register_anonymize(subparsers: Any) -> None:
    anonymize = subparsers.add_parser(
        "anonymize", help="create a k-anonymous (l-diverse, t-close) table from a table, inside PostgreSQL")
    anonymize.add_argument("--dsn", required=True, help="libpq connection string")
    anonymize.add_argument("--source", required=True, help="table or view to anonymize, e.g. public.adult")
    anonymize.add_argument("--target", required=True, help="table to create, e.g. public.adult_k10")
    anonymize.add_argument("--qi", required=True, type=name_list, help="quasi-identifiers, comma-separated")
    anonymize.add_argument("--sensitive", help="the sensitive column, kept as it is")
    anonymize.add_argument("--k", type=int, required=True, help="smallest equivalence class (k >= 2)")
    anonymize.add_argument("--l", type=Decimal, help="l-diversity of the sensitive column")
    anonymize.add_argument("--l-kind", choices=("distinct", "entropy", "recursive"), help="default entropy")
    anonymize.add_argument("--c", type=Decimal, help="c of recursive (c,l)-diversity")
    anonymize.add_argument("--t", type=Decimal, help="t-closeness of the sensitive column, in (0, 1]")
    anonymize.add_argument("--t-distance", choices=("ordered", "equal", "hierarchical"),
                           help="default: ordered for a numeric sensitive column, else equal")
    anonymize.add_argument("--method", choices=("mondrian", "mondrian_relaxed", "full_domain", "mdav", "tclose_first"),
                           help="default mondrian")
    anonymize.add_argument("--suppression-limit", type=Decimal, help="largest share of rows left out (default 0)")
    anonymize.add_argument("--unit", help="privacy-unit column: counts are of distinct units")
    anonymize.add_argument("--hierarchy", action="append", default=[], metavar="COLUMN=NAME", type=hierarchy_choice,
                           help="hierarchy of a column (repeatable); COLUMN= for none")
    anonymize.add_argument("--force", action="store_true", help="create it even if the composition guard objects")
    anonymize.set_defaults(run=_anonymize)


def name_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated column names, not {text!r}")
    return names


def hierarchy_choice(text: str) -> tuple[str, str | None]:
    column, equals, name = text.partition("=")
    if not equals or not column:
        raise argparse.ArgumentTypeError(f"expected COLUMN=HIERARCHY, not {text!r}")
    return column, name or None


def _anonymize(args: argparse.Namespace) -> int:
    too_large = _k_exceeding_source(args.dsn, args.source, args.unit, args.k)
    if too_large:
        for line in too_large:
            print(f"anonproxy anonymize: {line}", file=sys.stderr)
        return 1
    arguments: dict[str, object] = {"source": args.source, "target": args.target, "quasi_identifiers": args.qi}
    arguments.update({name: getattr(args, name) for name in _VIEW_OPTIONS if getattr(args, name) is not None})
    if args.hierarchy:
        arguments["hierarchies"] = json.dumps(dict(args.hierarchy))
    arguments["force"] = args.force
    casts = {"source": "::regclass", "hierarchies": "::jsonb", "quasi_identifiers": "::text[]", "k": "::integer"}
    casts.update({name: "::text" for name in ("target", "sensitive", "l_kind", "t_distance", "method", "unit")})
    query = sql.SQL("select * from anonproxy.create_anonymized_view({})").format(sql.SQL(", ").join(
        sql.SQL("{} => {}{}").format(sql.Identifier(name), sql.Placeholder(name), sql.SQL(casts.get(name, "")))
        for name in arguments))
    return _run_release_query("anonymize", args.dsn, query, arguments)


def _k_exceeding_source(dsn: str, source: str, unit: str | None, k: int) -> list[str]:
    """The error lines when k exceeds the rows (or privacy units) of the source, found before anything is copied.

    Empty when k fits, or when the count itself fails: create_anonymized_view
    then reports that problem in its own words.
    """
    try:
        with login.connect(dsn, "anonymize") as conn:
            row = conn.execute("select n.nspname, c.relname from pg_catalog.pg_class c join pg_catalog.pg_namespace n "
                               "on n.oid = c.relnamespace where c.oid = %s::regclass", (source,)).fetchone()
            assert row is not None
            counted = sql.SQL("count(distinct {})").format(sql.Identifier(unit)) if unit else sql.SQL("count(*)")
            counts = conn.execute(sql.SQL("select {} from {}").format(counted, sql.Identifier(*row))).fetchone()
    except psycopg.Error:
        return []
    assert counts is not None
    if k <= counts[0]:
        return []
    return [f"k = {k} exceeds the {counts[0]} {'privacy units' if unit else 'rows'} of {source} (SQLSTATE 22023)",
            "hint: no k-anonymous release of it exists: lower k"]


def _run_release_query(command: str, dsn: str, query: sql.SQL | sql.Composed, arguments: dict[str, object]) -> int:
    """Run a query returning anonproxy.release_summary with a progress bar; print the summary."""
    bar = ProgressBar(sys.stderr, f"anonproxy {command}")
    try:
        with login.connect(dsn, command) as conn:
            conn.add_notice_handler(bar.notice)
            cursor = conn.execute(query, arguments)
            row = cursor.fetchone()
            assert row is not None and cursor.description is not None
            summary = dict(zip((column.name for column in cursor.description), row, strict=True))
    except psycopg.Error as exc:
        bar.close()  # before the message, which must not land on the bar's line
        return fail(command, exc)
    finally:  # also on Ctrl-C, so that the shell prompt starts on a line of its own
        bar.close()
    print(_format_summary(summary))
    return 0


def _format_summary(summary: dict[str, Any]) -> str:
    lines = [f"release {summary['release_id']}: {summary['target']} ({summary['method']})",
             f"  k                    {summary['k']}"]
    if summary["l"] is not None:
        lines.append(f"  l                    {summary['l']:.4g}")
    if summary["c"] is not None:
        lines.append(f"  c (recursive)        above {summary['c']:.4g}")
    if summary["t"] is not None:
        lines.append(f"  t                    {summary['t']:.4g}")
    lines += [f"  equivalence classes  {summary['equivalence_classes']}",
              f"  suppressed rows      {summary['suppressed_rows']}",
              f"  NCP                  {summary['ncp'] * 100:.2f} % (information lost to generalization)"]
    if summary["sse_sst"] is not None:
        lines.append(f"  SSE/SST              {summary['sse_sst'] * 100:.2f} % (variance lost to averaging)")
    lines.append(f"  elapsed              {summary['elapsed'].total_seconds():.2f} s")
    return "\n".join(lines)


# release list | refresh | drop ------------------------------------------------------------------------


def _register_release(subparsers: Any) -> None:
    release = subparsers.add_parser("release", help="list, refresh or drop anonymized releases")
    actions = release.add_subparsers(required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list the releases and what they achieve")
    listing.add_argument("--dsn", required=True, help="libpq connection string")
    listing.set_defaults(run=_release_list)
    refresh = actions.add_parser("refresh", help="re-run a release on the current source rows")
    refresh.add_argument("target")
    refresh.add_argument("--dsn", required=True, help="libpq connection string")
    refresh.add_argument("--force", action="store_true", help="refresh it even if the composition guard objects")
    refresh.set_defaults(run=_release_refresh)
    drop = actions.add_parser("drop", help="drop a release's table and its registry row")
    drop.add_argument("target")
    drop.add_argument("--dsn", required=True, help="libpq connection string")
    drop.set_defaults(run=_release_drop)


def _release_list(args: argparse.Namespace) -> int:
    query = ("select id, target, method, source, (achieved ->> 'k')::numeric, (achieved ->> 'l_entropy')::numeric, "
             "(achieved ->> 't')::numeric, coalesce(refreshed_at, created_at)::timestamp(0)::text, combined "
             "from anonproxy.releases order by id")
    try:
        with login.connect(args.dsn, "release") as conn:
            rows = conn.execute(query).fetchall()
    except psycopg.Error as exc:
        return fail("release", exc)
    ids = {row[1]: row[0] for row in rows}
    header = ("id", "target", "method", "source", "k", "entropy ℓ", "t", "built", "revealed combined")
    # ℓ and t with four significant digits: the registry keeps 10 and 20 decimals, which tell nothing more.
    table = [header, *[(str(id_), target, method, source, number(k), "" if l is None else number(l),
                        "" if t is None else number(t), built, combined.cell(together, target, ids))
                       for id_, target, method, source, k, l, t, built, together in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip())
    if any(combined.others(row[-1], row[1]) for row in rows):
        print("\nrevealed combined: the share of people whose sensitive value combining the release with the releases "
              "of those ids (same source) reveals exactly; `anonproxy verify TARGET` says it in words")
    return 0


def _release_refresh(args: argparse.Namespace) -> int:
    query = sql.SQL("select * from anonproxy.refresh_anonymized_view(%(target)s, force => %(force)s)")
    return _run_release_query("release", args.dsn, query, {"target": args.target, "force": args.force})


def _release_drop(args: argparse.Namespace) -> int:
    return _call("release", args.dsn, "select anonproxy.drop_release(%s)", args.target, f"release {args.target} dropped")
