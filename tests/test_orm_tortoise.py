"""Tortoise ORM (asyncpg backend) through the real gated proxy (tests/orm_tortoise.py).

Its connection start-up and what an async application asks of ``public.adult`` and the linked ``public.visits``
(counts by one and two columns, filtered by equality, range and IN; ``count()`` with ``icontains`` and ``isnull``;
``Sum``/``Avg``; top-N; ``filter`` on an annotation (HAVING); a date range; ``group_by('person__sex')`` over the
join), and what reads rows or an extreme (``Max``, ``get``, ``exists``):

- as ``dba`` (direct): the same results through the proxy as from PostgreSQL itself;
- as ``reporter`` (suppress, k = 10, a suppressed-rest row): grouped counts of people release exactly the groups
  the suppression oracle (tests/suppression_oracle.py) releases, with PostgreSQL's counts, and the rest row when it
  releases it; aggregates whose every group holds thousands of people are PostgreSQL's answer; the rest is refused
  with a hint;
- as a dp role: the same fields, counts of thousands of people within 5 % of PostgreSQL's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from orm_answers import group_key
from orm_tortoise import STEPS, Rows, Step, config, rows
from suppression_oracle import suppress
from tortoise import Tortoise, connections

from anonproxy.embedded import EmbeddedPostgres

DP_ROLE = "tortoise_analyst"
REFUSAL_STATES = ("42501", "0A000")
K = 10  # the demo reporter's
Outcome = Rows | asyncpg.PostgresError


class Aliases:
    """Tortoise initialized once on an event loop of the module, with the aliases ``truth`` (the superuser,
    direct) and each role through the proxy."""

    def __init__(self, pg_server: EmbeddedPostgres, proxy: Endpoint, dbname: str) -> None:
        credentials = {"truth": {"host": pg_server.host, "port": pg_server.port, "user": pg_server.superuser,
                                 "password": pg_server.password, "database": dbname}}
        for role in ("dba", "reporter", DP_ROLE):
            credentials[role] = {"host": proxy.host, "port": proxy.port, "user": role, "password": role,
                                 "database": dbname}
        self.loop = asyncio.Runner()  # one context for every run: Tortoise keeps its own in a context variable
        self.loop.run(Tortoise.init(config=config(credentials)))
        self.results: dict[tuple[str, str], Outcome] = {}

    def outcome(self, step: Step, alias: str) -> Outcome:
        if (step.id, alias) not in self.results:
            self.results[step.id, alias] = self.loop.run(self._run(step, alias))
        return self.results[step.id, alias]

    @staticmethod
    async def _run(step: Step, alias: str) -> Outcome:
        try:
            return rows(await step.run(connections.get(alias)))
        except Exception as error:  # Tortoise wraps asyncpg's error (OperationalError and others)
            cause = error.__cause__ if isinstance(error.__cause__, asyncpg.PostgresError) else error
            if not isinstance(cause, asyncpg.PostgresError):
                raise
            return cause

    def close(self) -> None:
        self.loop.run(Tortoise.close_connections())
        self.loop.close()


@pytest.fixture(scope="module")
def aliases(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[Aliases]:
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=1000, delta=0.5):
        opened = Aliases(pg_server, gated_proxy, gated_database)
        yield opened
        opened.close()


@pytest.fixture(scope="module")
def everyone(truth: psycopg.Connection) -> int:
    return int(truth.execute("select count(*) from adult").fetchone()[0])


def _describe(result: Outcome) -> str:
    if isinstance(result, asyncpg.PostgresError):
        return f"{result.sqlstate} {result.message} (hint: {result.hint})"
    return repr(result)[:500]


def _refused_cleanly(step: Step, result: Outcome) -> None:
    assert isinstance(result, asyncpg.PostgresError), f"answered: {_describe(result)}"
    assert result.sqlstate in REFUSAL_STATES and step.refusal in result.message, _describe(result)
    hint = (result.hint or "").lower()
    assert "allowed" in hint or "supported" in hint or "aggregate" in hint, _describe(result)


@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_direct_role_gets_what_postgresql_gives(step: Step, aliases: Aliases) -> None:
    through = aliases.outcome(step, "dba")
    if step.kind == "refused":  # a row, or whether one exists: the same from the proxy as from PostgreSQL
        assert through == aliases.outcome(step, "truth")
        return
    assert not isinstance(through, asyncpg.PostgresError), _describe(through)
    assert through == aliases.outcome(step, "truth")


@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_reporter_gets_what_suppression_releases(step: Step, aliases: Aliases, everyone: int) -> None:
    got = aliases.outcome(step, "reporter")
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, asyncpg.PostgresError), _describe(got)
    truth = aliases.outcome(step, "truth")
    assert not isinstance(truth, asyncpg.PostgresError), _describe(truth)
    if step.kind == "exact":
        assert got == truth
        return
    exact = {group_key(row, step.keys): row for row in truth}
    verdict = suppress({key: row["n"] for key, row in exact.items()}, k=K, everyone=everyone, rest=True)
    rest = [row for row in got if group_key(row, step.keys) in (None, (None,) * len(step.keys))]
    assert {group_key(row, step.keys): row for row in got if row not in rest} == \
        {key: exact[key] for key in verdict.released}
    assert len(rest) == int(verdict.rest), (got, verdict)
    if rest:
        assert rest[0]["n"] == sum(exact[key]["n"] for key in verdict.withheld)


@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_dp_role_gets_noisy_aggregates_of_the_same_shape(step: Step, aliases: Aliases) -> None:
    got = aliases.outcome(step, DP_ROLE)
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, asyncpg.PostgresError), _describe(got)
    truth = aliases.outcome(step, "truth")
    assert not isinstance(truth, asyncpg.PostgresError)
    assert got and {tuple(row) for row in got} == {tuple(truth[0])}, (got, truth)
    exact = {group_key(row, step.keys) if step.keys else (): row for row in truth}
    for row in got:
        match = exact.get(group_key(row, step.keys) if step.keys else ())
        for name in ("n", "value"):
            if step.per_person and match is not None and name in row and match[name] >= 1000:
                assert math.isclose(row[name], match[name], rel_tol=0.05), (row, match)
