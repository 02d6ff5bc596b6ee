"""Distinct counts (issue 19 item 4): count(DISTINCT x) in dp mode for any column or row expression, and casts of the
column inside it in both modes.

Suppress mode answers count(DISTINCT col) and count(DISTINCT cast(col AS t)) for a cast that keeps the column's
values apart (the same number: nothing new is told), equal to PostgreSQL's own for the released groups, and refuses
every other expression there: the number of distinct values of CASE WHEN <one person> THEN 'x' ELSE 'y' END tells
whether that person is in the group, and a cast that merges or splits values (char, varchar(n), numeric to text)
tells what the column alone does not.

dp mode counts the distinct values over the bounded rows (at most c rows per unit and group): adding or removing one
person moves a group's count by at most c, 1 for the unit, whatever their rows hold. Tested on the bounded SQL run
by PostgreSQL (one person with 1000 rows of distinct values moves it by c, the unbounded count by 1000), on the
noise the answer draws (its law against the discrete Laplace at c·R/ε, and not at R/ε), and through the proxy:
answered, charged once, with the interval of a count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures
from test_mechanisms import (
    ALPHA,
    SMALL_DRAWS,
    chi_square_p,
    confirmed_on_fresh_draws,
    laplace_pmf,
)

from anonproxy.dp.finish import answer
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import demo_policy

EPSILON = 0.5
ROLE = RolePolicy("counter", "dp")


def _plan(sql: str, policy: Policy, rows: int = 1, groups: int = 1) -> DPPlan:
    plan = plan_dp(sql, ROLE, policy, DPParams(EPSILON, 1e-7, max_groups_per_unit=groups, max_rows_per_unit=rows))
    assert isinstance(plan, DPPlan), plan
    return plan


@pytest.fixture(scope="module")
def policy(truth: psycopg.Connection) -> Policy:
    """The gated database's policy as the proxy reads it: with the columns' SQL types."""
    return load_policy(truth)


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str
             ) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def _refusal(conn: psycopg.Connection[Any], sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as refused:
        conn.execute(sql).fetchall()
    assert refused.value.sqlstate in ("0A000", "42501"), refused.value
    assert refused.value.diag.message_hint, refused.value
    return refused.value


# --- suppress mode: the column, or a cast that keeps its values apart ---------------------------------------------


@pytest.mark.parametrize("sql", [
    # Tableau COUNTD (tb-ts-countd-cast): the unit through the link, cast to text
    ('SELECT "visits"."channel" AS "channel", COUNT(DISTINCT CAST("visits"."person_id" AS TEXT)) AS "ctd" '
    'FROM "public"."visits" "visits" GROUP BY 1'),
    ("select sex, count(distinct age::text), count(distinct (education)::varchar), count(distinct cast(age as bigint)) "
    "from adult group by sex"),
    ("select workclass, count(distinct occupation) filter (where age > 40), count(distinct id::text) from adult "
    "group by workclass"),
    "select count(distinct cast(cast(age as bigint) as text)) from adult",
    "select channel, count(distinct visited_at::text), count(distinct visited_at) from visits group by 1",
])
def test_suppress_answers_casts_that_keep_values_apart_as_postgresql_does(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection, sql: str) -> None:
    answered = reporter.execute(sql).fetchall()
    exact = {row[0] if len(row) > 1 else None: row for row in truth.execute(sql).fetchall()}
    assert answered
    for row in answered:  # every released group (the rest row aside) is PostgreSQL's own
        key = row[0] if len(row) > 1 else None
        if key in exact and None not in row[1:]:
            assert row == exact[key], (row, exact[key])
    assert any(row in exact.values() for row in answered)


def test_suppress_refuses_a_distinct_count_that_singles_out_a_person(reporter: psycopg.Connection[Any],
                                                                   truth: psycopg.Connection) -> None:
    # The attack: in a group of many people, the number of distinct values of CASE WHEN <the target> ... is 2
    # when the target is there and 1 when not, although the group passes every group-size rule.
    (target, age, occupation) = truth.execute(
        "select min(id), age, occupation from adult where age = 90 and sex = 'Female' group by age, occupation "
        "having count(*) = 1 limit 1").fetchone()
    probe = (f"count(DISTINCT CASE WHEN age = {age} AND sex = 'Female' AND occupation = '{occupation}' "
             "THEN 'x' ELSE 'y' END)")
    exact = dict(truth.execute(f"select workclass, {probe} from adult group by workclass").fetchall())
    (home,) = truth.execute("select workclass from adult where id = %s", [target]).fetchone()
    assert exact[home] == 2 and sorted(set(exact.values())) == [1, 2]  # the probe works without the rule
    refused = _refusal(reporter, f"select workclass, {probe} from adult group by workclass")
    assert "count(DISTINCT" in str(refused) and "single out" in str(refused)


def test_the_admitted_casts_keep_values_apart_and_the_refused_ones_do_not(truth: psycopg.Connection) -> None:
    """What the rule rests on, in PostgreSQL itself: an admitted cast counts as many values as the column, in every
    group; numeric to text splits equal values, char(1) merges different ones."""
    for column, cast, table in (
            ("age", "age::text", "adult"), ("education", "education::varchar", "adult"),
            ("age", "cast(age as bigint)", "adult"), ("id", "cast(id as text)", "adult"),
            ("visited_at", "visited_at::text", "visits"), ("person_id", "person_id::text", "visits")):
        rows = truth.execute(f"select count(DISTINCT {column}) = count(DISTINCT {cast}) from {table} "
                             f"group by {'sex' if table == 'adult' else 'channel'}").fetchall()
        assert rows and all(equal for (equal,) in rows), cast
    assert truth.execute("select count(DISTINCT x), count(DISTINCT x::text) from (values (1.0), (1.00)) v(x)"
                         ).fetchone() == (1, 2)
    assert truth.execute("select count(DISTINCT x), count(DISTINCT x::char) from (values ('ab'), ('ac')) v(x)"
                         ).fetchone() == (2, 1)


@pytest.mark.parametrize("argument", [
    "CAST(education AS CHAR)",  # char(1): 'Bachelors' and 'Bachelors'' neighbours merge into 'B'
    "education::varchar(3)",  # cut short: merges values
    "visits.amount::text",  # numeric to text: 1.0 and 1.00 are one value, two texts
    "age + 0",  # an expression, however harmless
    "lower(education)",
    "cast(id + 0 as text)",
    "coalesce(occupation, 'none')",
])
def test_suppress_refuses_other_expressions_inside_count_distinct(reporter: psycopg.Connection[Any],
                                                                  argument: str) -> None:
    table = "visits join adult on adult.id = visits.person_id" if "visits" in argument else "adult"
    _refusal(reporter, f"select sex, count(DISTINCT {argument}) from {table} group by sex")


# --- dp mode: bounding, sensitivity, noise -----------------------------------------------------------------------


def test_the_plan_counts_distinct_values_with_the_per_person_bound(policy: Policy) -> None:
    for rows, groups in ((1, 1), (3, 2)):
        plan = _plan("select date_trunc('month', visited_at), count(DISTINCT channel) from visits group by 1",
                     policy, rows, groups)
        (distinct,) = [stat for stat in plan.statistics if stat.kind == "distinct"]
        assert distinct.per_group == rows and distinct.sensitivity == rows * groups
        # c·R/ε: the months are a public time domain (visited_at has declared bounds), so no selection count shares ε
        assert distinct.scale == Fraction(rows * groups) / Fraction(EPSILON)
    # the unit, through the link or cast to text: a count of people (1 per group), the selection count's statistic
    for argument in ("person_id", "CAST(visits.person_id AS TEXT)", "(person_id)::varchar"):
        plan = _plan(f"select channel, count(DISTINCT {argument}) from visits group by 1", policy, 3, 2)
        assert [stat.kind for stat in plan.statistics] == ["units"], argument
    # a row expression allowed as a GROUP BY key, with its no-error proof
    plan = _plan("select channel, count(DISTINCT date_trunc('month', visited_at)) from visits group by 1", policy, 2)
    assert [(stat.kind, stat.per_group) for stat in plan.statistics] == [("distinct", 2)]
    # the unit under FILTER: its own statistic, still 1 per group
    plan = _plan("select count(DISTINCT person_id) filter (where channel = 'web') from visits", policy, 3)
    ((kind, per_group),) = [(stat.kind, stat.per_group) for stat in plan.statistics]
    assert (kind, per_group) == ("distinct", 1)


def test_one_person_with_many_distinct_values_moves_the_count_by_at_most_c(policy: Policy,
                                                                           truth: psycopg.Connection) -> None:
    """Neighbours: the visits of four people, with and without 1000 visits of a fifth at distinct times. Nobody else
    has more than five visits, so with c = 5 no row of theirs is dropped: the bounded SQL's value moves by the
    fifth person's bounded part alone."""
    people = [row[0] for row in truth.execute(
        "select person_id from visits group by 1 having count(*) between 2 and 5 order by 1 limit 5")]
    target = people[0]
    where = f"person_id IN ({', '.join(map(str, people))})"
    sql = f"select count(DISTINCT visited_at) from visits where {where}"
    plan = _plan(sql, policy, rows=5)
    with truth.transaction(force_rollback=True):
        truth.execute("delete from visits where person_id = %s", [target])
        (without,), = truth.execute(plan.sql).fetchall()
        (raw_without,), = truth.execute(sql).fetchall()
        truth.execute("insert into visits (visit_id, person_id, visited_at, channel, amount) "
                      "select 10000000 + i, %s, timestamptz '2025-03-01' + i * interval '1 minute', 'web', 10 "
                      "from generate_series(1, 1000) AS i", [target])
        (with_target,), = truth.execute(plan.sql).fetchall()
        (raw_with,), = truth.execute(sql).fetchall()
    assert raw_with - raw_without == 1000  # unbounded, one person would move it by 1000
    assert with_target - without == 5 and without == raw_without  # bounded: by c, and the others' rows kept


