"""The privacy-budget ledger (sql/0003_ledger.sql) and its Python API, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from anonproxy.dp import ledger
from anonproxy.dp.ledger import BudgetExhausted, LedgerError, NoBudget, Remaining
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.schema import migrations

SERVICE = "anonproxy_service"
ALICE = "ledger_alice"  # budgeted roles; roles are cluster-wide, so they are created once and kept
BOB = "ledger_bob"
ADULT = "public.adult"

T = TypeVar("T")


# Fixtures and helpers ----------------------------------------------------------------


@pytest.fixture(scope="session")
def logins(pg_server: EmbeddedPostgres) -> tuple[str, ...]:
    """The service role and two analysts; each one's password is its name."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        for role in (SERVICE, ALICE, BOB):
            exists = conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone() is not None
            conn.execute(f"{'alter' if exists else 'create'} role {role} login password '{role}'")
    return SERVICE, ALICE, BOB


@pytest.fixture
def db(postgresql: psycopg.Connection[Any], logins: tuple[str, ...]) -> psycopg.Connection[Any]:
    """A superuser connection in autocommit mode to a fresh database where public.adult is protected."""
    postgresql.commit()
    postgresql.autocommit = True
    postgresql.execute("select anonproxy.protect_table('public.adult', 'id')")
    return postgresql


@pytest.fixture
def connect(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any]) -> Callable[..., psycopg.Connection[Any]]:
    """Open a connection to the test database as a login whose password is its name."""
    dbname = db.info.dbname

    def open_as(role: str, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(pg_server.conninfo(user=role, password=role, dbname=dbname), autocommit=autocommit)

    return open_as


@pytest.fixture
def service_dsn(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any]) -> str:
    return pg_server.conninfo(user=SERVICE, password=SERVICE, dbname=db.info.dbname)


def run(dsn: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], autocommit: bool = True) -> T:
    """Run ``work`` on a fresh asyncio connection."""

    async def main() -> T:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
            return await work(conn)

    return asyncio.run(main())


def sql_error(conn: psycopg.Connection[Any], query: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(query, params)
    return caught.value


def ledger_rows(db: psycopg.Connection[Any], role: str) -> int:
    row = db.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", (role,)).fetchone()
    assert row is not None
    return int(row[0])


def set_budget(db: psycopg.Connection[Any], role: str, epsilon: str, delta: str = "0", **options: str) -> None:
    named = "".join(f", {name} => %({name})s" for name in options)
    db.execute(f"select anonproxy.set_budget(%(role)s, %(domain)s, %(epsilon)s, %(delta)s{named})",
               {"role": role, "domain": ADULT, "epsilon": Decimal(epsilon), "delta": Decimal(delta), **options})


# Charging and exhaustion ------------------------------------------------------------------


def test_charges_until_exhausted_then_refuses_naming_what_remains(db: psycopg.Connection[Any],
                                                                  service_dsn: str) -> None:
    set_budget(db, ALICE, "1", "0.00001", epsilon_per_query="0.25")

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Remaining], BudgetExhausted]:
        left = [await ledger.charge(conn, ALICE, ADULT, "0.25", 0, f"q{i}") for i in range(4)]
        with pytest.raises(BudgetExhausted) as refused:
            await ledger.charge(conn, ALICE, ADULT, Decimal("0.25"), 0, "q5")
        assert conn.info.transaction_status == TransactionStatus.IDLE
        return left, refused.value

    left, refused = run(service_dsn, work)
    assert [r.epsilon for r in left] == [Decimal("0.75"), Decimal("0.50"), Decimal("0.25"), Decimal(0)]
    assert left[0] == Remaining(
        role=ALICE, domain=ADULT, epsilon=Decimal("0.75"), delta=Decimal("0.00001"),
        role_epsilon=Decimal("0.75"), role_delta=Decimal("0.00001"), shared_epsilon=None, shared_delta=None,
        epsilon_budget=Decimal(1), delta_budget=Decimal("0.00001"), refresh_period=None,
        epsilon_per_query=Decimal("0.25"), delta_per_query=None,
        accounting="basic", epsilon_spent=Decimal("0.25"), rho_spent=Decimal("0.03125"), rho_left=None,
        shared_accounting=None, shared_rho_left=None, epsilon_spent_delta=Decimal("0.25"),
    )  # fmt: skip
    # basic accounting: each charge moves ε spent by its own ε (migration 0025)
    assert [r.epsilon_spent_delta for r in left] == [Decimal("0.25")] * 4
    assert refused.sqlstate == "53400"
    assert refused.message == (f'privacy budget exhausted for role "{ALICE}" on public.adult: '
                               "remaining epsilon 0, delta 0.00001; this query needs epsilon 0.25, delta 0 "
                               "(basic accounting)")
    assert refused.detail == f'the budget of role "{ALICE}" on public.adult is epsilon 1, delta 0.00001 in total'
    assert refused.hint is not None and "cached and free" in refused.hint and "larger budget" in refused.hint
    assert refused.remaining.epsilon == 0 and refused.remaining.delta == Decimal("0.00001")
    assert ledger_rows(db, ALICE) == 4  # the refused query charged nothing


