"""UNION [ALL], INTERSECT and EXCEPT of aggregate queries, answered in suppress mode (anonproxy/plan/set_operations.py).

Through the real gated proxy as ``reporter`` (suppress, k = 10, rest row on): a set operation whose every branch
is an aggregate query is answered with the client's set operator applied to what each branch releases when asked
alone through the proxy (its own suppression, its own suppressed-rest row); the result's column names and types are
PostgreSQL's own for the client's statement. A branch reading rows is refused as before. In dp mode each branch
is asked as its own noisy question (each charged) and the set operation combines their rows. Ibis drives its own
set operations (``union``) and ``describe()`` through the real library.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures

from anonproxy.dp.answers import measured_text
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import price
from anonproxy.dp.question import further_questions
from anonproxy.plan.outer import Outer
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy

Rows = list[tuple[Any, ...]]
BY_SEX = "select sex, count(*) as n from adult group by sex"
BY_AGE = "select age, count(*) as n from adult group by age"  # ages of fewer than 10 people: withheld
TOTAL = "select 'Total', count(*) from adult"
PARAMS = DPParams(epsilon=1.0, delta=1e-6)
BY_COUNTRY = "select native_country, count(*) as n from adult group by native_country"


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def _alone(conn: psycopg.Connection[Any], sql: str) -> Rows:
    return conn.execute(sql).fetchall()


def _combined(operator: str, left: Rows, right: Rows) -> Counter[tuple[Any, ...]]:
    """PostgreSQL's set operators over two answers, as multisets (ALL keeps duplicates; without it, each row once)."""
    a, b = Counter(left), Counter(right)
    every = operator.endswith("ALL")
    if operator.startswith("UNION"):
        found = a + b
    elif operator.startswith("INTERSECT"):
        found = a & b
    else:
        found = a - b if every else Counter(row for row in a if row not in b)
    return found if every else Counter(set(found))


