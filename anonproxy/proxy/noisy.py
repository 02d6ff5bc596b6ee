"""Differentially private answers for roles in mode ``dp`` (one instance per worker): the I/O of a question.

What a question does, and in what order, is :mod:`anonproxy.dp.question`, a
generator of steps without I/O; this module drives it (:meth:`NoisyAnswers._drive`)
and does each step's I/O. For one query: the router's measurement of the
statement (:class:`anonproxy.route.decision.Noisy`, made from its one parse)
is priced, with the final SQL check, in the worker's analysis process, at the
role's per-query ε and δ as this worker last read them (lowered by the
session's ``SET anonproxy.epsilon`` / ``anonproxy.delta``), and cached per
worker (a new text is priced in the same analysis call as the router's
decision: :meth:`NoisyAnswers.deciding`); in one statement (``anonproxy.lookup_answer``) the ledger gives that
per-query cost, the data version and the noisy measurement already paid for
(keyed by the plan's measurement only: anonproxy.dp.answers.fingerprint). That
one round trip is the whole ledger work for a question already answered; the
statement is then finished from that measurement, at no cost. (When the
ledger's cost differs, the same measurement is priced again at it.) Else check
the plan's SQL and the bound values (prepared and described in one round trip,
pipelined; values converted alone, reading nothing: a bad value is refused for
free), then charge the ledger, committed before any row is read (fail closed:
a question that fails after the charge stays paid for, and an exhausted budget
is refused before its SQL runs); then, in one REPEATABLE READ READ ONLY
transaction, read the data version of every table the plan reads and run the
contribution-bounded SQL with the client's bound parameters; measure (noise,
partition selection), cache the measurement under that version
(anonproxy.dp.ledger), and finish the statement from it. A query that only
lists declared public domains reads no row and is neither charged nor cached.

Round trips (:meth:`NoisyAnswers._charge_then_read`): when the data is read on
the primary, the check (the plan's SQL prepared, when it has no post statement
and no bound values; else it goes alone, before), the charge (BEGIN, charge,
COMMIT) and the read (BEGIN REPEATABLE READ, its time limit, the client's
settings, the data version, the SQL, COMMIT) go in one round trip, in pipeline
mode. The server runs them in order and skips the rest after an error: a
rejected SQL is not charged, a refused charge reads nothing, and the charge's
COMMIT is durable before the SQL reads a row; the read's COMMIT, after a sync of its own, ends whatever
transaction a failure left open, so a refusal needs no ROLLBACK round trip. A new question makes three round trips
(lookup, that one, store) where it made eight; one already answered makes one. Once this worker has read the role's
per-query cost on the table, a question it has not seen answered skips the lookup (:meth:`NoisyAnswers._lookup`:
folded): its charge is ``anonproxy.charge_unless_answered`` (sql/0041), which looks it up in the charge's
transaction and charges only if no answer is cached and the cost is the one it was priced at, and its read starts
with ``require_charged``, so nothing is read uncharged; not charged, the question goes round again from what the
ledger read (an answer another worker cached is then finished from, at no cost, with no other round trip). Two
round trips (that one, store).

Time limits and cancels (:class:`Stop`): a question is held to the session's
statement time limit from when it is asked, and a client's CancelRequest
stops it. Both are checked before the charge (and before a cached answer):
stopped there, it fails with 57014 and costs nothing. Once charged, what is
left of the limit is the data-reading transaction's ``statement_timeout``
and a cancel is passed on to its backend: it fails with 57014 and stays paid
for.

The client's session (:func:`measuring`): every statement that computes an
answer's values (the read, a free listing, the post statement, an outer query
over released rows) runs with the client's TimeZone and DateStyle field order
set locally in its transaction (bound values), and the answer cache's key
names them: in another zone a question is another question.

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
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from psycopg import generators, pq
from psycopg.adapt import Transformer
from psycopg.types.string import TextLoader

from ..config import ServiceLogin
from ..dp import amounts, ledger
from ..dp import question as question_steps
from ..dp.answers import (
    TEXT_LOADED,
    checked_sql,
    decided_and_priced,
    default_cost,
    measured_text,
    per_query,
    priced_checked,
    series_question,
)
from ..dp.finish import Measurement, finish, post_arrays, released_rows
from ..dp.model import DPParams, DPPlan, OutputColumn
from ..dp.plan import Packed
from ..dp.question import (
    Asked,
    Charge,
    Check,
    CheckStop,
    Costs,
    Finish,
    Limits,
    Lookup,
    MeasureText,
    Measuring,
    Need,
    Price,
    Read,
    Refused,
    Remaining,
    RunReleased,
    Store,
    notice,
    plain,
)
from ..plan.outer import Outer, Series
from ..plan.refusals import Reject
from ..policy.model import Policy, RolePolicy
from ..route.decision import Decision, ExplainDP, Noisy, SessionSetting
from ..wire.results import Column, Result, text_value
from .analysis import Analyser, AnalysisFailed, AnalysisTimeout
from .audit_trail import Spent
from .cache import BoundedCache
from .cancel import CANCEL_TIMEOUT
from .gate import Description, Parameters
from .servers import Servers
from .service import login_refusal
from .standby_reads import StandbyConnections, alive

__all__ = ["NoisyAnswers", "Refused", "SessionLimits", "Stop"]

log = logging.getLogger("anonproxy.dp")
T = TypeVar("T")

POOL_SIZE = 4  # connections per worker: dp questions of different sessions run side by side
PLAN_CACHE_BYTES = 32 * 1024 * 1024  # plans are deterministic in (text, role, policy version, ε, δ): kept per worker
ANSWERED_BYTES = 4 * 1024 * 1024  # the questions this worker saw answered: their next lookup is not folded
KEY_FIELDS_BYTES = 4 * 1024 * 1024  # PostgreSQL's description of answers' keys, by their SQL (no round trip again)

_BEGIN_SNAPSHOT = "begin isolation level repeatable read, read only"

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


class Stop:
    """What may stop one question before it is answered: the session's time limit (``timeout_ms``, the client's
    statement_timeout capped by the policy's, counted from when the question was asked; 0: none) and the client's
    CancelRequest (:meth:`cancel`). Checked before the charge (:meth:`check`: stopped there, a question costs
    nothing) and while the measurement SQL runs (:meth:`running`: PostgreSQL stops it, and it stays charged)."""

    def __init__(self, timeout_ms: int = 0) -> None:
        self.timeout_ms = timeout_ms
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


@dataclass(frozen=True)
class _Asking:
    """Who asks a question, and with what: what the driver needs to do its steps' I/O."""

    role: RolePolicy
    policy: Policy
    parameters: Parameters
    stop: Stop
    asker: int  # whose turn its analysis takes
    session: Measuring = ()  # the client's settings that the question's SQL runs under (measuring)
    # The outcome of a Read sent with its Charge (anonproxy.dp.question.Charge.then): rows, or the error to raise.
    read_ahead: list[tuple[str | None, list[int], list[tuple[Any, ...]]] | BaseException] = field(
        default_factory=list)
    # A Check kept to be sent first with the Charge that names it (Charge.check).
    check_ahead: list[Check] = field(default_factory=list)


