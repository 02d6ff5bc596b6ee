"""Real clients through the real proxy: psql, pgbench, asyncpg, pgjdbc, node-postgres.

Each client talks to `anonproxy serve` (fixture `proxy`) exactly as it would talk
to PostgreSQL; what it reports is checked against values this file computes on a
direct psycopg connection to the server (fixture `direct`), never against
outputs recorded from an earlier run.

The external programs are required, not optional: a missing psql, pgbench, java,
JDBC driver or node makes the test fail, never skip.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import glob
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Self

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, start_proxy, stop_proxy

from anonproxy.embedded import EmbeddedPostgres

CLIENTS = Path(__file__).parent / "clients"
NODE_DIR = CLIENTS / "node"
PSQL = shutil.which("psql") or "/usr/bin/psql"
PGBENCH = shutil.which("pgbench") or "/usr/bin/pgbench"


def libpq_env(endpoint: Endpoint, dbname: str, user: str = "scram_user", password: str | None = None) -> dict[str, str]:
    """The environment for a libpq program (psql, pgbench) or node-postgres: only our PG* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST=endpoint.host, PGPORT=str(endpoint.port), PGDATABASE=dbname, PGUSER=user,
               PGPASSWORD=user if password is None else password, PGCONNECT_TIMEOUT="10",
               PSQLRC=os.devnull, LC_ALL="C.UTF-8")
    return env


def run(args: list[str], env: dict[str, str], *, timeout: float = 60, cwd: Path | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, input=stdin, check=False, capture_output=True, text=True,
                          timeout=timeout)


def direct_error(direct: Endpoint, dbname: str, query: str) -> psycopg.Error:
    """The error PostgreSQL itself raises for ``query``."""
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        try:
            conn.execute(query)
        except psycopg.Error as exc:
            return exc
    raise AssertionError(f"{query!r} did not fail on the server")


# -- psql ----------------------------------------------------------------------------------


