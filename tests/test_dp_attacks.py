"""Attacks on dp mode (issue 4, item 6): averaging, differencing and a tracker.

Each attack is run twice:

* through the proxy, as a dp role, to show what it costs: every distinct
  question is charged to the ledger, a repeated question is answered from the
  cache at no cost (so it cannot be averaged);
* against the plan and the exact samplers (``plan_dp`` + ``answer`` on the real
  PostgreSQL), thousands of times in two neighbouring worlds — with and without
  the targeted fact — to measure how often the attacker guesses right. ε-DP
  bounds the accuracy of *any* guess between two neighbours, from the two
  answers together (ε = the sum of both queries' ε), by e^ε / (1 + e^ε); the
  tests assert the measured accuracy stays below that bound with a margin of
  five binomial standard deviations (a false alarm once in ~3 million runs),
  and that the attack without noise would have been exact (so the test would
  fail on an implementation that leaks).
"""

from __future__ import annotations

import math

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures

from anonproxy.dp.finish import answer
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.model import RolePolicy
from anonproxy.policy.yaml_policy import demo_policy

DRAWS = 4000
EPSILON = 0.5  # per query, as the proxy tests' budgets
ROLE = RolePolicy("attacker", "dp")


def _plan(sql: str) -> DPPlan:
    plan = plan_dp(sql, ROLE, demo_policy(), DPParams(EPSILON, 1e-7))
    assert isinstance(plan, DPPlan), plan
    return plan


def _count(plan: DPPlan, rows: list[tuple]) -> int:
    ((value,),), _ = answer(plan, rows)
    return value


def _accuracy_bound(epsilon: float) -> float:
    """The most often any test can tell two ε-DP neighbours apart (equal priors), plus five standard deviations
    of the measured accuracy over 2·DRAWS guesses."""
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    return p + 5 * math.sqrt(p * (1 - p) / (2 * DRAWS))


def _guess_accuracy(world_with: tuple[DPPlan, list, DPPlan, list], world_without: tuple[DPPlan, list, DPPlan, list]
                    ) -> float:
    """The attacker subtracts the second answer from the first and guesses "with" when the difference is ≥ 1/2
    (the fact adds exactly 1 to the first count). Its accuracy over DRAWS answers in each world."""
    right = 0
    for world, expected in ((world_with, True), (world_without, False)):
        first, first_rows, second, second_rows = world
        for _ in range(DRAWS):
            difference = _count(first, first_rows) - _count(second, second_rows)
            right += (difference >= 0.5) == expected
    return right / (2 * DRAWS)


# --- through the proxy: what each attack costs ------------------------------------------------------


def test_averaging_gets_one_answer_per_charge(gated_proxy: Endpoint, gated_database: str, analyst: str  # noqa: F811
                                              ) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        # the same question, asked again (keywords' case, whitespace, operator spacing, comments and the schema do
        # not matter: the plan is rendered from the parsed statement, so these spellings make the same plan)
        same = ["select count(*) from adult where age > 60", "SELECT COUNT(*)\nFROM public.adult WHERE age > 60",
                "select count(*) from adult where age>60", "select /* again */ count(*) from adult where age >60"]
        answers = {conn.execute(text).fetchone()[0] for text in same * 3}
        assert len(answers) == 1, "a repeated question gets the cached answer, not fresh noise to average"
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "twelve askings, one charge"
        # the question written differently inside a clause is a new question: fresh noise, and charged
        for text in ("select count(*) from adult where (age > 60)", "select count(*) from adult where 60 < age"):
            conn.execute(text).fetchone()
        assert "epsilon 0.5 of 2 left" in budget_left(conn), "averaging k answers costs k·ε"


def test_differencing_and_a_tracker_cost_budget(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                                truth: psycopg.Connection) -> None:  # noqa: F811
    target = _female_high_earner(truth)
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        # differencing: everybody, and everybody but the target
        conn.execute("select count(*) from adult").fetchone()
        conn.execute(f"select count(*) from adult where id <> {target}").fetchone()
        assert "epsilon 1 of 2 left" in budget_left(conn)
        # tracker: "men, or the target if she earns >50K", minus "men"
        conn.execute(f"select count(*) from adult where sex = 'Male' or (id = {target} and income = '>50K')")
        conn.execute("select count(*) from adult where sex = 'Male'").fetchone()
        assert "epsilon 0 of 2 left" in budget_left(conn)
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("select count(*) from adult where sex = 'Female'")
        assert refused.value.sqlstate == "53400"  # the budget caps how many differences can be taken


