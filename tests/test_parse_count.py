"""One sqlglot parse and one pglast parse per statement on first sight, in both modes and whatever the role's cost.

What the proxy does with a statement it has not seen, run in this process so that every parse can be counted:
``decide()`` (the router's one sqlglot parse; a suppress rewrite's final SQL check is PostgreSQL's parser, pglast,
once), then for dp the real ``NoisyAnswers`` against a real PostgreSQL with its ledger — for the simple protocol
the answer, for the extended one (Parse, Bind, Describe, Execute) the description and then the answer — with no
analysis process (``analyser=None``: the steps it would run, run here). A dp role whose per-query ε is not the
proxy's default is priced at the default first (the worker has not read its cost yet) and again once the ledger's
lookup says otherwise: the same measurement priced again, and the same SQL not checked again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from conftest import SERVICE_ROLE, govern_by_demo_policy
from sqlglot.parser import Parser

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan import final_sql
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.proxy.gate import Parameters
from anonproxy.proxy.noisy import NoisyAnswers, SessionLimits
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

OWN_COST_ROLE = "parses_own_cost"
STATEMENTS = {
    "flat": "select education, count(*) from adult where age > 30 group by education order by 2 desc",
    "power bi": 'select "_"."education", count(*) as "a0" from (select "_"."education" from "public"."adult" "_" '
                'where "_"."age" > 30) "_" group by "_"."education"',
    "avg": "select sex, avg(age), sum(hours_per_week) from adult group by sex",
}


class Counts:
    def __init__(self) -> None:
        self.sqlglot = self.pglast = 0


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Count sqlglot's Parser.parse (every entry point goes through it) and pglast's parse in the final SQL check."""
    counts = Counts()
    parse, pglast_parse = Parser.parse, final_sql.parse_sql_json

    def sqlglot_counted(self: Parser, *args: Any, **kwargs: Any) -> Any:
        counts.sqlglot += 1
        return parse(self, *args, **kwargs)

    def pglast_counted(sql: str) -> Any:
        counts.pglast += 1
        return pglast_parse(sql)

    with monkeypatch.context() as patch:
        patch.setattr(Parser, "parse", sqlglot_counted)
        patch.setattr(final_sql, "parse_sql_json", pglast_counted)
        yield counts


@pytest.fixture
def governed(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres) -> Iterator[tuple[Policy, str]]:
    """A fresh database under the demo policy, with a dp role whose per-query cost is ε 1, δ 1e-6 (the proxy's
    default is 0.5, 1e-7); the policy as the proxy loads it and the service login's connection string."""
    dbname = postgresql.info.dbname
    postgresql.autocommit = True
    govern_by_demo_policy(postgresql, dbname)
    postgresql.execute(f"drop role if exists {OWN_COST_ROLE}")
    postgresql.execute(f"create role {OWN_COST_ROLE} login")
    postgresql.execute("select anonproxy.set_role_policy(%s, 'dp')", [OWN_COST_ROLE])
    postgresql.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 100, 0.001, null, 1, 0.000001)",
                       [OWN_COST_ROLE])
    try:
        yield load_policy(postgresql), pg_server.conninfo(user=SERVICE_ROLE, password=SERVICE_ROLE, dbname=dbname)
    finally:
        postgresql.execute("select anonproxy.drop_budget(%s, 'public.adult')", [OWN_COST_ROLE])
        postgresql.execute("select anonproxy.drop_role_policy(%s)", [OWN_COST_ROLE])
        postgresql.execute(f"drop owned by {OWN_COST_ROLE}")
        postgresql.execute(f"drop role {OWN_COST_ROLE}")


def _first_sight(policy: Policy, dsn: str, role_name: str, sql: str, extended: bool) -> Callable[[], None]:
    """What the proxy does on first sight of ``sql`` for ``role_name``, in a new worker (nothing cached)."""
    role = policy.role(role_name)

    def run() -> None:
        decision = decide(sql, role, policy)
        if role.mode != "dp":
            assert isinstance(decision, Rewrite), decision
            return
        assert isinstance(decision, Noisy), decision

        async def ask() -> None:
            noisy = NoisyAnswers(dsn, analyser=None)
            try:
                if extended:  # Parse, Bind, Describe, Execute: described first, then answered
                    await noisy.describe(decision, role, policy, Parameters(), SessionLimits())
                result = await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
                assert result.rows, result
            finally:
                await noisy.close()

        asyncio.run(ask())

    return run


@pytest.mark.parametrize("extended", [False, True], ids=["query", "parse-bind"])
@pytest.mark.parametrize("role", ["reporter", "analyst", OWN_COST_ROLE])
@pytest.mark.parametrize("shape", list(STATEMENTS))
def test_one_sqlglot_and_one_pglast_parse_per_first_sight_statement(
        governed: tuple[Policy, str], monkeypatch: pytest.MonkeyPatch, role: str, shape: str, extended: bool) -> None:
    policy, dsn = governed
    assert policy.role("reporter").mode == "suppress" and policy.role("analyst").mode == "dp"
    run = _first_sight(policy, dsn, role, f"/* {role} {shape} {extended} */ {STATEMENTS[shape]}", extended)
    with counting(monkeypatch) as counts:
        run()
    assert (counts.sqlglot, counts.pglast) == (1, 1)
