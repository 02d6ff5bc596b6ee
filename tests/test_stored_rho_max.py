"""Each zcdp budget's ρ_max stored when it is set (sql/0031_stored_rho_max.sql, docs/ledger.md "What a charge
costs"): a charge to a zcdp budget runs no ρ_max search, the ledger's answers are those of the schema without 0031 to
the last digit, and the stored values follow every change a DBA makes to budgets and caps."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from ledger_versions import (
    REMAINING,
    ROLES,
    migrate,
    old_and_new_databases,
    outcome,
    replay_in_both,
)
from test_ledger import ALICE, BOB, db, logins  # noqa: F401  (fixtures)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, dump_policy, parse_policy

D = Decimal
STORED_FROM = 31


@pytest.fixture
def old_and_new(pg_server: EmbeddedPostgres,
                logins: tuple[str, ...]) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:  # noqa: F811
    """Two databases with public.people protected: the schema before 0031, and with every migration."""
    with old_and_new_databases(pg_server, "rho_max", STORED_FROM) as conns:
        yield conns


def _stored_values_are_true(new: psycopg.Connection[Any]) -> None:
    """budget_rho_max holds, for exactly the numbers of the zcdp budgets and caps, zcdp_rho_max of them."""
    stored = new.execute("select epsilon, delta, rho_max from anonproxy.budget_rho_max order by 1, 2").fetchall()
    expected = new.execute(
        "select e, d, anonproxy.zcdp_rho_max(e::numeric, d::numeric) from ("
        "select epsilon::text e, delta::text d from anonproxy.budgets where accounting = 'zcdp' union "
        "select epsilon::text, delta::text from anonproxy.shared_budgets where accounting = 'zcdp') x "
        "order by 1, 2").fetchall()
    assert stored == expected


def test_the_ledger_answers_as_before_over_generated_budgets_and_charges(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """Seeded sequences of budget changes and charges, run in the schema before 0031 and with it: every charge's
    result or refusal (message, detail, hint), every remaining budget, the ledger's rows and the auditor's views are
    the same, and the stored ρ_max stay those of the current budgets."""
    old, new = old_and_new
    replayed = replay_in_both(old, new, seed=31, after_change=_stored_values_are_true)
    by_the_cap = [result for result in replayed.refused if (result[2] or "").startswith("the shared budget")]
    assert replayed.charged > 80 and len(replayed.refused) > 20 and len(by_the_cap) > 5
    # What charges stored at the δ left after them is as true as what budgets stored.
    stored, wrong = new.execute("select count(*), count(*) filter (where rho_max <> anonproxy.zcdp_rho_max("
                                "epsilon::numeric, delta::numeric)) from anonproxy.budget_rho_max").fetchone()
    assert stored >= 1 and wrong == 0


def _calls_during_charge(conn: psycopg.Connection[Any], role: str, rho: str, delta_add: str) -> dict[str, int]:
    """How many times each conversion function ran during one charge (PostgreSQL's own function statistics)."""
    counts = ("select funcname, calls from pg_stat_xact_user_functions "
              "where schemaname = 'anonproxy' and funcname in ('zcdp_rho_max', 'zcdp_epsilon')")
    with conn.transaction():
        conn.execute("set transaction isolation level read committed")
        conn.execute("set local track_functions = 'pl'")
        before = dict(conn.execute(counts).fetchall())  # (counts not yet flushed from earlier transactions)
        conn.execute("select anonproxy.charge(%s, 'public.people', 0.1, %s, %s, %s, 'calls')",
                     (role, delta_add, rho, delta_add))
        after = dict(conn.execute(counts).fetchall())
    return {name: calls - before.get(name, 0) for name, calls in after.items() if calls > before.get(name, 0)}


def test_a_charge_to_a_zcdp_budget_searches_for_no_rho_max(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """Before 0031 a charge to a zcdp budget searched for ρ_max three times (whether it fits, ε spent before it,
    what is left after it) and converted its sum of ρ three times; now it reads the stored ρ_max, and converts
    twice (before and after it). A charge that spends partition selection's δ searches once."""
    old, new = old_and_new
    for conn in (old, new):
        conn.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5, null, 'zcdp')")
    assert _calls_during_charge(old, ALICE, "0.005", "0") == {"zcdp_rho_max": 3, "zcdp_epsilon": 3}
    # ε spent before and after the charge: the conversion of a sum of ρ, which changes with every charge
    assert _calls_during_charge(new, ALICE, "0.005", "0") == {"zcdp_epsilon": 2}
    # Spending δ moves the δ left: one search, at the δ left after the charge, where the next charge starts.
    assert _calls_during_charge(new, ALICE, "0.005", "0.000001") == {"zcdp_rho_max": 1, "zcdp_epsilon": 2}
    assert _calls_during_charge(new, ALICE, "0.005", "0") == {"zcdp_epsilon": 2}
    assert _calls_during_charge(old, ALICE, "0.005", "0.000001") == {"zcdp_rho_max": 3, "zcdp_epsilon": 3}
    assert new.execute("select count(*) from anonproxy.budget_rho_max").fetchone() == (2,)  # the budget's, a δ left
    new.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5, null, 'zcdp')")
    _stored_values_are_true(new)  # a change of budget drops the pairs the charges stored


