"""SET / SHOW / RESET anonproxy.epsilon and anonproxy.delta, and EXPLAIN (ANONPROXY), through the real proxy.

Each test gets its own dp role (ε 2 in all, 0.5 and δ 1e-7 per query, on public.adult; the `analyst` fixture
of test_dp_proxy). Expected noise scales, 95 % half-widths and thresholds are computed here from the discrete
Laplace distribution, Pr[X = k] ∝ α^|k| with α = e^(−1/t), not taken from the proxy.
"""

from __future__ import annotations

import math
import re

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)


def halfwidth(scale: float) -> int:
    """The smallest h with Pr[|X| > h] = 2α^(h+1)/(1+α) ≤ 5 %."""
    alpha = math.exp(-1 / scale)
    h = 0
    while 2 * alpha ** (h + 1) / (1 + alpha) > 0.05:
        h += 1
    return h


def threshold(scale: float, delta: float) -> int:
    """The smallest τ with Pr[1 + X ≥ τ] = α^(τ−1)/(1+α) ≤ δ (one group per person)."""
    alpha = math.exp(-1 / scale)
    tau = 2
    while alpha ** (tau - 1) / (1 + alpha) > delta:
        tau += 1
    return tau


def connect(proxy: Endpoint, database: str, role: str) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(database, user=role), autocommit=True)


def explain(conn: psycopg.Connection, query: str, prepare: bool = False) -> str:
    return "\n".join(row[0] for row in conn.execute(f"EXPLAIN (ANONPROXY) {query}", prepare=prepare))


def test_a_session_lowers_its_epsilon(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                      truth: psycopg.Connection) -> None:  # noqa: F811
    notices: list[str] = []
    with connect(gated_proxy, gated_database, analyst) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.5",)  # the policy's, per query
        assert conn.execute("show anonproxy.delta").fetchone() == ("0.0000001",)
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="at most 0.5") as raised:
            conn.execute("set anonproxy.epsilon = 0.6")
        assert raised.value.diag.message_hint is not None
        conn.execute("SET anonproxy.epsilon TO 0.1")
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.1",)
        total = conn.execute("select count(*) from adult").fetchone()[0]
        assert "epsilon 1.9 of 2 left" in budget_left(conn), "charged the lowered ε"
        assert any("ε=0.1," in notice for notice in notices)
        true_total = truth.execute("select count(*) from adult").fetchone()[0]
        assert abs(total - true_total) <= 10 * math.log(1e6)  # scale 1/0.1
        with connect(gated_proxy, gated_database, analyst) as other:
            assert other.execute("show anonproxy.epsilon").fetchone() == ("0.5",), "a setting of the session"
        conn.execute("reset anonproxy.epsilon")
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.5",)
        conn.execute("select count(*) from adult").fetchone()
        assert "epsilon 1.4 of 2 left" in budget_left(conn), "back to the policy's ε: a new question"
        # The same commands in the extended protocol.
        conn.execute("set anonproxy.epsilon = 0.25", prepare=True)
        assert conn.execute("show anonproxy.epsilon", prepare=True).fetchone() == ("0.25",)
        conn.execute("select count(*) from adult where age > %s", [40]).fetchone()
        assert "epsilon 1.15 of 2 left" in budget_left(conn)


def test_reset_all_and_discard_all_reset_the_dp_settings(gated_proxy: Endpoint, gated_database: str,
                                                         analyst: str) -> None:  # noqa: F811
    def shown(conn: psycopg.Connection) -> tuple[str, str]:
        return (conn.execute("show anonproxy.epsilon").fetchone()[0],
                conn.execute("show anonproxy.delta").fetchone()[0])

    with connect(gated_proxy, gated_database, analyst) as conn:
        for reset, prepare in (("RESET ALL", False), ("discard all", False), ("reset all", True),
                               ("DISCARD ALL", True)):
            conn.execute("set anonproxy.epsilon = 0.2")
            conn.execute("set anonproxy.delta = 0")
            conn.execute("set timezone = 'Asia/Tokyo'")
            conn.execute(reset, prepare=prepare)
            assert shown(conn) == ("0.5", "0.0000001"), reset
            assert conn.execute("show timezone").fetchone() != ("Asia/Tokyo",), "PostgreSQL ran it too"
        # In a message of several statements; and a RESET of one setting leaves them.
        conn.execute("set anonproxy.epsilon = 0.2")
        conn.execute("reset timezone")
        assert shown(conn)[0] == "0.2"
        conn.execute("set timezone = 'UTC'; reset all; set extra_float_digits = 1")
        assert shown(conn)[0] == "0.5"
        # A DISCARD ALL that PostgreSQL refuses (inside a transaction block) resets nothing, here either.
        conn.execute("set anonproxy.epsilon = 0.2")
        with conn.transaction(), pytest.raises(psycopg.errors.ActiveSqlTransaction):
            conn.execute("discard all")
        conn.execute("reset timezone")
        assert shown(conn)[0] == "0.2"
        conn.execute("select count(*) from adult").fetchone()
        assert "epsilon 1.8 of 2 left" in budget_left(conn), "charged the session's ε"
    # Values given at login are the session's defaults: RESET ALL goes back to them, as in PostgreSQL.
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), options="-c anonproxy.epsilon=0.3",
                         autocommit=True) as conn:
        conn.execute("set anonproxy.epsilon = 0.1")
        conn.execute("discard all")
        assert shown(conn) == ("0.3", "0.0000001")


