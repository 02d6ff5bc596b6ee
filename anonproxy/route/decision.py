"""What the proxy does with a statement: the possible decisions.

``decide`` (see :mod:`anonproxy.route.decide`) returns exactly one of these
values for the whole text of a Query or Parse message. They are plain frozen
dataclasses, so they can be cached and compared.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from decimal import Decimal

from anonproxy.dp.plan import Packed
from anonproxy.plan.bind_values import Slot
from anonproxy.plan.refusals import Reject


@dataclass(frozen=True)
class Pass:
    """Forward the client's original bytes, unchanged, to its own upstream connection. ``resets_session``: a
    RESET ALL or DISCARD ALL; once PostgreSQL has run it, the settings the proxy keeps for the session
    (anonproxy.epsilon, anonproxy.delta) go back to their login values as well. ``deallocates``: a DEALLOCATE,
    whose prepared statements the proxy forgets too. ``transaction``: a transaction statement that ends portals
    (the proxy's kept ones follow PostgreSQL's)."""

    resets_session: bool = False
    deallocates: Deallocate | None = None
    transaction: TransactionControl | None = None


class Control(enum.Enum):
    END = "end"  # COMMIT, END, ROLLBACK, ABORT: every portal of the transaction ends
    SAVEPOINT = "savepoint"
    RELEASE = "release"  # the portals opened since the savepoint now belong to the enclosing level
    ROLLBACK_TO = "rollback to"  # the portals opened since the savepoint end


@dataclass(frozen=True)
class TransactionControl:
    """A transaction statement, with the savepoint it names (folded as PostgreSQL folds it; "" for END)."""

    control: Control
    savepoint: str = ""


@dataclass(frozen=True)
class Deallocate:
    """What a DEALLOCATE names: one prepared statement (its name as PostgreSQL folds it), or all (None)."""

    name: str | None


@dataclass(frozen=True)
class Relayed:
    """Run ``sql``, rewritten from the client's statement, on the client's own connection (under its login).

    For statements that read no protected table but ask about privileges (see
    :mod:`anonproxy.route.probes`); the client's parameter types and result formats go with it.
    """

    sql: str


@dataclass(frozen=True)
class Rewrite:
    """Run ``sql`` on the proxy's privileged service connection instead of the client's text.

    ``reported``, when set, is the same answer wrapped so that it also reports what suppression withheld (an INFO
    that the gate hands to the hook of :mod:`anonproxy.route.reports`, which turns it into a NOTICE): the proxy
    runs it in place of ``sql``."""

    sql: str
    reported: str | None = None
    relations: tuple[str, ...] = ()  # the tables it reads, schema.table (for the audit trail)
    # A constant PostgreSQL reads with the clock ('now', 'today'...), once, when the statement is parsed: the
    # statement is then not kept prepared on the service connection (anonproxy.proxy.service_statements).
    reads_clock: bool = False
    # A column discovery (anonproxy.route.discovery): a statement that returns no row, answered with its columns.
    discovery: bool = False

    @property
    def runs(self) -> str:
        """The statement the proxy sends to the service connection."""
        return self.reported or self.sql


@dataclass(frozen=True)
class Intercept:
    """``SHOW anonproxy.<setting>``: the proxy answers itself (``setting`` is lower case, without the prefix)."""

    setting: str


@dataclass(frozen=True)
class Noisy:
    """Mode ``dp``: answer this aggregate query with differential privacy (priced and charged by the proxy).

    ``plan``: what the statement measures (anonproxy.dp.plan.measure, from the tree decide() parsed), or why dp
    refuses it, which the proxy reports when it answers, packed; the proxy prices it at the role's per-query cost.
    None: measured from ``sql`` when answered. Not compared: the text is the decision."""

    sql: str
    plan: Packed | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SessionSetting:
    """SET / RESET anonproxy.epsilon or anonproxy.delta: the session's per-query cost, at most the policy's."""

    setting: str  # "epsilon" or "delta"
    value: Decimal | None  # None: RESET, back to the policy's


@dataclass(frozen=True)
class ExplainDP:
    """EXPLAIN (ANONPROXY) <dp query>: its cost and noise, without running or charging it (``plan`` as Noisy's)."""

    sql: str
    plan: Packed | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ExplainSuppress:
    """EXPLAIN (ANONPROXY) <suppress query>, or of a column discovery in either mode: the rows describing its plan,
    made without running anything."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class DeclareCursor:
    """``DECLARE name ... CURSOR ... FOR query``: the query decided like a plain statement (Pass, Rewrite or Noisy).

    A passed query's DECLARE goes to the client's own connection; for a rewritten or noisy one the proxy keeps the
    answer's rows and serves FETCH / MOVE / CLOSE of that cursor itself (see anonproxy.proxy.cursors).
    """

    name: str  # as PostgreSQL folds it
    query: Pass | Rewrite | Noisy
    binary: bool = False
    scroll: bool = False  # SCROLL given (no SCROLL: the proxy's cursors scan forward only)
    hold: bool = False  # WITH HOLD


@dataclass(frozen=True)
class FetchCursor:
    """FETCH or MOVE, normalised as PostgreSQL does: a direction and a count (None: ALL)."""

    name: str
    direction: str  # "forward", "backward", "absolute" or "relative"
    count: int | None = 1
    move: bool = False


@dataclass(frozen=True)
class CloseCursor:
    name: str | None  # None: CLOSE ALL


@dataclass(frozen=True)
class AtBind:
    """A statement with ``$n`` parameters where the plan needs a constant (anonproxy.plan.bind_values): decided
    again at each Bind, with their values written as constants (the text of that value class, decided like any
    other). ``described``: its decision with a representative value in each slot, which Parse and a Describe
    before the first Bind answer (a refusal there refuses the statement at Parse)."""

    sql: str
    slots: tuple[Slot, ...]
    described: Rewrite | Noisy
    representative: str  # the text ``described`` decides


CursorStatement = DeclareCursor | FetchCursor | CloseCursor


@dataclass(frozen=True)
class Script:
    """A message of several statements with a cursor statement among them: run one by one, each with its decision
    (only passed statements and cursor statements; the original text of each)."""

    parts: tuple[tuple[str, Pass | DeclareCursor | FetchCursor | CloseCursor], ...]


Decision = (Pass | Relayed | Rewrite | Intercept | Noisy | SessionSetting | ExplainDP | ExplainSuppress | Reject
            | DeclareCursor | FetchCursor | CloseCursor | Script | AtBind)
