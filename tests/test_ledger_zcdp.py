"""zCDP accounting in the ledger (sql/0019_zcdp_ledger.sql, docs/ledger.md "Two accountings"), against a real
PostgreSQL, and the budget left as plain SQL (anonproxy.my_budget) through the real proxy with psycopg and asyncpg."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_policy
from test_ledger import (  # noqa: F401  (fixtures)
    ADULT,
    ALICE,
    BOB,
    connect,
    db,
    ledger_rows,
    logins,
    race,
    run,
    service_dsn,
    set_budget,
    sql_error,
)

from anonproxy.dp import ledger
from anonproxy.dp.ledger import BudgetExhausted, Remaining
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import (
    PolicyError,
    apply_policy,
    demo_policy,
    dump_policy,
    parse_policy,
)
from anonproxy.policy.zcdp import default_accounting, zcdp_epsilon, zcdp_rho_max
from anonproxy.schema import migrations

D = Decimal
TIGHT = D("1e-25")  # the conversions are computed to 45-50 digits; the hand values below to 30

# Bun and Steinke (2016), Prop. 1.3: rho-zCDP => (rho + 2 sqrt(rho ln(1/delta)), delta)-DP. Worked out by hand with
# bc -l at scale 30 (an arbitrary-precision calculator, independent of Python's decimal and PostgreSQL's numeric):
CONVERSIONS = [
    # ln(1e5) = 11.512925464970228420089957273421; 0.5 * that = 5.756462732485114210044978636710;
    # sqrt = 2.399262956094040603783684434452; 0.5 + 2 * 2.399262956094040603783684434452
    (D("0.5"), D("0.00001"), D("5.298525912188081207567368868904")),
    # ln(1e6) = 13.815510557964274104107948728106; sqrt(1 * that) = 3.716922188849838446952406761304; 1 + 2 * that
    (D("1"), D("0.000001"), D("8.433844377699676893904813522608")),
    # 0.1 * 11.512925464970228420089957273421 = 1.151292546497022842008995727342; sqrt = 1.072983013144673619818091785144
    (D("0.1"), D("0.00001"), D("2.245966026289347239636183570288")),
    # ln(1e9) = 20.723265836946411156161923092159; 0.01 * that = 0.207232658369464111561619230921;
    # sqrt = 0.455228138815543905258891718064; 0.01 + 2 * that
    (D("0.01"), D("0.000000001"), D("0.920456277631087810517783436128")),
    # ln(1e10) = 23.025850929940456840179914546843; 2.63 * that = 60.557987945743401489673175258197;
    # sqrt = 7.781901306605179600905808050917 (the 2020 US Census rho, under this conversion)
    (D("2.63"), D("0.0000000001"), D("18.193802613210359201811616101834")),
]
# rho_max(eps, delta) = (sqrt(eps + ln(1/delta)) - sqrt(ln(1/delta)))^2, by hand (bc -l, scale 30):
RHO_MAX = [
    # sqrt(10 + 11.512925464970228420089957273421) = 4.638202827062463470518476270622,
    # sqrt(11.512925464970228420089957273421) = 3.393070212207555898941545071428; difference squared
    (D(10), D("0.00001"), D("1.550355228575419595382819848240")),
    # sqrt(12.512925464970228420089957273421) = 3.537361370424320730328706731938; minus 3.393070212207555898941545071428
    (D(1), D("0.00001"), D("0.020819938339535461116043596782")),
    # sqrt(3 + 13.815510557964274104107948728106) = 4.100671964198584137230016317948; minus 3.716922188849838446952406761304
    (D(3), D("0.000001"), D("0.147263890080212785474128266287")),
]


def up12(value: Decimal) -> Decimal:
    """Rounded up to 12 decimals, as the ledger shows a zCDP epsilon spent."""
    return value.quantize(D("1e-12"), rounding=ROUND_CEILING)


# The conversion ------------------------------------------------------------------------------------


# Since migration 0025 the conversion is Canonne, Kamath and Steinke's (tests/test_zcdp_conversion.py): tighter than
# these, which stay upper bounds of it (and bun_steinke_rho_max, which the default accounting rule uses, is theirs).
@pytest.mark.parametrize("rho, delta, epsilon", CONVERSIONS)
def test_the_conversion_is_below_values_worked_out_by_hand(db: psycopg.Connection[Any], rho: Decimal,  # noqa: F811
                                                           delta: Decimal, epsilon: Decimal) -> None:
    assert zcdp_epsilon(rho, delta) < epsilon
    in_sql = db.execute("select anonproxy.zcdp_epsilon(%s, %s)", (rho, delta)).fetchone()[0]
    assert in_sql == zcdp_epsilon(rho, delta)


@pytest.mark.parametrize("epsilon, delta, rho", RHO_MAX)
def test_rho_max_is_above_values_worked_out_by_hand_and_round_trips(db: psycopg.Connection[Any],  # noqa: F811
                                                                    epsilon: Decimal, delta: Decimal,
                                                                    rho: Decimal) -> None:
    assert zcdp_rho_max(epsilon, delta) > rho
    in_sql, bun_steinke = db.execute("select anonproxy.zcdp_rho_max(%s, %s), anonproxy.bun_steinke_rho_max(%s, %s)",
                                     (epsilon, delta, epsilon, delta)).fetchone()
    assert in_sql == zcdp_rho_max(epsilon, delta) and abs(bun_steinke - rho) < TIGHT
    # round trip: rho_max converts back to epsilon, and no further
    assert epsilon - TIGHT < zcdp_epsilon(zcdp_rho_max(epsilon, delta), delta) <= epsilon
    back = db.execute("select anonproxy.zcdp_epsilon(anonproxy.zcdp_rho_max(%s, %s), %s)",
                      (epsilon, delta, delta)).fetchone()[0]
    assert epsilon - TIGHT < back <= epsilon


def test_conversion_edges(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    assert zcdp_epsilon(0, D("1e-5")) == 0 and zcdp_epsilon(1, 0) == D("Infinity") and zcdp_rho_max(10, 0) == 0
    assert db.execute("select anonproxy.zcdp_epsilon(0, 0.00001), anonproxy.zcdp_epsilon(1, 0), "
                      "anonproxy.zcdp_rho_max(10, 0)").fetchone() == (0, D("Infinity"), 0)
    error = sql_error(db, "select anonproxy.zcdp_rho_max(1, 1)")
    assert (error.sqlstate, error.diag.message_primary) == ("22023", "delta must be in [0, 1), got 1")
    with pytest.raises(ValueError):
        zcdp_epsilon(-1, D("1e-5"))


# The default accounting -------------------------------------------------------------------------------


def test_the_default_rule_is_the_same_in_python_and_in_the_database(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    cases = [(D(e), D(d), None if q is None else D(q)) for e in ("0.5", "1", "2", "5", "8", "10", "20", "50")
             for d in ("0", "1e-9", "0.0000001", "0.00001", "0.001") for q in (None, "0.1", "0.25", "0.5")]
    in_sql = db.execute("select array_agg(anonproxy.default_accounting(e, d, q) order by i) "
                        "from unnest(%s::numeric[], %s::numeric[], %s::numeric[]) with ordinality as c(e, d, q, i)",
                        ([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases])).fetchone()[0]
    assert [default_accounting(*case) for case in cases] == in_sql
    assert {"basic", "zcdp"} == set(in_sql)  # both sides of the rule are exercised
    # The rule: zcdp iff it affords more one-statistic answers at q (rho q²/4 each) than basic (q each).
    assert default_accounting(10, D("0.00001"), D("0.5")) == "zcdp"  # 1.5504 / 0.0625 = 24.8 answers > 20
    assert default_accounting(2, D("0.00001"), D("0.5")) == "basic"  # 0.0800 / 0.0625 = 1.3 answers < 4
    assert default_accounting(10, 0, D("0.5")) == "basic"  # zCDP has no finite epsilon at delta 0


def test_set_budget_without_accounting_follows_the_default_rule(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    set_budget(db, ALICE, "10", "0.00001", epsilon_per_query="0.5")
    set_budget(db, BOB, "2", "0.00001", epsilon_per_query="0.5")
    db.execute("select anonproxy.set_shared_budget('public.adult', 20, 0.0001)")
    assert db.execute("select role_name, accounting from anonproxy.budgets order by 1").fetchall() == [
        (ALICE, "zcdp"), (BOB, "basic")]
    assert db.execute("select accounting from anonproxy.shared_budgets").fetchone() == ("zcdp",)
    set_budget(db, ALICE, "10", "0.00001", epsilon_per_query="0.5", accounting="basic")  # given: kept
    assert db.execute("select accounting from anonproxy.budgets where role_name = %s", (ALICE,)).fetchone() == (
        "basic",)
    for statement, message in [
        (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 0, accounting => 'zcdp')",
         f'accounting for role "{ALICE}" on public.adult cannot be zcdp with delta 0'),
        (f"select anonproxy.set_budget('{ALICE}', 'public.adult', 1, 0.00001, accounting => 'rdp')",
         f'accounting for role "{ALICE}" on public.adult must be basic or zcdp, got rdp'),
        ("select anonproxy.set_shared_budget('public.adult', 1, 0, accounting => 'zcdp')",
         "accounting of the shared budget on public.adult cannot be zcdp with delta 0"),
    ]:
        error = sql_error(db, statement)
        assert (error.sqlstate, error.diag.message_primary) == ("22023", message)
        assert error.diag.message_hint


def test_the_demo_budget_is_zcdp_by_the_default_rule_and_the_policy_file_can_say_otherwise(
        db: psycopg.Connection[Any]) -> None:  # noqa: F811
    demo = demo_policy()
    assert demo.roles["analyst"].budgets["public.adult"].accounting == "zcdp"  # ε 10, δ 1e-5, 0.5 per query
    apply_policy(db, demo)
    assert db.execute("select accounting from anonproxy.budgets where role_name = 'analyst'").fetchone() == ("zcdp",)
    text = dump_policy(load_policy(db))
    assert "accounting: zcdp}" in text
    pinned = parse_policy(text.replace("accounting: zcdp}", "accounting: basic}"))
    apply_policy(db, pinned)
    assert db.execute("select accounting from anonproxy.budgets where role_name = 'analyst'").fetchone() == ("basic",)
    loaded = load_policy(db)
    assert parse_policy(dump_policy(loaded)) == dataclasses.replace(loaded, version=0)
    adult = "tables: {public.adult: {unit: id, shared_budget: {epsilon: 3, delta: 0, accounting: zcdp}}}\n"
    for text, problem in [
        (adult, ("tables.public.adult.shared_budget.accounting: cannot be zcdp with delta 0: zCDP converts to "
                 "(epsilon, delta)-DP only at a delta above 0")),
        (("tables: {public.adult: {unit: id}}\nroles: {analyst: {mode: dp, budgets: {public.adult: "
          "{epsilon: 1, delta: 0.00001, accounting: rdp}}}}"),
         "roles.analyst.budgets.public.adult.accounting: must be one of basic, zcdp, got 'rdp'"),
    ]:
        with pytest.raises(PolicyError) as caught:
            parse_policy(text)
        assert problem in caught.value.problems


# Charging under zCDP ---------------------------------------------------------------------------------


def test_zcdp_refuses_exactly_past_the_limit(db: psycopg.Connection[Any], service_dsn: str) -> None:  # noqa: F811
    set_budget(db, ALICE, "1", "0.00001", accounting="zcdp")
    rho_max, rest = db.execute("select m, m - 0.005 from anonproxy.zcdp_rho_max(1, 0.00001) m").fetchone()

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Remaining], BudgetExhausted]:
        left = [await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "a", rho="0.005", delta_add=0)]
        left.append(await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "b", rho=rest, delta_add=0))
        with pytest.raises(BudgetExhausted) as refused:  # the least rho more
            await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "c", rho="1e-30", delta_add=0)
        return left, refused.value

    (first, last), refused = run(service_dsn, work)
    assert first.accounting == "zcdp" and first.rho_spent == D("0.005")
    assert first.epsilon_spent == up12(zcdp_epsilon(D("0.005"), D("0.00001")))
    assert first.epsilon == 1 - first.epsilon_spent and first.delta == D("0.00001")
    assert last.rho_spent == rho_max and last.rho_left == 0 and last.epsilon == 0 and last.epsilon_spent == 1
    assert refused.sqlstate == "53400" and refused.remaining.rho_left == 0
    assert refused.message == (f'privacy budget exhausted for role "{ALICE}" on public.adult: remaining rho 0 '
                               "(epsilon 0), delta 0.00001; this query needs rho 0.000000000000000000000000000001, "
                               "delta 0 (zCDP accounting)")
    assert refused.detail is not None and "under zCDP accounting" in refused.detail
    assert ledger_rows(db, ALICE) == 2


def test_zcdp_spends_delta_add_apart_and_converts_at_what_is_left(db: psycopg.Connection[Any],  # noqa: F811
                                                                 service_dsn: str) -> None:  # noqa: F811
    set_budget(db, ALICE, "10", "0.00001", accounting="zcdp")

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Remaining], BudgetExhausted]:
        left = [await ledger.charge(conn, ALICE, ADULT, "0.5", "0.000004", f"q{i}", rho="0.125", delta_add="0.000004")
                for i in range(2)]
        with pytest.raises(BudgetExhausted) as refused:  # sum(delta_add) must stay below D, strictly
            await ledger.charge(conn, ALICE, ADULT, "0.5", "0.000002", "q2", rho="0.125", delta_add="0.000002")
        return left, refused.value

    left, refused = run(service_dsn, work)
    assert [r.delta for r in left] == [D("0.000006"), D("0.000002")]
    assert [r.epsilon_spent for r in left] == [up12(zcdp_epsilon(D("0.125"), D("0.000006"))),
                                               up12(zcdp_epsilon(D("0.25"), D("0.000002")))]
    assert left[1].rho_left == (zcdp_rho_max(10, D("0.000002")) - D("0.25")).quantize(D("1e-12"), rounding="ROUND_DOWN")
    assert "remaining rho" in refused.message and "needs rho 0.125, delta 0.000002 (zCDP accounting)" in refused.message
    # Every charge leaves less, never more, under either accounting.
    assert left[0].epsilon > left[1].epsilon > 0


def test_the_four_amounts_are_checked(db: psycopg.Connection[Any]) -> None:  # noqa: F811
    set_budget(db, BOB, "1", "0.0001")
    for arguments, sqlstate, message in [
        ("0.1, 0, 'NaN', 0", "22023", "rho of a charge must be a finite number >= 0, got NaN"),
        ("0.1, 0, 0.005, 0.000001", "22023", "delta_add of a charge must be in [0, delta], got 0.000001 with delta 0"),
        ("0.1, 0, 0, 0", "22023", "a charge must cost rho exactly when it costs epsilon, got epsilon 0.1 and rho 0"),
        ("0, 0, 0.1, 0", "22023", "a charge must cost rho exactly when it costs epsilon, got epsilon 0 and rho 0.1"),
        ("0.1, 0, null, 0", "22004",
         "role_name, domain, epsilon, delta, rho, delta_add and fingerprint of a charge must not be null"),
    ]:
        error = sql_error(db, f"select anonproxy.charge('{BOB}', 'public.adult', {arguments}, 'q')")
        assert (error.sqlstate, error.diag.message_primary) == (sqlstate, message)
    # The charge of 0003 (epsilon and delta only) still works: rho = epsilon²/2 exactly, delta_add = delta.
    db.execute(f"select anonproxy.charge('{BOB}', 'public.adult', 0.1234567890123456789, 0.000001, 'old form')")
    assert db.execute("select rho * 2 = epsilon * epsilon, delta_add = delta from anonproxy.budget_ledger").fetchone() \
        == (True, True)


def test_a_shared_cap_counts_by_its_own_accounting(db: psycopg.Connection[Any], service_dsn: str) -> None:  # noqa: F811
    set_budget(db, ALICE, "5", accounting="basic")
    set_budget(db, BOB, "5", "0.00001", accounting="zcdp")
    db.execute("select anonproxy.set_shared_budget('public.adult', 3, 0.00001, accounting => 'zcdp')")
    rho_max = zcdp_rho_max(3, D("0.00001"))  # 0.2242 (Bob's own: 0.5510): what all roles together may spend

    async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[Remaining, Remaining, BudgetExhausted]:
        alice = await ledger.charge(conn, ALICE, ADULT, "2", 0, "a", rho="0.1", delta_add=0)
        bob = await ledger.charge(conn, BOB, ADULT, "0.3", 0, "b", rho="0.07", delta_add=0)
        with pytest.raises(BudgetExhausted) as refused:  # Alice's own basic budget has 3 left; the cap is spent
            await ledger.charge(conn, ALICE, ADULT, "0.1", 0, "c", rho="0.06", delta_add=0)
        return alice, bob, refused.value

    alice, bob, refused = run(service_dsn, work)
    assert (alice.accounting, alice.shared_accounting, alice.role_epsilon) == ("basic", "zcdp", D(3))
    assert alice.rho_left is None and alice.shared_rho_left == (rho_max - D("0.1")).quantize(D("1e-12"), "ROUND_DOWN")
    assert alice.shared_epsilon == 3 - up12(zcdp_epsilon(D("0.1"), D("0.00001")))
    assert alice.epsilon == alice.shared_epsilon  # the lesser of the two
    assert bob.rho == bob.shared_rho_left < bob.rho_left  # the cap binds Bob harder than his own budget
    assert refused.message.endswith("this query needs rho 0.06, delta 0 (zCDP accounting)")
    assert refused.detail is not None and refused.detail.startswith("the shared budget of all roles on public.adult")
    # The other way round: a basic cap over a zcdp budget refuses in epsilon.
    db.execute("select anonproxy.set_shared_budget('public.adult', 2.5, 0.00001, accounting => 'basic')")
    with pytest.raises(BudgetExhausted) as basic:
        run(service_dsn, lambda conn: ledger.charge(conn, BOB, ADULT, "0.3", 0, "d", rho="0.0001", delta_add=0))
    assert basic.value.message == (f'privacy budget exhausted for role "{BOB}" on public.adult: remaining epsilon 0.2, '
                                   "delta 0.00001; this query needs epsilon 0.3, delta 0 (basic accounting)")


def test_concurrent_zcdp_charges_never_overspend(db: psycopg.Connection[Any], service_dsn: str) -> None:  # noqa: F811
    # Each round the budget's rho_max grows by 0.07 (0.005 to spare): exactly 7 of the 20 charges of rho 0.01 fit.
    for round_ in range(1, 4):
        epsilon = db.execute("select anonproxy.zcdp_epsilon(%s, 0.00001)", (D("0.07") * round_ + D("0.005"),)
                             ).fetchone()[0]
        set_budget(db, ALICE, str(epsilon), "0.00001", accounting="zcdp")
        succeeded = asyncio.run(race(service_dsn, [(ALICE, f"r{round_}q{i}") for i in range(20)], "0.1", rho="0.01",
                                        delta_add=0))
        assert succeeded.count(True) == 7, (round_, succeeded)
    assert db.execute("select sum(rho) from anonproxy.budget_ledger").fetchone() == (D("0.21"),)
    # And a zcdp shared cap across two roles (whose own basic budgets are large): 5 of 20 per round.
    set_budget(db, BOB, "100", accounting="basic")
    set_budget(db, ALICE, "100", accounting="basic")
    for round_ in range(1, 3):
        epsilon = db.execute("select anonproxy.zcdp_epsilon(%s, 0.00001)", (D("0.21") + D("0.05") * round_ + D("0.005"),)
                             ).fetchone()[0]
        db.execute("select anonproxy.set_shared_budget('public.adult', %s, 0.00001, accounting => 'zcdp')", (epsilon,))
        charges = [(ALICE if i % 2 else BOB, f"cap{round_}q{i}") for i in range(20)]
        succeeded = asyncio.run(race(service_dsn, charges, "0.1", rho="0.01", delta_add=0))
        assert succeeded.count(True) == 5, (round_, succeeded)
    assert db.execute("select sum(rho) from anonproxy.budget_ledger").fetchone() == (D("0.31"),)


# The migration -----------------------------------------------------------------------------------------


def test_the_migration_backfills_and_never_gives_budget_back(pg_server: EmbeddedPostgres,
                                                           logins: tuple[str, ...]) -> None:  # noqa: F811
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute("drop database if exists ledger_zcdp_upgrade")
        conn.execute("create database ledger_zcdp_upgrade")
    try:
        with psycopg.connect(pg_server.conninfo(dbname="ledger_zcdp_upgrade"), autocommit=True) as conn:
            for migration in (m for m in migrations() if m.version < 19):
                with conn.transaction():  # as anonproxy.schema.install runs them
                    conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
                    conn.execute(migration.sql.encode())
            conn.execute("create table public.people (id integer primary key)")
            conn.execute("select anonproxy.protect_table('public.people', 'id')")
            # ALICE: few large answers (zCDP shows more spent: it becomes zcdp); BOB: many small ones (zCDP would show
            # less spent than their sum: it stays basic); a delta 0 budget stays basic.
            conn.execute(f"select anonproxy.set_budget('{ALICE}', 'public.people', 10, 0.00001, null, 0.5)")
            conn.execute(f"select anonproxy.set_budget('{BOB}', 'public.people', 10, 0.00001, null, 0.5)")
            conn.execute("select anonproxy.set_budget('anonproxy_service', 'public.people', 1, 0)")
            conn.execute("select anonproxy.set_shared_budget('public.people', 40, 0.001)")
            for i in range(2):
                conn.execute(f"select anonproxy.charge('{ALICE}', 'public.people', 0.5, 0.000001, 'a{i}')")
            for i in range(40):
                conn.execute(f"select anonproxy.charge('{BOB}', 'public.people', 0.1, 0, 'b{i}')")
            conn.execute("select anonproxy.charge('anonproxy_service', 'public.people', 0.25, 0, 's')")
            before = dict(conn.execute("select b.role_name, (r).epsilon from anonproxy.budgets b, "
                                       "anonproxy.remaining_budget(b.role_name, b.domain) r").fetchall())
            with conn.transaction():
                conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
                conn.execute(next(m for m in migrations() if m.version == 19).sql.encode())
            rows = conn.execute("select epsilon, delta, rho, delta_add from anonproxy.budget_ledger").fetchall()
            assert len(rows) == 43 and all(rho == epsilon * epsilon / 2 and delta_add == delta
                                           for epsilon, delta, rho, delta_add in rows)
            after = {role: (accounting, left) for role, accounting, left in conn.execute(
                "select b.role_name, b.accounting, (r).epsilon from anonproxy.budgets b, "
                "anonproxy.remaining_budget(b.role_name, b.domain) r")}
            assert {role: accounting for role, (accounting, _) in after.items()} == {
                ALICE: "zcdp", BOB: "basic", "anonproxy_service": "basic"}
            assert all(left <= before[role] for role, (_, left) in after.items()), (before, after)
            assert after[BOB][1] == before[BOB] == 6 and after["anonproxy_service"][1] == before["anonproxy_service"]
            # 0019 converts by Bun and Steinke: 0.25 + 2 sqrt(0.25 ln(1/0.000008)), rounded up
            bun_steinke = D("0.25") + 2 * (D("0.25") * -D("0.000008").ln()).sqrt()
            assert after[ALICE][1] == 10 - up12(bun_steinke)  # below 9: dearer
            # By the default rule BOB's budget (and the cap) would be zcdp; the migration kept basic: under zCDP its 40
            # small answers would show less spent than their sum.
            assert default_accounting(10, D("0.00001"), D("0.5")) == "zcdp"
            assert conn.execute("select accounting from anonproxy.shared_budgets").fetchone() == ("basic",)
            # The ledger is still append-only, and charges go on.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("update anonproxy.budget_ledger set rho = 0")
            conn.execute(f"select anonproxy.charge('{ALICE}', 'public.people', 0.5, 0, 0.0625, 0, 'after')")
    finally:
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            conn.execute("drop database if exists ledger_zcdp_upgrade")


# Through the proxy: the budget left as plain SQL ----------------------------------------------------------


MY_BUDGET_COLUMNS = ["domain", "accounting", "epsilon_budget", "epsilon_spent", "epsilon_left", "delta_budget",
                     "delta_left", "rho_spent", "rho_left", "refresh_period"]


_names = itertools.count(1)


@pytest.fixture
def zcdp_analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A fresh dp role with a zcdp budget of ε 10, δ 1e-5 on public.adult (0.5 per query), as the demo's."""
    with fresh_dp_role(truth, gated_proxy, gated_database, f"zcdp_analyst_{next(_names)}") as role:
        truth.execute("select anonproxy.set_budget(%s, 'public.adult', 10, 0.00001, null, 0.5, 0.0000001, 'zcdp')",
                      [role])
        wait_for_policy(gated_proxy, gated_database, truth.execute("select version from anonproxy.policy_version"
                                                                   ).fetchone()[0])
        yield role


