"""The suppression rules as SQL conditions, and the names of the CTEs that decide them (docs/suppression.md).

Shared by the two shapes of suppression SQL: :mod:`anonproxy.suppress.rewrite`
(each person's part of each group, ``anonproxy_cells``, when a person may have
several rows) and :mod:`anonproxy.suppress.one_pass` (one aggregation pass: the
rules are arithmetic on each group's own aggregates). Pure functions.

The magnitude rules (dominance and p %) need the largest contributions of a
group. The group's total ``t`` and largest contribution ``m`` bound them: the
``n`` largest add up to at least ``m`` and at most ``n * m`` (and ``t``), the
second largest lies between 0 and ``min(m, t - m)``. :func:`magnitude_bounds`
says from ``t`` and ``m`` alone whether a rule surely holds or surely fails;
only the groups it leaves undecided are ranked (:func:`ranked_verdict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from anonproxy.plan.analysis import AnalyticQuery
from anonproxy.plan.refusals import unsupported
from anonproxy.policy.model import SuppressionParams

CELLS = "anonproxy_cells"
RANKED = "anonproxy_ranked"
SUMMARY = "anonproxy_summary"
UNDECIDED = "anonproxy_undecided"
EXACT = "anonproxy_exact"
GROUPS = "anonproxy_groups"
WITHHELD = "anonproxy_withheld"
PRIMARY = "anonproxy_primary"
ORDER = "anonproxy_order"
ANSWERED = "anonproxy_answered"
PEOPLE = "anonproxy_people"
STEPS = "anonproxy_steps"
TRIED = "anonproxy_tried"
STEP_CELLS = "anonproxy_step_cells"
STEP_RANKED = "anonproxy_step_ranked"
STEP_VERDICTS = "anonproxy_step_verdicts"
CHOSEN = "anonproxy_chosen"
MARGINS = "anonproxy_margins"
REST_CELLS = "anonproxy_rest_cells"
REST_RANKED = "anonproxy_rest_ranked"
REST_EXACT = "anonproxy_rest_exact"
REST = "anonproxy_rest"
REPORT = "anonproxy_report"
WITHHELD_PEOPLE = "anonproxy_withheld_people"
UNIVERSE = "anonproxy_universe"
ROWS = "anonproxy_rows"
SURE = "anonproxy_sure"
GROUP_PEOPLE = "anonproxy_group_people"
COVERED = "anonproxy_covered"
COUNTED = "anonproxy_counted"
ANSWER = "anonproxy_answer"
REPORT_FUNCTION = "anonproxy.suppression_report"  # sql/0022_complementary_report.sql

POLICY_HINT = "Ask the DBA to fix the role's suppression parameters."
# Complementary suppression checks the magnitude rules on the withheld groups together at this many steps (each
# adds the smallest released group); past them it withholds every group of the answer.
MAGNITUDE_STEPS = 8
# The margins of a GROUP BY of several columns that complementary suppression covers: those of one or two columns.
MARGIN_COLUMNS = 2

Ctes = list[tuple[str, str, str | None]]  # (name, body, comment)


class Rules:
    """The role's suppression parameters, validated."""

    def __init__(self, params: SuppressionParams) -> None:
        self.k = int(params.k)
        if self.k < 1:
            raise unsupported("the role's suppression threshold k must be at least 1", POLICY_HINT)
        if (params.dominance_n is None) != (params.dominance_percent is None):
            raise unsupported("the role's dominance rule needs both n and k%", POLICY_HINT)
        self.dominance: tuple[int, Decimal] | None = None
        if params.dominance_n is not None and params.dominance_percent is not None:
            n, percent = int(params.dominance_n), _decimal(params.dominance_percent)
            if n < 1 or not 0 < percent <= 100:
                raise unsupported("the role's dominance rule needs n >= 1 and 0 < k% <= 100", POLICY_HINT)
            self.dominance = (n, percent)
        self.p_percent: Decimal | None = None
        if params.p_percent is not None:
            self.p_percent = _decimal(params.p_percent)
            if self.p_percent < 0:
                raise unsupported("the role's p% rule needs p >= 0", POLICY_HINT)
        self.rest = params.suppressed_rest

    @property
    def magnitude_rules(self) -> bool:
        return self.dominance is not None or self.p_percent is not None


def string(text: str) -> str:
    """A standard SQL string constant (the service session keeps standard_conforming_strings on)."""
    return "'" + text.replace("'", "''") + "'"


def contributes(rule: str, argument: str) -> str:
    """Whether a row makes its unit a contributor to an aggregate of ``argument``."""
    return f"({argument}) IS NOT NULL" if rule == "nonnull" else f"({argument}) <> 0"


def query_set_size(units: str, query: AnalyticQuery, rules: Rules) -> str:
    """``units >= k``, and ``units`` leaves out of the FROM clause's N people nobody or at least k: a released total
    over everyone is the public total, one over all but a few would single those few out."""
    return f"{units} >= {rules.k} AND {left_out(f'({query.universe}) - {units}', rules)}"


