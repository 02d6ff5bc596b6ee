"""The sample data of demos and tests: the UCI Adult (Census Income) data set, and a dated table linked to it.

``anonproxy/data/adult.data.gz`` is the UCI Machine Learning Repository
"Adult" training file (Becker & Kohavi, 1996; CC BY 4.0), unchanged. We keep
the 30,162 rows without a missing value (``?``), the subset used throughout
the anonymization literature, numbered 1..30162 in file order.

``public.visits`` is made up: one to five visits per person of ``adult``, at
times uniform over 2025–2026 (UTC), drawn from a fixed seed, so the same rows on
every run: ``visits (visit_id bigint primary key, person_id integer not null,
visited_at timestamptz not null, channel text not null, amount numeric(10,2) not
null)``, person_id an id of ``adult`` (no foreign key: dropping or changing
``adult`` stays the owner's business, as with any linked table). Its policy (a linked table of ``adult`` on
``person_id``, visited_at's time bounds) is in ``data/demo_policy.yaml``.
"""

from __future__ import annotations

import csv
import gzip
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
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


VISITS_TABLE = "public.visits"
VISITS_SEED = 19
VISITS_FIRST = datetime(2025, 1, 1, tzinfo=UTC)
_VISITS_SECONDS = int((datetime(2027, 1, 1, tzinfo=UTC) - VISITS_FIRST).total_seconds())  # to 2026-12-31 23:59:59
VISIT_CHANNELS = ("web", "app", "store", "phone")
_AMOUNT_CENTS = (500, 50_000)  # 5.00 to 500.00

Visit = tuple[int, int, datetime, str, Decimal]


def visit_rows(person_ids: list[int]) -> list[Visit]:
    """The visits of ``person_ids``, the same for the same ids: one to five each, uniform over the two years."""
    rng = random.Random(VISITS_SEED)
    visits: list[Visit] = []
    for person in person_ids:
        for _ in range(rng.randint(1, 5)):
            visited_at = VISITS_FIRST + timedelta(seconds=rng.randrange(_VISITS_SECONDS))
            amount = Decimal(rng.randint(*_AMOUNT_CENTS)) / 100
            visits.append((len(visits) + 1, person, visited_at, rng.choice(VISIT_CHANNELS), amount))
    return visits


def load_visits(conn: psycopg.Connection) -> int:
    """Create ``public.visits`` with the visits of every person of ``public.adult`` and ANALYZE it; the row count.
    Does nothing if the table exists (a reused data directory keeps what its owner did with it)."""
    with conn.transaction():
        if _scalar(conn, sql.SQL("select to_regclass(%s)"), (VISITS_TABLE,)) is not None:
            count = _scalar(conn, sql.SQL("select count(*) from public.visits"))
            assert isinstance(count, int)
            return count
        conn.execute("create table public.visits (visit_id bigint primary key, person_id integer not null, "
                     "visited_at timestamptz not null, channel text not null, amount numeric(10,2) not null)")
        people = [row[0] for row in conn.execute("select id from public.adult order by id")]
        visits = visit_rows(people)
        with conn.cursor().copy("copy public.visits (visit_id, person_id, visited_at, channel, amount) "
                                "from stdin") as copy:
            for row in visits:
                copy.write_row(row)
        conn.execute("create index visits_person_id on public.visits (person_id)")
        conn.execute("analyze public.visits")
    return len(visits)


def load_demo(conn: psycopg.Connection) -> None:
    """The demo's tables, as its policy declares them: ``public.adult``, then the visits of its people."""
    load_adult(conn)
    load_visits(conn)


def _scalar(conn: psycopg.Connection, query: sql.SQL | sql.Composed, params: tuple[object, ...] = ()) -> object:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]
