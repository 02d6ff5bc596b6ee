"""The answer cache's key (anonproxy.dp.answers.fingerprint) writes the plan's measurement once per plan object (issue
23: a dp question's first answer, and every cached one, wrote it again, 60-170 µs): the key a plan gets is the same
whether its measurement was written before or not, and never another plan's."""

from __future__ import annotations

from dataclasses import replace

import psycopg
import pytest
from conftest import govern_by_demo_policy

from anonproxy.dp.answers import fingerprint, priced_checked
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy

QUESTIONS = ("select count(*) from adult", "select education, avg(age) from adult group by 1",
             "select sex, sum(capital_gain) from adult where age > 40 group by sex")


@pytest.fixture
def plans(postgresql: psycopg.Connection) -> list[DPPlan]:
    """The questions' plans under the demo policy, as the worker prices them."""
    postgresql.autocommit = True
    govern_by_demo_policy(postgresql, postgresql.info.dbname)
    policy: Policy = load_policy(postgresql)
    role = policy.role("analyst")
    priced = []
    for sql in QUESTIONS:
        decision = decide(sql, role, policy)
        assert isinstance(decision, Noisy) and decision.plan is not None
        plan = priced_checked(decision.plan, role, policy, DPParams(0.5, 1e-7))
        assert isinstance(plan, DPPlan)
        priced.append(plan)
    return priced


def test_a_plan_gets_the_key_of_an_equal_plan_written_afresh(plans: list[DPPlan]) -> None:
    for plan in plans:
        first = fingerprint(plan, 7, ("a",), (("TimeZone", "UTC"),))
        again = fingerprint(plan, 7, ("a",), (("TimeZone", "UTC"),))  # the same object: its measurement kept
        copy = replace(plan)  # an equal plan, another object: its measurement written afresh
        assert copy is not plan
        assert first == again == fingerprint(copy, 7, ("a",), (("TimeZone", "UTC"),))
        # what is not the plan's is still part of the key, kept measurement or not
        assert len({first, fingerprint(plan, 8, ("a",), (("TimeZone", "UTC"),)),
                    fingerprint(plan, 7, ("b",), (("TimeZone", "UTC"),)), fingerprint(plan, 7, ("a",), ())}) == 4
    assert len({fingerprint(plan, 7, (), ()) for plan in plans}) == len(plans)


def test_plans_made_and_dropped_one_after_another_never_share_a_key(plans: list[DPPlan]) -> None:
    """Plans made and dropped in turn often get the address of one dropped before (CPython reuses it): each still
    gets its own key, also once more plans were fingerprinted than the 4 MB of measurements kept hold (a few kB
    each), and the first plan's key is the one it had."""
    plan = plans[1]
    before = fingerprint(plan, 1, ())
    keys = set()
    for number in range(3000):
        keys.add(fingerprint(replace(plan, epsilon=float(number + 1)), 1, ()))  # dropped after its key
    assert len(keys) == 3000 and before not in keys
    assert fingerprint(plan, 1, ()) == before == fingerprint(replace(plan), 1, ())
