"""Issue 10, item 5: no combination of GROUP BY and rest row reveals a total the scalar query withholds.

Through the real gated proxy, as `reporter` (suppress, k = 10, dominance, p %, rest row on) and as a fresh dp
role. The attack: the whole table's total of capital_gain is public (sum the rows of GROUP BY sex); a group of
everyone but person 1146 (GROUP BY id = 1146, CASE WHEN id = 1146 ..., id <> 1146 ...) would give, by one
subtraction, that person's capital gain. So

* an identifying column (the unit, a linked key, a column marked identifier) stands only bare outside WHERE:
  any expression over it in GROUP BY, the select list, HAVING or ORDER BY, or inside an aggregate, is refused
  with 42501, in both modes;
* a released group obeys query-set-size control like a scalar query: k people or more, leaving out of N nobody
  (the total over everyone is public anyway) or at least k, so a group of all but a few people (GROUP BY
  native_country = 'Holand-Netherlands') is withheld;
* complementary suppression: the released rows of one answer, the rest row among them, never add up to a total
  over N - k + 1 to N - 1 people (GROUP BY sex with WHERE id <> 17 releases one group).

Filtering on an identifying column in WHERE stays allowed (its query sets obey the same rules); two released
answers with and without such a filter still differ by one person: that is suppression's documented
differencing limit (docs/suppression.md "Limits", kept here and by tests/test_attacks.py), which dp mode answers.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from suppression_oracle import suppress
from test_attacks_relations import VISITS, refusal, reporter, tables  # noqa: F401 - fixtures
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures

K = 10
VICTIM = 1146

# Expressions over identifying columns where they label rows instead of filtering them: 42501.
LABELS = [
    # in a select item that is a grouping key, by position or repeated in GROUP BY
    "select a.id = 1146 as x, sum(a.capital_gain) from adult a group by 1",
    "select id <> 1146, count(*), sum(capital_gain) from adult group by 1",
    "select case when id = 1146 then 'a' else 'b' end, sum(capital_gain) from adult group by 1",
    "select id in (1146, 1147), sum(capital_gain) from adult group by id in (1146, 1147)",
    "select id between 1146 and 1146, sum(capital_gain) from adult group by 1",
    "select coalesce(nullif(id, 1146), 0), sum(capital_gain) from adult group by 1",
    "select width_bucket(id, 1146, 1147, 1), sum(capital_gain) from adult group by 1",
    "select id::text = '1146', sum(capital_gain) from adult group by 1",
    "select (id is distinct from 1146), sum(capital_gain) from adult group by 1",
    "select distinct id = 1146 from adult",
    # only in GROUP BY
    "select sum(capital_gain) from adult group by id = 1146",
    "select sex, sum(capital_gain) from adult group by sex, case when id = 1146 then 1 end",
    "select sex, sum(capital_gain) from adult group by sex, (not (id = 1146))",
    "select sex, count(*) from adult group by sex, lower(id::text) like '1146'",
    # inside aggregates, in every clause
    "select sex, sum(case when id = 1146 then capital_gain else 0 end) from adult group by sex",
    "select sex, sum(capital_gain), count(case when id <> 1146 then 1 end) from adult group by sex",
    "select sex, sum(capital_gain) from adult group by sex having sum(case when id = 1146 then 1 else 0 end) = 0",
    "select sex, sum(capital_gain) from adult group by sex order by count(nullif(id, 1146))",
    "select sum(coalesce(nullif(id, 1146), 0)) from adult where age > 50",
    # HAVING and ORDER BY over a bare grouping key
    "select id, sum(capital_gain) from adult group by id having id <> 1146",
    "select id, sum(capital_gain) from adult group by id order by id = 1146",
    # a linked table's key is identifying too
    f"select v.person = 1146, sum(v.cost) from {VISITS} v group by 1",
    f"select a.sex, count(*) from adult a join {VISITS} v on v.person = a.id group by a.sex, v.person <> 1146",
]

# Refused for another reason already (arithmetic can overflow): still no answer.
OTHERWISE_REFUSED = [
    "select id / 1000, sum(capital_gain) from adult group by 1",
    "select sum(capital_gain) from adult group by id - 1146",
]

# Groups of more than N - k people: all but a few, or everyone.
LARGE = [
    "select native_country = 'Holand-Netherlands', count(*), sum(capital_gain) from adult group by 1",
    "select age > 16, count(*), sum(capital_gain) from adult group by 1",
    "select native_country <> 'Holand-Netherlands' as x, count(*), sum(capital_gain) from adult group by 1",
    "select age not in (83, 85, 86), count(*), sum(capital_gain) from adult group by 1",  # N - 9 and 9 people
    "select count(*), sum(capital_gain) from adult group by native_country in ('Holand-Netherlands')",
    "select workclass is not null, count(*) from adult group by 1",
]


def _everyone(truth: psycopg.Connection[Any]) -> int:  # noqa: F811
    return truth.execute("select count(distinct id) from adult").fetchone()[0]


def _nearly_everyone(counts: list[int], everyone: int) -> list[int]:
    """The numbers of people from N - k + 1 to N - 1 that some of an answer's rows add up to: the rows of one
    answer hold disjoint people (each person is in one group; the rest row holds the withheld ones), so each such
    sum, subtracted from the public total over everyone, would give the total of fewer than k people."""
    reachable = 1  # bit n: some rows hold n people together
    for n in counts:
        reachable |= reachable << n
    return [n for n in range(everyone - K + 1, everyone) if reachable >> n & 1]


def _assert_identifying(error: psycopg.Error, dp: bool) -> None:
    assert error.sqlstate == "42501", (error.sqlstate, str(error))
    message = error.diag.message_primary or ""
    assert "identifying column" in message and "is not allowed" in message, message
    hint = error.diag.message_hint or ""
    assert "Group by" in hint or "Filter on" in hint, hint
    if "Group by" in hint:  # the grouping hint fits the mode: dp has no group-size rules
        assert ("group-size rules" in hint) is not dp, hint


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", LABELS)
def test_suppress_refuses_identifying_expressions(reporter: psycopg.Connection[Any], sql: str) -> None:
    _assert_identifying(refusal(reporter, sql), dp=False)


def test_dp_refuses_identifying_expressions(tables: None, gated_proxy: Endpoint, gated_database: str,  # noqa: F811
                                            analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for sql in LABELS:
            if VISITS in sql:
                continue  # the dp role's budget covers public.adult only
            _assert_identifying(refusal(conn, sql), dp=True)
        assert "epsilon 2 of 2 left" in budget_left(conn), "refusals cost nothing"


@pytest.mark.parametrize("sql", OTHERWISE_REFUSED)
def test_arithmetic_on_identifiers_is_refused(reporter: psycopg.Connection[Any], sql: str) -> None:
    assert refusal(reporter, sql).sqlstate in ("42501", "0A000")


def test_bare_identifiers_and_filters_still_work(reporter: psycopg.Connection[Any],
                                                 truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """GROUP BY id (each group one person: all withheld), count(DISTINCT id), and WHERE on id stay allowed."""
    everyone = _everyone(truth)
    # The rest row holds every group: the public total over everyone; over all but one person it is withheld.
    assert reporter.execute("select id, count(*) from adult group by id").fetchall() == [(None, everyone)]
    assert reporter.execute("select (id), count(*) from adult group by (id)").fetchall() == [(None, everyone)]
    assert reporter.execute(f"select id, count(*) from adult where id <> {VICTIM} group by id").fetchall() == []
    people = reporter.execute("select sex, count(distinct id) from adult group by sex order by 1").fetchall()
    assert people == truth.execute("select sex, count(distinct id) from adult group by sex order by 1").fetchall()
    few = "select sex, count(*) from adult where id between 1 and 1000 group by sex order by 1"
    assert reporter.execute(few).fetchall() == truth.execute(few).fetchall()


# --- query-set-size control on released groups ----------------------------------------------------------------


@pytest.mark.parametrize("sql", LARGE)
def test_groups_of_nearly_everyone_are_withheld(reporter: psycopg.Connection[Any],
                                                truth: psycopg.Connection[Any], sql: str) -> None:  # noqa: F811
    """Each answer has, unguarded, a group of more than N - k people; one of all but a few people, subtracted from
    the public total over everyone, gives those few people's total. Released, no row and no rows together hold
    N - k + 1 to N - 1 people: a group of all but a few is withheld with the few, and the rest row then holds
    everyone; a group of everyone is the public total, and is released."""
    everyone = _everyone(truth)
    cursor = truth.execute(sql)
    count = [column.name for column in cursor.description].index("count")  # the first aggregate
    exact = cursor.fetchall()
    assert any(row[count] > everyone - K for row in exact)
    rows = reporter.execute(sql).fetchall()
    assert _nearly_everyone([row[count] for row in rows], everyone) == [], rows
    # Each row is the truth's, or the rest row, which adds up the truth's rows that were not released.
    released = [row for row in rows if row in exact]
    rest = [row for row in rows if row not in exact]
    assert len(rest) <= 1, rows
    left = [row for row in exact if row not in released]
    for row in rest:
        assert all(value is None for value in row[:count]), row
        assert list(row[count:]) == [sum(other[i] for other in left) for i in range(count, len(row))], (row, left)
    assert [row[count] for row in rows] == [everyone]  # what is released is the public total, in one row


def test_the_boundary_is_n_minus_k(reporter: psycopg.Connection[Any],
                                   truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """A group or total of exactly N - k people is released, N - k + 1 to N - 1 is not, N (everyone) is; the
    same rule for a group as for a scalar query."""
    everyone = _everyone(truth)
    ten_out = "select age not in (82, 85), count(*) from adult group by 1 order by 1"  # 7 + 3 people left out
    assert truth.execute(ten_out).fetchall() == [(False, K), (True, everyone - K)]
    assert reporter.execute(ten_out).fetchall() == [(False, K), (True, everyone - K)]
    nine_out = "select age not in (83, 85, 86), count(*) from adult group by 1 order by 1"  # 5 + 3 + 1
    assert truth.execute(nine_out).fetchall() == [(False, K - 1), (True, everyone - K + 1)]
    # Both groups withheld (9 people; N - 9): the rest row holds them, everyone.
    assert reporter.execute(nine_out).fetchall() == [(None, everyone)]
    # The scalar queries over such sets agree.
    for where in ("age not in (82, 85)", "age not in (83, 85, 86)", "age <> 82", f"id <> {VICTIM}", "age >= 0",
                  "true"):
        sql = f"select count(*) from adult where {where}"
        (n,), = truth.execute(sql).fetchall()
        assert reporter.execute(sql).fetchall() == ([] if everyone - K < n < everyone else [(n,)]), where
    assert truth.execute("select count(*) from adult where age <> 82").fetchone() == (everyone - 7,)
    assert reporter.execute("select count(*) from adult").fetchall() == [(everyone,)]


def test_withheld_large_group_goes_to_no_rest_row(reporter: psycopg.Connection[Any],
                                                  truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """With a WHERE that leaves k people out, small groups make a rest row; a group beyond N - k never does."""
    countries = ("select native_country, count(*), sum(capital_gain) from adult where age < 60 "
                 "group by 1 order by 2 desc")
    rows = reporter.execute(countries).fetchall()
    rest = [row for row in rows if row[0] is None]
    assert len(rest) == 1 and rest[0][1] >= K
    assert sum(n for _, n, _ in rows) == truth.execute("select count(*) from adult where age < 60").fetchone()[0]


# --- the differencing attack, end to end ---------------------------------------------------------------------


def _totals(rows: list[tuple[Any, ...]]) -> list[Decimal]:
    """Every capital_gain total one answer gives: each row's, and all its rows' together."""
    sums = [Decimal(row[-1]) for row in rows if row[-1] is not None]
    return [*sums, sum(sums, Decimal(0))]


def test_differencing_one_person_fails(reporter: psycopg.Connection[Any],
                                       truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    victim = truth.execute("select capital_gain from adult where id = %s", [VICTIM]).fetchone()[0]
    assert victim > 0
    # What the attacker knows: the whole table's total, from a legitimate dashboard.
    by_sex = reporter.execute("select sex, sum(capital_gain) from adult group by sex").fetchall()
    assert len(by_sex) == 2
    whole = sum(Decimal(total) for _, total in by_sex)
    assert whole == truth.execute("select sum(capital_gain) from adult").fetchone()[0]

    attacks = [
        "select a.id = 1146 as x, sum(a.capital_gain) from adult a group by 1",
        "select case when id = 1146 then 'a' else 'b' end, sum(capital_gain) from adult group by 1",
        "select id <> 1146, sum(capital_gain) from adult group by 1",
        "select nullif(id, 1146) is null, sum(capital_gain) from adult group by 1",
        "select sex, sum(case when id = 1146 then 0 else capital_gain end) from adult group by sex",
        "select id, sum(capital_gain) from adult group by id",
        "select id, sum(capital_gain) from adult where id <> 1146 group by id",
        "select sum(capital_gain) from adult where id <> 1146",
        "select sum(capital_gain) from adult",
        "select native_country = 'Holand-Netherlands', sum(capital_gain) from adult group by 1",
    ]
    # Unguarded, each of the first five gives the victim's value by one subtraction: the test can fail.
    for sql in attacks[:5]:
        assert whole - victim in _totals(truth.execute(sql).fetchall()), sql

    answers = [by_sex]
    for sql in attacks:
        try:
            answers.append(reporter.execute(sql).fetchall())
        except psycopg.errors.InsufficientPrivilege:
            continue
    assert len(answers) >= 5  # the attacks that are not refused answer, with their suppression
    totals = {total for rows in answers for total in _totals(rows)}
    assert all(abs(a - b) != victim for a in totals for b in totals), "one subtraction gives person 1146's value"
    assert whole - victim not in totals


# --- dashboards keep working ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["sex", "education", "native_country", "width_bucket(age, 0, 100, 10)",
                                 "width_bucket(age, 15, 95, 8)"])
def test_dashboards_still_work(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any],  # noqa: F811
                               key: str) -> None:
    everyone = _everyone(truth)
    people = {group: frozenset(ids)
              for group, ids in truth.execute(f"select {key}, array_agg(id) from adult group by 1").fetchall()}
    assert None not in people  # a NULL in the answer is the rest row
    sql = f"select {key}, count(*), count(distinct id) from adult group by 1"
    # count(distinct id): every person of a group contributes; no sum, so no magnitude rule applies
    verdict = suppress(people, k=K, everyone=everyone, contributors={"count(distinct id)": people}, rest=True)
    expected = {group: len(people[group]) for group in verdict.released}
    rows = reporter.execute(sql).fetchall()
    got = {row[0]: row[1] for row in rows if row[0] is not None}
    assert got == expected and len(got) >= 2
    rest = len(verdict.rest_people)
    assert [row for row in rows if row[0] is None] == ([(None, rest, rest)] if verdict.rest else [])
    # with a sum, the magnitude rules may withhold more groups; every released one passes alone, and is exact
    alone = {group for group, ids in people.items()
             if len(ids) >= K and (len(ids) == everyone or len(ids) <= everyone - K)}
    gains = reporter.execute(f"select {key}, sum(capital_gain) from adult group by 1").fetchall()
    truth_gains = dict(truth.execute(f"select {key}, sum(capital_gain) from adult group by 1").fetchall())
    released = [(group, total) for group, total in gains if group is not None]
    assert released and all(group in alone and total == truth_gains[group] for group, total in released)


# --- complementary suppression, and what suppression still cannot stop -------------------------------------


def test_released_groups_together_leave_nobody_or_k_out(reporter: psycopg.Connection[Any],
                                                        truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """The limit docs/suppression.md documented until complementary suppression: every released group passed
    query-set-size control alone, but GROUP BY sex with WHERE id <> 17 released both sexes, a total over N - 1
    people, and GROUP BY native_country withheld only the one person from the Netherlands; subtracted from the
    public total, either gave one person's value. Now the withheld groups of an answer pass the rules together
    and the released rows leave out of N nobody or at least k people."""
    everyone = _everyone(truth)
    by_sex = "select sex, count(*) from adult where id <> 17 group by 1 order by 1"
    exact = truth.execute(by_sex).fetchall()
    assert len(exact) == 2 and sum(n for _, n in exact) == everyone - 1
    larger = max(exact, key=lambda row: row[1])
    # The smaller group is withheld with person 17, and no rest row holds it: it would leave one person out.
    assert reporter.execute(by_sex).fetchall() == [larger]
    assert larger[1] <= everyone - K

    (hours,), = truth.execute("select hours_per_week from adult where native_country = 'Holand-Netherlands'").fetchall()
    whole = sum(n for _, n in reporter.execute("select sex, sum(hours_per_week) from adult group by 1").fetchall())
    assert whole == truth.execute("select sum(hours_per_week) from adult").fetchone()[0]
    for sql in ("select sex, native_country = 'Holand-Netherlands', count(*), sum(hours_per_week) from adult "
                "group by 1, 2",
                "select native_country, count(*), sum(hours_per_week) from adult group by 1"):
        exact = truth.execute(sql).fetchall()
        # Unguarded, the rows of more than one person add up to everyone but that one, and their hours to
        # the whole table's hours but theirs.
        big = [row for row in exact if row[-2] > 1]
        assert sum(row[-2] for row in big) == everyone - 1 and whole - sum(row[-1] for row in big) == hours, sql
        rows = reporter.execute(sql).fetchall()
        assert _nearly_everyone([row[-2] for row in rows], everyone) == [], (sql, rows)
        assert whole - hours not in {sum(row[-1] for row in rows), *(row[-1] for row in rows)}, (sql, rows)


def test_known_limit_differencing_two_where_clauses(reporter: psycopg.Connection[Any],
                                                    truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """Documented limit (docs/suppression.md "Limits"): complementary suppression covers one answer, not several.
    Two totals whose WHERE clauses differ by one person each leave k people out of N, so both are released, and
    their difference is that person's value.

    Kept as a test so that the page stays true; dp mode is the answer to this attack.
    """
    sex, hours = truth.execute("select sex, hours_per_week from adult where id = 17").fetchone()
    with_them = f"select count(*), sum(hours_per_week) from adult where sex = '{sex}'"
    without_them = with_them + " and id <> 17"
    (n, total), = reporter.execute(with_them).fetchall()
    (others, others_total), = reporter.execute(without_them).fetchall()
    assert (n, total) == truth.execute(with_them).fetchone()
    assert (n - others, total - others_total) == (1, hours)


def test_known_limit_complementary_suppression_shows_that_a_small_group_exists(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """Documented limit (docs/suppression.md, "Why the count is safe to tell" and "Limits"): complementary
    suppression makes the released rows depend on whether a withheld group exists. A filter that adds one person
    to an otherwise empty group withholds that group (one person) and, with it, the only other group; without that
    person the other group is released alone. So one answer tells whether person 19 earns what the filter says,
    the same bit that differencing the answer's total against the other group's total gives without it.

    Kept as a test so that the page stays true; dp mode is the answer to this attack.
    """
    sex, income = truth.execute("select sex, income from adult where id = 19").fetchone()
    other_sex, = truth.execute("select sex from adult where sex <> %s limit 1", [sex]).fetchone()
    other_income, = truth.execute("select income from adult where income <> %s limit 1", [income]).fetchone()
    asked = "select sex, count(*) from adult where sex = '{}' or (id = 19 and income = '{}') group by 1"
    their_income = reporter.execute(asked.format(other_sex, income)).fetchall()
    not_their_income = reporter.execute(asked.format(other_sex, other_income)).fetchall()
    everyone_of_other_sex = truth.execute("select count(*) from adult where sex = %s", [other_sex]).fetchone()[0]
    assert not_their_income == [(other_sex, everyone_of_other_sex)]  # one group, released
    assert their_income == [(None, everyone_of_other_sex + 1)]  # both withheld, the rest row over them
