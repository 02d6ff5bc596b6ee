"""EXPLAIN (ANONPROXY) for roles in suppress mode (docs/suppression.md), through the real proxy.

The `reporter` of the demo policy: k = 10, dominance (2, 85 %), p 10 %, suppressed rest. The plan comes from the
query and the policy only: nothing runs, no data is read, so two queries that differ only in a constant explain
alike whatever the data holds.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import Endpoint

K = 10


def reporter(proxy: Endpoint, dbname: str) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(dbname, user="reporter"), autocommit=True)


def explain(conn: psycopg.Connection, query: str, params: list[object] | None = None) -> list[str]:
    cur = conn.execute(f"EXPLAIN (ANONPROXY) {query}", params)
    assert [(c.name, c.type_code) for c in cur.description or ()] == [("QUERY PLAN", 25)]  # as dp's, and EXPLAIN's
    assert cur.statusmessage == "EXPLAIN"
    return [row[0] for row in cur.fetchall()]


def test_a_grouped_query_shows_every_rule_and_the_sql(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        plan = explain(conn, "SELECT education AS level, count(*), avg(hours_per_week), count(occupation) "
                             "FROM adult WHERE age > 30 GROUP BY education")
    assert plan[0] == f"suppressed answer on public.adult: exact values; groups of fewer than k = {K} people withheld"
    # adult.id is its primary key: each row is one person (docs/suppression.md, "The SQL it runs")
    assert ('  privacy unit: "adult"."id", unique and not null in the catalog: each row of the FROM clause is one '
            'person, and the rules are decided in the same pass as the answer') in plan
    # docs/suppression.md, "The rules": n >= k, and n = N or n <= N - k (a total over everyone is released)
    assert (f"  query-set-size control: every released group, total and rest row covers n people, n >= {K}, and "
            f"n = N or n <= N - {K}") in plan
    # N as the one-pass SQL reaches it (anonproxy.suppress.one_pass): no second count of the table
    assert ("    N: the people of the FROM clause, joins included, WHERE not: the people of every group, added up, plus "
            f"the rows the WHERE leaves out counted up to k = {K} (enough for every rule)") in plan
    assert "  grouping keys: education (text)" in plan  # typed from the column types the policy reads
    assert f"  sum/avg of hours_per_week: at least {K} people with a value that is not null and not zero" in plan
    assert f"  count/min/max of occupation: at least {K} people with a value that is not null" in plan
    assert ("  dominance: a group is withheld when its 2 largest contributions make more than 85 % of the sum of "
            "hours_per_week") in plan
    assert any(line.startswith("  p % rule: withheld when the sum minus its two largest") for line in plan)
    assert ("  suppressed rest: one more row, NULL in level, holds the withheld groups together; released only if it "
            f"passes the same rules and, with the released rows, leaves out of N nobody or at least {K} people") in plan
    assert (f"  complementary suppression: the withheld groups together must hold nobody or at least {K} people and "
            f"pass the same rules, and the released rows must leave out of N nobody or at least {K} people; else the "
            "smallest released groups are withheld too") in plan
    assert (f"  notice: after the answer, how many groups were withheld (when they hold at least {K} people together "
            f"and leave out of N nobody or at least {K}), or why a total was withheld") in plan
    assert not any(line.startswith("  HAVING:") for line in plan)  # the query has none
    sql = plan.index("SQL the service would run:")
    assert plan[sql + 1] == "  WITH anonproxy_summary AS ("  # one pass over the table: answer and rules
    assert "  anonproxy_universe(n) AS (" in plan and "  anonproxy_cells AS (" in plan  # N once; ranking if needed
    assert "  ) AS anonproxy_answer" in plan and "  WHERE (SELECT reported FROM anonproxy_report)" in plan
    assert plan[-1] == "nothing was run"


def test_a_total_and_the_extended_protocol(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        plan = explain(conn, "SELECT count(*) FROM adult WHERE age > %s", [30])
        again = explain(conn, "SELECT count(*) FROM adult WHERE age > %s", [99])
    assert plan == again  # the bound value is not looked at
    assert (f"  no GROUP BY: one total, withheld unless n >= {K} and n = N or n <= N - {K} (a total over everyone is "
            "released)") in plan
    assert not any("suppressed rest" in line or "dominance" in line for line in plan)  # no sum, no rest row
    assert not any("complementary" in line for line in plan)  # one total: no groups to withhold with it
    assert "  WHERE age > $1" in plan


def test_having_is_said_to_read_released_values_only(gated_proxy: Endpoint, gated_database: str) -> None:
    """docs/suppression.md, "HAVING, and everything after the groups": HAVING is evaluated on the released groups and
    the rest row, never on a withheld group; on a total, it takes no part in the verdict."""
    with reporter(gated_proxy, gated_database) as conn:
        grouped = explain(conn, "SELECT education, count(*) FROM adult GROUP BY education HAVING count(*) > 100")
        total = explain(conn, "SELECT count(*) FROM adult WHERE age > 40 HAVING count(*) > 100")
    assert [line for line in grouped if line.startswith("  HAVING:")] == [
        "  HAVING: evaluated on released groups and the rest row only; the rest row holds every withheld group"]
    assert [line for line in total if line.startswith("  HAVING:")] == [
        "  HAVING: applied to the total after the rules; it takes no part in the verdict"]


def test_refusals_are_the_querys_own(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="SELECT \\* is not allowed"):
            explain(conn, "SELECT * FROM adult")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="explains aggregate queries"):
            explain(conn, "SELECT 1")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="EXPLAIN ANALYZE is not allowed"):
            conn.execute("EXPLAIN (ANONPROXY, ANALYZE) SELECT sex, count(*) FROM adult GROUP BY sex")


# -- attacks -----------------------------------------------------------------------------------------------------


def test_explain_does_not_run_the_query(gated_proxy: Endpoint, gated_database: str) -> None:
    """A query that fails when it runs (the men's total overflows smallint) is explained without an error."""
    query = "SELECT sex, sum(capital_gain)::smallint FROM adult WHERE age > 20 GROUP BY sex"
    with reporter(gated_proxy, gated_database) as conn:
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):
            conn.execute(query)
        plan = explain(conn, query)
    assert plan[-1] == "nothing was run"