def _asked(question: Noisy | ExplainDP, role: RolePolicy, parameters: Parameters, limits: SessionLimits,
           session: Measuring = ()) -> Asked:
    """The question as dp.question takes it: the router's measurement (else its text, measured when priced)."""
    return Asked(question.sql, question.plan if question.plan is not None else question.sql, role.role, parameters,
                 Limits(limits.epsilon, limits.delta), session)


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
        # role -> table -> the per-query (ε, δ) and the accounting last read from the ledger: what the next question
        # is priced at before the ledger confirms it
        self._costs: dict[str, dict[str, Costs]] = {}
        # (role, table) -> what the ledger's lookup read last, as it read it: a question not known to be answered is
        # priced at it and charged unless answered, without a lookup of its own (question.Lookup.fold)
        self._looked: dict[tuple[str, str], ledger.Lookup] = {}
        self._answered: BoundedCache[tuple[str, str], bool] = BoundedCache(ANSWERED_BYTES)  # (role, key)
        # (policy version, keys' SQL, declared parameter types) -> what PostgreSQL described of the keys
        self._key_fields: BoundedCache[tuple[int, str, tuple[int, ...]], tuple[KeyField, ...]] = \
            BoundedCache(KEY_FIELDS_BYTES)

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()
        await self._standbys.close()

    # -- what the session asks ---------------------------------------------------------

    def deciding(self, decide: Callable[[str, RolePolicy, Policy], Decision], sql: str, role: RolePolicy,
                 policy: Policy) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """What the analysis process runs for a new text of a dp role: ``decide``, and the measurement it makes
        priced at the per-query cost this worker last read for its table (the proxy's default before any), in the
        same call (anonproxy.dp.answers.decided_and_priced). :meth:`decided` takes its outcome."""
        costs = {table: question_steps.params(known, Limits()) for table, known in self._known(role).items()}
        return decided_and_priced, (decide, sql, role, policy, costs, question_steps.params(question_steps.DEFAULTS,
                                                                                            Limits()))

    def decided(self, sql: str, role: RolePolicy, policy: Policy, outcome: tuple[Any, ...]) -> Decision:
        """The decision of :meth:`deciding`'s call; its priced plan is kept where pricing the question looks first
        (a session that lowered its own ε or δ prices it again, at those)."""
        decision, params, plan = outcome
        if params is not None and plan is not None:
            text = getattr(decision, "sql", sql)  # the statement's own text (a trailing ';' split off), as it is asked
            self._plans.put((text, role.role, policy.version, params), plan, _plan_weight(text, plan))
        return decision  # type: ignore[no-any-return]

    async def answer(self, question: Noisy, role: RolePolicy, policy: Policy, parameters: Parameters,
                     limits: SessionLimits, stop: Stop | None = None, spent: Spent | None = None,
                     settings: dict[str, str] | None = None) -> Result:
        """The noisy answer of ``question`` (the router's Noisy decision), charged (or the cached one, free);
        ``spent`` gets what it read and cost; ``stop``: the time limit and the client's cancel, which stop it with
        57014; ``settings``: the client's followed settings, those of them that change what its SQL reads
        (:func:`measuring`) it runs under and its cache key names. The question's steps are
        anonproxy.dp.question's; this drives them."""
        session = measuring(settings or {})
        asking = _Asking(role, policy, parameters, stop or Stop(), limits.asker, session=session)
        asked = _asked(question, role, parameters, limits, session)
        async with self._connection() as conn:
            return await self._drive(question_steps.answer(asked, self._known(role), policy.version,
                                                           spent or Spent()), asking, conn)

    async def describe(self, question: Noisy, role: RolePolicy, policy: Policy, parameters: Parameters,
                       limits: SessionLimits) -> Description:
        """Parameter types and result columns of a dp query, from the server's description of its plan:
        nothing is run, charged or read from the ledger (the types do not depend on the per-query cost)."""
        asking = _Asking(role, policy, parameters, Stop(), limits.asker)
        asked = _asked(question, role, parameters, limits)
        plan = await self._drive(question_steps.described(asked, self._known(role)), asking)
        more = tuple([Result((await self.describe(Noisy(further, packed if isinstance(packed, Packed) else None),
                                                  role, policy, parameters, limits)).columns)
                      for further, packed in question_steps.further_questions(plan.nested, asked.measured)]
                     if isinstance(plan.nested, Outer) else [])  # the columns of the aggregate queries it joins
        async with self._connection() as conn:
            parameter_types, types = await _describe(conn, plan.sql, parameters.types)
            post_types = await _post_types(conn, plan, types)
            columns = _output_columns(plan, types, post_types,
                                      await self._described_keys(conn, plan, parameter_types, policy))
            if isinstance(plan.nested, Outer):
                outer_sql, bound_types, _ = question_steps.over_released(plan.nested, Result(columns), more)
                columns = await _describe_columns(conn, outer_sql, bound_types)
        if isinstance(plan.nested, Series):  # the second question's columns; its restriction does not change them
            second = await self.describe(Noisy(series_question(plan.nested, ())), role, policy, parameters, limits)
            columns = second.columns
        return Description(parameter_types, columns)

    async def explain(self, question: ExplainDP, role: RolePolicy, policy: Policy, parameters: Parameters,
                      limits: SessionLimits, settings: dict[str, str] | None = None) -> Result:
        """``EXPLAIN (ANONPROXY)``: cost, noise and whether the answer is cached (under the client's ``settings``,
        as :meth:`answer`), without running or charging."""
        session = measuring(settings or {})
        asking = _Asking(role, policy, parameters, Stop(), limits.asker, session=session)
        asked = _asked(question, role, parameters, limits, session)
        async with self._connection() as conn:
            return await self._drive(question_steps.explain(asked, self._known(role), policy.version), asking,
                                     conn)

    def _check_confirmed(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """With standbys, refuse to answer when the charge's commit came with a WARNING: the ledger functions raise
        none, so it is PostgreSQL saying that the commit's wait for the synchronous standby was cancelled (the
        charge is committed on the primary alone, and a fail-over now would lose it). It stays charged."""
        if self._servers is not None and conn in self._warned:
            raise Refused("57014", "the privacy ledger's charge was committed on the primary but its wait for the "
                          "synchronous standby was cancelled: the question stays charged and is not answered",
                          "Check that a synchronous standby streams from the primary (docs/replicas.md), then ask "
                          "again.")

    def _standby(self) -> Any:
        """The standby a measurement would run on now (None: the primary)."""
        return self._servers.standby() if self._servers is not None else None

    async def _charge_then_read(self, conn: psycopg.AsyncConnection[Any], need: Charge, asking: _Asking,
                                check: bool) -> ledger.Remaining | ledger.Lookup:
        """The charge, committed, then the measurement's snapshot and SQL, in one round trip (pipeline mode): the
        server runs them in order, so the charge's COMMIT has returned before the first row is read, and it skips
        the rest when the charge fails (nothing read, nothing charged). ``check``: the plan's SQL is prepared first
        (the question's Check, kept for this round trip): when the server rejects it, nothing else runs and the
        question is refused at no cost. The read's outcome, or its error, waits in ``asking.read_ahead`` for the
        question's Read; a cancel from the charge on reaches the backend. Whatever failed, the round trip's last
        COMMIT, after a sync of its own, has ended the failed transaction (_read_commands): the connection is idle.

        With ``need.unless_answered`` (the question's lookup folded into this round trip), the charge is made only
        if the ledger holds no answer and reads the cost the question was priced at, and the read begins with
        require_charged: not charged, nothing is read, and what the ledger read is returned instead (as it is when
        the check fails: a question answered before is then finished from its answer, as after a lookup)."""
        plan, role, stop, unless = need.plan, asking.role.role, asking.stop, need.unless_answered
        if unless is None:
            sql, values = ledger.charge_statement(role, plan.table, plan.epsilon, plan.delta, need.key, rho=plan.rho,
                                                  delta_add=plan.delta_add)
        else:
            sql, values = ledger.charge_unless_answered_statement(role, plan.table, plan.tables, need.key, unless,
                                                                  plan.epsilon, plan.delta, rho=plan.rho,
                                                                  delta_add=plan.delta_add,
                                                                  time_left_ms=stop.left_ms())
        guard = ledger.require_charged_query(need.key) if unless is not None else None
        first = [_prepare(plan.sql, asking.parameters.types)] if check else []
        for attempt in range(ledger.RETRIES):
            results: list[pq.abc.PGresult] = []
            late: Refused | None = None
            try:
                async with stop.running(conn):
                    results = await _pipelined(conn, [*first, *_charge_commands(sql, values),
                                                      *_read_commands(plan, asking.parameters, stop.left_ms(),
                                                                      asking.session, guard)])
            except Refused as exc:  # the client's cancel, come while the pipeline ran
                if not results:
                    raise
                late = exc
            if first:
                if unless is not None and results[0].status != pq.ExecStatus.COMMAND_OK:
                    # refused, nothing else ran; unless the question was answered before
                    return self._read(role, plan.table, need.key, await ledger.lookup_answer(
                        conn, role, plan.table, plan.tables, need.key))
                _last(results[:1], pq.ExecStatus.COMMAND_OK)  # the check: refused, nothing else ran
                results = results[1:]
            failed = _error(conn, results[:_CHARGE_COMMANDS])
            if failed is not None:  # nothing was charged, nothing read
                if ledger.retryable(failed) and attempt < ledger.RETRIES - 1:
                    continue
                raise await ledger.refusal(conn, failed, role, plan.table) or failed
            row = _row(conn, results[1])
            left = ledger.Remaining.from_row(row) if unless is None else ledger.charged_or_looked(row)
            if isinstance(left, ledger.Lookup):  # not charged: the read stopped at require_charged
                if late is not None:
                    raise late
                return self._read(role, plan.table, need.key, left)
            asking.read_ahead.append(late or _read_outcome(conn, results[_CHARGE_COMMANDS:]))
            return left
        raise AssertionError("unreachable")

    async def _measure(self, conn: psycopg.AsyncConnection[Any], plan: DPPlan, parameters: Parameters,
                       stop: Stop, session: Measuring) -> tuple[str | None, list[int], list[tuple[Any, ...]]]:
        """The data version and the rows of the plan's SQL, read in one snapshot: on the standby in rotation with
        the least lag, else (none, or it failed) on ``conn``, the primary's. Called after the charge committed."""
        standby = self._standby()
        if standby is not None:
            assert self._servers is not None
            try:
                async with self._standbys.connection(standby) as reader:
                    return await _measured_on(reader, plan, parameters, stop, session)
            except psycopg.errors.QueryCanceled:
                raise  # the client's cancel or time limit: the question stops, paid for
            except psycopg.OperationalError as exc:  # unreachable, shut down, or cancelled by recovery (40001)
                log.warning("dp measurement on standby %s failed (%s); measuring on the primary", standby,
                            str(exc).strip())
                self._servers.failed(standby)
        return await _measured_on(conn, plan, parameters, stop, session)

    async def budget(self, role: str) -> Result:
        """``SHOW anonproxy.budget``: one row per protected table the role has a budget on."""
        async with self._connection() as conn:
            budgets = await ledger.remaining_all(conn, role)
        values = [f"{b.domain}: epsilon {amounts.left(b.epsilon)} of {plain(b.epsilon_budget)} left, delta "
                  f"{plain(b.delta)} of {plain(b.delta_budget)} left; epsilon spent {amounts.spent(b.epsilon_spent)} "
                  f"({_accounting(b)}); accuracy epsilon {plain(per_query(b, 'epsilon'))} per query"
                  for b in budgets]
        return _show("budget", values)

    async def show(self, setting: str, role: str, limits: SessionLimits) -> Result:
        """``SHOW anonproxy.epsilon | delta``: the session's value, else the policy's per query (per table)."""
        own = limits.epsilon if setting == "epsilon" else limits.delta
        if own is not None:
            return _show(setting, [plain(own)])
        async with self._connection() as conn:
            budgets = await ledger.remaining_all(conn, role)
        values = {b.domain: per_query(b, setting) for b in budgets}
        if len(set(values.values())) <= 1:
            return _show(setting, [plain(next(iter(values.values()), default_cost(setting)))])
        return _show(setting, [", ".join(f"{domain}: {plain(v)}" for domain, v in sorted(values.items()))])

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
                              f"at most {plain(maximum)} for role \"{role}\", got {plain(request.value)}",
                              f"Give {name} a value up to {plain(maximum)} (SET, or -c {name}=... at login); ask "
                              "the DBA for a larger one.")
            if at_login:
                limits.at_login[request.setting] = request.value
        value = request.value if request.value is not None else limits.at_login.get(request.setting)
        setattr(limits, request.setting, value)
        return Result((), tag="SET" if request.value is not None else "RESET")

    # -- the I/O of a question's steps ----------------------------------------------------

    def _known(self, role: RolePolicy) -> dict[str, Costs]:
        """The role's per-query costs per table as this worker last read them."""
        return self._costs.setdefault(role.role, {})

    async def _drive(self, steps: Generator[Need, Any, T], asking: _Asking,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> T:
        """Run ``steps`` to its end: each request it yields is done here, its outcome sent back. An exception of the
        I/O ends it (what was done, a charge, stays done)."""
        outcome: Any = None
        while True:
            try:
                need = steps.send(outcome)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            outcome = await self._do(need, asking, conn)

    async def _do(self, need: Need, asking: _Asking, conn: psycopg.AsyncConnection[Any] | None) -> Any:
        role, parameters = asking.role, asking.parameters
        if isinstance(need, MeasureText):
            return await self._analysed(measured_text, (need.text, role, asking.policy), asking, "planning")
        if isinstance(need, Price):
            return await self._priced(need, asking)
        if isinstance(need, CheckStop):
            asking.stop.check()
            return None
        assert conn is not None  # every other step reads or writes the database
        if isinstance(need, Lookup):
            return await self._lookup(conn, need, asking)
        if isinstance(need, Check):
            if need.plan.post is None and not parameters.values:  # one statement to prepare: it goes with the charge
                asking.check_ahead.append(need)
                return None
            return await _check_statement(conn, need.plan, parameters)
        if isinstance(need, Charge):
            self._warned.discard(conn)
            plan = need.plan
            kept = any(check is need.check for check in asking.check_ahead)
            asking.check_ahead.clear()
            # read on this connection (a charge unless answered always is: its read must stop when it charged nothing)
            if need.then is not None and not need.then.free and (self._standby() is None or need.unless_answered):
                left = await self._charge_then_read(conn, need, asking, kept)
            else:
                if kept:
                    await _check_statement(conn, plan, parameters)
                left = await ledger.charge(conn, role.role, plan.table, plan.epsilon, plan.delta, need.key,
                                           rho=plan.rho, delta_add=plan.delta_add)
            if isinstance(left, ledger.Remaining):  # charged (else nothing was: nothing to confirm)
                self._check_confirmed(conn)
            return left
        if isinstance(need, Read):
            if asking.read_ahead:  # sent with the charge
                outcome = asking.read_ahead.pop()
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome
            if need.free:
                return (None, *await _run(conn, need.plan.sql, parameters, asking.session))
            return await self._measure(conn, need.plan, parameters, asking.stop, asking.session)
        if isinstance(need, Store):
            self._answered.put((role.role, need.key), True, len(need.key))
            return await ledger.store_answer(conn, role.role, need.key, need.version, need.data)
        if isinstance(need, Finish):
            keys = await self._described_keys(conn, need.plan, parameters.types, asking.policy)
            return await _result(conn, need.plan, need.measurement, need.headline, asking, keys)
        if isinstance(need, RunReleased):
            return await self._run_released(conn, need, asking)
        assert isinstance(need, Remaining)
        return await ledger.remaining(conn, role.role, need.table)

    async def _lookup(self, conn: psycopg.AsyncConnection[Any], need: Lookup, asking: _Asking) -> ledger.Lookup:
        """The ledger's lookup; folded (nothing read: the cost read last, no answer) when the question may be and
        this worker knows the cost, does not know it answered, and reads on the primary, and the client did not
        set a time limit of its own (shorter than the policy's): such a question is looked up first, as before, so
        that a limit shorter than the lookup still stops it before the charge, at no cost. A question this worker
        saw answered is looked up alone (one statement): its answer is most likely still cached, and a folded
        charge that finds it costs the server the check, two transactions and the stopped read besides."""
        role, table = asking.role.role, need.plan.table
        last = self._looked.get((role, table))
        own_limit = 0 < asking.stop.timeout_ms < asking.policy.statement_limit("dp")
        if (need.fold and need.key is not None and last is not None and self._answered.get((role, need.key)) is None
                and self._standby() is None and not own_limit):
            return replace(last, data_version=None, answer=None, folded=True)
        return self._read(role, table, need.key, await ledger.lookup_answer(conn, role, table, need.plan.tables,
                                                                             need.key))

    async def _described_keys(self, conn: psycopg.AsyncConnection[Any], plan: DPPlan, declared: tuple[int, ...],
                              policy: Policy) -> tuple[KeyField, ...]:
        """:func:`_key_fields`, asked of the server once per keys' SQL and declared types under a policy version:
        the answers of one question (first, seen, described) then cost no round trip for it."""
        if not plan.keys_sql:
            return ()
        memo = (policy.version, plan.keys_sql, declared)
        known = self._key_fields.get(memo)
        if known is None:
            known = await _key_fields(conn, plan, declared)
            self._key_fields.put(memo, known, len(plan.keys_sql) + 16 * len(known))
        return known

    def _read(self, role: str, table: str, key: str | None, looked: ledger.Lookup) -> ledger.Lookup:
        """``looked``, kept as what the ledger read last for the role's table (and, with an answer, the key known
        answered)."""
        self._looked[(role, table)] = replace(looked, data_version=None, answer=None)
        if looked.answer is not None and key is not None:
            self._answered.put((role, key), True, len(key))
        return looked

    async def _run_released(self, conn: psycopg.AsyncConnection[Any], need: RunReleased, asking: _Asking) -> Result:
        """The outer query over the released rows, run by PostgreSQL over a VALUES list of them: its functions,
        types and column names are PostgreSQL's, and it reads no table (the final SQL check, in the analysis
        process, says so)."""
        refusal = await self._analysed(checked_sql, (need.sql, asking.policy, asking.role), asking, "checking")
        if refusal is not None:
            raise Refused(refusal.sqlstate, refusal.message, refusal.hint)
        bound = Parameters(types=need.types, formats=(0,) * len(need.values), values=need.values)
        columns, rows = await _run_described(conn, need.sql, bound, asking.session)
        return Result(columns, tuple(tuple(text_value(value, column.type_oid)
                                           for value, column in zip(row, columns, strict=True)) for row in rows))

    async def _priced(self, need: Price, asking: _Asking) -> DPPlan | Reject:
        """``priced_checked``, cached, and off the event loop: pricing and the final SQL check cost milliseconds
        (seconds for a long statement), a statement already seen should not."""
        key = (need.text, asking.role.role, asking.policy.version, need.params)  # `checked` only skips checks
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        plan = await self._analysed(priced_checked, (need.question, asking.role, asking.policy, need.params,
                                                     need.checked), asking, "planning")
        self._plans.put(key, plan, _plan_weight(need.text, plan))
        return plan

    async def _analysed(self, function: Callable[..., T], args: tuple[Any, ...], asking: _Asking, doing: str) -> T:
        """``function(*args)`` in the analysis process (on the event loop without one), which holds the policy
        from one call to the next: statement time limit 54001, a failure XX000."""
        if self._analyser is None:
            return function(*args)
        try:
            return await self._analyser.run(function, *args, asker=asking.asker, shared=(asking.policy,))
        except AnalysisTimeout:
            raise Refused("54001", f"statement too complex: anonproxy stopped {doing} it after "
                          f"{self._analyser.budget:g} s", "Simplify the statement (a long list of values is "
                          "the usual cause); the limit is the proxy's analysis_timeout setting.") from None
        except AnalysisFailed as exc:
            log.error("%s a dp query failed: %s", doing, exc)
            raise Refused("XX000", f"internal error in anonproxy while {doing} the query") from None

    # -- the pool ----------------------------------------------------------------------

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
            for name in TEXT_LOADED:  # kept in PostgreSQL's text: Python's dates have no ±infinity (a date_trunc key
                # over a column with an 'infinity' sentinel row failed the whole answer)
                conn.adapters.register_loader(name, TextLoader)
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


def _plan_weight(text: str, plan: DPPlan | Reject) -> int:
    """What a cached plan holds is mostly its SQL, its measured SQL's tokens and the client's text, each about as long
    as the statement."""
    return len(text) + 3 * len(getattr(plan, "sql", ""))


def _server_error(exc: psycopg.Error) -> Refused:
    """The server's error, as it gave it."""
    diag = exc.diag
    return Refused(diag.sqlstate or "XX000", diag.message_primary or str(exc), diag.message_hint, diag.message_detail)


async def _run_described(conn: psycopg.AsyncConnection[Any], sql: str, parameters: Parameters,
                         session: Measuring) -> tuple[tuple[Column, ...], list[tuple[Any, ...]]]:
    """Result columns (names and types) and rows of ``sql``, with ``parameters`` bound, run under ``session``."""
    result = await _executed(conn, sql, parameters, session)
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
                    timeout_ms: int = 0, session: Measuring = ()) -> AsyncIterator[str | None]:
    """A REPEATABLE READ, READ ONLY transaction; yields the data version of ``tables`` read in it, the version of the
    rows the plan reads in it, so that an answer is cached under the version it was computed from. Its statements
    run under ``timeout_ms`` (0: none) and the client's ``session`` settings, which end with it. Begun, timed,
    set and the version read in one round trip (pipelined)."""
    try:
        async with conn.cursor() as cur:
            async with conn.pipeline():
                await conn.execute(_BEGIN_SNAPSHOT)
                await conn.execute(f"set local statement_timeout = {int(timeout_ms)}")
                if session:
                    await conn.execute(_set_local(session, "%s"), [value for pair in session for value in pair])
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


