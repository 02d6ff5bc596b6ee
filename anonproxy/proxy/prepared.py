"""The client's prepared statements and portals as the gate keeps them: where each belongs (its Owner), what it
was decided on (text, decision, policy version), and what the gate needs to answer those it owns itself (SHOW
anonproxy.* settings, statements the proxy answers, cursor statements), and the rewritten portals whose Bind it
remembers or whose answer it keeps (proxy_portals.KeptPortal).

Memory: the named prepared statements kept here are capped (``limits``, limits.py: their number and bytes);
:meth:`Prepared.no_room` says why a new one cannot be kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan.refusals import Reject
from ..route.decision import Control, CursorStatement, Decision, TransactionControl
from ..wire import protocol as pg
from .gate_routes import Decided, Owner, statement_size
from .limits import MemoryLimits, size_text
from .proxy_portals import KeptPortal, ProxyPortal


@dataclass
class Prepared:
    texts: dict[bytes, Decided] = field(default_factory=dict)  # prepared statements, by name
    bound: dict[bytes, Decided] = field(default_factory=dict)  # portals, by name
    # Statements decided at each Bind (route.decision.AtBind), by name; ``texts`` holds the decision of the value
    # class last bound (or the representative one), which is what is prepared where it belongs.
    templates: dict[bytes, Decided] = field(default_factory=dict)
    statements: dict[bytes, Owner] = field(default_factory=dict)
    portals: dict[bytes, Owner] = field(default_factory=dict)
    # Settings shown by the statements and portals the gate owns (SHOW anonproxy.*).
    statement_settings: dict[bytes, str] = field(default_factory=dict)
    portal_settings: dict[bytes, str] = field(default_factory=dict)
    # Statements (with their parameter types) and portals the proxy answers after asynchronous work (owner PROXY).
    proxy_statements: dict[bytes, tuple[Decision, tuple[int, ...]]] = field(default_factory=dict)
    proxy_portals: dict[bytes, ProxyPortal] = field(default_factory=dict)
    # Cursor statements the gate answers (the proxy holds their cursors), and their portals with their Bind.
    cursor_statements: dict[bytes, CursorStatement] = field(default_factory=dict)
    cursor_portals: dict[bytes, tuple[CursorStatement, pg.Bind]] = field(default_factory=dict)
    # Rewritten portals (on the service connection): the client's Bind after the names, to run them again where
    # the service side's portal is gone; those read with a row limit or after a Sync, whose answers the gate keeps
    # (proxy_portals.KeptPortal).
    service_binds: dict[bytes, bytes] = field(default_factory=dict)
    kept_portals: dict[bytes, KeptPortal] = field(default_factory=dict)
    # Rewritten portals executed without a row limit in the batch of their Bind: read to their end there, never run
    # again (a later Execute gets no row, as PostgreSQL's portal at its end).
    read_to_end: set[bytes] = field(default_factory=set)
    # The client's savepoints, outermost first, as its transaction statements name them; and for each rewritten
    # portal, how many of them were open at its Bind (a ROLLBACK TO ends the portals opened since the savepoint).
    savepoints: list[str] = field(default_factory=list)
    levels: dict[bytes, int] = field(default_factory=dict)

    def replacing(self, name: bytes) -> None:
        """Statement ``name`` is prepared again: what the gate answered for the old one goes."""
        self.statement_settings.pop(name, None)
        self.proxy_statements.pop(name, None)
        self.cursor_statements.pop(name, None)

    def binding(self, portal: bytes, statement: bytes) -> Owner:
        """Portal ``portal`` is bound to ``statement``: it belongs where the statement does."""
        owner = self.portals[portal] = self.statements.get(statement, Owner.UPSTREAM)
        self.proxy_portals.pop(portal, None)
        self.cursor_portals.pop(portal, None)
        self.forget_portal(portal)
        bound = self.texts.get(statement)
        if bound is not None:
            self.bound[portal] = bound
        else:
            self.bound.pop(portal, None)
        return owner

    def service_bound(self, portal: bytes, bind: bytes) -> None:
        """Rewritten portal ``portal`` is bound (``bind``: the client's Bind after the names), at the savepoint
        level in force."""
        self.service_binds[portal] = bind
        self.levels[portal] = len(self.savepoints)

    def forget_portal(self, portal: bytes) -> None:
        """The rewritten portal ``portal``, if any, ends (its Close, a new Bind of its name)."""
        self.kept_portals.pop(portal, None)
        self.service_binds.pop(portal, None)
        self.read_to_end.discard(portal)
        self.levels.pop(portal, None)

    def transaction_ended(self) -> None:
        """The implicit transaction of a batch ends at its Sync: its portals go, as in PostgreSQL."""
        self.proxy_portals.clear()
        self.portals_ended()
        self.bound.clear()

    def portals_ended(self) -> None:
        """The client's transaction ended: the rewritten portals kept or known here go, and its savepoints."""
        self.kept_portals.clear()
        self.service_binds.clear()
        self.read_to_end.clear()
        self.levels.clear()
        self.savepoints.clear()

    def transaction_control(self, statement: TransactionControl, failed: bool) -> None:
        """A transaction statement sent to the client's connection (``failed``: in a failed transaction, where
        PostgreSQL refuses all but ROLLBACK and ROLLBACK TO): the rewritten portals it ends go, as PostgreSQL's.
        Decided when the statement is sent: one that then fails (no such savepoint) aborts the transaction, whose
        portals serve nothing more until it is rolled back."""
        control = statement.control
        if control is Control.END:
            self.portals_ended()
        elif failed and control is not Control.ROLLBACK_TO:
            return
        elif control is Control.SAVEPOINT:
            self.savepoints.append(statement.savepoint)
        elif statement.savepoint not in self.savepoints:
            # No savepoint of that name that the proxy saw made (PostgreSQL fails the statement, or it was made
            # where the proxy does not follow): every rewritten portal goes, rather than serve one PostgreSQL ended.
            self._portals_opened_after(-1)
        else:
            level = len(self.savepoints) - 1 - self.savepoints[::-1].index(statement.savepoint)  # the latest
            if control is Control.RELEASE:  # its portals now belong to the level around it
                del self.savepoints[level:]
                self.levels = {portal: min(opened, level) for portal, opened in self.levels.items()}
            else:
                del self.savepoints[level + 1:]
                self._portals_opened_after(level)

    def _portals_opened_after(self, level: int) -> None:
        """The rewritten portals bound with more than ``level`` savepoints open end (a ROLLBACK TO)."""
        for portal in [portal for portal, opened in self.levels.items() if opened > level]:
            self.forget_portal(portal)

    def no_room(self, name: bytes, decided: Decided, limits: MemoryLimits) -> Reject | None:
        """Why a new named statement cannot be kept (too many, or too many bytes, for the session's limits)."""
        named = [(key, kept) for key, kept in self.texts.items() if key]
        if len(named) >= limits.statements:
            return Reject("54000", f"too many prepared statements: anonproxy keeps at most {limits.statements} per "
                                   "session", "Close (or DEALLOCATE) the statements you no longer need; the limit is "
                                              "the proxy's max_prepared_statements setting.")
        size = sum(statement_size(key, kept) for key, kept in named) + statement_size(name, decided)
        if size > limits.statement_size:
            return Reject("54000", f"prepared statements too large: this session's would take {size_text(size)}; "
                                   f"anonproxy keeps at most {size_text(limits.statement_size)} of them per session",
                          "Close (or DEALLOCATE) the statements you no longer need; the limit is the proxy's "
                          "max_prepared_size setting.")
        return None

    def deallocated(self, name: bytes | None) -> None:
        """DEALLOCATE ``name`` ran (None: DEALLOCATE ALL or DISCARD ALL): the statement of that name (or every named
        one) is forgotten wherever it belongs, as PostgreSQL forgets its own, so that it no longer binds and no longer
        counts against the session's limits. The portals bound from it stay, as PostgreSQL's do."""
        for key in [key for key in self.statements if key] if name is None else [name]:
            self.statements.pop(key, None)
            self.texts.pop(key, None)
            self.templates.pop(key, None)
            self.replacing(key)
