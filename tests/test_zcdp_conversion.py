"""The zCDP → (ε, δ) conversion of migration 0025 (Canonne, Kamath and Steinke 2020, as OpenDP converts), in Python
(anonproxy.policy.zcdp) and in the database, against an independent numeric evaluation (a fine grid over the order α in
numpy's float64), against Bun and Steinke's bound, and an upgrade of a database with charges on it."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import numpy as np
import psycopg
import pytest
from test_ledger import ALICE, BOB, db, logins  # noqa: F401  (fixtures)

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.zcdp import default_accounting, zcdp_epsilon, zcdp_rho_max
from anonproxy.schema import migrations

D = Decimal

RHOS = ["0.000001", "0.0001", "0.01", "0.0625", "0.125", "0.5", "1", "2.63", "10", "100"]
EPSILONS = ["0.01", "0.1", "0.5", "1", "3", "10", "50", "1000"]
DELTAS = ["0.001", "0.00001", "0.0000001", "1e-10", "1e-20"]


def _orders() -> np.ndarray:
    return 1 + np.logspace(-7, 9, 400_001)


def grid_epsilon(rho: float, delta: float) -> float:
    """The least ε over a fine grid of orders α, then a finer one around the best: CKS Prop. 12 solved for ε,
    ε_α = αρ + (ln(1/δ) + (α−1)·ln(1 − 1/α) − ln α)/(α − 1), written out here independently of the code."""
    log = math.log(1 / delta)

    def at(alpha: np.ndarray) -> np.ndarray:
        return alpha * rho + (log + (alpha - 1) * np.log1p(-1 / alpha) - np.log(alpha)) / (alpha - 1)

    alphas = _orders()
    best = int(np.argmin(at(alphas)))
    finer = np.linspace(alphas[max(best - 1, 0)], alphas[min(best + 1, len(alphas) - 1)], 200_001)
    return float(np.min(at(finer)))


def grid_delta(rho: float, epsilon: float) -> float:
    """CKS's δ for ρ-zCDP at ε: the least over the grid of exp((α−1)(αρ−ε)) / (α−1) · (1 − 1/α)^α, in logs."""
    def logs(alpha: np.ndarray) -> np.ndarray:
        return (alpha - 1) * (alpha * rho - epsilon) + alpha * np.log1p(-1 / alpha) - np.log(alpha - 1)

    alphas = _orders()
    best = int(np.argmin(logs(alphas)))
    finer = np.linspace(alphas[max(best - 1, 0)], alphas[min(best + 1, len(alphas) - 1)], 200_001)
    return float(np.exp(np.min(logs(finer))))


def bun_steinke(rho: Decimal, delta: Decimal) -> Decimal:
    return rho + 2 * (rho * -delta.ln()).sqrt()


