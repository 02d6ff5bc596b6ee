"""Red team of suppression's bounds first (anonproxy.suppress.one_pass, ``_bounded``; docs/suppression.md "Where
rows are not people: bounds first"): over a linked table, every group is released from bounds when they prove that
it passes the rules, without the exact per-person figures. Each attack below builds data where the bounds could be
wrong -- a person in two groups where the SQL assumes one, NULL units, values cancelling in ``|sum|``, a person
with many rows in one group, a WHERE that removes most of a person's rows, extreme values -- and asserts the safe
outcome: the rewritten statement answers exactly as the same SQL forced onto its exact path (``anonproxy_sure``
false), which computes each group's distinct people and each person's part, so that the bounds never release a
group or a value the exact figures would withhold, and never raise an error the exact path would not."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from conftest import database_of_its_own
from service_sql import exact_path, reporter_sql, service_answer

from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "attacks_bounds_first"
VISITS = "public.stays"


def _stays(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy (reporter: k 10, dominance (2, 85 %), p 10 %, a rest row), and ``stays`` linked to adult,
    empty (each attack fills it in a transaction it rolls back)."""
    conn.execute(f"create table {VISITS} (person integer, kind text not null, amount numeric not null)")
    link = LinkedTable(VISITS, "person", "public.adult", "id", {
        "person": ColumnPolicy("person", "identifier"),
        "kind": ColumnPolicy("kind", "quasi_identifier"),
        "amount": ColumnPolicy("amount", "sensitive")})
    return dataclasses.replace(demo_policy(), links={VISITS: link})


owner = database_of_its_own(DATABASE, _stays)


def _same_as_exact(conn: psycopg.Connection[Any], fill: str, statement: str) -> list[tuple[Any, ...]]:
    """Fill stays, rewrite ``statement`` and check that it answers as its exact path; the rows."""
    with conn.transaction(force_rollback=True):
        conn.execute(fill)
        conn.execute(f"analyze {VISITS}")  # not the statistics of an empty table autovacuum may have taken
        sql = reporter_sql(conn, statement)
        answer = service_answer(conn, sql)
        assert answer == service_answer(conn, exact_path(sql)), statement
        return answer[0]


# A person in two groups where the SQL assumed one ------------------------------------------------------------------

# Everyone has a visit of amount 1 but the three first people; the first hundred have one of amount 2.
SPLIT = (f"insert into {VISITS} select id, 'small', 1 from public.adult where id > (select min(id) + 2 from "
         f"public.adult); insert into {VISITS} select id, 'large', 2 from public.adult order by id limit 100")


def test_a_left_join_condition_puts_a_person_in_two_groups(owner: psycopg.Connection) -> None:
    """``stays LEFT JOIN adult ON adult.id = stays.person AND stays.amount > 1``: the unit is stays.person, and
    a person's rows of amount 1 fall in the NULL group while those of amount 2 fall in their sex's group, although
    the grouping expression reads only adult. The NULL group holds everyone but three people: it leaves fewer than
    k of N out and is withheld; the bounds must not take the other groups' rows for people it leaves out."""
    rows = _same_as_exact(owner, SPLIT, ("SELECT a.sex, count(*) AS n, sum(v.amount) AS total FROM public.stays v "
                                         "LEFT JOIN public.adult a ON a.id = v.person AND v.amount > 1 GROUP BY 1"))
    # The NULL group is withheld, and with it both others (complementary suppression): the rest row alone.
    assert [row[0] for row in rows] == [None], rows


# Generated data where the bounds are closest to wrong --------------------------------------------------------------

# Every person 1 to 3 stays of amounts 1 to 50 over three kinds: the bounds settle most statements on this alone.
BASE = (f"insert into {VISITS} select id, (array['web', 'app', 'phone'])[(id + n) % 3 + 1], 1 + (id * 7 + n) % 50 "
        "from public.adult, generate_series(1, 1 + id % 3) n")