def psql(proxy: Endpoint, dbname: str, *args: str, user: str = "scram_user",
         stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([PSQL, "-X", *args], libpq_env(proxy, dbname, user), stdin=stdin)


def test_psql_queries_and_multi_statement_strings(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    with psycopg.connect(direct.dsn(dbname)) as conn:
        count, fnlwgt = conn.execute("select count(*), sum(fnlwgt) from adult").fetchone()
        educations = conn.execute("select education, count(*) from adult group by 1 order by 2 desc, 1").fetchall()
    assert count == 30162

    done = psql(proxy, dbname, "-At", "-v", "ON_ERROR_STOP=1", "-c", "select count(*), sum(fnlwgt) from adult")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{count}|{fnlwgt}"]

    # One -c string holding several statements goes as one simple Query message.
    done = psql(proxy, dbname, "-At", "-v", "ON_ERROR_STOP=1", "-c",
                "create table t(x int); insert into t values (1), (2), (3); select sum(x), count(*) from t")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "6|3"
    # Several -c options, a URL instead of the environment, and a result of many rows.
    connection_vars = ("PGHOST", "PGPORT", "PGDATABASE", "PGUSER", "PGPASSWORD")
    env = {k: v for k, v in libpq_env(proxy, dbname).items() if k not in connection_vars}
    done = run([PSQL, "-X", "-At", "-F", ",", "-v", "ON_ERROR_STOP=1", proxy.url(dbname),
                "-c", "insert into t values (4)", "-c",
                "select education, count(*) from adult group by 1 order by 2 desc, 1"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["INSERT 0 1"] + [f"{e},{n}" for e, n in educations]
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert conn.execute("select array_agg(x order by x) from t").fetchone() == ([1, 2, 3, 4],)

    # A script on stdin: variables, \gset, a transaction.
    done = psql(proxy, dbname, "-At", "-v", "ON_ERROR_STOP=1", "-f", "-", stdin=(
        "select max(age) as oldest from adult \\gset\n"
        "begin;\n"
        "insert into t select :oldest;\n"
        "commit;\n"
        "select x from t order by x desc limit 1;\n"
    ))
    assert done.returncode == 0, done.stderr
    with psycopg.connect(direct.dsn(dbname)) as conn:
        oldest = conn.execute("select max(age) from adult").fetchone()[0]
    assert done.stdout.splitlines()[-1] == str(oldest)


def test_psql_copy_out_and_in(proxy: Endpoint, direct: Endpoint, dbname: str, tmp_path: Path) -> None:
    exported = tmp_path / "adult.csv"
    done = psql(proxy, dbname, "-v", "ON_ERROR_STOP=1", "-c",
                f"\\copy (select * from adult order by id) to '{exported}' with (format csv, header)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "COPY 30162"
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        expected = io.BytesIO()
        with conn.cursor().copy("copy (select * from adult order by id) to stdout with (format csv, header)") as copy:
            for block in copy:
                expected.write(block)
        conn.execute("create table adult_copy (like adult including all)")
    assert exported.read_bytes() == expected.getvalue()

    done = psql(proxy, dbname, "-v", "ON_ERROR_STOP=1", "-c",
                f"\\copy adult_copy from '{exported}' with (format csv, header)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "COPY 30162"
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert conn.execute("select count(*) from adult_copy").fetchone() == (30162,)
        differences = conn.execute("select count(*) from ((select * from adult except all select * from adult_copy) "
                                   "union all (select * from adult_copy except all select * from adult)) d").fetchone()
        assert differences == (0,)

    # A bad row in \copy from: the server's error, nothing loaded.
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2\nthree,4\n")
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        conn.execute("create table pairs(a int, b int)")
    done = psql(proxy, dbname, "-v", "ON_ERROR_STOP=1", "-c", f"\\copy pairs from '{bad}' with (format csv)")
    assert done.returncode != 0
    assert 'invalid input syntax for type integer: "three"' in done.stderr
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert conn.execute("select count(*) from pairs").fetchone() == (0,)


def test_psql_describe_table(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    with psycopg.connect(direct.dsn(dbname)) as conn:
        columns = conn.execute(
            "select attname, format_type(atttypid, atttypmod), attnotnull from pg_attribute "
            "where attrelid = 'public.adult'::regclass and attnum > 0 and not attisdropped order by attnum").fetchall()
        indexes = [name for (name,) in conn.execute(
            "select indexrelid::regclass::text from pg_index where indrelid = 'public.adult'::regclass")]
    assert [name for name, _, _ in columns][:3] == ["id", "age", "workclass"] and len(columns) == 16

    done = psql(proxy, dbname, "-v", "ON_ERROR_STOP=1", "-c", "\\d adult")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].strip() == 'Table "public.adult"'
    listed = []
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 5 and cells[0] not in ("Column", ""):
            listed.append((cells[0], cells[1], cells[3] == "not null"))
    assert listed == columns
    assert indexes and all(f'"{index}"' in done.stdout for index in indexes)


def test_psql_errors(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    for query in ("selec 1", "select * from no_such_table", "select 1/0"):
        expected = direct_error(direct, dbname, query).diag.message_primary
        done = psql(proxy, dbname, "-c", query)
        assert done.returncode != 0, done.stdout
        assert f"ERROR:  {expected}" in done.stderr
    # Without ON_ERROR_STOP a script goes on after an error on the same connection.
    done = psql(proxy, dbname, "-At", "-f", "-", stdin="select 1;\nselec 2;\nselect pg_backend_pid() > 0;\n")
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["1", "t"]
    assert 'syntax error at or near "selec"' in done.stderr
    # With ON_ERROR_STOP psql stops there and exits 3.
    done = psql(proxy, dbname, "-At", "-v", "ON_ERROR_STOP=1", "-f", "-", stdin="select 1;\nselec 2;\nselect 3;\n")
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["1"]
    # A wrong password: the server's authentication error, exit 2.
    done = run([PSQL, "-X", "-c", "select 1"], libpq_env(proxy, dbname, password="wrong"))
    assert done.returncode == 2
    assert 'password authentication failed for user "scram_user"' in done.stderr


def test_psql_analyst_is_denied_adult(proxy: Endpoint, dbname: str) -> None:
    done = psql(proxy, dbname, "-At", "-c", "select current_user", user="analyst")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "analyst"
    done = psql(proxy, dbname, "-At", "-c", "select count(*) from adult", user="analyst")
    assert done.returncode != 0
    assert "ERROR:  permission denied for table adult" in done.stderr
    assert done.stdout == ""


# -- pgbench -------------------------------------------------------------------------------

PGBENCH_PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)/(\d+)$", re.MULTILINE)
PGBENCH_FAILED = re.compile(r"^number of failed transactions: (\d+) ", re.MULTILINE)


def pgbench(proxy: Endpoint, dbname: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    done = run([PGBENCH, *args], libpq_env(proxy, dbname), timeout=timeout)
    assert done.returncode == 0, f"pgbench {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def pgbench_init(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    pgbench(proxy, dbname, "-i", "-s", "1", "-q")
    with psycopg.connect(direct.dsn(dbname)) as conn:
        counts = conn.execute("select (select count(*) from pgbench_accounts), "
                              "(select count(*) from pgbench_branches), "
                              "(select count(*) from pgbench_tellers), (select count(*) from pgbench_history), "
                              "(select sum(abalance) from pgbench_accounts)").fetchone()
        assert counts == (100000, 1, 10, 0, 0)
        keys = conn.execute("select count(*) from pg_constraint where contype = 'p' "
                            "and conrelid::regclass::text like 'pgbench_%'").fetchone()
        assert keys == (3,)  # branches, tellers, accounts: the -i primary key step ran


def assert_pgbench_result(done: subprocess.CompletedProcess[str], transactions: int) -> None:
    processed = PGBENCH_PROCESSED.search(done.stdout)
    failed = PGBENCH_FAILED.search(done.stdout)
    assert processed and failed, done.stdout
    assert (int(processed[1]), int(processed[2])) == (transactions, transactions), done.stdout
    assert int(failed[1]) == 0, done.stdout


@pytest.mark.parametrize("protocol", ["simple", "extended", "prepared"])
def test_pgbench_select_only(proxy: Endpoint, direct: Endpoint, dbname: str, protocol: str) -> None:
    pgbench_init(proxy, direct, dbname)
    done = pgbench(proxy, dbname, "-M", protocol, "-S", "-t", "200", "-c", "4", "-j", "2", "-n")
    assert f"query mode: {protocol}" in done.stdout
    assert_pgbench_result(done, 800)


def test_pgbench_tpcb(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    pgbench_init(proxy, direct, dbname)
    done = pgbench(proxy, dbname, "-t", "50", "-c", "2", "-n")
    assert "TPC-B (sort of)" in done.stdout
    assert_pgbench_result(done, 100)
    with psycopg.connect(direct.dsn(dbname)) as conn:
        history, delta = conn.execute("select count(*), coalesce(sum(delta), 0) from pgbench_history").fetchone()
        balances = conn.execute("select (select sum(abalance) from pgbench_accounts), "
                                "(select sum(bbalance) from pgbench_branches), "
                                "(select sum(tbalance) from pgbench_tellers)").fetchone()
    assert history == 100
    # Every transaction moved the same delta through account, teller, branch and history.
    assert balances == (delta, delta, delta)


# -- asyncpg -------------------------------------------------------------------------------


async def asyncpg_connect(endpoint: Endpoint, dbname: str, **kwargs: object) -> asyncpg.Connection:
    return await asyncpg.connect(host=endpoint.host, port=endpoint.port, user="scram_user", password="scram_user",
                                 database=dbname, timeout=10, **kwargs)


def test_asyncpg_named_prepared_statements(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    query = "select count(*), sum(fnlwgt) from adult where age = $1 and sex = $2"
    keys = [(age, sex) for age in (19, 30, 45, 62, 90) for sex in ("Male", "Female")]
    with psycopg.connect(direct.dsn(dbname)) as conn:
        expected = {key: conn.execute(query.replace("$1", "%s").replace("$2", "%s"), key).fetchone() for key in keys}

    async def main() -> dict[str, object]:
        conn = await asyncpg_connect(proxy, dbname)
        try:
            stmt = await conn.prepare(query, name="adult_by_age_sex")
            first = {key: tuple(await stmt.fetchrow(*key)) for key in keys}
            again = {key: tuple(await stmt.fetchrow(*key)) for key in reversed(keys)}  # reused
            many = await stmt.fetch(45, "Female")
            other = await conn.prepare("select id, education from adult where id = any($1::int[]) order by id")
            rows = [tuple(r) for r in await other.fetch([3, 1, 2])]
            prepared = {r["name"]: (r["statement"], r["parameter_types"]) for r in
                        await conn.fetch("select name, statement, parameter_types::text[] from pg_prepared_statements")}
            return {"first": first, "again": again, "many": [tuple(r) for r in many], "rows": rows,
                    "prepared": prepared, "params": [t.name for t in stmt.get_parameters()],
                    "attributes": [a.name for a in stmt.get_attributes()]}
        finally:
            await conn.close()

    got = asyncio.run(main())
    assert got["first"] == expected and got["again"] == expected
    assert got["many"] == [expected[(45, "Female")]]
    with psycopg.connect(direct.dsn(dbname)) as conn:
        expected_rows = conn.execute("select id, education from adult where id in (1, 2, 3) order by id").fetchall()
    assert got["rows"] == expected_rows
    assert got["prepared"]["adult_by_age_sex"] == (query, ["integer", "text"])
    assert got["params"] == ["int4", "text"] and got["attributes"] == ["count", "sum"]


def test_asyncpg_binary_results(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    stamp = dt.datetime(2024, 2, 29, 12, 34, 56, 789000, tzinfo=dt.UTC)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    params = (2147483647, -9223372036854775808, Decimal("-1234567890.0123456789"), "héllo, wörld ✓",
              b"\x00\xff\x00binary", stamp, [1, None, 3], ["a", "b c", ""], '{"k": [1, "x", null]}',
              {"ignored": 1}, 2.5, True, dt.date(1999, 12, 31), ident)
    roundtrip = ("select $1::int4, $2::int8, $3::numeric, $4::text, $5::bytea, $6::timestamptz, $7::int4[], "
                 "$8::text[], $9::json, $10::jsonb, $11::float8, $12::bool, $13::date, $14::uuid")
    computed = ("select 40 + 2, 12345678901234::int8, 1.5::numeric * 3, repeat('ab', 3), "
                "decode(repeat('00ff', 100000), 'hex'), '2000-01-01 00:00:00+00'::timestamptz + interval '1 day', "
                "array[[1, 2], [3, 4]], array['x', null], json_build_object('n', 1, 'a', json_build_array(1, 2)), "
                "'NaN'::numeric")

    async def main() -> tuple[object, ...]:
        conn = await asyncpg_connect(proxy, dbname)
        try:
            await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
            echoed = tuple(await conn.fetchrow(roundtrip, *params))
            values = tuple(await conn.fetchrow(computed))
            adult = [tuple(r) for r in await conn.fetch("select * from adult order by id")]
            return echoed, values, adult
        finally:
            await conn.close()

    echoed, values, adult = asyncio.run(main())
    assert echoed == params
    assert values[:5] == (42, 12345678901234, Decimal("4.5"), "ababab", b"\x00\xff" * 100000)
    assert values[5] == dt.datetime(2000, 1, 2, tzinfo=dt.UTC)
    assert values[6:8] == ([[1, 2], [3, 4]], ["x", None])
    assert json.loads(values[8]) == {"n": 1, "a": [1, 2]}
    assert values[9].is_nan()
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert adult == conn.execute("select * from adult order by id").fetchall()
    assert len(adult) == 30162


def test_asyncpg_copy(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    base = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    records = [(i, f"name {i}", Decimal(i) / 100, base + dt.timedelta(seconds=i), [f"t{i % 3}", None])
               for i in range(10000)]
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        conn.execute("create table records(id int, name text, amount numeric, at timestamptz, tags text[])")
        conn.execute("create table adult_copy (like adult)")

        def direct_copy(statement: str) -> bytes:
            data = io.BytesIO()
            with conn.cursor().copy(statement) as copy:
                for block in copy:
                    data.write(block)
            return data.getvalue()

        expected_csv = direct_copy("copy (select * from adult where age > 60 order by id) to stdout (format csv)")
        expected_binary = direct_copy("copy adult to stdout (format binary)")

    async def main() -> tuple[str, bytes, bytes, str]:
        conn = await asyncpg_connect(proxy, dbname)
        try:
            status = await conn.copy_records_to_table("records", records=records)
            csv_out, binary_out = io.BytesIO(), io.BytesIO()
            await conn.copy_from_query("select * from adult where age > $1 order by id", 60, output=csv_out,
                                       format="csv")
            await conn.copy_from_table("adult", output=binary_out, format="binary")
            loaded = await conn.copy_to_table("adult_copy", source=io.BytesIO(csv_out.getvalue()), format="csv")
            return status, csv_out.getvalue(), binary_out.getvalue(), loaded
        finally:
            await conn.close()

    status, csv_out, binary_out, loaded = asyncio.run(main())
    assert status == "COPY 10000"
    assert csv_out == expected_csv and expected_csv.count(b"\n") > 1000
    assert binary_out == expected_binary
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert conn.execute("select * from records order by id").fetchall() == records
        over_60 = conn.execute("select count(*) from adult where age > 60").fetchone()[0]
        assert loaded == f"COPY {over_60}"
        assert conn.execute("select count(*) from (select * from adult where age > 60 except all "
                            "select * from adult_copy) d").fetchone() == (0,)


def test_asyncpg_transaction_rollback(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    async def main() -> tuple[bool, str]:
        conn = await asyncpg_connect(proxy, dbname)
        try:
            await conn.execute("create table tx(id int primary key)")
            with pytest.raises(RuntimeError, match="abandon"):
                async with conn.transaction():
                    await conn.executemany("insert into tx values ($1)", [(1,), (2,)])
                    assert await conn.fetchval("select count(*) from tx") == 2
                    raise RuntimeError("abandon")
            async with conn.transaction():
                await conn.execute("insert into tx values (3)")
                await conn.execute("insert into tx values (4)")
                with pytest.raises(asyncpg.UniqueViolationError):
                    async with conn.transaction():  # a savepoint, rolled back alone
                        await conn.execute("insert into tx values (5)")
                        await conn.execute("insert into tx values (4)")
                await conn.execute("insert into tx values (6)")
            tx = conn.transaction()
            await tx.start()
            with pytest.raises(asyncpg.DivisionByZeroError):
                await conn.fetchval("select 1/0")
            with pytest.raises(asyncpg.InFailedSQLTransactionError):
                await conn.fetchval("select 1")
            await tx.rollback()
            return conn.is_in_transaction(), await conn.fetchval("select string_agg(id::text, ',' order by id) from tx")
        finally:
            await conn.close()

    in_transaction, ids = asyncio.run(main())
    assert not in_transaction
    assert ids == "3,4,6"
    with psycopg.connect(direct.dsn(dbname)) as conn:
        assert [i for (i,) in conn.execute("select id from tx order by id")] == [3, 4, 6]


def test_asyncpg_cancel_on_timeout(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    """asyncio.wait_for cancels the query with a CancelRequest; repeated so that it reaches both workers."""

    async def main() -> list[tuple[float, object]]:
        conn = await asyncpg_connect(proxy, dbname, server_settings={"application_name": "asyncpg-cancel"})
        outcomes = []
        try:
            for i in range(4):
                start = time.monotonic()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(conn.fetch("select pg_sleep(10)"), 0.5)
                # Waits until the cancelled query has ended: ~10 s if the cancel went nowhere.
                value = await conn.fetchval("select $1::int + 1", i)
                outcomes.append((time.monotonic() - start, value))
        finally:
            await conn.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert [value for _, value in outcomes] == [1, 2, 3, 4]
    # each well before the 10 s of its sleep: the cancel ended it (room for a loaded machine)
    assert all(elapsed < 7.0 for elapsed, _ in outcomes), outcomes
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        running = conn.execute("select count(*) from pg_stat_activity where query like 'select pg_sleep%' "
                               "and state = 'active' and application_name = 'asyncpg-cancel'").fetchone()
        assert running == (0,)


class CancelDelayingRelay:
    """A TCP relay in front of PostgreSQL that passes CancelRequests on only after ``delay`` seconds.

    It records when the server, having acted on each cancel request, closed that connection.
    Everything else is piped through untouched.
    """

    def __init__(self, host: str, port: int, delay: float) -> None:
        self.upstream = (host, port)
        self.delay = delay
        self.port = 0
        self.cancels_done: list[float] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop)
        self._server = server.result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(8)
            if struct.unpack("!ii", head) == (8, 80877103):  # SSLRequest: no, as the server (ssl off) would say
                writer.write(b"N")
                head = await reader.readexactly(8)
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            if struct.unpack("!ii", head) == (16, 80877102):  # CancelRequest
                packet = head + await reader.readexactly(8)
                await asyncio.sleep(self.delay)
                upstream_writer.write(packet)
                await upstream_reader.read()  # the server hangs up once it has signalled the backend
                self.cancels_done.append(time.monotonic())
                upstream_writer.close()
                return
            upstream_writer.write(head)
            await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


def test_cancel_is_acknowledged_after_the_server_acted(pg_server: EmbeddedPostgres, dbname: str,
                                                       tmp_path: Path) -> None:
    """A client takes the server hanging up its CancelRequest connection as "the cancel is done".

    libpq waits for that ("Without this delay, we might issue another command only to find that our
    cancel zaps that command instead of the one we thought we were canceling"), and so do asyncpg and
    pgjdbc. The proxy must therefore hold the client's cancel connection open until the server has
    closed the upstream one, also when another worker owns the key. A relay that delays cancel
    requests makes the ordering observable; repeated so that both workers are exercised.
    """
    with CancelDelayingRelay(pg_server.host, pg_server.port, delay=0.5) as relay:
        relayed = start_proxy(f"host=127.0.0.1 port={relay.port}", tmp_path / "anonproxy.log", workers="2")
        observations = []
        try:
            for _ in range(4):
                with psycopg.connect(relayed.endpoint.dsn(dbname), autocommit=True) as conn:
                    outcome: dict[str, object] = {}
                    thread = threading.Thread(target=_sleep_query, args=(conn, outcome))
                    thread.start()
                    time.sleep(0.3)
                    already_done = len(relay.cancels_done)
                    conn.cancel_safe(timeout=5)
                    acknowledged = time.monotonic()
                    server_done = list(relay.cancels_done[already_done:])
                    thread.join(10)
                    observations.append((outcome.get("result"), server_done[:1], acknowledged))
        finally:
            stop_proxy(relayed)
        assert "Traceback" not in relayed.log(), relayed.log()
    for result, server_done, acknowledged in observations:
        assert result == "cancelled"
        assert server_done and server_done[0] <= acknowledged, "the client was told the cancel was done too early"


def _sleep_query(conn: psycopg.Connection, outcome: dict[str, object]) -> None:
    try:
        conn.execute("select pg_sleep(10)")
        outcome["result"] = "finished"
    except psycopg.errors.QueryCanceled:
        outcome["result"] = "cancelled"


def test_asyncpg_listen_notify(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    async def main() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        listener = await asyncpg_connect(proxy, dbname)
        sender = await asyncpg_connect(proxy, dbname)
        received: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

        def on_notify(_conn: object, _pid: int, channel: str, payload: str) -> None:
            received.put_nowait((channel, payload))

        try:
            await listener.add_listener("anonproxy_chan", on_notify)
            await sender.execute("notify anonproxy_chan, 'one'")
            await sender.execute("select pg_notify('anonproxy_chan', $1)", "two ✓")
            async with sender.transaction():
                await sender.execute("notify anonproxy_chan, 'three'")
                await sender.execute("notify other_chan, 'not listened to'")
                await asyncio.sleep(0.2)
                assert received.qsize() <= 2  # 'three' waits for the commit
            # The listener is idle: the server pushes this one unprompted through the proxy.
            await asyncio.to_thread(_notify_directly, direct, dbname, "anonproxy_chan", "four")
            first = [await asyncio.wait_for(received.get(), 5) for _ in range(4)]
            await listener.remove_listener("anonproxy_chan", on_notify)
            await sender.execute("notify anonproxy_chan, 'five'")
            await asyncio.sleep(0.3)
            late = []
            while not received.empty():
                late.append(received.get_nowait())
            assert await listener.fetchval("select 7") == 7
            return first, late
        finally:
            await listener.close()
            await sender.close()

    first, late = asyncio.run(main())
    assert first == [("anonproxy_chan", "one"), ("anonproxy_chan", "two ✓"), ("anonproxy_chan", "three"),
                     ("anonproxy_chan", "four")]
    assert late == []


def _notify_directly(direct: Endpoint, dbname: str, channel: str, payload: str) -> None:
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as conn:
        conn.execute("select pg_notify(%s, %s)", [channel, payload])


# -- JDBC ----------------------------------------------------------------------------------


def jdbc_jar() -> str:
    """The PostgreSQL JDBC driver: the Debian package's, else Maven's cache, else install the package."""
    def find() -> str | None:
        if Path("/usr/share/java/postgresql.jar").is_file():
            return "/usr/share/java/postgresql.jar"
        cached = sorted(glob.glob(os.path.expanduser("~/.m2/repository/org/postgresql/postgresql/*/postgresql-*.jar")))
        return cached[-1] if cached else None

    jar = find()
    if jar is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "libpostgresql-jdbc-java"]
        done = subprocess.run(install, env=env, check=False, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, check=False, capture_output=True, timeout=300)
            done = subprocess.run(install, env=env, check=False, capture_output=True, text=True, timeout=300)
        jar = find()
        if jar is None:
            pytest.fail(f"no PostgreSQL JDBC driver and `{' '.join(install)}` failed:\n{done.stdout}\n{done.stderr}")
    return jar


def test_jdbc(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    java = shutil.which("java")
    assert java, "java (17+) is required for the JDBC client test"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(CLIENTS / "JdbcClient.java"), proxy.host, str(proxy.port),
                           dbname, "scram_user", "scram_user"], check=False, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, f"JdbcClient failed:\n{done.stdout}\n{done.stderr}"
    out = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert out.get("done") == "ok", done.stdout

    with psycopg.connect(direct.dsn(dbname)) as conn:
        rows = conn.execute("select id, age, workclass, fnlwgt, education, hours_per_week, "
                            "round(capital_gain::numeric / 7, 6) from adult where id <= 12 order by id").fetchall()
        aggregates = conn.execute("select age, count(*), sum(fnlwgt), round(avg(hours_per_week), 6) from adult "
                                  "where age between 20 and 29 group by age order by age").fetchall()
        copy_out = io.BytesIO()
        with conn.cursor().copy("copy (select id, age, education, income from adult order by id) to stdout") as copy:
            for block in copy:
                copy_out.write(block)
        batch = conn.execute("select count(*), sum(amount), count(distinct name) from jdbc_batch").fetchone()
        copied = conn.execute("select count(*), sum(id), count(*) filter (where label = 'label ' || id) "
                              "from jdbc_copy").fetchone()
        adult_count = conn.execute("select count(*) from adult").fetchone()[0]

    assert any(row[6] != 0 for row in rows)  # some numerics are not zero
    for mode in ("default", "binary"):
        for row in rows:
            assert out[f"row.{mode}.{row[0]}"] == "|".join(str(v) for v in row[1:]), mode
        for age, count, total, average in aggregates:
            assert out[f"agg.{mode}.{age}"] == f"{count}|{total}|{average}", mode
        # After prepareThreshold executions pgjdbc uses named server-side statements.
        assert out[f"server_prepare.{mode}"] == "true"
        assert int(out[f"named_statements.{mode}"]) >= 2
    assert (out["batch.statements"], out["batch.rows"]) == ("1000", "1000")
    assert batch == (1000, sum(Decimal(i) / 100 for i in range(1, 1001)), 1000)
    assert out["copy_in.rows"] == "5000"
    assert copied == (5000, sum(range(5000)), 5000)
    expected = copy_out.getvalue()
    assert out["copy_out.rows"] == str(adult_count)
    assert (int(out["copy_out.bytes"]), out["copy_out.sha256"]) == (len(expected), hashlib.sha256(expected).hexdigest())
    assert out["cancel.sqlstate"] == "57014"  # query_canceled
    assert int(out["cancel.after_cancel_ms"]) < 7000, out  # well before the 10 s sleep's end: the cancel ended it
    assert out["cancel.then_count"] == str(adult_count)


# -- node-postgres -------------------------------------------------------------------------


def ensure_node_modules() -> None:
    if (NODE_DIR / "node_modules" / "pg" / "package.json").is_file():
        return
    npm = shutil.which("npm")
    assert npm, "npm is required for the node-postgres test"
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=False,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not (NODE_DIR / "node_modules" / "pg").is_dir():
        pytest.fail(f"npm install in {NODE_DIR} failed:\n{done.stdout}\n{done.stderr}")


def test_node_postgres(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    ensure_node_modules()
    node = shutil.which("node")
    assert node, "node is required for the node-postgres test"
    done = run([node, "client.js"], libpq_env(proxy, dbname), cwd=NODE_DIR)
    assert done.returncode == 0, f"client.js failed:\n{done.stdout}\n{done.stderr}"
    out = json.loads(done.stdout)

    named_query = "select count(*)::int as n, sum(fnlwgt)::text as total from adult where education = $1"
    with psycopg.connect(direct.dsn(dbname)) as conn:
        count = conn.execute("select count(*) from adult").fetchone()[0]
        cur = conn.execute("select id, age, workclass, fnlwgt, education from adult where age = 45 and sex = 'Female' "
                           "order by id limit 5")
        param_rows = [dict(zip([c.name for c in cur.description], row)) for row in cur.fetchall()]
        named = {}
        for education in ("Bachelors", "HS-grad", "Masters", "Doctorate"):
            n, total = conn.execute(named_query.replace("$1", "%s"), [education]).fetchone()
            named[education] = {"n": n, "total": total}
        multi = conn.execute("select array_agg(x order by x) from node_multi").fetchone()[0]
        tx = conn.execute("select id, note from node_tx order by id").fetchall()
    missing_table = direct_error(direct, dbname, "select * from no_such_table")
    bad_int = direct_error(direct, dbname, "select 'not a number'::int")

    assert out["simple_count"] == count == 30162
    assert [(r["command"], r["rowCount"]) for r in out["multi"]] == [("CREATE", None), ("INSERT", 3), ("SELECT", 1)]
    assert out["multi"][2]["rows"] == [{"s": 6}] and multi == [1, 2, 3]
    assert out["param_fields"] == ["id", "age", "workclass", "fnlwgt", "education"]
    assert out["param_rows"] == param_rows and len(param_rows) == 5
    assert out["named"] == {k: [v] * (2 if k in ("Bachelors", "HS-grad") else 1) for k, v in named.items()}
    assert out["prepared_statements"] == [{"name": "q", "statement": named_query}]
    assert tx == [(i, f"committed {i}") for i in range(10, 15)]
    assert out["simple_error"] == {"code": "42P01", "message": missing_table.diag.message_primary, "severity": "ERROR"}
    assert out["after_simple_error"] == 2
    assert out["extended_error"] == {"code": bad_int.sqlstate, "message": bad_int.diag.message_primary}
    assert out["after_extended_error"] == 42
    assert (out["tx_error"], out["aborted_tx"]) == ("22012", "25P02")
    assert out["named_after_errors"] == named["Doctorate"]
