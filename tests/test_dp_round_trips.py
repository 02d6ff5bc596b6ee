"""How many round trips to PostgreSQL a dp question makes, beyond its own SQL (issue 23: a first charge ≤ 2 ms).

The real ``NoisyAnswers`` against a real PostgreSQL with its ledger, in this process so that its service
connection's round trips can be counted: one round trip is one ``AsyncConnection.wait`` (psycopg sends what is
queued and waits for the server's answer). A question already paid for is one: the ledger's lookup. A new one
without parameters or post statement is three: the lookup; the charge with its check and the measurement's read
(the plan's SQL prepared, BEGIN, charge, COMMIT, then the snapshot, its data version, the SQL and its COMMIT,
pipelined: the server runs them in order and skips the rest after an error, so a rejected SQL is not charged and
the charge is durable before a row is read); the answer stored. (A wait is at most one round
trip; psycopg's own pipeline mode, which the code before used for the charge and the snapshot, waits more than once
per round trip: counted this way, a new question made 16 waits before, in 8 round trips: lookup, prepare,
describe, charge, snapshot, SQL, commit, store.) The charge's rules hold on the
pipelined path too: a statement the server rejects costs nothing, an exhausted budget reads nothing, a read that
fails after the charge stays charged.

Since migration 0041 a worker that has read the role's per-query cost does not look up a question it has not seen
answered: the lookup is made by the charge (``charge_unless_answered``), and a new question is two round trips. The
tests that empty the answer cache between two askings of one text keep the lookup (the worker saw it answered).
Since the read's COMMIT has a sync of its own, whatever fails in that round trip (the check, the charge,
``require_charged``, the SQL) leaves no transaction open: a refusal needs no ROLLBACK round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import SERVICE_ROLE, govern_by_demo_policy

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.policy.store import load_policy
from anonproxy.proxy.gate import Parameters
from anonproxy.proxy.noisy import NoisyAnswers, Refused, SessionLimits
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy

ROLE = "analyst"
COUNT = "select count(*) from adult"


@pytest.fixture
def governed(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres) -> Iterator[tuple[Policy, str]]:
    """A fresh database under the demo policy: the policy as the proxy loads it and the service login's DSN."""
    dbname = postgresql.info.dbname
    postgresql.autocommit = True
    govern_by_demo_policy(postgresql, dbname)
    yield load_policy(postgresql), pg_server.conninfo(user=SERVICE_ROLE, password=SERVICE_ROLE, dbname=dbname)


class RoundTrips:
    def __init__(self) -> None:
        self.count = 0


def _ask(policy: Policy, dsn: str, owner: psycopg.Connection, sql: str, trips: RoundTrips,
         monkeypatch: pytest.MonkeyPatch, cached: bool, settings: dict[str, str] | None = None) -> list[int]:
    """Round trips of ``sql`` asked first on a warm worker (planned, a pooled connection) with the answer cache
    emptied, then asked again (``cached``: without emptying it); ``settings``: the client's followed settings."""
    role = policy.role(ROLE)
    decision = decide(sql, role, policy)
    assert isinstance(decision, Noisy)
    wait = psycopg.AsyncConnection.wait

    async def counted(self: psycopg.AsyncConnection[Any], *args: Any, **kwargs: Any) -> Any:
        trips.count += 1
        return await wait(self, *args, **kwargs)

    async def run() -> list[int]:
        noisy = NoisyAnswers(dsn, analyser=None)
        counts = []
        try:
            await noisy.answer(decision, role, policy, Parameters(), SessionLimits(), settings=settings)  # warm
            for fresh in (True, not cached):
                if fresh:
                    owner.execute("delete from anonproxy.answer_cache where role_name = %s", [ROLE])
                trips.count = 0
                with monkeypatch.context() as patch:
                    patch.setattr(psycopg.AsyncConnection, "wait", counted)
                    await noisy.answer(decision, role, policy, Parameters(), SessionLimits(), settings=settings)
                counts.append(trips.count)
        finally:
            await noisy.close()
        return counts

    return asyncio.run(run())


async def refusal(dsn: str, decision: Noisy, role: RolePolicy, policy: Policy) -> str:
    """The SQLSTATE a question is refused with through a fresh NoisyAnswers ("" when it is answered)."""
    noisy = NoisyAnswers(dsn, analyser=None)
    try:
        await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
    except Refused as refused:
        return refused.sqlstate
    finally:
        await noisy.close()
    return ""