def test_delta_and_invalid_settings(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:  # noqa: F811
    with connect(gated_proxy, gated_database, analyst) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="at most 0.0000001"):
            conn.execute("set anonproxy.delta = 0.001")
        conn.execute("set anonproxy.delta = 0")
        # Groups without a public domain need δ for partition selection: refused, and nothing charged.
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="δ > 0"):
            conn.execute("select age, count(*) from adult group by age")
        for statement, error in [("set anonproxy.epsilon = 'abc'", psycopg.errors.InvalidParameterValue),
                                 ("set anonproxy.epsilon = 0", psycopg.errors.InvalidParameterValue),
                                 ("set anonproxy.epsilon = 1e-100", psycopg.errors.InvalidParameterValue),
                                 ("set local anonproxy.epsilon = 0.1", psycopg.errors.FeatureNotSupported),
                                 ("set anonproxy.k = 2", psycopg.errors.InsufficientPrivilege),
                                 ("set anonproxy.epsilon = 0.1; select 1", psycopg.errors.FeatureNotSupported)]:
            with pytest.raises(error):
                conn.execute(statement)
        assert "epsilon 2 of 2 left" in budget_left(conn)
    with connect(gated_proxy, gated_database, "reporter") as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="dp mode only"):
            conn.execute("set anonproxy.epsilon = 0.1")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="dp mode"):
            conn.execute("show anonproxy.epsilon")


def test_explain_shows_cost_noise_and_cache_without_charging(gated_proxy: Endpoint, gated_database: str,
                                                             analyst: str) -> None:  # noqa: F811
    query = "select count(*) from adult where age >= 30"
    with connect(gated_proxy, gated_database, analyst) as conn:
        plan = explain(conn, query)
        # One statistic (the count of people), ε 0.5, sensitivity 1: scale 2.
        assert "costs ε=0.5, δ=0" in plan and re.search(r"scale 2\b", plan)
        assert re.search(rf"95% interval ±{halfwidth(2)}\b", plan)
        assert "not cached" in plan and "nothing was run or charged" in plan
        assert "epsilon 2 of 2 left" in budget_left(conn)
        conn.execute(query).fetchone()
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        assert "cached: the same question" in explain(conn, query, prepare=True)  # also in the extended protocol
        conn.execute("set anonproxy.epsilon = 0.1")
        plan = explain(conn, query)
        assert "costs ε=0.1" in plan and re.search(r"scale 10\b", plan)
        assert re.search(rf"95% interval ±{halfwidth(10)}\b", plan) and "not cached" in plan
        conn.execute("reset anonproxy.epsilon")
        # A GROUP BY without a public domain: groups pass a threshold calibrated to δ = 1e-7.
        plan = explain(conn, "select age, count(*) from adult group by age")
        assert "δ=1e-07" in plan and f"reaches {threshold(2, 1e-7)} " in plan
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "EXPLAIN charges nothing"
        # Bound values are part of the question.
        with_value = "EXPLAIN (ANONPROXY) select count(*) from adult where age >= %s"
        conn.execute("select count(*) from adult where age >= %s", [30]).fetchone()
        assert "cached: the same question" in "\n".join(r[0] for r in conn.execute(with_value, [30]))
        assert "not cached" in "\n".join(r[0] for r in conn.execute(with_value, [31]))
        assert "epsilon 1 of 2 left" in budget_left(conn)
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="explains aggregate queries"):
            explain(conn, "select 1")
