"""The one hook through which the gate hears what a mode says about its answers, without knowing the mode.

A gated statement is answered in one of three ways: on a connection of PostgreSQL (the client's own, or the
proxy's service connection for a rewritten query), or by the proxy itself after asynchronous work. What the
gate needs to know beyond that is asked here, by decision, never of a back-end:

* :func:`answered_by_proxy`: whether the proxy answers a decision itself (a dp answer, EXPLAIN (ANONPROXY),
  SHOW or SET of a setting kept by the proxy);
* :func:`fixed_columns`: the result columns of such an answer when they do not depend on the query;
* :func:`explained`: the rows of an explanation made when the statement was decided (nothing runs);
* :func:`read_notice`: whether a notice that a rewritten answer's SQL raised is a back-end's report on that
  answer, which the client never sees as it is: it gets, after the answer's last rows, the NOTICE the report's
  :meth:`AnswerReport.notice` writes in the proxy's words. Today one back-end reports: suppression
  (anonproxy.suppress.explain), on what it withheld.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from anonproxy.route.decision import (
    Decision,
    ExplainDP,
    ExplainSuppress,
    Intercept,
    Noisy,
    SessionSetting,
)
from anonproxy.suppress import explain as suppression
from anonproxy.wire import protocol as pg
from anonproxy.wire.results import EXPLAIN_COLUMNS, Column, Result, explain_result

# SHOW anonproxy.<these> need the ledger or the session's dp settings: answered by the proxy, not at once.
PROXY_SETTINGS = frozenset({"budget", "epsilon", "delta"})


def answered_by_proxy(decision: Decision) -> bool:
    """Whether the proxy answers ``decision`` itself after asynchronous work (the session's ``ask_proxy``)."""
    return isinstance(decision, (Noisy, ExplainDP, ExplainSuppress, SessionSetting)) or (
        isinstance(decision, Intercept) and decision.setting in PROXY_SETTINGS)


def fixed_columns(decision: Decision) -> tuple[Column, ...] | None:
    """The result columns of a proxy decision, when they do not depend on the query (None: a dp query's)."""
    if isinstance(decision, Intercept):
        return (Column(f"anonproxy.{decision.setting}", 25),)
    if isinstance(decision, SessionSetting):
        return ()
    if isinstance(decision, (ExplainDP, ExplainSuppress)):
        return EXPLAIN_COLUMNS
    return None


def explained(decision: Decision) -> Result | None:
    """The answer of an explanation made when the statement was decided (None: not one)."""
    if isinstance(decision, ExplainSuppress):
        return explain_result(decision.lines)
    return None


class AnswerReport(Protocol):
    """A back-end's report on one answer, read from a notice the answer's SQL raised."""

    def notice(self, rows: int | None) -> bytes:
        """The NoticeResponse for the client after the answer of ``rows`` rows (None: unknown); b"": none."""
        ...


@dataclass(frozen=True)
class _Suppressed:
    """What suppression withheld from one answer."""

    report: suppression.SuppressionReport

    def notice(self, rows: int | None) -> bytes:
        told = suppression.notice(self.report, rows)
        if told is None:
            return b""
        return pg.error_response("00000", told.message, severity="NOTICE", detail=told.detail, hint=told.hint,
                                 type_=b"N")


def _suppression(fields: Mapping[str, str]) -> AnswerReport | None:
    report = suppression.read_report(fields)
    return None if report is None else _Suppressed(report)


_READERS: tuple[Callable[[Mapping[str, str]], AnswerReport | None], ...] = (_suppression,)


def read_notice(fields: Mapping[str, str]) -> AnswerReport | None:
    """The report in the fields of a NoticeResponse a rewritten answer's SQL raised; None: a notice for the
    client, as it is."""
    for read in _READERS:
        report = read(fields)
        if report is not None:
            return report
    return None
