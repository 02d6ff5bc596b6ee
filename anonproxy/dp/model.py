"""What a dp plan is: the statistics its SQL computes, the noise each gets, and how each client column follows.

Values only (:class:`DPPlan` and its parts); :mod:`anonproxy.dp.plan` makes them from a statement,
:mod:`anonproxy.dp.bounded_sql` writes the SQL they describe, :mod:`anonproxy.dp.finish` turns the SQL's rows
into the noisy answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Literal

import psycopg

from anonproxy.dp.mechanisms import CONFIDENCE, discrete_laplace_halfwidth, discrete_laplace_stddev
from anonproxy.dp.quantiles import dp_quantile, rank_halfwidth
from anonproxy.plan import outer as nested_shapes

StatKind = Literal["units", "rows", "count", "sum", "values"]
# "post": computed by the plan's post statement over the noisy values (a post-aggregate expression)
ColumnKind = Literal["key", "count", "sum", "avg", "variance", "stddev", "quantile", "post"]

_INT8, _FLOAT4, _FLOAT8, _NUMERIC = 20, 700, 701, 1700  # PostgreSQL type OIDs of answer values
_FLOATS = (_FLOAT4, _FLOAT8)

StatKind = Literal["units", "rows", "count", "sum", "values"]
# "post": computed by the plan's post statement over the noisy values (a post-aggregate expression)
ColumnKind = Literal["key", "count", "sum", "avg", "variance", "stddev", "quantile", "post"]

@dataclass(frozen=True)
class DPParams:
    epsilon: float
    delta: float
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1  # per unit and group
    accounting: Literal["basic", "zcdp"] = "basic"


@dataclass(frozen=True)
class Statistic:
    """One exact per-group statistic of the SQL, and the discrete Laplace noise ``answer`` adds to it.

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
    rho: float = 0.0
    delta_add: float = 0.0

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


def to_decimal(value: Fraction) -> Decimal:
    """A Fraction as a Decimal (a grid point: its denominator divides a power of ten)."""
    if value.denominator == 1:
        return Decimal(value.numerator)
    return Decimal(value.numerator) / Decimal(value.denominator)
