"""The dp question's rules, without a database: anonproxy.dp.question driven by a script of outcomes.

The question is a generator of requests (price, look up, check, charge, read, store, finish); here a fake driver
answers them from Python values and records the order they came in. What the tests hold: the charge commits before
any row is read, a question stopped before it costs nothing, a cached answer is not charged, a cost read from the
ledger that differs re-prices the same measurement (never measures the statement again), LIMIT/OFFSET parameters
bind as PostgreSQL binds them, and the budget arithmetic of notices, EXPLAIN and a series limit's two charges.
The same rules run end to end in tests/test_dp_proxy.py, test_dp_session.py and test_dp_charge.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest

from anonproxy.dp import ledger
from anonproxy.dp.answers import encoded
from anonproxy.dp.finish import measure
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import Packed, price
from anonproxy.dp.question import (
    Asked,
    Charge,
    Check,
    CheckStop,
    Finish,
    Limits,
    Lookup,
    MeasureText,
    Price,
    Read,
    Refused,
    Store,
    add_spent,
    answer,
    bound_tail,
    moved,
    state,
)
from anonproxy.policy.model import Policy, ProtectedTable, RolePolicy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy
from anonproxy.wire.results import Column, Result

POLICY = Policy(version=1, tables={"public.adult": ProtectedTable("public.adult", "id")})
ROLE = RolePolicy("researcher", "dp")
COUNT = "select count(*) from adult"


@dataclass(frozen=True)
class Bind:
    types: tuple[int, ...] = ()
    formats: tuple[int, ...] = ()
    values: tuple[bytes | None, ...] = ()


@dataclass
class Spent:
    relations: tuple[str, ...] = ()
    epsilon: Decimal | float | None = None
    delta: Decimal | float | None = None
    rho: Decimal | float | None = None
    delta_add: Decimal | float | None = None
    budget_domain: str | None = None
    accounting: str | None = None
    epsilon_spent_delta: Decimal | None = None
    epsilon_spent_after: Decimal | None = None


def _measured(sql: str = COUNT) -> Packed:
    decision = decide(sql, ROLE, POLICY)
    assert isinstance(decision, Noisy) and decision.plan is not None and decision.plan.table == "public.adult"
    return decision.plan


def _lookup(epsilon: str | None = None, answer: bytes | None = None) -> ledger.Lookup:
    return ledger.Lookup(None if epsilon is None else Decimal(epsilon), None, "basic", "v1", answer)


def _remaining(spent: str = "0.5", accounting: str = "basic", rho_spent: str = "0") -> ledger.Remaining:
    return ledger.Remaining(
        role="researcher", domain="public.adult", epsilon=Decimal(10) - Decimal(spent), delta=Decimal("1e-5"),
        role_epsilon=Decimal(10) - Decimal(spent), role_delta=Decimal("1e-5"), shared_epsilon=None,
        shared_delta=None, epsilon_budget=Decimal(10), delta_budget=Decimal("1e-5"), refresh_period=None,
        epsilon_per_query=None, delta_per_query=None, accounting=accounting,  # type: ignore[arg-type]
        epsilon_spent=Decimal(spent), rho_spent=Decimal(rho_spent),
        rho_left=Decimal(1) if accounting == "zcdp" else None, shared_accounting=None, shared_rho_left=None,
        epsilon_spent_delta=Decimal(spent))


@dataclass
class Driver:
    """Answers a question's requests from Python values; ``asked`` records them in order."""

    lookups: list[ledger.Lookup] = field(default_factory=lambda: [_lookup()])
    stop_at: int | None = None  # the CheckStop (counted from 1) that refuses with 57014
    read_fails: bool = False
    asked: list[Any] = field(default_factory=list)

    def run(self, steps: Generator[Any, Any, Any]) -> Any:
        outcome: Any = None
        while True:
            try:
                need = steps.send(outcome)
            except StopIteration as done:
                return done.value
            self.asked.append(need)
            outcome = self.do(need)

    def do(self, need: Any) -> Any:
        handlers: dict[type, Callable[[Any], Any]] = {
            Price: lambda need: price(need.question.open(), need.params),
            Lookup: lambda need: self.lookups.pop(0) if len(self.lookups) > 1 else self.lookups[0],
            CheckStop: self.check_stop,
            Check: lambda need: None,
            Charge: lambda need: _remaining(str(need.plan.epsilon)),
            Read: self.read,
            Store: lambda need: None,
            Finish: lambda need: Result((Column("count", 20),), ((b"1042",),)),
        }
        return handlers[type(need)](need)

    def check_stop(self, need: CheckStop) -> None:
        stops = sum(isinstance(seen, CheckStop) for seen in self.asked)
        if stops == self.stop_at:
            raise Refused("57014", "canceling statement due to user request")

    def read(self, need: Read) -> tuple[str | None, list[int], list[tuple[Any, ...]]]:
        if self.read_fails:
            raise Refused("08006", "the connection was lost")
        return "v1", [20], [(1040,)]

    def kinds(self) -> list[str]:
        return [type(need).__name__ for need in self.asked]


