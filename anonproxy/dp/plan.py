"""Differential-privacy mode for one aggregate query: its plan (docs/dp.md), measured, then priced.

Pure and I/O-free, in two steps. :func:`measure` takes the statement's one
parse (the router's, :mod:`anonproxy.route.decide`, in the same call) through
the same front end and checks as suppression mode (:mod:`anonproxy.plan`,
:func:`anonproxy.plan.analysis.analyze`) and decides what to measure: which
statistics each output column needs (each computed once), their bounds and
sensitivity, partition selection for groups without a declared public domain,
HAVING compiled over the noisy values (:mod:`anonproxy.dp.having`), the post
statement for post-aggregate expressions, and the table whose budget pays. What one
person may contribute (at most g groups, c rows in each) is what the role declares with
its budget on that table (sql/0034), 1 and 1 where each row of the FROM clause is one person.
The result, :class:`Measured`, is a value the router's decision carries.
:func:`price` then applies a per-query ε, δ and accounting to it: each
statistic's share of ε and its noise, partition selection's threshold, the
cost, and the SQL (:mod:`anonproxy.dp.bounded_sql`); the result is a
:class:`anonproxy.dp.model.DPPlan`, whose answer is made from the rows by
:mod:`anonproxy.dp.finish`. A new cost prices the same measurement again:
nothing is planned twice. :func:`plan_dp` does both for a text.

The plan is a deterministic function of (statement, policy, params), so it can
be cached; its ``epsilon`` and ``delta`` are the cost to charge to the ledger
*before* the answer's rows leave the proxy.
"""

from __future__ import annotations

import copy
import math
import pickle
import re
from dataclasses import dataclass, field, replace
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any, Literal, TypeAlias

from sqlglot import exp

from anonproxy.dp import interval_items, intervals
from anonproxy.dp.bounded_sql import Domain, bounded_sql, keys_sql, text_literal
from anonproxy.dp.domains import restricted
from anonproxy.dp.finish import canonical_statistics
from anonproxy.dp.having import compile_having
from anonproxy.dp.mechanisms import (
    ceil_scaled_log,
    combined_halfwidth,
    discrete_gaussian_tail,
    laplace_matched_sigma2,
    laplace_scale,
)
from anonproxy.dp.model import (
    ColumnKind,
    ColumnNoise,
    DPParams,
    DPPlan,
    OrderKey,
    OutputColumn,
    PostProcess,
    Quantile,
    Statistic,
    StatKind,
    as_float,
)
from anonproxy.dp.time_domains import (
    MAX_TIME_BUCKETS,
    TIME_TYPES,
    TimeColumn,
    TimeDomain,
    calendar_domain,
    within_assumed,
    within_range,
)
from anonproxy.plan import bounds, post_aggregate, render, unit_groups
from anonproxy.plan.analysis import AnalyticQuery, Item, analyze, canonical, filtered
from anonproxy.plan.expressions import distinct_column
from anonproxy.plan.outer import Outer, Series
from anonproxy.plan.post_aggregate import RELEASED, PostAggregate, value
from anonproxy.plan.refusals import (
    FEATURE_NOT_SUPPORTED,
    Refusal,
    Reject,
    forbidden,
    unsupported,
)
from anonproxy.plan.shape import Nested, prepare
from anonproxy.plan.statements import PARSE_HINT, Statement, parse_statement, split
from anonproxy.plan.tables import PolicyIndex, ResolvedTable, identifier, quote
from anonproxy.policy.model import (
    ColumnPolicy,
    Policy,
    RolePolicy,
    SuppressionParams,
)

__all__ = ["Caps", "Measured", "Packed", "caps_of", "declared_caps", "gaussian_selection_threshold", "measure",
           "plan_dp", "price", "selection_threshold"]

DP_HINT = ("Supported in dp mode: SELECT <GROUP BY columns>, count(*), count(x), count(DISTINCT x), sum(x), "
           "avg(x), variance/var_samp/var_pop/stddev/stddev_samp/stddev_pop(x), median(x), "
           "percentile_cont/percentile_disc(q) WITHIN GROUP (ORDER BY x), each with an optional FILTER (WHERE ...) "
           "but the quantiles, and expressions over them and constants (+ - * /, round, trunc, abs, sign, ceil, "
           "floor, coalesce, nullif, greatest, least, CASE, casts) FROM <protected table> "
           "[[LEFT] JOIN <linked table> ON <declared key>] [WHERE ...] [GROUP BY ...] [HAVING ...] "
           "[ORDER BY <output columns>] [LIMIT n] [OFFSET n]; x needs declared bounds except in count, or is an "
           "expression whose bounds follow from its columns' declared bounds (constants, CASE, arithmetic, "
           "rounding, casts: sum(hours_per_week::numeric * 52)).")
BOUNDS_HINT = "Ask the DBA to declare lower and upper bounds for the column in the policy."
JOIN_HINT = ("In dp mode a query reads one protected table and its linked tables, each joined with "
             "JOIN <linked table> ON <linked>.<key> = <protected>.<unit> as the policy declares them.")
MAX_DOMAIN_CELLS = 10_000  # public-domain grid (product of the domains) emitted by the SQL
GRID_UNITS = 1000  # a non-integer sum's sensitivity is about this many grid steps (rounding ≪ noise)
QUANTILE_STEPS = 10_000  # a quantile's output grid has about this many steps between the bounds (at least 1)


_SPREADS: dict[type[exp.Expression], tuple[ColumnKind, bool]] = {  # aggregate -> (kind, sample statistic?)
    exp.Variance: ("variance", True), exp.VariancePop: ("variance", False), exp.Stddev: ("stddev", True),
    exp.StddevSamp: ("stddev", True), exp.StddevPop: ("stddev", False),
}
_AGGREGATES: tuple[type[exp.Expression], ...] = (exp.Count, exp.Sum, exp.Avg, exp.Median, exp.WithinGroup, *_SPREADS)


# --- planning ---------------------------------------------------------------------


