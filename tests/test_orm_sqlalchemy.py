"""SQLAlchemy 2 (Core and ORM), SQLModel and PyPika's queries through the real gated proxy, over psycopg 3 and over
asyncpg (tests/orm_sqlalchemy.py).

Each step runs on both of SQLAlchemy's dialects for our drivers, ``postgresql+psycopg`` (a ``Session``) and
``postgresql+asyncpg`` (an ``AsyncSession``), each with its own connection start-up (the dialect's version, schema
and ``standard_conforming_strings`` reads; asyncpg's type introspection and codecs) and binding (``$n`` parameters;
asyncpg's named prepared statements and ``$1::VARCHAR`` casts):

- as ``dba`` (direct): the same rows through the proxy as from PostgreSQL itself;
- as ``reporter`` (suppress, k = 10, a suppressed-rest row): inspector reads are PostgreSQL's answer for the role (a
  direct connection under the role); grouped counts of people release exactly the groups the suppression oracle
  (tests/suppression_oracle.py) releases, with PostgreSQL's counts, and the rest row when the oracle releases it;
  aggregates whose every group holds thousands of people are PostgreSQL's answer; a count without GROUP BY over
  nobody is no row; rows, a row by its key, EXISTS and extremes are refused with a hint;
- as a dp role: inspector reads as PostgreSQL answers the role; aggregates answered with SQLAlchemy's labels,
  groups of the columns' public domains (the big ones all present), counts of people within 5 % of PostgreSQL's.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from orm_answers import group_key, groups_of_public_domains
from orm_sqlalchemy import STEPS, Rows, Step, rows
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from sqlmodel import Session as ModelSession
from sqlmodel.ext.asyncio.session import AsyncSession as AsyncModelSession
from suppression_oracle import suppress

from anonproxy.embedded import EmbeddedPostgres

DP_ROLE = "sqlalchemy_analyst"
REFUSAL_STATES = ("42501", "0A000")
K = 10  # the demo reporter's
DIALECTS = ("psycopg", "asyncpg")


@dataclass(frozen=True)
class Refusal:
    """The PostgreSQL error (from the proxy or the server) a step raised, read from either driver."""
    sqlstate: str
    message: str
    hint: str


def _refusal(error: DBAPIError) -> Refusal:
    cause = error.orig if isinstance(error.orig, psycopg.Error) else error.orig.__cause__
    if isinstance(cause, psycopg.Error):
        return Refusal(cause.sqlstate or "", cause.diag.message_primary or "", cause.diag.message_hint or "")
    return Refusal(cause.sqlstate, cause.message, cause.hint or "")  # asyncpg's PostgresError


Outcome = Rows | Refusal


class Connections:
    """Engines by dialect and alias: ``truth`` (the superuser, direct), ``as_<role>`` (direct, under the role) and
    each role through the proxy; async engines run on one event loop of the module."""

    def __init__(self, pg_server: EmbeddedPostgres, proxy: Endpoint, dbname: str) -> None:
        self.loop = asyncio.Runner()
        superuser = (pg_server.superuser, pg_server.password, pg_server.host, pg_server.port)
        self.places: dict[str, tuple[str, str, str, int, str | None]] = {"truth": (*superuser, None)}
        for role in ("reporter", DP_ROLE):
            self.places[f"as_{role}"] = (*superuser, role)
        for role in ("dba", "reporter", DP_ROLE):
            self.places[role] = (role, role, proxy.host, proxy.port, None)
        self.dbname = dbname
        self.engines: dict[tuple[str, str], Any] = {}

    def engine(self, dialect: str, alias: str) -> Any:
        if (dialect, alias) not in self.engines:
            user, password, host, port, role = self.places[alias]
            url = f"postgresql+{dialect}://{user}:{password}@{host}:{port}/{self.dbname}"
            if dialect == "asyncpg":
                args = {"server_settings": {"role": role}} if role else {}
                self.engines[dialect, alias] = create_async_engine(url, poolclass=NullPool, connect_args=args)
            else:
                args = {"options": f"-c role={role}"} if role else {}
                self.engines[dialect, alias] = create_engine(url, poolclass=NullPool, connect_args=args)
        return self.engines[dialect, alias]

    def outcome(self, step: Step, dialect: str, alias: str) -> Outcome:
        """The step's rows on ``alias`` over ``dialect``, or the PostgreSQL error SQLAlchemy raised."""
        engine = self.engine(dialect, alias)
        try:
            if dialect == "asyncpg":
                return self.loop.run(_run_async(step, engine))
            return _run(step, engine)
        except DBAPIError as error:
            return _refusal(error)

    def close(self) -> None:
        for (dialect, _), engine in self.engines.items():
            if dialect == "asyncpg":
                self.loop.run(engine.dispose())
            else:
                engine.dispose()
        self.loop.close()


def _run(step: Step, engine: Any) -> Rows:
    if step.inspect is not None:
        with engine.connect() as connection:
            return step.inspect(inspect(connection))
    assert step.statement is not None
    if step.sqlmodel:
        with ModelSession(engine) as model_session:
            return rows(model_session.exec(step.statement()))
    with Session(engine) as session:
        return rows(session.execute(step.statement()))


