"""A WHERE on a GROUP BY key with a declared public domain restricts the values listed (through the real proxy, a dp
role with its own budget: ε 20 in all, 0.5 per query). Decided on the statement, never on the data: it costs nothing
more than the same question without the restriction, and values that cannot pass are not listed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

_names = itertools.count(1)

EDUCATION = ("Preschool", "1st-4th", "5th-6th", "7th-8th", "9th", "10th", "11th", "12th", "HS-grad", "Some-college",
             "Assoc-voc", "Assoc-acdm", "Bachelors", "Masters", "Prof-school", "Doctorate")


@pytest.fixture
def conn(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
    role = f"dp_where_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, role, epsilon=20), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as connection:
        yield connection


def left(conn: psycopg.Connection) -> str:
    return conn.execute("show anonproxy.budget").fetchone()[0]


def keys(conn: psycopg.Connection, where: str, select: str = "education, count(*)") -> list[str]:
    return [row[0] for row in conn.execute(f"select {select} from adult where {where} group by education")]


def test_in_lists_exactly_those_values_at_the_same_cost(conn: psycopg.Connection, truth: psycopg.Connection) -> None:
    assert EDUCATION == tuple(truth.execute("select domain from anonproxy.column_policies "
                                            "where column_name = 'education'").fetchone()[0])
    rows = conn.execute("select education, count(*) from adult where education in ('Bachelors', 'Masters') "
                        "group by education").fetchall()
    assert [row[0] for row in rows] == ["Bachelors", "Masters"]  # in the domain's order
    # The budget (ε 20, δ 1e-5) counts in zCDP: one count at ε 0.5 is the discrete Gaussian of σ² 7.835, ρ 0.0638129,
    # shown to 4 significant digits rounded up.
    assert "rho 0.06382 spent" in left(conn), "one question's cost, nothing for the restriction"
    true = dict(truth.execute("select education, count(*) from adult where education in ('Bachelors', 'Masters') "
                              "group by education").fetchall())
    assert all(abs(n - true[e]) <= 2 * 14 for e, n in rows)  # scale 2: |noise| > 28 has probability < 1e-6


def test_not_in_equality_and_inequality(conn: psycopg.Connection) -> None:
    assert keys(conn, "education not in ('Bachelors', 'Masters')") == [e for e in EDUCATION
                                                                       if e not in ("Bachelors", "Masters")]
    assert keys(conn, "education = 'Doctorate'") == ["Doctorate"]
    assert keys(conn, "'Doctorate' = education") == ["Doctorate"]
    assert keys(conn, "education <> 'Doctorate'") == [e for e in EDUCATION if e != "Doctorate"]
    assert keys(conn, "not (education <> 'Doctorate')") == ["Doctorate"]
    assert keys(conn, "education not in ('Bachelors', null)") == []  # never true in SQL
    assert keys(conn, "education = 'Nursery'") == []  # not a declared value: nothing can pass
    assert keys(conn, "education is null") == []


def test_other_conjuncts_narrow_or_leave_it(conn: psycopg.Connection) -> None:
    assert keys(conn, "education in ('Bachelors', 'Masters', '9th') and age > 30 and education <> '9th'") \
        == ["Bachelors", "Masters"]
    assert keys(conn, "(education = 'Masters' or education = 'Doctorate') and education is not null") \
        == ["Masters", "Doctorate"]
    two = conn.execute("select education, sex, count(*) from adult where education = 'Masters' and sex <> 'Male' "
                       "group by education, sex").fetchall()
    assert [row[:2] for row in two] == [("Masters", "Female")]


def test_what_is_not_understood_leaves_the_whole_domain(conn: psycopg.Connection) -> None:
    assert keys(conn, "education = 'Masters' or sex = 'Male'") == list(EDUCATION)  # OR across columns
    assert keys(conn, "lower(education) = 'masters'") == list(EDUCATION)  # a function of the column
    assert keys(conn, "education::varchar = 'Masters'") == list(EDUCATION)  # a cast
    rows = conn.execute("select education, count(*) from adult where education = %s group by education",
                        ["Masters"]).fetchall()  # a parameter: the plan does not know its value
    assert [row[0] for row in rows] == list(EDUCATION)


def test_a_listing_of_keys_is_restricted_and_free(conn: psycopg.Connection) -> None:
    assert keys(conn, "education in ('HS-grad', 'Masters')", select="education") == ["HS-grad", "Masters"]
    assert keys(conn, "education in ('HS-grad', 'Masters')", select="distinct education") == ["HS-grad", "Masters"]
    assert "epsilon 20 of 20 left" in left(conn)