def left_out(people: str, rules: Rules) -> str:
    """``people`` is 0 or at least k: a set of people a subtraction could single out holds nobody or k people."""
    return f"{people} NOT BETWEEN 1 AND {rules.k - 1}"


def finite(total: str) -> str:
    """A numeric total is finite: neither Infinity nor NaN (NaN sorts above Infinity in PostgreSQL). One person's
    infinite value makes the total infinite, and Infinity compares equal to any multiple of itself, so that the
    magnitude rules' inequalities would hold for a group that one person dominates: such a group is withheld."""
    return f"{total} < 'Infinity'::numeric"


@dataclass(frozen=True)
class Bounds:
    """What a group's total and largest contribution say of the magnitude rules on one SUM/AVG argument."""

    holds: str  # SQL: the rules surely hold
    fails: str  # SQL: a rule surely fails

    def verdict(self, exact: str) -> str:
        """The rules' verdict, reading ``exact`` (the ranked verdict) only where the bounds leave it open."""
        return f"CASE WHEN {self.holds} THEN true WHEN {self.fails} THEN false ELSE coalesce({exact}, false) END"

    @property
    def undecided(self) -> str:
        return f"NOT ({self.holds}) AND NOT ({self.fails})"


def magnitude_bounds(rules: Rules, total: str, largest: str) -> Bounds:
    """The bounds of the magnitude rules from a group's ``total`` and ``largest`` absolute contribution (both not
    null, numeric). Dominance (n, k%): the n largest add up to between m and min(n m, t). p %: the second largest
    lies between 0 and min(m, t - m)."""
    t, m = total, largest
    holds, fails = [], []
    if rules.magnitude_rules:
        holds.append(finite(t))
        fails.append(f"NOT {finite(t)}")
    if rules.dominance is not None:
        n, percent = rules.dominance
        holds.append(f"100 * least({n} * {m}, {t}) <= {literal(percent)} * {t}")
        fails.append(f"100 * {m} > {literal(percent)} * {t}")
    if rules.p_percent is not None:
        p = literal(rules.p_percent)
        holds.append(f"100 * ({t} - {m} - least({m}, {t} - {m})) >= {p} * {m}")
        fails.append(f"100 * ({t} - {m}) < {p} * {m}")
    return Bounds(" AND ".join(holds) or "true", " OR ".join(fails) or "false")


def surely_hold(rules: Rules, least_total: str, most_part: str) -> list[str]:
    """The magnitude rules surely hold for a group whose absolute contributions add up to at least ``least_total``
    and are each at most ``most_part``: the n largest add up to at most n times it (dominance), and the total less
    the two largest is at least ``least_total`` less twice it (p %). The magnitude bounds of the rules
    (:func:`magnitude_bounds`) then hold at these values too."""
    conditions = [finite(least_total), finite(most_part)] if rules.magnitude_rules else []
    if rules.dominance is not None:
        n, percent = rules.dominance
        conditions.append(f"100 * {n} * {most_part} <= {literal(percent)} * {least_total}")
    if rules.p_percent is not None:
        conditions.append(f"100 * ({least_total} - 2 * {most_part}) >= {literal(rules.p_percent)} * {most_part}")
    return conditions


def magnitude_conditions(rules: Rules, contribution: str, rank: str) -> list[str]:
    """The magnitude rules as aggregate conditions over ranked rows: ``contribution`` (absolute) and its ``rank``
    in the group (1: the largest)."""
    c, r = contribution, rank
    total = f"coalesce(sum({c}), 0)"
    conditions = [finite(total)] if rules.magnitude_rules else []
    if rules.dominance is not None:
        n, percent = rules.dominance
        conditions.append(f"100 * coalesce(sum({c}) FILTER (WHERE {r} <= {n}), 0) <= {literal(percent)} * {total}")
    if rules.p_percent is not None:
        x1 = f"coalesce(max({c}) FILTER (WHERE {r} = 1), 0)"
        x2 = f"coalesce(max({c}) FILTER (WHERE {r} = 2), 0)"
        conditions.append(f"100 * ({total} - {x1} - {x2}) >= {literal(rules.p_percent)} * {x1}")
    return conditions


def ranked_verdict(source: str, ranked: str, name: str, keys: list[str], sums: list[str], flags: list[str],
                   threshold: str, rules: Rules, comment: str) -> Ctes:
    """CTEs ranking each unit's contributions in ``source`` and deciding ``released`` per group of ``keys``."""
    ctes: Ctes = []
    table = source
    if sums:
        partition = f"PARTITION BY {', '.join(keys)} " if keys else ""
        contributions = ", ".join([*keys, "unit", *flags,
                                   *(f"abs(coalesce({s}, 0))::numeric AS c{s[1:]}" for s in sums)])
        ranks = ", ".join(f"row_number() OVER ({partition}ORDER BY c{s[1:]} DESC) AS r{s[1:]}" for s in sums)
        body = "\n".join([
            f"SELECT {', '.join([*keys, 'unit', *flags, *(f'c{s[1:]}' for s in sums)])}, {ranks}",
            f"FROM (SELECT {contributions} FROM {source}) AS contributions",
        ])
        ctes.append((ranked, body, "absolute contributions, largest first"))
        table = ranked
    conditions = [threshold]
    conditions += [f"count(unit) FILTER (WHERE {flag}) >= {rules.k}" for flag in flags]
    for s in sums:
        conditions += magnitude_conditions(rules, f"c{s[1:]}", f"r{s[1:]}")
    lines = ["SELECT " + "".join(f"{key},\n       " for key in keys) + "\n       AND ".join(conditions)
             + "\n         AS released" + "".join(f", {column}" for column in group_counts(keys, flags)),
             f"FROM {table}"]
    if keys:
        lines.append(f"GROUP BY {', '.join(keys)}")
    ctes.append((name, "\n".join(lines), comment))
    return ctes