def test_arithmetic_is_exact(db: psycopg.Connection[Any], service_dsn: str) -> None:
    # With floats, 0.1 + 0.1 + 0.1 > 0.3 and the third charge would be refused.
    set_budget(db, ALICE, "0.3")

    async def work(conn: psycopg.AsyncConnection[Any]) -> list[Decimal]:
        return [(await ledger.charge(conn, ALICE, ADULT, 0.1, 0, f"q{i}")).epsilon for i in range(3)]

    assert run(service_dsn, work) == [Decimal("0.2"), Decimal("0.1"), Decimal("0.0")]


def test_delta_is_a_budget_of_its_own(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "10", "0.000002", accounting="basic")  # basic composition (the default here is zcdp)

    async def work(conn: psycopg.AsyncConnection[Any]) -> BudgetExhausted:
        await ledger.charge(conn, ALICE, ADULT, "0.1", "0.000001", "a")
        await ledger.charge(conn, ALICE, ADULT, "0.1", "0.000001", "b")
        assert (await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "pure")).epsilon == Decimal("9.7")
        with pytest.raises(BudgetExhausted) as refused:
            await ledger.charge(conn, ALICE, ADULT, "0.1", "0.000001", "c")
        return refused.value

    refused = run(service_dsn, work)
    assert "remaining epsilon 9.7, delta 0; this query needs epsilon 0.1, delta 0.000001" in refused.message


def test_a_role_without_a_budget_is_refused(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, BOB, "1")  # someone else's budget, and a shared cap, give Alice nothing
    db.execute("select anonproxy.set_shared_budget('public.adult', 5)")

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[NoBudget, NoBudget]:
        with pytest.raises(NoBudget) as charging:
            await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "q")
        with pytest.raises(NoBudget) as asking:
            await ledger.remaining(conn, ALICE, ADULT)
        return charging.value, asking.value

    charging, asking = run(service_dsn, work)
    assert charging.message == asking.message == f'role "{ALICE}" has no privacy budget on public.adult'
    assert charging.sqlstate == "42501"
    assert charging.hint == f"the policy owner gives one with: select anonproxy.set_budget('{ALICE}', 'public.adult', " \
                            "<epsilon>, <delta>)"
    assert ledger_rows(db, ALICE) == 0


