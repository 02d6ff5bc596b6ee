"""dp answers are charged before their SQL reads the data (fail closed), and cached under every table they read.

Through the gated proxy, as a fresh dp role of ε 2 in all, 0.5 per query (the
``analyst`` fixture of test_dp_proxy). The planner refuses every expression
that could fail on some rows, so the failure is planted in the database: a
linked table whose row-level security policy raises an error for each row it
reads. The question's SQL fails only once it reads rows (P0001).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy, wait_for_version
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)

FAILS_AT_RUN_TIME = "select count(*) from adult a join trap t on t.person = a.id"


@pytest.fixture
def trap(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:  # noqa: F811
    """public.trap, linked to public.adult: reading any of its rows raises P0001 'the data was read'."""
    truth.execute("create table public.trap (person int not null)")
    truth.execute("insert into public.trap select id from public.adult where id % 100 = 0")
    truth.execute("create function public.trap_read() returns boolean volatile language plpgsql as "
                  "$$ begin raise exception 'the data was read'; end $$")
    truth.execute("alter table public.trap enable row level security")
    truth.execute("create policy sprung on public.trap using (public.trap_read())")
    truth.execute("select anonproxy.link_table('public.trap', 'person', 'public.adult')")
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    wait_for_policy(gated_proxy, gated_database, version)
    yield
    truth.execute("select anonproxy.unlink_table('public.trap')")
    truth.execute("drop table public.trap")
    truth.execute("drop function public.trap_read()")


@pytest.mark.usefixtures("trap")
def test_a_question_that_fails_after_reaching_the_data_is_charged(gated_proxy: Endpoint, gated_database: str,
                                                                  analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        # each try is a new run of the SQL, so a new charge: never a free look; with a bound value (valid) too
        for left, (query, values) in zip(("1.5", "1", "0.5"), [(FAILS_AT_RUN_TIME, None)] * 2 + [
                (f"{FAILS_AT_RUN_TIME} where a.age > %s", [40])], strict=True):
            with pytest.raises(psycopg.errors.RaiseException, match="the data was read"):
                conn.execute(query, values)
            assert f"epsilon {left} of 2 left" in budget_left(conn)
        # the connection and the worker's pool still answer, at the price of a question
        assert conn.execute("select count(*) from adult where age > 40").fetchone()[0] > 0
        assert "epsilon 0 of 2 left" in budget_left(conn)


@pytest.mark.usefixtures("trap")
def test_an_exhausted_budget_is_refused_before_the_sql_runs(gated_proxy: Endpoint, gated_database: str,
                                                            analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        answers = [conn.execute(f"select count(*) from adult where age > {age}").fetchall() for age in range(30, 34)]
        assert "epsilon 0 of 2 left" in budget_left(conn)
        # Had the SQL run, it would have failed with P0001 (previous test); the budget error comes first.
        for query in (FAILS_AT_RUN_TIME, "select count(*) from adult where age > 50"):
            with pytest.raises(psycopg.errors.ConfigurationLimitExceeded) as caught:
                conn.execute(query)
            message = caught.value.diag.message_primary or ""
            assert f'privacy budget exhausted for role "{analyst}" on public.adult' in message
            assert "remaining epsilon 0" in message and "this query needs epsilon 0.5" in message
        # a bound value that is not a number is refused on its own, before the budget is looked at: it reads nothing
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            conn.execute(f"{FAILS_AT_RUN_TIME} where a.age > %s", ["forty"])
        # a question already paid for is still answered, from the cache, for free
        assert conn.execute("select count(*) from adult where age > 30").fetchall() == answers[0]
        assert "epsilon 0 of 2 left" in budget_left(conn)


def test_a_join_answer_is_a_new_question_after_the_linked_table_changes(gated_proxy: Endpoint, gated_database: str,
                                                                      analyst: str,  # noqa: F811
                                                                      truth: psycopg.Connection) -> None:  # noqa: F811
    truth.execute("create table public.stays (person int not null, minutes int)")
    truth.execute("insert into public.stays select id, 10 from public.adult where id % 3 = 0")
    truth.execute("select anonproxy.link_table('public.stays', 'person', 'public.adult')")
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    join = "select count(*) from adult a join stays v on v.person = a.id"
    try:
        with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
            wait_for_version(conn, version)
            first = conn.execute(join).fetchone()[0]
            assert conn.execute(join).fetchone()[0] == first, "the same question on the same data: cached"
            assert "epsilon 1.5 of 2 left" in budget_left(conn)
            truth.execute("insert into public.stays select id, 10 from public.adult where id % 3 <> 0")
            second = conn.execute(join).fetchone()[0]
            assert "epsilon 1 of 2 left" in budget_left(conn), "the linked table changed: a new, charged question"
        adults = truth.execute("select count(*) from public.adult").fetchone()[0]
        thirds = truth.execute("select count(*) from public.adult where id % 3 = 0").fetchone()[0]
        # count noise of scale 2 (ε 0.5): |error| < 2·ln(1e6) ≈ 28, while the true counts are ~20,000 apart
        assert abs(first - thirds) <= 28 and abs(second - adults) <= 28
    finally:
        truth.execute("select anonproxy.unlink_table('public.stays')")
        truth.execute("drop table public.stays")


def test_a_question_the_server_rejects_unread_costs_nothing(gated_proxy: Endpoint, gated_database: str,
                                                           analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        before = budget_left(conn)
        # PostgreSQL refuses to compare text with a number when it prepares the plan's SQL: nothing is read
        with pytest.raises(psycopg.errors.UndefinedFunction):
            conn.execute("select sex, count(*) from adult group by sex having sex > 5")
        assert budget_left(conn) == before
