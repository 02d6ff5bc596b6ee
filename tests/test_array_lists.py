"""``x = ANY(ARRAY[...])`` and ``x <> ALL(ARRAY[...])`` in gated statements: the IN lists SQL defines them as.

Application code often writes a set of values as an array; the analysis rewrites these two forms to ``IN`` and
``NOT IN`` and checks them as such (in dp mode a list on a key with a declared domain restricts the released
values). An array parameter (``= ANY($1)``) stays refused: its element type is the client's choice.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from test_rewrite import DP, POLICY, SUPPRESS

from anonproxy.dp.model import DPParams
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

PAIRS = [
    ("select sex, count(*) from adult where native_country = any(array['Cuba', 'Mexico']) group by sex",
     "select sex, count(*) from adult where native_country in ('Cuba', 'Mexico') group by sex"),
    ("select sex, count(*) from adult where native_country <> ALL (ARRAY['Cuba', 'Mexico']) group by sex",
     "select sex, count(*) from adult where native_country not in ('Cuba', 'Mexico') group by sex"),
    ("select sex, count(*) from adult where age = any(array[20, 30, 40]) and sex <> all(array['x']) group by sex",
     "select sex, count(*) from adult where age in (20, 30, 40) and sex not in ('x') group by sex"),
]


def test_the_array_forms_are_the_lists() -> None:
    for array, _ in PAIRS:
        rewritten = decide(array, SUPPRESS, POLICY)
        assert isinstance(rewritten, Rewrite), (array, rewritten)
        assert " IN (" in rewritten.sql and "ANY" not in rewritten.sql.upper()


@pytest.mark.parametrize("sql", [
    "select sex, count(*) from adult where native_country = any($1) group by sex",
    "select sex, count(*) from adult where native_country <> all($1) group by sex",
    "select sex, count(*) from adult where age < any(array[20, 30]) group by sex",
    "select sex, count(*) from adult where age = all(array[20]) group by sex",
    "select sex, count(*) from adult where age = any(array[age, 1.5::float8]) group by sex",  # casts age
])
def test_other_uses_of_any_and_all_are_refused(sql: str) -> None:
    for role in (SUPPRESS, DP):
        decision = decide(sql, role, POLICY)
        if isinstance(decision, Noisy):  # dp: the planner decides
            decision = plan_dp(decision.sql, role, POLICY, DPParams(epsilon=1, delta=1e-6))
        assert isinstance(decision, Reject) and "ANY/ALL" in decision.message, (role.mode, sql, decision)
        assert "IN ($1, $2, ...)" in (decision.message + (decision.hint or "")), decision


def test_suppress_answers_as_the_lists(gated_proxy: Endpoint, gated_database: str,
                                      truth: psycopg.Connection) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        for array, listed in PAIRS:
            assert sorted(conn.execute(array).fetchall()) == sorted(truth.execute(listed).fetchall()), array


def test_dp_a_key_array_restricts_its_domain(gated_proxy: Endpoint, gated_database: str,
                                             truth: psycopg.Connection) -> None:
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_array_lists") as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        rows = conn.execute("select education, count(*) from adult where education = any(array['Bachelors', "
                            "'Masters']) group by education").fetchall()
        assert sorted(education for education, _ in rows) == ["Bachelors", "Masters"]
        exact = dict(truth.execute("select education, count(*) from adult where education in ('Bachelors', "
                                   "'Masters') group by education").fetchall())
        assert all(abs(n - exact[education]) < 50 for education, n in rows)