def plan_dp(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan | Reject:
    """The plan for ``sql`` (one aggregate SELECT over a protected table), or why it is refused: the text parsed
    here (a question the proxy builds itself, tests), then :func:`measure` and :func:`price`."""
    try:
        statements = split(sql)
        if len(statements) != 1:
            raise unsupported("a dp query must be sent on its own, as one statement", DP_HINT)
        tree = parse_statement(statements[0])
    except Refusal as refusal:
        return price(refusal.reject, params)
    return price(measure(statements[0], tree, role, policy, caps_of(params)), params)


def caps_of(params: DPParams) -> Caps | None:
    """What a unit may contribute, when the parameters say (a bound they leave out is 1); None: the role's declared
    bounds."""
    if params.max_groups_per_unit is None and params.max_rows_per_unit is None:
        return None
    return Caps(1 if params.max_groups_per_unit is None else params.max_groups_per_unit,
                1 if params.max_rows_per_unit is None else params.max_rows_per_unit)


def declared_caps(role: RolePolicy, table: str) -> Caps:
    """The contribution bounds ``role`` declares on protected ``table`` with its budget (1 and 1 without one)."""
    budget = role.budgets.get(table)
    if budget is None:
        return Caps()
    return Caps(budget.max_groups_per_person, budget.max_rows_per_person_and_group)


@dataclass(frozen=True)
class Caps:
    """What one unit may contribute: to how many groups, and how many rows to each. Part of the measurement (the
    SQL bounds them), unlike ε, δ and the accounting, which only price it."""

    max_groups_per_unit: int = 1
    max_rows_per_unit: int = 1


ONE_ROW = Caps()  # where each row of the FROM clause is one person: what every unit contributes, whatever is declared


@dataclass
class Measured:
    """What a statement measures, before its price: everything :func:`price` needs to finish a plan at any per-query
    ε, δ and accounting, without the statement's text or tree being read again. ``late``: a refusal found after the
    point where a plan checks δ (so that a δ of 0 is reported first, as when both were decided in one pass);
    ``tail``: one of ORDER BY, LIMIT or OFFSET, reported after the refusals of pricing; ``further``: the
    measurements of the aggregate queries an outer query joins, or a set operation combines, besides the first
    (:func:`_measure_further`), packed apart (:class:`Packed`)."""

    query: AnalyticQuery
    columns: _Columns
    drafts: list[_Draft] = field(default_factory=list)
    hidden: list[_Draft] = field(default_factory=list)
    public: list[Domain] | None = None
    reach: int = 1
    selection: _ColumnKey | None = None
    having: tuple[Any, ...] | None = None
    checks: list[str] = field(default_factory=list)
    order: tuple[OrderKey, ...] = ()
    limit: tuple[int | None, int | None] = (None, None)
    offset: tuple[int | None, int | None] = (None, None)
    unmeasured_parameters: tuple[int, ...] = ()
    post: PostProcess | None = None
    nested: Outer | Series | None = None
    key_order: tuple[int, ...] = ()
    caps: Caps = Caps()
    late: Reject | None = None
    tail: Reject | None = None  # a refusal of ORDER BY, LIMIT or OFFSET: reported after any of pricing's
    further: tuple[Measured, ...] = ()  # the later aggregate queries of a nested statement, each asked on its own

    @property
    def table(self) -> str:
        """The privacy-unit domain the question is charged to (known before it is priced)."""
        return self.query.owner

    def slim(self) -> Measured:
        """Without the front end's nodes, which only measuring reads (pricing reads the rendered pieces): what is
        packed."""
        query = replace(self.query, items=(), order=(), contributors=(), aggregates=(), outer=None, key_nodes=(),
                        having_node=None, key_types=(), argument_types=(), post=None)
        columns = copy.copy(self.columns)
        # the time zone names (some 24 kB pickled) only bound the arguments measuring reads, as the tables do
        columns.query, columns.tables, columns.nullable, columns.zones = query, {}, [], None
        return replace(self, query=query, columns=columns, further=())


class Packed:
    """A measurement (or its refusal) as a value to keep and to send. Its trees take some hundred times the
    statement's length in memory, pickled a few times: it crosses processes (and is kept by a worker) pickled,
    slimmed of what only measuring reads, and is opened where it is priced; within one process it is the
    measurement itself. ``table``: the budget it is charged to (None: refused); ``size``: what it weighs pickled;
    ``further``: the later aggregate queries' measurements (:attr:`Measured.further`), each packed, asked with
    these rather than measured again."""

    def __init__(self, measured: Measured | Reject, further: tuple[Packed, ...] = ()) -> None:
        self._measured: Measured | Reject | None = measured
        self._data: bytes | None = None
        self.table = measured.table if isinstance(measured, Measured) else None
        self.further = further

    @classmethod
    def of(cls, measured: Measured | Reject) -> Packed:
        if isinstance(measured, Measured):
            return cls(measured.slim(), tuple(cls.of(more) for more in measured.further))
        return cls(measured)

    def open(self) -> Measured | Reject:
        if self._measured is None:
            assert self._data is not None
            opened = pickle.loads(self._data)
            assert isinstance(opened, (Measured, Reject))
            self._measured = opened
        return self._measured

    @property
    def size(self) -> int:
        return len(self._pickled()) + sum(more.size for more in self.further)

    def _pickled(self) -> bytes:
        if self._data is None:
            self._data = pickle.dumps(self._measured, pickle.HIGHEST_PROTOCOL)
        return self._data

    def __getstate__(self) -> tuple[bytes, str | None, tuple[Packed, ...]]:
        return self._pickled(), self.table, self.further

    def __setstate__(self, state: tuple[bytes, str | None, tuple[Packed, ...]]) -> None:
        self._data, self.table, self.further = state
        self._measured = None  # opened when priced


def measure(statement: Statement, tree: exp.Expression, role: RolePolicy, policy: Policy,
            caps: Caps | None = None) -> Measured | Reject:
    """What ``tree`` (the one parse of ``statement``) measures for ``role``, or why it is refused; its price comes
    after (:func:`price`). ``caps``: what a unit may contribute; None: what the role declares on the statement's
    protected table (:func:`declared_caps`). The tree is changed in place."""
    try:
        return _measure(statement, tree, role, policy, caps)
    except Refusal as refusal:
        return refusal.reject
    except RecursionError:
        return Reject(FEATURE_NOT_SUPPORTED, "the statement is nested too deeply to analyze", PARSE_HINT)


def price(measured: Measured | Reject, params: DPParams) -> DPPlan | Reject:
    """The plan of a measured statement at per-query ``params`` (ε, δ, accounting): each statistic's share of ε and
    its noise, partition selection's threshold, the SQL and the cost. Planning is not repeated: a new ε prices
    the same measurement again."""
    try:
        return _price(measured, params)
    except Refusal as refusal:
        return refusal.reject
    except RecursionError:
        return Reject(FEATURE_NOT_SUPPORTED, "the statement is nested too deeply to analyze", PARSE_HINT)
    except OverflowError:  # a noise scale Δ/ε past the largest double (about 1.8e308): nothing can describe it
        return Reject(FEATURE_NOT_SUPPORTED, f"ε = {params.epsilon:g} is too small for this query: its noise "
                      "scale is beyond the range of a double", "Ask the DBA for a larger per-query ε.")


def _measure(statement: Statement, tree: exp.Expression, role: RolePolicy, policy: Policy, caps: Caps | None,
             ) -> Measured | Reject:
    if role.mode != "dp":
        raise forbidden(f"role {role.role} is not in dp mode (mode {role.mode})", "Ask the DBA for a dp role.")
    if caps is not None:
        _caps(caps)
    index = PolicyIndex(policy)
    shape = prepare(statement, tree, index)
    further = _measure_further(shape.post, role, policy) if isinstance(shape, Nested) and isinstance(
        shape.post, Outer) else ()
    single = shape.inner if isinstance(shape, Nested) else shape  # a nested shape: the question asked first
    statement, tree = single.statement, single.tree
    interval_of = interval_items.unwrap(tree)  # dp_interval_low/high(x) items: planned as x, then bounded
    query = analyze(statement, tree, index, SuppressionParams(k=1), dp=True)
    assert isinstance(tree, exp.Select)  # analyze refuses everything else, and every relation outside the policy
    if isinstance(shape, Nested) and isinstance(shape.post, Outer):
        unit_groups.check(query, dp=True)
    if query.distinct and any(item.kind == "aggregate" or item.aggregates for item in query.items):
        raise unsupported("SELECT DISTINCT with aggregates is not supported in dp mode", DP_HINT)
    # Each row one person (checked again by the SQL, anonproxy.dp.bounded_sql): one row in one group, whatever the
    # bounds say; larger bounds would only add noise.
    caps = ONE_ROW if query.one_row_per_person else caps or declared_caps(role, query.owner)
    groups_cap, rows_cap = _caps(caps)

    columns = _Columns(query, rows_cap, tree, policy.zones)
    public = _public_domains(query, tree, columns) if query.keys else None
    within = [domain.within for domain in public or () if isinstance(domain, TimeDomain)]
    guards = within + _time_guards(query, columns, within)
    where = _guarded_where(query, tree, columns)
    # Rows outside the declared range of a calendar key's column fall in none of its buckets; those outside the
    # range of a time column another key, an aggregate or a WHERE expression reads must not reach it (the proof
    # trusts the range there).
    if guards or where != query.where:
        where = " AND ".join(f"({condition})" for condition in ([where] if where else []) + guards)
        query = columns.query = replace(query, where=where)
    # How many groups one unit can reach: a unit touches at most `groups_cap` groups, and never more than exist.
    # (At least 1: a WHERE may leave a domain no value, anonproxy.dp.domains; the answer is then empty.) A calendar's
    # buckets are counted by PostgreSQL, not here: `groups_cap` (its estimate only decides whether to list them).
    reach = 1 if not query.keys else (min(groups_cap, max(1, math.prod(len(d) for d in public)))
                                      if public and not within else groups_cap)
    measured = Measured(query, columns, public=public, reach=reach, caps=caps,
                        nested=shape.post if isinstance(shape, Nested) else None, further=further)
    if query.keys and public is None:  # (its δ is checked when priced, first)
        measured.selection = columns.need("units", None, Fraction(1))
    try:
        _measure_columns(measured, tree, interval_of)
    except Refusal as refusal:
        measured.late = refusal.reject
    return measured


def _time_guards(query: AnalyticQuery, columns: _Columns, within: list[str]) -> list[str]:
    """A condition keeping the rows within the declared range of each bounded time column that a GROUP BY key or
    an aggregate reads. The no-error proof trusts that range there (expressions.Checker): those run only on the
    rows the WHERE clause let through, so a value outside it ('infinity') must not reach them. Likewise for a time
    column without declared bounds, which the proof takes to lie between 2000 BC and 200000 AD (or at ±infinity):
    a value PostgreSQL holds beyond (4714 BC, 294276 AD) would make a truncation or a shift fail. (It does not trust
    the range in WHERE and JOIN conditions, which PostgreSQL may evaluate before these.) A NULL raises no error and
    stays: the rows a LEFT JOIN finds no match for are counted as PostgreSQL counts them. ``within``: the
    calendar keys' conditions, which keep their columns' rows within the range already. Numbers are not guarded
    here: a number whose bounds the proof needs is read clamped into them wherever it is read, conditions included
    (anonproxy.plan.clamp), and a row outside them stays, counted at the bound."""
    guards: list[str] = []
    for node in (*query.key_nodes, *(aggregate.node for aggregate in query.aggregates)):
        for column in node.find_all(exp.Column):
            time = columns.time_column(column)
            if time is not None:
                within_time = within_range(column, time)
                if within_time in within:
                    continue
            else:
                sql_type = columns.time_type(column)
                if sql_type is None:
                    continue
                within_time = within_assumed(column, sql_type)
            guard = f"{render.sql(column)} IS NULL OR {within_time}"
            if guard not in guards:
                guards.append(guard)
    return guards


# Where a column is compared as it is (visited_at >= '2025-06-01'): no value of it makes that fail.
_COMPARED = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ, exp.NullSafeNEQ, exp.Between, exp.In,
             exp.Is)


