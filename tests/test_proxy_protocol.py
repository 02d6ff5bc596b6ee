"""Protocol v3 through the real proxy with psycopg 3: every feature a client may use."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from conftest import AUTH_ROLES, Endpoint
from psycopg import sql


def test_simple_query_and_multi_statement_string(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        cur = conn.execute("create table t(x int); insert into t values (1), (2); select sum(x) from t")
        assert cur.statusmessage == "CREATE TABLE"
        assert cur.nextset() and cur.statusmessage == "INSERT 0 2"
        assert cur.nextset() and cur.fetchone() == (3,)
        assert conn.execute("select count(*) from adult").fetchone() == (30162,)


def test_extended_protocol_text_and_binary(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname)) as conn:
        for binary in (False, True):
            cur = conn.cursor(binary=binary)
            cur.execute("select age, workclass, fnlwgt from adult where id = %s", [1])
            assert cur.fetchone() == (39, "State-gov", 77516)
            cur.execute("select %s::numeric * 2, %s::text, %s::bytea", [1.25, "é", b"\x00\xff"])
            assert cur.fetchone() == (pytest.approx(2.5), "é", b"\x00\xff")


def test_server_side_prepared_statements(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), prepare_threshold=0) as conn:
        for age in (25, 40, 60):
            count = conn.execute("select count(*) from adult where age = %s", [age]).fetchone()
            expected = conn.execute(sql.SQL("select count(*) from adult where age = {}").format(age),
                                    prepare=False).fetchone()
            assert count == expected
        prepared = conn.execute("select name from pg_prepared_statements").fetchall()
        assert prepared, "psycopg should have prepared a named statement upstream"


def test_pipeline_mode(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname)) as conn, conn.pipeline():
        cursors = [conn.execute("select %s::int * 10", [i]) for i in range(50)]
        conn.execute("create temp table p(x int)")
        conn.cursor().executemany("insert into p values (%s)", [(i,) for i in range(100)])
        total = conn.execute("select sum(x) from p")
        assert [c.fetchone()[0] for c in cursors] == [i * 10 for i in range(50)]
        assert total.fetchone() == (4950,)


def test_pipeline_error_recovers(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero), conn.pipeline():
            conn.execute("select 1")
            conn.execute("select 1/0")
            conn.execute("select 2")
        assert conn.execute("select 3").fetchone() == (3,)


def test_copy_in_and_out(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        conn.execute("create table c(id int, name text)")
        with conn.cursor().copy("copy c from stdin") as copy:
            for i in range(5000):
                copy.write_row((i, f"name {i}"))
        assert conn.execute("select count(*), sum(id) from c").fetchone() == (5000, sum(range(5000)))
        with conn.cursor().copy("copy (select id, education from adult order by id) to stdout") as copy:
            rows = list(copy.rows())
        assert len(rows) == 30162 and rows[0] == ("1", "Bachelors")
        with conn.cursor(binary=True).copy("copy (select id from adult where id <= 3) to stdout (format binary)") as copy:
            copy.set_types(["int4"])
            assert list(copy.rows()) == [(1,), (2,), (3,)]


def test_copy_in_error_is_reported(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        conn.execute("create table c(id int)")
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            with conn.cursor().copy("copy c from stdin") as copy:
                copy.write(b"1\nnot a number\n")
        assert conn.execute("select count(*) from c").fetchone() == (0,)


def test_notice_and_error_responses(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("do $$ begin raise notice 'hello %', 42; end $$")
        assert notices == ["hello 42"]
        with pytest.raises(psycopg.errors.UndefinedTable) as caught:
            conn.execute("select * from no_such_table")
        assert caught.value.sqlstate == "42P01"
        assert conn.execute("select 1").fetchone() == (1,)


def test_listen_notify(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), autocommit=True) as listener, \
            psycopg.connect(proxy.dsn(dbname), autocommit=True) as sender:
        listener.execute("listen anonproxy_channel")
        sender.execute("notify anonproxy_channel, 'payload 1'")
        received = next(listener.notifies(timeout=20, stop_after=1))
        assert (received.channel, received.payload) == ("anonproxy_channel", "payload 1")


@pytest.mark.parametrize("role", sorted(AUTH_ROLES))
def test_authentication_methods_are_relayed(proxy: Endpoint, dbname: str, role: str) -> None:
    with psycopg.connect(proxy.dsn(dbname, user=role)) as conn:
        assert conn.execute("select current_user").fetchone() == (role,)


@pytest.mark.parametrize("role", ["scram_user", "md5_user", "dba"])
def test_wrong_password_is_refused_by_the_server(proxy: Endpoint, dbname: str, role: str) -> None:
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(proxy.dsn(dbname, user=role, password="wrong"))


def test_startup_parameters_reach_the_server(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname), application_name="metabase", options="-c search_path=pg_catalog") as conn:
        row = conn.execute("select current_setting('application_name'), current_setting('search_path')").fetchone()
        assert row == ("metabase", "pg_catalog")
        assert conn.info.parameter_status("application_name") == "metabase"
        assert conn.info.parameter_status("server_version", ).startswith("15")


def test_client_sees_its_backends_pid(proxy: Endpoint, dbname: str) -> None:
    with psycopg.connect(proxy.dsn(dbname)) as conn:
        upstream_pid = conn.execute("select pg_backend_pid()").fetchone()[0]
        assert conn.info.backend_pid == upstream_pid


def _run_sleep(conn: psycopg.Connection, seconds: float, outcome: dict[str, object]) -> None:
    start = time.monotonic()
    try:
        conn.execute(f"select pg_sleep({seconds})")
        outcome["result"] = "finished"
    except psycopg.errors.QueryCanceled:
        outcome["result"] = "cancelled"
    outcome["elapsed"] = time.monotonic() - start


def test_cancel_stops_the_right_query(proxy: Endpoint, dbname: str) -> None:
    """Repeated so that cancel requests land on both workers, owner and not."""
    for _ in range(6):
        with psycopg.connect(proxy.dsn(dbname), autocommit=True) as victim, \
                psycopg.connect(proxy.dsn(dbname), autocommit=True) as bystander:
            cancelled: dict[str, object] = {}
            untouched: dict[str, object] = {}
            threads = [threading.Thread(target=_run_sleep, args=(victim, 10, cancelled)),
                       threading.Thread(target=_run_sleep, args=(bystander, 1.5, untouched))]
            for thread in threads:
                thread.start()
            time.sleep(0.3)
            victim.cancel_safe(timeout=5)
            for thread in threads:
                thread.join(15)
            assert cancelled["result"] == "cancelled"
            # well before its 10 s: the cancel ended it (a bound with room for a loaded machine, not a timing)
            assert cancelled["elapsed"] < 7.0
            assert untouched["result"] == "finished"
            assert victim.execute("select 1").fetchone() == (1,)


def test_cancel_with_a_wrong_key_does_nothing(proxy: Endpoint, dbname: str) -> None:
    import socket
    import struct

    with psycopg.connect(proxy.dsn(dbname)) as conn:
        outcome: dict[str, object] = {}
        thread = threading.Thread(target=_run_sleep, args=(conn, 1, outcome))
        thread.start()
        time.sleep(0.2)
        with socket.create_connection((proxy.host, proxy.port)) as sock:
            sock.sendall(struct.pack("!iiii", 16, 80877102, conn.info.backend_pid, 12345))
            assert sock.recv(1) == b""  # the proxy hangs up without a word, as PostgreSQL does
        thread.join(5)
        assert outcome["result"] == "finished"


def test_client_vanishing_mid_query_cancels_it(proxy: Endpoint, direct: Endpoint, dbname: str) -> None:
    conn = psycopg.connect(proxy.dsn(dbname), application_name="vanishing")
    conn.pgconn.send_query(b"select pg_sleep(120)")
    time.sleep(0.3)
    conn.pgconn.finish()  # close the socket without Terminate, mid-query
    with psycopg.connect(direct.dsn(dbname), autocommit=True) as admin:
        deadline = time.monotonic() + 30  # a bound for a loaded machine; the query alone would run for 120 s
        while admin.execute("select count(*) from pg_stat_activity where application_name = 'vanishing' "
                            "and state = 'active'").fetchone() != (0,):
            assert time.monotonic() < deadline, "the abandoned query is still running"
            time.sleep(0.1)