def test_a_distinct_count_that_singles_out_a_person_learns_no_more_than_epsilon_allows(
        postgresql: psycopg.Connection) -> None:
    """The suppress-mode attack in dp mode, where it is answered: count(DISTINCT CASE WHEN <the target> THEN 'x'
    ELSE 'y' END) is 2 with the target and 1 without. Over 4000 noisy answers in each world, guessing "with" when
    the answer is at least 1.5 is right no more often than ε-DP allows (e^ε/(1+e^ε), plus five binomial standard
    deviations), and better than a coin (the noise is calibrated, not infinite)."""
    (target, age, occupation) = postgresql.execute(
        "select min(id), age, occupation from adult where age = 90 and sex = 'Female' group by age, occupation "
        "having count(*) = 1 limit 1").fetchone()
    plan = _plan(f"select count(DISTINCT CASE WHEN age = {age} AND sex = 'Female' AND occupation = '{occupation}' "
                 "THEN 'x' ELSE 'y' END) from adult", demo_policy())
    with_rows = postgresql.execute(plan.sql).fetchall()
    postgresql.execute("delete from adult where id = %s", [target])
    without_rows = postgresql.execute(plan.sql).fetchall()
    assert (with_rows, without_rows) == ([(2,)], [(1,)])  # without noise the attack is exact
    draws, right = 4000, 0
    for rows, present in ((with_rows, True), (without_rows, False)):
        for _ in range(draws):
            ((value,),), _ = answer(plan, rows)
            right += (value >= 1.5) == present
    p = math.exp(EPSILON) / (1 + math.exp(EPSILON))
    assert 0.52 < right / (2 * draws) <= p + 5 * math.sqrt(p * (1 - p) / (2 * draws))