def test_the_shared_cap_binds_all_roles_together(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1")
    set_budget(db, BOB, "1")
    db.execute("select anonproxy.set_shared_budget('public.adult', 1.5)")

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[Remaining, BudgetExhausted, list[Remaining]]:
        await ledger.charge(conn, ALICE, ADULT, "1", 0, "a")
        bob = await ledger.charge(conn, BOB, ADULT, "0.4", 0, "b")
        with pytest.raises(BudgetExhausted) as refused:
            await ledger.charge(conn, BOB, ADULT, "0.2", 0, "c")
        return bob, refused.value, await ledger.remaining_all(conn, BOB)

    bob, refused, listed = run(service_dsn, work)
    assert (bob.epsilon, bob.role_epsilon, bob.shared_epsilon) == (Decimal("0.1"), Decimal("0.6"), Decimal("0.1"))
    assert f'role "{BOB}" on public.adult: remaining epsilon 0.1, delta 0' in refused.message
    assert refused.detail == ("the shared budget of all roles on public.adult is epsilon 1.5, delta 0 in total, "
                              "and epsilon 0.1, delta 0 of it is left")
    # what the reading functions return is the charge's state, without what a charge moved (that is the charge's)
    assert bob.epsilon_spent_delta == Decimal("0.4")
    assert refused.remaining == listed[0] == dataclasses.replace(bob, epsilon_spent_delta=None) and len(listed) == 1
    # Dropping the cap leaves each role its own budget.
    db.execute("select anonproxy.drop_shared_budget('public.adult')")
    assert run(service_dsn, lambda conn: ledger.charge(conn, BOB, ADULT, "0.6", 0, "d")).epsilon == 0


def test_only_charges_within_the_refresh_period_count(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1", refresh_period="1 hour")
    db.execute("select anonproxy.set_shared_budget('public.adult', 3, refresh_period => '1 day')")
    # Charges as the proxy would have made them, back-dated: 3 hours ago (out of the role's
    # window, inside the cap's) and 30 minutes ago (inside both).
    db.execute("""insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint,
                                                     charged_at)
                  values (%(r)s, %(d)s, 1, 0, 0.5, 0, 'old', now() - interval '3 hours'),
                         (%(r)s, %(d)s, 0.4, 0, 0.08, 0, 'recent', now() - interval '30 minutes'),
                         (%(r)s, %(d)s, 1, 0, 0.5, 0, 'yesterday', now() - interval '25 hours')""",
               {"r": ALICE, "d": ADULT})
    left = run(service_dsn, lambda conn: ledger.remaining(conn, ALICE, ADULT))
    assert (left.epsilon, left.role_epsilon, left.shared_epsilon) == (Decimal("0.6"), Decimal("0.6"), Decimal("1.6"))
    assert left.refresh_period == "01:00:00"

    # And in real time: with a window of half a second, spent budget comes back after it.
    set_budget(db, BOB, "0.5", refresh_period="0.5 seconds")

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[BudgetExhausted, Remaining]:
        await ledger.charge(conn, BOB, ADULT, "0.5", 0, "a")
        with pytest.raises(BudgetExhausted) as refused:
            await ledger.charge(conn, BOB, ADULT, "0.5", 0, "b")
        await asyncio.sleep(0.6)
        return refused.value, await ledger.charge(conn, BOB, ADULT, "0.5", 0, "b")

    refused, later = run(service_dsn, work)
    assert refused.hint is not None and "wait" in refused.hint
    assert later.role_epsilon == 0


# Concurrency ------------------------------------------------------------------------------


async def race(dsn: str, charges: list[tuple[str, str]], epsilon: str, **costs: object) -> list[bool]:
    """One connection per (role, fingerprint), all charging ``epsilon`` (and ``costs``: rho, delta_add) at once;
    which ones succeeded."""
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in charges]
    start = asyncio.Event()

    async def one(conn: psycopg.AsyncConnection[Any], role: str, fingerprint: str) -> bool:
        await start.wait()
        try:
            await ledger.charge(conn, role, ADULT, epsilon, 0, fingerprint, **costs)
            return True
        except BudgetExhausted:
            return False

    try:
        tasks = [asyncio.create_task(one(conn, role, fp)) for conn, (role, fp) in zip(conns, charges)]
        await asyncio.sleep(0.05)
        start.set()
        return list(await asyncio.gather(*tasks))
    finally:
        for conn in conns:
            await conn.close()


def test_concurrent_sessions_of_a_role_never_overspend(db: psycopg.Connection[Any], service_dsn: str) -> None:
    # Each round the budget grows by 0.7: exactly 7 of the 20 concurrent charges of 0.1 fit.
    for round_ in range(1, 5):
        set_budget(db, ALICE, str(Decimal("0.7") * round_))
        succeeded = asyncio.run(race(service_dsn, [(ALICE, f"r{round_}q{i}") for i in range(20)], "0.1"))
        assert succeeded.count(True) == 7, (round_, succeeded)
        assert ledger_rows(db, ALICE) == 7 * round_
    row = db.execute("select sum(epsilon) from anonproxy.budget_ledger where role_name = %s", (ALICE,)).fetchone()
    assert row == (Decimal("2.8"),)


def test_concurrent_roles_never_overspend_the_shared_cap(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "5")
    set_budget(db, BOB, "5")
    for round_ in range(1, 4):
        db.execute("select anonproxy.set_shared_budget('public.adult', %s)", (Decimal("0.5") * round_,))
        charges = [(ALICE if i % 2 else BOB, f"r{round_}q{i}") for i in range(20)]
        succeeded = asyncio.run(race(service_dsn, charges, "0.1"))
        assert succeeded.count(True) == 5, (round_, succeeded)
    row = db.execute("select sum(epsilon) from anonproxy.budget_ledger").fetchone()
    assert row == (Decimal("1.5"),)


# Durability ------------------------------------------------------------------------------


def test_a_charge_is_committed_when_charge_returns(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1")

    def work(charged_before: int) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
        async def charge(conn: psycopg.AsyncConnection[Any]) -> None:
            await ledger.charge(conn, ALICE, ADULT, "0.3", 0, "q")
            # Another session sees the charge at once: it is committed, not pending.
            assert ledger_rows(db, ALICE) == charged_before + 1
            assert conn.info.transaction_status == TransactionStatus.IDLE
            # The proxy dies here, before sending the answer: the charge stays (over-count, never under-count).
        return charge

    run(service_dsn, work(0), autocommit=True)
    run(service_dsn, work(1), autocommit=False)
    left = run(service_dsn, lambda conn: ledger.remaining(conn, ALICE, ADULT))  # a new connection
    assert left.epsilon == Decimal("0.4")


def test_charge_refuses_a_connection_inside_a_transaction(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1")

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("select 1")  # not autocommit: now inside a transaction
        with pytest.raises(LedgerError, match="not inside a transaction"):
            await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "q")
        await conn.rollback()

    run(service_dsn, work, autocommit=False)
    assert ledger_rows(db, ALICE) == 0


def test_charge_needs_read_committed_and_a_durable_commit(connect: Callable[..., psycopg.Connection[Any]],
                                                          db: psycopg.Connection[Any]) -> None:
    set_budget(db, ALICE, "1")
    with connect(SERVICE) as conn:  # autocommit: the test spells out each transaction
        conn.execute("begin isolation level repeatable read")
        error = sql_error(conn, "select anonproxy.charge(%s, %s, 0.1, 0, 'q')", (ALICE, ADULT))
        assert error.sqlstate == "25000"
        assert error.diag.message_primary == ("anonproxy.charge() must run in a READ COMMITTED transaction, "
                                              "not REPEATABLE READ")
        conn.execute("rollback")
        conn.execute("set synchronous_commit = off")
        conn.execute("begin")
        conn.execute("select anonproxy.charge(%s, %s, 0.1, 0, 'q')", (ALICE, ADULT))
        assert conn.execute("show synchronous_commit").fetchone() == ("on",)  # for this transaction's commit
        conn.execute("commit")
        assert conn.execute("show synchronous_commit").fetchone() == ("off",)
    assert ledger_rows(db, ALICE) == 1


def test_the_ledger_is_append_only(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1")
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.5", 0, "q"))
    for statement in ("update anonproxy.budget_ledger set epsilon = 0", "delete from anonproxy.budget_ledger",
                      "truncate anonproxy.budget_ledger"):
        error = sql_error(db, statement)  # even for the owner (a superuser here)
        assert error.sqlstate == "42501"
        assert (error.diag.message_primary or "").startswith("the privacy-budget ledger is append-only: ")
    assert ledger_rows(db, ALICE) == 1
    # Dropping a budget keeps what was spent: a new budget starts from it.
    db.execute("select anonproxy.drop_budget(%s, 'public.adult')", (ALICE,))
    set_budget(db, ALICE, "1")
    assert run(service_dsn, lambda conn: ledger.remaining(conn, ALICE, ADULT)).epsilon == Decimal("0.5")


# The answer cache --------------------------------------------------------------------------


def test_a_repeated_query_gets_the_cached_answer_for_free(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1")
    set_budget(db, BOB, "1")

    async def cached(conn: psycopg.AsyncConnection[Any], role: str) -> bytes | None:
        return (await ledger.lookup_answer(conn, role, ADULT, [ADULT], "fp")).answer

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        version = await ledger.data_version(conn, [ADULT])
        assert version is not None and version == await ledger.data_version(conn, [ADULT])
        assert await cached(conn, ALICE) is None
        # The proxy's order: charge (committed), then compute and store the answer.
        assert (await ledger.charge(conn, ALICE, ADULT, "0.25", 0, "fp")).epsilon == Decimal("0.75")
        assert await ledger.store_answer(conn, ALICE, "fp", version, b"noisy 1") == b"noisy 1"
        for _ in range(3):  # asked again: same answer, nothing charged
            assert await cached(conn, ALICE) == b"noisy 1"
        assert (await ledger.remaining(conn, ALICE, ADULT)).epsilon == Decimal("0.75")
        # A second answer to the same question is not released: the first one is.
        assert await ledger.store_answer(conn, ALICE, "fp", version, b"noisy 2") == b"noisy 1"
        # Another role's answers are its own.
        assert await cached(conn, BOB) is None

    run(service_dsn, work)
    assert ledger_rows(db, ALICE) == 1
    assert db.execute("select count(*) from anonproxy.answer_cache").fetchone() == (1,)


def test_lookup_answer_reads_cost_version_and_answer_at_once(db: psycopg.Connection[Any], service_dsn: str) -> None:
    set_budget(db, ALICE, "1", "0.001", epsilon_per_query="0.25", delta_per_query="0.0001")
    set_budget(db, BOB, "1")  # no per-query cost: the proxy's default

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        version = await ledger.data_version(conn, [ADULT])
        empty = await ledger.lookup_answer(conn, ALICE, ADULT, [ADULT], "fp")
        assert empty == ledger.Lookup(Decimal("0.25"), Decimal("0.0001"), "basic", version, None)
        await ledger.charge(conn, ALICE, ADULT, "0.25", 0, "fp")
        await ledger.store_answer(conn, ALICE, "fp", version, b"noisy")
        assert (await ledger.lookup_answer(conn, ALICE, ADULT, [ADULT], "fp")).answer == b"noisy"
        assert (await ledger.lookup_answer(conn, ALICE, ADULT, [ADULT], None)).answer is None  # not asked
        assert (await ledger.lookup_answer(conn, ALICE, ADULT, [ADULT], "other")).answer is None
        assert await ledger.lookup_answer(conn, BOB, ADULT, [ADULT], "fp") == ledger.Lookup(None, None, "basic", version,
                                                                                            None)
        with pytest.raises(NoBudget):
            await ledger.lookup_answer(conn, "ledger_nobody", ADULT, [ADULT], "fp")
        assert conn.info.transaction_status == TransactionStatus.IDLE  # one statement: no transaction left open

    run(service_dsn, work)
    db.execute("update public.adult set age = age + 1 where id = 1")  # a new version: the answer is not for it

    async def after(conn: psycopg.AsyncConnection[Any]) -> ledger.Lookup:
        return await ledger.lookup_answer(conn, ALICE, ADULT, [ADULT], "fp")

    found = run(service_dsn, after)
    assert found.answer is None and found.data_version is not None
    assert ledger_rows(db, ALICE) == 1


def test_a_change_of_data_invalidates_the_cache(db: psycopg.Connection[Any], service_dsn: str) -> None:
    versions = []

    def version() -> str:
        found = run(service_dsn, lambda conn: ledger.data_version(conn, [ADULT]))
        assert found is not None
        versions.append(found)
        return found

    before = version()
    run(service_dsn, lambda conn: ledger.store_answer(conn, ALICE, "fp", before, b"old"))
    db.execute("update public.adult set age = age + 1 where id = 1")
    after = version()
    assert after != before
    assert db.execute("select anonproxy.cached_answer(%s, 'fp', %s)", (ALICE, after)).fetchone() == (None,)
    assert db.execute("select anonproxy.cached_answer(%s, 'fp', %s)", (ALICE, before)).fetchone() == (b"old",)
    with db.transaction():  # one more version per committed transaction, however many statements
        db.execute("delete from public.adult where id = 2")
        db.execute("delete from public.adult where id = 3")
    db.execute("begin")  # a rolled-back change is no change
    db.execute("delete from public.adult")
    db.execute("rollback")
    version()
    db.execute("truncate public.adult")
    version()
    db.execute("alter table public.adult rename column age to years")  # same rows, other answers
    version()
    assert len(set(versions)) == len(versions) == 5
    db.execute("select 1 from public.adult")  # reading changes nothing
    assert version() == versions[-1]


def test_data_version_is_unknown_unless_every_part_is_tracked(db: psycopg.Connection[Any],
                                                              service_dsn: str) -> None:
    db.execute("""
        create table public.events (person_id integer not null, year integer not null) partition by range (year);
        create table public.events_2024 partition of public.events for values from (2024) to (2025);
        create view public.adult_view as select id, age from public.adult;
    """)
    db.execute("select anonproxy.protect_table('public.events', 'person_id')")  # tracks it and its partition

    def version(*tables: str) -> str | None:
        return run(service_dsn, lambda conn: ledger.data_version(conn, list(tables)))

    first = version("public.events")
    assert first is not None
    db.execute("insert into public.events_2024 values (1, 2024)")  # straight into the partition
    second = version("public.events")
    assert second not in (None, first)
    db.execute("create table public.events_2025 partition of public.events for values from (2025) to (2026)")
    assert version("public.events") is None  # an untracked partition: nothing is cached
    db.execute("select anonproxy.track_data_version('public.events')")
    assert version("public.events") not in (None, second)
    assert version("public.events", ADULT) is not None
    assert version("public.adult_view") is None and version("public.missing") is None
    db.execute("alter table public.adult disable trigger anonproxy_data_version")
    assert version(ADULT) is None
    # Nothing is cached under an unknown version.
    assert run(service_dsn, lambda conn: ledger.store_answer(conn, ALICE, "fp", None, b"a")) == b"a"
    assert db.execute("select count(*) from anonproxy.answer_cache").fetchone() == (0,)
    error = sql_error(db, "select anonproxy.track_data_version('public.adult_view')")
    assert error.diag.message_primary == "public.adult_view is not a table: its data version cannot be tracked"


# Validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(("statement", "sqlstate", "message"), [
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 0)", "22023",
     f'epsilon for role "{ALICE}" on public.adult must be a finite number greater than 0, got 0'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 'NaN')", "22023",
     f'epsilon for role "{ALICE}" on public.adult must be a finite number greater than 0, got NaN'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 'Infinity')", "22023",
     f'epsilon for role "{ALICE}" on public.adult must be a finite number greater than 0, got Infinity'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 1)", "22023",
     f'delta for role "{ALICE}" on public.adult must be in [0, 1), got 1'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, -0.1)", "22023",
     f'delta for role "{ALICE}" on public.adult must be in [0, 1), got -0.1'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 0, '-1 day')", "22023",
     f'refresh_period for role "{ALICE}" on public.adult must be positive, got -1 days'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, epsilon_per_query => 2)", "22023",
     f'epsilon_per_query for role "{ALICE}" on public.adult must be in (0, 1], the budget\'s epsilon; got 2'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 0.001, delta_per_query => 0.01)", "22023",
     f'delta_per_query for role "{ALICE}" on public.adult must be in [0, 0.001], the budget\'s delta; got 0.01'),
    ("select anonproxy.set_budget('ghost', 'public.adult', 1)", "42704", 'role "ghost" does not exist'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.adlt', 1)", "42P01", 'relation "public.adlt" does not exist'),
    (f"select anonproxy.set_budget('{ALICE}', 'public.people', 1)", "22023", "table public.people is not protected"),
    (f"select anonproxy.set_budget('{ALICE}', 'public.stays', 1)", "22023",
     "table public.stays is a linked table; budgets belong to the protected table it links to, public.adult"),
    ("select anonproxy.set_shared_budget('public.adult', 1, 2)", "22023",
     "delta of the shared budget on public.adult must be in [0, 1), got 2"),
    (f"select anonproxy.drop_budget('{ALICE}', 'public.adult')", "42704",
     f'role "{ALICE}" has no privacy budget on public.adult'),
    ("select anonproxy.drop_shared_budget('public.adult')", "42704", "table public.adult has no shared privacy budget"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', -1, 0, 'q')", "22023",
     "epsilon of a charge must be a finite number >= 0, got -1"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', 'NaN', 0, 'q')", "22023",
     "epsilon of a charge must be a finite number >= 0, got NaN"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', 0.1, 1, 'q')", "22023",
     "delta of a charge must be in [0, 1), got 1"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', 0, 0, 'q')", "22023",
     "a charge of epsilon 0 and delta 0 charges nothing"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', 0.1, 0, '')", "22023",
     "fingerprint of a charge must have 1 to 512 bytes, got 0"),
    (f"select anonproxy.charge('{BOB}', 'public.adult', 0.1, null, 'q')", "22004",
     "role_name, domain, epsilon, delta and fingerprint of a charge must not be null"),
    ("select anonproxy.data_version('{}')", "22023", "data_version() needs at least one table, and no NULL"),
])  # fmt: skip
def test_errors_name_the_item(db: psycopg.Connection[Any], statement: str, sqlstate: str, message: str) -> None:
    db.execute("""
        create table public.people (id integer primary key);
        create table public.stays (id integer primary key, person_id integer not null);
        select anonproxy.link_table('public.stays', 'person_id', 'public.adult');
    """)
    set_budget(db, BOB, "1")
    error = sql_error(db, statement)
    assert (error.sqlstate, error.diag.message_primary) == (sqlstate, message)


