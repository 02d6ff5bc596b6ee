"""Differential-privacy mode end to end: the `analyst` (demo budget: ε 10, 0.5 per query) through the proxy.

Each test uses its own role with its own budget, so tests do not spend each
other's budget. Truths are computed from a superuser connection.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    fresh_dp_role,
    start_proxy,
    stop_proxy,
    wait_for_current_policy,
    wait_for_version,
)

from anonproxy.embedded import EmbeddedPostgres

_names = itertools.count(1)


@pytest.fixture
def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A fresh dp role with ε 2 in all, 0.5 per query, on public.adult."""
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_analyst_{next(_names)}") as role:
        yield role


def budget_left(conn: psycopg.Connection) -> str:
    return conn.execute("show anonproxy.budget").fetchone()[0]


QUERY = "select education, count(*), avg(hours_per_week) from adult group by 1"


def test_noisy_answer_is_close_and_charged_once(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                                truth: psycopg.Connection) -> None:
    notices: list[tuple[str, str]] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.message_primary or "", d.message_detail or "")))
        assert "epsilon 2 of 2 left" in budget_left(conn)
        rows = conn.execute(QUERY).fetchall()
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        again = conn.execute("SELECT education, count(*), avg(hours_per_week)\n FROM adult GROUP BY 1").fetchall()
        assert again == rows, "the same question gets the same answer (no averaging)"
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "and costs nothing"
    expected = {education: (n, float(avg)) for education, n, avg in truth.execute(QUERY)}
    assert {row[0] for row in rows} == set(expected)  # public domain: every education, none invented
    # Count noise: discrete Laplace of scale 4 (ε/2 of 0.5: hours_per_week is NOT NULL, so avg shares the count;
    # sensitivity 1): |error| < 4·ln(1/1e-6) ≈ 56.
    assert all(abs(n - expected[education][0]) <= 56 for education, n, _ in rows)
    big = [row for row in rows if expected[row[0]][0] > 3000]
    assert all(abs(float(avg) - expected[education][1]) < 1.0 for education, _, avg in big)
    assert any(message.startswith("anonproxy: differentially private answer; it costs ε=0.5, δ=")
               and message.endswith("(basic composition)") for message, _ in notices)
    assert any("answered before" in message for message, _ in notices)
    assert any("95% interval" in detail for _, detail in notices)


def test_budget_runs_out(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for age in range(30, 34):  # four different questions of ε 0.5 each spend the whole ε 2
            conn.execute(f"select sex, count(*) from adult where age > {age} group by sex").fetchall()
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("select sex, count(*) from adult where age > 50 group by sex")
        assert caught.value.sqlstate == "53400"
        assert "epsilon 0 of 2 left" in budget_left(conn)


def test_differencing_costs_budget_and_gets_noise(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                                   truth: psycopg.Connection) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        everyone = conn.execute("select count(*) from adult").fetchone()[0]
        but_one = conn.execute("select count(*) from adult where id <> 17").fetchone()[0]
        assert "epsilon 1 of 2 left" in budget_left(conn)
    true_total = truth.execute("select count(*) from adult").fetchone()[0]
    assert abs(everyone - true_total) <= 28 and abs(but_one - (true_total - 1)) <= 28  # scale 2: 2·ln(1e6)


def test_refusals_in_dp_mode(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for query, words in [("select * from adult", "row-level"),
                             ("select sum(fnlwgt / age) from adult", "not allowed"),  # division by a column
                             ("select percentile_cont(0.5) within group (order by age desc) from adult",
                              "ascending"),
                             ("select count(*) from adult a join pg_catalog.pg_class c on c.oid = a.id",
                              "only the protected table and its linked tables")]:
            with pytest.raises(psycopg.Error, match=words) as caught:
                conn.execute(query)
            assert caught.value.sqlstate in ("0A000", "42501")
        assert "epsilon 2 of 2 left" in budget_left(conn), "refusals cost nothing"


def test_a_role_without_budget_is_refused(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                          truth: psycopg.Connection) -> None:
    truth.execute("select anonproxy.drop_budget(%s, 'public.adult')", [analyst])
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        with (psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn,
              pytest.raises(psycopg.errors.InsufficientPrivilege)):
            conn.execute("select sex, count(*) from adult group by sex")
    finally:
        truth.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 2, 0.00001, null, 0.5, 0.0000001)",
                      [analyst])


def test_the_ledger_survives_a_killed_proxy(pg_server: EmbeddedPostgres, gated_database: str, analyst: str,
                                            tmp_path: Path) -> None:
    settings = {"service_dsn": f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}"}
    upstream = f"host={pg_server.host} port={pg_server.port}"
    first = start_proxy(upstream, tmp_path / "first.log", **settings)
    with psycopg.connect(first.endpoint.dsn(gated_database, user=analyst), autocommit=True) as conn:
        conn.execute("select race, count(*) from adult group by race").fetchall()
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    second = start_proxy(upstream, tmp_path / "second.log", **settings)
    try:
        with psycopg.connect(second.endpoint.dsn(gated_database, user=analyst), autocommit=True) as conn:
            assert "epsilon 1.5 of 2 left" in budget_left(conn)
    finally:
        stop_proxy(second)