def _guarded_where(query: AnalyticQuery, tree: exp.Select, columns: _Columns) -> str | None:
    """The client's WHERE clause, evaluated only on the rows where each bounded time column it reads inside an
    expression (date_trunc('day', visited_at) BETWEEN ...) is within its declared range, or NULL: the no-error
    proof trusts that range there (expressions.Checker.where_facts), and a CASE is evaluated in its order, before
    the clause, whatever order PostgreSQL picks for conditions. A row outside the range ('infinity') is left out,
    as it is of the keys and aggregates that read the column. A clause that reads such columns only as they are
    stays as written (an index serves it)."""
    node = tree.args.get("where")
    if query.where is None or node is None:
        return query.where
    guards: list[str] = []
    for column in node.find_all(exp.Column):
        time = columns.time_column(column)
        if time is None or isinstance(column.parent, _COMPARED):
            continue
        guard = f"{render.sql(column)} IS NULL OR {within_range(column, time)}"
        if guard not in guards:
            guards.append(guard)
    if not guards:
        return query.where
    return f"CASE WHEN {' AND '.join(f'({guard})' for guard in guards)} THEN ({query.where}) ELSE false END"


def _measure_further(outer: Outer, role: RolePolicy, policy: Policy) -> tuple[Measured, ...]:
    """The aggregate queries an outer query joins, or a set operation combines, besides its first are asked after
    it, each charged on its own: each is measured here, once, so that one refused refuses the statement before the
    first is charged; they are asked with these measurements (anonproxy.dp.question)."""
    measurements = []
    for more in outer.more:
        statement = split(render.sql(more.inner))[0]  # the text it is asked with (anonproxy.dp.question)
        measured = _measure(statement, parse_statement(statement), role, policy, None)  # as it is asked
        refusal = measured if isinstance(measured, Reject) else measured.late
        if refusal is not None:
            raise _again(refusal)
        assert isinstance(measured, Measured)
        unit_groups.check(measured.query, dp=True)  # measured alone, as asked: not checked as an outer's input
        measurements.append(measured)
    return tuple(measurements)