def test_hints_say_what_to_do(db: psycopg.Connection[Any]) -> None:
    db.execute("create table public.people (id integer primary key)")
    error = sql_error(db, f"select anonproxy.set_budget('{ALICE}', 'public.people', 1)")
    assert error.diag.message_hint == "protect it first: select anonproxy.protect_table('public.people', <unit column>)"
    error = sql_error(db, f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 1)")
    assert error.diag.message_hint is not None and "1/n" in error.diag.message_hint


def test_budgets_are_policy(db: psycopg.Connection[Any]) -> None:
    def version() -> int:
        row = db.execute("select version from anonproxy.policy_version").fetchone()
        assert row is not None
        return int(row[0])

    before = version()
    set_budget(db, ALICE, "1", refresh_period="1 day")
    db.execute("select anonproxy.set_shared_budget('public.adult', 2)")
    assert version() == before + 2
    assert db.execute("select role_name, domain, epsilon, refresh_period::text from anonproxy.budgets").fetchall() == [
        (ALICE, ADULT, Decimal(1), "1 day")]
    set_budget(db, ALICE, "2")  # replaces
    assert db.execute("select epsilon, refresh_period from anonproxy.budgets").fetchall() == [(Decimal(2), None)]
    db.execute("select anonproxy.clear_budgets()")
    assert db.execute("select (select count(*) from anonproxy.budgets) + "
                      "(select count(*) from anonproxy.shared_budgets)").fetchone() == (0,)