_CHARGE_COMMANDS = 3  # BEGIN, the charge, COMMIT


def measuring(settings: dict[str, str]) -> Measuring:
    """The client's settings that change what a dp question's SQL reads, as it runs them: TimeZone (day and hour
    buckets, casts of timestamptz, literals without an offset) and DateStyle's field order (literals such as
    '03/01/2025'). Values are printed in ISO style all the same: the proxy reads them back (answers, cached
    measurements) and prints them in the client's style itself (anonproxy.proxy.followed_settings)."""
    session = []
    if settings.get("TimeZone"):
        session.append(("TimeZone", settings["TimeZone"]))
    if settings.get("DateStyle"):
        order = settings["DateStyle"].split(",")[-1].strip().upper()
        session.append(("DateStyle", f"ISO, {order if order in ('DMY', 'MDY', 'YMD') else 'MDY'}"))
    return tuple(session)


def _set_local(session: Measuring, placeholder: str = "") -> str:
    """Set ``session``'s settings for the rest of a transaction, names and values bound (``$1, $2, ...``, or
    ``placeholder`` for psycopg's ``%s``): never spliced into the SQL."""
    marks = [placeholder or f"${number}" for number in range(1, 2 * len(session) + 1)]
    return "select " + ", ".join(f"pg_catalog.set_config({name}, {value}, true)"
                                 for name, value in zip(marks[::2], marks[1::2], strict=True))