def _refusal(conn: psycopg.Connection[Any], sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    return caught.value


@pytest.mark.parametrize("operator", ["UNION ALL", "UNION", "INTERSECT", "INTERSECT ALL", "EXCEPT", "EXCEPT ALL"])
def test_each_operator_combines_the_branches_answers(reporter: psycopg.Connection[Any], operator: str) -> None:
    left = "select sex, count(*) from adult where age > 30 group by sex"
    right = "select sex, count(*) from adult where age > 30 group by sex having count(*) > 10000"
    released = _alone(reporter, left), _alone(reporter, right)
    assert len(released[0]) == 2 and len(released[1]) == 1, "the branches share one row, not the other"
    answer = _alone(reporter, f"{left} {operator} {right}")
    assert Counter(answer) == _combined(operator, *released)


def test_total_row_with_withheld_groups(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """A hand-written total row under a grouped branch whose small groups are withheld: the grouped branch keeps
    its own suppression and rest row; the NULL of the total row takes the type of age, as in PostgreSQL."""
    sql = f"{BY_AGE} union all select null, count(*) from adult order by 1 nulls last"
    cursor = reporter.execute(sql)
    answer = cursor.fetchall()
    assert Counter(answer) == Counter(_alone(reporter, BY_AGE) + _alone(reporter, "select null, count(*) from adult"))
    small = {age for age, n in truth.execute(BY_AGE).fetchall() if n < 10}
    assert small and not small & {age for age, _ in answer}, "the ages of fewer than 10 people are not shown"
    own = truth.execute(sql)
    assert [(c.name, c.type_code) for c in cursor.description] == [(c.name, c.type_code) for c in own.description]
    # the rows' order is the client's ORDER BY over the combined rows
    ages = [age for age, _ in answer]
    assert ages == sorted(ages, key=lambda age: (age is None, age))


def test_names_types_order_and_limit_are_postgresqls(reporter: psycopg.Connection[Any],
                                                     truth: psycopg.Connection[Any]) -> None:
    """Parenthesised branches with their own ORDER BY and LIMIT, an outer ORDER BY by name and LIMIT/OFFSET."""
    first = "(select education, count(*) as n from adult group by education order by n desc limit 4)"
    sql = f"{first} union all ({TOTAL}) order by n desc limit 3 offset 1"
    cursor = reporter.execute(sql)
    answer = cursor.fetchall()
    own = truth.execute(sql)  # nothing withheld in these branches: PostgreSQL's own answer
    assert answer == own.fetchall()
    assert [(c.name, c.type_code) for c in cursor.description] == [(c.name, c.type_code) for c in own.description]


def test_with_queries_read_by_the_branches(reporter: psycopg.Connection[Any]) -> None:
    sql = ("with older as (select * from adult where age > 40) select sex, count(*) from older group by sex "
           "union all select race, count(*) from older group by race")
    branches = ["select sex, count(*) from adult where age > 40 group by sex",
                "select race, count(*) from adult where age > 40 group by race"]
    assert Counter(_alone(reporter, sql)) == Counter(_alone(reporter, branches[0]) + _alone(reporter, branches[1]))


def test_under_an_outer_query_and_nested(reporter: psycopg.Connection[Any]) -> None:
    """A set operation as a derived table, read by an outer query over released rows; set operations nested."""
    sql = (f"select count(*), sum(n) from ({BY_SEX} union all (select race, count(*) from adult group by race "
           f"except select race, count(*) from adult group by race having count(*) < 1000)) as q where n > 100")
    rows = _alone(reporter, BY_SEX) + list(_combined(
        "EXCEPT", _alone(reporter, "select race, count(*) from adult group by race"),
        _alone(reporter, "select race, count(*) from adult group by race having count(*) < 1000")).elements())
    kept = [n for _, n in rows if n is not None and n > 100]
    assert _alone(reporter, sql) == [(len(kept), sum(kept))]


def test_differencing_the_total_reveals_no_more_than_the_branches(reporter: psycopg.Connection[Any],
                                                                  truth: psycopg.Connection[Any]) -> None:
    """Total minus the released countries is the withheld countries' people: exactly what the two branches asked
    alone give (complementary suppression is per question: the grouped branch's rest row keeps the withheld
    countries at k or more together, or withholds them with it)."""
    sql = f"{BY_COUNTRY} union all select 'Total', count(*) from adult"
    answer = _alone(reporter, sql)
    assert Counter(answer) == Counter(_alone(reporter, BY_COUNTRY) + _alone(reporter, TOTAL))
    total = next(n for country, n in answer if country == "Total")
    withheld = total - sum(n for country, n in answer if country not in (None, "Total"))
    small = [n for _, n in truth.execute(BY_COUNTRY).fetchall() if n < 10]
    assert small and (withheld == 0 or withheld >= 10), "the withheld countries together hold 0 or k or more people"


@pytest.mark.parametrize("sql", [
    "select age from adult union all select count(*) from adult",
    f"{BY_SEX} union all select sex, age from adult",
    f"select * from ({BY_SEX} union select sex, 1 from adult) q",
])
def test_a_branch_reading_rows_is_refused(reporter: psycopg.Connection[Any], sql: str) -> None:
    error = _refusal(reporter, sql)
    assert error.sqlstate in ("0A000", "42501") and error.diag.message_hint, error


def test_order_by_an_expression_is_refused(reporter: psycopg.Connection[Any]) -> None:
    error = _refusal(reporter, f"{BY_SEX} union all {TOTAL} order by n + 1")
    assert error.sqlstate == "0A000" and "must name an output column" in (error.diag.message_primary or "")


def test_dp_answers_each_branch_as_its_own_question(analyst: str, gated_proxy: Endpoint,  # noqa: F811 - fixture
                                                    gated_database: str, truth: psycopg.Connection[Any]) -> None:
    """In dp mode each branch is a noisy question of its own, charged on its own (two charges, then both cached);
    the set operation only combines the noisy rows (post-processing). The keys are PostgreSQL's (sex has a
    declared domain: both are listed; the total's one row always exists)."""
    sql = f"{BY_SEX} union all {TOTAL} order by 1"
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        before = budget_left(conn)
        rows = conn.execute(sql).fetchall()
        after = budget_left(conn)
        assert [row[0] for row in rows] == [row[0] for row in truth.execute(sql).fetchall()]
        assert after != before
        assert conn.execute(sql).fetchall() == rows and budget_left(conn) == after  # cached: free
        explained = [row[0] for row in conn.execute(f"explain (anonproxy) {sql}").fetchall()]
        assert "and the next branch of the set operation, a question of its own:" in explained, explained


def test_dp_union_without_all_and_intersect(analyst: str, gated_proxy: Endpoint,  # noqa: F811 - fixture
                                            gated_database: str) -> None:
    """UNION keeps each noisy row once; INTERSECT of a branch with itself asks it once (its rows, once each)."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        union = conn.execute(f"{BY_SEX} union {TOTAL}").fetchall()
        assert sorted(row[0] for row in union) == ["Female", "Male", "Total"]
        left = budget_left(conn)
        same = conn.execute(f"{BY_SEX} intersect {BY_SEX}").fetchall()
        assert budget_left(conn) == left  # the by-sex branch was asked (and paid) by the union already
        assert Counter(same) == Counter(row for row in union if row[0] != "Total")


def test_dp_refuses_a_refused_branch_before_charging_any(analyst: str, gated_proxy: Endpoint,  # noqa: F811
                                                         gated_database: str) -> None:
    """A later branch that dp refuses (min(): an extreme) refuses the statement before the first branch is charged."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        before = budget_left(conn)
        error = _refusal(conn, f"{BY_SEX} union all select 'Youngest', min(age) from adult")
        assert error.sqlstate == "42501" and (error.diag.message_primary or "").startswith("min()"), error
        assert budget_left(conn) == before


def test_dp_measures_each_later_branch_once(truth: psycopg.Connection[Any]) -> None:
    """The router's measurement of a set operation carries each later branch's measurement, made when every branch
    was checked (before any is charged); the branch is asked with it, not measured again from its text, and it is
    what measuring that text gives (the same SQL once priced), also after crossing processes (pickled)."""
    policy = load_policy(truth)
    role = policy.role("analyst")
    decision = decide(f"{BY_SEX} union all {TOTAL}", role, policy)
    assert isinstance(decision, Noisy) and decision.plan is not None
    packed = pickle.loads(pickle.dumps(decision.plan))
    plan = price(packed.open(), PARAMS)
    assert isinstance(plan, DPPlan) and isinstance(plan.nested, Outer)
    ((text, measured),) = further_questions(plan.nested, packed)
    assert measured is packed.further[0]
    again = price(measured_text(text, role, policy).open(), PARAMS)
    branch = price(measured.open(), PARAMS)
    assert isinstance(branch, DPPlan) and isinstance(again, DPPlan) and branch.sql == again.sql


def test_ibis_union_of_aggregates(reporter: psycopg.Connection[Any], gated_proxy: Endpoint,
                                  gated_database: str) -> None:
    """Ibis's own set operation of two aggregates, through the real library: answered, the branches' answers."""
    import ibis

    con = ibis.postgres.from_connection(psycopg.connect(gated_proxy.url(gated_database, user="reporter"),
                                                        autocommit=True))
    try:
        t = con.table("adult")
        young, old = t.filter(t.age < 30), t.filter(t.age >= 30)
        young, old = (rows.group_by("sex").aggregate(n=rows.count()) for rows in (young, old))
        frame = ibis.union(young, old, distinct=False).execute()
    finally:
        con.disconnect()
    rows = [(row.sex, int(row.n)) for row in frame.itertuples()]
    assert Counter(rows) == Counter(
        _alone(reporter, "select sex, count(*) from adult where age < 30 group by sex")
        + _alone(reporter, "select sex, count(*) from adult where age >= 30 group by sex"))


def test_ibis_describe_is_refused_for_its_aggregates(gated_proxy: Endpoint, gated_database: str) -> None:
    """``describe()`` is a UNION ALL of one aggregate query per column: no longer refused as a set operation, but
    for what its branches compute: min() and max() (the reporter's policy disallows extremes; percentiles and
    mode() are outside suppress mode's aggregates too)."""
    import ibis

    con = ibis.postgres.from_connection(psycopg.connect(gated_proxy.url(gated_database, user="reporter"),
                                                        autocommit=True))
    try:
        with pytest.raises(Exception) as caught:
            con.table("adult").select("age", "hours_per_week").describe().execute()
    finally:
        con.disconnect()
    error = caught.value
    while not isinstance(error, psycopg.Error) and error.__cause__ is not None:
        error = error.__cause__
    assert isinstance(error, psycopg.Error), caught.value
    message = error.diag.message_primary or ""
    assert "UNION" not in message and message.startswith(("min()", "max()", "percentile", "mode")), message


def test_explain_names_the_set_operation(reporter: psycopg.Connection[Any]) -> None:
    explained = [row[0] for row in reporter.execute(f"explain (anonproxy) {BY_SEX} union all {TOTAL}").fetchall()]
    assert explained[0].startswith("a set operation of the released rows of 2 aggregate queries"), explained


def test_parameters_in_the_branches(reporter: psycopg.Connection[Any]) -> None:
    """$n parameters bound by the driver (psycopg binds on the server) stand in the branches as in the text."""
    sql = ("select sex, count(*) from adult where age > %s group by sex "
           "union all select 'Total', count(*) from adult where age > %s")
    answer = reporter.execute(sql, (40, 40)).fetchall()
    assert Counter(answer) == Counter(_alone(reporter, sql.replace("%s", "40")))
    assert len(answer) == 3