def test_the_stored_values_follow_the_policy_file(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    """`policy apply` sets budgets and caps: the stored ρ_max follow each version, and a charge fits exactly up to
    the ρ_max of the budget now in force, not of an earlier one."""
    text = ("tables: {public.adult: {unit: id, shared_budget: {epsilon: 40, delta: 0.001, accounting: zcdp}}}\n"
            f"roles: {{{ALICE}: {{mode: dp, budgets: {{public.adult: "
            "{epsilon: 10, delta: 0.00001, epsilon_per_query: 0.5, accounting: zcdp}}}}\n")
    apply_policy(db, parse_policy(text))
    _stored_values_are_true(db)
    assert db.execute("select count(*) from anonproxy.budget_rho_max").fetchone() == (2,)
    changed = dump_policy(parse_policy(text)).replace("epsilon: 10", "epsilon: 12")
    apply_policy(db, parse_policy(changed))
    _stored_values_are_true(db)
    rho_max = db.execute("select anonproxy.zcdp_rho_max(12, 0.00001)").fetchone()[0]
    assert rho_max > db.execute("select anonproxy.zcdp_rho_max(10, 0.00001)").fetchone()[0]
    fits = outcome(db, "select rho_left from anonproxy.charge(%s, 'public.adult', 1, 0, %s, 0, 'all')",
                    (ALICE, rho_max))
    assert fits == [(0,)]
    refused = outcome(db, "select anonproxy.charge(%s, 'public.adult', 1, 0, 1e-30, 0, 'more')", (ALICE,))
    assert refused[0] == "53400"
    apply_policy(db, parse_policy("tables: {public.adult: {unit: id}}\n"))  # no budget left: nothing stored
    assert db.execute("select count(*) from anonproxy.budget_rho_max").fetchone() == (0,)


def test_a_failed_budget_change_leaves_the_stored_values_as_they_were(
        db: psycopg.Connection[Any]) -> None:  # noqa: F811
    """A change refused midway (here by the table's own constraint) rolls back with the stored values."""
    db.execute(f"select anonproxy.set_budget('{ALICE}', 'public.adult', 10, 0.00001, accounting => 'zcdp')")
    before = db.execute("select * from anonproxy.budget_rho_max").fetchall()
    with pytest.raises(psycopg.errors.CheckViolation), db.transaction():
        db.execute(f"select anonproxy.set_budget('{BOB}', 'public.adult', 3, 0.0001, accounting => 'zcdp')")
        db.execute("update anonproxy.budgets set delta = 1 where role_name = %s", (ALICE,))
    assert db.execute("select * from anonproxy.budget_rho_max").fetchall() == before
    _stored_values_are_true(db)


def test_the_upgrade_stores_the_budgets_already_set(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """Applying 0031 to a database with budgets, a cap and charges stores their ρ_max, and changes no figure."""
    old, _ = old_and_new
    old.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5, null, 'zcdp')")
    old.execute(f"select anonproxy.set_budget('{BOB}', 'public.people', 3.0, 0.0001, null, null, null, 'basic')")
    old.execute("select anonproxy.set_shared_budget('public.people', 40, 0.001, null, 'zcdp')")
    for role in ROLES:
        outcome(old, "select anonproxy.charge(%s, 'public.people', 0.5, 0.000001, 0.0625, 0.000001, 'before')",
                 (role,))
    remaining = f"select {REMAINING} from anonproxy.remaining_budget(%s, 'public.people')"
    before = [outcome(old, remaining, (role,)) for role in ROLES]
    migrate(old, lambda version: version >= STORED_FROM)
    _stored_values_are_true(old)
    assert old.execute("select epsilon, delta from anonproxy.budget_rho_max order by 1").fetchall() == [
        ("10", "0.00001"), ("40", "0.001")]
    assert [outcome(old, remaining, (role,)) for role in ROLES] == before