Command = Callable[[pq.abc.PGconn], None]


def _command(sql: bytes, values: list[bytes | None] | None = None) -> Command:
    """One statement to send in a pipeline, its values in text format."""
    return lambda pgconn: pgconn.send_query_params(sql, values, result_format=pq.Format.TEXT)


def _prepare(sql: str, declared: tuple[int, ...]) -> Command:
    """The plan's SQL prepared as the unnamed statement: parsed and type-checked, never executed."""
    return lambda pgconn: pgconn.send_prepare(b"", sql.encode(), list(declared))


def _charge_commands(sql: bytes, values: list[bytes | None]) -> list[Command]:
    return [_command(ledger.BEGIN_CHARGE.encode()), _command(sql, values), _command(b"commit")]


def _session_commands(session: Measuring) -> list[Command]:
    """The client's settings set for the transaction begun just before (none: nothing to set)."""
    return [_command(_set_local(session).encode(), [value.encode() for pair in session for value in pair])
            ] if session else []


def _sync(pgconn: pq.abc.PGconn) -> None:
    """The end of a pipeline's segment: after an error the server skips what follows up to here, then goes on."""
    pgconn.pipeline_sync()


def _read_commands(plan: DPPlan, parameters: Parameters, timeout_ms: int, session: Measuring,
                   guard: tuple[bytes, list[bytes | None]] | None = None) -> list[Command]:
    """What _measured_on does, as commands: the snapshot begun, timed and set to the client's settings, its data
    version, the SQL with the client's values as it bound them, the commit. ``guard``: a statement run first in
    the snapshot, which stops the read when it fails (ledger.require_charged_query).

    The COMMIT goes after a sync of its own: when anything before it failed (the check, the charge, the guard, the
    SQL), the server skipped the rest up to the sync, and this COMMIT then ends the failed transaction (PostgreSQL
    rolls it back), in the same round trip: no ROLLBACK round trip after a refusal."""
    count = len(parameters.values)
    types = [*parameters.types[:count], *[0] * (count - len(parameters.types))]
    version_sql, version_values = ledger.data_version_query(plan.tables)

    def run(pgconn: pq.abc.PGconn) -> None:
        pgconn.send_query_params(plan.sql.encode(), list(parameters.values), types, list(parameters.formats),
                                 pq.Format.TEXT)

    return [_command(_BEGIN_SNAPSHOT.encode()), *([_command(*guard)] if guard is not None else []),
            _command(f"set local statement_timeout = {int(timeout_ms)}".encode()),
            *_session_commands(session), _command(version_sql, version_values), run, _sync, _command(b"commit")]