def _asked(sql: str = COUNT, limits: Limits | None = None, parameters: Bind | None = None) -> Asked:
    return Asked(sql, _measured(sql), "researcher", parameters or Bind(), limits or Limits())


def test_the_charge_commits_before_any_row_is_read() -> None:
    driver, spent = Driver(), Spent()
    result = driver.run(answer(_asked(), {}, 1, spent))
    assert driver.kinds() == ["Price", "Lookup", "CheckStop", "Check", "CheckStop", "Charge", "Read", "Store",
                              "Finish"]
    charge = next(need for need in driver.asked if isinstance(need, Charge))
    assert spent.epsilon == charge.plan.epsilon == 0.5 and spent.budget_domain == "public.adult"
    assert b"this answer moved \xce\xb5 spent on public.adult" in result.notices


def test_a_question_stopped_before_its_charge_costs_nothing() -> None:
    driver, spent = Driver(stop_at=2), Spent()
    with pytest.raises(Refused) as refused:
        driver.run(answer(_asked(), {}, 1, spent))
    assert refused.value.sqlstate == "57014"
    assert "Charge" not in driver.kinds() and "Read" not in driver.kinds()
    assert spent.epsilon == 0 and spent.epsilon_spent_after is None


def test_a_question_that_fails_after_its_charge_stays_charged() -> None:
    driver, spent = Driver(read_fails=True), Spent()
    with pytest.raises(Refused):
        driver.run(answer(_asked(), {}, 1, spent))
    assert driver.kinds()[-2:] == ["Charge", "Read"]
    assert spent.epsilon == 0.5 and spent.epsilon_spent_after == Decimal("0.5")


def test_the_charge_names_the_read_it_may_be_sent_with() -> None:
    """A driver may send the charge and the read in one round trip only because the charge says which read follows
    it, and that read is the next request: nothing comes between them (no Store, no Finish of the answer)."""
    driver = Driver()
    driver.run(answer(_asked(), {}, 1, Spent()))
    at = driver.kinds().index("Charge")
    charge, read = driver.asked[at], driver.asked[at + 1]
    assert isinstance(read, Read) and charge.then is read and not read.free and read.plan is charge.plan


def test_the_charge_names_the_check_it_may_be_sent_after() -> None:
    """A driver may keep the check for the charge's round trip only because the charge names it and nothing but a
    CheckStop (no I/O) comes between them: the server, running the check first, skips the charge when it fails."""
    driver = Driver()
    driver.run(answer(_asked(), {}, 1, Spent()))
    kinds = driver.kinds()
    at = kinds.index("Charge")
    assert kinds[at - 2:at] == ["Check", "CheckStop"] and driver.asked[at].check is driver.asked[at - 2]


