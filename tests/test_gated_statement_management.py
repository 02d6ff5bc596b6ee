"""Drivers' statement management through a gated role behaves as PostgreSQL: DEALLOCATE (SQL, in the simple and the
extended protocol) of a rewritten or dp statement deallocates it, DEALLOCATE ALL and DISCARD ALL drop every
prepared statement (DISCARD PLANS none), and a statement of the same name prepared again afterwards works; inside
and outside transaction blocks, and in a failed one (25P02); a portal bound from a deallocated statement still runs;
a simple Query drops the unnamed statement.
A rewritten portal described in a later batch than its Bind gets its RowDescription.

Each scenario, written on the wire by hand, runs side by side on PostgreSQL directly (as the database's owner, who
may read the table) and through the proxy as reporter (suppress) and as a dp role: the message types, command tags,
errors (SQLSTATE and message) and transaction statuses must be the same; the rows too in suppress mode (dp answers
are noisy). psycopg (a prepared-statement cache of 3, every statement prepared; evicting with Close, and with SQL
DEALLOCATE as it does with a libpq older than 17) and asyncpg (a statement cache of 2) run 20 distinct gated
statements twice in a loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import psycopg._connection_base
import pytest
from conftest import Endpoint, fresh_dp_role
from test_attacks_round14 import SYNC, Message, Raw, bind, describe, execute, parse

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.wire import protocol as pg

COUNT = "select count(*) from public.adult"  # gated: rewritten (suppress), answered by the proxy (dp)
OTHER = "select 1"  # passed to the client's own connection
# A step: a simple Query (str), or extended-protocol messages up to their Sync (bytes).
Step = str | bytes


def _parsed(name: bytes, sql: str = COUNT) -> bytes:
    return parse(sql, name) + SYNC


def _run(name: bytes) -> bytes:
    return bind(statement=name) + execute() + SYNC


def _extended(sql: str) -> bytes:
    """A statement as psycopg sends one without parameters: the unnamed statement, described and executed."""
    return parse(sql) + bind() + describe(b"P") + execute() + SYNC


SCENARIOS: dict[str, list[Step]] = {
    "deallocate": [_parsed(b"s1"), "deallocate s1", _run(b"s1"), "deallocate s1", _parsed(b"s1"), _run(b"s1")],
    "deallocate extended": [_parsed(b"s1"), _extended("deallocate s1"), _run(b"s1"), _extended("deallocate s1"),
                            _parsed(b"s1"), _run(b"s1")],
    "deallocate prepare quoted": [_parsed(b"S1"), 'deallocate prepare "S1"', _run(b"S1"), _parsed(b"S1"),
                                  _run(b"S1")],
    "deallocate in a block": ["begin", _parsed(b"s1"), "deallocate s1", _run(b"s1"), "rollback", _run(b"s1"),
                              _parsed(b"s1"), _run(b"s1")],
    "deallocate in a failed block": ["begin", _parsed(b"s1"), "select 1/0", "deallocate s1",
                                     _extended("deallocate s1"), "rollback", _run(b"s1")],
    "deallocate all": [_parsed(b"s1"), _parsed(b"s2", OTHER), "deallocate all", _run(b"s1"), _run(b"s2"),
                       _parsed(b"s1"), _run(b"s1")],
    "deallocate all extended": [_parsed(b"s1"), _extended("deallocate all"), _run(b"s1"), _parsed(b"s1"),
                                _run(b"s1")],
    "deallocate all in a block": ["begin", _parsed(b"s1"), "deallocate all", "rollback", _run(b"s1")],
    "discard all": [_parsed(b"s1"), _parsed(b"s2", OTHER), "discard all", _run(b"s1"), _run(b"s2"),
                    _parsed(b"s1"), _run(b"s1")],
    "discard all extended": [_parsed(b"s1"), _extended("discard all"), _run(b"s1")],
    "discard all in a block": [_parsed(b"s1"), "begin", "discard all", "rollback", _run(b"s1")],
    "discard plans": [_parsed(b"s1"), "discard plans", _run(b"s1")],
    "unnamed statement after a query": [_parsed(b""), "select 1", _run(b""), _parsed(b""), _run(b"")],
    "portal outlives its statement": ["begin", parse(COUNT, b"s1") + bind(statement=b"s1", portal=b"p1") + SYNC,
                                      "deallocate s1", execute(b"p1") + SYNC, _run(b"s1"), "commit"],
    "describe in a later batch": ["begin", _parsed(b"s1"), bind(statement=b"s1", portal=b"p1") + SYNC,
                                  describe(b"P", b"p1") + execute(b"p1") + SYNC,
                                  describe(b"P", b"p1") + SYNC, "commit"],
}

Outcome = tuple[object, ...]


def _outcome(message: Message, rows: bool) -> Outcome:
    """What must match PostgreSQL in one message: its type, and its tag, error, status, columns or row."""
    type_, body = message
    if type_ == b"E":
        fields = pg.parse_fields(body)
        return type_, fields["C"], fields["M"]
    if type_ in (b"C", b"Z"):
        return type_, body
    if type_ == b"T":
        return type_, tuple(name for name, _ in pg.parse_row_description(body))
    if type_ == b"D" and rows:
        return type_, pg.parse_data_row(body)
    return (type_,)


def _outcomes(session: Raw, steps: list[Step], rows: bool) -> list[list[Outcome]]:
    """Each step's answer, up to its ReadyForQuery (a mode's NOTICE on its answer, which PostgreSQL does not send,
    left out)."""
    answers = []
    for step in steps:
        session.send(pg.query_message(step) if isinstance(step, str) else step)
        answers.append([_outcome(message, rows) for message in session.until(b"Z") if message[0] != b"N"])
    return answers


@pytest.fixture(scope="module")
def dp_role(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "x14_analyst", epsilon=1000) as role:
        yield role


@pytest.fixture(params=["suppress", "dp"])
def role(request: pytest.FixtureRequest, dp_role: str) -> str:
    return "reporter" if request.param == "suppress" else dp_role


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_statement_management_as_postgresql(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                            gated_database: str, role: str, scenario: str) -> None:
    """Each step's answer through the proxy is PostgreSQL's (rows: in suppress mode)."""
    steps = SCENARIOS[scenario]
    rows = role == "reporter"
    direct = Raw(pg_server.conninfo(dbname=gated_database))
    try:
        expected = _outcomes(direct, steps, rows)
    finally:
        direct.close()
    proxied = Raw(gated_proxy.dsn(gated_database, user=role))
    try:
        got = _outcomes(proxied, steps, rows)
    finally:
        proxied.close()
    assert got == expected


# -- drivers' caches ---------------------------------------------------------------------------------------------

STATEMENTS = [f"select count(*) from public.adult where age > {age}" for age in range(20, 40)]


def _psycopg_loop(conninfo: str) -> list[object]:
    """20 distinct statements twice, each prepared at once in a cache of 3 (psycopg deallocates the evicted ones),
    then a ROLLBACK (psycopg answers it with DEALLOCATE ALL) and the loop once more: each answer's count."""
    counts: list[object] = []
    with psycopg.connect(conninfo, prepare_threshold=0) as conn:
        conn.prepared_max = 3
        for _ in range(2):
            counts += [conn.execute(sql).fetchone()[0] for sql in STATEMENTS]  # type: ignore[index]
        conn.rollback()
        counts += [conn.execute(sql).fetchone()[0] for sql in STATEMENTS]  # type: ignore[index]
    return counts