def test_my_budget_through_the_proxy_with_psycopg(gated_proxy: Endpoint, gated_database: str, zcdp_analyst: str,
                                                  truth: psycopg.Connection, pg_server: EmbeddedPostgres) -> None:
    notices: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=zcdp_analyst), autocommit=True) as conn:
        conn.add_notice_handler(lambda diagnostic: notices.append(diagnostic.message_primary or ""))
        cursor = conn.execute("select * from anonproxy.my_budget")
        assert [column.name for column in cursor.description or ()] == MY_BUDGET_COLUMNS
        assert cursor.fetchall() == [("public.adult", "zcdp", D(10), D(0), D(10), D("0.00001"), D("0.00001"), D(0),
                                      zcdp_rho_max(10, D("0.00001")).quantize(D("1e-12"), "ROUND_DOWN"), None)]
        conn.execute("select count(*) from adult where age > 40").fetchone()
        assert any("this answer moved ε spent on public.adult by" in notice and " spent); left: ε " in notice
                   for notice in notices), notices
        # the extended protocol, a bound value and a prepared statement
        row = conn.execute("select epsilon_spent, epsilon_left, delta_left, rho_spent, rho_left from "
                           "anonproxy.my_budget where domain = %s", ["public.adult"], prepare=True).fetchone()
        spent, left, delta_left, rho_spent, rho_left = row
        exact_rho = truth.execute("select rho_spent from anonproxy.remaining_budget(%s, 'public.adult')",
                                  [zcdp_analyst]).fetchone()[0]
        assert rho_spent == up12(exact_rho)  # shown to 12 decimals, rounded up; the ledger keeps the exact sum
        assert rho_spent > 0 and spent == up12(zcdp_epsilon(exact_rho, delta_left)) and left == 10 - spent
        assert rho_left == (zcdp_rho_max(10, delta_left) - exact_rho).quantize(D("1e-12"), "ROUND_DOWN")
        # the same numbers as SHOW anonproxy.budget and the ledger's own function
        shown = conn.execute("show anonproxy.budget").fetchone()[0]
        four = left.quantize(D(1).scaleb(left.adjusted() - 3), rounding=ROUND_FLOOR)  # shown to 4 digits, down
        assert f"epsilon {four.normalize():f} of 10 left" in shown and "(zCDP accounting: rho " in shown
        explained = [line for (line,) in conn.execute("explain (anonproxy) select count(*) from adult where age > 50")]
        assert any(line.startswith("running it moves ε spent on public.adult by") for line in explained), explained
    assert truth.execute("select epsilon, rho_spent from anonproxy.remaining_budget(%s, 'public.adult')",
                         [zcdp_analyst]).fetchone() == (left, exact_rho)
    # Directly, not through the proxy, the same view answers the same.
    with psycopg.connect(pg_server.conninfo(user=zcdp_analyst, password=zcdp_analyst, dbname=gated_database),
                         autocommit=True) as direct:
        assert direct.execute("select epsilon_left, rho_spent from anonproxy.my_budget").fetchall() == [
            (left, rho_spent)]