def test_a_read_sent_with_the_charge_that_failed_fails_at_the_read_charged() -> None:
    """The driver keeps the failure of a read it sent with the charge for the Read: the charge's outcome is recorded
    first, so the audit trail says the question was charged."""
    driver, spent = Driver(read_fails=True), Spent()
    steps = answer(_asked(), {}, 1, spent)
    with pytest.raises(Refused):
        driver.run(steps)
    assert driver.kinds()[-2:] == ["Charge", "Read"] and driver.asked[-2].then is driver.asked[-1]
    assert spent.epsilon == 0.5 and spent.epsilon_spent_delta == Decimal("0.5")


def test_a_cached_answer_is_finished_without_a_charge() -> None:
    plan = price(_measured().open(), _asked_params())
    assert isinstance(plan, DPPlan)
    cached = encoded(measure(plan, [20], [(1040,)]).canonical(plan))
    driver, spent = Driver(lookups=[_lookup(answer=cached)]), Spent()
    result = driver.run(answer(_asked(), {}, 1, spent))
    assert driver.kinds() == ["Price", "Lookup", "CheckStop", "Finish"]
    assert spent.epsilon == 0 and b"at no cost" in result.notices


def _asked_params() -> DPParams:
    return DPParams(0.5, 1e-7)


def test_a_cost_change_prices_the_same_measurement_again() -> None:
    asked, known = _asked(), {}
    driver = Driver(lookups=[_lookup("1.5"), _lookup("1.5")])
    driver.run(answer(asked, known, 1, Spent()))
    prices = [need for need in driver.asked if isinstance(need, Price)]
    assert [need.params.epsilon for need in prices] == [0.5, 1.5]  # the default first, then the ledger's
    assert all(need.question is asked.measured for need in prices)  # priced again, never measured again
    assert not isinstance(asked.measured, str)
    first = price(asked.measured.open(), prices[0].params)
    assert isinstance(first, DPPlan) and prices[1].checked == {first.sql}  # its SQL, checked once, is not again
    assert not any(isinstance(need, MeasureText) for need in driver.asked)
    charge = next(need for need in driver.asked if isinstance(need, Charge))
    assert charge.plan.epsilon == 1.5
    assert known == {"public.adult": (Decimal("1.5"), Decimal("1e-7"), "basic")}
    # The next question of the role is priced at the cost read: one Price, one Lookup.
    again = Driver(lookups=[_lookup("1.5")])
    again.run(answer(_asked(), known, 1, Spent()))
    assert again.kinds()[:2] == ["Price", "Lookup"] and again.kinds().count("Price") == 1


def test_a_cost_that_keeps_changing_is_refused_with_40001() -> None:
    driver = Driver(lookups=[_lookup("1.1"), _lookup("1.2"), _lookup("1.3"), _lookup("1.4")])
    with pytest.raises(Refused) as refused:
        driver.run(answer(_asked(), {}, 1, Spent()))
    assert refused.value.sqlstate == "40001" and 'role "researcher" on public.adult' in str(refused.value)
    assert "Charge" not in driver.kinds()


def test_the_session_setting_lowers_the_price() -> None:
    driver = Driver(lookups=[_lookup("1.5")])
    known = {"public.adult": (Decimal("1.5"), Decimal("1e-7"), "basic")}
    driver.run(answer(_asked(limits=Limits(epsilon=Decimal("0.25"))), known, 1, Spent()))
    price_need = next(need for need in driver.asked if isinstance(need, Price))
    assert price_need.params.epsilon == 0.25


def test_a_refused_statement_is_refused_before_any_lookup() -> None:
    driver = Driver()
    with pytest.raises(Refused) as refused:
        driver.run(answer(_asked("select sum(age) from adult"), {}, 1, Spent()))
    assert refused.value.sqlstate == "0A000" and "declared bounds" in str(refused.value)
    assert driver.kinds() == ["Price"]


def _limited(sql: str) -> DPPlan:
    plan = price(_measured(sql).open(), _asked_params())
    assert isinstance(plan, DPPlan)
    return plan