def _read_outcome(conn: psycopg.AsyncConnection[Any], results: list[pq.abc.PGresult],
                  ) -> tuple[str | None, list[int], list[tuple[Any, ...]]] | psycopg.Error:
    """The data version, column types and rows the read commands returned; or their error (rolled back by their
    last COMMIT)."""
    failed = _error(conn, results)
    if failed is not None:
        return failed
    version = _row(conn, results[-3])["version"]
    rows = results[-2]
    loader = Transformer(conn)
    loader.set_pgresult(rows)
    return version, [rows.ftype(i) for i in range(rows.nfields)], loader.load_rows(0, rows.ntuples, tuple)


def _error(conn: psycopg.AsyncConnection[Any], results: list[pq.abc.PGresult]) -> psycopg.Error | None:
    """The first error among a pipeline's results (the server skipped what followed it)."""
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            return psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return None


def _row(conn: psycopg.AsyncConnection[Any], result: pq.abc.PGresult) -> dict[str, Any]:
    """The first row of a result, by column name."""
    loader = Transformer(conn)
    loader.set_pgresult(result)
    names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
    return dict(zip(names, loader.load_row(0, tuple) or (), strict=True))


async def _rollback(conn: psycopg.AsyncConnection[Any]) -> None:
    """End a transaction a pipeline's error left open; if that fails, the pool drops the connection (not idle)."""
    if conn.info.transaction_status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
        with contextlib.suppress(psycopg.Error):
            await conn.execute("rollback")


