"""Differential-privacy mode for one aggregate query: a plan, then an answer (docs/dp.md).

Pure and I/O-free. :func:`plan_dp` reads the client's SQL with the same
parser, validator and expression allowlist as suppression mode
(:func:`anonproxy.plan.analysis.analyze`), and builds SQL for the service
connection that returns *exact, contribution-bounded* per-group statistics
(docs/design.md, principle 6). :func:`answer` adds exact discrete noise to those
statistics in the proxy (principle 4), draws quantiles with the exponential
mechanism, keeps non-public groups only when a noisy count of distinct units
passes a threshold (partition selection), and then applies HAVING, ORDER BY,
LIMIT and OFFSET to the noisy values (post-processing).

Post-aggregate expressions (``round(avg(x), 1)``, ``sum(x) / count(*)``, a
HAVING over them) are post-processing too: the plan's ``post`` statement
computes them in PostgreSQL over the noisy values, passed as arrays, so they
have PostgreSQL's semantics and result types (:class:`PostProcess`).

The plan is a deterministic function of (sql, policy, params), so it can be
cached by text; its ``epsilon`` and ``delta`` are the cost to charge to the
ledger *before* :func:`answer`'s rows leave the proxy.
"""

from __future__ import annotations

import datetime
import functools
import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Literal

import psycopg
from sqlglot import exp