def _measure_columns(measured: Measured, tree: exp.Select,
                     interval_of: dict[int, interval_items.IntervalItem]) -> None:
    """The output columns, hidden columns, HAVING, post statement and tail of a measured statement."""
    query, columns, drafts, hidden = measured.query, measured.columns, measured.drafts, measured.hidden
    keys = list(query.key_nodes)
    outer = query.outer
    if outer is not None:
        _check_outer(outer)
    for position, item in enumerate(query.items):
        if position in interval_of:
            drafts.append(_interval(interval_of[position], item, columns))
            continue
        if outer is not None and outer.items[position].computed and not _plain_aggregate(_node(item)):
            drafts.append(_Draft(outer.items[position].name, "post"))
            continue
        if item.kind == "constant":
            raise unsupported(f"constant select item {item.expression} is not supported in dp mode", DP_HINT)
        node = _node(item)
        if item.kind == "group":
            if canonical(node) not in keys:
                raise unsupported(f"select item {render.written(node)} must be one of the GROUP BY expressions in dp "
                                  "mode", DP_HINT)
            drafts.append(_Draft(item.name, "key", key=keys.index(canonical(node))))
        else:
            drafts.append(columns.aggregate(node, item.name, item.expression))

    if query.having is not None and not query.having_outer:
        measured.having = _having(_having_node(query), keys, query, drafts, hidden, columns)
    inputs: list[tuple[str, int]] = []  # the post statement's value columns: (name, index in the answer row)
    if outer is not None:
        if outer.keys_used:  # the GROUP BY expressions, when an expression reads one: hidden key columns
            for number, key_text in enumerate(query.keys, 1):
                hidden.append(_Draft(f"key {key_text}", "key", key=number - 1))
                inputs.append((post_aggregate.key(number), len(drafts) + len(hidden) - 1))
        for number, node in enumerate(outer.aggregates, 1):  # each aggregate: a hidden column (statistics shared)
            hidden.append(columns.aggregate(node, query.text_of(node).text, None))
            inputs.append((value(number), len(drafts) + len(hidden) - 1))
        measured.post = _post_process(outer, query, inputs, [i for i, d in enumerate(drafts) if d.kind == "post"])

    try:
        measured.order, measured.limit, measured.offset = _tail(query, tree)
    except Refusal as refusal:
        measured.tail = refusal.reject  # reported once the plan is priced, as when both were one pass
    limit_parameter, offset_parameter = measured.limit[1], measured.offset[1]
    tail = [part for part in (tree.args.get("limit"), tree.args.get("offset")) if part is not None]
    in_tail = {id(node) for part in tail for node in part.find_all(exp.Parameter)}
    measured_parameters = {node.this.this for node in tree.find_all(exp.Parameter) if id(node) not in in_tail}
    measured.unmeasured_parameters = tuple(sorted({number for number in (limit_parameter, offset_parameter)
                                                   if number is not None and str(number) not in measured_parameters}))
    # A LIMIT/OFFSET parameter is bound with the others: the SQL types it as PostgreSQL would (bigint), unrun.
    measured.checks = _having_checks(measured.having, drafts, hidden, query) + [
        f"${number}::bigint IS NULL" for number in (limit_parameter, offset_parameter) if number is not None]
    # GROUP BY a, b and GROUP BY b, a measure the same groups: one order of the keys for the measurement
    measured.key_order = tuple(sorted(range(len(query.keys)), key=lambda i: query.keys[i]))


def _price(measured: Measured | Reject, params: DPParams) -> DPPlan:
    epsilon, delta = _params(params)
    if isinstance(measured, Reject):
        raise _again(measured)
    query, columns = measured.query, measured.columns
    if measured.selection is not None and delta <= 0:
        raise unsupported(f"GROUP BY {', '.join(map(render.written, query.key_nodes))} needs δ > 0: groups without a declared public "
                          "domain are released only past a noisy threshold, which costs δ",
                          "Declare a public domain for the grouping column, or give the role a δ.")
    if measured.late is not None:
        raise _again(measured.late)
    # zCDP accounting: each statistic may take the discrete Gaussian of the same variance (it needs δ > 0 for the
    # answer's basic (ε, δ) pair to be finite).
    gaussian = params.accounting == "zcdp" and delta > 0
    reach, public = measured.reach, measured.public
    stats, swaps = columns.settled_sums(epsilon, reach, gaussian)
    drafts = [_settled(draft, swaps) for draft in measured.drafts]
    hidden = [_settled(draft, swaps) for draft in measured.hidden]
    mechanisms = columns.noisy(stats)
    if not mechanisms and not public:
        raise unsupported("a dp query needs an aggregate or a GROUP BY", DP_HINT)
    share = Fraction(epsilon) / max(mechanisms, 1)
    names = {key: f"anonproxy_s{i}" for i, key in enumerate(stats, 1)}
    statistics = {key: stat.finish(names[key], share, reach, gaussian) for key, stat in stats.items()}
    quantiles = {key: Quantile(names[values], key[1], key[2], lower, upper, step, share / reach, share,
                               measured.caps.max_rows_per_unit)
                 for key, (values, lower, upper, step) in columns.quantiles.items()}

    threshold = None
    selection = measured.selection
    if selection is not None:
        chosen = statistics[selection]
        threshold = (selection_threshold(chosen.scale, reach, float(delta)) if chosen.sigma2 is None
                     else gaussian_selection_threshold(chosen.sigma2, reach, float(delta)))
    cost = _costs(list(statistics.values()), list(quantiles.values()), delta, selection is not None)
    (limit, limit_parameter), (offset, offset_parameter) = measured.limit, measured.offset
    if measured.tail is not None:
        raise _again(measured.tail)
    key_order, caps = measured.key_order, measured.caps
    groups_cap, rows_cap = caps.max_groups_per_unit, caps.max_rows_per_unit
    return DPPlan(
        sql=bounded_sql(query, list(statistics.values()), public, rows_cap, groups_cap, measured.checks),
        columns=tuple(draft.finish(statistics, quantiles) for draft in drafts),
        epsilon=cost.epsilon,  # 0 when listing a public domain, which reads nothing private
        delta=cost.delta,
        table=query.owner,
        tables=tuple(sorted({source.policy_name for _, source in query.sources})),
        keys=len(query.keys),
        statistics=tuple(statistics.values()),
        selection=statistics[selection].name if selection is not None else None,
        threshold=threshold,
        order=measured.order,
        limit=limit,
        offset=offset or 0,
        limit_parameter=limit_parameter,
        offset_parameter=offset_parameter,
        unmeasured_parameters=measured.unmeasured_parameters,
        max_groups_per_unit=groups_cap,
        max_rows_per_unit=rows_cap,
        hidden=tuple(draft.finish(statistics, quantiles) for draft in hidden),
        having=measured.having,
        domains=tuple(public) if public is not None else None,
        post=measured.post,
        nested=measured.nested,
        rho=cost.rho,
        delta_add=cost.delta_add,
        # What the answer cache's key reads: the SQL with statistics and keys in a canonical order, no HAVING checks.
        measured=bounded_sql(replace(query, keys=tuple(query.keys[i] for i in key_order)),
                             canonical_statistics(statistics.values()),
                             None if public is None else [public[i] for i in key_order], rows_cap, groups_cap, []),
        key_order=key_order,
        keys_sql=keys_sql(query) if query.keys else "",
    )


def _again(reject: Reject) -> Refusal:
    """A refusal measuring found, raised when the plan is priced."""
    return Refusal(reject.sqlstate, reject.message, reject.hint)


@dataclass(frozen=True)
class _Cost:
    epsilon: float
    delta: float
    rho: float
    delta_add: float


def _costs(statistics: list[Statistic], quantiles: list[Quantile], delta: Fraction, selection: bool) -> _Cost:
    """An answer's four costs (docs/dp.md, "Mechanism choice and costs"), each a valid guarantee on its own.

    zCDP: a discrete Laplace at ε is ε²/2-zCDP, the exponential mechanism at ε is ε²/8-zCDP, a discrete Gaussian
    Δ₂²/(2σ²)-zCDP; ρ adds up over the statistics. The basic pair: the pure-ε mechanisms' ε added up, plus the
    Gaussians' ρ converted at the role's δ (ρ + 2√(ρ·ln(1/δ)), δ); partition selection adds δ to both δs."""
    noisy = [stat for stat in statistics if stat.kind != "values"]
    pure = sum((stat.epsilon for stat in noisy if stat.sigma2 is None), Fraction(0))
    pure += sum((quantile.share for quantile in quantiles), Fraction(0))
    gaussian = float(sum((stat.rho for stat in noisy if stat.sigma2 is not None), Fraction(0)))
    rho = sum((stat.rho for stat in noisy), Fraction(0)) + sum((q.share ** 2 / 8 for q in quantiles), Fraction(0))
    epsilon, basic_delta = _up(pure), 0.0
    if gaussian > 0:
        conversion = gaussian + 2 * math.sqrt(gaussian * math.log(1 / float(delta)))
        epsilon = (epsilon + conversion) * (1 + 1e-14)  # above the float arithmetic's rounding: never under-charged
        basic_delta = float(delta)
    selected = float(delta) if selection else 0.0
    return _Cost(epsilon, basic_delta + selected, _up(rho), selected)