@confirmed_on_fresh_draws
def test_the_noise_of_a_distinct_count_is_calibrated_to_c_rows() -> None:
    """The noise answer() adds to count(DISTINCT occupation) with c = 3 and R = 1 at ε 0.5 follows the discrete Laplace
    of scale c/ε = 6 (a chi-square a correct sampler passes at false alarm 1e-4 per sample, confirmed on a second);
    the scale a sensitivity of 1 would give (2) fails it."""
    plan = _plan("select count(DISTINCT occupation) from adult", demo_policy(), rows=3)
    ((stat),) = plan.statistics
    assert stat.scale == 6
    exact = 10_000  # far from 0, where a count is clamped
    draws = [answer(plan, [(exact,)])[0][0][0] - exact for _ in range(SMALL_DRAWS)]
    assert chi_square_p(draws, laplace_pmf(Fraction(6))) > ALPHA
    assert chi_square_p(draws, laplace_pmf(Fraction(2))) < ALPHA


def test_the_interval_of_a_distinct_count_covers_95_percent() -> None:
    """dp_interval_low/high of count(DISTINCT occupation) at c = 3: the noise's 95 % interval (half-width 18 at scale
    6), covering the exact value in 95 % of answers (within five binomial standard deviations: 0.9423 over 20,000);
    the half-width a sensitivity of 1 would give (6) covers far fewer."""
    plan = _plan("select count(DISTINCT occupation) as n, dp_interval_low(n), dp_interval_high(n) from adult",
                 demo_policy(), rows=3)
    exact, draws, covered, narrow = 10_000, 20_000, 0, 0
    for _ in range(draws):
        ((value, low, high),), _ = answer(plan, [(exact,)])
        assert high - value == value - low == 18
        covered += low <= exact <= high
        narrow += abs(value - exact) <= 6
    assert covered / draws >= 0.95 - 5 * (0.95 * 0.05 / draws) ** 0.5
    assert narrow / draws < 0.75