@pytest.mark.parametrize(("values", "formats", "limit", "offset"), [
    ((b"5", b"2"), (0, 0), 5, 2),
    ((None, None), (0, 0), None, 0),  # NULL: no limit, offset 0
    (((7).to_bytes(4, "big"), (3).to_bytes(8, "big")), (1, 1), 7, 3),  # binary int4, int8
])
def test_limit_and_offset_parameters_bind_as_postgresql_reads_them(values: tuple[bytes | None, ...],
                                                                   formats: tuple[int, ...], limit: int | None,
                                                                   offset: int) -> None:
    plan = bound_tail(_limited(COUNT + " limit $1 offset $2"), Bind((), formats, values))
    assert (plan.limit, plan.offset) == (limit, offset)


@pytest.mark.parametrize(("values", "formats", "sqlstate"), [
    ((b"-1", b"0"), (0, 0), "2201W"),
    ((b"1", b"-3"), (0, 0), "2201X"),
    ((b"ten", b"0"), (0, 0), "22P02"),
    ((b"\x01\x02\x03", b"0"), (1, 0), "22P02"),  # a binary value of no integer width
    ((b"1",), (0,), "08P01"),  # $2 has no value
])
def test_limit_and_offset_binding_errors(values: tuple[bytes | None, ...], formats: tuple[int, ...],
                                         sqlstate: str) -> None:
    with pytest.raises(Refused) as refused:
        bound_tail(_limited(COUNT + " limit $1 offset $2"), Bind((), formats, values))
    assert refused.value.sqlstate == sqlstate


def test_limit_parameters_are_not_part_of_the_measurement() -> None:
    plan = _limited(COUNT + " limit $1")
    assert plan.unmeasured_parameters == (1,)
    driver = Driver()
    keys = []
    for value in (b"5", b"10"):
        driver.asked.clear()
        driver.run(answer(_asked(COUNT + " limit $1", parameters=Bind((), (0,), (value,))), {}, 1, Spent()))
        keys.append(next(need for need in driver.asked if isinstance(need, Lookup)).key)
    assert keys[0] == keys[1]


def test_budget_state_and_what_a_question_moves_under_basic_accounting() -> None:
    plan = _limited(COUNT)
    budget = _remaining("1.5")
    assert state(budget) == "ε spent 1.5 of 10; left: ε 8.5, δ 0.00001"
    assert moved([plan, plan], budget) == "running it moves ε spent on public.adult by 1: from 1.5 to 2.5 of 10"


def test_what_a_question_moves_under_zcdp_is_the_conversion_of_the_rho_added() -> None:
    plan = _limited(COUNT)  # one discrete Laplace at ε = 0.5, no partition selection: ρ = ε²/2, δ_add = 0
    assert (plan.rho, plan.delta_add) == (0.125, 0)
    budget = _remaining("0", "zcdp", "0")
    # The conversion of ρ-zCDP at δ = 1e-5 (the role's δ left), found here by a plain search over the order α:
    # min over α > 1 of αρ + (ln(1/δ) + (α−1)·ln(1 − 1/α) − ln α)/(α − 1).
    rho, log = 0.125, math.log(1e5)
    expected = min(a * rho + (log + (a - 1) * math.log(1 - 1 / a) - math.log(a)) / (a - 1)
                   for a in (1 + i / 1000 for i in range(1, 100_000)))
    text = moved([plan], budget)
    figure = Decimal(text.split(" by ")[1].split(":")[0])
    assert abs(float(figure) - expected) < 0.001, text
    assert float(figure) < rho + 2 * math.sqrt(rho * log)  # tighter than Bun and Steinke's ρ + 2√(ρ ln(1/δ))


def test_a_series_limits_two_charges_add_up() -> None:
    first = Spent(("public.adult",), 0.5, 1e-7, 0.125, 1e-7, "public.adult", "basic", Decimal("0.5"),
                  Decimal("1.0"))
    second = Spent(("public.visits",), 0.5, 1e-7, 0.125, 1e-7, "public.adult", "basic", Decimal("0.5"),
                   Decimal("1.5"))
    add_spent(first, second)
    assert first.relations == ("public.adult", "public.visits")
    assert (first.epsilon, first.rho, first.epsilon_spent_delta, first.epsilon_spent_after) == (
        1.0, 0.25, Decimal("1.0"), Decimal("1.5"))
