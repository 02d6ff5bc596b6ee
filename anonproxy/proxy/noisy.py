"""Differentially private answers for roles in mode ``dp`` (one instance per worker).

The I/O of the dp back-end (what it decides without I/O is in
:mod:`anonproxy.dp.answers`). For one query: plan it (anonproxy.dp.plan) with the role's per-query
ε and δ from its budget — lowered by the session's ``SET anonproxy.epsilon``
/ ``anonproxy.delta`` — and, in one statement (``anonproxy.lookup_answer``),
read that per-query cost, the data version and the noisy measurement already
paid for (keyed by the plan's measurement only: anonproxy.dp.answers.fingerprint).
That one round trip is the whole ledger work for a question already answered;
the statement is then finished from that measurement, at no cost.
Else check the bound values (converted alone, reading nothing: a bad value is
refused for free), then charge the ledger, committed before any row is read
(fail closed: a question that fails after the charge stays paid for, and an
exhausted budget is refused before its SQL runs); then, in one REPEATABLE
READ READ ONLY transaction, read the data version of every table the plan
reads and run the contribution-bounded SQL with the client's bound
parameters; measure (noise, partition selection), cache the measurement
under that version (anonproxy.dp.ledger), and finish the statement from it.
A query that only lists declared public domains reads no row and is neither
charged nor cached.

Time limits and cancels (:class:`Stop`): a question is held to the session's
statement time limit from when it is asked, and a client's CancelRequest
stops it. Both are checked before the charge (and before a cached answer):
stopped there, it fails with 57014 and costs nothing. Once charged, what is
left of the limit is the data-reading transaction's ``statement_timeout``
and a cancel is passed on to its backend: it fails with 57014 and stays paid
for.

Answers are :class:`Result` values, which the gate encodes for the simple or
the extended protocol; refusals raise :class:`Refused`, which carries the
ErrorResponse.

Also: the column types of a dp query without running it (Describe),
``EXPLAIN (ANONPROXY)``, ``SHOW anonproxy.budget | epsilon | delta`` and
``SET anonproxy.epsilon | delta``.

With standbys (proxy/servers.py, docs/replicas.md), the data-reading
transaction runs on the standby in rotation with the least lag, after the
charge committed on the primary; its data version is read there, in the same
snapshot, so the answer is cached under the version of the data it was
computed from (a lagging standby's answer is kept under its older version,
which a question on the primary's newer data never finds). A standby that
fails (unreachable, or a query cancelled by recovery) leaves the rotation and
the measurement runs on the primary instead: the question, paid once, is
answered once. ``anonproxy.charge()`` commits with ``synchronous_commit`` at
least ``on`` whatever the server's default, so with a synchronous standby
(servers.py checks there is one) a charge is on it before the data is read.

Queries run on a small pool of psycopg connections of the service role,
separate from the sessions' read-only service connections because the
ledger writes. A pooled connection is checked before use (without a round
trip: an idle connection has nothing to read unless the server ended it,
e.g. at a restart) and replaced when dead; when the server refuses a new
one, the client gets the server's SQLSTATE and message (53300, 57P03…).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import generators, pq
from psycopg.adapt import Transformer

from ..config import ServiceLogin
from ..dp import amounts, ledger
from ..dp.answers import (
    DEFAULT_COSTS,
    cost,
    decoded,
    default_cost,
    encoded,
    explained,
    fingerprint,
    or_default,
    per_query,
    plan_checked,
    row_texts,
    series_question,
)
from ..dp.finish import Measurement, finish, measure, post_arrays, released_rows
from ..dp.model import DPParams, DPPlan
from ..plan.final_sql import verify
from ..plan.outer import ROWS, Outer, Series
from ..plan.refusals import Reject
from ..policy.model import Policy, RolePolicy
from ..policy.zcdp import Accounting, zcdp_epsilon
from ..route.decision import SessionSetting
from ..wire import protocol as pg
from ..wire.results import Column, Result, text_value
from .analysis import Analyser, AnalysisFailed, AnalysisTimeout
from .audit_trail import Spent
from .cache import BoundedCache
from .cancel import CANCEL_TIMEOUT
from .gate import EXPLAIN_COLUMNS, Description, Parameters
from .servers import Servers
from .service import login_refusal
from .standby_reads import StandbyConnections, alive

log = logging.getLogger("anonproxy.dp")

POOL_SIZE = 4  # connections per worker: dp questions of different sessions run side by side
PLAN_CACHE_BYTES = 32 * 1024 * 1024  # plans are deterministic in (text, role, policy version, ε, δ): kept per worker

_BEGIN_SNAPSHOT = "begin isolation level repeatable read, read only"

# What a question is planned at: the per-query ε and δ, and the accounting of the budget it spends (which decides
# the mechanisms).
Costs = tuple[Decimal, Decimal, Accounting]
_DEFAULTS: Costs = (*DEFAULT_COSTS, "basic")


@dataclass
class SessionLimits:
    """What a session set with ``SET anonproxy.epsilon`` / ``anonproxy.delta`` (None: the policy's); ``at_login``:
    what it gave at login (``options=-c anonproxy.epsilon=...``), which RESET goes back to, as in PostgreSQL."""

    epsilon: Decimal | None = None
    delta: Decimal | None = None
    at_login: dict[str, Decimal] = field(default_factory=dict)
    asker: int = 0  # the session's id: whose turn the analysis of its dp plans takes

    def reset(self) -> None:
        """RESET ALL, DISCARD ALL: back to the values given at login, else the policy's."""
        self.epsilon, self.delta = self.at_login.get("epsilon"), self.at_login.get("delta")


class Refused(Exception):
    """An error for the client: SQLSTATE, message, hint, detail."""

    def __init__(self, sqlstate: str, message: str, hint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate, self.hint, self.detail = sqlstate, hint, detail
        self.response = pg.error_response(sqlstate, message, hint=hint, detail=detail)


class Stop:
    """What may stop one question before it is answered: the session's time limit (``timeout_ms``, the client's
    statement_timeout capped by the policy's, counted from when the question was asked; 0: none) and the client's
    CancelRequest (:meth:`cancel`). Checked before the charge (:meth:`check`: stopped there, a question costs
    nothing) and while the measurement SQL runs (:meth:`running`: PostgreSQL stops it, and it stays charged)."""

    def __init__(self, timeout_ms: int = 0) -> None:
        self._deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None
        self._cancelled = False
        self._running: psycopg.AsyncConnection[Any] | None = None  # the connection running the measurement
        self._sending: asyncio.Task[None] | None = None  # the cancel sent to it

    async def cancel(self) -> None:
        """The client's cancel: the measurement running now is cancelled by PostgreSQL (57014); else the question
        stops at its next check. Returns once the server has acted."""
        self._cancelled = True
        if self._running is not None and self._sending is None:
            self._sending = asyncio.ensure_future(_send_cancel(self._running))
        if self._sending is not None:
            await asyncio.shield(self._sending)

    def check(self) -> None:
        """Refuse with PostgreSQL's own 57014 if the client cancelled or the time limit has passed."""
        self._check_cancelled()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise Refused("57014", "canceling statement due to statement timeout")

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise Refused("57014", "canceling statement due to user request")

    def left_ms(self) -> int:
        """What is left of the time limit, in whole ms (at least 1); 0: no limit."""
        if self._deadline is None:
            return 0
        return max(1, math.ceil((self._deadline - time.monotonic()) * 1000))

    @contextlib.asynccontextmanager
    async def running(self, conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
        """The measurement runs on ``conn``: a cancel from now on is sent to its backend. A cancel on its way when
        it ends is waited for, so that it cannot reach a later statement on the pooled connection; and one that
        reached the backend between two statements (PostgreSQL ignores it there) still stops the question."""
        self.check()
        self._running = conn
        try:
            yield
        finally:
            self._running = None
            if self._sending is not None:
                await asyncio.shield(self._sending)
        self._check_cancelled()


async def _send_cancel(conn: psycopg.AsyncConnection[Any]) -> None:
    """Ask the server to cancel what ``conn`` runs; wait until it has acted."""
    try:
        await conn.cancel_safe(timeout=CANCEL_TIMEOUT)
    except (psycopg.Error, OSError) as exc:
        log.warning("cannot cancel a dp question's SQL: %s", str(exc).strip())


class NoisyAnswers:
    def __init__(self, dsn: str, size: int = POOL_SIZE, analyser: Analyser | None = None,
                 login: ServiceLogin | None = None, servers: Servers | None = None) -> None:
        # Unqualified names in plans resolve in pg_catalog only, as the final SQL check assumes (a function of the
        # same name in another schema on the search_path could otherwise be a better match for its argument types).
        options = psycopg.conninfo.conninfo_to_dict(dsn).get("options") or ""
        self._dsn = psycopg.conninfo.make_conninfo(dsn, options=f"{options} -c search_path=pg_catalog".strip())
        self._servers = servers
        self._standbys = StandbyConnections(self._dsn)
        # Connections that received a WARNING (see _check_confirmed).
        self._warned: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
        self._login = login  # the same login, to learn the server's reason when it refuses a connection
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(size)
        self._analyser = analyser  # plans off the event loop (None: on it)
        self._plans: BoundedCache[tuple[str, str, int, DPParams], DPPlan | Reject] = BoundedCache(PLAN_CACHE_BYTES)
        # (role, table) -> the per-query (ε, δ) and the accounting last read from the ledger: what the next question
        # is planned at before the ledger confirms it
        self._costs: dict[tuple[str, str], Costs] = {}

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()
        await self._standbys.close()

    # -- what the session asks ---------------------------------------------------------

    async def answer(self, sql: str, role: RolePolicy, policy: Policy, parameters: Parameters,
                     limits: SessionLimits, stop: Stop | None = None, spent: Spent | None = None) -> Result:
        """The noisy answer, charged (or the cached one, free); ``spent`` gets what it read and cost; ``stop``: the
        time limit and the client's cancel, which stop it with 57014.

        A nested question (anonproxy.plan.outer) is answered in steps: its aggregate query first, like any other;
        then an outer query post-processes the released rows in PostgreSQL (over a VALUES list of them, reading no
        table), or Superset's series limit asks its second question, restricted to the released keys, and pays
        for it too."""
        spent, stop = spent or Spent(), stop or Stop()
        result, plan = await self._answer(sql, role, policy, parameters, limits, stop, spent)
        if isinstance(plan.nested, Outer):
            return await self._post_process(plan.nested, result, policy, role)
        if isinstance(plan.nested, Series):
            question = series_question(plan.nested, result.rows)
            second = Spent()
            answered, _ = await self._answer(question, role, policy, parameters, limits, stop, second)
            spent.relations = tuple(sorted({*spent.relations, *second.relations}))
            spent.epsilon, spent.delta = spent.epsilon + second.epsilon, spent.delta + second.delta
            spent.rho, spent.delta_add = spent.rho + second.rho, spent.delta_add + second.delta_add
            spent.epsilon_spent_delta = (spent.epsilon_spent_delta or 0) + (second.epsilon_spent_delta or 0)
            spent.epsilon_spent_after = second.epsilon_spent_after or spent.epsilon_spent_after
            keys = {plan.nested.key_values(row_texts(row)) for row in result.rows}
            rows = plan.nested.page(tuple(row for row in answered.rows
                                          if plan.nested.released(row_texts(row), keys)))
            return replace(answered, rows=rows, notices=result.notices + answered.notices)
        return result

    async def _answer(self, sql: str, role: RolePolicy, policy: Policy, parameters: Parameters,
                      limits: SessionLimits, stop: Stop, spent: Spent) -> tuple[Result, DPPlan]:
        """One question's noisy answer and its plan. Stopped (``stop``) before the charge, it costs nothing;
        stopped while its SQL runs, it stays charged."""
        async with self._connection() as conn:
            plan, fingerprint, found = await self._question(conn, sql, role, policy, parameters, limits)
            plan = _bound_tail(plan, parameters)  # LIMIT $n, OFFSET $n: post-processing, not in the key
            spent.relations, spent.budget_domain, spent.accounting = plan.tables, plan.table, found.accounting
            spent.epsilon, spent.delta, spent.rho, spent.delta_add = 0, 0, 0, 0  # until charged
            spent.epsilon_spent_delta, spent.epsilon_spent_after = Decimal(0), None
            stop.check()  # a cached answer too: a statement past its time limit fails, as in PostgreSQL
            if plan.free:
                types, rows = await _run(conn, plan.sql, parameters)
                return await _result(conn, plan, measure(plan, types, rows), "anonproxy: the declared public domain, "
                                     "from the policy: no row was read and nothing was charged"), plan
            headline = f"anonproxy: differentially private answer; it {cost(plan, found.accounting)}"
            cached = _readable(found.answer, plan)
            if cached is not None:  # the measurement paid for before, finished for this statement: no cost
                headline = ("anonproxy: differentially private answer, paid for when first asked "
                            f"(it {cost(plan, found.accounting)})")
                return _with_notice(await _result(conn, plan, cached, headline), "anonproxy: the same question on "
                                    "the same data was answered before; this is that answer, at no cost: ε spent "
                                    f"on {plan.table} did not move"), plan
            await _check_statement(conn, plan, parameters)
            stop.check()
            # Charged, and committed, before the data is read: a question that fails from here on (its SQL, the
            # noise, the connection) stays paid for, so no failure is a free look at the data.
            self._warned.discard(conn)
            left = await ledger.charge(conn, role.role, plan.table, plan.epsilon, plan.delta, fingerprint,
                                       rho=plan.rho, delta_add=plan.delta_add)
            self._check_confirmed(conn)
            spent.epsilon, spent.delta = plan.epsilon, plan.delta
            spent.rho, spent.delta_add = plan.rho, plan.delta_add
            spent.accounting, spent.epsilon_spent_after = left.accounting, left.epsilon_spent
            spent.epsilon_spent_delta = left.epsilon_spent_delta or Decimal(0)
            version, types, rows = await self._measure(conn, plan, parameters, stop)
            measured = measure(plan, types, rows)
            # Another session of the role may have paid for the same question meanwhile: one measurement is released.
            stored = await ledger.store_answer(conn, role.role, fingerprint, version,
                                               encoded(measured.canonical(plan)))
            kept = _readable(stored, plan)
            result = await _result(conn, plan, kept or measured, headline)
            return _with_notice(result, f"anonproxy: this answer moved ε spent on {plan.table} by "
                                        f"{amounts.spent(spent.epsilon_spent_delta)}: {_state(left)}"), plan

    def _check_confirmed(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """With standbys, refuse to answer when the charge's commit came with a WARNING: the ledger functions raise
        none, so it is PostgreSQL saying that the commit's wait for the synchronous standby was cancelled (the
        charge is committed on the primary alone, and a fail-over now would lose it). It stays charged."""
        if self._servers is not None and conn in self._warned:
            raise Refused("57014", "the privacy ledger's charge was committed on the primary but its wait for the "
                          "synchronous standby was cancelled: the question stays charged and is not answered",
                          "Check that a synchronous standby streams from the primary (docs/replicas.md), then ask "
                          "again.")

    async def _measure(self, conn: psycopg.AsyncConnection[Any], plan: DPPlan, parameters: Parameters,
                       stop: Stop) -> tuple[str | None, list[int], list[tuple[Any, ...]]]:
        """The data version and the rows of the plan's SQL, read in one snapshot: on the standby in rotation with
        the least lag, else (none, or it failed) on ``conn``, the primary's. Called after the charge committed."""
        standby = self._servers.standby() if self._servers is not None else None
        if standby is not None:
            assert self._servers is not None
            try:
                async with self._standbys.connection(standby) as reader:
                    return await _measured_on(reader, plan, parameters, stop)
            except psycopg.errors.QueryCanceled:
                raise  # the client's cancel or time limit: the question stops, paid for
            except psycopg.OperationalError as exc:  # unreachable, shut down, or cancelled by recovery (40001)
                log.warning("dp measurement on standby %s failed (%s); measuring on the primary", standby,
                            str(exc).strip())
                self._servers.failed(standby)
        return await _measured_on(conn, plan, parameters, stop)

    async def _post_process(self, outer: Outer, released: Result, policy: Policy, role: RolePolicy) -> Result:
        """The outer query over the released rows, run by PostgreSQL over a VALUES list of them: its functions,
        types and column names are PostgreSQL's, and it reads no table (the final SQL check says so)."""
        sql, parameters = _over_released(outer, released)
        verify(sql, policy, role.role)
        async with self._connection() as conn:
            columns, rows = await _run_described(conn, sql, parameters)
        return Result(columns, tuple(tuple(text_value(value, column.type_oid)
                                           for value, column in zip(row, columns, strict=True)) for row in rows),
                      notices=released.notices + _notice("anonproxy: the outer query was computed from the released "
                                                         "rows above, at no extra cost"))

    async def describe(self, sql: str, role: RolePolicy, policy: Policy, parameters: Parameters,
                       limits: SessionLimits) -> Description:
        """Parameter types and result columns of a dp query, from the server's description of its plan:
        nothing is run, charged or read from the ledger (the types do not depend on the per-query cost)."""
        first = await self._plan(sql, role, policy, _DEFAULTS, limits)
        plan = await self._plan(sql, role, policy, self._costs.get((role.role, first.table), _DEFAULTS), limits)
        async with self._connection() as conn:
            parameter_types, types = await _describe(conn, plan.sql, parameters.types)
            post_types = await _post_types(conn, plan, types)
            columns = _output_columns(plan, types, post_types)
            if isinstance(plan.nested, Outer):
                outer_sql, bound = _over_released(plan.nested, Result(columns))
                columns = await _describe_columns(conn, outer_sql, bound.types)
        if isinstance(plan.nested, Series):  # the second question's columns; its restriction does not change them
            second = await self.describe(series_question(plan.nested, ()), role, policy, parameters,
                                         limits)
            columns = second.columns
        return Description(parameter_types, columns)

    async def explain(self, sql: str, role: RolePolicy, policy: Policy, parameters: Parameters,
                      limits: SessionLimits) -> Result:
        """``EXPLAIN (ANONPROXY)``: cost, noise and whether the answer is cached, without running or charging."""
        async with self._connection() as conn:
            plan, _, found = await self._question(conn, sql, role, policy, parameters, limits)
            lines = explained(plan, found)
            questions = [(plan, found)]
            if isinstance(plan.nested, Outer):
                lines.append("then an outer query post-processes the released rows: no extra cost")
            elif isinstance(plan.nested, Series):
                # The second question costs the same whatever keys the first one releases: plan it without them.
                question = series_question(plan.nested, ())
                second, _, second_found = await self._question(conn, question, role, policy, parameters, limits)
                lines.append("then the same query restricted to the groups released above (series limit), a second "
                             "question:")
                lines += [f"  {line}" for line in explained(second, second_found)]
                questions.append((second, second_found))
            budget = await ledger.remaining(conn, role.role, plan.table)
        charged = [question for question, seen in questions if not question.free and seen.answer is None]
        if charged:
            lines.append(_moved(charged, budget))
        lines.append(f"budget of {plan.table}: {_state(budget)}")
        lines.append("nothing was run or charged")
        return Result(EXPLAIN_COLUMNS, tuple((line.encode(),) for line in lines), "EXPLAIN")

    async def budget(self, role: str) -> Result:
        """``SHOW anonproxy.budget``: one row per protected table the role has a budget on."""
        async with self._connection() as conn:
            budgets = await ledger.remaining_all(conn, role)
        values = [f"{b.domain}: epsilon {amounts.left(b.epsilon)} of {_plain(b.epsilon_budget)} left, delta "
                  f"{_plain(b.delta)} of {_plain(b.delta_budget)} left; epsilon spent {amounts.spent(b.epsilon_spent)} "
                  f"({_accounting(b)}); accuracy epsilon {_plain(per_query(b, 'epsilon'))} per query"
                  for b in budgets]
        return _show("budget", values)

    async def show(self, setting: str, role: str, limits: SessionLimits) -> Result:
        """``SHOW anonproxy.epsilon | delta``: the session's value, else the policy's per query (per table)."""
        own = limits.epsilon if setting == "epsilon" else limits.delta
        if own is not None:
            return _show(setting, [_plain(own)])
        async with self._connection() as conn:
            budgets = await ledger.remaining_all(conn, role)
        values = {b.domain: per_query(b, setting) for b in budgets}
        if len(set(values.values())) <= 1:
            return _show(setting, [_plain(next(iter(values.values()), default_cost(setting)))])
        return _show(setting, [", ".join(f"{domain}: {_plain(v)}" for domain, v in sorted(values.items()))])

    async def set(self, request: SessionSetting, role: str, limits: SessionLimits, at_login: bool = False) -> Result:
        """``SET anonproxy.epsilon | delta``: only down from the policy's per-query value; RESET goes back to the
        value given at login, else to the policy's. ``at_login``: the setting came with the login (its value then
        becomes the session's default)."""
        name = f"anonproxy.{request.setting}"
        if request.value is not None:
            async with self._connection() as conn:
                budgets = await ledger.remaining_all(conn, role)
            if not budgets:
                raise Refused("42501", f'role "{role}" has no privacy budget', "Ask the DBA for one.")
            maximum = max(per_query(b, request.setting) for b in budgets)
            if request.value > maximum:
                raise Refused("22023", f"{name} may only lower the policy's {_SETTING_NAMES[request.setting]}: "
                              f"at most {_plain(maximum)} for role \"{role}\", got {_plain(request.value)}",
                              f"Give {name} a value up to {_plain(maximum)} (SET, or -c {name}=... at login); ask "
                              "the DBA for a larger one.")
            if at_login:
                limits.at_login[request.setting] = request.value
        value = request.value if request.value is not None else limits.at_login.get(request.setting)
        setattr(limits, request.setting, value)
        return Result((), tag="SET" if request.value is not None else "RESET")

    # -- helpers ----------------------------------------------------------------------

    async def _question(self, conn: psycopg.AsyncConnection[Any], sql: str, role: RolePolicy, policy: Policy,
                        parameters: Parameters, limits: SessionLimits) -> tuple[DPPlan, str, ledger.Lookup]:
        """The plan at the role's per-query cost on the table the query reads, lowered by the session's; its
        fingerprint; and what ``anonproxy.lookup_answer`` read for it. One round trip when the role's per-query
        cost is the one this worker read last; when it changed, the plan for the new cost is looked up again."""
        first = await self._plan(sql, role, policy, _DEFAULTS, limits)
        key = (role.role, first.table)
        costs = self._costs.get(key, _DEFAULTS)
        for _ in range(3):
            plan = await self._plan(sql, role, policy, costs, limits)
            key_of_answer = fingerprint(plan, policy.version, _measured(parameters, plan.unmeasured_parameters))
            found = await ledger.lookup_answer(conn, role.role, plan.table, plan.tables,
                                               None if plan.free else key_of_answer)
            read: Costs = (or_default(found.epsilon_per_query, "epsilon"), or_default(found.delta_per_query, "delta"),
                           found.accounting)
            self._costs[key] = read
            if read == costs:
                if found.answer is not None and _readable(found.answer, plan) is None:
                    found = replace(found, answer=None)  # cached in another format: a miss, never an error
                return plan, key_of_answer, found
            costs = read
        raise Refused("40001", f'the per-query budget of role "{role.role}" on {first.table} kept changing while '
                      "the question was planned", "Try again.")

    async def _plan(self, sql: str, role: RolePolicy, policy: Policy, costs: Costs,
                    limits: SessionLimits) -> DPPlan:
        """The plan at per-query ``costs`` (ε, δ lowered by the session's; accounting); a Reject becomes ``Refused``."""
        epsilon, delta, accounting = costs
        if limits.epsilon is not None:
            epsilon = min(epsilon, limits.epsilon)
        if limits.delta is not None:
            delta = min(delta, limits.delta)
        plan = await self._plan_dp(sql, role, policy, DPParams(float(epsilon), float(delta), accounting=accounting),
                                   limits.asker)
        if isinstance(plan, Reject):
            raise Refused(plan.sqlstate, plan.message, plan.hint)
        return plan

    async def _plan_dp(self, sql: str, role: RolePolicy, policy: Policy, params: DPParams,
                       asker: int) -> DPPlan | Reject:
        """``plan_dp``, cached, and off the event loop: planning costs milliseconds (seconds for a long statement),
        a statement already seen should not."""
        key = (sql, role.role, policy.version, params)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        if self._analyser is None:
            plan = plan_checked(sql, role, policy, params)
        else:
            try:
                plan = await self._analyser.run(plan_checked, sql, role, policy, params, asker=asker)
            except AnalysisTimeout:
                raise Refused("54001", f"statement too complex: anonproxy stopped planning it after "
                              f"{self._analyser.budget:g} s", "Simplify the statement (a long list of values is "
                              "the usual cause); the limit is the proxy's analysis_timeout setting.") from None
            except AnalysisFailed as exc:
                log.error("planning a dp query failed: %s", exc)
                raise Refused("XX000", "internal error in anonproxy while planning the query") from None
        # What a plan holds is mostly its SQL and the client's text, each about as long as the statement.
        self._plans.put(key, plan, len(sql) + 2 * len(getattr(plan, "sql", "")))
        return plan

    async def _checkout(self) -> psycopg.AsyncConnection[Any]:
        """An idle pooled connection that is still alive, else a new one."""
        while self._idle:
            conn = self._idle.pop()
            if alive(conn):
                return conn
            log.info("a pooled dp connection was ended by the server; replacing it")
            await conn.close()
        try:
            conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True)
            conn.add_notice_handler(lambda diag: self._warned.add(conn) if diag.severity_nonlocalized == "WARNING"
                                    else None)
            return conn
        except psycopg.OperationalError as exc:
            refusal = await login_refusal(self._login) if self._login is not None else None
            if refusal is None:
                raise
            log.warning("dp connection refused: %s (SQLSTATE %s)", refusal.message, refusal.sqlstate)
            raise Refused(refusal.sqlstate, refusal.message, refusal.hint, refusal.detail) from exc

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection; a broken one is dropped. Errors become ``Refused``."""
        async with self._slots:
            conn = None
            try:
                conn = await self._checkout()
                yield conn
            except ledger.BudgetError as exc:
                raise Refused(exc.sqlstate, exc.message, exc.hint, exc.detail) from exc
            except psycopg.errors.QueryCanceled as exc:  # a time limit or a cancel: the connection is still good
                raise _server_error(exc) from exc
            except psycopg.OperationalError as exc:
                log.warning("dp connection failed: %s", str(exc).strip())
                if conn is not None:
                    await conn.close()
                conn = None
                diag = exc.diag  # the server's reason, when it sent one before hanging up (57P01...)
                raise Refused(diag.sqlstate or "08006", diag.message_primary or "anonproxy lost its connection to "
                              "the PostgreSQL server", diag.message_hint or "Try again.") from exc
            except psycopg.Error as exc:  # e.g. a bound value that is not valid input for its type
                raise _server_error(exc) from exc
            finally:
                if conn is not None and not conn.closed:
                    if conn.info.transaction_status == pq.TransactionStatus.IDLE:
                        self._idle.append(conn)
                    else:
                        await conn.close()


def _server_error(exc: psycopg.Error) -> Refused:
    """The server's error, as it gave it."""
    diag = exc.diag
    return Refused(diag.sqlstate or "XX000", diag.message_primary or str(exc), diag.message_hint, diag.message_detail)


MAX_PARAMETERS = 65535  # the protocol's limit on $n parameters in one statement


def _measured(parameters: Parameters, unmeasured: tuple[int, ...]) -> tuple[tuple[int, int, int, bytes | None], ...]:
    """The bound parameters the measurement depends on, as (number, declared type, format, value): those only
    LIMIT and OFFSET use left out (``limit 5``, ``limit $1`` with 5 or with 10 measure the same groups)."""
    count = len(parameters.values)
    types = parameters.types + (0,) * (count - len(parameters.types))
    formats = parameters.formats if len(parameters.formats) == count else (0,) * count
    return tuple((number, types[number - 1], formats[number - 1], parameters.values[number - 1])
                 for number in range(1, count + 1) if number not in unmeasured)


def _bound_tail(plan: DPPlan, parameters: Parameters) -> DPPlan:
    """``plan`` with the bound values of its LIMIT and OFFSET parameters, as PostgreSQL reads them: NULL is no
    limit (or offset 0), a negative value an error."""
    bound = {}
    tail = (("limit", plan.limit_parameter, "2201W"), ("offset", plan.offset_parameter, "2201X"))
    for name, number, sqlstate in tail:
        if number is None:
            continue
        value = _bound_integer(parameters, number)
        if value is not None and value < 0:
            raise Refused(sqlstate, f"{name.upper()} must not be negative")
        bound[name] = value if value is not None or name == "limit" else 0
    return replace(plan, **bound) if bound else plan


def _bound_integer(parameters: Parameters, number: int) -> int | None:
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


def _readable(cached: bytes | None, plan: DPPlan) -> Measurement | None:
    """The cached measurement of ``plan``, keys in the plan's order; None (a miss) when there is none or it cannot
    be read as one."""
    measurement = decoded(cached)
    return measurement.for_plan(plan) if measurement is not None and measurement.fits(plan) else None


def _over_released(outer: Outer, released: Result) -> tuple[str, Parameters]:
    """The outer query over ``WITH anonproxy_released(<columns>) AS (VALUES ($1, $2), ...)``, each value a
    parameter typed as its column, in text format as the answer holds it."""
    width = len(released.columns)
    if width != len(outer.names):
        raise Refused("XX000", "internal error in anonproxy: the released rows do not have the inner query's columns")
    count = max(len(released.rows), 1)
    if count * width > MAX_PARAMETERS:
        raise Refused("54000", f"the outer query would read {len(released.rows)} released rows, more than anonproxy "
                      "can pass to it", "Restrict the inner query (WHERE, LIMIT) or run it on its own.")
    rows = released.rows or ((None,) * width,)
    values = ", ".join("(" + ", ".join(f"${row * width + column + 1}" for column in range(width)) + ")"
                       for row in range(count))
    limit = "" if released.rows else " LIMIT 0"  # no rows: one row of NULLs keeps the types, and is cut
    columns = ", ".join(_quote(name) for name in outer.names)
    sql = f"WITH {_quote(ROWS)}({columns}) AS (VALUES {values}{limit})\n{outer.sql()}"
    types = tuple(column.type_oid for column in released.columns) * count
    flat = tuple(value for row in rows for value in row)
    return sql, Parameters(types=types, formats=(0,) * len(flat), values=flat)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _run_described(conn: psycopg.AsyncConnection[Any], sql: str, parameters: Parameters,
                         ) -> tuple[tuple[Column, ...], list[tuple[Any, ...]]]:
    """Result columns (names and types) and rows of ``sql``, with ``parameters`` bound."""
    pgconn = conn.pgconn
    async with conn.lock:
        pgconn.send_query_params(sql.encode(), list(parameters.values), list(parameters.types),
                                 list(parameters.formats), pq.Format.TEXT)
        result = _last(await conn.wait(generators.execute(pgconn)), pq.ExecStatus.TUPLES_OK)
    loader = Transformer(conn)
    loader.set_pgresult(result)
    columns = tuple(Column((result.fname(i) or b"").decode(), result.ftype(i)) for i in range(result.nfields))
    return columns, loader.load_rows(0, result.ntuples, tuple)


async def _describe_columns(conn: psycopg.AsyncConnection[Any], sql: str, declared: tuple[int, ...],
                            ) -> tuple[Column, ...]:
    """Result columns (names and types) of ``sql``: prepared, never executed."""
    result = await _prepared(conn, sql, declared)
    return tuple(Column((result.fname(i) or b"").decode(), result.ftype(i)) for i in range(result.nfields))


@contextlib.asynccontextmanager
async def _snapshot(conn: psycopg.AsyncConnection[Any], tables: tuple[str, ...],
                    timeout_ms: int = 0) -> AsyncIterator[str | None]:
    """A REPEATABLE READ, READ ONLY transaction; yields the data version of ``tables`` read in it, the version of the
    rows the plan reads in it, so that an answer is cached under the version it was computed from. Its statements
    run under ``timeout_ms`` (0: none), which ends with it. Begun, timed and the version read in one round trip
    (pipelined)."""
    try:
        async with conn.cursor() as cur:
            async with conn.pipeline():
                await conn.execute(_BEGIN_SNAPSHOT)
                await conn.execute(f"set local statement_timeout = {int(timeout_ms)}")
                await cur.execute(*ledger.data_version_statement(tables))
            row = await cur.fetchone()
        assert row is not None
        yield row[0]
    except BaseException:
        if conn.info.transaction_status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
            with contextlib.suppress(psycopg.Error):  # if it fails, the pool drops the connection (not idle)
                await conn.execute("rollback")
        raise
    await conn.execute("commit")


async def _measured_on(conn: psycopg.AsyncConnection[Any], plan: DPPlan, parameters: Parameters,
                       stop: Stop) -> tuple[str | None, list[int], list[tuple[Any, ...]]]:
    async with stop.running(conn), _snapshot(conn, plan.tables, stop.left_ms()) as version:
        stop.check()  # no await from here until the SQL is sent: a cancel now reaches it
        types, rows = await _run(conn, plan.sql, parameters)
    return version, types, rows


async def _run(conn: psycopg.AsyncConnection[Any], sql: str, parameters: Parameters,
               ) -> tuple[list[int], list[tuple[Any, ...]]]:
    """Column types and rows of ``sql``, the client's $n values bound as it sent them (text or binary)."""
    count = len(parameters.values)
    types = [*parameters.types[:count], *[0] * (count - len(parameters.types))]
    pgconn = conn.pgconn
    async with conn.lock:
        pgconn.send_query_params(sql.encode(), list(parameters.values), types, list(parameters.formats),
                                 pq.Format.TEXT)
        result = _last(await conn.wait(generators.execute(pgconn)), pq.ExecStatus.TUPLES_OK)
    loader = Transformer(conn)
    loader.set_pgresult(result)
    return [result.ftype(i) for i in range(result.nfields)], loader.load_rows(0, result.ntuples, tuple)


async def _check_statement(conn: psycopg.AsyncConnection[Any], plan: DPPlan, parameters: Parameters) -> None:
    """Refuse, before the charge, what the server rejects without reading a row: the plan's SQL and its post
    statement are prepared (parsed and type-checked, never executed: ``round(double precision, integer)`` does not
    exist), and bound values it cannot take (not valid input for the types the server infers, too many or too
    few) are converted on their own in a statement that reads no table. Such a refusal depends on the question
    and the values alone, so it costs nothing."""
    types, columns = await _describe(conn, plan.sql, parameters.types)
    await _post_types(conn, plan, columns)
    if not parameters.values:
        return
    probe = "SELECT " + ", ".join(f"${number}" for number in range(1, len(types) + 1))
    await _run(conn, probe, replace(parameters, types=types))


async def _describe(conn: psycopg.AsyncConnection[Any], sql: str, declared: tuple[int, ...],
                    ) -> tuple[tuple[int, ...], list[int]]:
    """Parameter types (as the server infers them) and column types of ``sql``: prepared, never executed."""
    result = await _prepared(conn, sql, declared)
    return (tuple(result.param_type(i) for i in range(result.nparams)),
            [result.ftype(i) for i in range(result.nfields)])


async def _prepared(conn: psycopg.AsyncConnection[Any], sql: str, declared: tuple[int, ...]) -> pq.abc.PGresult:
    """The server's description of ``sql`` prepared as the unnamed statement (never executed)."""
    pgconn = conn.pgconn
    async with conn.lock:
        pgconn.send_prepare(b"", sql.encode(), list(declared))
        _last(await conn.wait(generators.execute(pgconn)), pq.ExecStatus.COMMAND_OK)
        pgconn.send_describe_prepared(b"")
        return _last(await conn.wait(generators.execute(pgconn)), pq.ExecStatus.COMMAND_OK)


def _last(results: list[pq.abc.PGresult], expected: pq.ExecStatus) -> pq.abc.PGresult:
    result = results[-1]
    if result.status != expected:
        field = pq.DiagnosticField
        text = {name: (result.error_field(code) or b"").decode("utf-8", "replace") or None
                for name, code in (("sqlstate", field.SQLSTATE), ("message", field.MESSAGE_PRIMARY),
                                   ("hint", field.MESSAGE_HINT), ("detail", field.MESSAGE_DETAIL))}
        raise Refused(text["sqlstate"] or "XX000", text["message"] or "the query failed", text["hint"],
                      text["detail"])
    return result


async def _result(conn: psycopg.AsyncConnection[Any], plan: DPPlan, measurement: Measurement, headline: str) -> Result:
    """The statement's answer from a noisy measurement, fresh or cached (its columns, HAVING, the post statement
    over the noisy values when the query has post-aggregate expressions, ORDER BY, LIMIT), with a notice:
    ``headline`` and the plan's noise lines. Post-processing only: it costs nothing."""
    types = measurement.sql_types(plan)  # this statement's order of the statistics
    released = released_rows(plan, measurement)
    post_types, computed = None, None
    if plan.post is not None:
        array_types = _array_types(plan, types)
        arrays = post_arrays(plan, released)
        values = tuple(_array_text(values, element) for values, element in
                       zip(arrays, (_INT8, *(plan.value_types(types)[i] for i in plan.post.values)), strict=True))
        post_types, computed = await _run(conn, plan.post.sql, Parameters(array_types, (0,) * len(values), values))
    columns = _output_columns(plan, types, post_types)
    noisy_rows, _ = finish(plan, released, computed)
    return Result(columns, tuple(tuple(text_value(value, column.type_oid)
                                       for value, column in zip(row, columns, strict=True))
                                 for row in noisy_rows),
                  notices=_notice(headline, "\n".join(plan.notices()) or None))


_INT8 = 20


def _array_types(plan: DPPlan, sql_types: list[int]) -> tuple[int, ...]:
    """The post statement's parameter types: arrays of bigint (row numbers) and of each value column's type (a
    built-in type: aggregates are numbers, GROUP BY expressions of ordinary columns text, dates, numbers ...)."""
    assert plan.post is not None
    value_types = plan.value_types(sql_types)
    types = [_array_of(_INT8)]
    for index in plan.post.values:
        array = _array_of(value_types[index])
        if array is None:
            raise Refused("0A000", f"{plan.hidden[index - len(plan.columns)].name} cannot be used in an expression "
                          f"over aggregates in dp mode: its type (oid {value_types[index]}) is not a built-in one",
                          "Select it as a column of its own.")
        types.append(array)
    return tuple(types)


def _array_of(oid: int) -> int | None:
    info = psycopg.postgres.types.get(oid)
    return info.array_oid if info is not None and info.array_oid else None


async def _post_types(conn: psycopg.AsyncConnection[Any], plan: DPPlan, sql_types: list[int]) -> list[int] | None:
    """The post statement's result types (None without one): prepared, never executed."""
    if plan.post is None:
        return None
    _, types = await _describe(conn, plan.post.sql, _array_types(plan, sql_types))
    return types


def _array_text(values: list[object], element_type: int) -> bytes:
    """A one-dimensional array in PostgreSQL's text format: every element quoted, NULL bare."""
    elements = []
    for item in values:
        text = text_value(item, element_type)
        if text is None:
            elements.append("NULL")
        else:
            elements.append('"' + text.decode().replace("\\", "\\\\").replace('"', '\\"') + '"')
    return ("{" + ",".join(elements) + "}").encode()


def _output_columns(plan: DPPlan, sql_types: list[int], post_types: list[int] | None = None) -> tuple[Column, ...]:
    types = plan.value_types(sql_types, post_types)[:len(plan.columns)]
    return tuple(Column(column.name, oid) for column, oid in zip(plan.columns, types, strict=True))


# What the policy's per-query values are (docs/policy.md): ε sets the noise, δ is what partition selection may add.
_SETTING_NAMES = {"epsilon": "accuracy epsilon (accuracy_epsilon)", "delta": "per-query delta (delta_per_query)"}


def _state(budget: ledger.Remaining) -> str:
    """Where a budget stands, in its own accounting: ε spent of the budget (and ρ under zCDP), and what is left (the
    lesser of the role's and the shared cap's)."""
    text = f"ε spent {amounts.spent(budget.epsilon_spent)} of {_plain(budget.epsilon_budget)}"
    if budget.accounting == "zcdp":
        text += f" (ρ {amounts.spent(budget.rho_spent)} spent)"
    text += f"; left: ε {amounts.left(budget.epsilon)}, δ {_plain(budget.delta)}"
    if budget.rho is not None:
        text += f", ρ {amounts.left(budget.rho)}"
    return text


def _accounting(budget: ledger.Remaining) -> str:
    """How a budget counts, for SHOW anonproxy.budget: under zCDP with the ρ spent and what is left of it."""
    text = "zCDP accounting" if budget.accounting == "zcdp" else "basic accounting"
    if budget.accounting == "zcdp":
        text += f": rho {amounts.spent(budget.rho_spent)} spent"
    if budget.rho is not None:
        text += f"{',' if budget.accounting == 'zcdp' else ':'} rho {amounts.left(budget.rho)} left"
    return text


def _moved(charged: list[DPPlan], budget: ledger.Remaining) -> str:
    """What running the questions to be charged (a series limit's two, or one) would move the role's ε spent by, in its
    accounting: under basic their ε; under zCDP their ρ adds up and ε spent is the conversion of the sum at what is
    left of δ, so an answer's share of ε is not its own ε (a first answer looks dearer than later ones)."""
    if budget.accounting == "basic":
        after = budget.epsilon_spent + sum((Decimal(repr(plan.epsilon)) for plan in charged), Decimal(0))
    else:
        rho = sum((Decimal(repr(plan.rho)) for plan in charged), Decimal(0))
        delta_add = sum((Decimal(repr(plan.delta_add)) for plan in charged), Decimal(0))
        delta_left = budget.role_delta - delta_add  # the role's δ left under zcdp: D − Σδ_add
        after = zcdp_epsilon(budget.rho_spent + rho, delta_left) if delta_left > 0 else Decimal("Infinity")
    return (f"running it moves ε spent on {charged[0].table} by {amounts.spent(after - budget.epsilon_spent)}: from "
            f"{amounts.spent(budget.epsilon_spent)} to {amounts.spent(after)} of {_plain(budget.epsilon_budget)}")


def _show(setting: str, values: list[str]) -> Result:
    return Result((Column(f"anonproxy.{setting}", 25),), tuple((value.encode(),) for value in values), "SHOW")


def _with_notice(result: Result, message: str) -> Result:
    return replace(result, notices=result.notices + _notice(message))


def _plain(amount: Decimal) -> str:
    """1.50 -> 1.5, 10 -> 10, 0.00001 -> 0.00001."""
    return format(amount.normalize(), "f")


def _notice(message: str, detail: str | None = None) -> bytes:
    return pg.error_response("00000", message, severity="NOTICE", detail=detail, type_=b"N")