def test_join_having_spread_and_quantiles(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                          truth: psycopg.Connection) -> None:
    truth.execute("create table public.adult_region as select id, (array['North', 'South', 'East', 'West'])"
                  "[1 + id % 4] as region from public.adult")
    truth.execute("select anonproxy.link_table('public.adult_region', 'id', 'public.adult')")
    truth.execute("select anonproxy.set_column('public.adult_region', 'region', 'quasi_identifier', "
                  "domain => array['North', 'South', 'East', 'West'])")
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    try:
        with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
            wait_for_version(conn, version)
            join = "select r.region, count(*) from adult a join adult_region r on r.id = a.id group by r.region"
            regions = dict(conn.execute(join).fetchall())
            having = conn.execute("select education, count(*) from adult group by 1 having count(*) > 1000 "
                                  "order by 2 desc").fetchall()
            spread = conn.execute("select stddev(age), var_pop(age) from adult").fetchone()
            quantiles = conn.execute("select sex, median(age), percentile_disc(0.9) within group "
                                     "(order by hours_per_week) from adult group by sex").fetchall()
            assert "epsilon 0 of 2 left" in budget_left(conn)
        # count scale 2 (ε 0.5): |error| < 2·ln(1/1e-6) ≈ 28
        assert set(regions) == {"North", "South", "East", "West"}
        assert all(abs(n - truth.execute(f"select count(*) from adult_region where region = '{region}'"
                                         ).fetchone()[0]) <= 28 for region, n in regions.items())
        assert having and all(n > 1000 for _, n in having)  # filtered on the noisy values, after noise
        assert [n for _, n in having] == sorted((n for _, n in having), reverse=True)
        exact = truth.execute("select stddev(age), var_pop(age) from adult").fetchone()
        assert abs(spread[0] - exact[0]) < 1 and abs(spread[1] - exact[1]) < 20
        assert {row[0] for row in quantiles} == {"Female", "Male"}
        for sex, median, p90 in quantiles:
            true_median = truth.execute("select percentile_cont(0.5) within group (order by age) from adult "
                                        "where sex = %s", [sex]).fetchone()[0]
            assert abs(float(median) - true_median) <= 3 and 15 <= float(median) <= 100
            assert 0 <= int(p90) <= 100 and float(p90) == int(p90)
    finally:
        truth.execute("select anonproxy.unlink_table('public.adult_region')")
        truth.execute("drop table public.adult_region")


def test_listing_a_public_domain_reads_no_row_and_costs_nothing(gated_proxy: Endpoint, gated_database: str,
                                                                analyst: str) -> None:
    # sex has the declared public domain [Female, Male]: the answer is that domain, whatever the data or the WHERE
    notices: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        grouped = conn.execute("select sex from adult group by sex order by 1").fetchall()
        distinct = conn.execute("select distinct sex from adult order by sex desc").fetchall()
        # no adult is 200 years old: a count would find no group; the public domain is listed all the same
        filtered = conn.execute("select sex from adult where age > 200 group by sex order by 1").fetchall()
        bound = conn.execute("select sex from adult where age > %s group by sex order by 1", [200]).fetchall()
        both = conn.execute("select sex, income from adult group by 1, 2 order by 1, 2").fetchall()
        explained = [row[0] for row in conn.execute("explain (anonproxy) select sex from adult group by sex")]
        assert "epsilon 2 of 2 left" in budget_left(conn), "listing a public domain is not charged"
    assert grouped == filtered == bound == [("Female",), ("Male",)]
    assert distinct == [("Male",), ("Female",)]
    assert both == [(sex, income) for sex in ("Female", "Male") for income in ("<=50K", ">50K")]
    assert notices and all("no row was read and nothing was charged" in message for message in notices)
    assert any("costs nothing" in line for line in explained)


def test_grouping_without_a_public_domain_pays_for_partition_selection(gated_proxy: Endpoint, gated_database: str,
                                                                         analyst: str,
                                                                         truth: psycopg.Connection) -> None:
    # age has bounds but no domain: an age is released only when its noisy count of people passes the threshold,
    # and that count costs the per-query ε like any count
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        ages = {row[0] for row in conn.execute("select age from adult group by age").fetchall()}
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
    counts = dict(truth.execute("select age, count(*) from adult group by age").fetchall())
    assert ages <= set(counts), "no age is invented"
    # count noise has scale 2 (ε 0.5); the threshold is 1 + ⌈2·ln(10^7/(1 + e^-0.5))⌉ = 33: an age held by 200
    # people passes unless the noise is below −167 (probability e^-83)
    assert {age for age, n in counts.items() if n >= 200} <= ages


def test_grouping_without_a_public_domain_needs_delta(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                                      truth: psycopg.Connection) -> None:
    truth.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 2, 0.00001, null, 0.5, 0)", [analyst])
    wait_for_current_policy(truth, gated_proxy, gated_database)
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="needs δ > 0") as caught:
            conn.execute("select age from adult group by age")
        assert "public domain" in (caught.value.diag.message_hint or "")
        assert conn.execute("select sex from adult group by sex").fetchall() == [("Female",), ("Male",)]
        assert "epsilon 2 of 2 left" in budget_left(conn)


def test_a_bad_bound_value_is_refused_before_the_charge(gated_proxy: Endpoint, gated_database: str,
                                                       analyst: str) -> None:
    # The bound value is converted on its own, in a statement that reads no table, before the charge: it is
    # refused for nothing, and the worker's pooled connections (4) keep answering. (A question that fails once its
    # SQL runs is charged: tests/test_dp_charge.py.)
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for _ in range(5):
            with pytest.raises(psycopg.errors.InvalidTextRepresentation):
                conn.execute("select count(*) from adult where age > %s", ["not a number"])
        assert "epsilon 2 of 2 left" in budget_left(conn)
        first = conn.execute("select count(*) from adult where age > %s", [40]).fetchall()
        assert conn.execute("select count(*) from adult where age > %s", [40]).fetchall() == first
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
