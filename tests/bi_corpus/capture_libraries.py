"""Record the SQL the libraries of tests/bi_libraries.py send into corpus files (tests/bi_corpus/<library>.yaml).

Run against `anonproxy up` as the direct role, from the repository root:

    python tests/bi_corpus/capture_libraries.py postgresql://dba:dba@127.0.0.1:6432/postgres

Each step of each library runs once; every statement it sends through psycopg 3 (which all of them use: the
SQLAlchemy dialect postgresql+psycopg, Ibis's postgres backend, Peewee's psycopg 3 adapter, pandas and Polars over
either) is recorded by wrapping ``psycopg.Cursor.execute`` as it was sent, with its parameters. A statement that
reads neither ``adult`` nor ``visits`` is a catalog statement (connect-time set-up, introspection); the others take
the step's kind. The same statement sent again (a connection's set-up) is kept once.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
import sqlglot
import yaml
from sqlglot import exp

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

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


def capture(library: bi_libraries.Library, url: str) -> list[dict[str, Any]]:
    sent: list[Sent] = []
    original = psycopg.Cursor.execute

    def recording(cursor: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else query.as_string(cursor.connection)
        sent.append((text, params))
        return original(cursor, query, params, **kwargs)

    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    psycopg.Cursor.execute = recording  # type: ignore[method-assign]
    try:
        with bi_libraries.opened(library, url) as handle:
            for step in library.steps:
                del sent[:]
                step.run(handle)
                entries.extend(_entries(library, step, list(sent), seen))
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]
    return entries


def _entries(library: bi_libraries.Library, step: bi_libraries.Step, sent: list[Sent],
             seen: set[str]) -> list[dict[str, Any]]:
    chosen = []
    for sql, params in sent:
        key = repr((sql, params))
        if key in seen:
            continue
        seen.add(key)
        chosen.append((sql, params, step.kind if reads_demo_tables(sql) else "catalog"))
    entries = []
    for number, (sql, params, kind) in enumerate(chosen, 1):
        entry: dict[str, Any] = {
            "id": step.id if len(chosen) == 1 else f"{step.id}-{number}", "kind": kind,
            "source": f"{library.version} run: {step.what}" + ("" if kind == step.kind else " (sent by the library)"),
        }
        if params:  # psycopg sends a statement without parameters (None or empty) as a simple Query
            entry["params"] = plain(list(params) if isinstance(params, tuple) else params)
        if step.time_series and kind == "aggregate":
            entry["time_series"] = True
        entry["sql"] = sql
        entries.append(entry)
    return entries


def write(library: bi_libraries.Library, entries: list[dict[str, Any]]) -> None:
    header = (f"# {library.version}: every statement the library sent for the steps of tests/bi_libraries.py, as\n"
              "# recorded by tests/bi_corpus/capture_libraries.py against `anonproxy up` as the direct role dba\n"
              "# (psycopg 3 binds parameters on the server: each %s or %(name)s is a $n of the extended protocol).\n")
    document = {"tool": library.tool, "corpus": "widened", "protocol": "simple", "entries": entries}
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=120)
    (Path(__file__).resolve().parent / f"{library.file}.yaml").write_text(header + text)


def main(url: str) -> None:
    for library in bi_libraries.LIBRARIES:
        write(library, capture(library, url))


if __name__ == "__main__":
    main(sys.argv[1])