def bounded_verdicts(query: AnalyticQuery, rules: Rules, keys: list[str], sums: list[str], flags: list[str],
                     name: str, settled: str | None = None) -> Ctes:
    """``name``: each group's verdict alone, from ``anonproxy_summary`` (per group: ``units``, the contributors
    ``n<j>``, and per SUM/AVG argument the total ``t<j>`` and largest ``m<j>`` absolute contribution): the counts,
    and the magnitude rules from the bounds; only the cells (``anonproxy_cells``) of the groups the bounds leave
    undecided are ranked (``anonproxy_exact``), in a pass PostgreSQL skips when there are none. ``settled``: SQL
    of a condition that proves every group passes (then the summary's figures are bounds, not a group's own)."""
    counts = [query_set_size("s.units", query, rules), *(f"s.{flag} >= {rules.k}" for flag in flags)]
    ctes: Ctes = []
    conditions = list(counts)
    join = ""
    if sums:
        bounds = [magnitude_bounds(rules, f"s.t{s[1:]}", f"s.m{s[1:]}") for s in sums]
        undecided = " OR ".join(f"({b.undecided})" for b in bounds)
        ctes.append((UNDECIDED, "\n".join([
            f"SELECT {', '.join(keys) or 'true AS undecided'} FROM {SUMMARY} AS s",
            f"WHERE {' AND '.join(counts)}\n  AND ({undecided})",
        ]), "the groups that pass the counts and whose totals leave the magnitude rules open"))
        restricted = (f"(SELECT * FROM {CELLS} WHERE EXISTS (SELECT FROM {UNDECIDED})"
                      + (f" AND {key_tuple(keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {UNDECIDED})"
                         if keys else "") + ") AS undecided")
        ctes += ranked_verdict(restricted, RANKED, EXACT, keys, sums, [], "true", rules,
                               "the magnitude rules on the ranked contributions of those groups")
        on = " AND ".join(f"ARRAY[s.{k}] = ARRAY[e.{k}]" for k in keys) or "true"
        join = f"\nLEFT JOIN {EXACT} AS e ON {on}"
        conditions += [b.verdict("e.released") for b in bounds]
    totals = [f"s.{column}{s[1:]}" for s in sums for column in ("t", "m")]
    select = [*(f"s.{k}" for k in keys), "s.units", *(f"s.{flag}" for flag in flags), *totals]
    comment = ("primary suppression: each group alone holds k people, leaves nobody or k people out of N"
               + (", passes the magnitude rules" if sums else "")) if keys else \
        "released: k people, and nobody or k people left out of N, magnitude rules"
    verdict = "\n       AND ".join(conditions)
    if settled is not None:
        verdict = f"({settled}\n        OR {verdict})"
    ctes.append((name, "\n".join([
        f"SELECT {', '.join(select)},",
        f"       {verdict} AS released",
        f"FROM {SUMMARY} AS s{join}",
    ]), comment))
    return ctes


def group_counts(keys: list[str], flags: list[str]) -> list[str]:
    """A group's people, and its contributors per aggregate (named as the cells' flags), for complementary
    suppression; none for a verdict without groups."""
    if not keys:
        return []
    return ["count(unit) AS units", *(f"count(unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]


def with_ctes(ctes: Ctes, materialized: tuple[str, ...] = ()) -> str:
    """``WITH name AS (body), ...``; the CTEs named in ``materialized`` are optimization fences (no condition of
    the statement that reads them is evaluated inside)."""
    parts = []
    for name, body, comment in ctes:
        note = f"-- {comment}\n" if comment else ""
        fence = "MATERIALIZED " if name in materialized else ""
        # Bodies are not indented: a string constant of the client's may span lines, and every copy of its text
        # must read the same rows.
        parts.append(f"{name} AS {fence}(\n{note}{body}\n)")
    return "WITH " + ",\n".join(parts)


def key_tuple(expressions: list[str] | tuple[str, ...], bare: bool = False) -> str:
    """ARRAY[...] per key: arrays compare NULL elements as equal, and a row of them is hashable."""
    arrays = [f"ARRAY[{expression}]" for expression in expressions]
    if len(arrays) == 1 or bare:
        return ", ".join(arrays)
    return f"({', '.join(arrays)})"


def _decimal(value: float) -> Decimal:
    return Decimal(str(value))


def literal(value: Decimal) -> str:
    return format(value.normalize(), "f")
