"""One dp question, sans-I/O: a generator that says what it needs, and the rules it keeps (docs/dp.md).

In the style of psycopg 3's ``generators``: :func:`answer` (and :func:`explain`,
:func:`priced`) never touch a socket, a clock or a database. Each step they
cannot take alone is *yielded* as a request — price the measurement at a cost
(:class:`Price`), look the question up in the ledger (:class:`Lookup`), check
its SQL (:class:`Check`), charge it (:class:`Charge`), read its rows
(:class:`Read`), store the measurement (:class:`Store`), make the answer from
it (:class:`Finish`), … — and the driver (:mod:`anonproxy.proxy.noisy`) does
the I/O and sends the outcome back in. A failure of the I/O is the driver's
exception: the generator does not catch it, so what it did before stays done
(a charge stays charged).

The rules, here and nowhere else:

* **Measure, then price.** The statement is measured once, where it was parsed
  (:func:`anonproxy.dp.plan.measure`); a question is priced at the per-query
  ε and δ this worker last read for the role and table, lowered by the
  session's ``SET anonproxy.epsilon | delta``. When the ledger's lookup reads
  another per-query cost, the same measurement is priced again (never planned
  again), at most :data:`PRICE_TRIES` times (then 40001), and SQL it wrote
  before is not checked again.
* **The charge commits before the first row is read**: :class:`Charge` comes
  before :class:`Read`, and nothing of the answer exists before it. The
  Charge names the Read that follows it (``then``), so that the driver may
  send both in one round trip, the read after the charge's COMMIT; what the
  charge returned is recorded before the Read's outcome is taken, so a read
  that fails leaves the question recorded as charged. It also names the
  Check before it (``check``), which the driver may send first in that round
  trip: a check that fails skips the charge, and fails the Charge uncharged. A
  question stopped before the charge (:class:`CheckStop`: the time limit, a
  cancel) costs nothing; a cached answer is finished at no cost; a question
  that only lists public domains reads no row and is not charged. A Charge made after a folded lookup
  (``unless_answered``: the driver read nothing) may send back what the ledger read instead of charging (an
  answer cached, another per-query cost): nothing was charged or read, and the question is asked again from it,
  never folded twice.
* **LIMIT $n / OFFSET $n** are bound here, as PostgreSQL reads them
  (:func:`bound_tail`: 2201W, 2201X, 22P02, 08P01), and are not part of the
  measurement (:func:`measured_parameters`).
* **The budget arithmetic** of notices and EXPLAIN (:func:`state`,
  :func:`moved`) and of a series limit's two charges (:func:`add_spent`).
"""

from __future__ import annotations

from collections.abc import Generator, MutableMapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Protocol, TypeAlias

from anonproxy.dp import amounts, ledger
from anonproxy.dp.answers import (
    DEFAULT_COSTS,
    cost,
    decoded,
    encoded,
    explained,
    fingerprint,
    or_default,
    row_texts,
    series_question,
)
from anonproxy.dp.finish import Measurement, measure
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import Packed
from anonproxy.plan import render
from anonproxy.plan.outer import ROWS, Outer, Series
from anonproxy.plan.refusals import Reject
from anonproxy.policy.zcdp import Accounting, zcdp_epsilon
from anonproxy.wire import protocol as pg
from anonproxy.wire.results import Result, explain_result

# What a question is priced at: the per-query ε and δ, and the accounting of the budget it spends (which decides
# the mechanisms).
Costs: TypeAlias = tuple[Decimal, Decimal, Accounting]
DEFAULTS: Costs = (*DEFAULT_COSTS, "basic")
PRICE_TRIES = 3  # lookups that may each read a new per-query cost before the question is refused (40001)
MAX_PARAMETERS = 65535  # the protocol's limit on $n parameters in one statement
FREE_HEADLINE = ("anonproxy: the declared public domain, from the policy: no row was read and nothing was "
                 "charged")


