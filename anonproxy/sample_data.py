"""The UCI Adult (Census Income) data set, shipped for demos and tests.

``anonproxy/data/adult.data.gz`` is the UCI Machine Learning Repository
"Adult" training file (Becker & Kohavi, 1996; CC BY 4.0), unchanged. We keep
the 30,162 rows without a missing value (``?``), the subset used throughout
the anonymization literature, numbered 1..30162 in file order.
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Iterator
from importlib.resources import files

import psycopg
from psycopg import sql

ADULT_ROW_COUNT = 30162

ADULT_COLUMNS: tuple[str, ...] = (
    "id", "age", "workclass", "fnlwgt", "education", "education_num", "marital_status",
    "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
    "hours_per_week", "native_country", "income",
)  # fmt: skip

_INTEGER_COLUMNS = frozenset({"id", "age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"})


class SampleDataError(RuntimeError):
    """The sample table cannot be loaded as asked."""


def adult_rows() -> Iterator[tuple[int | str, ...]]:
    """Complete rows of adult.data as (id, age, workclass, ...), values trimmed, numbers as int."""
    converters = [int if name in _INTEGER_COLUMNS else str for name in ADULT_COLUMNS[1:]]
    with (
        files("anonproxy.data").joinpath("adult.data.gz").open("rb") as raw,
        gzip.open(raw, "rt", encoding="ascii", newline="") as text,
    ):
        row_id = 0
        for fields in csv.reader(text):
            values = [field.strip() for field in fields]
            if not values or "?" in values:  # the file ends with a blank line
                continue
            row_id += 1
            yield (row_id, *(convert(value) for convert, value in zip(converters, values, strict=True)))


def load_adult(conn: psycopg.Connection, table: str = "public.adult") -> int:
    """Create ``table`` with the Adult rows and ANALYZE it; returns the row count.

    Does nothing if the table already holds the 30,162 rows; refuses to touch a
    table of that name holding anything else.
    """
    target = sql.Identifier(*table.split("."))
    with conn.transaction():
        if _scalar(conn, sql.SQL("select to_regclass(%s)"), (table,)) is not None:
            count = _scalar(conn, sql.SQL("select count(*) from {}").format(target))
            if count == ADULT_ROW_COUNT:
                return ADULT_ROW_COUNT
            raise SampleDataError(
                f"table {table} already exists with {count} rows, not the {ADULT_ROW_COUNT} Adult rows; "
                "drop it or choose another name"
            )
        columns = sql.SQL(", ").join(
            sql.SQL("{} {} not null").format(
                sql.Identifier(name), sql.SQL("integer" if name in _INTEGER_COLUMNS else "text")
            )
            for name in ADULT_COLUMNS
        )
        conn.execute(sql.SQL("create table {} ({}, primary key (id))").format(target, columns))
        loaded = 0
        with conn.cursor().copy(sql.SQL("copy {} from stdin").format(target)) as copy:
            for row in adult_rows():
                copy.write_row(row)
                loaded += 1
        conn.execute(sql.SQL("analyze {}").format(target))
    return loaded


def _scalar(conn: psycopg.Connection, query: sql.SQL | sql.Composed, params: tuple[object, ...] = ()) -> object:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]
