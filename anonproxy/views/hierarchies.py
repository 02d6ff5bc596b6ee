"""Generalization hierarchies: read ARX CSV files and store them with ``anonproxy.load_hierarchy``.

The database checks that a hierarchy is a consistent tree (sql/0004); this
module only turns a file into rows and reports file-level mistakes (ragged rows,
an empty file) with their line numbers.

The Adult hierarchies shipped in ``anonproxy/data/hierarchies/`` are ARX's
(``datasets/adult/adult_hierarchy_*.csv``), renamed to our column names;
``income`` is ARX's ``salary-class``.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path

import psycopg

# Columns of public.adult with a shipped ARX hierarchy (file anonproxy/data/hierarchies/<column>.csv).
ADULT_CSV_COLUMNS: tuple[str, ...] = (
    "education", "income", "marital_status", "native_country", "occupation", "race", "sex", "workclass",
)  # fmt: skip
# Numeric columns of public.adult get interval hierarchies: widths per level, then '*'. ARX's age file
# has the same shape (5, 10, 20) but labels shifted by one (26..30 under "25-29"), and a release cell
# "25-29" must mean 25..29 to whoever reads it back, so age is built here too.
ADULT_INTERVAL_WIDTHS: dict[str, tuple[int, ...]] = {
    "age": (5, 10, 20),
    "education_num": (2, 4, 8),
    "hours_per_week": (5, 10, 20, 40),
}


class HierarchyFileError(ValueError):
    """A hierarchy file is not a rectangular ``;``-separated table of values."""


def parse_hierarchy_csv(text: str, source: str = "<text>", delimiter: str = ";") -> list[list[str]]:
    """Rows of an ARX hierarchy file: one row per value, columns = levels 0..n.

    Blank lines are skipped; every other row must have as many columns as the
    first, and at least two (the value and the top).
    """
    rows: list[list[str]] = []
    width = 0
    for line_number, fields in enumerate(csv.reader(io.StringIO(text), delimiter=delimiter), start=1):
        if not fields or fields == [""]:
            continue
        if not rows:
            width = len(fields)
            if width < 2:
                raise HierarchyFileError(
                    f"{source}:{line_number}: one column; a hierarchy row needs the value and at least the top "
                    f"level (columns separated by {delimiter!r})"
                )
        elif len(fields) != width:
            raise HierarchyFileError(
                f"{source}:{line_number}: {len(fields)} columns, but the first row has {width}; "
                "every value needs an ancestor at every level"
            )
        rows.append(fields)
    if not rows:
        raise HierarchyFileError(f"{source}: no rows")
    return rows


def read_hierarchy_file(path: Path, delimiter: str = ";") -> list[list[str]]:
    return parse_hierarchy_csv(path.read_text(encoding="utf-8-sig"), str(path), delimiter)


def load_hierarchy(conn: psycopg.Connection, name: str, rows: list[list[str]], replace: bool = False) -> int:
    """Store ``rows`` as hierarchy ``name``; returns the number of values (leaves)."""
    row = conn.execute("select anonproxy.load_hierarchy(%s, %s::text[], %s)", (name, rows, replace)).fetchone()
    assert row is not None
    return int(row[0])


def load_adult_hierarchies(conn: psycopg.Connection, table: str = "public.adult") -> list[str]:
    """Create the ``adult.<column>`` hierarchies that do not exist yet; returns the names created.

    The categorical ones come from the shipped ARX CSV files; ``age``,
    ``education_num`` and ``hours_per_week`` get interval hierarchies built
    from ``table``.
    """
    created: list[str] = []
    with conn.transaction():
        existing = {name for (name,) in conn.execute("select name from anonproxy.hierarchies")}
        for column in ADULT_CSV_COLUMNS:
            name = f"adult.{column}"
            if name not in existing:
                resource = files("anonproxy.data").joinpath("hierarchies", f"{column}.csv")
                load_hierarchy(conn, name, parse_hierarchy_csv(resource.read_text(encoding="utf-8"), name))
                created.append(name)
        for column, widths in ADULT_INTERVAL_WIDTHS.items():
            name = f"adult.{column}"
            if name not in existing:
                build_interval_hierarchy(conn, name, table, column, widths)
                created.append(name)
    return created


def build_interval_hierarchy(
    conn: psycopg.Connection, name: str, source: str, column: str, widths: Iterable[int], replace: bool = False
) -> int:
    row = conn.execute(
        "select anonproxy.build_interval_hierarchy(%s, %s::regclass, %s, %s::numeric[], %s)",
        (name, source, column, list(widths), replace),
    ).fetchone()
    assert row is not None
    return int(row[0])


def build_prefix_hierarchy(
    conn: psycopg.Connection, name: str, source: str, column: str, levels: int, replace: bool = False
) -> int:
    row = conn.execute(
        "select anonproxy.build_prefix_hierarchy(%s, %s::regclass, %s, %s, %s)",
        (name, source, column, levels, replace),
    ).fetchone()
    assert row is not None
    return int(row[0])


def hierarchy_summary(conn: psycopg.Connection) -> list[tuple[str, str, int, int]]:
    """(name, kind, levels, leaves) of every stored hierarchy, by name."""
    query = (
        "select h.name, h.kind, h.levels, (select count(*) from anonproxy.hierarchy_nodes n"
        " where n.hierarchy = h.name and n.level = 0)::int from anonproxy.hierarchies h order by h.name"
    )
    return [(name, kind, levels, leaves) for name, kind, levels, leaves in conn.execute(query)]
