"""Differential-privacy mode for one aggregate query: a plan, then an answer (docs/dp.md).

Pure and I/O-free. :func:`plan_dp` reads the client's SQL with the same
parser, validator and expression allowlist as suppression mode
(:func:`anonproxy.rewrite.analytic.analyze`), and builds SQL for the service
connection that returns *exact, contribution-bounded* per-group statistics
(DESIGN.md principle 6). :func:`answer` adds exact discrete noise to those
statistics in the proxy (principle 4), keeps non-public groups only when a
noisy count of distinct units passes a threshold (partition selection), and
then applies ORDER BY / LIMIT / OFFSET to the noisy values (post-processing).

The plan is a deterministic function of (sql, policy, params), so it can be
cached by text; its ``epsilon`` and ``delta`` are the cost to charge to the
ledger *before* :func:`answer`'s rows leave the proxy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Literal

import sqlglot
from sqlglot import exp

from anonproxy.policy.model import (
    ColumnPolicy,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.privacy.mechanisms import (
    discrete_laplace,
    discrete_laplace_halfwidth,
    discrete_laplace_stddev,
    laplace_scale,
    to_grid,
)
from anonproxy.rewrite.analytic import AnalyticQuery, _canonical, analyze
from anonproxy.rewrite.classify import _parse
from anonproxy.rewrite.decision import (
    FEATURE_NOT_SUPPORTED,
    Refusal,
    Reject,
    forbidden,
    unsupported,
)
from anonproxy.rewrite.names import PolicyIndex, identifier, quote
from anonproxy.rewrite.statements import PARSE_HINT, split

__all__ = ["ColumnNoise", "DPParams", "DPPlan", "OutputColumn", "Statistic", "answer", "plan_dp",
           "selection_threshold"]

DP_HINT = ("Supported in dp mode: SELECT <GROUP BY columns>, count(*), count(x), count(DISTINCT <unit>), sum(x), "
           "avg(x) FROM <protected table> [WHERE ...] [GROUP BY ...] [ORDER BY <output columns>] [LIMIT n] "
           "[OFFSET n]; sum/avg need declared bounds.")
BOUNDS_HINT = "Ask the DBA to declare lower and upper bounds for the column in the policy."
MAX_DOMAIN_CELLS = 10_000  # public-domain grid (product of the domains) emitted by the SQL
GRID_UNITS = 1000  # a non-integer sum's sensitivity is about this many grid steps (rounding ≪ noise)

# Column names in the generated SQL (prefixed so they cannot collide with the client's).
ROWS = "anonproxy_rows"
CELLS = "anonproxy_cells"
BOUNDED = "anonproxy_bounded"
STATS = "anonproxy_stats"
DOMAIN = "anonproxy_domain"
UNIT = "anonproxy_unit"

StatKind = Literal["units", "rows", "count", "sum"]
ColumnKind = Literal["key", "count", "sum", "avg"]


@dataclass(frozen=True)
class DPParams:
    epsilon: float
    delta: float
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1  # per unit and group


@dataclass(frozen=True)
class Statistic:
    """One exact per-group statistic of the SQL, and the discrete Laplace noise ``answer`` adds to it."""

    name: str  # its column in the SQL
    kind: StatKind
    argument: str | None  # the aggregate's argument, as written (None for units/rows)
    per_group: Fraction  # how much one unit can move it in one group
    sensitivity: Fraction  # L1 over all groups: per_group × groups a unit can reach
    epsilon: Fraction
    resolution: Fraction | None  # grid of a sum whose SQL value is not an integer
    scale: Fraction  # discrete Laplace t, in integer (grid) units
    bounds: tuple[Fraction, Fraction] | None = None  # sum: the declared [L, U] the SQL clamps to

    @property
    def value_scale(self) -> float:
        """The noise scale in the statistic's own units."""
        return float(self.scale * (self.resolution or 1))

    def noise(self) -> ColumnNoise:
        r = float(self.resolution or 1)
        rounding = float(self.resolution) / 2 if self.resolution is not None else 0.0
        return ColumnNoise("discrete_laplace", self.value_scale, float(self.epsilon), 0.0,
                           discrete_laplace_stddev(self.scale) * r,
                           discrete_laplace_halfwidth(self.scale) * r + rounding, self.resolution)


