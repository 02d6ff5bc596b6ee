"""Window functions over aggregates, computed over the released rows, in both modes.

Metabase (0.50 and later) writes a cumulative count as ``SUM(COUNT(*)) OVER (ORDER BY <breakout> ROWS UNBOUNDED
PRECEDING)``, partitioned by the other breakouts; analysts write a share of the total as ``count(*) * 100.0 /
sum(count(*)) OVER ()``. A window over the groups is post-processing of released values: the suppress back-end
runs it over the suppressed result, the dp back-end over the noisy values. Expected values are computed here from
the released rows (and, where every group is released, from PostgreSQL directly).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from test_rewrite import DP, POLICY, SUPPRESS

from anonproxy.dp.model import DPParams
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

_names = itertools.count(1)

CUMULATIVE = ('SELECT "public"."adult"."education" AS "education", COUNT(*) AS "count", '
              'SUM(COUNT(*)) OVER (ORDER BY "public"."adult"."education" ASC ROWS UNBOUNDED PRECEDING) AS "cum" '
              'FROM "public"."adult" GROUP BY "public"."adult"."education" ORDER BY "public"."adult"."education" ASC')
# Two breakouts: the running count restarts with each value of the first (Metabase partitions by the others).
PARTITIONED = ('SELECT "public"."adult"."sex" AS "sex", "public"."adult"."race" AS "race", COUNT(*) AS "n", '
               'SUM(COUNT(*)) OVER (PARTITION BY "public"."adult"."sex" ORDER BY "public"."adult"."race" ASC '
               'ROWS UNBOUNDED PRECEDING) AS "count" FROM "public"."adult" '
               'GROUP BY "public"."adult"."sex", "public"."adult"."race" '
               'ORDER BY "public"."adult"."sex" ASC, "public"."adult"."race" ASC')
SHARE = "select sex, count(*), count(*) * 100.0 / sum(count(*)) over () as pct from adult group by sex order by sex"
RANKED = ("select education, count(*) as n, rank() over (order by count(*) desc) as r, "
          "lag(count(*), 1) over (order by education) as previous from adult group by education order by education")


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def running(values: list[Any]) -> list[Any]:
    return list(itertools.accumulate(values))


def test_windows_over_aggregates_are_post_aggregate_expressions() -> None:
    rewrite = decide(CUMULATIVE, SUPPRESS, POLICY)
    assert isinstance(rewrite, Rewrite), rewrite
    assert "sum(anonproxy_v1) OVER (ORDER BY anonproxy_g1 ASC NULLS LAST ROWS UNBOUNDED PRECEDING)" in rewrite.sql
    ranked = decide(RANKED, SUPPRESS, POLICY)
    assert isinstance(ranked, Rewrite) and "lag(anonproxy_v1, 1) OVER (ORDER BY anonproxy_g1" in ranked.sql


@pytest.mark.parametrize(("sql", "words"), [
    ("select sex, sum(age) over () from adult group by sex", "window functions"),  # a window over rows
    ("select sex, count(*) from adult group by sex having sum(count(*)) over () > 0", "not allowed in HAVING"),
    ("select sex, count(*) from adult where sum(count(*)) over () > 0 group by sex", "WHERE"),
    ("select sex, count(distinct count(*)) over () from adult group by sex", "window function"),
    ("select sex, string_agg(sex, ',') over () from adult group by sex", "window function"),
    ("select sex, sum(count(*)) over (order by sex rows between $1 preceding and current row) from adult "
     "group by sex", "window frame"),
    ("select sex, sum(count(*)) over (order by sex rows between unbounded preceding and current row exclude "
     "current row) from adult group by sex", "window frame"),
    ("select count(*) over () from adult", "must aggregate"),  # one row per person, each with the total
    ("select sum(age) over () from adult", "window functions"),
])
def test_windows_that_are_not_post_processing_are_refused(sql: str, words: str) -> None:
    for role in (SUPPRESS, DP):
        decision = decide(sql, role, POLICY)
        if not isinstance(decision, Reject):
            decision = plan_dp(sql, role, POLICY, DPParams(epsilon=1, delta=1e-6))
        assert isinstance(decision, Reject) and words in decision.message, (role.mode, sql, decision)


def test_suppress_mode_answers_windows_as_postgresql_when_every_group_is_released(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    groups = "select sex, count(*) over () as groups from adult group by sex"  # the number of groups, on each
    for sql in (CUMULATIVE, PARTITIONED, SHARE, RANKED, groups):
        got = reporter.execute(sql)
        expected = truth.execute(sql)
        assert [c.name for c in got.description] == [c.name for c in expected.description], sql
        assert got.fetchall() == expected.fetchall(), sql


def test_suppress_mode_windows_see_only_the_released_rows(reporter: psycopg.Connection[Any],
                                                          truth: psycopg.Connection[Any]) -> None:
    rows = reporter.execute("select native_country, count(*) as n, sum(count(*)) over () as total "
                            "from adult group by native_country").fetchall()
    countries = truth.execute("select count(distinct native_country) from adult").fetchone()[0]
    assert 0 < len(rows) < countries, "some countries are small enough to be withheld"
    assert {total for _, _, total in rows} == {sum(n for _, n, _ in rows)}, "the total of what was released"


def test_dp_windows_are_free_post_processing_of_the_noisy_counts(gated_proxy: Endpoint, gated_database: str,
                                                                  truth: psycopg.Connection[Any]) -> None:
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_windows_{next(_names)}") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        plain = conn.execute('SELECT "public"."adult"."education" AS "education", COUNT(*) AS "count" '
                             'FROM "public"."adult" GROUP BY "public"."adult"."education"').fetchall()
        left = conn.execute("show anonproxy.budget").fetchone()[0]
        rows = conn.execute(CUMULATIVE).fetchall()
        assert [(education, n) for education, n, _ in rows] == sorted(plain), "the same noisy counts"
        assert [cum for _, _, cum in rows] == running([n for _, n, _ in rows])
        assert conn.execute("show anonproxy.budget").fetchone()[0] == left, "post-processing: no charge"
        shares = conn.execute(SHARE).fetchall()
        total = sum(n for _, n, _ in shares)
        assert all(pct == Decimal(n) * 100 / total for _, n, pct in shares) or all(
            abs(pct - Decimal(n) * 100 / total) < Decimal("1e-15") for _, n, pct in shares)
        ranked = conn.execute(RANKED).fetchall()
        counts = [n for _, n, _, _ in ranked]
        assert [previous for _, _, _, previous in ranked] == [None, *counts[:-1]]
        assert [r for _, _, r, _ in ranked] == [1 + sum(other > n for other in counts) for n in counts]


@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_windows_see_the_groups_having_keeps(gated_proxy: Endpoint, gated_database: str, mode: str,
                                             truth: psycopg.Connection[Any]) -> None:
    """As in PostgreSQL, a window runs after HAVING: a total over the kept groups only, whether HAVING compares
    aggregates with constants or computes over them."""
    with contextlib.ExitStack() as stack:
        role = "reporter" if mode == "suppress" else stack.enter_context(
            fresh_dp_role(truth, gated_proxy, gated_database, f"dp_windows_{next(_names)}", epsilon=10))
        conn = stack.enter_context(psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True))
        for having in ("count(*) > 1000", "count(*) * 2 > 2000"):
            rows = conn.execute(f"select education, count(*) as n, sum(count(*)) over () as total from adult "
                                f"group by education having {having} order by 1").fetchall()
            assert 3 < len(rows) < 16 and all(n > 1000 for _, n, _ in rows), having
            assert {total for _, _, total in rows} == {sum(n for _, n, _ in rows)}, having
