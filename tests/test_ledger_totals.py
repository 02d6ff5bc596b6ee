"""Each role's running totals kept beside its charges (sql/0035_running_totals.sql, docs/ledger.md "What a charge
costs"): a charge to a budget without a refresh period reads no row of the ledger, the totals are the ledger's sums
after concurrent charges, refused ones and rolled-back ones, and every answer of the ledger is the one of the schema
before 0035, to the last digit."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from ledger_versions import (
    PEOPLE,
    migrate,
    old_and_new_databases,
    replay_in_both,
)
from test_ledger import ALICE, BOB, db, logins  # noqa: F401  (fixtures)

from anonproxy.embedded import EmbeddedPostgres

TOTALS_FROM = 35
SUMS = ("select l.role_name, l.domain, sum(l.epsilon)::text, sum(l.delta)::text, sum(l.rho)::text, "
        "sum(l.delta_add)::text, count(*) from anonproxy.budget_ledger l group by 1, 2 order by 1, 2")
TOTALS = ("select t.role_name, t.domain, t.epsilon::text, t.delta::text, t.rho::text, t.delta_add::text, t.charges "
          "from anonproxy.budget_totals t order by 1, 2")
CHARGE = "select anonproxy.charge(%s, %s, %s, %s, %s, %s, %s)"


@pytest.fixture
def old_and_new(pg_server: EmbeddedPostgres,
                logins: tuple[str, ...]) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:  # noqa: F811
    """Two databases with public.people protected: the schema before 0035, and with every migration."""
    with old_and_new_databases(pg_server, "totals", TOTALS_FROM) as conns:
        yield conns


def _charged(conn: psycopg.Connection[Any], *amounts: Any) -> bool:
    """One charge in a READ COMMITTED transaction of its own: True when charged, False when the ledger refused it."""
    try:
        with conn.transaction():
            conn.execute("set transaction isolation level read committed")
            conn.execute(CHARGE, amounts)
        return True
    except psycopg.errors.ConfigurationLimitExceeded:
        return False


def test_a_charge_to_a_budget_without_a_refresh_period_reads_no_row_of_the_ledger(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    """What the role spent is read from its totals, not summed over its charges: the cost of a charge does not grow
    with the ledger. With a refresh period only that period's charges count, and they are summed as before."""
    scans = ("select seq_scan + coalesce(idx_scan, 0) from pg_stat_xact_user_tables "
             "where relid = 'anonproxy.budget_ledger'::regclass")
    for period in (None, "1 day"):
        db.execute("select anonproxy.set_budget(%s, 'public.adult', 100, 0.00001, %s::interval, null, null, 'zcdp')",
                   (ALICE, period))
        for n in range(3):
            assert _charged(db, ALICE, "public.adult", "0.1", "0", "0.005", "0", f"q{n}")
        with db.transaction():
            db.execute("set transaction isolation level read committed")
            db.execute(CHARGE, (ALICE, "public.adult", "0.1", "0", "0.005", "0", "counted"))
            read = db.execute(scans).fetchone()
        assert read is not None and (read[0] == 0) == (period is None), (period, read)


def test_the_totals_are_the_ledgers_sums_after_concurrent_refused_and_rolled_back_charges(
        pg_server: EmbeddedPostgres, db: psycopg.Connection[Any]) -> None:  # noqa: F811
    """Four sessions charge two roles at once until one role's budget refuses; a charge rolled back after it ran
    adds nothing. The totals hold every committed charge's amounts, exactly (as text: value and scale)."""
    db.execute("select anonproxy.set_budget(%s, 'public.adult', 3, 0.0001, null, null, null, 'basic')", (ALICE,))
    db.execute("select anonproxy.set_budget(%s, 'public.adult', 1000, 0.0001, null, null, null, 'zcdp')", (BOB,))
    outcomes: list[bool] = []
    failures: list[BaseException] = []

    def session(number: int) -> None:
        rng = random.Random(number)
        try:
            with psycopg.connect(pg_server.conninfo(dbname=db.info.dbname), autocommit=True) as conn:
                for n in range(30):
                    epsilon = Decimal(rng.choice(("0.05", "0.1", "0.125", "0.25")))
                    delta = Decimal(rng.choice(("0", "0", "0.000001", "0.0000010")))
                    outcomes.append(_charged(conn, ALICE if n % 2 else BOB, "public.adult", epsilon, delta,
                                             epsilon * epsilon / 2, delta, f"s{number}q{n}"))
        except BaseException as exc:  # noqa: BLE001  (reported by the test's thread)
            failures.append(exc)

    threads = [threading.Thread(target=session, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert outcomes.count(False) > 0 and outcomes.count(True) > 60  # ALICE's budget of ε 3 ran out
    with db.transaction():
        db.execute("set transaction isolation level read committed")
        db.execute(CHARGE, (BOB, "public.adult", "0.5", "0", "0.125", "0", "rolled back"))
        raise psycopg.Rollback()
    assert db.execute(TOTALS).fetchall() == db.execute(SUMS).fetchall()
    alice = db.execute("select epsilon from anonproxy.budget_totals where role_name = %s", (ALICE,)).fetchone()
    assert alice is not None and alice[0] <= 3


def test_the_ledger_answers_as_before_over_generated_budgets_and_charges(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """Seeded sequences of budget changes (refresh periods, caps, budgets dropped and set again) and charges, in the
    schema before 0035 and with it: every charge's result or refusal, every remaining budget, the auditor's views
    and the ledger's rows are the same, and the totals are the ledger's sums."""
    old, new = old_and_new
    assert replay_in_both(old, new, seed=35).charged > 60
    assert new.execute(TOTALS).fetchall() == new.execute(SUMS).fetchall()


def test_the_upgrade_counts_the_charges_already_made(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """A ledger with charges before 0035: the migration sums them once, and the next charge counts them."""
    old, _ = old_and_new
    old.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5, null, 'basic')")
    for n in range(5):
        assert _charged(old, ALICE, PEOPLE, "0.25", "0", "0.03125", "0", f"before {n}")
    migrate(old, lambda version: version >= TOTALS_FROM)
    assert old.execute(TOTALS).fetchall() == old.execute(SUMS).fetchall() != []
    row = old.execute(f"select epsilon_spent from anonproxy.charge('{ALICE}', 'public.people', 0.25, 0, 0.03125, 0, "
                      "'after')").fetchone()
    assert row == (Decimal("1.50"),)
