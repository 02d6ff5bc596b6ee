"""Each zcdp budget's ρ_max stored when it is set (sql/0031_stored_rho_max.sql, docs/ledger.md "What a charge
costs"): a charge to a zcdp budget runs no ρ_max search, the ledger's answers are those of the schema without 0031 to
the last digit, and the stored values follow every change a DBA makes to budgets and caps."""

from __future__ import annotations

import random
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from test_ledger import ALICE, BOB, db, logins  # noqa: F401  (fixtures)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, dump_policy, parse_policy
from anonproxy.schema import migrations

D = Decimal
STORED_FROM = 31
PEOPLE = "public.people"
ROLES = (ALICE, BOB)
# The columns a charge and remaining_budget return (anonproxy.budget_remaining), all of them.
REMAINING = ("role_name, domain, epsilon, delta, role_epsilon, role_delta, shared_epsilon, shared_delta, "
             "epsilon_budget, delta_budget, refresh_period, epsilon_per_query, delta_per_query, accounting, "
             "epsilon_spent, rho_spent, rho_left, shared_accounting, shared_rho_left, epsilon_spent_delta")
# Budget numbers, some equal in value but written with another scale (the conversion's digits follow the scale).
EPSILONS = ("0.5", "1", "3.25", "10", "10.0", "7.52", "40", "100", "100.00", "1000")
DELTAS = ("0.00001", "0.000010", "0.000001", "0.001", "0.0000000001", "0.2")


def _migrate(conn: psycopg.Connection[Any], which: Any) -> None:
    for migration in (m for m in migrations() if which(m.version)):
        with conn.transaction():  # as anonproxy.schema.install runs them
            conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
            conn.execute(migration.sql.encode())


@pytest.fixture
def old_and_new(pg_server: EmbeddedPostgres,
                logins: tuple[str, ...]) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:  # noqa: F811
    """Two databases with public.people protected, as their superuser (autocommit): the schema before 0031, and
    with every migration."""
    names = ("rho_max_old", "rho_max_new")
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        for name in names:
            conn.execute(f"drop database if exists {name}")
            conn.execute(f"create database {name}")
    conns = [psycopg.connect(pg_server.conninfo(dbname=name), autocommit=True) for name in names]
    try:
        for conn, which in zip(conns, (lambda v: v < STORED_FROM, lambda v: True)):
            _migrate(conn, which)
            conn.execute("create table public.people (id integer primary key)")
            conn.execute("select anonproxy.protect_table('public.people', 'id')")
        yield conns[0], conns[1]
    finally:
        for conn in conns:
            conn.close()
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            for name in names:
                conn.execute(f"drop database if exists {name}")


def _outcome(conn: psycopg.Connection[Any], statement: str, params: Any = None) -> Any:
    """Every row of ``statement`` in a READ COMMITTED transaction of its own, or its error as PostgreSQL gives it."""
    try:
        with conn.transaction():
            conn.execute("set transaction isolation level read committed")
            return conn.execute(statement, params).fetchall()
    except psycopg.Error as error:
        diag = error.diag
        return error.sqlstate, diag.message_primary, diag.message_detail, diag.message_hint


def _both(old: psycopg.Connection[Any], new: psycopg.Connection[Any], statement: str, params: Any = None) -> Any:
    """The outcome of ``statement`` in both databases, which must be the same; returns it."""
    before, after = _outcome(old, statement, params), _outcome(new, statement, params)
    assert after == before, statement
    return after


def _stored_values_are_true(new: psycopg.Connection[Any]) -> None:
    """budget_rho_max holds, for exactly the numbers of the zcdp budgets and caps, zcdp_rho_max of them."""
    stored = new.execute("select epsilon, delta, rho_max from anonproxy.budget_rho_max order by 1, 2").fetchall()
    expected = new.execute(
        "select e, d, anonproxy.zcdp_rho_max(e::numeric, d::numeric) from ("
        "select epsilon::text e, delta::text d from anonproxy.budgets where accounting = 'zcdp' union "
        "select epsilon::text, delta::text from anonproxy.shared_budgets where accounting = 'zcdp') x "
        "order by 1, 2").fetchall()
    assert stored == expected


def _random_budget_change(rng: random.Random) -> tuple[str, tuple[Any, ...]]:
    """A DBA's change: a role's budget or the cap set (numbers, accounting, refresh period), or either dropped."""
    epsilon, delta = D(rng.choice(EPSILONS)), D(rng.choice(DELTAS))
    accounting = rng.choice(("zcdp", "zcdp", "basic", None))
    period = rng.choice((None, None, "1 day"))
    kind = rng.random()
    if kind < 0.05:  # the role's charges are refused (42501) until its budget is set again
        return "select anonproxy.drop_budget(%s, 'public.people')", (rng.choice(ROLES),)
    if kind < 0.15:
        return "select anonproxy.drop_shared_budget('public.people')", ()
    if kind < 0.35:
        return ("select anonproxy.set_shared_budget('public.people', %s, %s, %s::interval, %s)",
                (epsilon, delta, period, accounting))
    if kind < 0.45:  # by hand, as the owner may: the table's own constraints still hold
        return (("update anonproxy.budgets set epsilon = %s, delta = %s, delta_per_query = null, "
                 "epsilon_per_query = null where role_name = %s"), (epsilon, delta, rng.choice(ROLES)))
    return ("select anonproxy.set_budget(%s, 'public.people', %s, %s, %s::interval, null, null, %s)",
            (rng.choice(ROLES), epsilon, delta, period, accounting))