@pytest.mark.parametrize("close", [True, False], ids=["close", "sql deallocate"])
def test_psycopg_prepared_cache(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str,
                                role: str, close: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg evicts with a protocol Close when libpq has PQsendClosePrepared (17 and later), else with SQL
    DEALLOCATE: both ways, through the proxy, every statement answers as PostgreSQL (suppress: the same counts)."""
    monkeypatch.setattr(psycopg._connection_base, "_HAS_SEND_CLOSE", close)
    expected = _psycopg_loop(pg_server.conninfo(dbname=gated_database))
    got = _psycopg_loop(gated_proxy.dsn(gated_database, user=role))
    assert len(got) == len(expected) == 60
    if role == "reporter":
        assert got == expected
    else:
        assert all(isinstance(count, int) for count in got)


async def _asyncpg_loop(**connect: object) -> list[int]:
    """20 distinct statements twice, prepared by asyncpg in a statement cache of 2 (it closes the evicted ones)."""
    conn = await asyncpg.connect(statement_cache_size=2, **connect)
    try:
        return [await conn.fetchval(sql) for _ in range(2) for sql in STATEMENTS]
    finally:
        await conn.close()


def test_asyncpg_statement_cache(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str,
                                 role: str) -> None:
    expected = asyncio.run(_asyncpg_loop(host=pg_server.host, port=pg_server.port, user=pg_server.superuser,
                                         password=pg_server.password, database=gated_database))
    got = asyncio.run(_asyncpg_loop(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                    database=gated_database))
    assert len(got) == len(expected) == 40
    if role == "reporter":
        assert got == expected
    else:
        assert all(isinstance(count, int) for count in got)
