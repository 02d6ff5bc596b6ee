"""The ledger's answers compared across two versions of the schema: two databases, one migrated up to a version and
one with every migration, the same seeded budget changes and charges run in both, and every outcome compared.

Shared by the tests of migrations that must not change what the ledger answers (tests/test_stored_rho_max.py for
0031, tests/test_ledger_totals.py for 0035).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg
from test_ledger import ALICE, BOB

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.schema import migrations

Connection = psycopg.Connection[Any]

PEOPLE = "public.people"
ROLES = (ALICE, BOB)
# The columns a charge and remaining_budget return (anonproxy.budget_remaining), all of them.
REMAINING = ("role_name, domain, epsilon, delta, role_epsilon, role_delta, shared_epsilon, shared_delta, "
             "epsilon_budget, delta_budget, refresh_period, epsilon_per_query, delta_per_query, accounting, "
             "epsilon_spent, rho_spent, rho_left, shared_accounting, shared_rho_left, epsilon_spent_delta")
# Budget numbers, some equal in value but written with another scale (the conversion's digits follow the scale).
EPSILONS = ("0.5", "1", "3.25", "10", "10.0", "7.52", "40", "100", "100.00", "1000")
DELTAS = ("0.00001", "0.000010", "0.000001", "0.001", "0.0000000001", "0.2")


def migrate(conn: Connection, which: Callable[[int], bool]) -> None:
    """Run the migrations whose version ``which`` accepts, as anonproxy.schema.install runs them."""
    for migration in (m for m in migrations() if which(m.version)):
        with conn.transaction():
            conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
            conn.execute(migration.sql.encode())


@contextmanager
def old_and_new_databases(pg_server: EmbeddedPostgres, prefix: str,
                          first_new: int) -> Iterator[tuple[Connection, Connection]]:
    """Two databases with public.people protected, as their superuser (autocommit): the schema before migration
    ``first_new``, and with every migration; dropped afterwards."""
    names = (f"{prefix}_old", f"{prefix}_new")
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        for name in names:
            conn.execute(f"drop database if exists {name}")
            conn.execute(f"create database {name}")
    conns = [psycopg.connect(pg_server.conninfo(dbname=name), autocommit=True) for name in names]
    try:
        for conn, which in zip(conns, (lambda v: v < first_new, lambda v: True), strict=True):
            migrate(conn, which)
            conn.execute("create table public.people (id integer primary key)")
            conn.execute("select anonproxy.protect_table('public.people', 'id')")
        yield conns[0], conns[1]
    finally:
        for conn in conns:
            conn.close()
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            for name in names:
                conn.execute(f"drop database if exists {name}")


def outcome(conn: Connection, statement: str, params: Any = None) -> Any:
    """Every row of ``statement`` in a READ COMMITTED transaction of its own, or its error as PostgreSQL gives it."""
    try:
        with conn.transaction():
            conn.execute("set transaction isolation level read committed")
            return conn.execute(statement, params).fetchall()
    except psycopg.Error as error:
        diag = error.diag
        return error.sqlstate, diag.message_primary, diag.message_detail, diag.message_hint


def both(old: Connection, new: Connection, statement: str, params: Any = None) -> Any:
    """The outcome of ``statement`` in both databases, which must be the same; returns it."""
    before, after = outcome(old, statement, params), outcome(new, statement, params)
    assert after == before, statement
    return after


def random_budget_change(rng: random.Random) -> tuple[str, tuple[Any, ...]]:
    """A DBA's change: a role's budget or the cap set (numbers, accounting, refresh period), or either dropped."""
    epsilon, delta = Decimal(rng.choice(EPSILONS)), Decimal(rng.choice(DELTAS))
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


def random_charge(rng: random.Random, n: int) -> tuple[Any, ...]:
    """One answer's four amounts: mostly small, some with partition selection's δ, some large enough to refuse."""
    epsilon = Decimal(rng.choice(("0.01", "0.05", "0.1", "0.25", "0.5", "1")))
    rho = (epsilon * epsilon / 2 if rng.random() < 0.5
           else Decimal(rng.choice(("0.0001", "0.001", "0.005", "0.0625"))))
    delta = Decimal(rng.choice(("0", "0", "0", "0", "0", "0.00000001", "0.0000001", "0.000001")))
    delta_add = delta if rng.random() < 0.7 else Decimal(0)
    return rng.choice(ROLES), epsilon, delta, rho, delta_add, f"q{n}"


@dataclass
class Replayed:
    """What a seeded sequence did: each charge's outcome (rows when charged, the error's fields when refused)."""

    charges: list[Any] = field(default_factory=list)

    @property
    def charged(self) -> int:
        return sum(isinstance(result, list) for result in self.charges)

    @property
    def refused(self) -> list[Any]:
        return [result for result in self.charges if not isinstance(result, list)]


def replay_in_both(old: Connection, new: Connection, seed: int,
                   after_change: Callable[[Connection], None] | None = None) -> Replayed:
    """400 seeded steps in both databases, outcomes compared at each: budget changes (one in five) and charges,
    over two roles with budgets and charges older than a day; then every remaining budget, the auditor's views and
    the ledger's rows compared. ``after_change`` runs on the new database after each budget change that succeeded."""
    rng = random.Random(seed)
    for conn in (old, new):  # charges older than a day: a refresh period of a day no longer counts them
        for role in ROLES:
            conn.execute("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, "
                         "fingerprint, charged_at) values (%s, %s, 0.5, 0.000001, 0.125, 0.000001, 'old', "
                         "now() - interval '2 days')", (role, PEOPLE))
    for role in ROLES:
        both(old, new, "select anonproxy.set_budget(%s, 'public.people', 10, 0.00001, null, 0.5, null, 'zcdp')",
             (role,))
    replayed = Replayed()
    for n in range(400):
        if rng.random() < 0.2:
            if isinstance(both(old, new, *random_budget_change(rng)), list) and after_change is not None:
                after_change(new)  # (a refused change changed nothing)
            continue
        role, *amounts, fingerprint = random_charge(rng, n)
        replayed.charges.append(both(old, new, f"select {REMAINING} from anonproxy.charge(%s, %s, %s, %s, %s, %s, %s)",
                                     (role, PEOPLE, *amounts, fingerprint)))
        if n % 10 == 0:
            for who in ROLES:
                both(old, new, f"select {REMAINING} from anonproxy.remaining_budget(%s, %s)", (who, PEOPLE))
    for who in ROLES:
        both(old, new, f"select {REMAINING} from anonproxy.remaining_budgets(%s)", (who,))
        both(old, new, "select epsilon, rho, epsilon_spent from anonproxy.audit_budget_history(%s, %s)",
             (who, PEOPLE))
    both(old, new, f"select {REMAINING} from anonproxy.audit_budgets()")
    both(old, new, "select role_name, epsilon, delta, rho, delta_add, fingerprint, epsilon_spent_after, "
                   "epsilon_spent_delta from anonproxy.budget_ledger order by id")
    return replayed
