"""Suppress mode explains itself: the NOTICE after an answer, and ``EXPLAIN (ANONPROXY)`` (docs/suppression.md).

* :func:`read_report` reads the INFO message that the SQL built by
  :func:`anonproxy.suppress.rewrite.reported` raises through
  ``anonproxy.suppression_report()`` (sql/0022): figures computed next to
  the answer, already reduced to what may be released. :func:`notice` turns
  them into the words of the proxy's NOTICE. The gate reaches them only
  through the mode-neutral hook :mod:`anonproxy.route.reports`.
* :func:`explain_suppression` lists the plan of a suppress query (protected
  table, privacy unit, k, query-set-size control, grouping keys, the rule per
  aggregate, the rest row, the SQL) from the analysed query and the role's
  parameters alone: nothing is run and no data is read.

Pure functions: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from anonproxy.plan.analysis import AnalyticQuery
from anonproxy.policy.model import RolePolicy

REPORT_MESSAGE = "anonproxy.suppression_report"  # the MESSAGE of the INFO the report function raises


@dataclass(frozen=True)
class SuppressionReport:
    """What one suppressed answer withheld, as far as it may be told (see suppress._report)."""

    k: int
    relation: str
    labels: tuple[str, ...] | None  # the answer's grouping columns: aliases, else rendered (None: no GROUP BY)
    groups: int | None  # groups withheld; None: not said (none, or too few or too many people to say)
    complementary: int | None  # of them, withheld only so that the withheld groups pass the rules together
    total: str | None  # no GROUP BY: "qss" or "rules" when the total was withheld, None when released
    rest: bool | None  # the suppressed-rest row was released (None: the role has none, or no GROUP BY)
    null_group: bool | None  # a released group also has NULL in every grouping column


@dataclass(frozen=True)
class Notice:
    message: str
    detail: str | None = None
    hint: str | None = None


def read_report(fields: Mapping[str, str]) -> SuppressionReport | None:
    """The report in the fields of a NoticeResponse, or None when the notice is not one (or is malformed)."""
    if fields.get("V") != "INFO" or fields.get("M") != REPORT_MESSAGE:
        return None
    try:
        data = json.loads(fields.get("D", ""))
        return SuppressionReport(
            k=int(data["k"]), relation=str(data["relation"]),
            labels=None if data["labels"] is None else tuple(str(label) for label in data["labels"]),
            groups=None if data["groups"] is None else int(data["groups"]),
            complementary=None if data.get("complementary") is None else int(data["complementary"]),
            total=data["total"] if data["total"] in ("qss", "rules") else None,
            rest=None if data["rest"] is None else bool(data["rest"]),
            null_group=None if data["null_group"] is None else bool(data["null_group"]),
        )
    except (ValueError, TypeError, KeyError):
        return None


def notice(report: SuppressionReport, rows: int | None) -> Notice | None:
    """The NOTICE the proxy sends after an answer of ``rows`` rows (None: unknown), or None: nothing to say."""
    k = report.k
    if report.total == "qss":
        return Notice("anonproxy: the total was withheld by query-set-size control",
                      f"A total is released only when its rows belong to at least k = {k} people and leave out "
                      f"either nobody or at least {k} of the people in {report.relation} (N, everyone in "
                      f"{report.relation} and the tables joined to it): n >= k, and n = N or n <= N - k.",
                      f"Change the WHERE so that it covers at least {k} people and leaves out nobody or at least "
                      f"{k}, or GROUP BY a column to see the total in parts.")
    if report.total == "rules":
        return Notice("anonproxy: the total was withheld: fewer than k people contribute to one of its aggregates, "
                      "or a few people dominate a sum",
                      f"Each aggregate needs at least k = {k} people with a value (not null; for sum and avg also "
                      "not zero), and sums and averages must pass the role's dominance and p % rules.")
    if report.groups is not None:
        plural = "s were" if report.groups != 1 else " was"
        message = f"anonproxy: {report.groups} group{plural} suppressed"
        detail = (f"A group is suppressed when it holds fewer than k = {k} people or all but 1 to {k - 1} of the "
                  f"people in {report.relation}, when fewer than {k} people contribute to one of its aggregates, "
                  "or when a few people dominate a sum (the role's dominance and p % rules).")
        if report.complementary:
            primary = report.groups - report.complementary
            if primary:
                message += f" ({primary} by the rules, {report.complementary} more by complementary suppression)"
            else:  # every withheld group passed the rules alone
                message += f" (none by the rules, {report.complementary} by complementary suppression)"
            detail += (" The withheld groups must also pass the same rules together, so that no total minus the "
                       "released rows singles out fewer than k people: the smallest released groups are withheld "
                       "with them until they do (complementary suppression).")
        them = "it" if report.groups == 1 else "them"
        if report.rest and not report.labels:  # no grouping column in the select list to show it
            message += f"; one more row, the last one unless the query orders the rows, holds {them} together"
        elif report.rest and report.labels:
            message += f"; the row with NULL in {_columns(report.labels)} holds {them} together"
            if report.null_group:
                detail += (f" A released group has NULL in {_columns(report.labels)} too: the rest row is the "
                           "second such row (the last row of the answer when it has no ORDER BY).")
        elif report.rest is False:
            message += f"; no rest row holds {them} together: it did not pass the same rules"
            detail += (f" The rest row must itself hold at least {k} people and pass the other rules, and it and "
                       f"the released rows together must leave out of N nobody or at least {k} people.")
        return Notice(message, detail)
    if rows == 0 and report.labels is not None:
        return Notice("anonproxy: no group was released",
                      f"Suppression withholds groups of fewer than k = {k} people or of all but 1 to {k - 1} of "
                      f"the people in {report.relation}, and groups whose aggregates fail the contributor, "
                      "dominance or p % rules. How many groups were withheld is not said when they hold fewer "
                      f"than {k} people together, or leave out of N between 1 and {k - 1}: the number could tell "
                      "whether anybody matches the query.")
    return None


def explain_suppression(query: AnalyticQuery, role: RolePolicy, sql: str) -> tuple[str, ...]:
    """The rows of ``EXPLAIN (ANONPROXY)`` for a suppress query: its plan, from the query and the policy only."""
    params = role.suppression
    k = params.k
    if query.one_row_per_person and query.post is not None:  # the one-pass shape counts rows (rows.parts)
        unit = (f"  privacy unit: {query.unit}, unique and not null in the catalog: each row of the FROM clause is "
                "one person, and the rules are decided in the same pass as the answer")
        universe = (f"the people of every group, added up, plus the rows the WHERE leaves out counted up to k = {k} "
                    "(enough for every rule)" if query.where is not None
                    else "the people of every group, added up (no WHERE: every row is in a group)")
    else:
        unit = f"  privacy unit: {query.unit} (people are counted as distinct units, not rows)"
        universe = query.universe
    lines = [(f"suppressed answer on {query.owner or query.table}: exact values; groups of fewer than k = {k} "
              "people withheld"),
             unit,
             (f"  query-set-size control: every released group, total and rest row covers n people, "
              f"n >= {k}, and n = N or n <= N - {k}"),
             f"    N: the people of the FROM clause, joins included, WHERE not: {universe}"]
    if query.grouped:
        lines.append(f"  grouping keys: {', '.join(key.describe() for key in query.key_types)}")
    else:
        lines.append(f"  no GROUP BY: one total, withheld unless n >= {k} and n = N or n <= N - {k} (a total over "
                     "everyone is released)")
    for rule, argument in query.contributors:
        if rule == "nonzero":
            lines.append(f"  sum/avg of {argument}: at least {k} people with a value that is not null and not zero")
        else:
            lines.append(f"  count/min/max of {argument}: at least {k} people with a value that is not null")
    if query.magnitudes and params.dominance_n is not None and params.dominance_percent is not None:
        lines.append(f"  dominance: a group is withheld when its {params.dominance_n} largest contributions make "
                     f"more than {params.dominance_percent:g} % of the sum of {', '.join(query.magnitudes)}")
    if query.magnitudes and params.p_percent is not None:
        lines.append(f"  p % rule: withheld when the sum minus its two largest contributions is below "
                     f"{params.p_percent:g} % of the largest ({', '.join(query.magnitudes)})")
    if query.grouped and params.suppressed_rest:
        labels = tuple(item.alias or item.expression for item in query.items if item.kind == "group")
        shown = f", NULL in {_columns(labels)}," if labels else ""
        lines.append(f"  suppressed rest: one more row{shown} holds the withheld groups "
                     f"together; released only if it passes the same rules and, with the released rows, leaves out of "
                     f"N nobody or at least {k} people")
    elif query.grouped:
        lines.append("  suppressed rest: off (withheld groups are left out)")
    if query.grouped:
        lines.append(f"  complementary suppression: the withheld groups together must hold nobody or at least {k} "
                     "people and pass the same rules, and the released rows must leave out of N nobody or at least "
                     f"{k} people; else the smallest released groups are withheld too")
    if query.having is not None and query.grouped:
        lines.append("  HAVING: evaluated on released groups and the rest row only; the rest row holds every "
                     "withheld group")
    elif query.having is not None:
        lines.append("  HAVING: applied to the total after the rules; it takes no part in the verdict")
    lines.append(f"  notice: after the answer, how many groups were withheld (when they hold at least {k} people "
                 f"together and leave out of N nobody or at least {k}), or why a total was withheld")
    lines.append("SQL the service would run:")
    lines += [f"  {line}" for line in sql.split("\n")]
    lines.append("nothing was run")
    return tuple(lines)


def _columns(labels: tuple[str, ...]) -> str:
    if len(labels) <= 1:
        return "".join(labels)
    return ", ".join(labels[:-1]) + " and " + labels[-1]