# Who may do what --------------------------------------------------------------------------------


def test_an_analyst_cannot_touch_the_ledger(connect: Callable[..., psycopg.Connection[Any]],
                                            db: psycopg.Connection[Any], service_dsn: str) -> None:
    db.execute("select anonproxy.set_role_policy(%s, 'dp')", (ALICE,))
    set_budget(db, ALICE, "1")
    set_budget(db, BOB, "1")
    version = run(service_dsn, lambda conn: ledger.data_version(conn, [ADULT]))

    async def pay(conn: psycopg.AsyncConnection[Any]) -> None:
        for role, answer in ((BOB, b"bob's"), (ALICE, b"alice's")):
            await ledger.charge(conn, role, ADULT, "0.5", 0, "fp")
            await ledger.store_answer(conn, role, "fp", version, answer)

    run(service_dsn, pay)
    with connect(ALICE) as alice:
        refused = [
            ("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, fingerprint) "
             f"values ('{ALICE}', 'public.adult', -5, 0, 'refund')"),
            "select * from anonproxy.budget_ledger",
            "select * from anonproxy.answer_cache",
            "select * from anonproxy.data_changes",
            f"update anonproxy.budgets set epsilon = 100 where role_name = '{ALICE}'",
            f"select anonproxy.set_budget('{ALICE}', 'public.adult', 100)",
            f"select anonproxy.drop_budget('{ALICE}', 'public.adult')",
            "select anonproxy.set_shared_budget('public.adult', 100)",
            "select anonproxy.clear_budgets()",
            "select anonproxy.track_data_version('public.adult')",
            f"select anonproxy.charge('{BOB}', 'public.adult', 0.5, 0, 'spend bob''s budget')",
            f"select anonproxy.charge('{ALICE}', 'public.adult', 0.1, 0, 'q')",
            f"select anonproxy.remaining_budget('{BOB}', 'public.adult')",
            f"select anonproxy.cached_answer('{BOB}', 'fp', '{version}')",
            f"select anonproxy.store_answer('{ALICE}', 'fp2', '{version}', 'forged')",
            "select anonproxy.data_version(array['public.adult'])",
            f"select anonproxy.lookup_answer('{ALICE}', 'public.adult', array['public.adult'], 'fp')",
        ]
        for statement in refused:
            assert sql_error(alice, statement).sqlstate == "42501", statement
        error = sql_error(alice, f"select anonproxy.charge('{ALICE}', 'public.adult', 0.1, 0, 'q')")
        assert error.diag.message_primary == f'role "{ALICE}" may not charge a privacy budget'
        assert error.diag.message_hint == f'the proxy does this on its service connection, as role "{SERVICE}"'
        # Its own budget and its own answers it may read; the policy is public.
        row = alice.execute(f"select epsilon from anonproxy.remaining_budget('{ALICE}', 'public.adult')").fetchone()
        assert row == (Decimal("0.5"),)
        assert alice.execute(f"select anonproxy.cached_answer('{ALICE}', 'fp', '{version}')").fetchone() == (
            b"alice's",)
        assert alice.execute("select count(*) from anonproxy.budgets").fetchone() == (2,)
    assert ledger_rows(db, ALICE) == ledger_rows(db, BOB) == 1