# --- dp mode through the proxy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", [
    # Superset COUNT_DISTINCT (ss-count-distinct), Tableau COUNTD (tb-count-distinct)
    ('SELECT sex AS sex, COUNT(DISTINCT occupation) AS "COUNT_DISTINCT(occupation)" FROM public.adult GROUP BY sex '
    'ORDER BY "COUNT_DISTINCT(occupation)" DESC LIMIT 10000'),
    ('SELECT "adult"."income" AS "income", COUNT(DISTINCT "adult"."education") AS "ctd:education:ok" '
    'FROM "public"."adult" "adult" GROUP BY 1'),
    ("select date_trunc('month', visited_at) as month, count(DISTINCT channel) from visits "
    "where visited_at < '2025-07-01' group by 1"),
    "select sex, count(distinct occupation) filter (where age > 40) from adult group by sex",
    # the unit of a table on the nullable side: the people with a web visit, not everyone the join keeps
    ("select adult.sex, count(DISTINCT visits.person_id) from adult "
    "left join visits on visits.person_id = adult.id and visits.channel = 'web' group by 1"),
])
def test_dp_answers_distinct_counts_close_to_postgresql(gated_proxy: Endpoint, gated_database: str,
                                                        analyst: str, truth: psycopg.Connection,  # noqa: F811
                                                        sql: str) -> None:
    exact = {str(key): value for key, value in truth.execute(sql).fetchall()}
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        answered = {str(key): value for key, value in conn.execute(sql).fetchall()}
        assert "epsilon 1.5 of 2 left" in budget_left(conn)  # one charge of the per-query ε
    assert answered and set(answered) <= set(exact)
    for key, value in answered.items():
        # the noise's scale is a few units: 100 from the truth is more than 20 scales away (e^-20)
        assert abs(value - exact[key]) <= 100, (key, value, exact[key])


@pytest.mark.parametrize("sql", [
    "select channel, count(DISTINCT person_id) from visits group by 1",
    # Tableau COUNTD of the unit cast to text (tb-ts-countd-cast): the same count of people
    ('SELECT "visits"."channel" AS "channel", COUNT(DISTINCT CAST("visits"."person_id" AS TEXT)) AS "ctd" '
    'FROM "public"."visits" "visits" GROUP BY 1'),
])
def test_dp_counts_people_through_the_link(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                           truth: psycopg.Connection,
                                           sql: str) -> None:
    """One group per person (the role's bound): each person is counted in one of their channels, so the channels'
    counts add up to the people who visit, give or take the four counts' noise (scale 2 each)."""
    (people,) = truth.execute("select count(DISTINCT person_id) from visits").fetchone()
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        answered = dict(conn.execute(sql).fetchall())
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
    assert set(answered) == {"web", "app", "store", "phone"}
    assert abs(sum(answered.values()) - people) <= 200, (answered, people)


def test_dp_distinct_count_has_an_interval_and_is_charged_once(gated_proxy: Endpoint, gated_database: str,
                                                               analyst: str) -> None:  # noqa: F811
    notices: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(f"{d.message_primary} {d.message_detail}"))
        low, value, high, people = conn.execute(
            "select dp_interval_low(count(distinct education)), count(distinct education), "
            "dp_interval_high(count(distinct education)), count(distinct id) from adult").fetchone()
        assert low <= value <= high and high - low > 0
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        assert people > 30_000 - 200
    assert any("count(DISTINCT education)" in notice for notice in notices), notices  # what the notice measured


def test_dp_still_refuses_what_no_bound_covers(gated_proxy: Endpoint, gated_database: str,
                                               analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        # an identifying column inside an expression labels one person's rows (refused in every aggregate)
        _refusal(conn, "select count(DISTINCT CASE WHEN id = 17 THEN 1 END) from adult")
        # an expression that can fail on some rows: the no-error proof refuses it before anything runs
        _refusal(conn, "select count(DISTINCT 100 / (age - 40)) from adult")
        assert "epsilon 2 of 2 left" in budget_left(conn)
