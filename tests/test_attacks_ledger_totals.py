"""Red team of the ledger's running totals (sql/0035_running_totals.sql, docs/ledger.md "Running totals"): a role's
spending on a budget without a refresh period is read from anonproxy.budget_totals, kept by a trigger on the
append-only ledger. Every attack tries to lower a total -- or to make totals and ledger disagree -- as the roles
that exist in production: the service login the proxy charges with, an analyst (a budgeted role), and the owner of
the schema (a superuser here). Each asserts the safe outcome: refused, and the spending unchanged."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from test_ledger import (  # noqa: F401  (fixtures)
    ADULT,
    ALICE,
    BOB,
    SERVICE,
    connect,
    db,
    logins,
    run,
    service_dsn,
    set_budget,
    sql_error,
)

from anonproxy.dp import ledger

SUMS = ("select l.role_name, l.domain, sum(l.epsilon), sum(l.delta), sum(l.rho), sum(l.delta_add), count(*) "
        "from anonproxy.budget_ledger l group by 1, 2 order by 1, 2")
TOTALS = ("select t.role_name, t.domain, t.epsilon, t.delta, t.rho, t.delta_add, t.charges "
          "from anonproxy.budget_totals t order by 1, 2")
LOWER = ("delete from anonproxy.budget_totals", "truncate anonproxy.budget_totals",
         "update anonproxy.budget_totals set epsilon = 0", "update anonproxy.budget_totals set rho = rho - 1",
         "update anonproxy.budget_totals set charges = charges + 1, epsilon = epsilon - 0.25",
         "update anonproxy.budget_totals set domain = 'public.adult2'",
         (f"insert into anonproxy.budget_totals values ('{ALICE}', '{ADULT}', -1, 0, -1, 0, 1) "
          "on conflict (role_name, domain) do update set epsilon = excluded.epsilon"),
         # a role that has not been charged yet: a row of negative amounts would be a larger budget
         f"insert into anonproxy.budget_totals values ('{BOB}', '{ADULT}', -1, 0, -1, 0, 1)")


def _left(service_dsn: str) -> Decimal:  # noqa: F811
    """The epsilon left of ALICE's budget of 1."""
    return run(service_dsn, lambda conn: ledger.remaining(conn, ALICE, ADULT)).epsilon


def _consistent(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    assert db.execute(TOTALS).fetchall() == db.execute(SUMS).fetchall()


@pytest.mark.parametrize("role", [SERVICE, ALICE])
def test_no_login_but_the_owner_reads_or_writes_the_totals_or_the_ledger(
        db: psycopg.Connection[Any], service_dsn: str, connect: Callable[..., psycopg.Connection[Any]],  # noqa: F811
        role: str) -> None:
    """The service login charges through anonproxy.charge() only, an analyst not at all: neither may read or write
    the totals, insert a row into the ledger (which the trigger would add to the totals), or charge directly."""
    set_budget(db, ALICE, "1")
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.5", 0, "q"))
    attempts = [*LOWER, "select * from anonproxy.budget_totals",
                ("insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint,"
                 f" charged_at) values ('{ALICE}', '{ADULT}', 0, 0, 0, 0, 'x', now())"),
                "select anonproxy.add_to_totals()"]
    with connect(role) as conn:
        for statement in attempts:
            assert sql_error(conn, statement).sqlstate == "42501", statement
        if role == ALICE:
            error = sql_error(conn, "select anonproxy.charge(%s, %s, 0.1, 0, 0.005, 0, 'q')", (ALICE, ADULT))
            assert error.sqlstate == "42501"
    assert _left(service_dsn) == Decimal("0.5")
    _consistent(db)


@pytest.mark.parametrize("statement", LOWER)
def test_the_owner_cannot_lower_a_total(db: psycopg.Connection[Any], service_dsn: str,  # noqa: F811
                                        statement: str) -> None:
    """The ledger refuses UPDATE, DELETE and TRUNCATE even to its owner, so that an answer once paid for stays paid
    for. Since spending is read from the totals, a total lowered, deleted or moved to another domain would give the
    budget back: refused to the owner too (sql/0039)."""
    set_budget(db, ALICE, "1")
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.5", 0, "q"))
    error = sql_error(db, statement)
    assert error.sqlstate == "42501", statement
    assert (error.diag.message_primary or "").startswith("the privacy-budget totals only grow with the ledger: ")
    assert _left(service_dsn) == Decimal("0.5")
    _consistent(db)
    # The charges still add up.
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.25", 0, "r"))
    assert _left(service_dsn) == Decimal("0.25")
    _consistent(db)


def test_dropping_and_setting_a_budget_keeps_totals_and_ledger_together(db: psycopg.Connection[Any],  # noqa: F811
                                                                       service_dsn: str) -> None:  # noqa: F811
    """drop_budget and set_budget never touch the totals: a budget dropped and set again, with a refresh period
    and without, starts from what was spent, and the totals stay the ledger's sums."""
    set_budget(db, ALICE, "1")
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.5", 0, "q"))
    db.execute("select anonproxy.drop_budget(%s, %s)", (ALICE, ADULT))
    set_budget(db, ALICE, "1", refresh_period="1 day")
    assert _left(service_dsn) == Decimal("0.5")  # charged within the period
    run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.25", 0, "r"))
    db.execute("select anonproxy.drop_budget(%s, %s)", (ALICE, ADULT))
    set_budget(db, ALICE, "1")
    assert _left(service_dsn) == Decimal("0.25")
    _consistent(db)
    with pytest.raises(ledger.BudgetExhausted):
        run(service_dsn, lambda conn: ledger.charge(conn, ALICE, ADULT, "0.5", 0, "s"))
    _consistent(db)