async def _pipelined(conn: psycopg.AsyncConnection[Any], commands: list[Command]) -> list[pq.abc.PGresult]:
    """``commands`` sent in pipeline mode, in one round trip: each one's result, in order (after an error the server
    skipped the rest until the next :func:`_sync`, or the end: PIPELINE_ABORTED)."""
    pgconn = conn.pgconn
    async with conn.lock:
        pgconn.enter_pipeline_mode()
        for command in commands:
            command(pgconn)
        pgconn.pipeline_sync()
        results = await conn.wait(_pipeline_results(pgconn, 1 + commands.count(_sync)))
        pgconn.exit_pipeline_mode()
    return results


def _pipeline_results(pgconn: pq.abc.PGconn, syncs: int) -> Generator[Any, Any, list[pq.abc.PGresult]]:
    """Flush what was sent, then read one result per command up to the pipeline's last of ``syncs`` syncs."""
    yield from generators.send(pgconn)
    results: list[pq.abc.PGresult] = []
    while True:
        result = yield from generators.fetch(pgconn)
        if result is None:  # the end of one command's results
            continue
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            syncs -= 1
            if not syncs:
                return results
            continue
        results.append(result)


async def _measured_on(conn: psycopg.AsyncConnection[Any], plan: DPPlan, parameters: Parameters,
                       stop: Stop, session: Measuring) -> tuple[str | None, list[int], list[tuple[Any, ...]]]:
    async with stop.running(conn), _snapshot(conn, plan.tables, stop.left_ms(), session) as version:
        stop.check()  # no await from here until the SQL is sent: a cancel now reaches it
        types, rows = await _run(conn, plan.sql, parameters)
    return version, types, rows


