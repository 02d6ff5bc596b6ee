"""A new text of a dp role crosses to the analysis process once (issue 24: "a new dp question ≤ 2× the relayed
statement"): the router's decision and the pricing of what it measures are one call there
(anonproxy.dp.answers.decided_and_priced), where they were two; the answer is the one the two calls gave, cached under
the same key (the measured SQL's tokens are computed there too, and are not part of the key's text)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from conftest import SERVICE_ROLE, govern_by_demo_policy

from anonproxy.dp.answers import fingerprint, folded, priced_checked
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.proxy.analysis import Analyser
from anonproxy.proxy.gate import Parameters
from anonproxy.proxy.noisy import NoisyAnswers, SessionLimits
from anonproxy.proxy.session import ProxyContext
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy
from anonproxy.wire.results import Result

ROLE = "analyst"
QUESTIONS = ("select education, count(*) from adult group by education",
             "select sex, avg(age) from adult where hours_per_week > 30 group by 1",
             "select count(*) from adult where age > 30;")


class Counted(Analyser):
    """The real analysis processes, counting the calls made to them."""

    def __init__(self) -> None:
        super().__init__(30.0, processes=1)
        self.calls: list[str] = []

    async def run(self, function: Any, *args: Any, asker: Any, shared: tuple[Any, ...] = ()) -> Any:
        self.calls.append(function.__name__)
        return await super().run(function, *args, asker=asker, shared=shared)


@pytest.fixture
def governed(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres) -> tuple[Policy, str]:
    """A fresh database under the demo policy: the policy as the proxy loads it and the service login's DSN."""
    dbname = postgresql.info.dbname
    postgresql.autocommit = True
    govern_by_demo_policy(postgresql, dbname)
    return load_policy(postgresql), pg_server.conninfo(user=SERVICE_ROLE, password=SERVICE_ROLE, dbname=dbname)


def _asked(policy: Policy, dsn: str, sql: str) -> tuple[list[str], Result]:
    """The analysis calls a new text makes, from the worker's decision to its answer, and the answer, on a worker
    that has answered the role before (so it knows the role's per-query cost: its first question is priced at the
    proxy's default, then again at the cost the ledger reads)."""
    role = policy.role(ROLE)

    async def run() -> tuple[list[str], Result]:
        analyser = Counted()
        noisy = NoisyAnswers(dsn, analyser=analyser)
        context = ProxyContext(upstream=None, cancel_keys=None, noisy=noisy, analyser=analyser)  # type: ignore[arg-type]
        try:
            answer = None
            for text in ("select count(*), avg(age) from adult", sql):
                analyser.calls.clear()
                decision = await context.decide(text, role, policy, asker=1)
                assert isinstance(decision, Noisy), decision
                answer = await noisy.answer(decision, role, policy, Parameters(), SessionLimits())
            assert answer is not None
            return analyser.calls, answer
        finally:
            await noisy.close()
            analyser.close()

    return asyncio.run(run())


@pytest.mark.parametrize("sql", QUESTIONS)
def test_a_new_dp_text_is_decided_and_priced_in_one_analysis_call(governed: tuple[Policy, str], sql: str) -> None:
    policy, dsn = governed
    calls, answer = _asked(policy, dsn, sql)
    assert calls == ["decided_and_priced"]  # before: decide, then priced_checked
    assert answer.rows and b"differentially private answer" in answer.notices


def test_the_answer_cache_key_is_the_same_with_the_tokens_computed_where_the_plan_is_priced(
        governed: tuple[Policy, str]) -> None:
    policy, _ = governed
    role = policy.role(ROLE)
    for sql in QUESTIONS:
        decision = decide(sql, role, policy)
        assert isinstance(decision, Noisy) and decision.plan is not None
        plan = priced_checked(decision.plan, role, policy, DPParams(0.5, 1e-7, accounting="zcdp"))
        assert isinstance(plan, DPPlan)
        assert plan.measured_tokens == folded(plan.measured) != ""
        assert fingerprint(plan, 3, ()) == fingerprint(replace(plan, measured_tokens=""), 3, ())
