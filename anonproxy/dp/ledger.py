"""The privacy-budget ledger (sql/0003_ledger.sql, docs/ledger.md) as the proxy uses it.

Every function takes a psycopg ``AsyncConnection`` logged in as the service
role (or the schema's owner) and runs one SQL function of the ledger; the SQL
holds all the logic — validation, locking, sums, messages — so this module
only moves values and maps the two refusals to exceptions:

- SQLSTATE 53400 from ``anonproxy.charge`` → :class:`BudgetExhausted`
- SQLSTATE 42501 about ``anonproxy.budgets`` → :class:`NoBudget` (no budget
  configured: fail closed)

Any other database error propagates as the ``psycopg.Error`` it is.

:func:`charge` and :func:`store_answer` write: each runs in a transaction
of its own and returns only after its COMMIT has returned, in one round trip:
``charge`` sends BEGIN (READ COMMITTED, as ``anonproxy.charge`` requires),
the charge and COMMIT pipelined (psycopg's pipeline mode: the server runs
them in order and skips the rest after an error, which is rolled back), and
``store_answer`` is one statement, its own transaction in autocommit. The proxy charges before it reads the
data, so a charge returned is a charge kept, whatever happens to the query.
They refuse a connection that is inside a transaction: its commit would not
be theirs to make. A caller that sends the charge in a pipeline of its own (the
proxy sends it with the measurement's read, anonproxy.proxy.noisy) takes it
from :func:`charge_statement` and maps its failure with :func:`refusal` and
:func:`retryable`, as :func:`charge` does. The answer cache's commit does not
wait for the WAL flush (sql/0032): a lost answer costs a repeat a new charge.
The reading functions are one statement
each, with no transaction or savepoint of their own: in autocommit the
statement is its own snapshot, inside the caller's transaction it reads that
transaction's — so :func:`data_version` can be read in the snapshot of the query.
:func:`lookup_answer` is the proxy's one round trip for a question it has seen.

Amounts are :class:`decimal.Decimal`, as PostgreSQL's numeric: exact. Pass
Decimals, ints or strings; a float is converted through its shortest repr
(``0.1`` → ``Decimal("0.1")``).

A charge carries four amounts (sql/0019_zcdp_ledger.sql): the answer's (ε, δ)
for basic composition and its (ρ, δ_add) for zCDP accounting; each budget is
checked by its own accounting (:attr:`Remaining.accounting`). What a charge
moved the role's "ε spent" by, in that accounting (sql/0025_one_currency.sql),
is :attr:`Remaining.epsilon_spent_delta` of what :func:`charge` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from anonproxy.policy.zcdp import Accounting

EXHAUSTED_SQLSTATE = "53400"  # configuration_limit_exceeded
NO_BUDGET_SQLSTATE = "42501"  # insufficient_privilege, with table_name = 'budgets'

Amount = Decimal | int | str | float

# ``select *`` of the composite anonproxy.budget_remaining; the interval as
# PostgreSQL prints it, since a month is not a fixed timedelta.
_COLUMNS = (
    "role_name, domain, epsilon, delta, role_epsilon, role_delta, shared_epsilon, shared_delta, "
    "epsilon_budget, delta_budget, refresh_period::text as refresh_period, epsilon_per_query, delta_per_query, "
    "accounting, epsilon_spent, rho_spent, rho_left, shared_accounting, shared_rho_left, epsilon_spent_delta"
)
_CHARGE_SQL = (f"select {_COLUMNS} from anonproxy.charge(%s, %s, %s::numeric, %s::numeric, %s::numeric, %s::numeric, "
               "%s)")
_CHARGE_PURE_SQL = f"select {_COLUMNS} from anonproxy.charge(%s, %s, %s::numeric, %s::numeric, %s)"
_CHARGE_PARAMETERS_SQL = (f"select {_COLUMNS} from anonproxy.charge($1, $2, $3::numeric, $4::numeric, $5::numeric, "
                          "$6::numeric, $7)").encode()
_REMAINING_SQL = f"select {_COLUMNS} from anonproxy.remaining_budget(%s, %s)"
_REMAINING_ALL_SQL = f"select {_COLUMNS} from anonproxy.remaining_budgets(%s)"
_STORE_SQL = "select anonproxy.store_answer(%s, %s, %s, %s) as answer"
_DATA_VERSION_SQL = "select anonproxy.data_version(%s::text[]) as version"
_DATA_VERSION_PARAMETERS_SQL = b"select anonproxy.data_version($1::text[]) as version"
_UNLESS_ANSWERED_SQL = ("select charged, c.epsilon_per_query as per_query_epsilon, c.delta_per_query as "
                        "per_query_delta, per_query_accounting, data_version, answer, "
                        + ", ".join(f"(remaining).{column}" for column in _COLUMNS.split(", ")) +
                        " from anonproxy.charge_unless_answered($1, $2, $3::text[], $4, $5::numeric, $6::numeric, "
                        "$7, $8::numeric, $9::numeric, $10::numeric, $11::numeric, $12, $13::integer) c").encode()
_REQUIRE_CHARGED_SQL = b"select anonproxy.require_charged($1)"
_LOOKUP_SQL = ("select epsilon_per_query, delta_per_query, accounting, data_version, answer "
               "from anonproxy.lookup_answer(%s, %s, %s::text[], %s)")
BEGIN_CHARGE = "begin isolation level read committed"
_READ_COMMITTED = "set transaction isolation level read committed"

# Charges wait for each other's row locks; a deadlock or serialization failure
# can only come from a concurrent edit of the budgets, and is worth a retry.
RETRIES = 3


@dataclass(frozen=True)
class Remaining:
    """What a role may still spend on a domain (a row of ``anonproxy.budget_remaining``)."""

    role: str
    domain: str
    epsilon: Decimal  # the lesser of the role's own remainder and the shared cap's
    delta: Decimal
    role_epsilon: Decimal
    role_delta: Decimal
    shared_epsilon: Decimal | None  # None: the domain has no shared cap
    shared_delta: Decimal | None
    epsilon_budget: Decimal
    delta_budget: Decimal
    refresh_period: str | None  # as PostgreSQL prints it, e.g. "1 day"; None: spent budget never comes back
    epsilon_per_query: Decimal | None  # the default cost of one query; None: the proxy's default
    delta_per_query: Decimal | None
    accounting: Accounting  # the role's budget's: basic or zcdp
    epsilon_spent: Decimal  # of the role's budget, under its accounting (zcdp: converted at the δ left)
    rho_spent: Decimal  # Σρ of the role's charges that count
    rho_left: Decimal | None  # what the role's budget still allows in ρ; None under basic
    shared_accounting: Accounting | None  # the shared cap's; None: no cap
    shared_rho_left: Decimal | None  # None unless the cap is zcdp
    epsilon_spent_delta: Decimal | None = None  # after a charge: what it moved epsilon_spent by (sql/0025); else None

    @property
    def rho(self) -> Decimal | None:
        """The ρ still allowed by the zcdp budgets among the role's and the cap's; None when neither is zcdp."""
        left = [value for value in (self.rho_left, self.shared_rho_left) if value is not None]
        return min(left) if left else None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Remaining:
        return cls(
            role=row["role_name"], domain=row["domain"], epsilon=row["epsilon"], delta=row["delta"],
            role_epsilon=row["role_epsilon"], role_delta=row["role_delta"],
            shared_epsilon=row["shared_epsilon"], shared_delta=row["shared_delta"],
            epsilon_budget=row["epsilon_budget"], delta_budget=row["delta_budget"],
            refresh_period=row["refresh_period"],
            epsilon_per_query=row["epsilon_per_query"], delta_per_query=row["delta_per_query"],
            accounting=row["accounting"], epsilon_spent=row["epsilon_spent"], rho_spent=row["rho_spent"],
            rho_left=row["rho_left"], shared_accounting=row["shared_accounting"],
            shared_rho_left=row["shared_rho_left"], epsilon_spent_delta=row["epsilon_spent_delta"],
        )


class LedgerError(RuntimeError):
    """The ledger was used in a way that cannot keep its guarantees."""


class BudgetError(Exception):
    """The ledger refused a charge; ``sqlstate``, ``message``, ``detail``, ``hint`` are PostgreSQL's, to relay."""

    def __init__(self, message: str, *, sqlstate: str, detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint


class BudgetExhausted(BudgetError):
    """The charge would exceed the role's budget or the domain's shared cap; nothing was charged."""

    def __init__(self, remaining: Remaining, message: str, *, sqlstate: str = EXHAUSTED_SQLSTATE,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, sqlstate=sqlstate, detail=detail, hint=hint)
        self.remaining = remaining


class NoBudget(BudgetError):
    """The role has no budget on the domain, so it may not spend any."""


@dataclass(frozen=True)
class Lookup:
    """What :func:`lookup_answer` read, in one snapshot."""

    epsilon_per_query: Decimal | None  # the role's per-query cost on the domain; None: the proxy's default
    delta_per_query: Decimal | None
    accounting: Accounting  # of the role's budget there: the plan's mechanisms follow it
    data_version: str | None  # None: unknown, nothing is cached
    answer: bytes | None  # the answer already paid for, on that version; None: none
    # Not read: the cost read last, no answer; the charge looks the question up itself (charge_unless_answered)
    folded: bool = False


async def charge(conn: psycopg.AsyncConnection[Any], role: str, domain: str, epsilon: Amount, delta: Amount,
                 fingerprint: str, *, rho: Amount | None = None, delta_add: Amount | None = None) -> Remaining:
    """Charge an answer to ``role``'s budget on ``domain``; committed when this returns.

    ``(epsilon, delta)``: its guarantee for basic composition; ``(rho, delta_add)``: for zCDP accounting (it is
    ``delta_add``-approximately ``rho``-zCDP). Give both or neither; without them the database takes
    ``rho = epsilon²/2`` (exactly), ``delta_add = delta``: true of an answer whose ε is pure DP and whose δ is
    partition selection's.

    Raises :class:`BudgetExhausted` (with what remains) or :class:`NoBudget`.
    """
    _require_idle(conn, "charge")
    sql = _CHARGE_PURE_SQL
    params: tuple[object, ...] = (role, domain, _decimal(epsilon), _decimal(delta), fingerprint)
    if rho is not None and delta_add is not None:
        sql = _CHARGE_SQL
        params = (role, domain, _decimal(epsilon), _decimal(delta), _decimal(rho), _decimal(delta_add), fingerprint)
    elif rho is not None or delta_add is not None:
        raise TypeError("charge() takes both rho and delta_add, or neither")
    for attempt in range(RETRIES):
        try:
            return Remaining.from_row(await _committed(conn, sql, params))
        except psycopg.Error as exc:
            if retryable(exc) and attempt < RETRIES - 1:
                continue
            raise await refusal(conn, exc, role, domain) or exc
    raise AssertionError("unreachable")


def charge_statement(role: str, domain: str, epsilon: Amount, delta: Amount, fingerprint: str, *, rho: Amount,
                     delta_add: Amount) -> tuple[bytes, list[bytes | None]]:
    """The charge as :func:`charge` makes it, for a caller that sends it in a pipeline of its own: the statement and
    its values in text format. It must run between :data:`BEGIN_CHARGE` and COMMIT, with nothing else in that
    transaction; its row is a :class:`Remaining` (``Remaining.from_row``), its failure is :func:`refusal`'s to
    map, and :func:`retryable` says when to send it again."""
    values = (role, domain, _decimal(epsilon), _decimal(delta), _decimal(rho), _decimal(delta_add), fingerprint)
    return _CHARGE_PARAMETERS_SQL, [str(value).encode() for value in values]


def charge_unless_answered_statement(role: str, domain: str, tables: Sequence[str], key: str, priced: Lookup,
                                     epsilon: Amount, delta: Amount, *, rho: Amount, delta_add: Amount,
                                     time_left_ms: int = 0) -> tuple[bytes, list[bytes | None]]:
    """As :func:`charge_statement`, the charge made only if the ledger holds no answer under ``key`` on the current
    data version of ``tables`` and reads the per-query cost and accounting of ``priced`` (sql/0041), and only if,
    once it looked, the question's ``time_left_ms`` (0: no limit) has not passed (else 57014). Its row is
    :func:`charged_or_looked`'s to read; the read sent after it in the same round trip starts with
    :func:`require_charged_query`."""
    values: list[bytes | None] = [role.encode(), domain.encode(), _text_array(tables), key.encode()]
    values += [None if value is None else str(value).encode()
               for value in (priced.epsilon_per_query, priced.delta_per_query, priced.accounting)]
    values += [str(_decimal(value)).encode() for value in (epsilon, delta, rho, delta_add)]
    values += [key.encode(), str(int(time_left_ms)).encode()]
    return _UNLESS_ANSWERED_SQL, values


def charged_or_looked(row: dict[str, Any]) -> Remaining | Lookup:
    """What charge_unless_answered returned: the budget left after the charge, or, not charged, what its lookup
    read (an answer already paid for, or another per-query cost)."""
    if row["charged"]:
        return Remaining.from_row(row)
    answer = row["answer"]
    return Lookup(row["per_query_epsilon"], row["per_query_delta"], row["per_query_accounting"], row["data_version"],
                  None if answer is None else bytes(answer))


def require_charged_query(key: str) -> tuple[bytes, list[bytes | None]]:
    """The statement that fails, so that the server skips what follows it, unless the charge committed just before
    on the connection was made for ``key`` by charge_unless_answered."""
    return _REQUIRE_CHARGED_SQL, [key.encode()]


def retryable(exc: psycopg.Error) -> bool:
    """A charge that failed this way charged nothing and may be sent again: a deadlock or serialization failure,
    which only a concurrent edit of the budgets causes."""
    return isinstance(exc, (errors.DeadlockDetected, errors.SerializationFailure))


async def refusal(conn: psycopg.AsyncConnection[Any], exc: psycopg.Error, role: str, domain: str,
                  ) -> BudgetError | None:
    """The ledger's refusal a charge's error is: :class:`BudgetExhausted` (with what remains, read on ``conn``,
    which must be idle) or :class:`NoBudget`; None for any other error."""
    if isinstance(exc, errors.ConfigurationLimitExceeded):
        diag = exc.diag
        exhausted = BudgetExhausted(await remaining(conn, role, domain), diag.message_primary or str(exc),
                                    detail=diag.message_detail, hint=diag.message_hint)
        exhausted.__cause__ = exc
        return exhausted
    if isinstance(exc, errors.InsufficientPrivilege):
        return _no_budget(exc)
    return None


async def _committed(conn: psycopg.AsyncConnection[Any], sql: str, params: tuple[Any, ...]) -> dict[str, Any]:
    """The row of ``sql`` run in a READ COMMITTED transaction of its own, committed when this returns: in
    autocommit (the proxy's connections), BEGIN, ``sql`` and COMMIT in one round trip. After an error the server
    ran nothing more; the transaction is rolled back before the error propagates."""
    if not conn.autocommit:  # psycopg opens the transaction itself
        async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(_READ_COMMITTED)
            row = await (await cur.execute(sql, params)).fetchone()
        assert row is not None
        return row
    try:
        async with conn.cursor(row_factory=dict_row) as cur:
            async with conn.pipeline():
                await conn.execute(BEGIN_CHARGE)
                await cur.execute(sql, params)
                await conn.execute("commit")
            row = await cur.fetchone()  # (the pipeline ended: the COMMIT has returned, the charge is durable)
    except psycopg.Error:
        if conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            with contextlib.suppress(psycopg.Error):  # else the connection is not idle: its pool drops it
                await conn.execute("rollback")
        raise
    assert row is not None
    return row


async def remaining(conn: psycopg.AsyncConnection[Any], role: str, domain: str) -> Remaining:
    """What ``role`` may still spend on ``domain``; :class:`NoBudget` if it has no budget there."""
    try:
        async with conn.cursor(row_factory=dict_row) as cur:
            row = await (await cur.execute(_REMAINING_SQL, (role, domain))).fetchone()
    except errors.InsufficientPrivilege as exc:
        raise _no_budget(exc) or exc
    assert row is not None
    return Remaining.from_row(row)


async def remaining_all(conn: psycopg.AsyncConnection[Any], role: str) -> list[Remaining]:
    """Every budget of ``role``, by domain (for ``SHOW anonproxy.budget``)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        rows = await (await cur.execute(_REMAINING_ALL_SQL, (role,))).fetchall()
    return [Remaining.from_row(row) for row in rows]


def data_version_statement(tables: Sequence[str]) -> tuple[str, tuple[list[str]]]:
    """The statement :func:`data_version` runs (its one column: the version), to send with others in one round
    trip."""
    return _DATA_VERSION_SQL, (list(tables),)


def data_version_query(tables: Sequence[str]) -> tuple[bytes, list[bytes | None]]:
    """The statement :func:`data_version` runs, with its one value in text format: for a caller that sends it in a
    pipeline of its own (its one column: the version)."""
    return _DATA_VERSION_PARAMETERS_SQL, [_text_array(tables)]


def _text_array(texts: Sequence[str]) -> bytes:
    """A text[] value in text format."""
    elements = ",".join('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"' for text in texts)
    return ("{" + elements + "}").encode()


async def data_version(conn: psycopg.AsyncConnection[Any], tables: Sequence[str]) -> str | None:
    """The version of the data of ``tables`` (names as in the policy); None when it cannot be known.

    Read it in the snapshot the query runs in, so that the answer cached under
    it was computed from that version.
    """
    async with conn.cursor(row_factory=dict_row) as cur:
        row = await (await cur.execute(_DATA_VERSION_SQL, (list(tables),))).fetchone()
    assert row is not None
    version: str | None = row["version"]
    return version


async def lookup_answer(conn: psycopg.AsyncConnection[Any], role: str, domain: str, tables: Sequence[str],
                        fingerprint: str | None) -> Lookup:
    """In one statement: ``role``'s per-query cost on ``domain``, the data version of ``tables`` and the answer
    cached for ``fingerprint`` on it (None: do not look). :class:`NoBudget` if the role has no budget there."""
    try:
        async with conn.cursor(row_factory=dict_row) as cur:
            row = await (await cur.execute(_LOOKUP_SQL, (role, domain, list(tables), fingerprint))).fetchone()
    except errors.InsufficientPrivilege as exc:
        raise _no_budget(exc) or exc
    assert row is not None
    answer = row["answer"]
    return Lookup(row["epsilon_per_query"], row["delta_per_query"], row["accounting"], row["data_version"],
                  None if answer is None else bytes(answer))


async def store_answer(conn: psycopg.AsyncConnection[Any], role: str, fingerprint: str, data_version: str | None,
                       answer: bytes) -> bytes:
    """Cache ``answer`` unless one is cached already; return the cached one. Committed when this returns."""
    _require_idle(conn, "store_answer")
    # In autocommit the statement is its own transaction, committed when it returns: one round trip.
    async with _own_transaction(conn), conn.cursor(row_factory=dict_row) as cur:
        row = await (await cur.execute(_STORE_SQL, (role, fingerprint, data_version, answer))).fetchone()
    assert row is not None
    return bytes(row["answer"])


def _own_transaction(conn: psycopg.AsyncConnection[Any]) -> AbstractAsyncContextManager[Any]:
    """A transaction block of psycopg's where the connection is not in autocommit (else the statement is one)."""
    return contextlib.nullcontext() if conn.autocommit else conn.transaction()


def _no_budget(exc: psycopg.Error) -> NoBudget | None:
    """The NoBudget for a refusal of anonproxy.no_budget(); None for any other 42501."""
    diag = exc.diag
    if diag.schema_name == "anonproxy" and diag.table_name == "budgets":
        no_budget = NoBudget(diag.message_primary or str(exc), sqlstate=NO_BUDGET_SQLSTATE,
                             detail=diag.message_detail, hint=diag.message_hint)
        no_budget.__cause__ = exc
        return no_budget
    return None


def _require_idle(conn: psycopg.AsyncConnection[Any], what: str) -> None:
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise LedgerError(f"{what}() commits on its own: pass a connection that is not inside a transaction")


def _decimal(value: Amount) -> Decimal:
    """Exact value of an amount; validation is the database's (NaN and negatives are refused there)."""
    if isinstance(value, bool):
        raise TypeError("an amount of privacy budget is a number, not a bool")
    if isinstance(value, float):
        return Decimal(repr(value))
    return Decimal(value)