async def _run(conn: psycopg.AsyncConnection[Any], sql: str, parameters: Parameters, session: Measuring = (),
               ) -> tuple[list[int], list[tuple[Any, ...]]]:
    """Column types and rows of ``sql``, the client's $n values bound as it sent them (text or binary), run under
    the client's ``session`` settings."""
    result = await _executed(conn, sql, parameters, session)
    loader = Transformer(conn)
    loader.set_pgresult(result)
    return [result.ftype(i) for i in range(result.nfields)], loader.load_rows(0, result.ntuples, tuple)


async def _executed(conn: psycopg.AsyncConnection[Any], sql: str, parameters: Parameters, session: Measuring,
                    ) -> pq.abc.PGresult:
    """The result of ``sql`` with ``parameters`` bound; with ``session`` settings, in a read-only transaction of
    its own that sets them first (one round trip, pipelined), so that the pooled connection keeps its own."""
    count = len(parameters.values)
    types = [*parameters.types[:count], *[0] * (count - len(parameters.types))]

    def run(pgconn: pq.abc.PGconn) -> None:
        pgconn.send_query_params(sql.encode(), list(parameters.values), types, list(parameters.formats),
                                 pq.Format.TEXT)

    if not session:
        pgconn = conn.pgconn
        async with conn.lock:
            run(pgconn)
            return _last(await conn.wait(generators.execute(pgconn)), pq.ExecStatus.TUPLES_OK)
    results = await _pipelined(conn, [_command(b"begin read only"), *_session_commands(session), run,
                                      _command(b"commit")])
    failed = _error(conn, results)
    if failed is not None:
        await _rollback(conn)
        raise failed
    return results[-2]


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
    prepared, described = await _pipelined(conn, [lambda pgconn: pgconn.send_prepare(b"", sql.encode(),
                                                                                    list(declared)),
                                                   lambda pgconn: pgconn.send_describe_prepared(b"")])
    _last([prepared], pq.ExecStatus.COMMAND_OK)  # (if it failed, the describe was skipped)
    return _last([described], pq.ExecStatus.COMMAND_OK)


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