@pytest.mark.parametrize("query", [
    "SELECT income, count(*), sum(capital_gain) FROM adult WHERE {} GROUP BY income",
    "SELECT count(*) FROM adult WHERE {}",
])
def test_explain_says_nothing_about_the_data(gated_proxy: Endpoint, gated_database: str, query: str) -> None:
    """One person, a sensitive condition on them, or nobody: the plans differ only by the query's own text."""
    conditions = ["id = 17", "id = 17 AND income = '>50K'", "id = -1"]
    notices: list[str] = []
    with reporter(gated_proxy, gated_database) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        plans = [[line.replace(condition, "<condition>") for line in explain(conn, query.format(condition))]
                 for condition in conditions]
    assert plans[0] == plans[1] == plans[2]
    assert notices == []  # no answer, so no word of what was withheld


def test_derived_keys_are_shown_with_their_type_and_bounds(gated_proxy: Endpoint, gated_database: str) -> None:
    """The plan knows each grouping key's SQL type and, for a number, the bounds that follow from the declared
    bounds of its columns (age in [15, 100], hours_per_week in [0, 100] in the demo policy)."""
    with reporter(gated_proxy, gated_database) as conn:
        plan = explain(conn, "SELECT age / 10 * 10, floor((hours_per_week - 10.0) / 10.0), count(*) FROM adult "
                             "GROUP BY 1, 2")
    assert ("  grouping keys: age / 10 * 10 (int4 in [10, 100]), floor((hours_per_week - 10.0) / 10.0) "
            "(numeric in [-1, 9])") in plan, plan