def test_a_new_question_makes_three_round_trips_and_a_seen_one_one(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    policy, dsn = governed
    first, seen = _ask(policy, dsn, postgresql, COUNT, RoundTrips(), monkeypatch, cached=True)
    # lookup (the worker stored this question's answer: not folded), the charge with its check and read, store
    assert (first, seen) == (3, 1)


def test_a_grouped_answer_describes_its_keys_once_per_worker(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dp answer describes its GROUP BY keys as PostgreSQL does (their table, column number and modifier: the
    keys' SQL prepared, never run); the worker asks once per text, at the first answer, so a later first answer and
    a seen one make the round trips of an answer without keys."""
    policy, dsn = governed
    first, seen = _ask(policy, dsn, postgresql, "select sex, count(*) from adult group by sex", RoundTrips(),
                       monkeypatch, cached=True)
    assert (first, seen) == (3, 1)


def test_the_clients_time_zone_costs_no_round_trip(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's TimeZone and DateStyle order are set in the read's own transaction, in the same round trip."""
    policy, dsn = governed
    settings = {"TimeZone": "America/New_York", "DateStyle": "SQL, DMY"}
    counts = _ask(policy, dsn, postgresql, COUNT, RoundTrips(), monkeypatch, cached=True, settings=settings)
    assert counts == [3, 1]


def test_a_statement_the_server_rejects_is_refused_in_the_charges_round_trip_at_no_cost(
        governed: tuple[Policy, str], postgresql: psycopg.Connection) -> None:
    """The plan's SQL, prepared first in the charge's round trip, names a column renamed since the policy was read:
    PostgreSQL rejects it (42703) and skips the charge and the read that follow it."""
    policy, dsn = governed
    role = policy.role(ROLE)
    decision = decide("select avg(age) from adult", role, policy)
    assert isinstance(decision, Noisy), decision
    charges = "select count(*) from anonproxy.budget_ledger where role_name = %s"
    before = postgresql.execute(charges, [ROLE]).fetchone()
    postgresql.execute("alter table public.adult rename column age to years")

    try:
        assert asyncio.run(refusal(dsn, decision, role, policy)) == "42703"
    finally:
        postgresql.execute("alter table public.adult rename column years to age")
    assert postgresql.execute(charges, [ROLE]).fetchone() == before


def test_an_exhausted_budget_on_the_pipelined_path_reads_nothing_and_charges_nothing(
        governed: tuple[Policy, str], postgresql: psycopg.Connection) -> None:
    policy, dsn = governed
    role = policy.role(ROLE)
    postgresql.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 0.6, 0.001, null, 0.5, 0.0000001, "
                       "'basic')",
                       [ROLE])
    charges = "select count(*) from anonproxy.budget_ledger where role_name = %s"
    before = postgresql.execute(charges, [ROLE]).fetchone()

    async def run() -> tuple[int, str]:
        noisy = NoisyAnswers(dsn, analyser=None)
        try:
            answered = 0
            for sql in (COUNT, "select sex, count(*) from adult group by 1"):
                decision = decide(sql, role, policy)
                assert isinstance(decision, Noisy)
                try:
                    await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
                    answered += 1
                except Refused as refused:
                    return answered, refused.sqlstate
            return answered, ""
        finally:
            await noisy.close()

    answered, sqlstate = asyncio.run(run())
    assert (answered, sqlstate) == (1, "53400")  # the second question does not fit what is left
    after = postgresql.execute(charges, [ROLE]).fetchone()
    assert before is not None and after is not None and after[0] == before[0] + 1


def test_a_read_that_fails_after_the_pipelined_charge_stays_charged(
        governed: tuple[Policy, str], postgresql: psycopg.Connection) -> None:
    """The measurement's SQL fails when it runs: the service role lost SELECT on the table (PostgreSQL checks
    privileges when a statement runs, not when it is prepared, so the check passes). The charge, sent in the same
    round trip, committed first and stays."""
    policy, dsn = governed
    role = policy.role(ROLE)
    decision = decide(COUNT, role, policy)
    assert isinstance(decision, Noisy), decision
    charges = "select count(*) from anonproxy.budget_ledger where role_name = %s"
    before = postgresql.execute(charges, [ROLE]).fetchone()
    postgresql.execute(f"revoke select on public.adult from {SERVICE_ROLE}")

    try:
        assert asyncio.run(refusal(dsn, decision, role, policy)) == "42501"  # permission denied, raised when the rows are read
    finally:
        postgresql.execute(f"grant select on public.adult to {SERVICE_ROLE}")
    after = postgresql.execute(charges, [ROLE]).fetchone()
    assert before is not None and after is not None and after[0] == before[0] + 1


def test_a_stored_answer_does_not_wait_for_the_flush_and_a_charge_before_it_still_does(
        governed: tuple[Policy, str], pg_server: EmbeddedPostgres, postgresql: psycopg.Connection) -> None:
    """The answer cache only serves later repeats: its commit may return before the WAL flush (a lost answer costs a
    repeat a new charge). Not so in a transaction that charged before storing: the charge's commit stays durable."""
    _, dsn = governed
    store = "select anonproxy.store_answer('analyst', %s, 'v1', '\\x00'::bytea)"
    with psycopg.connect(dsn, options="-c synchronous_commit=on") as service:  # (the test server's default: off)
        service.execute(store, ["a fingerprint"])
        assert service.execute("show synchronous_commit").fetchone() == ("off",)
        service.rollback()
        service.execute("set transaction isolation level read committed")
        service.execute("select anonproxy.charge('analyst', 'public.adult', 0.5, 0, 'another fingerprint')")
        service.execute(store, ["another fingerprint"])
        assert service.execute("show synchronous_commit").fetchone() == ("on",)
        service.rollback()


AVG = "select avg(age) from adult"
CHARGES = "select count(*) from anonproxy.budget_ledger where role_name = %s"


def _charges(owner: psycopg.Connection) -> int:
    row = owner.execute(CHARGES, [ROLE]).fetchone()
    assert row is not None
    return int(row[0])


def _counted(trips: RoundTrips) -> Any:
    wait = psycopg.AsyncConnection.wait

    async def counted(self: psycopg.AsyncConnection[Any], *args: Any, **kwargs: Any) -> Any:
        trips.count += 1
        return await wait(self, *args, **kwargs)

    return counted


async def _answer(noisy: NoisyAnswers, policy: Policy, sql: str) -> Any:
    role = policy.role(ROLE)
    decision = decide(sql, role, policy)
    assert isinstance(decision, Noisy), decision
    return await noisy.answer(decision, role, policy, Parameters(), SessionLimits())


def test_a_new_question_on_a_warm_worker_makes_two_round_trips(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the worker has read the role's per-query cost, a question it has not seen answered is charged unless
    answered, with its check and read, in one round trip, then stored: no lookup of its own (sql/0041). Asked
    again, it is one lookup."""
    policy, dsn = governed
    trips = RoundTrips()

    async def run() -> list[int]:
        noisy = NoisyAnswers(dsn, analyser=None)
        counts = []
        try:
            await _answer(noisy, policy, COUNT)  # the worker reads the per-query cost
            for _ in range(2):
                trips.count = 0
                with monkeypatch.context() as patch:
                    patch.setattr(psycopg.AsyncConnection, "wait", _counted(trips))
                    await _answer(noisy, policy, AVG)
                counts.append(trips.count)
        finally:
            await noisy.close()
        return counts

    before = _charges(postgresql)
    assert asyncio.run(run()) == [2, 1]  # charge unless answered with check and read, store | lookup
    assert _charges(postgresql) == before + 2  # COUNT and AVG, once each


def test_a_question_another_worker_answered_is_not_charged_again_and_reads_nothing(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker A knows the cost but not that worker B answered the question: its charge unless answered finds the
    answer, charges nothing, the read after it stops at its first statement, and A releases B's answer."""
    policy, dsn = governed
    trips = RoundTrips()

    async def run() -> tuple[Any, Any, int]:
        first, second = NoisyAnswers(dsn, analyser=None), NoisyAnswers(dsn, analyser=None)
        try:
            await _answer(first, policy, COUNT)
            answered = await _answer(second, policy, AVG)
            charges = _charges(postgresql)
            with monkeypatch.context() as patch:
                patch.setattr(psycopg.AsyncConnection, "wait", _counted(trips))
                again = await _answer(first, policy, AVG)
            assert _charges(postgresql) == charges
            return answered, again, trips.count
        finally:
            await first.close()
            await second.close()

    answered, again, count = asyncio.run(run())
    assert again.rows == answered.rows
    assert b"answered before" in again.notices, again.notices
    assert count == 1  # the charge unless answered (not charged, read stopped, its transaction ended by its COMMIT)


def test_a_per_query_cost_changed_since_the_worker_read_it_is_charged_once_at_the_new_cost(
        governed: tuple[Policy, str], postgresql: psycopg.Connection) -> None:
    """The folded charge reads another per-query ε than the question was priced at: it charges nothing, and the
    question is priced again at the ledger's cost and charged once, at it."""
    policy, dsn = governed

    async def run() -> None:
        noisy = NoisyAnswers(dsn, analyser=None)
        try:
            await _answer(noisy, policy, COUNT)
            postgresql.execute("update anonproxy.budgets set epsilon_per_query = 0.25 where role_name = %s", [ROLE])
            await _answer(noisy, policy, AVG)
        finally:
            await noisy.close()

    async def cold() -> None:  # a worker that has read nothing looks the question up first
        noisy = NoisyAnswers(dsn, analyser=None)
        try:
            await _answer(noisy, policy, AVG)
        finally:
            await noisy.close()

    before = _charges(postgresql)
    asyncio.run(run())
    assert _charges(postgresql) == before + 2
    postgresql.execute("delete from anonproxy.answer_cache where role_name = %s", [ROLE])
    asyncio.run(cold())
    last = postgresql.execute("select epsilon, delta, rho, delta_add from anonproxy.budget_ledger "
                              "where role_name = %s order by id desc limit 2", [ROLE]).fetchall()
    assert last[0] == last[1]  # the same charge as after a lookup that read the new cost


def test_two_sessions_racing_on_a_new_question_release_one_answer(
        governed: tuple[Policy, str], postgresql: psycopg.Connection) -> None:
    """Two workers that know the cost ask the same new question at once. Each charge checks for an answer stored,
    not one being computed: both may be charged (as with a lookup before the charge), never more, and both release
    the one measurement stored first. Asked again, by either, it is not charged."""
    policy, dsn = governed

    async def run() -> tuple[Any, Any, int, int]:
        first, second = NoisyAnswers(dsn, analyser=None), NoisyAnswers(dsn, analyser=None)
        try:
            await asyncio.gather(_answer(first, policy, COUNT), _answer(second, policy, COUNT))
            before = _charges(postgresql)
            one, other = await asyncio.gather(_answer(first, policy, AVG), _answer(second, policy, AVG))
            raced = _charges(postgresql) - before
            await asyncio.gather(_answer(first, policy, AVG), _answer(second, policy, AVG))
            return one, other, raced, _charges(postgresql) - before
        finally:
            await first.close()
            await second.close()

    one, other, raced, after = asyncio.run(run())
    assert one.rows == other.rows
    assert raced in (1, 2)
    assert after == raced


def test_a_read_that_fails_after_the_charge_is_refused_in_its_one_round_trip(
        governed: tuple[Policy, str], postgresql: psycopg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement's SQL fails when it runs (the service role lost SELECT; privileges are checked when a statement
    runs, not when it is prepared): the read's COMMIT, after a sync of its own, ends the failed transaction in the
    same round trip, so the refusal takes that one round trip and no ROLLBACK. The charge stays; the pooled
    connection answers the next question."""
    policy, dsn = governed
    trips = RoundTrips()

    async def run() -> tuple[str, int, Any]:
        noisy = NoisyAnswers(dsn, analyser=None)
        try:
            await _answer(noisy, policy, COUNT)  # the worker reads the per-query cost
            postgresql.execute(f"revoke select on public.adult from {SERVICE_ROLE}")
            sqlstate = ""
            try:
                with monkeypatch.context() as patch:
                    patch.setattr(psycopg.AsyncConnection, "wait", _counted(trips))
                    await _answer(noisy, policy, AVG)
            except Refused as refused:
                sqlstate = refused.sqlstate
            finally:
                postgresql.execute(f"grant select on public.adult to {SERVICE_ROLE}")
            return sqlstate, trips.count, await _answer(noisy, policy, AVG)
        finally:
            await noisy.close()

    before = _charges(postgresql)
    sqlstate, count, again = asyncio.run(run())
    assert (sqlstate, count) == ("42501", 1)
    assert len(again.rows) == 1
    assert _charges(postgresql) == before + 3  # COUNT; AVG, which failed and stays charged; AVG asked again