async def _result(conn: psycopg.AsyncConnection[Any], plan: DPPlan, measurement: Measurement, headline: str,
                  asking: _Asking, keys: tuple[KeyField, ...]) -> Result:
    """The statement's answer from a noisy measurement, fresh or cached (its columns, ``keys`` described as
    PostgreSQL describes them, HAVING, the post statement over the noisy values when the query has post-aggregate
    expressions, run under the client's ``session``, ORDER BY, LIMIT), with a notice: ``headline`` and the plan's
    noise lines. Post-processing only: it costs nothing."""
    types = measurement.sql_types(plan)  # this statement's order of the statistics
    released = released_rows(plan, measurement)
    post_types, computed = None, None
    if plan.post is not None:
        array_types = _array_types(plan, types)
        arrays = post_arrays(plan, released)
        values = tuple(_array_text(values, element) for values, element in
                       zip(arrays, (_INT8, *(plan.value_types(types)[i] for i in plan.post.values)), strict=True))
        post_types, computed = await _run(conn, plan.post.sql, Parameters(array_types, (0,) * len(values), values),
                                          asking.session)
    columns = _output_columns(plan, types, post_types, keys)
    noisy_rows, _ = finish(plan, released, computed)
    return Result(columns, tuple(tuple(text_value(value, column.type_oid)
                                       for value, column in zip(row, columns, strict=True))
                                 for row in noisy_rows),
                  notices=notice(headline, "\n".join(plan.notices()) or None))


_INT8, _INT8_ARRAY = 20, 1016  # bigint and bigint[]


def _array_types(plan: DPPlan, sql_types: list[int]) -> tuple[int, ...]:
    """The post statement's parameter types: arrays of bigint (row numbers) and of each value column's type (a
    built-in type: aggregates are numbers, GROUP BY expressions of ordinary columns text, dates, numbers ...)."""
    assert plan.post is not None
    value_types = plan.value_types(sql_types)
    types = [_INT8_ARRAY]
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


# What PostgreSQL describes of a GROUP BY key beyond its name: its type OID, the table OID and column number it
# reads (0, 0: not a plain column) and its type's modifier.
KeyField = tuple[int, int, int, int]


async def _key_fields(conn: psycopg.AsyncConnection[Any], plan: DPPlan,
                      declared: tuple[int, ...]) -> tuple[KeyField, ...]:
    """PostgreSQL's description of the plan's keys as the client's FROM and WHERE read them (prepared, never
    executed; none without keys, or when it cannot be prepared alone: a parameter only the aggregates read, and
    the client left untyped, has no type there)."""
    try:
        result = await _prepared(conn, plan.keys_sql, declared)
    except Refused:
        return ()
    return tuple((result.ftype(i), result.ftable(i), result.ftablecol(i), result.fmod(i))
                 for i in range(result.nfields))


def _output_columns(plan: DPPlan, sql_types: list[int], post_types: list[int] | None = None,
                    keys: tuple[KeyField, ...] = ()) -> tuple[Column, ...]:
    types = plan.value_types(sql_types, post_types)[:len(plan.columns)]
    return tuple(_column(column, oid, keys) for column, oid in zip(plan.columns, types, strict=True))


def _column(column: OutputColumn, oid: int, keys: tuple[KeyField, ...]) -> Column:
    """An answer column: a key of the answer's type keeps what PostgreSQL describes of it (its table, column
    number and modifier); any other column reads no table, as an aggregate in PostgreSQL."""
    if column.kind != "key" or column.key is None or column.key >= len(keys) or keys[column.key][0] != oid:
        return Column(column.name, oid)
    _, table, attnum, typmod = keys[column.key]
    return Column(column.name, oid, table, attnum, typmod=typmod)


# What the policy's per-query values are (docs/policy.md): ε sets the noise, δ is what partition selection may add.
_SETTING_NAMES = {"epsilon": "accuracy epsilon (accuracy_epsilon)", "delta": "per-query delta (delta_per_query)"}


def _accounting(budget: ledger.Remaining) -> str:
    """How a budget counts, for SHOW anonproxy.budget: under zCDP with the ρ spent and what is left of it."""
    text = "zCDP accounting" if budget.accounting == "zcdp" else "basic accounting"
    if budget.accounting == "zcdp":
        text += f": rho {amounts.spent(budget.rho_spent)} spent"
    if budget.rho is not None:
        text += f"{',' if budget.accounting == 'zcdp' else ':'} rho {amounts.left(budget.rho)} left"
    return text


def _show(setting: str, values: list[str]) -> Result:
    return Result((Column(f"anonproxy.{setting}", 25),), tuple((value.encode(),) for value in values), "SHOW")
