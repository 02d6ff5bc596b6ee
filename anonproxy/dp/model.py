"""What a dp plan is: the statistics its SQL computes, the noise each gets, and how each client column follows.

Values only (:class:`DPPlan` and its parts); :mod:`anonproxy.dp.plan` makes them from a statement,
:mod:`anonproxy.dp.bounded_sql` writes the SQL they describe, :mod:`anonproxy.dp.finish` turns the SQL's rows
into the noisy answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

import psycopg

from anonproxy.dp.mechanisms import (
    CONFIDENCE,
    discrete_gaussian_halfwidth,
    discrete_gaussian_stddev,
    discrete_laplace_halfwidth,
    discrete_laplace_stddev,
)
from anonproxy.dp.quantiles import dp_quantile, rank_halfwidth
from anonproxy.dp.time_domains import TimeDomain
from anonproxy.plan import outer as nested_shapes

# "distinct": count(DISTINCT x) over the bounded rows (a unit's rows there hold at most c distinct values of x)
StatKind = Literal["units", "rows", "count", "distinct", "sum", "values"]
# "post": computed by the plan's post statement over the noisy values (a post-aggregate expression)
# "interval": dp_interval_low/high of another column (``of``), from the same noisy values
ColumnKind = Literal["key", "count", "sum", "avg", "variance", "stddev", "quantile", "post", "interval"]

_INT8, _FLOAT4, _FLOAT8, _NUMERIC = 20, 700, 701, 1700  # PostgreSQL type OIDs of answer values
_FLOATS = (_FLOAT4, _FLOAT8)
Mechanism = Literal["discrete_laplace", "discrete_gaussian"]
MECHANISM_NAMES = {"discrete_laplace": "discrete Laplace", "discrete_gaussian": "discrete Gaussian"}


@dataclass(frozen=True)
class DPParams:
    epsilon: float
    delta: float
    # What a unit may contribute (a test's or benchmark's own; None: the bounds the role declares on the table, sql/0034)
    max_groups_per_unit: int | None = None
    max_rows_per_unit: int | None = None  # per unit and group
    accounting: Literal["basic", "zcdp"] = "basic"


@dataclass(frozen=True)
class Statistic:
    """One exact per-group statistic of the SQL, and the noise ``answer`` adds to it: a discrete Laplace of scale
    ``scale``, or a discrete Gaussian of parameter ``sigma2`` with the same variance (docs/dp.md, "Mechanism
    choice and costs"). ``epsilon`` is its share of the query's ε, the accuracy level both give it; ``rho`` its
    cost in zero-concentrated DP.

    A ``sum`` adds up f(x) = (clamp(x) − center)^power − offset over the bounded rows, where clamp(x) is x
    clamped to the declared [L, U] (``clamp``); ``per_group`` is c times the largest |f|. A ``values``
    statistic is the array of the group's clamped values, for quantiles (no noise of its own).
    """

    name: str  # its column in the SQL
    kind: StatKind
    argument: str | None  # the aggregate's argument, rendered (None for units/rows)
    per_group: Fraction  # how much one unit can move it in one group
    sensitivity: Fraction  # L1 over all groups: per_group × groups a unit can reach
    epsilon: Fraction
    resolution: Fraction | None  # grid of a sum whose SQL value is not an integer
    scale: Fraction  # discrete Laplace t, in integer (grid) units
    clamp: tuple[Fraction, Fraction] | None = None  # sum, values: the declared [L, U] the SQL clamps to
    center: Fraction = Fraction(0)
    power: int = 1
    offset: Fraction = Fraction(0)
    mechanism: Mechanism = "discrete_laplace"
    sigma2: Fraction | None = None  # discrete Gaussian: its parameter σ², in grid units²
    rho: Fraction = Fraction(0)  # zCDP cost: ε²/2 (Laplace at ε) or Δ₂²/(2σ²) (Gaussian)

    @property
    def value_scale(self) -> float:
        """The noise scale in the statistic's own units (the Laplace t, or the Gaussian σ)."""
        own = self.scale if self.sigma2 is None else Fraction(self.sigma2) ** 0.5
        return float(own * (self.resolution or 1))

    @property
    def stddev(self) -> float:
        """The noise's standard deviation in the statistic's own units."""
        grid = discrete_laplace_stddev(self.scale) if self.sigma2 is None else discrete_gaussian_stddev(self.sigma2)
        return grid * float(self.resolution or 1)

    def halfwidth(self, confidence: float = CONFIDENCE) -> float:
        """The noisy value is within this of the exact one with probability ≥ ``confidence``, in its own units."""
        rounding = float(self.resolution) / 2 if self.resolution is not None else 0.0
        grid = (discrete_laplace_halfwidth(self.scale, confidence) if self.sigma2 is None
                else discrete_gaussian_halfwidth(self.sigma2, confidence))
        return grid * float(self.resolution or 1) + rounding

    def noise_parameters(self, weight: Fraction) -> tuple[str, Fraction, Fraction]:
        """(mechanism, its parameter in grid units, ``weight``): this noise as mechanisms.combined_halfwidth reads it."""
        return self.mechanism, self.scale if self.sigma2 is None else self.sigma2, weight

    def label(self) -> str:
        """What it measures, for notices."""
        if self.kind == "units":
            return "number of people"
        if self.kind == "rows":
            return "number of rows"
        if self.kind == "count":
            return f"count({self.argument})"
        if self.kind == "distinct":
            return f"count(DISTINCT {self.argument})"
        term = self.argument if self.center == 0 else f"{self.argument} − {self.center}"
        if self.power == 2:
            term = f"({term})²" + (f" − {self.offset}" if self.offset else "")
        return f"sum({term})"

    def noise(self) -> ColumnNoise:
        return ColumnNoise(self.mechanism, self.value_scale, float(self.epsilon), 0.0, self.stddev, self.halfwidth(),
                           self.resolution, rho=as_float(self.rho))


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
        return int(exact) if exact.denominator == 1 else to_decimal(exact)

    def noise(self) -> ColumnNoise:
        scale = 2 * self.max_contributions * max(self.q, 1 - self.q) / self.epsilon
        ranks = rank_halfwidth(self.q, self.lower, self.upper, self.epsilon, resolution=self.resolution,
                               max_contributions=self.max_contributions)
        return ColumnNoise("exponential", float(scale), float(self.share), 0.0, None, None, self.resolution,
                           rank_halfwidth=ranks)


@dataclass(frozen=True)
class ColumnNoise:
    """What the accuracy notice says about one output column (the same for every row)."""

    mechanism: str  # "discrete_laplace", "discrete_gaussian", "derived" (a SUM from AVG's statistics), "ratio"
    # (AVG), "moments" (VARIANCE/STDDEV) or "exponential"
    scale: float | None
    epsilon: float
    delta: float
    stddev: float | None
    ci95_halfwidth: float | None
    resolution: Fraction | None = None
    rank_halfwidth: float | None = None  # exponential: 95 % of answers are within this many ranks
    ratio_numerator: float | None = None  # ratio: the widest row's 95 % interval is ± this / (its noisy count)
    rho: float | None = None  # the zCDP cost of the statistic(s) it reads
    parts: tuple[ColumnNoise, ColumnNoise] | None = None  # ratio: the noise of its sum and of its count
    ratio_center: float | None = None  # ratio: ± this / n when the average is at the middle of the bounds

    def describe(self, column: str) -> str:
        if self.mechanism == "ratio":
            assert self.ratio_numerator is not None and self.ratio_center is not None
            a, b = self.ratio_numerator, self.ratio_center
            return (f"{column}: noisy sum / noisy count, ε={self.epsilon:g}, values clamped to the declared bounds, "
                    f"95% interval per row ±q/n for a group of n values, q from {b:.4g} (average at the middle "
                    f"of the bounds) to {a:.4g} (at a bound) (±{b / 1000:.3g} to ±{a / 1000:.3g} at n = 1000; "
                    "dp_interval_low/high give each row's), rounded to the digits that interval supports")
        if self.mechanism == "moments":
            return (f"{column}: from noisy count, sum and sum of squares, ε={self.epsilon:g}, clamped to what "
                    "the declared bounds allow")
        if self.mechanism == "exponential":
            return (f"{column}: exponential mechanism on a grid of step {self.resolution}, ε={self.epsilon:g}, "
                    f"95% within ±{self.rank_halfwidth:.3g} ranks of the grid point nearest the true quantile")
        if self.mechanism == "derived":  # a sum from avg's statistics: Σ(x − c) + c·n
            parts = [f"{column}: Σ(x − c) + c·n from the statistics of its average, ε={self.epsilon:g}"]
        elif self.mechanism == "discrete_gaussian":
            parts = [f"{column}: discrete Gaussian at the sd of a discrete Laplace with ε={self.epsilon:g}",
                     f"ρ={self.rho:.4g}", f"σ {self.scale:g}"]
        else:
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

    name: str  # the output column's name, as PostgreSQL names it in the client's statement
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
    bound: Literal["low", "high"] | None = None  # kind "interval": which end of ``of``'s 95 % interval
    of: OutputColumn | None = None  # kind "interval": the aggregate column it bounds (planned like any other)


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
    # The answer's costs (docs/dp.md, "Mechanism choice and costs"): `epsilon`, `delta` its (ε, δ) pair for basic
    # composition; `rho`, `delta_add` (below) the same answer as `delta_add`-approximately `rho`-zCDP.
    epsilon: float
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
    # LIMIT $n / OFFSET $n: the parameter's number; the proxy puts its bound value in limit / offset before finishing
    limit_parameter: int | None = None
    offset_parameter: int | None = None
    unmeasured_parameters: tuple[int, ...] = ()  # those only LIMIT and OFFSET use: not part of the measurement
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1
    hidden: tuple[OutputColumn, ...] = ()  # aggregates HAVING needs that the select list does not show
    having: tuple[Any, ...] | None = None  # compiled HAVING (dp_having) over columns + hidden
    # the GROUP BY keys' public domains, in order: declared values, or a calendar key's buckets (dp/time_domains.py)
    domains: tuple[tuple[str, ...] | TimeDomain, ...] | None = None
    post: PostProcess | None = None  # post-aggregate expressions, computed over the noisy values
    nested: nested_shapes.Outer | nested_shapes.Series | None = None  # the released rows' next step
    rho: float = 0.0
    delta_add: float = 0.0
    # `sql` with the statistics and the keys in a canonical order (finish.canonical_statistics, `key_order`) and
    # without HAVING's never-run type checks: the measurement, whatever the order of the select list and GROUP BY
    # and whatever HAVING says (the answer cache's key reads it)
    measured: str = ""
    # The keys' canonical order, the one `measured` and the answer cache use: key_order[i] is the position in `sql`
    # of the i-th key in that order (empty: the keys' own order)
    key_order: tuple[int, ...] = ()
    # `measured` as the answer cache's key reads it (answers.folded), computed where the plan is priced (the analysis
    # process) so that the worker does not tokenize it again; "" until then. Not part of the plan's repr or equality:
    # the key is the same with or without it.
    measured_tokens: str = field(default="", repr=False, compare=False)
    # The keys as the client's FROM and WHERE read them (bounded_sql.keys_sql; "" without keys): prepared, never
    # run, for what PostgreSQL describes of the key columns. Derived from `sql`'s query: not part of equality.
    keys_sql: str = field(default="", repr=False, compare=False)

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
        lines += self.statistic_lines()
        if self.selection is not None:
            lines.append(f"groups released only if their noisy count of people reaches {self.threshold} "
                         f"(δ={self.delta_add:g}); near it a released count of people is biased upward, and its "
                         "interval from dp_interval_low/high accounts for that (it covers 95% of released groups)")
        return lines

    def statistic_lines(self) -> list[str]:
        """Each noisy statistic once: what it measures, which outputs read it, its share of ε and its noise."""
        uses: dict[str, list[str]] = {}
        roles = (("statistic", ""), ("denominator", "'s count"), ("linear", "'s sum"))
        for column in self.columns + self.hidden:
            for field_name, role in roles:
                name = getattr(column, field_name)
                if name is not None and column.kind not in ("key", "post", "quantile"):
                    label = column.name + (role if column.kind != "count" else "")
                    if label not in uses.setdefault(name, []):
                        uses[name].append(label)
        if self.selection is not None:
            uses.setdefault(self.selection, []).append("partition selection")
        lines = []
        for stat in self.statistics:
            if stat.kind == "values":
                continue
            parts = [f"statistic {stat.name}: {stat.label()} for {', '.join(uses.get(stat.name, ['?']))}",
                     f"{MECHANISM_NAMES[stat.mechanism]}, ε share {float(stat.epsilon):g}", f"ρ={as_float(stat.rho):.4g}",
                     f"sd {stat.stddev:.4g}"]
            lines.append(", ".join(parts))
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

        def type_of(column: OutputColumn) -> int:
            if column.kind == "interval":  # an interval's bounds have the type of the value they bound
                assert column.of is not None
                return type_of(column.of)
            if column.kind == "key":
                return sql_types[column.key]  # type: ignore[index]
            if column.kind == "count":
                return _INT8
            if column.kind == "sum":  # on a fixed-point grid: numeric, unless the argument is a float
                own = statistic[column.statistic]  # type: ignore[index]
                grid = column.noise is not None and column.noise.resolution is not None
                return _NUMERIC if grid and own not in _FLOATS else own
            if column.kind == "quantile":
                assert column.quantile is not None
                return _element_type(statistic[column.quantile.values]) if column.quantile.discrete else _FLOAT8
            # avg: Σ(x − c) in x's type; variance, stddev: the same linear sum
            linear = statistic[column.statistic if column.kind == "avg" else column.linear]  # type: ignore[index]
            return _FLOAT8 if linear in _FLOATS else _NUMERIC

        return tuple(computed.get(position, 0) if column.kind == "post" else type_of(column)
                     for position, column in enumerate(self.columns + self.hidden))


def _element_type(array_oid: int) -> int:
    """The element type of an array type (array_agg's result): a discrete quantile has its argument's type."""
    for info in psycopg.postgres.types:
        if info.array_oid == array_oid:
            return info.oid
    return _NUMERIC


def as_float(value: Fraction) -> float:
    """A cost as a float: past the largest double (a huge ε squared) infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def to_decimal(value: Fraction) -> Decimal:
    """A Fraction as a Decimal (a grid point: its denominator divides a power of ten)."""
    if value.denominator == 1:
        return Decimal(value.numerator)
    return Decimal(value.numerator) / Decimal(value.denominator)
