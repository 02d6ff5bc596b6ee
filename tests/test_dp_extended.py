"""Differential-privacy mode over the extended query protocol, with real drivers through the real proxy.

Each test gets its own dp role (ε 2 in all, 0.5 and δ 1e-7 per query, on public.adult; the `analyst` fixture
of test_dp_proxy), so budgets do not leak between tests. Truths come from a superuser connection; noisy values
are checked against bounds derived from the noise scale, ledger charges against `SHOW anonproxy.budget`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path

import asyncpg
import psycopg
import pytest
from conftest import Endpoint
from psycopg import pq
from test_clients import NODE_DIR, ensure_node_modules, jdbc_jar, libpq_env, run
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)

from anonproxy.wire.results import binary_value

QUERY = "select education, count(*), sum(age), avg(hours_per_week) from adult group by 1"
# count(*), sum(age), and avg's sum and count: ε 0.5 / 4 each. Count scale 1/0.125 = 8, sum(age) scale 100/0.125
# = 800 (age's declared bounds are [15, 100]). Discrete Laplace tails: Pr[|N| > t·ln(1/p)] < p, so with p = 1e-6
# over 16 groups a correct mechanism almost never exceeds 8·13.8 ≈ 111 (count) or 800·13.8 ≈ 11,053 (sum).
COUNT_BOUND, SUM_BOUND = 111, 11053


def connect(proxy: Endpoint, database: str, role: str) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(database, user=role), autocommit=True)


def truths(superuser: psycopg.Connection) -> dict[str, tuple[int, int, float]]:
    return {education: (n, int(total), float(mean)) for education, n, total, mean in superuser.execute(QUERY)}


def check_close(rows: list[tuple], expected: dict[str, tuple[int, int, float]]) -> None:
    assert {row[0] for row in rows} == set(expected)  # a public domain: every value, none invented
    for education, n, total, mean in rows:
        true_n, true_total, true_mean = expected[education]
        assert abs(n - true_n) <= COUNT_BOUND and abs(total - true_total) <= SUM_BOUND
        assert 0 <= mean <= 100  # post-processing keeps an average within the declared bounds
        if true_n > 3000:
            assert abs(float(mean) - true_mean) < 1.0


def test_psycopg_prepared_binary(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                 truth: psycopg.Connection) -> None:  # noqa: F811
    with connect(gated_proxy, gated_database, analyst) as conn:
        cursor = conn.cursor(binary=True)
        rows = cursor.execute(QUERY, prepare=True).fetchall()
        # Binary values decode into the types PostgreSQL would give: bigint counts, bigint sum of an integer
        # column, numeric average (psycopg's binary numeric loader read them).
        assert [d.type_code for d in cursor.description] == [25, 20, 20, 1700]
        assert all(isinstance(n, int) and isinstance(total, int) and isinstance(mean, Decimal)
                   for _, n, total, mean in rows)
        check_close(rows, truths(truth))
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        for _ in range(3):  # prepared by now: Bind/Execute only; the cached answer, free
            assert cursor.execute(QUERY, prepare=True).fetchall() == rows
        assert conn.cursor().execute(QUERY, prepare=True).fetchall() == rows  # the same answer in text format
        assert "epsilon 1.5 of 2 left" in budget_left(conn)


def test_psycopg_bound_parameters(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                  truth: psycopg.Connection) -> None:  # noqa: F811
    query = "select sex, count(*) from adult where age > %s and workclass = %s group by sex"
    with connect(gated_proxy, gated_database, analyst) as conn:
        answers = {}
        for age, binary in ((30, False), (50, True)):
            answers[age] = dict(conn.cursor(binary=binary).execute(query, [age, "Private"]).fetchall())
            expected = dict(truth.execute(query, [age, "Private"]).fetchall())
            assert set(answers[age]) == {"Female", "Male"}
            # One statistic (count of people; sex has a public domain, no selection): ε 0.5, scale 2, 2·ln(1e6) < 28.
            assert all(abs(answers[age][sex] - expected[sex]) <= 28 for sex in expected)
        assert "epsilon 1 of 2 left" in budget_left(conn), "two values, two questions"
        assert dict(conn.execute(query, [30, "Private"]).fetchall()) == answers[30]
        assert "epsilon 1 of 2 left" in budget_left(conn), "the same value again is the same question"
        # A value is bound, never pasted into SQL: this is one strange workclass (no one), not an injection.
        nobody = conn.execute(query, [30, "x' or true --"]).fetchall()
        assert [sex for sex, _ in nobody] == ["Female", "Male"] and all(n <= 28 for _, n in nobody)
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            conn.execute("select count(*) from adult where age > %s", ["not a number"])


def test_asyncpg_fetch_and_prepare(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                   truth: psycopg.Connection) -> None:  # noqa: F811
    expected = truths(truth)

    async def run() -> None:
        conn = await asyncpg.connect(gated_proxy.url(gated_database, user=analyst))
        try:
            rows = [tuple(r) for r in await conn.fetch(QUERY)]  # asyncpg: binary results, a described statement
            check_close(rows, expected)
            statement = await conn.prepare(QUERY)
            assert [(a.name, a.type.name) for a in statement.get_attributes()] == [
                ("education", "text"), ("count", "int8"), ("sum", "int8"), ("avg", "numeric")]
            assert [tuple(r) for r in await statement.fetch()] == rows  # cached: the same answer, free
            budget = await conn.fetchval("show anonproxy.budget")
            assert "epsilon 1.5 of 2 left" in budget
            by_age = await conn.prepare("select count(*) from adult where age >= $1")
            assert [t.name for t in by_age.get_parameters()] == ["int4"]  # inferred by the server
            total = await by_age.fetchval(40)
            true_total = truth.execute("select count(*) from adult where age >= 40").fetchone()[0]
            assert abs(total - true_total) <= 28  # scale 2
            assert await by_age.fetchval(40) == total
            assert "epsilon 1 of 2 left" in await conn.fetchval("show anonproxy.budget")
            # A cursor reads a portal a few rows at a time (Execute with a row limit, PortalSuspended): one charge.
            async with conn.transaction():
                chunks = [tuple(r) async for r in conn.cursor(
                    "select race, count(*) from adult group by race order by 1", prefetch=2)]
            assert [r[0] for r in chunks] == sorted(["White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other",
                                                     "Black"])
            assert "epsilon 0.5 of 2 left" in await conn.fetchval("show anonproxy.budget")
        finally:
            await conn.close()

    asyncio.run(run())


def test_jdbc_named_statements_binary_and_fetch_size(gated_proxy: Endpoint, gated_database: str,
                                                     analyst: str, truth: psycopg.Connection) -> None:  # noqa: F811
    java = shutil.which("java")
    assert java, "java is needed for the JDBC tests (Debian: default-jre-headless)"
    source = Path(__file__).parent / "clients" / "JdbcAnalyst.java"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(source), gated_proxy.host, str(gated_proxy.port),
                           gated_database, analyst], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line.split("|") for line in done.stdout.splitlines()]
    assert [line[2:] for line in lines if line[0] == "types"] == [["int8", "int8", "numeric"]] * 3
    rounds = [[(e, int(n), int(total), Decimal(mean)) for _, r, e, n, total, mean in
               (line for line in lines if line[0] == "row") if int(r) == round_] for round_ in range(3)]
    check_close(rounds[0], truths(truth))
    assert rounds[1] == rounds[0] and rounds[2] == rounds[0], "the cached answer, read four rows at a time"
    older = int(next(line[2] for line in lines if line[0] == "older"))
    assert abs(older - truth.execute("select count(*) from adult where age > 30").fetchone()[0]) <= 28
    assert "epsilon 1 of 2 left" in next(line[2] for line in lines if line[0] == "budget"), "two questions"


def test_node_postgres_parameters_and_named_statements(gated_proxy: Endpoint, gated_database: str,
                                                       analyst: str,  # noqa: F811
                                                       truth: psycopg.Connection) -> None:  # noqa: F811
    ensure_node_modules()
    node = shutil.which("node")
    assert node, "node is required for the node-postgres test"
    done = run([node, "dp.js"], libpq_env(gated_proxy, gated_database, user=analyst), cwd=NODE_DIR)
    assert done.returncode == 0, f"dp.js failed:\n{done.stdout}\n{done.stderr}"
    out = json.loads(done.stdout)
    expected = dict(truth.execute("select sex, count(*) from adult where age > 30 group by sex").fetchall())
    # node-postgres returns bigint as a string; count of people at ε 0.5: scale 2, 2·ln(1e6) < 28.
    assert {r["sex"] for r in out["by_sex"]} == set(expected)
    assert all(abs(int(r["count"]) - expected[r["sex"]]) <= 28 for r in out["by_sex"])
    first, second = out["named"]
    assert first == second, "the named statement's second run is the cached answer"
    races = dict(truth.execute("select race, avg(age)::float8 from adult where sex = 'Female' group by race"))
    assert {r["race"] for r in first} == set(races)
    assert all(15 <= float(r["avg"]) <= 100 for r in first)  # within the declared bounds of age
    assert abs(float(next(r["avg"] for r in first if r["race"] == "White")) - races["White"]) < 1.5
    assert "epsilon 1 of 2 left" in out["budget"], "two questions of ε 0.5"
    assert out["refused"] == "42501" and out["after_refusal"] == 7  # max() is refused in dp mode
    assert any("differentially private answer" in notice for notice in out["notices"])


def test_a_write_to_the_table_makes_a_new_question(gated_proxy: Endpoint, gated_database: str,
                                                   analyst: str,  # noqa: F811
                                                   truth: psycopg.Connection) -> None:  # noqa: F811
    query = "select count(*) from adult where age between %s and %s"
    with connect(gated_proxy, gated_database, analyst) as conn:
        conn.execute(query, [20, 25], prepare=True).fetchone()
        conn.execute(query, [20, 25], prepare=True).fetchone()
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        truth.execute("update adult set age = age where id = 1")  # a committed write: a new data version
        conn.execute(query, [20, 25], prepare=True).fetchone()
        assert "epsilon 1 of 2 left" in budget_left(conn), "the cached answer was for other data"


def test_spread_and_quantile_types_over_asyncpg(gated_proxy: Endpoint, gated_database: str,
                                                analyst: str,  # noqa: F811
                                                truth: psycopg.Connection) -> None:  # noqa: F811
    query = ("select sex, stddev(age), percentile_cont(0.5) within group (order by age), "
             "percentile_disc(0.5) within group (order by age) from adult group by sex")

    async def run() -> tuple[list[tuple[str, str]], list[tuple]]:
        conn = await asyncpg.connect(gated_proxy.url(gated_database, user=analyst))
        try:
            statement = await conn.prepare(query)  # described before it runs, then read in binary
            types = [(a.name, a.type.name) for a in statement.get_attributes()]
            return types, [tuple(r) for r in await statement.fetch()]
        finally:
            await conn.close()

    types, rows = asyncio.run(run())
    assert [t for _, t in types] == ["text", "numeric", "float8", "int4"]  # disc: int4, as PostgreSQL
    exact = {sex: (float(sd), median) for sex, sd, median in truth.execute(
        "select sex, stddev(age), percentile_cont(0.5) within group (order by age) from adult group by sex")}
    assert {row[0] for row in rows} == set(exact)
    for sex, sd, cont, disc in rows:
        assert isinstance(sd, Decimal) and isinstance(cont, float) and isinstance(disc, int)
        assert abs(float(sd) - exact[sex][0]) < 1  # thousands of people per group: the noise is small
        assert abs(cont - exact[sex][1]) <= 3 and abs(disc - exact[sex][1]) <= 3


def test_budget_exhausted_in_a_pipeline_skips_the_rest_of_the_batch(gated_proxy: Endpoint, gated_database: str,
                                                                    analyst: str) -> None:  # noqa: F811
    with connect(gated_proxy, gated_database, analyst) as conn:
        for age in range(20, 24):  # four questions of ε 0.5: the whole ε 2
            conn.execute("select count(*) from adult where age > %s", [age], prepare=True).fetchone()
        with pytest.raises(psycopg.errors.ConfigurationLimitExceeded, match="budget exhausted"), conn.pipeline():
            conn.execute("select count(*) from adult where age > %s", [60])
            conn.execute("select 1")  # skipped: after an error, up to Sync
        assert conn.execute("select 2").fetchone() == (2,), "the session goes on"
        assert "epsilon 0 of 2 left" in budget_left(conn)


def test_refusals_in_the_extended_protocol_cost_nothing(gated_proxy: Endpoint, gated_database: str,
                                                       analyst: str) -> None:  # noqa: F811
    with connect(gated_proxy, gated_database, analyst) as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="parameter"):
            # (a value added up, sum(age * $1), is decided at Bind now, and answered as sum(age * 2) is)
            conn.execute("select sex, coalesce(sum(age), %s) from adult group by sex", [0], prepare=True)
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="LIMIT"):
            conn.execute("select sex, count(*) from adult group by sex limit %s + 1", [1])
        with pytest.raises(psycopg.errors.InvalidRowCountInLimitClause):
            conn.execute("select sex, count(*) from adult group by sex limit %s", [-1])
        assert "epsilon 2 of 2 left, delta 0.00001 of 0.00001 left; epsilon spent 0 " in conn.execute(
            "show anonproxy.budget", prepare=True).fetchone()[0]


@pytest.mark.parametrize("oid, text", [
    (20, b"-9007199254740993"), (23, b"-17"), (25, "Hé 'x'".encode()), (701, b"0.1"), (701, b"-1.5e+300"),
    (1700, b"0"), (1700, b"12.50"), (1700, b"-0.000123"), (1700, b"123456789012345678901234.5678"),
    (1700, b"10000"), (1700, b"NaN"),
])
def test_binary_values_match_postgresql(truth: psycopg.Connection, oid: int, text: bytes) -> None:  # noqa: F811
    """The proxy's binary encoding of a text value is byte for byte what PostgreSQL's own send function gives."""
    result = truth.pgconn.exec_params(b"select $1::text::" + {20: b"int8", 23: b"int4", 25: b"text", 701: b"float8",
                                                              1700: b"numeric"}[oid],
                                      [text], [25], [0], pq.Format.BINARY)
    assert result.status == pq.ExecStatus.TUPLES_OK and result.ftype(0) == oid
    assert binary_value(oid, text) == result.get_value(0, 0)