class Refused(Exception):
    """An error for the client: SQLSTATE, message, hint, detail."""

    def __init__(self, sqlstate: str, message: str, hint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate, self.hint, self.detail = sqlstate, hint, detail
        self.response = pg.error_response(sqlstate, message, hint=hint, detail=detail)


class Bound(Protocol):
    """The values a Bind gave the statement's $n parameters, as the client sent them."""

    @property
    def types(self) -> tuple[int, ...]: ...
    @property
    def formats(self) -> tuple[int, ...]: ...
    @property
    def values(self) -> tuple[bytes | None, ...]: ...


class Spending(Protocol):
    """What the audit trail keeps of a question (anonproxy.proxy.audit_trail.Spent), filled in as it goes: a
    question that fails after its charge is recorded as charged."""

    relations: tuple[str, ...]
    epsilon: Decimal | float | None
    delta: Decimal | float | None
    rho: Decimal | float | None
    delta_add: Decimal | float | None
    budget_domain: str | None
    accounting: str | None
    epsilon_spent_delta: Decimal | None
    epsilon_spent_after: Decimal | None


@dataclass
class Limits:
    """The session's own per-query ε and δ (``SET anonproxy.epsilon | delta``; None: the policy's)."""

    epsilon: Decimal | None = None
    delta: Decimal | None = None


# -- what a question asks its driver for ----------------------------------------------------------------------


@dataclass(frozen=True)
class MeasureText:
    """Parse and measure ``text`` (a question the proxy makes itself: a series limit's second one), in the analysis
    process. Sends back a Packed measurement (or refusal)."""

    text: str


@dataclass(frozen=True)
class Price:
    """Price ``question`` at ``params`` and check its SQL (the final SQL check), in the analysis process. Sends
    back a DPPlan, or a Reject."""

    question: Packed
    text: str  # the statement's text: what the priced plans are cached by
    params: DPParams
    checked: frozenset[str] = frozenset()  # SQL this question wrote before at another cost: checked already


@dataclass(frozen=True)
class Lookup:
    """``anonproxy.lookup_answer``: the role's per-query cost on the plan's table, its data version and the answer
    cached under ``key`` (None: a free plan, nothing cached). Sends back a :class:`anonproxy.dp.ledger.Lookup`.

    ``fold``: the question is asked to be answered (not explained), so the driver may send back, without reading
    anything, the cost it read last and no answer (``Lookup.folded``), and make the lookup with the charge."""

    plan: DPPlan
    key: str | None
    fold: bool = False


@dataclass(frozen=True)
class CheckStop:
    """Raise Refused 57014 if the client cancelled or the time limit has passed. Sends back None."""


@dataclass(frozen=True)
class Check:
    """Refuse what the server rejects without reading a row: the plan's SQL and post statement prepared, the bound
    values converted alone. Sends back None."""

    plan: DPPlan


@dataclass(frozen=True)
class Charge:
    """Charge the plan's cost to the role's budget on its table, committed. Sends back a ledger.Remaining.

    ``then``: the :class:`Read` the question asks next, which the driver may send in the same round trip, after
    the charge's COMMIT: the server runs them in order and skips the read when the charge fails, so no row is read
    before the charge is durable. The read's outcome (or its failure) is then what the next Read sends back: a
    read that fails after the charge fails at that Read, with the question charged.

    ``check``: the :class:`Check` asked just before it (only a CheckStop between them), which the driver may have
    kept to send first in the same round trip: the server skips the charge when the check fails, so such a
    refusal still costs nothing (it fails at the Charge, uncharged).

    ``unless_answered``: the folded :class:`ledger.Lookup` the question was priced after; the charge is then made
    only if the ledger holds no answer for ``key`` and reads that cost (sql/0041), else it sends back what the
    ledger read (a ledger.Lookup), having charged nothing and read nothing."""

    plan: DPPlan
    key: str
    check: Check | None = None
    then: Read | None = None
    unless_answered: ledger.Lookup | None = None


@dataclass(frozen=True)
class Read:
    """Run the plan's SQL in one snapshot (``free``: it reads no row, no snapshot). Sends back (data version or
    None, column types, rows)."""

    plan: DPPlan
    free: bool = False


@dataclass(frozen=True)
class Store:
    """Store the measurement under ``key`` and ``version``, unless another session did first. Sends back what the
    ledger keeps (bytes or None)."""

    key: str
    version: str | None
    data: bytes


@dataclass(frozen=True)
class Finish:
    """The statement's answer from a noisy measurement (the post statement runs in PostgreSQL), with a notice:
    ``headline`` and the plan's noise lines. Sends back a Result."""

    plan: DPPlan
    measurement: Measurement
    headline: str


@dataclass(frozen=True)
class RunReleased:
    """Run ``sql`` (an outer query over the released rows: it reads no table) with ``types`` and ``values`` bound
    in text format, after the final SQL check. Sends back a Result (its columns and rows)."""

    sql: str
    types: tuple[int, ...]
    values: tuple[bytes | None, ...]


@dataclass(frozen=True)
class Remaining:
    """``anonproxy.budget_remaining`` of the role on ``table``. Sends back a ledger.Remaining."""

    table: str


Need = MeasureText | Price | Lookup | CheckStop | Check | Charge | Read | Store | Finish | RunReleased | Remaining
# The client's settings a measurement runs under, as (name, value) pairs: part of its answer cache key.
Measuring: TypeAlias = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Asked:
    """One question: the statement as the router measured it, and what the session gives it."""

    text: str
    measured: Packed | str  # a text: measured first (a question the proxy makes itself)
    role: str
    parameters: Bound
    limits: Limits = field(default_factory=Limits)
    session: Measuring = ()  # the client's settings the measurement runs under (TimeZone, DateStyle's order)


@dataclass(frozen=True)
class Found:
    """A priced question, its answer cache key and what the ledger's lookup read for it."""

    plan: DPPlan
    key: str
    lookup: ledger.Lookup


# -- the question ---------------------------------------------------------------------------------------------


def answer(asked: Asked, known: MutableMapping[str, Costs], policy_version: int,
           spent: Spending) -> Generator[Need, Any, Result]:
    """The noisy answer, charged (or the cached one, free). ``known``: the role's per-query costs per table as
    this worker last read them (updated as read); ``spent``: what it read and cost, as it goes.

    A nested question (anonproxy.plan.outer) is answered in steps: its aggregate query first, like any other (and
    each further aggregate query the outer query joins or its set operation combines, each a question of its own,
    charged as if sent alone; measuring the statement measured them all, so one that measuring refuses refuses
    the statement before any charge);
    then an outer query post-processes the released rows in PostgreSQL (over a VALUES list of them, reading no
    table), or Superset's series limit asks its second question, restricted to the released keys, and pays for
    it too."""
    result, plan = yield from ask(asked, known, policy_version, spent)
    if isinstance(plan.nested, Outer):
        more = []
        for further, measured in further_questions(plan.nested, asked.measured):  # each: a question of its own
            second = _Spent()
            answered, _ = yield from ask(replace(asked, text=further, measured=measured), known, policy_version,
                                         second)
            add_spent(spent, second)
            more.append(answered)
        sql, types, values = over_released(plan.nested, result, tuple(more))
        post: Result = yield RunReleased(sql, types, values)
        return replace(post, notices=result.notices + notice("anonproxy: the outer query was computed from the "
                                                             "released rows above, at no extra cost"))
    if isinstance(plan.nested, Series):
        question = series_question(plan.nested, result.rows)
        second = _Spent()
        answered, _ = yield from ask(replace(asked, text=question, measured=question), known, policy_version, second)
        add_spent(spent, second)
        keys = {plan.nested.key_values(row_texts(row)) for row in result.rows}
        rows = plan.nested.page(tuple(row for row in answered.rows if plan.nested.released(row_texts(row), keys)))
        return replace(answered, rows=rows, notices=result.notices + answered.notices)
    return result


def ask(asked: Asked, known: MutableMapping[str, Costs], policy_version: int,
        spent: Spending, looked: ledger.Lookup | None = None) -> Generator[Need, Any, tuple[Result, DPPlan]]:
    """One question's noisy answer and its plan. Stopped before the charge, it costs nothing; stopped while its SQL
    runs, it stays charged. ``looked``: what a charge made unless answered read instead of charging (asked again
    from it, without folding: a question goes round at most twice)."""
    found = yield from priced_and_found(asked, known, policy_version, looked, fold=looked is None)
    plan = bound_tail(found.plan, asked.parameters)  # LIMIT $n, OFFSET $n: post-processing, not in the key
    accounting = found.lookup.accounting
    spent.relations, spent.budget_domain, spent.accounting = plan.tables, plan.table, accounting
    spent.epsilon, spent.delta, spent.rho, spent.delta_add = 0, 0, 0, 0  # until charged
    spent.epsilon_spent_delta, spent.epsilon_spent_after = Decimal(0), None
    yield CheckStop()  # a cached answer too: a statement past its time limit fails, as in PostgreSQL
    if plan.free:
        _, types, rows = yield Read(plan, free=True)
        result: Result = yield Finish(plan, measure(plan, types, rows), FREE_HEADLINE)
        return result, plan
    headline = f"anonproxy: differentially private answer; it {cost(plan, accounting)}"
    cached = readable(found.lookup.answer, plan)
    if cached is not None:  # the measurement paid for before, finished for this statement: no cost
        headline = f"anonproxy: differentially private answer, paid for when first asked (it {cost(plan, accounting)})"
        result = yield Finish(plan, cached, headline)
        return with_notice(result, "anonproxy: the same question on the same data was answered before; this is "
                                   f"that answer, at no cost: ε spent on {plan.table} did not move"), plan
    check = Check(plan)
    yield check
    yield CheckStop()
    # Charged, and committed, before the data is read: a question that fails from here on (its SQL, the noise,
    # the connection) stays paid for, so no failure is a free look at the data.
    read = Read(plan)
    left: ledger.Remaining | ledger.Lookup = yield Charge(
        plan, found.key, check=check, then=read, unless_answered=found.lookup if found.lookup.folded else None)
    if isinstance(left, ledger.Lookup):  # answered before, or another per-query cost: nothing charged, nothing read
        return (yield from ask(asked, known, policy_version, spent, left))
    spent.epsilon, spent.delta = plan.epsilon, plan.delta
    spent.rho, spent.delta_add = plan.rho, plan.delta_add
    spent.accounting, spent.epsilon_spent_after = left.accounting, left.epsilon_spent
    spent.epsilon_spent_delta = left.epsilon_spent_delta or Decimal(0)
    version, types, rows = yield read
    measured = measure(plan, types, rows)
    # Another session of the role may have paid for the same question meanwhile: one measurement is released.
    stored = yield Store(found.key, version, encoded(measured.canonical(plan)))
    result = yield Finish(plan, readable(stored, plan) or measured, headline)
    return with_notice(result, f"anonproxy: this answer moved ε spent on {plan.table} by "
                               f"{amounts.spent(spent.epsilon_spent_delta)}: {state(left)}"), plan


def priced_and_found(asked: Asked, known: MutableMapping[str, Costs], policy_version: int,
                     looked: ledger.Lookup | None = None, fold: bool = False) -> Generator[Need, Any, Found]:
    """The question priced at the role's per-query cost on its table, lowered by the session's; its fingerprint;
    and what the lookup read for it. One lookup when the cost is the one this worker read last (``known``); when
    the lookup reads another, the same measurement is priced again at it, never measured again. ``looked``: what
    the ledger read for the question priced at ``known`` (the first lookup, not asked again); ``fold``: the first
    lookup may be folded into the charge (:class:`Lookup`)."""
    asked = yield from measured(asked)
    costs = _costs(asked, known)
    checked: frozenset[str] = frozenset()
    for _ in range(PRICE_TRIES):
        plan = yield from priced(asked, costs, checked)
        checked |= {plan.sql, *([plan.post.sql] if plan.post is not None else [])}
        key = fingerprint(plan, policy_version, measured_parameters(asked.parameters, plan.unmeasured_parameters),
                          asked.session)
        found: ledger.Lookup = looked if looked is not None else (yield Lookup(plan, None if plan.free else key,
                                                                             fold))
        looked, fold = None, False
        read: Costs = (or_default(found.epsilon_per_query, "epsilon"), or_default(found.delta_per_query, "delta"),
                       found.accounting)
        known[plan.table] = read
        if read == costs:
            if found.answer is not None and readable(found.answer, plan) is None:
                found = replace(found, answer=None)  # cached in another format: a miss, never an error
            return Found(plan, key, found)
        costs = read
    raise Refused("40001", f'the per-query budget of role "{asked.role}" on {plan.table} kept changing while the '
                  "question was planned", "Try again.")


def _costs(asked: Asked, known: MutableMapping[str, Costs]) -> Costs:
    """The per-query cost last read for the question's table (the proxy's default before any)."""
    table = asked.measured.table if isinstance(asked.measured, Packed) else None
    return known.get(table, DEFAULTS) if table is not None else DEFAULTS


def measured(asked: Asked) -> Generator[Need, Any, Asked]:
    """The question with its measurement: a text (a question the proxy makes itself) is measured first."""
    if isinstance(asked.measured, str):
        return replace(asked, measured=(yield MeasureText(asked.measured)))
    return asked


def priced(asked: Asked, costs: Costs, checked: frozenset[str] = frozenset()) -> Generator[Need, Any, DPPlan]:
    """The question priced at per-query ``costs``, lowered by the session's (``checked``: the SQL it wrote at
    another cost, which the final SQL check read already); a refusal raises Refused."""
    assert isinstance(asked.measured, Packed)
    plan: DPPlan | Reject = yield Price(asked.measured, asked.text, params(costs, asked.limits), checked)
    if isinstance(plan, Reject):
        raise Refused(plan.sqlstate, plan.message, plan.hint)
    return plan


def described(asked: Asked, known: MutableMapping[str, Costs]) -> Generator[Need, Any, DPPlan]:
    """The plan whose SQL describes the question's columns (Describe): priced at the cost last read for its table,
    with no lookup (the types do not depend on the per-query cost)."""
    asked = yield from measured(asked)
    costs = _costs(asked, known)
    return (yield from priced(asked, costs))


def explain(asked: Asked, known: MutableMapping[str, Costs], policy_version: int,
            ) -> Generator[Need, Any, Result]:
    """``EXPLAIN (ANONPROXY)``: cost, noise and whether the answer is cached, without running or charging."""
    first = yield from priced_and_found(asked, known, policy_version)
    plan = first.plan
    lines = explained(plan, first.lookup)
    questions = [first]
    if isinstance(plan.nested, Outer):
        next_one = ("and the next branch of the set operation, a question of its own:" if plan.nested.combines
                    else "and the aggregate query it joins, a question of its own:")
        for further, measured in further_questions(plan.nested, asked.measured):
            found = yield from priced_and_found(replace(asked, text=further, measured=measured), known,
                                                policy_version)
            lines.append(next_one)
            lines += [f"  {line}" for line in explained(found.plan, found.lookup)]
            questions.append(found)
        lines.append("then an outer query post-processes the released rows: no extra cost")
    elif isinstance(plan.nested, Series):
        # The second question costs the same whatever keys the first one releases: price it without them.
        question = series_question(plan.nested, ())
        second = yield from priced_and_found(replace(asked, text=question, measured=question), known,
                                             policy_version)
        lines.append("then the same query restricted to the groups released above (series limit), a second "
                     "question:")
        lines += [f"  {line}" for line in explained(second.plan, second.lookup)]
        questions.append(second)
    budget: ledger.Remaining = yield Remaining(plan.table)
    charged = [found.plan for found in questions if not found.plan.free and found.lookup.answer is None]
    if charged:
        lines.append(moved(charged, budget))
    lines.append(f"budget of {plan.table}: {state(budget)}")
    lines.append("nothing was run or charged")
    return explain_result(lines)


def params(costs: Costs, limits: Limits) -> DPParams:
    """What a question is priced at: the per-query ``costs``, ε and δ lowered by the session's own."""
    epsilon, delta, accounting = costs
    if limits.epsilon is not None:
        epsilon = min(epsilon, limits.epsilon)
    if limits.delta is not None:
        delta = min(delta, limits.delta)
    return DPParams(float(epsilon), float(delta), accounting=accounting)


@dataclass
class _Spent:
    """What a series limit's second question cost, before it is added to the first's."""

    relations: tuple[str, ...] = ()
    epsilon: Decimal | float | None = 0
    delta: Decimal | float | None = 0
    rho: Decimal | float | None = 0
    delta_add: Decimal | float | None = 0
    budget_domain: str | None = None
    accounting: str | None = None
    epsilon_spent_delta: Decimal | None = None
    epsilon_spent_after: Decimal | None = None


def add_spent(spent: Spending, second: Spending) -> None:
    """A series limit's second question's cost added to the first's: both are charged to the same budget; ε spent
    after is the second's (when it was charged)."""
    spent.relations = tuple(sorted({*spent.relations, *second.relations}))
    spent.epsilon = _added(spent.epsilon, second.epsilon)
    spent.delta = _added(spent.delta, second.delta)
    spent.rho = _added(spent.rho, second.rho)
    spent.delta_add = _added(spent.delta_add, second.delta_add)
    spent.epsilon_spent_delta = (spent.epsilon_spent_delta or Decimal(0)) + (second.epsilon_spent_delta or Decimal(0))
    spent.epsilon_spent_after = second.epsilon_spent_after or spent.epsilon_spent_after


def _added(first: Decimal | float | None, second: Decimal | float | None) -> Decimal | float:
    """Two costs added (a plan's are floats, an uncharged question's 0), exactly when either is a Decimal."""
    a, b = first or 0, second or 0
    if isinstance(a, Decimal) or isinstance(b, Decimal):
        return Decimal(str(a)) + Decimal(str(b))
    return a + b


# -- the rules, as functions ----------------------------------------------------------------------------------


def readable(cached: bytes | None, plan: DPPlan) -> Measurement | None:
    """The cached measurement of ``plan``, keys in the plan's order; None (a miss) when there is none or it cannot
    be read as one."""
    measurement = decoded(cached)
    return measurement.for_plan(plan) if measurement is not None and measurement.fits(plan) else None


def measured_parameters(parameters: Bound, unmeasured: tuple[int, ...],
                        ) -> tuple[tuple[int, int, int, bytes | None], ...]:
    """The bound parameters the measurement depends on, as (number, declared type, format, value): those only
    LIMIT and OFFSET use left out (``limit 5``, ``limit $1`` with 5 or with 10 measure the same groups)."""
    count = len(parameters.values)
    types = parameters.types + (0,) * (count - len(parameters.types))
    formats = parameters.formats if len(parameters.formats) == count else (0,) * count
    return tuple((number, types[number - 1], formats[number - 1], parameters.values[number - 1])
                 for number in range(1, count + 1) if number not in unmeasured)


def bound_tail(plan: DPPlan, parameters: Bound) -> DPPlan:
    """``plan`` with the bound values of its LIMIT and OFFSET parameters, as PostgreSQL reads them: NULL is no
    limit (or offset 0), a negative value an error."""
    bound: dict[str, int | None] = {}
    tail = (("limit", plan.limit_parameter, "2201W"), ("offset", plan.offset_parameter, "2201X"))
    for name, number, sqlstate in tail:
        if number is None:
            continue
        value = bound_integer(parameters, number)
        if value is not None and value < 0:
            raise Refused(sqlstate, f"{name.upper()} must not be negative")
        bound[name] = value if value is not None or name == "limit" else 0
    return replace(plan, **bound) if bound else plan  # type: ignore[arg-type]


def bound_integer(parameters: Bound, number: int) -> int | None:
    """The integer bound to ``$number`` (text, or binary int2/int4/int8 as the client sent it); None for NULL."""
    if number > len(parameters.values):
        raise Refused("08P01", f"bind message supplies {len(parameters.values)} parameters, but the statement "
                      f"uses ${number}")
    value = parameters.values[number - 1]
    if value is None:
        return None
    binary = number <= len(parameters.formats) and parameters.formats[number - 1] == 1
    try:
        if binary and len(value) in (2, 4, 8):
            return int.from_bytes(value, "big", signed=True)
        if not binary:
            return int(value.decode())
    except (UnicodeDecodeError, ValueError):
        pass
    raise Refused("22P02", f"invalid input syntax for type bigint in LIMIT/OFFSET parameter ${number}")


def further_questions(outer: Outer, measured: Packed | str) -> tuple[tuple[str, Packed | str], ...]:
    """The SQL of the aggregate queries an outer query joins besides its first (asked after it, each on its own),
    each with its measurement: made when the statement was (``measured``, its measurement), or else (a statement
    measured from its text) its text, measured when asked."""
    texts = tuple(render.sql(more.inner) for more in outer.more)
    if isinstance(measured, Packed):
        return tuple(zip(texts, measured.further, strict=True))
    return tuple((text, text) for text in texts)


def over_released(outer: Outer, released: Result, more: tuple[Result, ...] = ()
                  ) -> tuple[str, tuple[int, ...], tuple[bytes | None, ...]]:
    """The outer query over ``WITH anonproxy_released(<columns>) AS (VALUES ($1, $2), ...)`` (and a WITH query of
    the same form for each further aggregate query it joins, answered in ``more``), each value a parameter typed
    as its column, in text format as the answer holds it: (SQL, parameter types, values)."""
    inputs = [(ROWS, outer.names, released), *((further.name, further.names, answer)
                                              for further, answer in zip(outer.more, more, strict=True))]
    parts: list[str] = []
    types: list[int] = []
    values: list[bytes | None] = []
    for name, names, answer in inputs:
        width = len(answer.columns)
        if width != len(names):
            raise Refused("XX000", "internal error in anonproxy: the released rows do not have the inner query's "
                          "columns")
        count = max(len(answer.rows), 1)
        if len(types) + count * width > MAX_PARAMETERS:
            raise Refused("54000", f"the outer query would read {len(answer.rows)} released rows, more than "
                          "anonproxy can pass to it", "Restrict the inner query (WHERE, LIMIT) or run it on its own.")
        first = len(types) + 1
        rows = answer.rows or ((None,) * width,)
        listed = ", ".join("(" + ", ".join(f"${first + row * width + column}" for column in range(width)) + ")"
                           for row in range(count))
        limit = "" if answer.rows else " LIMIT 0"  # no rows: one row of NULLs keeps the types, and is cut
        parts.append(f"{_quote(name)}({', '.join(_quote(column) for column in names)}) AS (VALUES {listed}{limit})")
        types += [column.type_oid for column in answer.columns] * count
        values += [value for row in rows for value in row]
    return f"WITH {', '.join(parts)}\n{outer.sql()}", tuple(types), tuple(values)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def state(budget: ledger.Remaining) -> str:
    """Where a budget stands, in its own accounting: ε spent of the budget (and ρ under zCDP), and what is left (the
    lesser of the role's and the shared cap's)."""
    text = f"ε spent {amounts.spent(budget.epsilon_spent)} of {plain(budget.epsilon_budget)}"
    if budget.accounting == "zcdp":
        text += f" (ρ {amounts.spent(budget.rho_spent)} spent)"
    text += f"; left: ε {amounts.left(budget.epsilon)}, δ {plain(budget.delta)}"
    if budget.rho is not None:
        text += f", ρ {amounts.left(budget.rho)}"
    return text


def moved(charged: list[DPPlan], budget: ledger.Remaining) -> str:
    """What running the questions to be charged (a series limit's two, or one) would move the role's ε spent by, in
    its accounting: under basic their ε; under zCDP their ρ adds up and ε spent is the conversion of the sum at what
    is left of δ, so an answer's share of ε is not its own ε (a first answer looks dearer than later ones)."""
    if budget.accounting == "basic":
        after = budget.epsilon_spent + sum((Decimal(repr(plan.epsilon)) for plan in charged), Decimal(0))
    else:
        rho = sum((Decimal(repr(plan.rho)) for plan in charged), Decimal(0))
        delta_add = sum((Decimal(repr(plan.delta_add)) for plan in charged), Decimal(0))
        delta_left = budget.role_delta - delta_add  # the role's δ left under zcdp: D − Σδ_add
        after = zcdp_epsilon(budget.rho_spent + rho, delta_left) if delta_left > 0 else Decimal("Infinity")
    return (f"running it moves ε spent on {charged[0].table} by {amounts.spent(after - budget.epsilon_spent)}: from "
            f"{amounts.spent(budget.epsilon_spent)} to {amounts.spent(after)} of {plain(budget.epsilon_budget)}")


def plain(amount: Decimal) -> str:
    """1.50 -> 1.5, 10 -> 10, 0.00001 -> 0.00001."""
    return format(amount.normalize(), "f")


def with_notice(result: Result, message: str) -> Result:
    return replace(result, notices=result.notices + notice(message))


def notice(message: str, detail: str | None = None) -> bytes:
    return pg.error_response("00000", message, severity="NOTICE", detail=detail, type_=b"N")