def test_the_issue_figure_rho_1_7827_at_epsilon_10_delta_1e5(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    assert round(zcdp_rho_max(10, D("0.00001")), 4) == D("1.7827")  # Bun and Steinke: 1.5504
    assert db.execute("select round(anonproxy.zcdp_rho_max(10, 0.00001), 4), "
                      "round(anonproxy.bun_steinke_rho_max(10, 0.00001), 4)").fetchone() == (D("1.7827"), D("1.5504"))


@pytest.mark.parametrize("delta", DELTAS)
def test_epsilon_is_valid_tight_and_never_looser_than_bun_steinke(delta: str) -> None:
    for rho in RHOS:
        ours = zcdp_epsilon(rho, delta)
        reference = max(grid_epsilon(float(rho), float(delta)), 0)  # ε is at least 0 (a tiny ρ at a large δ)
        # valid: never below the exact bound (the grid's least is at most float rounding above it) ...
        assert float(ours) >= reference * (1 - 1e-12) - 1e-12, (rho, delta, ours, reference)
        # ... and tight: the best order was found
        assert float(ours) <= reference * (1 + 1e-9) + 1e-12, (rho, delta, ours, reference)
        # valid by CKS's δ itself: ρ-zCDP is (ours, δ)-DP
        assert grid_delta(float(rho), float(ours)) <= float(delta) * (1 + 1e-9), (rho, delta)
        assert ours < bun_steinke(D(rho), D(delta)), (rho, delta)


@pytest.mark.parametrize("delta", DELTAS)
def test_rho_max_is_valid_tight_and_never_below_bun_steinke(delta: str) -> None:
    for epsilon in EPSILONS:
        ours = zcdp_rho_max(epsilon, delta)
        assert ours > 0
        # valid: what it allows converts back within ε (by the code, and by the independent grid) ...
        assert zcdp_epsilon(ours, delta) <= D(epsilon)
        assert grid_epsilon(float(ours), float(delta)) <= float(epsilon) * (1 + 1e-12) + 1e-12
        # ... and tight: a little more ρ does not
        assert grid_epsilon(float(ours) * (1 + 1e-6), float(delta)) > float(epsilon), (epsilon, delta)
        log = -D(delta).ln()
        loose = (D(epsilon) / ((D(epsilon) + log).sqrt() + log.sqrt())) ** 2
        assert ours > loose, (epsilon, delta)


def test_python_and_the_database_agree_on_a_grid(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    cases = [(value, delta) for value in sorted({*RHOS, *EPSILONS}, key=D) for delta in DELTAS]
    values = [D(value) for value, _ in cases]
    deltas = [D(delta) for _, delta in cases]
    rows = db.execute("select anonproxy.zcdp_epsilon(v, d), anonproxy.zcdp_rho_max(v, d) "
                      "from unnest(%s::numeric[], %s::numeric[]) with ordinality as c(v, d, i) order by i",
                      (values, deltas)).fetchall()
    unit = D("1e-30")  # both round outwards at 30 decimals
    for (value, delta), (epsilon, rho_max) in zip(cases, rows, strict=True):
        assert abs(epsilon - zcdp_epsilon(value, delta)) <= unit, (value, delta)
        assert abs(rho_max - zcdp_rho_max(value, delta)) <= unit, (value, delta)


def test_conversion_edges(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    assert zcdp_epsilon(0, D("1e-5")) == 0 and zcdp_epsilon(1, 0) == D("Infinity") and zcdp_rho_max(10, 0) == 0
    assert db.execute("select anonproxy.zcdp_epsilon(0, 0.00001), anonproxy.zcdp_epsilon(1, 0), "
                      "anonproxy.zcdp_rho_max(10, 0), anonproxy.zcdp_rho_max(0, 0.00001)").fetchone() == (
        0, D("Infinity"), 0, 0)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("select anonproxy.zcdp_epsilon(-1, 0.00001)")
    with pytest.raises(ValueError):
        zcdp_rho_max(1, 1)


def test_the_default_rule_decides_as_before_0025() -> None:
    """The rule still counts zCDP's answers with Bun and Steinke's ρ_max: no budget's accounting switches on upgrade.
    Just below 7.52 (δ 1e-5, q 0.5) it keeps basic, though the tighter conversion would afford more under zcdp."""
    q, delta = D("0.5"), D("0.00001")
    assert default_accounting(D("7.51"), delta, q) == "basic" and default_accounting(D("7.53"), delta, q) == "zcdp"
    assert zcdp_rho_max(D("7.51"), delta) / (q * q / 4) > D("7.51") / q  # what zcdp would afford there


def test_the_upgrade_never_raises_epsilon_spent(pg_server: EmbeddedPostgres,
                                                logins: tuple[str, ...]) -> None:  # noqa: F811
    """Install up to 0024, charge, read ε spent; apply 0025; read again: never higher, never less left; stored
    accountings unchanged; charges go on and record what they moved ε spent by."""
    name = "zcdp_conversion_upgrade"
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {name}")
        conn.execute(f"create database {name}")
    try:
        with psycopg.connect(pg_server.conninfo(dbname=name), autocommit=True) as conn:
            _migrate(conn, lambda version: version < 25)
            conn.execute("create table public.people (id integer primary key)")
            conn.execute("select anonproxy.protect_table('public.people', 'id')")
            # ALICE zcdp with few large and Gaussian answers, BOB basic, the service role zcdp with partition
            # selection's delta; a zcdp cap over all of them.
            conn.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5, null, "
                         "'zcdp')")
            conn.execute(f"select anonproxy.set_budget('{BOB}', 'public.people', 10, 0.00001, null, 0.5, null, "
                         "'basic')")
            conn.execute("select anonproxy.set_budget('anonproxy_service', 'public.people', 3, 0.0001, null, null, "
                         "null, 'zcdp')")
            conn.execute("select anonproxy.set_shared_budget('public.people', 40, 0.001, null, 'zcdp')")
            for i in range(3):
                conn.execute(f"select anonproxy.charge('{ALICE}', 'public.people', 0.5, 0, 0.0625, 0, 'a{i}')")
            conn.execute(f"select anonproxy.charge('{ALICE}', 'public.people', 1, 0.000001, 'a-pure')")
            for i in range(12):
                conn.execute(f"select anonproxy.charge('{BOB}', 'public.people', 0.25, 0.0000001, 'b{i}')")
            conn.execute("select anonproxy.charge('anonproxy_service', 'public.people', 0.3, 0.00001, 0.02, "
                         "0.00001, 's')")
            before = _spending(conn)
            _migrate(conn, lambda version: version == 25)
            after = _spending(conn)
            assert before.keys() == after.keys() == {ALICE, BOB, "anonproxy_service"}
            for role, (accounting, spent, left, shared_left) in after.items():
                old_accounting, old_spent, old_left, old_shared_left = before[role]
                assert accounting == old_accounting  # stored accountings are kept
                assert spent <= old_spent and left >= old_left and shared_left >= old_shared_left, role
            assert after[ALICE][1] < before[ALICE][1] and after[BOB][:3] == before[BOB][:3]  # zcdp: lower; basic: the same
            # Charges go on, and record what they moved the role's ε spent by.
            moved = conn.execute(f"select epsilon_spent, epsilon_spent_delta from anonproxy.charge('{ALICE}', "
                                 "'public.people', 0.5, 0, 0.0625, 0, 'after')").fetchone()
            assert moved is not None and moved[0] - moved[1] == after[ALICE][1] and 0 < moved[1] < D("0.5")
    finally:
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            conn.execute(f"drop database if exists {name}")


def _migrate(conn: psycopg.Connection[Any], which: Any) -> None:
    for migration in (m for m in migrations() if which(m.version)):
        with conn.transaction():  # as anonproxy.schema.install runs them
            conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
            conn.execute(migration.sql.encode())


def _spending(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, Decimal, Decimal, Decimal]]:
    """Per role: its accounting, ε spent, ε left of its own budget and of the cap, as the ledger tells them."""
    return {role: (accounting, spent, left, shared) for role, accounting, spent, left, shared in conn.execute(
        "select b.role_name, b.accounting, (r).epsilon_spent, (r).role_epsilon, (r).shared_epsilon "
        "from anonproxy.budgets b, anonproxy.remaining_budget(b.role_name, b.domain) r")}