def _up(cost: Fraction) -> float:
    """An exact cost as the nearest float not below it (the ledger is charged these floats: never less)."""
    rounded = as_float(cost)
    return math.nextafter(rounded, math.inf) if rounded < cost else rounded


def _interval(wanted: interval_items.IntervalItem, item: Item, columns: _Columns) -> _Draft:
    """A dp_interval_low/high item: an end of the interval of the aggregate it names (planned as that aggregate)."""
    node = _node(item)
    if not _plain_aggregate(node):
        raise unsupported(f"{wanted.function}({item.expression}): its argument must be an aggregate or the alias of "
                          "an aggregate output column", interval_items.HINT)
    target = columns.aggregate(node, item.name, item.expression)
    if target.kind not in ("count", "sum", "avg"):
        raise unsupported(f"{wanted.function}({item.expression}): only count, sum and avg have a 95 % interval in "
                          "value units (a quantile's accuracy is stated in ranks; variance and stddev have no "
                          "interval yet)", interval_items.HINT)
    return _Draft(wanted.name, "interval", bound="low" if wanted.bound == "low" else "high", of=target)


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
    released = f"FROM unnest({arrays}) AS {RELEASED}({', '.join(columns)})"
    if query.having_outer and outer.windows:
        # PostgreSQL computes window functions over the groups HAVING keeps: those first, then the others, kept out
        kept = [*select[:-1], "true AS anonproxy_keep"]
        dropped = ["anonproxy_n", *("NULL" for _ in select[1:-1]), "false"]
        sql = "\n".join([f"SELECT {', '.join(kept)}", released, f"WHERE {outer.having}", "UNION ALL",
                         f"SELECT {', '.join(dropped)}", released, f"WHERE ({outer.having}) IS NOT TRUE",
                         "ORDER BY anonproxy_n"])
    else:
        sql = "\n".join([f"SELECT {', '.join(select)}", released, "ORDER BY anonproxy_n"])
    return PostProcess(sql, tuple(index for _, index in inputs), tuple(computed), query.having_outer)


_ColumnKey: TypeAlias = tuple[Any, ...]  # identifies a statistic: (kind, argument, center, power, offset)
# (Σ(x − center), its count, center) of an avg, variance or stddev: what a sum may derive from
_Moments: TypeAlias = tuple[_ColumnKey, _ColumnKey, Fraction]
_QuantileKey: TypeAlias = tuple[str, Fraction, bool]  # (argument, q, discrete)


def _settled(draft: _Draft, swaps: dict[_ColumnKey, _Moments]) -> _Draft:
    """``draft`` with its sum's statistics as priced (``swaps``: own statistic -> the moments it derives from)."""
    if draft.of is not None:
        return replace(draft, of=_settled(draft.of, swaps))
    if draft.kind == "sum" and draft.denominator is None and draft.statistic in swaps:
        statistic, denominator, center = swaps[draft.statistic]
        return replace(draft, statistic=statistic, denominator=denominator, center=center)
    return draft


def _floor_log10(x: Fraction) -> int:
    """⌊log10 x⌋ of a positive fraction, exactly: math.log10 converts it to a float first, which is 0 below 1e-324
    (sum(v.amount * 1e-400) failed with a math domain error) and rounds near a power of ten."""
    exponent = len(str(x.numerator)) - len(str(x.denominator))  # ⌊log10 x⌋ is this or one less
    return exponent - 1 if Fraction(10) ** exponent > x else exponent