from anonproxy.plan import bounds
from anonproxy.plan import outer as nested_shapes
from anonproxy.plan.shape import Nested, prepare
from anonproxy.policy.model import (
    ColumnPolicy,
    Policy,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.dp.having import compile_having, holds
from anonproxy.dp.mechanisms import (
    CONFIDENCE,
    ceil_scaled_log,
    discrete_laplace,
    discrete_laplace_halfwidth,
    discrete_laplace_stddev,
    laplace_scale,
    to_grid,
)
from anonproxy.dp.quantiles import dp_quantile, rank_halfwidth
from anonproxy.plan.analysis import AnalyticQuery, Item, analyze, canonical, filtered
from anonproxy.plan.post_aggregate import RELEASED, PostAggregate, value
from anonproxy.plan import post_aggregate
from anonproxy.rewrite.classify import parsed_tree
from anonproxy.rewrite.decision import (
    FEATURE_NOT_SUPPORTED,
    Refusal,
    Reject,
    forbidden,
    unsupported,
)
from anonproxy.rewrite.expressions import unwrap
from anonproxy.rewrite.names import PolicyIndex, ResolvedTable, identifier, quote
from anonproxy.rewrite.statements import PARSE_HINT, split

__all__ = ["ColumnNoise", "DPParams", "DPPlan", "OutputColumn", "PostProcess", "Quantile", "Statistic", "answer",
           "finish", "plan_dp", "released_rows", "selection_threshold"]

DP_HINT = ("Supported in dp mode: SELECT <GROUP BY columns>, count(*), count(x), count(DISTINCT <unit>), sum(x), "
           "avg(x), variance/var_samp/var_pop/stddev/stddev_samp/stddev_pop(x), median(x), "
           "percentile_cont/percentile_disc(q) WITHIN GROUP (ORDER BY x), each with an optional FILTER (WHERE ...) "
           "but the quantiles, and expressions over them and constants (+ - * /, round, trunc, abs, sign, ceil, "
           "floor, coalesce, nullif, greatest, least, CASE, casts) FROM <protected table> "
           "[[LEFT] JOIN <linked table> ON <declared key>] [WHERE ...] [GROUP BY ...] [HAVING ...] "
           "[ORDER BY <output columns>] [LIMIT n] [OFFSET n]; x needs declared bounds except in count, or is an "
           "expression whose bounds follow from its columns' declared bounds (constants, CASE, arithmetic, "
           "rounding, casts: sum(hours_per_week * 52)).")
BOUNDS_HINT = "Ask the DBA to declare lower and upper bounds for the column in the policy."
JOIN_HINT = ("In dp mode a query reads one protected table and its linked tables, each joined with "
             "JOIN <linked table> ON <linked>.<key> = <protected>.<unit> as the policy declares them.")
MAX_DOMAIN_CELLS = 10_000  # public-domain grid (product of the domains) emitted by the SQL
GRID_UNITS = 1000  # a non-integer sum's sensitivity is about this many grid steps (rounding ≪ noise)
QUANTILE_STEPS = 10_000  # a quantile's output grid has about this many steps between the bounds (at least 1)

# Column names in the generated SQL (prefixed so they cannot collide with the client's).
ROWS = "anonproxy_rows"
CELLS = "anonproxy_cells"
BOUNDED = "anonproxy_bounded"
STATS = "anonproxy_stats"
GUARD = "anonproxy_guard"
PLAIN = "anonproxy_plain"
DOMAIN = "anonproxy_domain"
UNIT = "anonproxy_unit"
UNREAD = "anonproxy_unread"
HAVING_TYPES = "anonproxy_having_types"

_INT8, _FLOAT4, _FLOAT8, _NUMERIC = 20, 700, 701, 1700  # PostgreSQL type OIDs of answer values
_FLOATS = (_FLOAT4, _FLOAT8)

StatKind = Literal["units", "rows", "count", "sum", "values"]
# "post": computed by the plan's post statement over the noisy values (a post-aggregate expression)
ColumnKind = Literal["key", "count", "sum", "avg", "variance", "stddev", "quantile", "post"]
_SPREADS: dict[type[exp.Expression], tuple[ColumnKind, bool]] = {  # aggregate -> (kind, sample statistic?)
    exp.Variance: ("variance", True), exp.VariancePop: ("variance", False), exp.Stddev: ("stddev", True),
    exp.StddevSamp: ("stddev", True), exp.StddevPop: ("stddev", False),
}
_AGGREGATES = (exp.Count, exp.Sum, exp.Avg, exp.Median, exp.WithinGroup, *_SPREADS)


@dataclass(frozen=True)
class DPParams:
    epsilon: float
    delta: float
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1  # per unit and group


@dataclass(frozen=True)
class Statistic:
    """One exact per-group statistic of the SQL, and the discrete Laplace noise ``answer`` adds to it.

    A ``sum`` adds up f(x) = (clamp(x) − center)^power − offset over the bounded rows, where clamp(x) is x
    clamped to the declared [L, U] (``clamp``); ``per_group`` is c times the largest |f|. A ``values``
    statistic is the array of the group's clamped values, for quantiles (no noise of its own).
    """

    name: str  # its column in the SQL
    kind: StatKind
    argument: str | None  # the aggregate's argument, as written (None for units/rows)
    per_group: Fraction  # how much one unit can move it in one group
    sensitivity: Fraction  # L1 over all groups: per_group × groups a unit can reach
    epsilon: Fraction
    resolution: Fraction | None  # grid of a sum whose SQL value is not an integer
    scale: Fraction  # discrete Laplace t, in integer (grid) units
    clamp: tuple[Fraction, Fraction] | None = None  # sum, values: the declared [L, U] the SQL clamps to
    center: Fraction = Fraction(0)
    power: int = 1
    offset: Fraction = Fraction(0)

    @property
    def value_scale(self) -> float:
        """The noise scale in the statistic's own units."""
        return float(self.scale * (self.resolution or 1))

    def halfwidth(self, confidence: float = CONFIDENCE) -> float:
        """The noisy value is within this of the exact one with probability ≥ ``confidence``, in its own units."""
        rounding = float(self.resolution) / 2 if self.resolution is not None else 0.0
        return discrete_laplace_halfwidth(self.scale, confidence) * float(self.resolution or 1) + rounding

    def noise(self) -> ColumnNoise:
        return ColumnNoise("discrete_laplace", self.value_scale, float(self.epsilon), 0.0,
                           discrete_laplace_stddev(self.scale) * float(self.resolution or 1), self.halfwidth(),
                           self.resolution)


@dataclass(frozen=True)
class Quantile:
    """One quantile output: the exponential mechanism over the grid lower + resolution·j, per group."""

    values: str  # the SQL column holding the group's clamped values
    q: Fraction
    discrete: bool  # percentile_disc: the grid point in the column's type; else double precision
    lower: Fraction
    upper: Fraction
    resolution: Fraction
    epsilon: Fraction  # per group: the column's share of ε over the groups one unit reaches
    share: Fraction  # the column's share of the query's ε
    max_contributions: int  # rows per unit and group

    def draw(self, values: list[object] | None) -> int | Decimal | float:
        value = dp_quantile(values or [], self.q, self.lower, self.upper, self.epsilon,
                            resolution=self.resolution, max_contributions=self.max_contributions)
        if not self.discrete:
            return value
        exact = self.lower + round((Fraction(value) - self.lower) / self.resolution) * self.resolution
        return int(exact) if exact.denominator == 1 else _decimal(exact)

    def noise(self) -> ColumnNoise:
        scale = 2 * self.max_contributions * max(self.q, 1 - self.q) / self.epsilon
        ranks = rank_halfwidth(self.q, self.lower, self.upper, self.epsilon, resolution=self.resolution,
                               max_contributions=self.max_contributions)
        return ColumnNoise("exponential", float(scale), float(self.share), 0.0, None, None, self.resolution,
                           rank_halfwidth=ranks)


@dataclass(frozen=True)
class ColumnNoise:
    """What the accuracy notice says about one output column (the same for every row)."""

    mechanism: str  # "discrete_laplace", "ratio" (AVG), "moments" (VARIANCE/STDDEV) or "exponential"
    scale: float | None
    epsilon: float
    delta: float
    stddev: float | None
    ci95_halfwidth: float | None
    resolution: Fraction | None = None
    rank_halfwidth: float | None = None  # exponential: 95 % of answers are within this many ranks
    ratio_numerator: float | None = None  # ratio: 95 % of answers are within this / (the group's noisy count)

    def describe(self, column: str) -> str:
        if self.mechanism == "ratio":
            assert self.ratio_numerator is not None
            a = self.ratio_numerator
            return (f"{column}: noisy sum / noisy count, ε={self.epsilon:g}, values clamped to the declared bounds, "
                    f"95% interval ±{a:.4g}/n for a group of n values (±{a / 1000:.3g} at n = 1000), "
                    "rounded to the digits that interval supports")
        if self.mechanism == "moments":
            return (f"{column}: from noisy count, sum and sum of squares, ε={self.epsilon:g}, clamped to what "
                    "the declared bounds allow")
        if self.mechanism == "exponential":
            return (f"{column}: exponential mechanism on a grid of step {self.resolution}, ε={self.epsilon:g}, "
                    f"95% within ±{self.rank_halfwidth:.3g} ranks of the true quantile")
        parts = [f"{column}: discrete Laplace, ε={self.epsilon:g}", f"scale {self.scale:g}"]
        if self.stddev is not None:
            parts.append(f"sd {self.stddev:.3g}")
        if self.ci95_halfwidth is not None:
            parts.append(f"95% interval ±{self.ci95_halfwidth:g}")
            if self.resolution is not None:  # a sum on a fixed-point grid: answer() rounds it to this interval
                parts.append("rounded to the digits that interval supports")
        return ", ".join(parts)


@dataclass(frozen=True)
class OutputColumn:
    """How one client output column is derived from the SQL's columns and noise."""

    name: str  # the client's alias, or the expression as written
    kind: ColumnKind
    key: int | None = None  # kind "key": index of the group key in the SQL row
    statistic: str | None = None  # count / sum; avg: Σ(x − center); variance, stddev: Σ((x − center)² − offset)
    denominator: str | None = None  # avg, variance, stddev: the count of non-null values
    linear: str | None = None  # variance, stddev: Σ(x − center)
    center: Fraction = Fraction(0)
    offset: Fraction = Fraction(0)
    lower: Fraction | None = None  # avg, variance, stddev: declared bounds
    upper: Fraction | None = None
    sample: bool = False  # variance, stddev: divide by n − 1 (var_samp) rather than n (var_pop)
    quantile: Quantile | None = None
    noise: ColumnNoise | None = None


@dataclass(frozen=True)
class OrderKey:
    position: int  # 0-based output column
    descending: bool
    nulls_first: bool


@dataclass(frozen=True)
class PostProcess:
    """A statement over the released noisy values: the client's post-aggregate expressions, and HAVING when it
    holds any, with PostgreSQL's own semantics and result types.

    Its parameters are arrays, one element per released group: $1 the row number, then one array per value
    column (``values``: indices into the answer row, columns then hidden ones: the GROUP BY expressions when an
    expression reads one, then the aggregates). Its result row is the row number,
    the ``computed`` output columns in order, and ``keep`` (HAVING) last when ``having``.
    """

    sql: str
    values: tuple[int, ...]
    computed: tuple[int, ...]  # positions of the client's columns it computes
    having: bool


@dataclass(frozen=True)
class DPPlan:
    sql: str  # contribution-bounded exact per-group statistics, for the service connection
    columns: tuple[OutputColumn, ...]
    epsilon: float  # the total cost of the answer
    delta: float
    table: str  # the privacy-unit domain to charge (policy name of the protected table)
    tables: tuple[str, ...]  # every table its SQL reads (policy names): the data version of the answer
    keys: int  # the SQL row holds the group keys first, then one column per statistic
    statistics: tuple[Statistic, ...]
    selection: str | None  # statistic whose noisy value must reach `threshold` (None: public or no groups)
    threshold: int | None
    order: tuple[OrderKey, ...] = ()
    limit: int | None = None
    offset: int = 0
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1
    hidden: tuple[OutputColumn, ...] = ()  # aggregates HAVING needs that the select list does not show
    having: tuple | None = None  # compiled HAVING (dp_having) over columns + hidden
    domains: tuple[tuple[str, ...], ...] | None = None  # the GROUP BY keys' declared public domains, in order
    post: PostProcess | None = None  # post-aggregate expressions, computed over the noisy values
    nested: nested_shapes.Outer | nested_shapes.Series | None = None  # the released rows' next step

    @property
    def free(self) -> bool:
        """Only keys of declared public domains: the answer is those domains, its SQL reads no row, it costs
        nothing (and there is nothing to charge or cache)."""
        return not self.statistics and self.epsilon == 0 and self.delta == 0

    def notices(self) -> list[str]:
        lines = [column.noise.describe(column.name) for column in self.columns if column.noise is not None]
        # hidden columns: those HAVING compares ("having <n>"), and the aggregates of post-aggregate expressions
        lines += [("HAVING: " if column.name.startswith("having ") else "") + column.noise.describe(column.name)
                  for column in self.hidden if column.noise is not None]
        if self.selection is not None:
            lines.append(f"groups released only if their noisy count of people reaches {self.threshold} "
                         f"(δ={self.delta:g})")
        return lines

    def output_types(self, sql_types: list[int]) -> tuple[int, ...]:
        """Type OIDs of the client's columns given those PostgreSQL reports for the columns of ``sql``, so a
        Describe can answer before anything runs. They are PostgreSQL's for the same aggregates, read off the
        statistics' SQL types (each sums the clamped argument in the argument's own type): a key keeps its SQL
        type; count is bigint; sum is its statistic's type (numeric on a fixed-point grid, unless the argument is a
        float); avg, variance and stddev are double precision of a float argument, else numeric; a continuous
        quantile is double precision, a discrete one the argument's type."""
        return self.value_types(sql_types)[:len(self.columns)]

    def value_types(self, sql_types: list[int], post_types: list[int] | None = None) -> tuple[int, ...]:
        """Type OIDs of the answer row's columns, hidden ones included; ``post_types``: the post statement's
        result types (a computed column's type is PostgreSQL's for the expression; 0 when not known)."""
        statistic = {stat.name: sql_types[self.keys + i] for i, stat in enumerate(self.statistics)}
        computed = dict(zip(self.post.computed, (post_types or [])[1:], strict=False)) if self.post else {}
        types = []
        for position, column in enumerate(self.columns + self.hidden):
            if column.kind == "post":
                types.append(computed.get(position, 0))
            elif column.kind == "key":
                types.append(sql_types[column.key])  # type: ignore[index]
            elif column.kind == "count":
                types.append(_INT8)
            elif column.kind == "sum":  # on a fixed-point grid: numeric, unless the argument is a float
                own = statistic[column.statistic]  # type: ignore[index]
                grid = column.noise is not None and column.noise.resolution is not None
                types.append(_NUMERIC if grid and own not in _FLOATS else own)
            elif column.kind == "quantile":
                grid = column.quantile
                assert grid is not None
                types.append(_element_type(statistic[grid.values]) if grid.discrete else _FLOAT8)
            else:  # avg: Σ(x − c) in x's type; variance, stddev: the same linear sum
                linear = statistic[column.statistic if column.kind == "avg" else column.linear]  # type: ignore[index]
                types.append(_FLOAT8 if linear in _FLOATS else _NUMERIC)
        return tuple(types)


def _element_type(array_oid: int) -> int:
    """The element type of an array type (array_agg's result): a discrete quantile has its argument's type."""
    for info in psycopg.postgres.types:
        if info.array_oid == array_oid:
            return info.oid
    return _NUMERIC


# --- planning ---------------------------------------------------------------------


def plan_dp(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan | Reject:
    """The plan for ``sql`` (one aggregate SELECT over a protected table), or why it is refused."""
    try:
        return _plan(sql, role, policy, params)
    except Refusal as refusal:
        return refusal.reject
    except RecursionError:
        return Reject(FEATURE_NOT_SUPPORTED, "the statement is nested too deeply to analyze", PARSE_HINT)
    except OverflowError:  # a noise scale Δ/ε past the largest double (about 1.8e308): nothing can describe it
        return Reject(FEATURE_NOT_SUPPORTED, f"ε = {params.epsilon:g} is too small for this query: its noise "
                      "scale is beyond the range of a double", "Ask the DBA for a larger per-query ε.")


def _plan(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan:
    if role.mode != "dp":
        raise forbidden(f"role {role.role} is not in dp mode (mode {role.mode})", "Ask the DBA for a dp role.")
    epsilon, delta, groups_cap, rows_cap = _params(params)
    statements = split(sql)
    if len(statements) != 1:
        raise unsupported("a dp query must be sent on its own, as one statement", DP_HINT)
    index = PolicyIndex(policy)
    shape = prepare(*parsed_tree(statements[0]), index)
    single = shape.inner if isinstance(shape, Nested) else shape  # a nested shape: the question asked first
    statement, tree = single.statement, single.tree
    query = analyze(statement, tree, index, SuppressionParams(k=1), dp=True)
    assert isinstance(tree, exp.Select)  # analyze refuses everything else, and every relation outside the policy
    if query.distinct and any(item.kind == "aggregate" or item.aggregates for item in query.items):
        raise unsupported("SELECT DISTINCT with aggregates is not supported in dp mode", DP_HINT)

    columns = _Columns(query, rows_cap)
    keys = list(query.key_nodes)
    public = _public_domains(query, columns) if query.keys else None
    # How many groups one unit can reach: a unit touches at most `groups_cap` groups, and never more than exist.
    reach = 1 if not query.keys else (min(groups_cap, math.prod(len(d) for d in public)) if public else groups_cap)

    selection = None
    if query.keys and public is None:
        if delta <= 0:
            raise unsupported(f"GROUP BY {', '.join(query.keys)} needs δ > 0: groups without a declared public "
                              "domain are released only past a noisy threshold, which costs δ",
                              "Declare a public domain for the grouping column, or give the role a δ.")
        selection = columns.need("units", None, Fraction(1))

    outer = query.outer
    if outer is not None:
        _check_outer(outer)
    drafts: list[_Draft] = []
    for position, item in enumerate(query.items):
        if outer is not None and outer.items[position].computed and not _plain_aggregate(_node(item)):
            drafts.append(_Draft(outer.items[position].name, "post"))
            continue
        if item.kind == "constant":
            raise unsupported(f"constant select item {item.expression} is not supported in dp mode", DP_HINT)
        node = _node(item)
        if item.kind == "group":
            if canonical(node) not in keys:
                raise unsupported(f"select item {item.expression} must be one of the GROUP BY expressions in dp "
                                  "mode", DP_HINT)
            drafts.append(_Draft(item.name, "key", key=keys.index(canonical(node))))
        else:
            drafts.append(columns.aggregate(node, item.name, item.expression))

    hidden: list[_Draft] = []
    having = None
    if query.having is not None and not query.having_outer:
        having = _having(_having_node(query), keys, query, drafts, hidden, columns)
    inputs: list[tuple[str, int]] = []  # the post statement's value columns: (name, index in the answer row)
    if outer is not None:
        if outer.keys_used:  # the GROUP BY expressions, when an expression reads one: hidden key columns
            for number, key_text in enumerate(query.keys, 1):
                hidden.append(_Draft(f"key {key_text}", "key", key=number - 1))
                inputs.append((post_aggregate.key(number), len(drafts) + len(hidden) - 1))
        for number, node in enumerate(outer.aggregates, 1):  # each aggregate: a hidden column (statistics shared)
            hidden.append(columns.aggregate(node, query.text_of(node).text, None))
            inputs.append((value(number), len(drafts) + len(hidden) - 1))

    mechanisms = [key for key, stat in columns.stats.items() if stat.kind != "values"] + list(columns.quantiles)
    if not mechanisms and not public:
        raise unsupported("a dp query needs an aggregate or a GROUP BY", DP_HINT)
    share = Fraction(epsilon) / max(len(mechanisms), 1)
    names = {key: f"anonproxy_s{i}" for i, key in enumerate(columns.stats, 1)}
    statistics = {key: stat.finish(names[key], share, reach) for key, stat in columns.stats.items()}
    quantiles = {key: Quantile(names[values], key[1], key[2], lower, upper, step, share / reach, share, rows_cap)
                 for key, (values, lower, upper, step) in columns.quantiles.items()}

    threshold = None
    if selection is not None:
        threshold = selection_threshold(statistics[selection].scale, reach, float(delta))
    order, limit, offset = _tail(query, tree)
    checks = _having_checks(having, drafts, hidden, query)
    return DPPlan(
        sql=_sql(query, list(statistics.values()), public, rows_cap, groups_cap, checks),
        columns=tuple(draft.finish(statistics, quantiles) for draft in drafts),
        epsilon=float(epsilon) if mechanisms else 0.0,  # listing a public domain reads nothing private
        delta=float(delta) if selection is not None else 0.0,
        table=query.owner,
        tables=tuple(sorted({source.policy_name for _, source in query.sources})),
        keys=len(query.keys),
        statistics=tuple(statistics.values()),
        selection=statistics[selection].name if selection is not None else None,
        threshold=threshold,
        order=order,
        limit=limit,
        offset=offset,
        max_groups_per_unit=groups_cap,
        max_rows_per_unit=rows_cap,
        hidden=tuple(draft.finish(statistics, quantiles) for draft in hidden),
        having=having,
        domains=tuple(public) if public is not None else None,
        post=_post_process(outer, query, inputs, [i for i, d in enumerate(drafts) if d.kind == "post"])
        if outer is not None else None,
        nested=shape.post if isinstance(shape, Nested) else None,
    )


def _check_outer(outer: PostAggregate) -> None:
    if outer.parameters:
        raise unsupported("$n parameters in expressions over aggregates are not supported in dp mode",
                          "Write the value as a constant.")


def _plain_aggregate(item: exp.Expression) -> bool:
    """Whether a select item is one aggregate (FILTER included), which the plan answers itself."""
    node = _unparen(item)
    return isinstance(node, _AGGREGATES) or (isinstance(node, exp.Filter) and isinstance(node.this, _AGGREGATES))


def _post_process(outer: PostAggregate, query: AnalyticQuery, inputs: list[tuple[str, int]],
                  computed: list[int]) -> PostProcess:
    """The statement computing the client's post-aggregate expressions over the released values."""
    select = ["anonproxy_n", *(outer.items[position].sql for position in computed)]
    if query.having_outer:
        assert outer.having is not None
        select.append(f"{outer.having} AS anonproxy_keep")
    columns = ["anonproxy_n", *(name for name, _ in inputs)]
    arrays = ", ".join(f"${number}" for number in range(1, len(columns) + 1))
    sql = "\n".join([f"SELECT {', '.join(select)}",
                     f"FROM unnest({arrays}) AS {RELEASED}({', '.join(columns)})",
                     "ORDER BY anonproxy_n"])
    return PostProcess(sql, tuple(index for _, index in inputs), tuple(computed), query.having_outer)


_ColumnKey = tuple  # identifies a statistic: (kind, argument, center, power, offset)


@dataclass
class _Stat:
    kind: StatKind
    argument: str | None
    per_group: Fraction
    clamp: tuple[Fraction, Fraction] | None = None
    center: Fraction = Fraction(0)
    power: int = 1
    offset: Fraction = Fraction(0)

    def finish(self, name: str, epsilon: Fraction, reach: int) -> Statistic:
        if self.kind == "values":
            return Statistic(name, "values", self.argument, self.per_group, self.per_group * reach, Fraction(0),
                             None, Fraction(0), self.clamp)
        sensitivity = self.per_group * reach
        resolution = None
        if self.kind == "sum":
            lower, upper = self.range()
            if lower.denominator != 1 or upper.denominator != 1:
                # Not an integer sum: release it on the grid r·ℤ, r a power of ten, with ~GRID_UNITS steps per Δ.
                resolution = Fraction(10) ** math.floor(math.log10(sensitivity / GRID_UNITS))
        # On the grid each reachable group moves by at most ⌈per_group/r⌉ steps (to_grid rounds half up).
        units = sensitivity if resolution is None else reach * Fraction(math.ceil(self.per_group / resolution))
        return Statistic(name, self.kind, self.argument, self.per_group, sensitivity, epsilon, resolution,
                         laplace_scale(units, epsilon), self.clamp, self.center, self.power, self.offset)

    def range(self) -> tuple[Fraction, Fraction]:
        """The range of f(x) = (clamp(x) − center)^power − offset."""
        assert self.clamp is not None
        low, high = self.clamp[0] - self.center, self.clamp[1] - self.center
        if self.power == 1:
            return low - self.offset, high - self.offset
        return -self.offset, max(low * low, high * high) - self.offset


@dataclass
class _Draft:
    """An output column before the ε split: statistics by key."""

    name: str
    kind: ColumnKind
    key: int | None = None
    statistic: _ColumnKey | None = None
    denominator: _ColumnKey | None = None
    linear: _ColumnKey | None = None
    center: Fraction = Fraction(0)
    offset: Fraction = Fraction(0)
    lower: Fraction | None = None
    upper: Fraction | None = None
    sample: bool = False
    quantile: tuple | None = None

    def finish(self, statistics: dict[_ColumnKey, Statistic], quantiles: dict[tuple, Quantile]) -> OutputColumn:
        def name(key: _ColumnKey | None) -> str | None:
            return None if key is None else statistics[key].name

        noise = None
        if self.kind in ("count", "sum"):
            noise = statistics[self.statistic].noise()  # type: ignore[index]
        elif self.kind == "avg":
            total, count = statistics[self.statistic], statistics[self.denominator]  # type: ignore[index]
            spent = float(total.epsilon + count.epsilon)
            # AVG = center + S̃/Ñ with S = Σ(x − center), so AVG − true = (e_S − (true − center)·e_N)/Ñ and
            # |true − center| ≤ the farther bound. Each error within its 97.5 % interval: 95 % together.
            assert self.lower is not None and self.upper is not None
            reach = float(max(self.upper - self.center, self.center - self.lower))
            numerator = total.halfwidth(0.975) + reach * count.halfwidth(0.975)
            noise = ColumnNoise("ratio", None, spent, 0.0, None, None, ratio_numerator=numerator)
        elif self.kind in ("variance", "stddev"):
            used = [self.statistic, self.denominator, self.linear]
            spent = float(sum(statistics[key].epsilon for key in used if key is not None))
            noise = ColumnNoise("moments", None, spent, 0.0, None, None)
        quantile = None
        if self.kind == "quantile":
            quantile = quantiles[self.quantile]  # type: ignore[index]
            noise = quantile.noise()
        return OutputColumn(self.name, self.kind, self.key, name(self.statistic), name(self.denominator),
                            name(self.linear), self.center, self.offset, self.lower, self.upper, self.sample,
                            quantile, noise)


class _Columns:
    """The statistics and quantiles the query's aggregates need, each computed once."""

    def __init__(self, query: AnalyticQuery, rows_cap: int) -> None:
        self.query = query
        self.rows_cap = rows_cap
        self.tables = dict(query.sources)
        self.stats: dict[_ColumnKey, _Stat] = {}
        # (argument, q, discrete) -> (the values statistic, L, U, grid step)
        self.quantiles: dict[tuple, tuple[_ColumnKey, Fraction, Fraction, Fraction]] = {}

    def need(self, kind: StatKind, argument: str | None, per_group: Fraction,
             clamp: tuple[Fraction, Fraction] | None = None, center: Fraction = Fraction(0), power: int = 1,
             offset: Fraction = Fraction(0)) -> _ColumnKey:
        if kind == "rows" and self.rows_cap == 1:
            kind = "units"  # one row per unit and group: count(*) is the count of distinct units
        key = (kind, argument if kind in ("count", "sum", "values") else None, center, power, offset)
        if key not in self.stats:
            self.stats[key] = _Stat(kind, key[1], per_group, clamp, center, power, offset)
        return key

    def aggregate(self, node: exp.Expression, name: str, written: str | None) -> _Draft:
        """The column of one aggregate; ``written`` is its text as the client wrote it (None: from HAVING)."""
        c = Fraction(self.rows_cap)
        condition = None  # FILTER (WHERE condition), as written: folded into the argument (analytic.filtered)
        whole = node  # the texts of the query's aggregates are found by the whole aggregate, FILTER included
        if isinstance(node, exp.Filter):
            condition = self.query.text_of(node).filter
            node = node.this
        if not isinstance(node, _AGGREGATES):
            raise unsupported(f"{written or node.sql(dialect='postgres')}: only count, sum, avg, variance, stddev "
                              "and quantile aggregates are supported in dp mode", DP_HINT)
        argument = node.this
        if isinstance(node, exp.Count):
            if isinstance(argument, exp.Distinct):
                column = unwrap(argument.expressions[0])  # Power BI writes count(distinct("rows"."id"))
                if not self._is_unit(column) or condition is not None:
                    raise unsupported(f"{written or node.sql(dialect='postgres')}: count(DISTINCT x) is supported "
                                      f"in dp mode only on the privacy unit {self._unit_name()}, without FILTER "
                                      "(a count of distinct values of another column has no bound the policy "
                                      "declares on how much one person moves it)",
                                      f"Count people with count(DISTINCT {self._unit_name()}); to see the values "
                                      "of a column, GROUP BY it (in suppress mode count(DISTINCT column) is "
                                      "answered).")
                return _Draft(name, "count", statistic=self.need("units", None, Fraction(1)))
            if isinstance(argument, exp.Star) or _numeric_constant(argument) is not None:  # count(1) is count(*)
                if condition is None:
                    return _Draft(name, "count", statistic=self.need("rows", None, c))
                return _Draft(name, "count", statistic=self.need("count", filtered(None, condition), c))
            if isinstance(argument, exp.Column) and condition is None:
                text = self._column_sql(argument)  # the same text as the argument of avg(x) on that column
            else:
                text = filtered(self.query.text_of(whole).argument, condition)  # type: ignore[assignment]
            return _Draft(name, "count", statistic=self.need("count", text, c))
        if isinstance(node, exp.WithinGroup):
            function, literal, sign = node.this, node.this.this, 1
            if isinstance(literal, exp.Neg):  # -0 (the allowlist checked that q is a constant in [0, 1])
                literal, sign = literal.this, -1
            q = sign * Fraction(Decimal(literal.name))
            return self._quantile(name, node.expression.expressions[0].this, q,
                                  isinstance(function, exp.PercentileDisc), "PERCENTILE")
        if isinstance(node, exp.Median):
            return self._quantile(name, argument, Fraction(1, 2), False, "MEDIAN")
        function = _function_name(node)  # sum, avg, variance, var_pop, stddev, ...
        lower, upper, text = self._bounds(function, argument, whole)
        text = filtered(text, condition)  # type: ignore[assignment]
        if isinstance(node, exp.Sum):
            return _Draft(name, "sum", statistic=self.need("sum", text, c * max(abs(lower), abs(upper)),
                                                             (lower, upper)))
        # avg, variance, stddev: sums centred on the middle of the bounds (an integer one for integer bounds, so
        # integer sums stay integers), whose sensitivity is half the width of the bounds, not the largest |bound|.
        if lower == upper:
            raise unsupported(f"{function.upper()}({text}) needs bounds lower < upper", BOUNDS_HINT)
        center = (lower + upper) / 2 if (lower.denominator, upper.denominator) != (1, 1) else Fraction(
            (lower.numerator + upper.numerator) // 2)
        half = max(center - lower, upper - center)
        count = self.need("count", text, c)
        linear = self.need("sum", text, c * half, (lower, upper), center)
        if isinstance(node, exp.Avg):
            return _Draft(name, "avg", statistic=linear, denominator=count, center=center, lower=lower, upper=upper)
        # Σ((x − center)² − offset): (x − center)² lies in [0, half²]; the offset halves the magnitude.
        offset = Fraction(math.floor(half * half / 2)) if half.denominator == 1 else half * half / 2
        square = self.need("sum", text, c * max(offset, half * half - offset), (lower, upper), center, 2, offset)
        kind, sample = _SPREADS[type(node)]
        return _Draft(name, kind, statistic=square, denominator=count, linear=linear, center=center, offset=offset,
                      lower=lower, upper=upper, sample=sample)

    def _quantile(self, name: str, argument: exp.Expression, q: Fraction, discrete: bool, what: str) -> _Draft:
        lower, upper, text = self._bounds(what, argument)
        if lower == upper:
            raise unsupported(f"{what}({text}) needs bounds lower < upper", BOUNDS_HINT)
        step = Fraction(10) ** math.floor(math.log10((upper - lower) / QUANTILE_STEPS))
        if (lower.denominator, upper.denominator) == (1, 1):
            step = max(step, Fraction(1))  # integer bounds: integer grid points (percentile_disc stays integer)
        values = self.need("values", text, Fraction(self.rows_cap), (lower, upper))
        key = (text, q, discrete)
        self.quantiles[key] = (values, lower, upper, step)
        return _Draft(name, "quantile", quantile=key)

    def _bounds(self, function: str, argument: exp.Expression,
                node: exp.Expression | None = None) -> tuple[Fraction, Fraction, str]:
        written = argument.sql(dialect="postgres")
        derived = self._derived_bounds(argument) if node is not None else None
        if derived is not None:  # a constant, or a CASE of constants and bounded columns: its text as written
            text = self.query.text_of(node).argument  # type: ignore[arg-type]
            assert text is not None
            if max(abs(derived[0]), abs(derived[1])) == 0:
                raise unsupported(f"{function.upper()}({text}) adds up only zeros", DP_HINT)
            return derived[0], derived[1], text
        cast = _unparen(argument)
        cast = cast if isinstance(cast, exp.Cast) and node is not None else None  # checked: a widening cast
        found = self.column_table(cast.this if cast is not None else argument)
        if found is None:
            raise unsupported(f"{function.upper()}({written}) in dp mode takes a column with declared bounds, or "
                              "an expression whose bounds follow from its columns' declared bounds", DP_HINT)
        table, name = found
        if table is None:
            raise unsupported(f"{function.upper()}({written}): qualify the column with its table's alias, so the "
                              "policy's bounds for it can be found", JOIN_HINT)
        policy = _policy_columns(table).get(name)
        if policy is None or policy.lower is None or policy.upper is None:
            raise unsupported(f"{function.upper()}({name}) needs declared bounds for {name}: the noise is "
                              "calibrated to the bounds, never to the data", BOUNDS_HINT)
        lower, upper = Fraction(Decimal(str(policy.lower))), Fraction(Decimal(str(policy.upper)))
        if lower > upper:
            raise unsupported(f"the declared bounds of {name} are inverted ({policy.lower} > {policy.upper})",
                              BOUNDS_HINT)
        if max(abs(lower), abs(upper)) == 0:
            raise unsupported(f"the declared bounds of {name} are both 0", BOUNDS_HINT)
        if cast is not None:  # the column's values, converted without error or change of magnitude
            return lower, upper, self.query.text_of(node).argument  # type: ignore[arg-type, return-value]
        return lower, upper, self._column_sql(_unparen(argument))

    def _derived_bounds(self, argument: exp.Expression) -> tuple[Fraction, Fraction] | None:
        """Bounds that follow from the expression itself and the declared bounds of the columns it reads
        (anonproxy.plan.bounds, the interpreter of the no-error proof): a constant c gives [c, c], a CASE the
        smallest and largest of its results (a NULL result is skipped by the aggregate), arithmetic, rounding
        and casts what they compute. None for a bare column (or a cast of one), and when the value depends on a
        number without declared bounds. Sound whatever the interpreter says: the SQL clamps every value of the
        argument into these bounds before it is added up (_aggregate)."""
        argument = _unparen(argument)
        number = _numeric_constant(argument)
        if number is not None:
            return number, number
        if isinstance(argument, exp.Column) or (isinstance(argument, exp.Cast)
                                                  and isinstance(_unparen(argument.this), exp.Column)):
            return None
        try:
            found = bounds.evaluate(argument, self.facts)
        except bounds.Unsafe:
            return None  # the proof passed with the columns' types; without their bounds no range follows
        if found.type not in bounds.NUMBERS or not (found.low.is_finite() and found.high.is_finite()):
            return None
        return _outward(found.low, ROUND_FLOOR), _outward(found.high, ROUND_CEILING)

    def facts(self, node: exp.Column) -> bounds.ColumnFacts:
        """A column's SQL type and declared bounds, for the bounds of an expression. A number without declared
        bounds is unknown: no bound of use follows from its type's range."""
        name = identifier(node.this) or ""
        found = self.column_table(node)
        if found is None or found[0] is None:
            return bounds.ColumnFacts(name, None)
        table, name = found
        model = table.protected if table.protected is not None else table.linked
        sql_type = model.types.get(name) if model is not None and model.types is not None else None
        policy = _policy_columns(table).get(name)
        if policy is not None and policy.lower is not None and policy.upper is not None:
            # Declared bounds make it a number; its type, when not read (a policy built in memory), as numeric.
            return bounds.ColumnFacts(name, sql_type or "numeric", Decimal(repr(policy.lower)),
                                      Decimal(repr(policy.upper)))
        if sql_type is not None and bounds.column_value(bounds.ColumnFacts(name, sql_type)).type in bounds.NUMBERS:
            return bounds.ColumnFacts(name, None)
        return bounds.ColumnFacts(name, sql_type)

    def column_table(self, node: exp.Expression) -> tuple[ResolvedTable | None, str] | None:
        """The table a column reference reads (None when unqualified and not declared by exactly one table)."""
        node = _unparen(node)
        if not isinstance(node, exp.Column) or node.args.get("db") is not None:
            return None
        name = identifier(node.this)
        if name is None:
            return None
        qualifier = identifier(node.args.get("table"))
        if qualifier is not None:
            return self.tables.get(qualifier), name
        if len(self.tables) == 1:
            return next(iter(self.tables.values())), name
        owners = [table for table in self.tables.values() if name in _policy_columns(table)]
        return (owners[0] if len(owners) == 1 else None), name

    def _column_sql(self, node: exp.Column) -> str:
        qualifier = identifier(node.args.get("table"))
        name = quote(identifier(node.this) or "")
        return f"{quote(qualifier)}.{name}" if qualifier is not None else name

    def _is_unit(self, node: exp.Expression) -> bool:
        found = self.column_table(node)
        if found is None or found[0] is None:
            return False
        table, name = found
        if table.protected is not None:
            return name == table.protected.unit_column
        return table.linked is not None and name == table.linked.column

    def _unit_name(self) -> str:
        return self.query.unit.split(".")[-1].strip('"')


def _outward(number: Decimal, rounding: str) -> Fraction:
    """``number`` to 15 significant digits, rounded away from the inside of the bounds (wider bounds stay valid)."""
    with localcontext() as context:
        context.prec, context.rounding = 15, rounding
        return Fraction(+number)


def _policy_columns(table: ResolvedTable | None) -> dict[str, ColumnPolicy]:
    if table is None:
        return {}
    if table.protected is not None:
        return table.protected.columns
    return table.linked.columns if table.linked is not None else {}


def _unparen(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def _function_name(node: exp.Expression) -> str:
    """An aggregate's function name, for messages (its sqlglot class: var_samp is variance)."""
    names = {exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Variance: "variance",
             exp.VariancePop: "var_pop", exp.Stddev: "stddev", exp.StddevSamp: "stddev_samp",
             exp.StddevPop: "stddev_pop", exp.Median: "median", exp.PercentileCont: "percentile_cont",
             exp.PercentileDisc: "percentile_disc"}
    return names.get(type(node), "?column?")


def _having(node: exp.Expression, keys: list[exp.Expression], query: AnalyticQuery, drafts: list[_Draft],
            hidden: list[_Draft], columns: _Columns) -> tuple:
    """HAVING compiled over the answer row (visible columns, then hidden ones it needs)."""
    positions: dict[exp.Expression, int] = {}
    for index, item in enumerate(query.items):
        positions.setdefault(canonical(_node(item)), index)

    def value_of(candidate: exp.Expression) -> int | None:
        wanted = canonical(candidate)
        if wanted in positions:
            return positions[wanted]
        if isinstance(candidate, _AGGREGATES) or (isinstance(candidate, exp.Filter)
                                                   and isinstance(candidate.this, _AGGREGATES)):
            hidden.append(columns.aggregate(candidate, f"having {len(hidden) + 1}", None))
            positions[wanted] = len(drafts) + len(hidden) - 1
            return positions[wanted]
        if wanted in keys:
            hidden.append(_Draft(f"having {len(hidden) + 1}", "key", key=keys.index(wanted)))
            positions[wanted] = len(drafts) + len(hidden) - 1
            return positions[wanted]
        if isinstance(candidate, exp.Column):
            raise unsupported(f"HAVING {candidate.sql(dialect='postgres')}: a column in HAVING must be a GROUP BY "
                              "expression", DP_HINT)
        return None

    return compile_having(node, value_of, lambda index: [*drafts, *hidden][index].kind != "key")


def _having_checks(tree: tuple | None, drafts: list[_Draft], hidden: list[_Draft], query: AnalyticQuery) -> list[str]:
    """SQL conditions repeating HAVING's comparisons that involve a grouping key, with every aggregate standing in as
    a numeric, for PostgreSQL to type-check (text > 5 is an error there, not an empty answer): the plan's SQL parses
    them in a CTE it never runs."""
    if tree is None or tree[0] in ("value", "const"):
        return []
    if tree[0] != "cmp":
        return [check for child in tree[1:] for check in _having_checks(child, drafts, hidden, query)]
    outputs = [*drafts, *hidden]

    def sql(node: tuple) -> str | None:
        if node[0] == "value":
            draft = outputs[node[1]]
            return f"({query.keys[draft.key]})" if draft.kind == "key" else "0::numeric"  # type: ignore[index]
        constant = node[1]
        if node[0] != "const" or constant is None:
            return None
        if isinstance(constant, str):
            return _text_literal(constant)
        return str(constant).lower() if isinstance(constant, bool) else f"{constant:f}"

    left, right = sql(tree[2]), sql(tree[3])
    if left is None or right is None or not any(side.startswith("(") for side in (left, right)):
        return []
    return [f"{left} {tree[1]} {right}"]


def selection_threshold(scale: Fraction | float, reach: int, delta: float) -> int:
    """The smallest τ ≥ 2 with reach · Pr[1 + N ≥ τ] ≤ δ, N ~ discrete Laplace(scale).

    Pr[N ≥ k] = α^k / (1 + α) for k ≥ 1, α = e^(−1/t). A key that only one unit holds has exact count 1 (the
    count is of distinct units), and one unit holds at most ``reach`` such keys. So τ − 1 ≥ t·(ln(reach/δ) −
    ln(1 + α)), evaluated exactly for any t (:func:`ceil_scaled_log`).
    """
    return max(2, 1 + ceil_scaled_log(scale, lambda alpha: (reach / Decimal(delta)).ln() - (1 + alpha).ln()))


def _params(params: DPParams) -> tuple[Fraction, Fraction, int, int]:
    hint = "Ask the DBA to fix the role's dp parameters."
    if not (isinstance(params.epsilon, (int, float)) and math.isfinite(params.epsilon) and params.epsilon > 0):
        raise unsupported("the role's ε must be a positive number", hint)
    if not (isinstance(params.delta, (int, float)) and 0 <= params.delta < 1):
        raise unsupported("the role's δ must be in [0, 1)", hint)
    for name in ("max_groups_per_unit", "max_rows_per_unit"):
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise unsupported(f"the role's {name} must be a positive integer", hint)
    return (Fraction(params.epsilon), Fraction(params.delta), params.max_groups_per_unit, params.max_rows_per_unit)


def _node(item: Item) -> exp.Expression:
    """A select item's checked expression (analyze() always records it)."""
    assert item.node is not None
    return item.node


def _having_node(query: AnalyticQuery) -> exp.Expression:
    assert query.having_node is not None
    return query.having_node


def _numeric_constant(node: exp.Expression) -> Fraction | None:
    """The value of a finite numeric constant (``1``, ``-2.5``, ``(3)``), else None."""
    node = _unparen(node)
    sign = 1
    if isinstance(node, exp.Neg):
        sign, node = -1, _unparen(node.this)
    if not (isinstance(node, exp.Literal) and not node.is_string):
        return None
    try:
        number = Decimal(node.this)
    except ArithmeticError:
        return None
    return sign * Fraction(number) if number.is_finite() else None


def _public_domains(query: AnalyticQuery, columns: _Columns) -> list[tuple[str, ...]] | None:
    """The declared domain of every GROUP BY key, when every key is a column that has one; else None."""
    domains = []
    for key in query.key_nodes:
        found = columns.column_table(key)
        column = _policy_columns(found[0]).get(found[1]) if found is not None else None
        if column is None or not column.domain:
            return None
        domains.append(tuple(column.domain))
    if math.prod(len(d) for d in domains) > MAX_DOMAIN_CELLS:
        raise unsupported(f"the public domains of the GROUP BY columns have more than {MAX_DOMAIN_CELLS} "
                          "combinations", "Group by fewer columns.")
    return domains


def _tail(query: AnalyticQuery, tree: exp.Select) -> tuple[tuple[OrderKey, ...], int | None, int]:
    order = []
    for item in query.order:
        if item.position is None:
            raise unsupported(f"ORDER BY {item.text} must name an output column in dp mode (ordering happens "
                              "after the noise is added)", "Order by a select-list position or an output alias.")
        words = item.suffix.upper().split()
        descending = "DESC" in words
        nulls_first = ("FIRST" in words) if "NULLS" in words else descending  # PostgreSQL's default
        order.append(OrderKey(item.position - 1, descending, nulls_first))
    limit = _constant(tree.args.get("limit"), "LIMIT")
    offset = _constant(tree.args.get("offset"), "OFFSET")
    return tuple(order), limit, offset or 0


def _constant(node: exp.Expression | None, what: str) -> int | None:
    if node is None:
        return None
    if isinstance(node, exp.Fetch):
        value = node.args.get("count")
        if value is None:
            return 1
    else:
        value = node.args.get("expression")
    if value is None or (isinstance(value, exp.Var) and value.name.upper() == "ALL"):
        return None
    if isinstance(value, exp.Literal) and not value.is_string and value.this.isdigit():
        return int(value.this)
    raise unsupported(f"{what} takes a constant in dp mode ($n parameters are not supported yet)", DP_HINT)


def _literal(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    decimal = Decimal(value.numerator) / Decimal(value.denominator)
    return f"{decimal:f}"


def _text_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _sql(query: AnalyticQuery, statistics: list[Statistic], public: list[tuple[str, ...]] | None, rows_cap: int,
         groups_cap: int, checks: list[str]) -> str:
    keys = [f"anonproxy_g{i}" for i in range(1, len(query.keys) + 1)]
    arguments: dict[str, str] = {}
    for stat in statistics:
        if stat.argument is not None and stat.argument not in arguments:
            arguments[stat.argument] = f"anonproxy_a{len(arguments) + 1}"

    where = [f"WHERE {query.where}"] if query.where is not None else []
    # CTEs that nothing references are never run (PostgreSQL plans no unreferenced SELECT CTE) but still parsed:
    # names are checked, $n parameters typed, and HAVING's comparisons of keys with constants type-checked.
    typecheck = [(HAVING_TYPES, "\n".join([f"SELECT FROM {query.from_sql}",
                                           f"WHERE {' AND '.join(f'({check})' for check in checks)}"]),
                  "HAVING's comparisons of grouping keys with constants: never run")] if checks else []
    if public is not None and not statistics:  # the domains, reading no row
        unread = (UNREAD, "\n".join([f"SELECT FROM {query.from_sql}", *where]),
                  "the client's FROM and WHERE: never run, nothing references it")
        return _with([unread, *typecheck, _domain_cte(public, keys)]) + f"\nSELECT {', '.join(keys)} FROM {DOMAIN}"
    select = [f"{query.unit} AS {UNIT}"]
    select += [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select += [f"{argument} AS {name}" for argument, name in arguments.items()]
    # Without bounding nothing reads the unit (each row is one): leaving it out spares decoding it (SELECT FROM t
    # with no column is valid PostgreSQL).
    plain = [f"SELECT {', '.join(select[1:])}", f"FROM {query.from_sql}", *where]
    rows = [f"SELECT {', '.join([*select, 'random() AS anonproxy_r'])}", f"FROM {query.from_sql}", *where]
    ctes = [*typecheck,
            (GUARD, _guard(query), ("true when every table holds at most one row per unit (a valid unique index on "
             "its non-null unit column, no child table), as of this statement's snapshot: then no row needs to be "
             "dropped")),
            (PLAIN, "\n".join(plain), "the client's FROM and WHERE, when each unit has at most one row"),
            (ROWS, "\n".join(rows), "the client's FROM and WHERE, with a random number per row")]
    if rows_cap == 1 and (groups_cap == 1 or not keys):
        # One random row per unit (so one group): a single sort. Each group then has one row per unit.
        ctes.append((BOUNDED, "\n".join([
            "SELECT * FROM (",
            f"  SELECT *, row_number() OVER (PARTITION BY {UNIT} ORDER BY anonproxy_r) AS anonproxy_row_rank",
            f"  FROM {ROWS}",
            ") AS ranked WHERE anonproxy_row_rank = 1"]), "one row per unit, chosen at random"))
    else:
        cell = ", ".join([UNIT, *keys])
        # The first random number of a cell (unit, group) in the cell's random order is the cell's own.
        cells = [("SELECT *, row_number() OVER cell AS anonproxy_row_rank, first_value(anonproxy_r) OVER cell "
                 "AS anonproxy_cell_r"), f"FROM {ROWS}", f"WINDOW cell AS (PARTITION BY {cell} ORDER BY anonproxy_r)"]
        bounded = ["SELECT *"]
        if keys:
            bounded = [(f"SELECT *, dense_rank() OVER (PARTITION BY {UNIT} ORDER BY anonproxy_cell_r, "
                        f"{', '.join(keys)}) AS anonproxy_group_rank")]
        bounded += [f"FROM {CELLS}", f"WHERE anonproxy_row_rank <= {rows_cap}"]
        ctes += [(CELLS, "\n".join(cells), ("a random order of each unit's rows per group, a random number per "
                  "(unit, group)")),
                 (BOUNDED, "\n".join(bounded), f"at most {rows_cap} row(s) per unit and group" +
                  (", groups ranked at random per unit" if keys else ""))]
    # Two branches, only one of which runs: the guard is a one-time filter (PostgreSQL skips the other scan). The
    # same guard in HAVING drops the row an aggregate without GROUP BY returns for no input.
    single = f"(SELECT single FROM {GUARD})"
    branches = []
    for source, condition, bounded_rows in ((PLAIN, single, False), (BOUNDED, f"NOT {single}", True)):
        aggregates = [f"{_aggregate(stat, arguments, bounded_rows)} AS {stat.name}" for stat in statistics]
        conditions = [condition]
        if bounded_rows and keys and not (rows_cap == 1 and groups_cap == 1):
            conditions.append(f"anonproxy_group_rank <= {groups_cap}")
        branch = [f"SELECT {', '.join([*keys, *aggregates])}", f"FROM {source}", f"WHERE {' AND '.join(conditions)}"]
        branch += [f"GROUP BY {', '.join(keys)}"] if keys else []
        branches.append("\n".join([*branch, f"HAVING {condition}"]))
    final = "\nUNION ALL\n".join(branches)
    if public is None:
        return _with(ctes) + "\n" + final
    ctes.append((STATS, final, f"at most {groups_cap} group(s) per unit; exact per-group statistics"))
    ctes.append(_domain_cte(public, keys))
    on = " AND ".join(f"s.{key}::text = d.{key}" for key in keys)
    outer = [f"SELECT {', '.join(f'd.{key}' for key in keys)}, "
             + ", ".join(f"coalesce(s.{stat.name}, {_EMPTY[stat.kind]}) AS {stat.name}" for stat in statistics),
             f"FROM {DOMAIN} AS d LEFT JOIN {STATS} AS s ON {on}"]
    return _with(ctes) + "\n" + "\n".join(outer)


def _domain_cte(public: list[tuple[str, ...]], keys: list[str]) -> tuple[str, str, str]:
    domain_from = []
    for i, (values, key) in enumerate(zip(public, keys, strict=True)):
        array = ", ".join(_text_literal(v) for v in values)
        domain_from.append(f"unnest(ARRAY[{array}]::text[]) AS d{i + 1}({key})")
    domain = [f"SELECT {', '.join(f'd{i + 1}.{key}' for i, key in enumerate(keys))}",
              f"FROM {' CROSS JOIN '.join(domain_from)}"]
    return DOMAIN, "\n".join(domain), "every value of the declared public domains"


def _guard(query: AnalyticQuery) -> str:
    """SQL: whether each table of the query has a valid, live, non-partial unique index on exactly its unit column
    (the linked key for a linked table), that column is NOT NULL, and the table has no inheritance child or
    partition: FROM t reads those too, and the index does not cover them. (relhassubclass may stay true after the
    last child is dropped, until a VACUUM: then bounding runs, which is safe.)"""
    if any(table.reference is not None for _, table in query.sources):
        # A reference table's unique key was read with the policy; one dropped since (duplicates added) would let a
        # unit's row match twice until the proxy loads the policy again. Bounding keeps one row per unit whatever
        # the catalog says now.
        return "SELECT false AS single"
    pairs = set()
    for _, table in query.sources:
        column = table.protected.unit_column if table.protected is not None else table.linked.column  # type: ignore[union-attr]
        pairs.add(f"({_text_literal(table.qualified)}::regclass::oid, {_text_literal(column)}::name)")
    return "\n".join([
        "SELECT count(DISTINCT i.indrelid) = " + str(len(pairs)) + " AS single",
        "FROM pg_catalog.pg_index AS i",
        "JOIN pg_catalog.pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]",
        "JOIN pg_catalog.pg_class AS c ON c.oid = i.indrelid AND NOT c.relhassubclass",
        "WHERE i.indisunique AND i.indisvalid AND i.indislive AND i.indnkeyatts = 1 AND i.indpred IS NULL",
        "  AND i.indexprs IS NULL AND a.attnotnull",
        f"  AND (i.indrelid, a.attname) IN ({', '.join(sorted(pairs))})"])


_EMPTY = {"units": "0", "rows": "0", "count": "0", "sum": "0", "values": "'{}'"}  # an empty group's value


def _aggregate(stat: Statistic, arguments: dict[str, str], bounded: bool) -> str:
    if stat.kind == "units":  # distinct units: every row without bounding, else each unit's first row in the group
        return "count(*) FILTER (WHERE anonproxy_row_rank = 1)" if bounded else "count(*)"
    if stat.kind == "rows":
        return "count(*)"
    argument = arguments[stat.argument]  # type: ignore[index]
    if stat.kind == "count":
        return f"count({argument})"
    assert stat.clamp is not None
    # GREATEST/LEAST skip NULLs (GREATEST(NULL, 17) = 17): a NULL must stay NULL, so that sum and array_agg skip it.
    clamped = (f"CASE WHEN {argument} IS NOT NULL THEN LEAST(GREATEST({argument}, {_literal(stat.clamp[0])}), "
               f"{_literal(stat.clamp[1])}) END")
    if stat.kind == "values":
        return f"array_agg({clamped}) FILTER (WHERE {argument} IS NOT NULL)"
    if stat.power == 1 and stat.offset == 0:
        total = f"coalesce(sum({clamped}), 0)"  # in the column's own type, like PostgreSQL's sum
        # Σ(x − c) = Σx − c·n: the same number, without per-row numeric arithmetic
        return total if stat.center == 0 else f"{total} - {_literal(stat.center)} * count({argument})"
    centred = f"({clamped})::numeric - {_literal(stat.center)}"  # numeric: no overflow, exact
    term = centred if stat.power == 1 else f"({centred}) * ({centred})"
    if stat.offset:
        term = f"{term} - {_literal(stat.offset)}"
    return f"coalesce(sum({term}), 0)"


def _with(ctes: list[tuple[str, str, str]]) -> str:
    parts = []
    for name, body, comment in ctes:
        indented = "\n".join("  " + line for line in body.split("\n"))
        parts.append(f"{name} AS (\n  -- {comment}\n{indented}\n)")
    return "WITH " + ",\n".join(parts)


# --- answering ----------------------------------------------------------------------


def answer(plan: DPPlan, rows: list[tuple]) -> tuple[list[tuple], list[ColumnNoise | None]]:
    """Noisy rows for the client from the rows of ``plan.sql``, and the noise of each output column (a plan
    without post-aggregate expressions; else :func:`released_rows`, the post statement, then :func:`finish`).

    Call only after the plan's (ε, δ) has been charged. Every value of every statistic gets fresh noise from
    :mod:`secrets`-driven exact samplers; nothing here depends on the data except through those noisy values.
    """
    assert plan.post is None, "a plan with post-aggregate expressions needs its post statement run"
    return finish(plan, released_rows(plan, rows), None)


def released_rows(plan: DPPlan, rows: list[tuple]) -> list[tuple]:
    """The released groups' answer rows (output columns, then hidden ones), noisy, in the order of their keys:
    partition selection and a HAVING compiled by dp_having applied; ORDER BY and LIMIT not yet."""
    positions = {stat.name: plan.keys + i for i, stat in enumerate(plan.statistics)}
    by_name = {stat.name: stat for stat in plan.statistics}
    result = []
    # PostgreSQL's row order depends on the data (a hash join emits the empty public groups last): release the
    # groups in a fixed order of their keys instead, which ORDER BY refines and LIMIT cuts.
    for row in sorted(rows, key=functools.partial(_key_order, plan)):
        noisy: dict[object, object] = {}  # statistic name or Quantile -> its one noisy value in this group
        if plan.selection is not None:
            stat = by_name[plan.selection]
            value = _noisy(stat, row[positions[stat.name]])
            assert plan.threshold is not None
            if value < plan.threshold:  # type: ignore[operator]
                continue
            noisy[stat.name] = value
        for stat in plan.statistics:
            if stat.name not in noisy:
                value = row[positions[stat.name]]
                noisy[stat.name] = value if stat.kind == "values" else _noisy(stat, value)
        out = tuple(_output(column, row, noisy) for column in plan.columns + plan.hidden)
        if plan.having is not None and not holds(plan.having, out):
            continue
        result.append(out)
    return result


def post_arrays(plan: DPPlan, released: list[tuple]) -> list[list[object]]:
    """The post statement's parameters: the row numbers 1..n, then each value column it reads, as lists."""
    assert plan.post is not None
    return [list(range(1, len(released) + 1)), *([row[i] for row in released] for i in plan.post.values)]


def finish(plan: DPPlan, released: list[tuple], computed: list[tuple] | None,
           ) -> tuple[list[tuple], list[ColumnNoise | None]]:
    """The client's rows: the post statement's ``computed`` rows (row number, computed columns, HAVING) merged
    into the released ones, then ORDER BY, OFFSET and LIMIT, all over released values."""
    result = []
    if plan.post is not None:
        assert computed is not None and len(computed) == len(released)
        for row, extra in zip(released, sorted(computed, key=lambda r: r[0]), strict=True):
            if plan.post.having and extra[-1] is not True:
                continue
            merged = list(row)
            for position, value_ in zip(plan.post.computed, extra[1:], strict=False):
                merged[position] = value_
            result.append(tuple(merged[:len(plan.columns)]))
    else:
        result = [row[:len(plan.columns)] for row in released]
    result = _ordered(result, plan.order)  # stable: ties stay in key order
    end = None if plan.limit is None else plan.offset + plan.limit
    return result[plan.offset:end], [column.noise for column in plan.columns]


def _key_order(plan: DPPlan, row: tuple) -> tuple:
    """A sort key of a SQL row's group keys that depends on nothing but their values: a public key's position in
    its declared domain, else the value itself (NULL last, as PostgreSQL sorts ascending)."""
    if plan.domains is not None:
        return tuple(domain.index(value) for domain, value in zip(plan.domains, row[:plan.keys], strict=True))
    return tuple(_value_order(value) for value in row[:plan.keys])


def _value_order(value: object) -> tuple:
    """NULL and NaN after every number (PostgreSQL's order), other values by themselves or, if they have no
    order of their own, by their repr: never an exception, and the same order whatever order they arrive in."""
    nan = (isinstance(value, float) and math.isnan(value)) or (isinstance(value, Decimal) and value.is_nan())
    if value is None or nan:
        return (1 + (value is None), 0)
    return (0, value if isinstance(value, _ORDERABLE) else repr(value))


_ORDERABLE = (int, float, Decimal, str, bytes, datetime.date, datetime.time, datetime.timedelta)


def _noisy(stat: Statistic, value: object) -> int | Decimal | float:
    """The statistic plus discrete Laplace noise: in the type PostgreSQL gave the exact value, or a numeric on the
    statistic's fixed-point grid when it has one."""
    if value is None:
        value = 0
    if stat.resolution is None:
        if isinstance(value, int) and not isinstance(value, bool):
            return value + discrete_laplace(stat.scale)
        exact = Fraction(value) if isinstance(value, float) else Fraction(Decimal(value))  # type: ignore[arg-type]
        grid = to_grid(exact, 1)  # an integer statistic that came back as numeric (sum of bigint)
        return _like(value, Fraction(grid + discrete_laplace(stat.scale)))
    exact = Fraction(value) if isinstance(value, float) else Fraction(Decimal(value))  # type: ignore[arg-type]
    grid = to_grid(exact, stat.resolution)
    return _decimal((grid + discrete_laplace(stat.scale)) * stat.resolution)


def _like(template: object, value: Fraction) -> int | Decimal | float:
    if isinstance(template, float):
        return float(value)
    if isinstance(template, int):
        return int(value) if value.denominator == 1 else _decimal(value)
    return _decimal(value)


def _decimal(value: Fraction) -> Decimal:
    if value.denominator == 1:
        return Decimal(value.numerator)
    return Decimal(value.numerator) / Decimal(value.denominator)


def _output(column: OutputColumn, row: tuple, noisy: dict[object, object]) -> object:
    if column.kind == "post":
        return None  # the post statement computes it
    if column.kind == "key":
        return row[column.key]  # type: ignore[index]
    if column.kind == "count":
        return max(0, noisy[column.statistic])  # type: ignore[call-overload, index]
    if column.kind == "sum":
        total = noisy[column.statistic]  # type: ignore[index]
        if column.noise is not None and column.noise.resolution is not None and column.noise.ci95_halfwidth:
            return supported_digits(_fraction(total), column.noise.ci95_halfwidth)  # numeric on its grid
        return total
    if column.kind == "quantile":
        assert column.quantile is not None
        # One draw per quantile and group, whichever columns and HAVING repeat it: it is charged once.
        if column.quantile not in noisy:
            noisy[column.quantile] = column.quantile.draw(noisy[column.quantile.values])  # type: ignore[arg-type]
        return noisy[column.quantile]
    n = max(int(noisy[column.denominator]), 1)  # type: ignore[call-overload, index]
    mean = _fraction(noisy[column.statistic if column.kind == "avg" else column.linear]) / n  # type: ignore[index]
    lower, upper = column.lower, column.upper
    assert lower is not None and upper is not None
    if column.kind == "avg":
        value = min(max(column.center + mean, lower), upper)  # post-processing: AVG lies within the bounds
        assert column.noise is not None and column.noise.ratio_numerator is not None
        rounded = supported_digits(value, column.noise.ratio_numerator / n)
        if not lower <= Fraction(rounded) <= upper:  # rounding must not leave the bounds either
            return _decimal(min(max(Fraction(rounded), lower), upper))
        return rounded
    # Σ((x − c)² − o) / n + o − ((Σ(x − c)) / n)² is the population variance; n/(n − 1) times it the sample one.
    variance = _fraction(noisy[column.statistic]) / n + column.offset - mean * mean  # type: ignore[index]
    half = (upper - lower) / 2
    variance = min(max(variance, Fraction(0)), half * half)  # values in [L, U] have a variance ≤ ((U − L)/2)²
    if column.sample:
        variance = variance * n / max(n - 1, 1)
    if column.kind == "variance":
        return round(_decimal(variance), 16)
    return round(_decimal(variance).sqrt(), 16)


def supported_digits(value: Fraction, halfwidth: float) -> Decimal:
    """``value`` rounded to one decimal place below the leading digit of its 95 % interval's half-width: ±51
    gives whole numbers, ±0.3 hundredths. Finer digits are noise, not information. The half-width comes from
    the plan and the group's noisy count only, so the rounding is post-processing of noisy values: it costs
    no privacy and reveals nothing about the data."""
    if not (math.isfinite(halfwidth) and halfwidth > 0):
        return round(_decimal(value), 16)
    exponent = math.floor(math.log10(halfwidth)) - 1
    steps = round(value / Fraction(10) ** exponent)  # half to even
    return Decimal(steps).scaleb(exponent)


def _fraction(value: object) -> Fraction:
    return Fraction(value) if isinstance(value, (int, float)) else Fraction(Decimal(value))  # type: ignore[arg-type]


def _ordered(rows: list[tuple], order: tuple[OrderKey, ...]) -> list[tuple]:
    if not order:
        return rows

    def compare(a: tuple, b: tuple) -> int:
        for key in order:
            x, y = a[key.position], b[key.position]
            if x is None or y is None:
                if x is None and y is None:
                    continue
                return (-1 if key.nulls_first else 1) * (1 if y is not None else -1)
            if x != y:
                result = -1 if x < y else 1
                return -result if key.descending else result
        return 0

    return sorted(rows, key=functools.cmp_to_key(compare))