async def _run_async(step: Step, engine: AsyncEngine) -> Rows:
    if step.inspect is not None:
        inspector = step.inspect
        async with engine.connect() as connection:
            return await connection.run_sync(lambda sync: inspector(inspect(sync)))
    assert step.statement is not None
    if step.sqlmodel:
        async with AsyncModelSession(engine) as model_session:
            return rows(await model_session.exec(step.statement()))
    async with AsyncSession(engine) as session:
        return rows(await session.execute(step.statement()))


@pytest.fixture(scope="module")
def connections(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[Connections]:
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=1000, delta=0.5):
        places = Connections(pg_server, gated_proxy, gated_database)
        yield places
        places.close()


@pytest.fixture(scope="module")
def everyone(truth: psycopg.Connection) -> int:
    """N: the people of public.adult."""
    return int(truth.execute("select count(*) from adult").fetchone()[0])


def _describe(result: Outcome) -> str:
    if isinstance(result, Refusal):
        return f"{result.sqlstate} {result.message} (hint: {result.hint})"
    return repr(result)[:500]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_direct_role_gets_what_postgresql_gives(step: Step, dialect: str, connections: Connections) -> None:
    through = connections.outcome(step, dialect, "dba")
    assert not isinstance(through, Refusal), _describe(through)
    assert through == connections.outcome(step, dialect, "truth")


def _refused_cleanly(step: Step, result: Outcome) -> None:
    """Refused with 42501 or 0A000, the message naming what (``step.refusal``), a hint saying what is allowed."""
    assert isinstance(result, Refusal), f"answered: {_describe(result)}"
    assert result.sqlstate in REFUSAL_STATES and step.refusal in result.message, _describe(result)
    hint = result.hint.lower()
    assert "allowed" in hint or "supported" in hint or "aggregate" in hint, _describe(result)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_reporter_gets_what_suppression_releases(step: Step, dialect: str, connections: Connections,
                                                 everyone: int) -> None:
    got = connections.outcome(step, dialect, "reporter")
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, Refusal), _describe(got)
    if step.kind == "catalog":
        assert got == connections.outcome(step, dialect, "as_reporter")
        return
    truth = connections.outcome(step, dialect, "truth")
    assert not isinstance(truth, Refusal), _describe(truth)
    if step.kind == "exact":
        assert got == truth
    elif step.kind == "empty":
        assert got == [] and len(truth) == 1, (got, truth)
    else:
        _released_as_oracle(step, got, truth, connections, everyone)


def _released_as_oracle(step: Step, got: Rows, truth: Rows, connections: Connections, everyone: int) -> None:
    """The groups the oracle releases (from each group's people) with PostgreSQL's rows, and the rest row (its
    keys NULL) exactly when the oracle releases it, holding the withheld groups' counts."""
    people: dict[Any, Any] = defaultdict(set)
    if step.people is None:  # one row per person: "n" counts people
        people = {group_key(row, step.keys): row["n"] for row in truth}
    else:
        listed = connections.outcome(Step(f"{step.id}-people", "counts", "", step.people), "psycopg", "truth")
        assert not isinstance(listed, Refusal), _describe(listed)
        for row in listed:
            people[group_key(row, step.keys)].add(row["person_id"])
    verdict = suppress(people, k=K, everyone=everyone, rest=True)
    exact = {group_key(row, step.keys): row for row in truth}
    rest = [row for row in got if group_key(row, step.keys) in (None, (None,) * len(step.keys))]
    assert {group_key(row, step.keys): row for row in got if row not in rest} == \
        {key: exact[key] for key in verdict.released}
    assert len(rest) == int(verdict.rest), (got, verdict)
    for row in rest:
        for name in set(row) - set(step.keys):
            assert row[name] == sum(exact[key][name] for key in verdict.withheld), (row, verdict)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_dp_role_gets_noisy_aggregates_of_the_same_shape(step: Step, dialect: str, connections: Connections) -> None:
    got = connections.outcome(step, dialect, DP_ROLE)
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, Refusal), _describe(got)
    if step.kind == "catalog":
        assert got == connections.outcome(step, dialect, f"as_{DP_ROLE}")
        return
    truth = connections.outcome(step, dialect, "truth")
    assert not isinstance(truth, Refusal)
    assert got and {tuple(row) for row in got} == {tuple(truth[0])}, (got, truth)
    if step.keys and step.per_person:
        groups_of_public_domains(step.keys, got, truth)
    if step.per_person:
        _counts_near(step, got, truth)


def _counts_near(step: Step, got: Rows, truth: Rows) -> None:
    """Counts of thousands of people are within 5 % of PostgreSQL's (the noise of ε 0.5 on a count of people is a
    few units)."""
    exact = {group_key(row, step.keys): row for row in truth} if step.keys else {None: truth[0]}
    for row in got:
        match = exact.get(group_key(row, step.keys) if step.keys else None)
        for name in ("n", "count"):
            if match is not None and name in row and match[name] >= 1000:
                assert math.isclose(row[name], match[name], rel_tol=0.05), (row, match)
