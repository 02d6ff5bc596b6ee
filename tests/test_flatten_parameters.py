"""$n parameters in derived tables that are flattened (extended protocol, psycopg and asyncpg).

Flattening (anonproxy.plan.flatten) drops the select items of a derived table that the outer query does not read.
A parameter only such an item holds would vanish from the statement the service connection runs, which would then
take fewer parameters than the client declared and binds. Such a statement is refused at Parse (0A000, naming the
parameter); parameters the flattened statement keeps (the derived table's WHERE, items the outer query reads) are
bound as the client sent them.
"""

from __future__ import annotations

import asyncio

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

# (A cast of $1 to another type than text would be decided at Bind, written as a constant: tests/test_bind_time.py.)
DROPPED = "select sex, count(*) from (select sex, {0}::text as unused from adult where age > {1}) t group by sex"
KEPT = "select sex, count(*) from (select sex, age from adult where age > {0}) t group by sex order by sex"
READ = ("select s, count(*) from (select sex as s, age as a from adult where age > {0}) t where a < {1} "
        "group by s order by s")


def psycopg_placeholders(template: str) -> str:
    return template.format(*["%s"] * template.count("{"))


def dollar_placeholders(template: str) -> str:
    return template.format(*[f"${n}" for n in range(1, template.count("{") + 1)])


@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_parameter_only_a_dropped_item_holds_is_refused_at_parse(gated_proxy: Endpoint, gated_database: str,
                                                                   role: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(psycopg_placeholders(DROPPED), (5, 30))
        assert caught.value.sqlstate == "0A000", caught.value
        message = caught.value.diag.message_primary or ""
        assert "$1" in message and "unused" in message, message
        assert caught.value.diag.message_hint, "a refusal has a hint"
        assert conn.execute("select 1").fetchone() == (1,), "the session goes on"


def test_asyncpg_prepare_is_refused_with_the_same_error(gated_proxy: Endpoint, gated_database: str) -> None:
    async def prepare() -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            with pytest.raises(asyncpg.PostgresError) as caught:
                await conn.prepare(dollar_placeholders(DROPPED))
            assert caught.value.sqlstate == "0A000" and "$1" in str(caught.value)
            assert await conn.fetchval("select 1") == 1
        finally:
            await conn.close()

    asyncio.run(prepare())


def test_parameters_the_flattened_statement_keeps_are_bound(gated_proxy: Endpoint, gated_database: str,
                                                            truth: psycopg.Connection) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        assert conn.execute(psycopg_placeholders(KEPT), (30,)).fetchall() == \
            truth.execute(psycopg_placeholders(KEPT), (30,)).fetchall()
        assert conn.execute(psycopg_placeholders(READ), (30, 60)).fetchall() == \
            truth.execute(psycopg_placeholders(READ), (30, 60)).fetchall()

    async def prepared() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            statement = await conn.prepare(dollar_placeholders(READ))
            return [tuple(row) for row in await statement.fetch(30, 60)]
        finally:
            await conn.close()

    assert asyncio.run(prepared()) == truth.execute(psycopg_placeholders(READ), (30, 60)).fetchall()


def test_dp_binds_the_kept_parameters(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_flat_params") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        rows = conn.execute(psycopg_placeholders(KEPT), (30,)).fetchall()
        expected = dict(truth.execute(psycopg_placeholders(KEPT), (30,)).fetchall())
        assert {sex for sex, _ in rows} == set(expected)
        assert all(abs(n - expected[sex]) < 200 for sex, n in rows)
