"""The console's flags and policy differences: pure functions of trail rows, budgets and policy snapshots."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import unquote

from anonproxy.console.flags import (
    Budget,
    Flag,
    TrailRow,
    budget_exhaustion,
    differencing_pairs,
    identifying_columns,
    refusal_bursts,
)
from anonproxy.console.history import policy_changes
from anonproxy.console.pages import LINKED_IDS, flags_body

T0 = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)
ADULT = ("public.adult",)
IDENTIFIERS = {"public.adult": frozenset({"id"})}


def row(id_: int, statement: str, login: str = "reporter", decision: str = "answered", seconds: float = 0,
        sqlstate: str | None = None) -> TrailRow:
    return TrailRow(id_, T0 + timedelta(seconds=seconds), login, decision, sqlstate, statement, ADULT)


def refused(id_: int, seconds: float, login: str = "reporter") -> TrailRow:
    return row(id_, "select * from adult", login, "refused", seconds, "42501")


def test_refusals_flag_five_within_ten_minutes_only() -> None:
    burst = [refused(i, i * 60) for i in range(1, 6)]  # five in four minutes
    spread = [refused(10 + i, 3600 + i * 200, "analyst") for i in range(5)]  # five in 13 minutes 20 seconds
    flags = refusal_bursts(burst + spread)
    assert [(f.login, f.ids) for f in flags] == [("reporter", (1, 2, 3, 4, 5))]


def test_refusals_two_bursts_are_two_flags() -> None:
    rows = [refused(i, i) for i in range(5)] + [refused(10 + i, 7200 + i) for i in range(6)]
    assert [len(f.ids) for f in refusal_bursts(rows)] == [5, 6]


def test_identifying_columns_in_group_by_and_where_of_answered_statements() -> None:
    rows = [row(1, "select id, count(*) from adult group by id"),
            row(2, "select count(*) from adult where ID = 17"),
            row(3, "select count(*) from adult where age > 30 group by sex"),
            row(4, "select id from adult where id = 1", decision="refused", sqlstate="42501"),
            row(5, "select count(id) from adult")]  # an identifier only counted: not a probe
    flags = identifying_columns(rows, IDENTIFIERS)
    assert [(f.summary, f.ids) for f in flags] == [
        ("1 answered statement with the identifying column id in GROUP BY", (1,)),
        ("1 answered statement with the identifying column id in WHERE", (2,))]


def test_identifying_columns_of_the_tables_read_only() -> None:
    other = TrailRow(1, T0, "reporter", "answered", None, "select count(*) from t where id = 1", ("public.t",))
    assert identifying_columns([other], {"public.adult": frozenset({"id"}), "public.t": frozenset({"pid"})}) == []


def test_differencing_one_condition_more_or_one_replaced_on_the_same_column() -> None:
    rows = [row(1, "select count(*) from adult"),
            row(2, "select count(*) from adult where id <> 17"),
            row(3, "select count(*) from adult where age > 30 and sex = 'Male'"),
            row(4, "select count(*) from adult where (age > 40) and sex = 'Male'"),
            row(5, "select count(*) from adult where age > 30 and race = 'White'"),  # replaced on another column
            row(6, "select sum(age) from adult where id <> 17"),  # another shape
            row(7, "select count(*) from adult where id <> 17", login="analyst")]  # another login
    flags = differencing_pairs(rows)
    assert sorted((f.ids, f.summary) for f in flags) == [
        ((1, 2), "two answered statements differ only in id <> 17"),
        ((3, 4), "two answered statements differ only in age > 30 / age > 40")]


def test_differencing_ignores_repeats_refusals_and_unparsable_text() -> None:
    rows = [row(1, "select count(*) from adult where age > 1"), row(2, "select count(*) from adult where age > 1"),
            row(3, "select count(*) from adult where age > 1 and id = 2", decision="refused", sqlstate="42501"),
            row(4, "this is not sql ((("), row(5, "select 1; select 2")]
    assert differencing_pairs(rows) == []


def test_budget_flags_at_ninety_percent_and_refusals_for_budget() -> None:
    budgets = [Budget("analyst", "public.adult", Decimal(10), Decimal(9)),
               Budget("other", "public.adult", Decimal(10), Decimal("8.99"))]
    rows = [row(1, "select count(*) from adult", login="analyst"),
            row(2, "select count(*) from adult", login="analyst", decision="refused", sqlstate="53400"),
            row(3, "select count(*) from adult", login="other", decision="refused", sqlstate="42501")]
    flags = budget_exhaustion(budgets, rows)
    assert [(f.login, f.summary, f.ids) for f in flags] == [
        ("analyst", "9 of ε 10 spent on public.adult (90 %)", (1,)),
        ("analyst", "1 statement refused for lack of budget (SQLSTATE 53400)", (2,))]


def test_policy_changes_name_what_changed() -> None:
    before = {"role_policies": [{"role_name": "reporter", "mode": "suppress", "k": 10}],
              "budgets": [{"role_name": "analyst", "domain": "public.adult", "epsilon": 10}],
              "service_role": "anonproxy_service"}
    after = {"role_policies": [{"role_name": "reporter", "mode": "suppress", "k": 20},
                               {"role_name": "auditor", "mode": "direct", "k": 10}],
             "budgets": [], "service_role": "anonproxy_service"}
    assert policy_changes(before, after) == ["role_policies: added auditor", "role_policies: reporter: k 10 → 20",
                                             "budgets: removed analyst.public.adult"]
    assert policy_changes(after, after) == ["no change"]
    assert policy_changes(None, after) == ["(the first version recorded)"]


def test_a_flag_links_to_its_latest_statements_only() -> None:
    page = flags_body([Flag("budget", "analyst", "many", tuple(range(1, 1001)))], 1000, 20000)
    link = re.search(r'href="/trail\?ids=([^"]*)"', page)
    assert link is not None
    assert unquote(link.group(1)).split(",") == [str(i) for i in range(1001 - LINKED_IDS, 1001)]
    assert f"1000 statements (the latest {LINKED_IDS})" in page