@dataclass(frozen=True)
class ColumnNoise:
    """What the accuracy notice says about one output column (the same for every row)."""

    mechanism: str  # "discrete_laplace", or "ratio" for AVG (noisy sum / noisy count)
    scale: float | None
    epsilon: float
    delta: float
    stddev: float | None
    ci95_halfwidth: float | None
    resolution: Fraction | None = None

    def describe(self, column: str) -> str:
        if self.mechanism == "ratio":
            return f"{column}: noisy sum / noisy count, ε={self.epsilon:g}, clamped to the declared bounds"
        parts = [f"{column}: discrete Laplace, ε={self.epsilon:g}", f"scale {self.scale:g}"]
        if self.stddev is not None:
            parts.append(f"sd {self.stddev:.3g}")
        if self.ci95_halfwidth is not None:
            parts.append(f"95% interval ±{self.ci95_halfwidth:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class OutputColumn:
    """How one client output column is derived from the SQL's columns and noise."""

    name: str  # the client's alias, or the expression as written
    kind: ColumnKind
    key: int | None = None  # kind "key": index of the group key in the SQL row
    statistic: str | None = None  # count / sum: the statistic; avg: the sum
    denominator: str | None = None  # avg: the count of non-null values
    lower: Fraction | None = None  # avg: declared bounds
    upper: Fraction | None = None
    noise: ColumnNoise | None = None


@dataclass(frozen=True)
class OrderKey:
    position: int  # 0-based output column
    descending: bool
    nulls_first: bool


@dataclass(frozen=True)
class DPPlan:
    sql: str  # contribution-bounded exact per-group statistics, for the service connection
    columns: tuple[OutputColumn, ...]
    epsilon: float  # the total cost of the answer
    delta: float
    table: str  # the privacy-unit domain to charge (policy name of the protected table)
    keys: int  # the SQL row holds the group keys first, then one column per statistic
    statistics: tuple[Statistic, ...]
    selection: str | None  # statistic whose noisy value must reach `threshold` (None: public or no groups)
    threshold: int | None
    order: tuple[OrderKey, ...] = ()
    limit: int | None = None
    offset: int = 0
    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1

    def notices(self) -> list[str]:
        lines = [column.noise.describe(column.name) for column in self.columns if column.noise is not None]
        if self.selection is not None:
            lines.append(f"groups released only if their noisy count of people reaches {self.threshold} "
                         f"(δ={self.delta:g})")
        return lines


# --- planning ---------------------------------------------------------------------


def plan_dp(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan | Reject:
    """The plan for ``sql`` (one aggregate SELECT over a protected table), or why it is refused."""
    try:
        return _plan(sql, role, policy, params)
    except Refusal as refusal:
        return refusal.reject
    except RecursionError:
        return Reject(FEATURE_NOT_SUPPORTED, "the statement is nested too deeply to analyze", PARSE_HINT)


def _plan(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan:
    if role.mode != "dp":
        raise forbidden(f"role {role.role} is not in dp mode (mode {role.mode})", "Ask the DBA for a dp role.")
    epsilon, delta, groups_cap, rows_cap = _params(params)
    statements = split(sql)
    if len(statements) != 1:
        raise unsupported("a dp query must be sent on its own, as one statement", DP_HINT)
    statement = statements[0]
    tree = _parse(statement)
    index = PolicyIndex(policy)
    query = analyze(statement, tree, index, SuppressionParams(k=1))
    assert isinstance(tree, exp.Select)  # analyze refuses everything else
    if tree.args.get("joins"):
        raise unsupported("JOIN is not supported in dp mode yet: query one protected table", DP_HINT)
    table = policy.tables.get(query.table)
    if table is None or index.resolve(tree.args["from_"].this).kind != "protected":
        raise unsupported("dp mode reads protected tables only (linked tables are not supported yet)", DP_HINT)
    if query.having is not None:
        raise unsupported("HAVING is not supported in dp mode yet: the filter would have to run on noisy values",
                          "Drop HAVING and filter the noisy result on the client.")
    if query.distinct and any(item.kind == "aggregate" for item in query.items):
        raise unsupported("SELECT DISTINCT with aggregates is not supported in dp mode", DP_HINT)

    keys = [_canonical(_parse_expression(key)) for key in query.keys]
    public = _public_domains(query, table, tree) if query.keys else None
    # How many groups one unit can reach: a unit touches at most `groups_cap` groups, and never more than exist.
    reach = 1 if not query.keys else (min(groups_cap, math.prod(len(d) for d in public)) if public else groups_cap)

    stats: dict[tuple[StatKind, str | None], _Stat] = {}

    def need(kind: StatKind, argument: str | None, per_group: Fraction, bounds: tuple[Fraction, Fraction] | None = None,
             ) -> tuple[StatKind, str | None]:
        if kind == "rows" and rows_cap == 1:
            kind = "units"  # one row per unit and group: count(*) is the count of distinct units
        key = (kind, argument if kind in ("count", "sum") else None)
        if key not in stats:
            stats[key] = _Stat(kind, key[1], per_group, bounds)
        return key

    selection = None
    if query.keys and public is None:
        if delta <= 0:
            raise unsupported(f"GROUP BY {', '.join(query.keys)} needs δ > 0: groups without a declared public "
                              "domain are released only past a noisy threshold, which costs δ",
                              "Declare a public domain for the grouping column, or give the role a δ.")
        selection = need("units", None, Fraction(1))

    columns: list[tuple[str, ColumnKind, object]] = []
    for item in query.items:
        if item.kind == "constant":
            raise unsupported(f"constant select item {item.expression} is not supported in dp mode", DP_HINT)
        node = _parse_expression(item.expression)
        # PostgreSQL's name for an unaliased column: the column's name, or the aggregate function's.
        name = item.alias or _column_name(node) or (type(node).__name__.lower() if isinstance(
            node, (exp.Count, exp.Sum, exp.Avg)) else "?column?")
        if item.kind == "group":
            canonical = _canonical(node)
            if canonical not in keys:
                raise unsupported(f"select item {item.expression} must be one of the GROUP BY expressions in dp "
                                  "mode", DP_HINT)
            columns.append((name, "key", keys.index(canonical)))
            continue
        if not isinstance(node, (exp.Count, exp.Sum, exp.Avg)):
            raise unsupported(f"{item.expression}: only count, sum and avg, without casts, are supported in dp mode",
                              DP_HINT)
        argument = node.this
        if isinstance(node, exp.Count):
            if isinstance(argument, exp.Star):
                columns.append((name, "count", need("rows", None, Fraction(rows_cap))))
            elif isinstance(argument, exp.Distinct):
                column = argument.expressions[0]
                if not (isinstance(column, exp.Column) and identifier(column.this) == table.unit_column):
                    raise unsupported(f"{item.expression}: count(DISTINCT x) is supported in dp mode only on the "
                                      f"privacy unit {table.unit_column}", DP_HINT)
                columns.append((name, "count", need("units", None, Fraction(1))))
            else:
                columns.append((name, "count", need("count", _argument_text(item.expression), Fraction(rows_cap))))
            continue
        function = "sum" if isinstance(node, exp.Sum) else "avg"
        lower, upper, column_name = _bounds(function, argument, table)
        text = quote(column_name)
        magnitude = max(abs(lower), abs(upper))
        total = need("sum", text, rows_cap * magnitude, (lower, upper))
        if function == "sum":
            columns.append((name, "sum", total))
        else:
            count = need("count", text, Fraction(rows_cap))
            columns.append((name, "avg", (total, count, lower, upper)))

    if not stats and not public:
        raise unsupported("a dp query needs an aggregate or a GROUP BY", DP_HINT)
    share = Fraction(epsilon) / max(len(stats), 1)
    names = {key: f"anonproxy_s{i}" for i, key in enumerate(stats, 1)}
    statistics = {key: stat.finish(names[key], share, reach) for key, stat in stats.items()}

    outputs = []
    for name, kind, source in columns:
        if kind == "key":
            outputs.append(OutputColumn(name, "key", key=source))  # type: ignore[arg-type]
        elif kind in ("count", "sum"):
            stat = statistics[source]  # type: ignore[index]
            outputs.append(OutputColumn(name, kind, statistic=stat.name, noise=stat.noise()))
        else:
            total, count, lower, upper = source  # type: ignore[misc]
            share_eps = float(statistics[total].epsilon + statistics[count].epsilon)
            outputs.append(OutputColumn(name, "avg", statistic=statistics[total].name,
                                        denominator=statistics[count].name, lower=lower, upper=upper,
                                        noise=ColumnNoise("ratio", None, share_eps, 0.0, None, None)))

    threshold = None
    if selection is not None:
        threshold = selection_threshold(statistics[selection].scale, reach, float(delta))
    order, limit, offset = _tail(query, tree, len(outputs))
    return DPPlan(
        sql=_sql(query, list(statistics.values()), public, rows_cap, groups_cap),
        columns=tuple(outputs),
        epsilon=float(epsilon) if stats else 0.0,  # listing a public domain reads nothing private
        delta=float(delta) if selection is not None else 0.0,
        table=query.table,
        keys=len(query.keys),
        statistics=tuple(statistics.values()),
        selection=statistics[selection].name if selection is not None else None,
        threshold=threshold,
        order=order,
        limit=limit,
        offset=offset,
        max_groups_per_unit=groups_cap,
        max_rows_per_unit=rows_cap,
    )


@dataclass
class _Stat:
    kind: StatKind
    argument: str | None
    per_group: Fraction
    bounds: tuple[Fraction, Fraction] | None

    def finish(self, name: str, epsilon: Fraction, reach: int) -> Statistic:
        sensitivity = self.per_group * reach
        resolution = None
        if self.kind == "sum":
            lower, upper = self.bounds  # type: ignore[misc]
            if lower.denominator != 1 or upper.denominator != 1:
                # Not an integer sum: release it on the grid r·ℤ, r a power of ten, with ~GRID_UNITS steps per Δ.
                resolution = Fraction(10) ** math.floor(math.log10(sensitivity / GRID_UNITS))
        # On the grid each reachable group moves by at most ⌈per_group/r⌉ steps (to_grid rounds half up).
        units = sensitivity if resolution is None else reach * Fraction(math.ceil(self.per_group / resolution))
        return Statistic(name, self.kind, self.argument, self.per_group, sensitivity, epsilon, resolution,
                         laplace_scale(units, epsilon), self.bounds)


def selection_threshold(scale: Fraction | float, reach: int, delta: float) -> int:
    """The smallest τ with reach · Pr[1 + N ≥ τ] ≤ δ, N ~ discrete Laplace(scale).

    Pr[N ≥ k] = α^k / (1 + α) for k ≥ 1, α = e^(−1/t). A key that only one unit holds has exact count 1 (the
    count is of distinct units), and one unit holds at most ``reach`` such keys.
    """
    t = float(scale)
    alpha = math.exp(-1 / t)

    def leak(tau: int) -> float:
        return reach * alpha ** (tau - 1) / (1 + alpha)

    tau = max(2, 1 + math.ceil(t * math.log(reach / (delta * (1 + alpha)))))
    while leak(tau) > delta:
        tau += 1
    while tau > 2 and leak(tau - 1) <= delta:
        tau -= 1
    return tau


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


def _parse_expression(text: str) -> exp.Expression:
    """A piece of the client's text that analyze() already parsed and checked, parsed again on its own."""
    node = sqlglot.parse_one(text, read="postgres")
    assert isinstance(node, exp.Expression)
    return node


def _argument_text(expression: str) -> str:
    """The text between the outer parentheses of an aggregate as written: count( x ) -> x."""
    return expression[expression.index("(") + 1 : expression.rindex(")")].strip()


def _column_name(node: exp.Expression) -> str | None:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column) and node.args.get("db") is None:
        return identifier(node.this)
    return None


def _bounds(function: str, argument: exp.Expression, table: ProtectedTable) -> tuple[Fraction, Fraction, str]:
    name = _column_name(argument)
    written = argument.sql(dialect="postgres")
    if name is None:
        raise unsupported(f"{function.upper()}({written}) in dp mode takes a column with declared bounds, "
                          "not an expression", DP_HINT)
    column = table.columns.get(name) or ColumnPolicy(name)
    if column.lower is None or column.upper is None:
        raise unsupported(f"{function.upper()}({name}) needs declared bounds for {name}: the noise is calibrated "
                          "to the bounds, never to the data", BOUNDS_HINT)
    lower, upper = Fraction(Decimal(str(column.lower))), Fraction(Decimal(str(column.upper)))
    if lower > upper:
        raise unsupported(f"the declared bounds of {name} are inverted ({column.lower} > {column.upper})",
                          BOUNDS_HINT)
    if max(abs(lower), abs(upper)) == 0:
        raise unsupported(f"the declared bounds of {name} are both 0", BOUNDS_HINT)
    return lower, upper, name


def _public_domains(query: AnalyticQuery, table: ProtectedTable, tree: exp.Select) -> list[tuple[str, ...]] | None:
    """The declared domain of every GROUP BY key, when every key is a column that has one; else None."""
    domains = []
    for key in query.keys:
        name = _column_name(_parse_expression(key))
        column = table.columns.get(name) if name is not None else None
        if column is None or column.domain is None or not column.domain:
            return None
        domains.append(tuple(column.domain))
    if math.prod(len(d) for d in domains) > MAX_DOMAIN_CELLS:
        raise unsupported(f"the public domains of the GROUP BY columns have more than {MAX_DOMAIN_CELLS} "
                          "combinations", "Group by fewer columns.")
    return domains


def _tail(query: AnalyticQuery, tree: exp.Select, width: int) -> tuple[tuple[OrderKey, ...], int | None, int]:
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
         groups_cap: int) -> str:
    keys = [f"anonproxy_g{i}" for i in range(1, len(query.keys) + 1)]
    arguments: dict[str, str] = {}
    for stat in statistics:
        if stat.argument is not None and stat.argument not in arguments:
            arguments[stat.argument] = f"anonproxy_a{len(arguments) + 1}"

    select = [f"{query.unit} AS {UNIT}"]
    select += [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select += [f"{argument} AS {name}" for argument, name in arguments.items()]
    select.append("random() AS anonproxy_r")
    rows = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        rows.append(f"WHERE {query.where}")

    cell = ", ".join([UNIT, *keys])
    cells = ["SELECT *,", f"       row_number() OVER (PARTITION BY {cell} ORDER BY anonproxy_r) AS anonproxy_row_rank"]
    if keys:
        cells.append(f"     , first_value(anonproxy_r) OVER (PARTITION BY {cell}) AS anonproxy_cell_r")
    cells.append(f"FROM {ROWS}")
    bounded = ["SELECT *"]
    if keys:
        bounded = [(f"SELECT *, dense_rank() OVER (PARTITION BY {UNIT} ORDER BY anonproxy_cell_r, {', '.join(keys)})"
                   " AS anonproxy_group_rank")]
    bounded += [f"FROM {CELLS}", f"WHERE anonproxy_row_rank <= {rows_cap}"]

    aggregates = []
    for stat in statistics:
        if stat.kind == "units":
            aggregates.append(f"count(DISTINCT {UNIT}) AS {stat.name}")
        elif stat.kind == "rows":
            aggregates.append(f"count(*) AS {stat.name}")
        elif stat.kind == "count":
            aggregates.append(f"count({arguments[stat.argument]}) AS {stat.name}")  # type: ignore[index]
        else:
            lower, upper = _bounds_of(stat)
            aggregates.append(f"coalesce(sum(LEAST(GREATEST({arguments[stat.argument]}, {lower}), {upper})), 0) "  # type: ignore[index]
                              f"AS {stat.name}")
    final = [f"SELECT {', '.join([*keys, *aggregates])}", f"FROM {BOUNDED}"]
    if keys:
        final.append(f"WHERE anonproxy_group_rank <= {groups_cap}")
        final.append(f"GROUP BY {', '.join(keys)}")

    ctes = [(ROWS, "\n".join(rows), "the client's FROM and WHERE; one row per input row"),
            (CELLS, "\n".join(cells), "a random order of each unit's rows per group" +
             (", and a random number per (unit, group)" if keys else "")),
            (BOUNDED, "\n".join(bounded), f"at most {rows_cap} row(s) per unit and group" +
             (", groups ranked at random per unit" if keys else ""))]
    if public is None:
        body = "\n".join(final)
        return _with(ctes) + "\n" + body
    ctes.append((STATS, "\n".join(final), f"at most {groups_cap} group(s) per unit; exact per-group statistics"))
    domain_from = []
    for i, (values, key) in enumerate(zip(public, keys, strict=True)):
        array = ", ".join(_text_literal(v) for v in values)
        domain_from.append(f"unnest(ARRAY[{array}]::text[]) AS d{i + 1}({key})")
    domain = [f"SELECT {', '.join(f'd{i + 1}.{key}' for i, key in enumerate(keys))}",
              f"FROM {' CROSS JOIN '.join(domain_from)}"]
    ctes.append((DOMAIN, "\n".join(domain), "every value of the declared public domains"))
    on = " AND ".join(f"s.{key}::text = d.{key}" for key in keys)
    outer = [f"SELECT {', '.join(f'd.{key}' for key in keys)}, "
             + ", ".join(f"coalesce(s.{stat.name}, 0) AS {stat.name}" for stat in statistics),
             f"FROM {DOMAIN} AS d LEFT JOIN {STATS} AS s ON {on}"]
    return _with(ctes) + "\n" + "\n".join(outer)


def _bounds_of(stat: Statistic) -> tuple[str, str]:
    assert stat.bounds is not None
    return _literal(stat.bounds[0]), _literal(stat.bounds[1])


def _with(ctes: list[tuple[str, str, str]]) -> str:
    parts = []
    for name, body, comment in ctes:
        indented = "\n".join("  " + line for line in body.split("\n"))
        parts.append(f"{name} AS (\n  -- {comment}\n{indented}\n)")
    return "WITH " + ",\n".join(parts)


# --- answering ----------------------------------------------------------------------


def answer(plan: DPPlan, rows: list[tuple]) -> tuple[list[tuple], list[ColumnNoise | None]]:
    """Noisy rows for the client from the rows of ``plan.sql``, and the noise of each output column.

    Call only after the plan's (ε, δ) has been charged. Every value of every statistic gets fresh noise from
    :mod:`secrets`-driven exact samplers; nothing here depends on the data except through those noisy values.
    """
    positions = {stat.name: plan.keys + i for i, stat in enumerate(plan.statistics)}
    by_name = {stat.name: stat for stat in plan.statistics}
    result = []
    for row in rows:
        noisy: dict[str, object] = {}
        if plan.selection is not None:
            stat = by_name[plan.selection]
            value = _noisy(stat, row[positions[stat.name]])
            assert plan.threshold is not None
            if value < plan.threshold:  # type: ignore[operator]
                continue
            noisy[stat.name] = value
        for stat in plan.statistics:
            if stat.name not in noisy:
                noisy[stat.name] = _noisy(stat, row[positions[stat.name]])
        out = []
        for column in plan.columns:
            if column.kind == "key":
                out.append(row[column.key])  # type: ignore[index]
            elif column.kind == "count":
                out.append(max(0, noisy[column.statistic]))  # type: ignore[call-overload, index]
            elif column.kind == "sum":
                out.append(noisy[column.statistic])  # type: ignore[index]
            else:
                out.append(_average(noisy[column.statistic], noisy[column.denominator], column))  # type: ignore[index]
        result.append(tuple(out))
    result = _ordered(result, plan.order)
    end = None if plan.limit is None else plan.offset + plan.limit
    return result[plan.offset:end], [column.noise for column in plan.columns]


def _noisy(stat: Statistic, value: object) -> int | Decimal | float:
    """The statistic plus discrete Laplace noise, in the type PostgreSQL gave the exact value."""
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
    return _like(value, (grid + discrete_laplace(stat.scale)) * stat.resolution)


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


def _average(total: object, count: object, column: OutputColumn) -> Decimal | float:
    lower, upper = column.lower, column.upper
    assert lower is not None and upper is not None
    exact_total = Fraction(total) if isinstance(total, float) else Fraction(Decimal(total))  # type: ignore[arg-type]
    value = exact_total / max(int(count), 1)  # type: ignore[call-overload]
    value = min(max(value, lower), upper)  # post-processing: AVG lies within the declared bounds
    if isinstance(total, float):
        return float(value)
    return round(_decimal(value), 16)


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
