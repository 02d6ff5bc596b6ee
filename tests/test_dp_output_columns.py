"""dp answers have the column names and types PostgreSQL gives the same statement run directly.

Each statement runs twice: as the owner directly (PostgreSQL's names and type OIDs) and as a dp role through the
proxy. The table is the demo's adult with columns of every numeric type added (double precision, real, numeric,
bigint), so that sum, avg, stddev and the quantiles meet each argument type.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, parse_policy

DATABASE = "anonproxy_dp_columns"
ROLE = "dp_columns"

# Columns added to adult, with their types and the bounds the policy declares.
TYPED_COLUMNS = {"hours_f": ("double precision", "hours_per_week + 0.25", 0, 100),
                 "hours_r": ("real", "hours_per_week + 0.5", 0, 100),
                 "gain_n": ("numeric", "capital_gain / 4.0", 0, 25000),
                 "weight_b": ("bigint", "fnlwgt", 0, 1500000),
                 "age_s": ("smallint", "age", 15, 100),
                 "seen": ("date", "date '2020-01-01' + (id % 700)", None, None),
                 "seen_at": ("timestamp", "timestamp '2020-01-01' + (id % 700) * interval '1 hour'", None, None)}


def policy_text() -> str:
    """The demo policy with the typed columns declared (bounds) and a large budget for the dp role."""
    text = files("anonproxy.data").joinpath("demo_policy.yaml").read_text(encoding="utf-8")
    declared = "".join(f"      {name}: {{kind: sensitive, lower: {low}, upper: {high}}}\n" if low is not None
                       else f"      {name}: {{kind: quasi_identifier}}\n"
                       for name, (_, _, low, high) in TYPED_COLUMNS.items())
    text = text.replace("      income:", declared + "      income:", 1)
    return text + (f"  {ROLE}:\n    mode: dp\n    budgets:\n      public.adult: {{epsilon: 10000, delta: 0.1, "
                   "epsilon_per_query: 0.5, delta_per_query: 0.0000001}\n")


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: object) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")  # type: ignore[attr-defined]
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        for name, (type_, value, _, _) in TYPED_COLUMNS.items():
            conn.execute(f"alter table adult add column {name} {type_}")
            conn.execute(f"update adult set {name} = {value}")
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"drop role if exists {ROLE}")
        conn.execute(f"create role {ROLE} login password '{ROLE}'")
        apply_policy(conn, parse_policy(policy_text()))
        conn.commit()
    return DATABASE


@pytest.fixture(scope="module")
def proxy(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[ProxyProcess]:
    log_path: Path = tmp_path_factory.mktemp("dp_columns") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def analyst(proxy: ProxyProcess, database: str) -> Iterator[psycopg.Connection]:
    endpoint: Endpoint = proxy.endpoint
    with psycopg.connect(endpoint.dsn(database, user=ROLE), autocommit=True) as conn:
        yield conn


STATEMENTS = [
    # grouping keys: functions, casts, CASE, arithmetic
    "select upper(education), count(*) from adult group by 1",
    "select lower(sex) as s, count(*) from adult group by 1",
    "select education::text, count(*) from adult group by 1",
    "select cast(sex as varchar), count(*) from adult group by 1",
    "select left(education, 3), count(*) from adult group by 1",
    "select substring(education from 1 for 2), count(*) from adult group by 1",
    "select trim(sex), count(*) from adult group by 1",
    "select coalesce(workclass, 'none'), count(*) from adult group by 1",
    "select case when age < 40 then 'young' else 'old' end, count(*) from adult group by 1",
    "select case when age < 40 then 'young' else sex end, count(*) from adult group by 1",
    "select age / 10 * 10, count(*) from adult group by 1",
    "select (age / 10)::integer, count(*) from adult group by 1",
    "select (age / 10)::bigint as decade, count(*) from adult group by 1",
    "select sex, (age / 10)::numeric, count(*) from adult group by 1, 2",
    # on dates and timestamps
    "select date_trunc('month', seen), count(*) from adult group by 1",
    "select date_trunc('day', seen_at) as day, count(*) from adult group by 1",
    "select extract(year from seen), count(*) from adult group by 1",
    "select to_char(seen_at, 'YYYY-MM'), count(*) from adult group by 1",
    "select seen::text, count(*) from adult group by 1",
    # count
    "select count(*), count(1), count(age) from adult",
    "select sex, count(*) filter (where age > 30) from adult group by sex",
    # sum of each argument type
    "select sum(age), sum(age_s), sum(weight_b), sum(gain_n), sum(hours_f), sum(hours_r) from adult",
    "select sum(1), sum(case when age > 30 then 1 else 0 end) from adult",
    "select sum(case when age > 30 then 1.5 else 0 end) from adult",
    # avg, stddev, variance of each argument type
    "select avg(age), avg(age_s), avg(weight_b), avg(gain_n), avg(hours_f), avg(hours_r) from adult",
    "select sex, stddev(hours_f), variance(hours_f), var_pop(hours_r), stddev_pop(hours_f) from adult group by sex",
    "select stddev(age), variance(gain_n), stddev_samp(weight_b), var_samp(age) from adult",
    "select avg(case when sex = 'Male' then 1 else 0 end) from adult",
    # quantiles
    "select percentile_cont(0.5) within group (order by age) from adult",
    "select percentile_disc(0.5) within group (order by age) from adult",
    "select percentile_disc(0.5) within group (order by hours_f) from adult",
    "select percentile_cont(0.25) within group (order by hours_f) from adult",
    # expressions over aggregates
    "select round(avg(age), 1) from adult",
    "select round(avg(hours_f)::numeric, 1), avg(hours_f) * 2 from adult",
    "select sum(capital_gain) / count(*) from adult",
    "select 100.0 * avg(case when sex = 'Male' then 1 else 0 end) from adult",
    "select sex, coalesce(sum(age), 0), avg(age)::float8 from adult group by sex",
    "select education, sum(hours_f) / count(*) as per_person from adult group by 1",
]


def described(conn: psycopg.Connection, statement: str) -> list[tuple[str, int]]:
    cursor = conn.execute(statement)
    assert cursor.description is not None
    cursor.fetchall()
    return [(column.name, column.type_code) for column in cursor.description]


@pytest.mark.parametrize("statement", STATEMENTS)
def test_names_and_types_are_postgresqls(owner: psycopg.Connection, analyst: psycopg.Connection,
                                         statement: str) -> None:
    assert described(analyst, statement) == described(owner, statement)


@pytest.mark.parametrize("statement", STATEMENTS[:3] + STATEMENTS[19:21])
def test_prepared_statements_describe_the_same_columns(owner: psycopg.Connection, analyst: psycopg.Connection,
                                                       statement: str) -> None:
    """A Describe before anything runs (extended protocol, prepared) names and types the columns alike."""
    with analyst.cursor() as cursor:
        cursor.execute(statement, prepare=True)
        assert cursor.description is not None
        assert [(c.name, c.type_code) for c in cursor.description] == described(owner, statement)


def test_a_float_average_follows_extra_float_digits(analyst: psycopg.Connection) -> None:
    """avg of a double precision column is double precision: extra_float_digits = -3 prints it with 12 digits."""
    analyst.execute("set extra_float_digits = -3")
    try:
        value = analyst.execute("select sum(hours_f) from adult where age < 100").fetchone()
        assert value is not None and isinstance(value[0], float)
        with analyst.cursor(binary=False) as cursor:
            cursor.execute("select avg(hours_f) / 3 from adult")
            text = cursor.pgresult.get_value(0, 0).decode()  # type: ignore[union-attr]
        assert len(text.replace(".", "").replace("-", "").lstrip("0")) <= 12, text
    finally:
        analyst.execute("set extra_float_digits = 1")
