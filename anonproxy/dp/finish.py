"""A dp plan's answer from the rows its SQL returned, in two steps: the measurement, then the finishing.

Pure. **Measurement** (:func:`measure`): exact discrete noise added to each statistic (docs/mechanisms.md),
quantiles drawn with the exponential mechanism, groups without a declared public domain kept only when their
noisy count of people reaches the plan's threshold. Its result, a :class:`Measurement` (the released groups'
keys and noisy values, nothing exact), is what the answer cache keeps and what the budget pays for.
**Finishing** (:func:`released_rows`, :func:`finish`): the client's columns computed from the noisy values,
HAVING, the post statement's columns, ORDER BY, LIMIT and OFFSET — post-processing, run alike on a fresh
measurement and on one read back from the cache, so that re-sorting or renaming a question costs nothing and
shows the same numbers.
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction
from typing import Any

from anonproxy.dp import intervals
from anonproxy.dp.having import holds
from anonproxy.dp.mechanisms import discrete_gaussian, discrete_laplace, to_grid
from anonproxy.dp.model import (
    ColumnNoise,
    DPPlan,
    OrderKey,
    OutputColumn,
    Quantile,
    Statistic,
    to_decimal,
)

# A row of values: as the SQL returned it, or an answer row.
Row = tuple[Any, ...]


@dataclass(frozen=True)
class Group:
    """One released group: its keys as the SQL returned them, and the noisy value of each noisy statistic and
    each quantile, by their canonical names (:func:`canonical_names`, :func:`quantile_id`), which do not depend on
    where the statement mentions them. Never an exact value."""

    keys: Row
    values: dict[str, object]


@dataclass(frozen=True)
class Measurement:
    """The noisy measurement of a plan: the SQL's column types (of the keys, in order; of each statistic, by its
    canonical name) and the released groups, in the order of their keys."""

    key_types: tuple[int, ...]
    statistic_types: dict[str, int]
    groups: tuple[Group, ...]

    def fits(self, plan: DPPlan) -> bool:
        """Whether every released group holds each noisy value ``plan`` finishes from (it does for the measurement
        of the plan's own key; anything else read from the cache is a miss)."""
        names = canonical_names(plan.statistics)
        wanted = {names[stat.name] for stat in plan.statistics if stat.kind != "values"}
        wanted |= {quantile_id(quantile, names) for quantile in _quantiles(plan)}
        return len(self.key_types) == plan.keys and all(
            len(group.keys) == plan.keys and wanted <= group.values.keys() for group in self.groups)

    def canonical(self, plan: DPPlan) -> Measurement:
        """This measurement of ``plan`` with its keys in the plan's canonical order (``plan.key_order``), as the
        answer cache keeps it: GROUP BY a, b and GROUP BY b, a read the same measurement."""
        order = plan.key_order or tuple(range(plan.keys))
        return Measurement(tuple(self.key_types[i] for i in order), self.statistic_types,
                           tuple(Group(tuple(group.keys[i] for i in order), group.values) for group in self.groups))

    def for_plan(self, plan: DPPlan) -> Measurement:
        """A measurement kept by :meth:`canonical`, with its keys back in ``plan``'s order and its groups in the
        plan's order of their keys (the order a fresh measurement of ``plan`` has)."""
        order = plan.key_order or tuple(range(plan.keys))
        where = {position: i for i, position in enumerate(order)}  # a key's position in plan -> in the cache
        back = [where[position] for position in range(len(order))]
        groups = (Group(tuple(group.keys[i] for i in back), group.values) for group in self.groups)
        return Measurement(tuple(self.key_types[i] for i in back), self.statistic_types,
                           tuple(sorted(groups, key=lambda group: _key_order(plan, group.keys))))

    def sql_types(self, plan: DPPlan) -> list[int]:
        """The column types of ``plan.sql`` (keys, then the plan's statistics in its own order), for a plan whose
        measurement this is, whatever order its statement named the statistics in."""
        names = canonical_names(plan.statistics)
        return [*self.key_types, *(self.statistic_types.get(names[stat.name], 0) for stat in plan.statistics)]


def answer(plan: DPPlan, rows: list[Row]) -> tuple[list[Row], list[ColumnNoise | None]]:
    """Noisy rows for the client from the rows of ``plan.sql``, and the noise of each output column (a plan
    without post-aggregate expressions; else :func:`released_rows`, the post statement, then :func:`finish`).

    Call only after the plan's (ε, δ) has been charged. Every value of every statistic gets fresh noise from
    exact samplers drawing from ``os.urandom`` (anonproxy.dp.randomness); nothing here depends on the data except
    through those noisy values.
    """
    assert plan.post is None, "a plan with post-aggregate expressions needs its post statement run"
    return finish(plan, released_rows(plan, measure(plan, (), rows)), None)


# --- measurement: noise and partition selection ---------------------------------------------------------------


def measure(plan: DPPlan, types: tuple[int, ...] | list[int], rows: list[Row]) -> Measurement:
    """The released groups of ``plan`` with noisy statistics, from the rows of ``plan.sql`` (``types``: their
    column types). Groups without a public domain pass partition selection first; every quantile of the plan is
    drawn once per released group (whichever columns and HAVING repeat it: it is charged once)."""
    positions = {stat.name: plan.keys + i for i, stat in enumerate(plan.statistics)}
    by_name = {stat.name: stat for stat in plan.statistics}
    names = canonical_names(plan.statistics)
    groups = []
    # PostgreSQL's row order depends on the data (a hash join emits the empty public groups last): release the
    # groups in a fixed order of their keys instead, which ORDER BY refines and LIMIT cuts.
    for row in sorted(rows, key=functools.partial(_key_order, plan)):
        noisy: dict[str, object] = {}
        if plan.selection is not None:
            stat = by_name[plan.selection]
            value = _noisy(stat, row[positions[stat.name]])
            assert plan.threshold is not None
            if value < plan.threshold:
                continue
            noisy[names[stat.name]] = value
        for stat in plan.statistics:
            if names[stat.name] not in noisy and stat.kind != "values":  # a quantile's values are exact: not kept
                noisy[names[stat.name]] = _noisy(stat, row[positions[stat.name]])
        for quantile in sorted(_quantiles(plan), key=_quantile_key):
            values = row[positions[quantile.values]]
            noisy[quantile_id(quantile, names)] = quantile.draw(values)
        groups.append(Group(tuple(row[:plan.keys]), noisy))
    types = list(types) or [0] * (plan.keys + len(plan.statistics))
    return Measurement(tuple(types[:plan.keys]), {names[stat.name]: types[plan.keys + i]
                                                  for i, stat in enumerate(plan.statistics)}, tuple(groups))


def canonical_statistics(statistics: Iterable[Statistic]) -> list[Statistic]:
    """The statistics in a canonical order, named ``anonproxy_s1``, ... in that order: the same list whatever
    order the statement's select list, HAVING and expressions mention them in (the answer cache's key)."""
    ordered = sorted(statistics, key=lambda stat: repr(replace(stat, name="")))
    return [replace(stat, name=f"anonproxy_s{i}") for i, stat in enumerate(ordered, 1)]


def canonical_names(statistics: Iterable[Statistic]) -> dict[str, str]:
    """Each statistic's name in the plan -> its canonical name (:func:`canonical_statistics`)."""
    ordered = sorted(statistics, key=lambda stat: repr(replace(stat, name="")))
    return {stat.name: f"anonproxy_s{i}" for i, stat in enumerate(ordered, 1)}


def plan_quantiles(plan: DPPlan) -> list[Quantile]:
    """Every distinct quantile of the plan, named canonically (its values statistic's canonical name), in a fixed
    order."""
    names = canonical_names(plan.statistics)
    return sorted((replace(quantile, values=names[quantile.values]) for quantile in _quantiles(plan)),
                  key=_quantile_key)


def _quantiles(plan: DPPlan) -> set[Quantile]:
    return {column.quantile for column in plan.columns + plan.hidden if column.quantile is not None}


def _quantile_key(quantile: Quantile) -> str:
    """A quantile's name by the plan's own statistic names."""
    return quantile_id(quantile, {})


def quantile_id(quantile: Quantile, names: dict[str, str]) -> str:
    """A quantile's canonical name in a measurement: its values statistic (``names`` maps a plan name to the
    canonical one; already canonical when absent), fraction and kind (unique in a plan)."""
    values = names.get(quantile.values, quantile.values)
    return f"{values}:{quantile.q}:{'disc' if quantile.discrete else 'cont'}"


# --- finishing: post-processing of the measurement -----------------------------------------------------------


def released_rows(plan: DPPlan, measurement: Measurement) -> list[Row]:
    """The released groups' answer rows (output columns, then hidden ones), in the order of their keys, with a
    HAVING compiled by dp_having applied; ORDER BY and LIMIT not yet."""
    names = canonical_names(plan.statistics)
    wanted = {**{stat.name: names[stat.name] for stat in plan.statistics if stat.kind != "values"},
              **{_quantile_key(q): quantile_id(q, names) for q in _quantiles(plan)}}
    result = []
    for group in measurement.groups:
        # by the plan's names
        values: dict[object, object] = {name: group.values[canonical] for name, canonical in wanted.items()}
        out = tuple(_output(column, group.keys, values, plan) for column in plan.columns + plan.hidden)
        if plan.having is not None and not holds(plan.having, out):
            continue
        result.append(out)
    return result


def post_arrays(plan: DPPlan, released: list[Row]) -> list[list[object]]:
    """The post statement's parameters: the row numbers 1..n, then each value column it reads, as lists."""
    assert plan.post is not None
    return [list(range(1, len(released) + 1)), *([row[i] for row in released] for i in plan.post.values)]


def finish(plan: DPPlan, released: list[Row], computed: list[Row] | None,
           ) -> tuple[list[Row], list[ColumnNoise | None]]:
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


def _key_order(plan: DPPlan, row: Row) -> tuple[object, ...]:
    """A sort key of a SQL row's group keys that depends on nothing but their values: a public key's position in
    its declared domain, else the value itself (NULL last, as PostgreSQL sorts ascending)."""
    if plan.domains is not None:  # a calendar key's buckets: by their own values
        return tuple(domain.index(value) if isinstance(domain, tuple) else _value_order(value)
                     for domain, value in zip(plan.domains, row[:plan.keys], strict=True))
    return tuple(_value_order(value) for value in row[:plan.keys])


def _value_order(value: object) -> tuple[int, object]:
    """NULL and NaN after every number (PostgreSQL's order), other values by themselves or, if they have no
    order of their own, by their repr: never an exception, and the same order whatever order they arrive in."""
    nan = (isinstance(value, float) and math.isnan(value)) or (isinstance(value, Decimal) and value.is_nan())
    if value is None or nan:
        return (1 + (value is None), 0)
    return (0, value if isinstance(value, _ORDERABLE) else repr(value))


_ORDERABLE = (int, float, Decimal, str, bytes, datetime.date, datetime.time, datetime.timedelta)


def _draw(stat: Statistic) -> int:
    """One draw of the statistic's noise, in grid units: its discrete Gaussian, or its discrete Laplace."""
    return discrete_laplace(stat.scale) if stat.sigma2 is None else discrete_gaussian(stat.sigma2)


def _noisy(stat: Statistic, value: object) -> int | Decimal | float:
    """The statistic plus its noise: in the type PostgreSQL gave the exact value, or a numeric on the statistic's
    fixed-point grid when it has one."""
    if value is None:
        value = 0
    if stat.resolution is None:
        if isinstance(value, int) and not isinstance(value, bool):
            return value + _draw(stat)
        exact = Fraction(value) if isinstance(value, float) else Fraction(Decimal(value))  # type: ignore[arg-type]
        grid = to_grid(exact, 1)  # an integer statistic that came back as numeric (sum of bigint)
        return _like(value, Fraction(grid + _draw(stat)))
    exact = Fraction(value) if isinstance(value, float) else Fraction(Decimal(value))  # type: ignore[arg-type]
    grid = to_grid(exact, stat.resolution)
    return to_decimal((grid + _draw(stat)) * stat.resolution)


def _like(template: object, value: Fraction) -> int | Decimal | float:
    if isinstance(template, float):
        return float(value)
    if isinstance(template, int):
        return int(value) if value.denominator == 1 else to_decimal(value)
    return to_decimal(value)


def _output(column: OutputColumn, keys: Row, noisy: dict[object, object], plan: DPPlan) -> object:
    if column.kind == "post":
        return None  # the post statement computes it
    if column.kind == "key":
        return keys[column.key]  # type: ignore[index]
    if column.kind == "interval":
        assert column.of is not None
        low, high = _interval(column.of, noisy, plan)
        return low if column.bound == "low" else high
    if column.kind == "count":
        return max(0, noisy[column.statistic])  # type: ignore[call-overload]
    if column.kind == "sum":
        total = noisy[column.statistic]
        if column.denominator is not None:  # Σ(x − c) + c·n, from its average's noisy statistics
            exact = _fraction(total) + column.center * _fraction(noisy[column.denominator])
            total = to_decimal(exact) if column.noise is not None and column.noise.resolution is not None \
                else _like(total, exact)
        if column.noise is not None and column.noise.resolution is not None and column.noise.ci95_halfwidth:
            return supported_digits(_fraction(total), column.noise.ci95_halfwidth)  # numeric on its grid
        return total
    if column.kind == "quantile":
        assert column.quantile is not None
        return noisy[_quantile_key(column.quantile)]  # drawn once per group by measure()
    if column.kind == "avg":
        return _average(column, noisy)[0]
    n = max(int(noisy[column.denominator]), 1)  # type: ignore[call-overload]
    mean = _fraction(noisy[column.linear]) / n
    lower, upper = column.lower, column.upper
    assert lower is not None and upper is not None
    # Σ((x − c)² − o) / n + o − ((Σ(x − c)) / n)² is the population variance; n/(n − 1) times it the sample one.
    variance = _fraction(noisy[column.statistic]) / n + column.offset - mean * mean
    half = (upper - lower) / 2
    variance = min(max(variance, Fraction(0)), half * half)  # values in [L, U] have a variance ≤ ((U − L)/2)²
    if column.sample:
        variance = variance * n / max(n - 1, 1)
    if column.kind == "variance":
        return round(to_decimal(variance), 16)
    return round(to_decimal(variance).sqrt(), 16)


def supported_digits(value: Fraction, halfwidth: float) -> Decimal:
    """``value`` rounded to one decimal place below the leading digit of its 95 % interval's half-width: ±51
    gives whole numbers, ±0.3 hundredths. Finer digits are noise, not information. The half-width comes from
    the plan and the group's noisy values only, so the rounding is post-processing of noisy values: it costs
    no privacy and reveals nothing about the data."""
    exponent = intervals.digits(halfwidth)
    steps = round(value / Fraction(10) ** exponent)  # half to even
    return Decimal(steps).scaleb(exponent)


def _average(column: OutputColumn, noisy: dict[object, object], bounds: bool = False,
             ) -> tuple[Decimal, Decimal | None, Decimal | None]:
    """A group's released AVG, rounded to the digits its own interval supports, and (``bounds``) that interval's
    ends, rounded outward to the same digit."""
    lower, upper = column.lower, column.upper
    assert lower is not None and upper is not None and column.noise is not None and column.noise.parts is not None
    sum_spread, count_spread = (intervals.spread(part.mechanism, part.stddev) for part in column.noise.parts)
    total, count = _fraction(noisy[column.statistic]), int(noisy[column.denominator])  # type: ignore[call-overload]
    value, half = intervals.average_value(total, count, column.center, lower, upper, sum_spread, count_spread)
    rounded = supported_digits(value, half)
    if not lower <= Fraction(rounded) <= upper:  # rounding must not leave the bounds either
        rounded = to_decimal(min(max(Fraction(rounded), lower), upper))
    if not bounds:
        return rounded, None, None
    found = intervals.average(total, count, column.center, lower, upper, sum_spread, count_spread)
    low, high = intervals.outward(min(found.low, Fraction(rounded)), max(found.high, Fraction(rounded)),
                                  intervals.digits(half))
    return rounded, max(low, to_decimal(lower)), min(high, to_decimal(upper))


def _selected_average(column: OutputColumn, noisy: dict[object, object], threshold: int,
                      released: Decimal) -> tuple[Decimal, Decimal] | None:
    """An AVG's interval when its count is partition selection's and the selection biases it (intervals.py,
    selected_average), rounded outward to the digits of the released value (``released``) and holding it; else
    None."""
    assert column.noise is not None and column.noise.parts is not None
    assert column.lower is not None and column.upper is not None
    total_noise, count_noise = column.noise.parts
    assert total_noise.scale is not None and count_noise.scale is not None
    step = total_noise.resolution
    sum_law = intervals.law(total_noise.mechanism, total_noise.scale / float(step or 1))  # in grid steps
    found = intervals.selected_average(_fraction(noisy[column.statistic]), int(noisy[column.denominator]),  # type: ignore
                                       column.center, column.lower, column.upper, sum_law, step,
                                       intervals.law(count_noise.mechanism, count_noise.scale), threshold)
    if found is None:
        return None
    rounded = Fraction(released)
    low, high = intervals.outward(min(found[0], rounded), max(found[1], rounded), int(released.as_tuple().exponent))
    return max(low, to_decimal(column.lower)), min(high, to_decimal(column.upper))


def _interval(column: OutputColumn, noisy: dict[object, object], plan: DPPlan) -> tuple[object, object]:
    """The ends of the 95 % interval of an output column's value in this group (intervals.py)."""
    if column.kind == "avg":
        key = ("interval", column.statistic, column.denominator, column.center, column.lower, column.upper)
        if key not in noisy:  # dp_interval_low and dp_interval_high of one AVG: computed once per group
            released, low, high = _average(column, noisy, bounds=True)
            noisy[key] = (low, high)
            if column.denominator == plan.selection and plan.threshold is not None:  # its count decided the release
                noisy[key] = _selected_average(column, noisy, plan.threshold, released) or noisy[key]
        return noisy[key]  # type: ignore[return-value]
    # a count's raw noisy value (its interval may reach below 0); a sum as released (derived from avg's statistics)
    value = noisy[column.statistic] if column.kind == "count" else _output(column, (), noisy, plan)
    noise = column.noise
    assert noise is not None and noise.ci95_halfwidth is not None
    if column.kind == "count":
        half = int(noise.ci95_halfwidth)
        if column.statistic == plan.selection and plan.threshold is not None:  # its value decided the release
            assert noise.scale is not None
            return intervals.selected_count(value, intervals.law(noise.mechanism, noise.scale),  # type: ignore
                                            plan.threshold, half)
        return max(0, value - half), max(0, value + half)  # type: ignore[operator]
    if noise.resolution is not None:  # a sum on a fixed-point grid, released rounded to its interval's digits
        total = _fraction(value)
        half_width = Fraction(noise.ci95_halfwidth)
        return intervals.outward(total - half_width, total + half_width, intervals.digits(noise.ci95_halfwidth))
    halfwidth = noise.ci95_halfwidth
    halfwidth = int(halfwidth) if isinstance(value, int) or halfwidth == int(halfwidth) else halfwidth
    return value - halfwidth, value + halfwidth  # type: ignore[operator]


def _fraction(value: object) -> Fraction:
    return Fraction(value) if isinstance(value, (int, float)) else Fraction(Decimal(value))  # type: ignore[arg-type]


def _ordered(rows: list[Row], order: tuple[OrderKey, ...]) -> list[Row]:
    if not order:
        return rows

    def compare(a: Row, b: Row) -> int:
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