def test_the_service_role_is_read_from_the_settings(connect: Callable[..., psycopg.Connection[Any]],
                                                    db: psycopg.Connection[Any]) -> None:
    set_budget(db, ALICE, "1")
    charge = f"select epsilon from anonproxy.charge('{ALICE}', 'public.adult', 0.1, 0, 'q')"
    with connect(SERVICE) as service:
        assert service.execute(charge).fetchone() == (Decimal("0.9"),)
        # It may charge, not configure, and not read the ledger's tables.
        assert sql_error(service, f"select anonproxy.set_budget('{ALICE}', 'public.adult', 100)").sqlstate == "42501"
        assert sql_error(service, "select * from anonproxy.budget_ledger").sqlstate == "42501"
    db.execute("select anonproxy.set_service_role(%s)", (BOB,))
    try:
        with connect(SERVICE) as old, connect(BOB) as new:
            assert sql_error(old, charge).sqlstate == "42501"
            assert new.execute(charge).fetchone() == (Decimal("0.8"),)
    finally:
        db.execute("select anonproxy.set_service_role(%s)", (SERVICE,))


def test_the_migration_tracks_tables_protected_before_it(pg_server: EmbeddedPostgres,
                                                         logins: tuple[str, ...]) -> None:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute("drop database if exists ledger_upgrade")
        conn.execute("create database ledger_upgrade")
    try:
        with psycopg.connect(pg_server.conninfo(dbname="ledger_upgrade"), autocommit=True) as conn:
            before, after = [m for m in migrations() if m.version < 3], [m for m in migrations() if m.version == 3]
            for migration in before:
                conn.execute(migration.sql.encode())
            conn.execute("create table public.people (id integer primary key)")
            conn.execute("select anonproxy.protect_table('public.people', 'id')")
            with conn.transaction():  # as anonproxy.schema.install runs it
                conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
                conn.execute(after[0].sql.encode())
            assert conn.execute("select tgenabled from pg_trigger where tgname = 'anonproxy_data_version'"
                                " and tgrelid = 'public.people'::regclass").fetchone() == ("A",)
            assert conn.execute("select anonproxy.data_version(array['public.people'])").fetchone() != (None,)
    finally:
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            conn.execute("drop database if exists ledger_upgrade")
