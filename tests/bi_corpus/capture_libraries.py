"""Record the SQL the libraries of tests/bi_libraries.py send into corpus files (tests/bi_corpus/<library>.yaml).

Run against `anonproxy up` as the direct role, from the repository root:

    python tests/bi_corpus/capture_libraries.py postgresql://dba:dba@127.0.0.1:6432/postgres

Each step of each library runs once; every statement it sends through psycopg 3 (which all the Python ones use:
the SQLAlchemy dialect postgresql+psycopg, Ibis's postgres backend, Peewee's psycopg 3 adapter, pandas and Polars
over either) is recorded by wrapping ``psycopg.Cursor.execute`` as it was sent, with its parameters; Knex and
Kysely (tests/bi_builders.py) report what they hand node-postgres themselves (Knex's query event, Kysely's log). A statement that
reads neither ``adult`` nor ``visits`` is a catalog statement (connect-time set-up, introspection); the others take
the step's kind. The same statement sent again (a connection's set-up) is kept once.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import sqlglot
import yaml
from sqlglot import exp

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import bi_builders
import bi_libraries

DEMO_TABLES = {"adult", "visits"}
Sent = tuple[str, object]


def reads_demo_tables(sql: str) -> bool:
    try:
        trees = sqlglot.parse(sql, read="postgres")
    except sqlglot.errors.ParseError:
        return False
    return any(table.name in DEMO_TABLES and table.db in ("", "public")
               for tree in trees if tree is not None for table in tree.find_all(exp.Table))


def plain(value: object) -> object:
    """A parameter as YAML holds it: numbers, strings, aware timestamps; anything else (a Decimal, the TextClause
    pandas passes to SQLAlchemy's has_table as a table name) as the text it is sent as."""
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    return value if value is None or isinstance(value, (int, float, str, bool, dt.datetime, dt.date)) else str(value)


@dataclass(frozen=True)
class Ran:
    """One step as it ran: its id, kind, call, whether it draws time, and the statements it sent."""

    id: str
    kind: str
    what: str
    time_series: bool
    sent: list[Sent]


def capture(library: bi_libraries.Library, url: str) -> list[Ran]:
    sent: list[Sent] = []
    original = psycopg.Cursor.execute

    def recording(cursor: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else query.as_string(cursor.connection)
        sent.append((text, params))
        return original(cursor, query, params, **kwargs)

    ran = []
    psycopg.Cursor.execute = recording  # type: ignore[method-assign]
    try:
        with bi_libraries.opened(library, url) as handle:
            for step in library.steps:
                del sent[:]
                step.run(handle)
                ran.append(Ran(step.id, step.kind, step.what, step.time_series, list(sent)))
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]
    return ran


def capture_builders(url: str) -> dict[str, list[Ran]]:
    """The steps of Knex and Kysely (tests/bi_builders.py) by tool; node-postgres sends every value as text."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    steps = bi_builders.run(str(info["host"]), int(info["port"]), str(info["dbname"]), str(info["user"]),
                            str(info["password"]))
    by_tool: dict[str, list[Ran]] = {}
    for step in steps:
        sent: list[Sent] = [(pyformat(statement["sql"], len(statement["params"])), statement["params"])
                            for statement in step["statements"]]
        by_tool.setdefault(step["tool"], []).append(
            Ran(step["id"], step["kind"], step["what"], step["time_series"], sent))
    return by_tool


def pyformat(sql: str, count: int) -> str:
    """node-postgres's ``$1 … $n`` (each once, in order, as Knex and Kysely write them) as psycopg's ``%s``, which
    the corpus's replay binds to the same $n; a % of the text doubled."""
    if not count:
        return sql
    parts = re.split(r"\$(\d+)\b", sql)
    assert [int(number) for number in parts[1::2]] == list(range(1, count + 1)), sql
    return "%s".join(part.replace("%", "%%") for part in parts[0::2])


def entries(version: str, ran: list[Ran]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    return [entry for step in ran for entry in _entries(version, step, seen)]


def _entries(version: str, step: Ran, seen: set[str]) -> list[dict[str, Any]]:
    chosen = []
    for sql, params in step.sent:
        key = repr((sql, params))
        if key in seen:
            continue
        seen.add(key)
        chosen.append((sql, params, step.kind if reads_demo_tables(sql) else "catalog"))
    entries = []
    for number, (sql, params, kind) in enumerate(chosen, 1):
        entry: dict[str, Any] = {
            "id": step.id if len(chosen) == 1 else f"{step.id}-{number}", "kind": kind,
            "source": f"{version} run: {step.what}" + ("" if kind == step.kind else " (sent by the library)"),
        }
        if params:  # psycopg sends a statement without parameters (None or empty) as a simple Query
            entry["params"] = plain(list(params) if isinstance(params, tuple) else params)
        if step.time_series and kind == "aggregate":
            entry["time_series"] = True
        entry["sql"] = sql
        entries.append(entry)
    return entries


def write(tool: str, file: str, version: str, binding: str, entries: list[dict[str, Any]]) -> None:
    header = (f"# {version}: every statement the library sent for its steps ({binding}), as recorded by\n"
              "# tests/bi_corpus/capture_libraries.py against `anonproxy up` as the direct role dba.\n")
    document = {"tool": tool, "corpus": "widened", "protocol": "simple", "entries": entries}
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=120)
    (Path(__file__).resolve().parent / f"{file}.yaml").write_text(header + text)


PSYCOPG_BINDING = "tests/bi_libraries.py; psycopg 3 binds parameters on the server: each %s or %(name)s is a $n"
NODE_BINDING = "tests/clients/node_builders/builders.js; node-postgres binds each value as text of no declared type"
BUILDERS = {"Knex": ("knex", "Knex 3.3 over node-postgres 8.23"), "Kysely": ("kysely", "Kysely 0.28 over node-postgres 8.23")}


def main(url: str) -> None:
    for library in bi_libraries.LIBRARIES:
        write(library.tool, library.file, library.version, PSYCOPG_BINDING, entries(library.version,
                                                                                      capture(library, url)))
    for tool, ran in capture_builders(url).items():
        file, version = BUILDERS[tool]
        write(tool, file, version, NODE_BINDING, entries(version, ran))


if __name__ == "__main__":
    main(sys.argv[1])