def test_my_budget_through_the_proxy_with_asyncpg(gated_proxy: Endpoint, gated_database: str,
                                                  zcdp_analyst: str) -> None:
    async def main() -> tuple[list[str], list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        analyst = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=zcdp_analyst,
                                        password=zcdp_analyst, database=gated_database, timeout=10)
        reporter = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                         password="reporter", database=gated_database, timeout=10)
        try:
            statement = await analyst.prepare("select * from anonproxy.my_budget")
            names = [attribute.name for attribute in statement.get_attributes()]
            mine = [tuple(row) for row in await statement.fetch()]
            filtered = [tuple(row) for row in await analyst.fetch(
                "select domain, accounting from anonproxy.my_budget where epsilon_left > $1", D(1))]
            none = [tuple(row) for row in await reporter.fetch("select * from anonproxy.my_budget")]
            return names, mine, filtered, none
        finally:
            await analyst.close()
            await reporter.close()

    names, mine, filtered, none = asyncio.run(main())
    assert names == MY_BUDGET_COLUMNS
    assert [row[:3] for row in mine] == [("public.adult", "zcdp", D(10))]
    assert filtered == [("public.adult", "zcdp")]
    assert none == []  # a suppress role has no budget: no rows, and no error


def test_my_budget_for_roles_without_a_budget(gated_proxy: Endpoint, gated_database: str) -> None:
    for role in ("reporter", "dba"):  # suppress mode through the proxy, direct mode passed through
        with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
            cursor = conn.execute("select * from anonproxy.my_budget")
            assert [column.name for column in cursor.description or ()] == MY_BUDGET_COLUMNS
            assert cursor.fetchall() == []