@dataclass
class _Stat:
    kind: StatKind
    argument: str | None
    per_group: Fraction
    clamp: tuple[Fraction, Fraction] | None = None
    center: Fraction = Fraction(0)
    power: int = 1
    offset: Fraction = Fraction(0)

    def finish(self, name: str, epsilon: Fraction, reach: int, gaussian: bool = False) -> Statistic:
        """The statistic with the noise of its share ``epsilon``: the discrete Laplace of scale Δ/ε, or (``gaussian``)
        the discrete Gaussian of the same variance when that costs less ρ."""
        if self.kind == "values":
            return Statistic(name, "values", self.argument, self.per_group, self.per_group * reach, Fraction(0),
                             None, Fraction(0), self.clamp)
        sensitivity = self.per_group * reach
        resolution = None
        if self.kind == "sum":
            lower, upper = self.range()
            if lower.denominator != 1 or upper.denominator != 1:
                # Not an integer sum: release it on the grid r·ℤ, r a power of ten, with ~GRID_UNITS steps per Δ.
                resolution = Fraction(10) ** _floor_log10(sensitivity / GRID_UNITS)
        # On the grid each reachable group moves by at most ⌈per_group/r⌉ steps (to_grid rounds half up).
        per_group = math.ceil(self.per_group if resolution is None else self.per_group / resolution)
        units = sensitivity if resolution is None else reach * Fraction(per_group)
        scale = laplace_scale(units, epsilon)
        laplace = Statistic(name, self.kind, self.argument, self.per_group, sensitivity, epsilon, resolution, scale,
                            self.clamp, self.center, self.power, self.offset, rho=epsilon * epsilon / 2)
        if not gaussian:
            return laplace
        # L2 sensitivity in grid units: one unit moves each of `reach` groups by at most `per_group` steps.
        try:
            sigma2 = laplace_matched_sigma2(scale)
        except OverflowError:  # a variance past the largest double (t ≳ 10¹⁵⁴): keep the Laplace, which has none
            return laplace
        rho = Fraction(per_group * per_group * reach) / (2 * sigma2)
        if rho >= laplace.rho:
            return laplace
        return replace(laplace, mechanism="discrete_gaussian", sigma2=sigma2, rho=rho)

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
    quantile: _QuantileKey | None = None
    bound: Literal["low", "high"] | None = None  # kind "interval": which end of ``of``'s interval
    of: _Draft | None = None

    def finish(self, statistics: dict[_ColumnKey, Statistic], quantiles: dict[_QuantileKey, Quantile]) -> OutputColumn:
        def name(key: _ColumnKey | None) -> str | None:
            return None if key is None else statistics[key].name

        if self.of is not None:
            return OutputColumn(self.name, "interval", bound=self.bound, of=self.of.finish(statistics, quantiles))

        noise = None
        if self.kind == "sum" and self.denominator is not None:
            # Σx = Σ(x − c) + c·n from its average's statistics: independent noises, so the variances add, and the
            # interval is that of the sum of the two noises (or, when that is too long to sum, each error within its
            # 97.5 % interval: 95 % together).
            total, count = statistics[self.statistic], statistics[self.denominator]  # type: ignore[index]
            c = float(self.center)
            step = total.resolution or Fraction(1)
            combined = combined_halfwidth(total.noise_parameters(step), count.noise_parameters(abs(self.center)))
            if combined is None:
                half = total.halfwidth(0.975) + abs(c) * count.halfwidth(0.975)
            else:  # plus the rounding to the grid
                half = float(combined) + (float(step) / 2 if total.resolution is not None else 0.0)
            noise = ColumnNoise("derived", None, float(total.epsilon + count.epsilon), 0.0,
                                math.hypot(total.stddev, c * count.stddev), half, total.resolution,
                                rho=float(total.rho + count.rho))
        elif self.kind in ("count", "sum"):
            noise = statistics[self.statistic].noise()  # type: ignore[index]
        elif self.kind == "avg":
            total, count = statistics[self.statistic], statistics[self.denominator]  # type: ignore[index]
            parts = (total.noise(), count.noise())
            # AVG − true = (e_S − (true − center)·e_N)/Ñ: per row ± q/Ñ, q from the released average
            # (intervals.average); the notice gives q's range, from the middle of the bounds to the farther bound.
            assert self.lower is not None and self.upper is not None
            reach = float(max(self.upper - self.center, self.center - self.lower))
            spreads = [intervals.spread(part.mechanism, part.stddev) for part in parts]
            noise = ColumnNoise("ratio", None, float(total.epsilon + count.epsilon), 0.0, None, None,
                                ratio_numerator=intervals.sum_quantile(spreads[0], spreads[1], reach), parts=parts,
                                ratio_center=intervals.sum_quantile(spreads[0], spreads[1], 0.0))
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

    def __init__(self, query: AnalyticQuery, rows_cap: int, tree: exp.Select, zones: frozenset[str] | None) -> None:
        self.query = query
        self.zones = zones  # the server's time zone names (Policy.zones), for bounds of derived arguments
        self.rows_cap = rows_cap
        self.tables = dict(query.sources)
        self.nullable = _nullable_side(tree, self.tables)
        self.stats: dict[_ColumnKey, _Stat] = {}
        # (argument, q, discrete) -> (the values statistic, L, U, grid step)
        self.quantiles: dict[_QuantileKey, tuple[_ColumnKey, Fraction, Fraction, Fraction]] = {}
        # argument -> (Σ(x − center), its count, center) of an avg, variance or stddev: what a sum may derive from
        self.moments: dict[str, tuple[_ColumnKey, _ColumnKey, Fraction]] = {}
        self.sums: list[tuple[_Draft, _ColumnKey]] = []  # sum drafts and their own statistics, for settle_sums

    def noisy(self, stats: dict[_ColumnKey, _Stat]) -> int:
        """How many noisy statistics an answer with ``stats`` has (each quantile counted as one): its ε is split
        between them."""
        return sum(stat.kind != "values" for stat in stats.values()) + len(self.quantiles)

    def settled_sums(self, epsilon: Fraction, reach: int, gaussian: bool,
                     ) -> tuple[dict[_ColumnKey, _Stat], dict[_ColumnKey, _Moments]]:
        """The statistics at ``epsilon``, and each sum's statistic that is derived instead (from its moments):
        Σ(x − c) + c·n from an average of the same argument when that has the smaller error at the final split of
        ε, else its own statistic. Decided on the measurement alone, which it leaves as it is (it is priced again
        at another ε)."""
        stats = dict(self.stats)
        swaps: dict[_ColumnKey, _Moments] = {}
        decided: set[_ColumnKey] = set()
        for _, own in self.sums:
            moments = self.moments.get(own[1])
            if own in decided or moments is None or moments[0] == own:  # (centred on 0, avg's sum is this one)
                continue
            decided.add(own)
            linear, count, center = moments
            m = self.noisy(stats)
            variance = (stats[linear].finish("", epsilon / (m - 1), reach, gaussian).stddev ** 2
                        + float(center) ** 2 * stats[count].finish("", epsilon / (m - 1), reach,
                                                                   gaussian).stddev ** 2)
            alone = stats[own].finish("", epsilon / m, reach, gaussian).stddev ** 2
            if variance <= alone:
                del stats[own]
                swaps[own] = moments
        return stats, swaps

    def never_null(self, node: exp.Expression) -> bool:
        """Whether an aggregate's argument is a column that is NULL in no row of the FROM clause: declared NOT NULL
        in the catalog (read with the policy), of a table not on the nullable side of a LEFT JOIN. Only the
        accuracy rests on it: a count of such a column is the count of rows, and shares that statistic."""
        found = self.column_table(node)
        if found is None:
            return False
        table, name = found
        if table is None or table in self.nullable:
            return False
        model = table.protected if table.protected is not None else table.linked
        return model is not None and model.not_null is not None and name in model.not_null

    def need(self, kind: StatKind, argument: str | None, per_group: Fraction,
             clamp: tuple[Fraction, Fraction] | None = None, center: Fraction = Fraction(0), power: int = 1,
             offset: Fraction = Fraction(0)) -> _ColumnKey:
        if kind == "rows" and self.rows_cap == 1:
            kind = "units"  # one row per unit and group: count(*) is the count of distinct units
        key = (kind, argument if kind in ("count", "distinct", "sum", "values") else None, center, power, offset)
        if key not in self.stats:
            self.stats[key] = _Stat(kind, key[1], per_group, clamp, center, power, offset)
        return key

    def aggregate(self, node: exp.Expression, name: str, written: str | None) -> _Draft:
        """The column of one aggregate; ``written`` is its text as the client wrote it (None: from HAVING)."""
        c = Fraction(self.rows_cap)
        condition = None  # FILTER (WHERE condition): folded into the argument (analysis.filtered)
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
                return self._distinct(name, argument.expressions[0], whole, condition)
            if isinstance(argument, exp.Star) or _numeric_constant(argument) is not None:  # count(1) is count(*)
                if condition is None:
                    return _Draft(name, "count", statistic=self.need("rows", None, c))
                return _Draft(name, "count", statistic=self.need("count", filtered(None, condition), c))
            if isinstance(argument, exp.Column) and condition is None:
                if self.never_null(argument):  # count(x) = count(*): one statistic serves both
                    return _Draft(name, "count", statistic=self.need("rows", None, c))
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
        if isinstance(node, exp.Sum):  # its statistics are chosen once every aggregate is known (settle_sums)
            draft = _Draft(name, "sum", statistic=self.need("sum", text, c * max(abs(lower), abs(upper)),
                                                             (lower, upper)))
            self.sums.append((draft, draft.statistic))  # type: ignore[arg-type]
            return draft
        # avg, variance, stddev: sums centred on the middle of the bounds (an integer one for integer bounds, so
        # integer sums stay integers), whose sensitivity is half the width of the bounds, not the largest |bound|.
        if lower == upper:
            raise unsupported(f"{function.upper()}({text}) needs bounds lower < upper", BOUNDS_HINT)
        center = (lower + upper) / 2 if (lower.denominator, upper.denominator) != (1, 1) else Fraction(
            (lower.numerator + upper.numerator) // 2)
        half = max(center - lower, upper - center)
        # The denominator: the count of rows when the argument is a column that is never NULL (shared with count(*))
        shared = condition is None and self.never_null(argument)
        count = self.need("rows", None, c) if shared else self.need("count", text, c)
        linear = self.need("sum", text, c * half, (lower, upper), center)
        self.moments.setdefault(text, (linear, count, center))
        if isinstance(node, exp.Avg):
            return _Draft(name, "avg", statistic=linear, denominator=count, center=center, lower=lower, upper=upper)
        # Σ((x − center)² − offset): (x − center)² lies in [0, half²]; the offset halves the magnitude.
        offset = Fraction(math.floor(half * half / 2)) if half.denominator == 1 else half * half / 2
        square = self.need("sum", text, c * max(offset, half * half - offset), (lower, upper), center, 2, offset)
        kind, sample = _SPREADS[type(node)]
        return _Draft(name, kind, statistic=square, denominator=count, linear=linear, center=center, offset=offset,
                      lower=lower, upper=upper, sample=sample)

    def _distinct(self, name: str, argument: exp.Expression, whole: exp.Expression, condition: str | None,
                  ) -> _Draft:
        """count(DISTINCT x) [FILTER (WHERE c)]. Of the unit (under casts that keep values apart: the same number),
        read from a table on no nullable side and without FILTER: the one count of people. Otherwise the count of
        distinct values of x over the bounded rows: adding or removing one unit changes a group's count by at most
        the number of distinct values its rows there hold, at most c (its rows per group), and 1 for the unit (its
        one value); over the groups it reaches, R times that, as count(x)."""
        column = distinct_column(argument, self._column_type)
        unit = column is not None and self._is_unit(column)
        found = self.column_table(column) if column is not None else None
        if unit and condition is None and found is not None and found[0] not in self.nullable:
            return _Draft(name, "count", statistic=self.need("units", None, Fraction(1)))
        text = filtered(self.query.text_of(whole).argument, condition)
        assert text is not None  # count(DISTINCT x) has an argument
        return _Draft(name, "count", statistic=self.need("distinct", text, Fraction(1 if unit else self.rows_cap)))

    def _column_type(self, node: exp.Column) -> str | None:
        """A column's SQL type as the policy read it (None: unknown)."""
        found = self.column_table(node)
        if found is None or found[0] is None:
            return None
        table = found[0]
        model = table.protected or table.linked or table.reference
        return model.types.get(found[1]) if model is not None and model.types is not None else None

    def _quantile(self, name: str, argument: exp.Expression, q: Fraction, discrete: bool, what: str) -> _Draft:
        lower, upper, text = self._bounds(what, argument)
        if lower == upper:
            raise unsupported(f"{what}({text}) needs bounds lower < upper", BOUNDS_HINT)
        step = Fraction(10) ** _floor_log10((upper - lower) / QUANTILE_STEPS)
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
        if derived is not None:  # bounds that follow from the expression: the argument, rendered
            text = self.query.text_of(node).argument  # type: ignore[arg-type]
            assert text is not None
            if max(abs(derived[0]), abs(derived[1])) == 0:
                raise unsupported(f"{function.upper()}({text}) adds up only zeros", DP_HINT)
            return derived[0], derived[1], text
        unwrapped = _unparen(argument)
        cast = unwrapped if isinstance(unwrapped, exp.Cast) and node is not None else None  # checked: widening
        found = self.column_table(cast.this if cast is not None else argument)
        if found is None:
            if node is None:  # a quantile ranks the column's own values
                raise unsupported(f"{function.upper()}({written}) in dp mode takes a column with declared bounds, "
                                  "not an expression", DP_HINT)
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
        assert isinstance(unwrapped, exp.Column)  # column_table found a table: a column reference
        return lower, upper, self._column_sql(unwrapped)

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
            found = bounds.evaluate(argument, self.facts, self.zones)
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
        table, name = found[0], found[1]
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

    def time_column(self, node: exp.Expression) -> TimeColumn | None:
        """A reference to a date, timestamp or timestamptz column with declared time bounds, else None."""
        found = self.column_table(node)
        if found is None or found[0] is None:
            return None
        table, name = found[0], found[1]
        policy = _policy_columns(table).get(name)
        cast = _time_type(table, name)
        if policy is None or policy.earliest is None or policy.latest is None or cast is None:
            return None
        return TimeColumn((id(table), name), cast, policy.earliest, policy.latest)

    def time_type(self, node: exp.Column) -> str | None:
        """The type (date, timestamp, timestamptz) of a reference to a date or time column of a protected or linked
        table, bounds declared or not (a column without a policy of its own included), else None."""
        name, qualifier = identifier(node.this), identifier(node.args.get("table"))
        if name is None or node.args.get("db") is not None:
            return None
        tables = [self.tables.get(qualifier)] if qualifier is not None else list(self.tables.values())
        types = {_time_type(table, name) for table in tables if table is not None} - {None}
        return types.pop() if len(types) == 1 else None

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
        table, name = found[0], found[1]
        if table.protected is not None:
            return name == table.protected.unit_column
        return table.linked is not None and name == table.linked.column

    def _unit_name(self) -> str:
        return self.query.unit.split(".")[-1].strip('"')


def _time_type(table: ResolvedTable, name: str) -> str | None:
    """The type (date, timestamp, timestamptz) of column ``name`` of a protected or linked table, if a time type."""
    model = table.protected if table.protected is not None else table.linked
    sql_type = model.types.get(name) if model is not None and model.types is not None else None
    return TIME_TYPES.get(re.sub(r"\(\d+\)", "", sql_type or ""))


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
    names: dict[type[exp.Expression], str] = {exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Variance: "variance",
             exp.VariancePop: "var_pop", exp.Stddev: "stddev", exp.StddevSamp: "stddev_samp",
             exp.StddevPop: "stddev_pop", exp.Median: "median", exp.PercentileCont: "percentile_cont",
             exp.PercentileDisc: "percentile_disc"}
    return names.get(type(node), "?column?")


def _having(node: exp.Expression, keys: list[exp.Expression], query: AnalyticQuery, drafts: list[_Draft],
            hidden: list[_Draft], columns: _Columns) -> tuple[Any, ...]:
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


def _having_checks(tree: tuple[Any, ...] | None, drafts: list[_Draft], hidden: list[_Draft], query: AnalyticQuery) -> list[str]:
    """SQL conditions repeating HAVING's comparisons that involve a grouping key, with every aggregate standing in as
    a numeric, for PostgreSQL to type-check (text > 5 is an error there, not an empty answer): the plan's SQL parses
    them in a CTE it never runs."""
    if tree is None or tree[0] in ("value", "const"):
        return []
    if tree[0] != "cmp":
        return [check for child in tree[1:] for check in _having_checks(child, drafts, hidden, query)]
    outputs = [*drafts, *hidden]

    def sql(node: tuple[Any, ...]) -> str | None:
        if node[0] == "value":
            draft = outputs[node[1]]
            return f"({query.keys[draft.key]})" if draft.kind == "key" else "0::numeric"
        constant = node[1]
        if node[0] != "const" or constant is None:
            return None
        if isinstance(constant, str):
            return text_literal(constant)
        return str(constant).lower() if isinstance(constant, bool) else f"{constant:f}"

    left, right = sql(tree[2]), sql(tree[3])
    if left is None or right is None or not any(side.startswith("(") for side in (left, right)):
        return []
    return [f"{left} {tree[1]} {right}"]


def _nullable_side(tree: exp.Select, tables: dict[str, ResolvedTable]) -> list[ResolvedTable]:
    """The tables on the nullable side of an outer join (all of them after a RIGHT or FULL join, which the join
    checks refuse anyway): their columns can be NULL in the FROM clause's rows whatever the catalog says."""
    nullable = []
    for join in tree.args.get("joins") or []:
        side, kind = (join.side or "").upper(), (join.kind or "").upper()
        if side in ("RIGHT", "FULL"):
            return list(tables.values())
        if side or kind not in ("", "INNER"):
            alias = join.this.args.get("alias")
            reference = identifier(alias.this) if alias is not None else identifier(join.this.this)
            if reference not in tables:
                return list(tables.values())
            nullable.append(tables[reference])
    return nullable


def gaussian_selection_threshold(sigma2: Fraction | float, reach: int, delta: float) -> int:
    """The smallest τ ≥ 2 with reach · Pr[1 + N ≥ τ] ≤ δ, N ~ discrete Gaussian(σ²): partition selection when the
    count's noise is Gaussian (zCDP accounting). The tail is the exact sum of the pmf
    (:func:`anonproxy.dp.mechanisms.discrete_gaussian_tail`, an upper bound past σ = 10⁴), with a relative margin
    of 10⁻⁹ for its rounding."""
    def holds(k: int) -> bool:  # k = τ − 1
        return reach * discrete_gaussian_tail(k, sigma2) * (1 + 1e-9) <= delta

    high = max(1, math.ceil(math.sqrt(2 * float(sigma2) * math.log(reach / delta))) + 1)  # sub-Gaussian bound
    while not holds(high):
        high *= 2
    low = 1
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return max(2, 1 + low)


def selection_threshold(scale: Fraction | float, reach: int, delta: float) -> int:
    """The smallest τ ≥ 2 with reach · Pr[1 + N ≥ τ] ≤ δ, N ~ discrete Laplace(scale).

    Pr[N ≥ k] = α^k / (1 + α) for k ≥ 1, α = e^(−1/t). A key that only one unit holds has exact count 1 (the
    count is of distinct units), and one unit holds at most ``reach`` such keys. So τ − 1 ≥ t·(ln(reach/δ) −
    ln(1 + α)), evaluated exactly for any t (:func:`ceil_scaled_log`).
    """
    return max(2, 1 + ceil_scaled_log(scale, lambda alpha: (reach / Decimal(delta)).ln() - (1 + alpha).ln()))


_PARAMS_HINT = "Ask the DBA to fix the role's dp parameters."


def _params(params: DPParams) -> tuple[Fraction, Fraction]:
    """The per-query ε and δ, exact, once checked (and the accounting)."""
    if not (isinstance(params.epsilon, (int, float)) and math.isfinite(params.epsilon) and params.epsilon > 0):
        raise unsupported("the role's ε must be a positive number", _PARAMS_HINT)
    if not (isinstance(params.delta, (int, float)) and 0 <= params.delta < 1):
        raise unsupported("the role's δ must be in [0, 1)", _PARAMS_HINT)
    if params.accounting not in ("basic", "zcdp"):
        raise unsupported("the role's accounting must be basic or zcdp", _PARAMS_HINT)
    return Fraction(params.epsilon), Fraction(params.delta)


def _caps(caps: Caps) -> tuple[int, int]:
    for name in ("max_groups_per_unit", "max_rows_per_unit"):
        value = getattr(caps, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise unsupported(f"the role's {name} must be a positive integer", _PARAMS_HINT)
    return caps.max_groups_per_unit, caps.max_rows_per_unit


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


def _public_domains(query: AnalyticQuery, tree: exp.Select, columns: _Columns) -> list[Domain] | None:
    """The public domain of every GROUP BY key — a column's declared domain without the values its WHERE clause
    excludes, or a calendar key's buckets (anonproxy.dp.time_domains) — when every key has one; else None (and
    None past MAX_TIME_BUCKETS combinations with a calendar key: partition selection, as without bounds)."""
    where_node = tree.args.get("where")
    where = where_node.this if where_node is not None else None
    declared: list[tuple[str, ...]] = []
    calendars: dict[int, TimeDomain] = {}
    for index, key in enumerate(query.key_nodes):
        found = columns.column_table(key)
        column = _policy_columns(found[0]).get(found[1]) if found is not None else None
        if column is not None and column.domain:
            declared.append(tuple(column.domain))
            continue
        calendar = calendar_domain(key, where, columns.time_column)
        if calendar is None:
            return None
        declared.append(())  # (listed by the calendar, not by restricted())
        calendars[index] = calendar
    # the values the WHERE clause lets through
    restricted_values = restricted(query, where, declared, columns.column_table)
    domains: list[Domain] = [calendars.get(index, values) for index, values in enumerate(restricted_values)]
    cells = math.prod(len(d) for d in domains)
    if calendars:
        return domains if cells <= MAX_TIME_BUCKETS else None
    if cells > MAX_DOMAIN_CELLS:
        raise unsupported(f"the public domains of the GROUP BY columns have more than {MAX_DOMAIN_CELLS} "
                          "combinations", "Group by fewer columns.")
    return domains


def _tail(query: AnalyticQuery, tree: exp.Select) -> tuple[tuple[OrderKey, ...], tuple[int | None, int | None],
                                                           tuple[int | None, int | None]]:
    """ORDER BY as output positions; LIMIT and OFFSET each as (constant, $n parameter number)."""
    order = []
    for item in query.order:
        if item.position is None:
            raise unsupported(f"ORDER BY {item.written} must name an output column in dp mode (ordering happens "
                              "after the noise is added)", "Order by a select-list position or an output alias.")
        words = item.suffix.upper().split()
        descending = "DESC" in words
        nulls_first = ("FIRST" in words) if "NULLS" in words else descending  # PostgreSQL's default
        order.append(OrderKey(item.position - 1, descending, nulls_first))
    return tuple(order), _count(tree.args.get("limit"), "LIMIT"), _count(tree.args.get("offset"), "OFFSET")


def _count(node: exp.Expression | None, what: str) -> tuple[int | None, int | None]:
    """A LIMIT or OFFSET: (its constant, None), (None, its $n parameter's number), or (None, None) for none."""
    if node is None:
        return None, None
    if isinstance(node, exp.Fetch):
        value = node.args.get("count")
        if value is None:
            return 1, None
    else:
        value = node.args.get("expression")
    if value is None or (isinstance(value, exp.Var) and value.name.upper() == "ALL"):
        return None, None
    if isinstance(value, exp.Literal) and not value.is_string and value.this.isdigit():
        return int(value.this), None
    if isinstance(value, exp.Parameter) and isinstance(value.this, exp.Literal) and value.this.this.isdigit():
        return None, int(value.this.this)
    raise unsupported(f"{what} takes a constant or a $n parameter in dp mode", DP_HINT)
