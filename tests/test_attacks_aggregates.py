"""Error and overflow side channels of aggregate forms and post-aggregate expressions (issue 11).

A query that raises an error, or not, depending on one person's value or on a group that is never released,
answers a question suppression or noise never saw: ``HAVING 1/(count(*) - 37) > 0`` fails exactly when a withheld
group has 37 people. Post-aggregate expressions are evaluated on released values only (suppress: outside the
materialized suppressed result; dp: over the noisy values), divisions by zero give NULL, and what could still
make a row-level error is refused. Through the real proxy, as the `reporter` (suppress, k = 10, with the
suppressed-rest row) and a fresh dp role.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)

K = 10


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str):
    connection = psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True)
    yield connection
    connection.close()


def released(rows: list[tuple]) -> list[tuple]:
    """The rows of released groups (the suppressed-rest row has NULL keys)."""
    return [row for row in rows if row[0] is not None]


def test_a_group_of_exactly_k_or_37_raises_nothing(reporter: psycopg.Connection, truth: psycopg.Connection) -> None:
    sizes = dict(truth.execute("select age, count(*) from adult group by age").fetchall())
    assert 37 in sizes.values() or any(n < K for n in sizes.values()), "the data has a group the attack targets"
    rows = reporter.execute("select age, 1 / (count(*) - 10) from adult group by age").fetchall()
    assert all(row[1] == (None if sizes[row[0]] == 10 else 1 // (sizes[row[0]] - 10)) for row in released(rows))
    rows = reporter.execute("select age, count(*) from adult group by age having 1 / (count(*) - 37) > 0").fetchall()
    assert released(rows) and all(n >= K and n != 37 and sizes[age] == n for age, n in released(rows))


def test_a_cast_that_overflows_only_for_withheld_groups_raises_nothing(reporter: psycopg.Connection,
                                                                       truth: psycopg.Connection) -> None:
    """300000 / count(*) passes smallint's 32767 only for groups of fewer than 10 people: never released."""
    small = truth.execute("select count(*) from (select age from adult group by age having count(*) < 10) s")
    assert small.fetchone()[0] > 0
    expected = dict(truth.execute("select age, 300000 / count(*) from adult group by age having count(*) >= 10"))
    rows = reporter.execute("select age, (300000 / count(*))::smallint from adult group by age").fetchall()
    assert released(rows) and all(expected[age] == value for age, value in released(rows))
    rows = reporter.execute("select age, count(*) from adult group by age "
                            "having (300000 / count(*))::smallint > 0").fetchall()
    assert released(rows)
    with pytest.raises(psycopg.Error) as caught:  # directly, the same HAVING fails on the small groups
        truth.execute("select age, count(*) from adult group by age having (300000 / count(*))::smallint > 0")
    assert caught.value.sqlstate == "22003"


def test_division_by_a_count_that_is_zero_gives_null(reporter: psycopg.Connection) -> None:
    rows = reporter.execute("select sex, sum(age) / count(case when age > 200 then 1 end), sum(age) / 0, "
                            "sum(age) / (count(*) - count(*)) from adult group by sex").fetchall()
    assert all(row[1:] == (None, None, None) for row in released(rows))


def test_huge_round_scale_raises_nothing(reporter: psycopg.Connection, truth: psycopg.Connection) -> None:
    query = "select sex, round(avg(age), 1000000) from adult group by sex"
    assert released(reporter.execute(query).fetchall()) == truth.execute(query).fetchall()


@pytest.mark.parametrize("attack", [
    "select sex, exp(sum(age)) from adult group by sex",  # not on the allowlist: overflow
    "select sex, power(2, count(*)) from adult group by sex",
    "select sex, sum(age) / age from adult group by sex",  # a column outside the GROUP BY
    "select sex, count(*) / (age - 30) from adult group by sex",
    "select id, count(*) / (id - 17) from adult group by id",  # an identifying column in an expression
    "select sex, sum(case when id = 17 then 1e300 else 0 end) from adult group by sex",
    "select sex, sum(1e300) filter (where age = 17) from adult group by sex",
    "select sex, count(*) filter (where id = 17) from adult group by sex",  # as inside an aggregate: 42501
    "select sex, count(*), count(*) filter (where id <> 17) from adult group by sex",
    "select sex, sum(case when age = 17 then 1e300 else 0 end) from adult group by sex",
    "select sex, count(*) filter (where age / 0 = 1) from adult group by sex",  # FILTER is row-level
    "select sex, count(*) filter (where (select count(*)) = 1) from adult group by sex",  # (select 1) is a constant
    "select sex, sum(age) filter (where age > 1) over () from adult group by sex",
    "select sex, count(*) filter (where count(*) > 1) from adult group by sex",
    "select sex, sum(age)::regclass from adult group by sex",  # only numeric and text casts
    "select sex, sum(age) % 7 from adult group by sex",  # modulo: not on the list
])
def test_refused(reporter: psycopg.Connection, attack: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        reporter.execute(attack).fetchall()
    assert caught.value.sqlstate in ("42501", "0A000"), (caught.value.sqlstate, str(caught.value))
    assert caught.value.diag.message_primary
    assert reporter.execute("select 1").fetchone() == (1,)


ONE_PERSON = "age = 90 and native_country = 'Philippines'"


def test_filter_on_a_few_people_is_withheld_with_the_rest_row(reporter: psycopg.Connection,
                                                             truth: psycopg.Connection) -> None:
    assert 1 <= truth.execute(f"select count(*) from adult where {ONE_PERSON}").fetchone()[0] < K
    for query in (f"select sex, count(*) filter (where {ONE_PERSON}) from adult group by sex",
                  f"select sex, count(*) from adult group by sex having count(*) filter (where {ONE_PERSON}) > 0",
                  f"select sex, count(*) from adult group by sex having count(*) filter (where {ONE_PERSON}) = 0",
                  f"select education, 1 / (count(*) filter (where {ONE_PERSON}) - 1), count(*) from adult "
                  "group by education"):
        assert reporter.execute(query).fetchall() == [], query


def test_dp_errors_are_never_a_function_of_exact_values(gated_proxy: Endpoint, gated_database: str,
                                                        analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        rows = conn.execute("select sex, 1 / (count(*) - 37), sum(age) / count(case when age > 200 then 1 end) "
                            "from adult group by sex having 1 / (count(*) - 37) > -1").fetchall()
        assert [row[0] for row in rows] == ["Female", "Male"]
        assert all(row[2] is None or isinstance(row[2], int) for row in rows)
        for attack in ("select exp(sum(age)) from adult",
                       "select count(*) filter (where id = 17) from adult",
                       "select sex, sum(case when id = 17 then 1e300 else 0 end) from adult group by sex"):
            with pytest.raises(psycopg.Error) as caught:
                conn.execute(attack).fetchall()
            assert caught.value.sqlstate in ("42501", "0A000")
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "refusals cost nothing"
        # An overflow of a post-aggregate expression is one of the noisy value's: post-processing, already paid.
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("select sum(age)::smallint from adult").fetchall()
        assert caught.value.sqlstate == "22003"
        assert "epsilon 1 of 2 left" in budget_left(conn)
        rows = conn.execute(f"select count(*) filter (where {ONE_PERSON}) from adult").fetchall()
        assert len(rows) == 1 and abs(rows[0][0]) < 100, "a few people: noise around a small count"