@pytest.mark.parametrize("user", ["analyst", "reporter"])
def test_the_conversion_functions_are_no_channel_over_protected_rows(gated_proxy: Endpoint, gated_database: str,
                                                                     user: str) -> None:
    # zcdp_rho_max raises on a negative argument: over a person's value it would be an error channel. Neither mode
    # admits the anonproxy schema's functions in a query over a protected table (nothing runs, nothing is charged).
    with psycopg.connect(gated_proxy.dsn(gated_database, user=user), autocommit=True) as conn:
        for query in ("select count(*) from adult where anonproxy.zcdp_rho_max(age - 40, 0.00001) > 0",
                      "select anonproxy.zcdp_epsilon(age, 0.00001), count(*) from adult group by 1",
                      "select count(*) from adult a join anonproxy.my_budget b on b.epsilon_left > a.age"):
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(query)
            assert refused.value.sqlstate in ("42501", "0A000"), (query, refused.value)  # refused by the planner
            assert "exceeded" not in str(refused.value) and "must be a finite number" not in str(refused.value)


def test_explain_counts_both_questions_of_a_series_limit_under_zcdp(gated_proxy: Endpoint, gated_database: str,
                                                                    zcdp_analyst: str) -> None:
    series = ("SELECT education AS education, count(*) AS count FROM public.adult JOIN (SELECT education AS "
              "education__, count(*) AS mme_inner__ FROM public.adult GROUP BY education ORDER BY mme_inner__ DESC "
              "LIMIT 5) AS series_limit ON education = series_limit.education__ GROUP BY education")
    with psycopg.connect(gated_proxy.dsn(gated_database, user=zcdp_analyst), autocommit=True) as conn:
        def explained(sql: str) -> list[str]:
            return [line for (line,) in conn.execute(f"explain (anonproxy) {sql}")]

        def zcdp_costs(lines: list[str]) -> list[str]:
            return [line.split("costs ρ=")[1].split(",")[0] for line in lines if "costs ρ=" in line]

        def moved(lines: list[str]) -> list[float]:
            return [float(line.split(" by ")[1].split(":")[0]) for line in lines
                    if line.startswith("running it moves ε spent on public.adult by")]

        lines = explained(series)
        single = explained("select education, count(*) from adult group by education")
        assert len(zcdp_costs(lines)) == 2 and set(zcdp_costs(lines)) == set(zcdp_costs(single)), lines
        # one figure for both questions: more than either alone (their ρ adds up), less than twice (the conversion
        # is concave in the ρ spent)
        assert len(moved(lines)) == 1 and len(moved(single)) == 1, lines
        assert moved(single)[0] < moved(lines)[0] < 2 * moved(single)[0], lines
        conn.execute("select education, count(*) from adult group by education").fetchall()
        assert not moved(explained("select education, count(*) from adult group by education")), \
            "cached: nothing to charge"