def test_copies_row_order_and_having_oracles_learn_nothing_free(gated_proxy: Endpoint, gated_database: str,
                                                                analyst: str,  # noqa: F811
                                                                truth: psycopg.Connection) -> None:  # noqa: F811
    education = demo_policy().tables["public.adult"].columns["education"].domain
    (doctor,) = truth.execute("select min(id) from adult where education = 'Doctorate'").fetchone()
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        # 60 copies of one median: charged once, so drawn once (60 independent draws would average the noise away)
        items = ", ".join(["median(age)"] * 60)
        row = conn.execute(f"select {items} from adult where education = 'Doctorate' and sex = 'Female'").fetchone()
        assert len(set(row)) == 1, row
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        # the rows' order is the domain's, whether or not the target's group is empty
        for target in (f"id = {doctor}", "id = -1"):  # Doctorate holds one person, then none
            rows = conn.execute(f"select education, count(*) from adult where education <> 'Doctorate' or {target} "
                                "group by education").fetchall()
            assert [key for key, _ in rows] == list(education)
        # HAVING against 'NaN' is refused at planning, before anything is read or charged (it used to fail in
        # the answer only when some group passed: a free oracle)
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("select age, count(*) from adult where age = 90 group by age having count(*) > 'NaN'")
        assert refused.value.sqlstate == "22023" and "finite" in str(refused.value)
        assert refused.value.diag.message_hint
        assert "epsilon 0.5 of 2 left" in budget_left(conn)


# --- against the mechanisms: how much each attack learns --------------------------------------------


def _female_high_earner(conn: psycopg.Connection) -> int:
    return conn.execute("select min(id) from adult where sex = 'Female' and income = '>50K'").fetchone()[0]


def test_differencing_learns_no_more_than_epsilon_allows(postgresql: psycopg.Connection) -> None:
    """Is the target in the table? Neighbours: adult with and without the target's row."""
    target = _female_high_earner(postgresql)
    everybody = _plan("select count(*) from adult")
    but_target = _plan(f"select count(*) from adult where id <> {target}")
    with_rows = (everybody, postgresql.execute(everybody.sql).fetchall(),
                 but_target, postgresql.execute(but_target.sql).fetchall())
    postgresql.execute("delete from adult where id = %s", [target])
    without_rows = (everybody, postgresql.execute(everybody.sql).fetchall(),
                    but_target, postgresql.execute(but_target.sql).fetchall())
    assert with_rows[1][0][0] - with_rows[3][0][0] == 1 and without_rows[1][0][0] == without_rows[3][0][0]
    accuracy = _guess_accuracy(with_rows, without_rows)  # without noise it would be 1.0
    assert accuracy <= _accuracy_bound(2 * EPSILON), accuracy
    assert accuracy > 0.52  # the noise is calibrated, not infinite: the guess is still better than a coin


def test_a_tracker_learns_no_more_than_epsilon_allows(postgresql: psycopg.Connection) -> None:
    """Does the target (a woman) earn >50K? Neighbours: the target's row with either income."""
    target = _female_high_earner(postgresql)
    padded = _plan(f"select count(*) from adult where sex = 'Male' or (id = {target} and income = '>50K')")
    men = _plan("select count(*) from adult where sex = 'Male'")
    high = (padded, postgresql.execute(padded.sql).fetchall(), men, postgresql.execute(men.sql).fetchall())
    postgresql.execute("update adult set income = '<=50K' where id = %s", [target])
    low = (padded, postgresql.execute(padded.sql).fetchall(), men, postgresql.execute(men.sql).fetchall())
    assert high[1][0][0] - high[3][0][0] == 1 and low[1][0][0] == low[3][0][0]  # the tracker works exactly
    # Changing one person's row is two add/remove steps: each answer is 2·ε/query-DP for it, so 4ε for both.
    accuracy = _guess_accuracy(high, low)
    assert accuracy <= _accuracy_bound(4 * EPSILON), accuracy
    assert accuracy > 0.52
