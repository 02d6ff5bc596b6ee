"""The embedded server, the sample data, the schema installer and the demo roles, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import csv
import gzip
import io
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest

from anonproxy.demo import DEMO_ROLES, create_demo_roles
from anonproxy.embedded import EmbeddedPostgres, EmbeddedPostgresError, find_pg_bindir
from anonproxy.sample_data import ADULT_COLUMNS, adult_rows, load_adult
from anonproxy.schema import SchemaError, install, installed_versions, migrations

AUTH_OK, AUTH_MD5, AUTH_SASL = 0, 5, 10
is_root = os.geteuid() == 0


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(
        hba_extra=[
            "host all md5user 127.0.0.1/32 md5",
            "host all trustuser 127.0.0.1/32 trust",
        ],
        settings={"cluster_name": "anon'proxy \\ test", "work_mem": "8MB"},
    )
    pg.start()
    yield pg
    pg.stop()


@pytest.fixture(scope="module")
def adult_server(server: EmbeddedPostgres) -> EmbeddedPostgres:
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        load_adult(conn)
    return server


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A temp dir the server's OS account can enter even when we are root."""
    path = Path(tempfile.mkdtemp(prefix="anonproxy-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def superuser(pg: EmbeddedPostgres, dbname: str = "postgres") -> psycopg.Connection:
    return psycopg.connect(pg.conninfo(dbname=dbname), autocommit=True)


def scalar(conn: psycopg.Connection, query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def first_auth_request(pg: EmbeddedPostgres, user: str) -> tuple[int, bytes]:
    """Send a StartupMessage and return the server's first Authentication request (code, payload)."""
    params = b"user\0" + user.encode() + b"\0database\0postgres\0\0"
    with socket.create_connection((pg.host, pg.port), timeout=5) as sock:
        sock.sendall(struct.pack("!ii", 8 + len(params), 3 << 16) + params)
        stream = sock.makefile("rb")
        kind, length = struct.unpack("!ci", stream.read(5))
        body = stream.read(length - 4)
    assert kind == b"R", body
    return struct.unpack("!i", body[:4])[0], body[4:]


# -- the server ----------------------------------------------------------------


def test_find_pg_bindir_holds_the_server_programs() -> None:
    bindir = find_pg_bindir()
    for program in ("initdb", "pg_ctl", "postgres"):
        assert os.access(bindir / program, os.X_OK)


def test_throwaway_server_settings(server: EmbeddedPostgres) -> None:
    assert server.data_dir is not None and server.socket_dir == server.data_dir
    assert (server.socket_dir / f".s.PGSQL.{server.port}").is_socket()
    with superuser(server) as conn:
        show = {name: scalar(conn, f"show {name}") for name in (
            "listen_addresses", "port", "fsync", "password_encryption", "server_encoding", "lc_collate",
            "cluster_name", "work_mem",
        )}  # fmt: skip
        stored = scalar(conn, "select rolpassword from pg_authid where rolname = 'postgres'")
    assert show == {
        "listen_addresses": "127.0.0.1",
        "port": str(server.port),
        "fsync": "off",
        "password_encryption": "scram-sha-256",
        "server_encoding": "UTF8",
        "lc_collate": "C",
        "cluster_name": "anon'proxy \\ test",
        "work_mem": "8MB",
    }
    assert stored.startswith("SCRAM-SHA-256$")


def test_scram_is_required_and_a_wrong_password_fails_with_28P01(server: EmbeddedPostgres) -> None:
    code, mechanisms = first_auth_request(server, "postgres")
    assert code == AUTH_SASL and b"SCRAM-SHA-256\0" in mechanisms

    async def connect_with_wrong_password() -> None:
        await asyncpg.connect(
            host=server.host, port=server.port, user="postgres", password="wrong", database="postgres"
        )

    with pytest.raises(asyncpg.InvalidPasswordError) as excinfo:
        asyncio.run(connect_with_wrong_password())
    assert excinfo.value.sqlstate == "28P01"


def test_hba_extra_lines_come_before_the_scram_default(server: EmbeddedPostgres) -> None:
    with superuser(server) as conn:
        conn.execute("set password_encryption = 'md5'")
        for role in ("md5user", "trustuser", "scramuser"):
            conn.execute(f"drop role if exists {role}")
            conn.execute(f"create role {role} login password 'secret'")
    assert first_auth_request(server, "md5user")[0] == AUTH_MD5
    assert first_auth_request(server, "trustuser")[0] == AUTH_OK
    # Every other role falls through to the default rule.
    assert first_auth_request(server, "scramuser")[0] == AUTH_SASL
    with psycopg.connect(server.conninfo("trustuser")) as conn:
        assert conn.execute("select current_user").fetchone() == ("trustuser",)
    with psycopg.connect(server.conninfo("md5user", "secret")) as conn:
        assert conn.execute("select current_user").fetchone() == ("md5user",)


def test_a_taken_port_fails_clearly_and_cleans_up(server: EmbeddedPostgres) -> None:
    other = EmbeddedPostgres(port=server.port)
    with pytest.raises(EmbeddedPostgresError, match=f"port {server.port} on 127.0.0.1 is already in use") as excinfo:
        other.start(timeout=10)
    assert "Address already in use" in str(excinfo.value)  # the log tail
    assert other.data_dir is not None and not other.data_dir.exists()
    other.stop()  # idempotent, nothing to do


def test_persistent_data_dir_keeps_data_and_password(reachable_dir: Path) -> None:
    data_dir = reachable_dir / "pgdata"
    with EmbeddedPostgres(data_dir) as first:
        password = first.password
        with superuser(first) as conn:
            assert conn.execute("show fsync").fetchone() == ("on",)
            conn.execute("create table kept (v text)")
            conn.execute("insert into kept values ('still here')")
        with pytest.raises(EmbeddedPostgresError, match="already running"):
            EmbeddedPostgres(data_dir).start()
    password_file = data_dir / "anonproxy-superuser.password"
    assert password_file.stat().st_mode & 0o777 == 0o600
    assert data_dir.exists() and not (data_dir / "postmaster.pid").exists()

    with EmbeddedPostgres(data_dir) as second:
        assert second.password == password
        with superuser(second) as conn:
            assert conn.execute("select v from kept").fetchall() == [("still here",)]


def test_a_foreign_non_empty_dir_is_refused(reachable_dir: Path) -> None:
    (reachable_dir / "notes.txt").write_text("not a database")
    with pytest.raises(EmbeddedPostgresError, match="is not empty and is not a PostgreSQL data directory"):
        EmbeddedPostgres(reachable_dir).start()


@pytest.mark.skipif(not is_root, reason="only root hands the data directory to the postgres OS user")
def test_a_data_dir_the_postgres_user_cannot_reach_is_refused() -> None:
    private = Path(tempfile.mkdtemp(prefix="anonproxy-test-"))  # mode 0700, owned by root
    try:
        with pytest.raises(EmbeddedPostgresError, match="'postgres' OS user, which runs PostgreSQL, cannot write"):
            EmbeddedPostgres(private / "pgdata").start()
    finally:
        shutil.rmtree(private)


# -- sample data ---------------------------------------------------------------


def complete_rows_in_shipped_file() -> int:
    """Counted without anonproxy.sample_data: a plain csv read of the shipped file."""
    raw = files("anonproxy.data").joinpath("adult.data.gz").read_bytes()
    reader = csv.reader(io.StringIO(gzip.decompress(raw).decode("ascii")))
    return sum(1 for fields in reader if len(fields) == 15 and all(f.strip() != "?" for f in fields))


def test_adult_rows_are_the_complete_rows() -> None:
    rows = list(adult_rows())
    assert len(rows) == complete_rows_in_shipped_file() == 30162
    assert [row[0] for row in rows] == list(range(1, 30163))
    assert all(len(row) == len(ADULT_COLUMNS) for row in rows)


def test_load_adult(adult_server: EmbeddedPostgres) -> None:
    with superuser(adult_server) as conn:
        assert conn.execute("select count(*), min(id), max(id), count(distinct id) from adult").fetchone() == (
            30162, 1, 30162, 30162,
        )  # fmt: skip
        columns = conn.execute(
            "select column_name, data_type from information_schema.columns"
            " where table_name = 'adult' order by ordinal_position"
        ).fetchall()
        first = conn.execute("select * from adult where id = 1").fetchone()
        assert conn.execute("select reltuples from pg_class where oid = 'adult'::regclass").fetchone() == (30162,)
        assert load_adult(conn) == 30162  # already there: nothing to do
        assert conn.execute("select count(*) from adult").fetchone() == (30162,)
    assert [name for name, _ in columns] == list(ADULT_COLUMNS)
    types = {name: data_type for name, data_type in columns}
    assert types["age"] == "integer" and types["workclass"] == "text"
    assert first == (
        1, 39, "State-gov", 77516, "Bachelors", 13, "Never-married", "Adm-clerical",
        "Not-in-family", "White", "Male", 2174, 0, 40, "United-States", "<=50K",
    )  # fmt: skip


# -- schema --------------------------------------------------------------------


def test_migrations_are_shipped_in_order() -> None:
    found = migrations()
    assert [m.version for m in found] == sorted({m.version for m in found})
    assert found[0].version == 1 and found[0].name == "anonproxy_schema"
    assert "anonproxy.schema_migrations" in found[0].sql


def test_install_applies_once_without_superuser(server: EmbeddedPostgres) -> None:
    with superuser(server) as conn:
        conn.execute("drop database if exists install_test")
        conn.execute("drop role if exists installer")
        conn.execute("create role installer login password 'installer'")
        conn.execute("create database install_test owner installer")
    with psycopg.connect(server.conninfo("installer", "installer", "install_test")) as conn:
        latest = [m.version for m in migrations()]
        assert install(conn) == latest
        assert install(conn) == []
        assert installed_versions(conn) == latest
        assert conn.execute("select version, name from anonproxy.schema_migrations where version = 1").fetchone() == (
            1, "anonproxy_schema",
        )  # fmt: skip
        conn.execute("select 1")  # now inside a transaction
        with pytest.raises(SchemaError, match="not inside a transaction"):
            install(conn)


# -- demo roles ----------------------------------------------------------------


def test_demo_roles(adult_server: EmbeddedPostgres) -> None:
    with superuser(adult_server) as conn:
        install(conn)
        create_demo_roles(conn, "postgres")
        create_demo_roles(conn, "postgres")  # idempotent
        verifiers = conn.execute(
            "select rolname, rolpassword, rolsuper from pg_authid where rolname = any(%s)", (list(DEMO_ROLES),)
        ).fetchall()
    assert {name for name, _, _ in verifiers} == set(DEMO_ROLES)
    assert all(verifier.startswith("SCRAM-SHA-256$") and not is_super for _, verifier, is_super in verifiers)

    with psycopg.connect(adult_server.conninfo("dba", "dba")) as conn:
        assert conn.execute("select count(*) from adult").fetchone() == (30162,)
        # The tour's DBA builds a release without being a superuser.
        conn.execute("select * from anonproxy.create_anonymized_view(source => 'public.adult', "
                     "target => 'public.demo_release', quasi_identifiers => array['age', 'sex'], k => 10)")
        assert conn.execute("select created_by from anonproxy.releases where target = 'public.demo_release'"
                            ).fetchone() == ("dba",)
        conn.rollback()

    for role in ("reporter", "analyst"):
        with psycopg.connect(adult_server.conninfo(role, role), autocommit=True) as conn:
            assert conn.execute("select count(*) from pg_class where relname = 'adult'").fetchone() == (1,)
            for statement in (
                "select count(*) from adult",
                "create table public.mine (id integer)",
                "create temporary table mine (id integer)",
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege) as excinfo:
                    conn.execute(statement)
                assert excinfo.value.sqlstate == "42501"
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for table adult"):
                conn.execute("select count(*) from adult")