def _random_charge(rng: random.Random, n: int) -> tuple[Any, ...]:
    """One answer's four amounts: mostly small, some with partition selection's δ, some large enough to refuse."""
    epsilon = D(rng.choice(("0.01", "0.05", "0.1", "0.25", "0.5", "1")))
    rho = epsilon * epsilon / 2 if rng.random() < 0.5 else D(rng.choice(("0.0001", "0.001", "0.005", "0.0625")))
    delta = D(rng.choice(("0", "0", "0", "0", "0", "0.00000001", "0.0000001", "0.000001")))
    delta_add = delta if rng.random() < 0.7 else D(0)
    return rng.choice(ROLES), epsilon, delta, rho, delta_add, f"q{n}"


def test_the_ledger_answers_as_before_over_generated_budgets_and_charges(
        old_and_new: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """Seeded sequences of budget changes and charges, run in the schema before 0031 and with it: every charge's
    result or refusal (message, detail, hint), every remaining budget, the ledger's rows and the auditor's views are
    the same, and the stored ρ_max stay those of the current budgets."""
    old, new = old_and_new
    rng = random.Random(31)
    for conn in (old, new):  # charges older than a day: a refresh period of a day no longer counts them
        for role in ROLES:
            conn.execute("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, "
                         "fingerprint, charged_at) values (%s, %s, 0.5, 0.000001, 0.125, 0.000001, 'old', "
                         "now() - interval '2 days')", (role, PEOPLE))
    outcomes = {"charged": 0, "refused": 0, "by the cap": 0}
    for role in ROLES:
        _both(old, new, "select anonproxy.set_budget(%s, 'public.people', 10, 0.00001, null, 0.5, null, 'zcdp')",
              (role,))
    for n in range(400):
        if rng.random() < 0.2:
            statement, params = _random_budget_change(rng)
            if isinstance(_both(old, new, statement, params), list):  # (else refused, and nothing changed)
                _stored_values_are_true(new)
            continue
        role, *amounts, fingerprint = _random_charge(rng, n)
        result = _both(old, new, f"select {REMAINING} from anonproxy.charge(%s, %s, %s, %s, %s, %s, %s)",
                       (role, PEOPLE, *amounts, fingerprint))
        outcomes["charged" if isinstance(result, list) else "refused"] += 1
        outcomes["by the cap"] += not isinstance(result, list) and (result[2] or "").startswith("the shared budget")
        if n % 10 == 0:
            for who in ROLES:
                _both(old, new, f"select {REMAINING} from anonproxy.remaining_budget(%s, %s)", (who, PEOPLE))
    for who in ROLES:
        _both(old, new, f"select {REMAINING} from anonproxy.remaining_budgets(%s)", (who,))
        _both(old, new, "select epsilon, rho, epsilon_spent from anonproxy.audit_budget_history(%s, %s)",
              (who, PEOPLE))
    _both(old, new, f"select {REMAINING} from anonproxy.audit_budgets()")
    _both(old, new, "select role_name, epsilon, delta, rho, delta_add, fingerprint, epsilon_spent_after, "
                    "epsilon_spent_delta from anonproxy.budget_ledger order by id")
    assert outcomes["charged"] > 80 and outcomes["refused"] > 20 and outcomes["by the cap"] > 5, outcomes
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
    fits = _outcome(db, "select rho_left from anonproxy.charge(%s, 'public.adult', 1, 0, %s, 0, 'all')",
                    (ALICE, rho_max))
    assert fits == [(0,)]
    refused = _outcome(db, "select anonproxy.charge(%s, 'public.adult', 1, 0, 1e-30, 0, 'more')", (ALICE,))
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
        _outcome(old, "select anonproxy.charge(%s, 'public.people', 0.5, 0.000001, 0.0625, 0.000001, 'before')",
                 (role,))
    remaining = f"select {REMAINING} from anonproxy.remaining_budget(%s, 'public.people')"
    before = [_outcome(old, remaining, (role,)) for role in ROLES]
    _migrate(old, lambda version: version >= STORED_FROM)
    _stored_values_are_true(old)
    assert old.execute("select epsilon, delta from anonproxy.budget_rho_max order by 1").fetchall() == [
        ("10", "0.00001"), ("40", "0.001")]
    assert [_outcome(old, remaining, (role,)) for role in ROLES] == before
