"""anonproxy.anonymize_mondrian releases exactly what sql/0036's version released, on every kind of run.

A change made for speed must not change a release. The version of sql/0036
(the last one before the rounds ran without DDL) is read from its migration
file and created as a function of this session's pg_temp schema; each case
below stages one input, runs both versions on it and compares the two
outputs row for row and cell for cell, and the facts both return (rounds,
partitions, atoms). The cases are those benchmarks/views/README.md lists:
strict k = 10 on adult, k = 50, distinct ℓ, recursive (c,ℓ), entropy ℓ,
t-closeness with its three distances, units of several rows (with and
without ℓ), and the relaxed variant; a QI without a hierarchy, whose
cells are value sets; and twelve QIs whose codes need a numeric key, two of
them value sets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

MIGRATION_0036 = (
    Path(__file__).resolve().parent.parent / "sql" / "0036_mondrian_lean.sql"
)

ADULT_QI: list[dict[str, Any]] = [
    {"name": "age", "kind": "numeric", "hierarchy": None},
    {"name": "workclass", "kind": "categorical", "hierarchy": "adult.workclass"},
    {"name": "education_num", "kind": "numeric", "hierarchy": None},
    {
        "name": "marital_status",
        "kind": "categorical",
        "hierarchy": "adult.marital_status",
    },
    {"name": "occupation", "kind": "categorical", "hierarchy": "adult.occupation"},
    {"name": "race", "kind": "categorical", "hierarchy": "adult.race"},
    {"name": "sex", "kind": "categorical", "hierarchy": "adult.sex"},
    {
        "name": "native_country",
        "kind": "categorical",
        "hierarchy": "adult.native_country",
    },
]
INCOME = {"name": "income", "kind": "categorical", "hierarchy": "adult.income"}
OCCUPATION_SET = {"name": "occupation", "kind": "categorical", "hierarchy": None}
OCCUPATION_TREE = {
    "name": "occupation",
    "kind": "categorical",
    "hierarchy": "adult.occupation",
}
HOURS = {"name": "hours_per_week", "kind": "numeric", "hierarchy": None}
# Without occupation among the QIs, so that it can be the sensitive column.
SMALL_QI = [q for q in ADULT_QI if q["name"] != "occupation"]
# Occupation without its hierarchy: a class's cell lists the occupations it holds.
SET_QI = [OCCUPATION_SET if q["name"] == "occupation" else q for q in ADULT_QI]
# Twelve QIs whose codes do not fit in a bigint key (the product of their numbers of distinct
# values on adult is 6.6e18, more than 2^62: the key is numeric), two of them value sets.
NUMERIC_KEY_QI: list[dict[str, Any]] = [
    {"name": name, "kind": "numeric", "hierarchy": None}
    for name in ("fnlwgt", "capital_gain", "capital_loss", "hours_per_week")
] + [
    {**q, "hierarchy": None} if q["name"] in ("workclass", "marital_status") else q
    for q in ADULT_QI
]

ONE_ROW_PER_UNIT = "id::text"
TWO_ROWS_PER_UNIT = (
    "(id / 2)::text"  # rows 2n and 2n + 1 are one person, mostly with different QIs
)

CASES: dict[
    str, tuple[str, list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]
] = {
    "strict k=10": (ONE_ROW_PER_UNIT, ADULT_QI, None, {"k": 10}),
    "strict k=50": (ONE_ROW_PER_UNIT, ADULT_QI, None, {"k": 50}),
    "strict k=10, value sets": (ONE_ROW_PER_UNIT, SET_QI, None, {"k": 10}),
    "strict k=10, numeric key, two value sets": (ONE_ROW_PER_UNIT, NUMERIC_KEY_QI, None, {"k": 10}),
    "distinct l=2": (
        ONE_ROW_PER_UNIT,
        ADULT_QI,
        INCOME,
        {"k": 10, "l": 2, "l_kind": "distinct"},
    ),
    "entropy l=3": (
        ONE_ROW_PER_UNIT,
        SMALL_QI,
        OCCUPATION_TREE,
        {"k": 5, "l": 3, "l_kind": "entropy"},
    ),
    "recursive (2,3)": (
        ONE_ROW_PER_UNIT,
        SMALL_QI,
        OCCUPATION_SET,
        {"k": 5, "l": 3, "l_kind": "recursive", "c": 2},
    ),
    "t=0.2 ordered": (
        ONE_ROW_PER_UNIT,
        ADULT_QI,
        INCOME,
        {"k": 10, "t": 0.2, "t_distance": "ordered"},
    ),
    "t=0.1 ordered numeric": (
        ONE_ROW_PER_UNIT,
        ADULT_QI,
        HOURS,
        {"k": 5, "t": 0.1, "t_distance": "ordered"},
    ),
    "t=0.3 equal": (
        ONE_ROW_PER_UNIT,
        SMALL_QI,
        OCCUPATION_SET,
        {"k": 5, "t": 0.3, "t_distance": "equal"},
    ),
    "t=0.1 hierarchical": (
        ONE_ROW_PER_UNIT,
        SMALL_QI,
        OCCUPATION_TREE,
        {"k": 5, "t": 0.1, "t_distance": "hierarchical"},
    ),
    "two rows per unit": (TWO_ROWS_PER_UNIT, ADULT_QI, None, {"k": 10}),
    "two rows per unit, distinct l=2": (
        TWO_ROWS_PER_UNIT,
        ADULT_QI,
        INCOME,
        {"k": 10, "l": 2, "l_kind": "distinct"},
    ),
    "relaxed k=10": (ONE_ROW_PER_UNIT, ADULT_QI, None, {"k": 10, "variant": "relaxed"}),
    "relaxed distinct l=2": (
        ONE_ROW_PER_UNIT,
        ADULT_QI,
        INCOME,
        {"k": 10, "l": 2, "l_kind": "distinct", "variant": "relaxed"},
    ),
    "relaxed two rows per unit": (
        TWO_ROWS_PER_UNIT,
        ADULT_QI,
        None,
        {"k": 10, "variant": "relaxed"},
    ),
}


@pytest.fixture
def both(postgresql: psycopg.Connection) -> psycopg.Connection:
    """The session's connection, with sql/0036's anonymize_mondrian as pg_temp.mondrian_0036."""
    text = MIGRATION_0036.read_text()
    definition = text[
        text.index("create or replace function anonproxy.anonymize_mondrian(") :
    ]
    postgresql.execute(
        definition.replace("anonproxy.anonymize_mondrian(", "pg_temp.mondrian_0036(", 1)
    )
    return postgresql


def stage(
    conn: psycopg.Connection,
    unit: str,
    qi: list[dict[str, Any]],
    sensitive: dict[str, Any] | None,
) -> None:
    columns = [q["name"] for q in qi] + ([sensitive["name"]] if sensitive else [])
    conn.execute("drop table if exists pg_temp.input")
    conn.execute(
        f"create temp table input as select id::bigint as _row, {unit} as _unit, {', '.join(columns)} "
        "from adult"
    )


def release(
    conn: psycopg.Connection, function: str, spec: dict[str, Any], output: str
) -> dict[str, Any]:
    """Run one version into the temp table `output`; its facts without the clock."""
    row = conn.execute(
        f"select {function}('pg_temp.input', %s)",
        (json.dumps({**spec, "output": output}),),
    ).fetchone()
    assert row is not None
    facts: dict[str, Any] = row[0]
    facts.pop("elapsed")
    return facts


@pytest.mark.parametrize("case", list(CASES))
def test_same_release_as_0036(both: psycopg.Connection, case: str) -> None:
    unit, qi, sensitive, model = CASES[case]
    stage(both, unit, qi, sensitive)
    spec = {"qi": qi, "sensitive": sensitive, "suppression_limit": 0.0, **model}
    both.execute("drop table if exists pg_temp.old_out, pg_temp.new_out")
    old = release(both, "pg_temp.mondrian_0036", spec, "old_out")
    new = release(both, "anonproxy.anonymize_mondrian", spec, "new_out")
    assert new == old
    row = both.execute(
        "select (select count(*) from pg_temp.new_out), (select count(*) from pg_temp.input), "
        "(select count(*) from (table pg_temp.old_out except table pg_temp.new_out) a), "
        "(select count(*) from (table pg_temp.new_out except table pg_temp.old_out) b)"
    ).fetchone()
    assert row is not None
    released, staged, only_old, only_new = row
    assert released == staged
    assert (only_old, only_new) == (0, 0)
    assert old["partitions"] > 1