FIRST = "(select min(id) from public.adult)"
FILLS = {
    "plain": BASE,
    # rows without a person: not counted as people, but their amounts are in |sum| and max|x|
    "NULL units": f"{BASE}; insert into {VISITS} select null, 'web', 40 from generate_series(1, 5000)",
    # one person's large positive and negative amounts cancel in |sum|
    "cancelling": (f"{BASE}; insert into {VISITS} select {FIRST}, 'web', 1e9; "
                   f"insert into {VISITS} select {FIRST}, 'web', -1e9"),
    # two people's amounts cancel each other
    "cancelling people": (f"{BASE}; insert into {VISITS} select {FIRST}, 'app', 1e9; "
                          f"insert into {VISITS} select {FIRST} + 1, 'app', -1e9"),
    # one person with many small rows in one group only: most rises for everyone
    "many rows": f"{BASE}; insert into {VISITS} select {FIRST}, 'phone', 1 from generate_series(1, 300)",
    # one dominant amount in a group that otherwise passes
    "dominant": f"{BASE}; insert into {VISITS} select {FIRST}, 'web', 1e7",
    # extremes of numeric
    "extreme": (f"{BASE}; insert into {VISITS} select {FIRST}, 'app', 9e130000; "
                f"insert into {VISITS} select {FIRST} + 1, 'app', -9e130000"),
    "infinite": f"{BASE}; insert into {VISITS} select {FIRST}, 'web', 'Infinity'",
    "not a number": f"{BASE}; insert into {VISITS} select {FIRST}, 'web', 'NaN'",
}
STATEMENTS = {
    "count by kind": "SELECT v.kind, count(*) AS n FROM public.stays v GROUP BY 1",
    "sum by kind": "SELECT v.kind, sum(v.amount) AS total, count(*) AS n FROM public.stays v GROUP BY 1",
    "avg by sex": ("SELECT a.sex, avg(v.amount) AS mean FROM public.adult a JOIN public.stays v ON v.person = a.id "
                   "GROUP BY 1"),
    # a WHERE that removes most of some people's rows
    "sum by sex, filtered": ("SELECT a.sex, sum(v.amount) AS total FROM public.adult a JOIN public.stays v "
                             "ON v.person = a.id WHERE v.amount > 45 GROUP BY 1"),
    # a grouping expression that is not a column
    "sum by age decade": ("SELECT a.age / 20 AS decade, sum(v.amount) AS total FROM public.adult a "
                          "JOIN public.stays v ON v.person = a.id GROUP BY 1"),
    "sum by upper kind": "SELECT upper(v.kind) AS k, sum(v.amount) AS total FROM public.stays v GROUP BY 1",
    # FILTER: the rows of the aggregate are not the group's rows
    "filtered sum by kind": ("SELECT v.kind, sum(v.amount) FILTER (WHERE v.amount > 40) AS big FROM public.stays v "
                             "GROUP BY 1"),
    # the linked table LEFT JOINed to adult: the unit is the linked table's key
    "sum by sex, left join": ("SELECT a.sex, sum(v.amount) AS total FROM public.stays v LEFT JOIN public.adult a "
                              "ON a.id = v.person GROUP BY 1"),
}


@pytest.mark.parametrize("fill", sorted(FILLS))
@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_bounds_answer_as_the_exact_path(owner: psycopg.Connection, fill: str, name: str) -> None:
    _same_as_exact(owner, FILLS[fill], STATEMENTS[name])


@pytest.mark.parametrize("fill", ["infinite", "not a number"])
@pytest.mark.parametrize("name", ["sum by kind", "avg by sex", "sum by age decade"])
def test_one_persons_infinite_value_is_not_released(owner: psycopg.Connection, fill: str, name: str) -> None:
    """One person's Infinity (or NaN) makes the group's total Infinity (NaN); Infinity is not more than 85 % of
    itself, NaN sorts above every number, so the dominance and p % inequalities held, and the group was released
    with the person's value as its sum or average. A total that is not finite now fails the magnitude rules, on
    the bounds and on the exact path alike: the group is withheld (and the rest row, which holds it)."""
    rows = _same_as_exact(owner, FILLS[fill], STATEMENTS[name])
    assert all(not (isinstance(v, str) and v in ("Infinity", "NaN")) for row in rows for v in row), rows
