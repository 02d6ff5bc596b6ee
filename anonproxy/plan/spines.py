"""Constant relations (time spines) beside the released rows of aggregate queries.

Cube, MetricFlow and Grafana fill the gaps of a series by LEFT JOINing a list of the periods to the aggregate
query: ``FROM generate_series('2025-03-01'::timestamptz, '2025-03-31'::timestamptz, interval '1 day') AS d(day)
LEFT JOIN (SELECT date_trunc('day', visited_at) AS day, count(*) AS n FROM visits GROUP BY 1) AS q ON q.day =
d.day``, or ``(VALUES (...), ...) AS dates(date_from, date_to)`` and a derived table over it. Such a relation
holds constants only, no person's data: an outer query over released rows (:mod:`anonproxy.plan.outer`) may read
it beside them. A period without a released row (none happened, or its group was withheld) gets the NULLs of the
LEFT JOIN. Its size is bounded: :data:`MAX_ROWS` rows at most, counted from its constant arguments.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from sqlglot import exp

from anonproxy.plan import time_values as tv
from anonproxy.plan.names import output_name, own_nodes, sources
from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import identifier

MAX_ROWS = 20_000  # as many buckets as dp mode lists for a time key at most (anonproxy.dp.time_domains)
HINT = ("A time spine is generate_series(<start>, <stop>, <step>) of constants (numbers, or timestamps and an "
        "interval), or a VALUES list, of at most 20000 rows, LEFT JOINed to an aggregate query: FROM "
        "generate_series('2025-01-01'::timestamptz, '2025-01-31'::timestamptz, interval '1 day') AS d(day) LEFT "
        "JOIN (SELECT date_trunc('day', t) AS day, count(*) AS n FROM ... GROUP BY 1) AS q ON q.day = d.day.")
_SECONDS_PER_STEP_UNIT = {"months": 28 * 86400, "days": 86400}  # the shortest month and day a step can be


def is_spine(item: exp.Expression) -> bool:
    """Whether FROM item ``item`` is a constant relation by its form: generate_series, VALUES, or a derived table
    that reads only those (its size and arguments are checked by :func:`columns`)."""
    if isinstance(item, exp.Table):
        return isinstance(item.this, exp.ExplodingGenerateSeries)
    if isinstance(item, exp.Values):
        return True
    if isinstance(item, exp.Subquery) and isinstance(item.this, exp.Select):
        body = item.this
        inner = sources(body)
        return {key for key, value in body.args.items() if value not in (None, False, [], "")} <= {
            "expressions", "from_"} and bool(inner) and all(is_spine(other) for other in inner) \
            and not any(isinstance(node, (exp.AggFunc, exp.Window)) for node in own_nodes(body))
    return False


def reference(item: exp.Expression) -> str:
    """The name the outer query reads the spine by (its alias; generate_series without one)."""
    alias = item.args.get("alias")
    name = identifier(alias.this) if alias is not None and alias.this else None
    return name or "generate_series"


def columns(item: exp.Expression, source: str) -> tuple[str, ...]:
    """The spine's column names, after checking it is constant and at most MAX_ROWS rows."""
    alias = item.args.get("alias")
    listed = tuple(identifier(column) or "" for column in alias.args.get("columns") or []) if alias else ()
    if isinstance(item, exp.Table):
        _check_series(item.this)
        return listed[:1] or (reference(item),)  # a function's alias names its column too
    if isinstance(item, exp.Values):
        rows = item.expressions
        if len(rows) > MAX_ROWS or any(_reads_data(row) for row in rows):
            raise unsupported(f"a VALUES list beside aggregate queries holds at most {MAX_ROWS} rows of constants",
                              HINT)
        width = len(rows[0].expressions) if rows and isinstance(rows[0], exp.Tuple) else 1
        return listed + tuple(f"column{i}" for i in range(len(listed) + 1, width + 1))
    body = item.this
    for inner in sources(body):
        columns(inner, source)
    if any(_reads_data(node) for node in body.expressions):
        raise unsupported("a derived table over a time spine may compute only over its constants", HINT)
    names = tuple(output_name(node, source) or "?column?" for node in body.expressions)
    return listed + names[len(listed):]


def _reads_data(node: exp.Expression) -> bool:
    """Whether ``node`` holds anything but constants and the spine's own columns: a parameter or a query."""
    return any(isinstance(part, (exp.Parameter, exp.Placeholder, exp.Query, exp.Exists)) for part in node.walk())


def _check_series(series: exp.ExplodingGenerateSeries) -> None:
    start, end, step = series.args.get("start"), series.args.get("end"), series.args.get("step")
    rows = _number_rows(start, end, step) if step is None or _integer(step) is not None else None
    if rows is None:
        rows = _time_rows(start, end, step)
    if rows is None:
        raise unsupported("generate_series beside aggregate queries takes constants: integers, or two timestamps "
                          "and an interval", HINT)
    if rows > MAX_ROWS:
        raise unsupported(f"generate_series beside aggregate queries gives at most {MAX_ROWS} rows; this one "
                          f"gives {rows}", HINT)


def _number_rows(start: exp.Expression | None, end: exp.Expression | None, step: exp.Expression | None,
                 ) -> int | None:
    low, high = _integer(start), _integer(end)
    by = 1 if step is None else _integer(step)
    if low is None or high is None or by is None or by == 0:
        return None
    return max(0, (high - low) // by + 1)


def _integer(node: exp.Expression | None) -> int | None:
    sign = 1
    while isinstance(node, (exp.Paren, exp.Neg)):
        sign = -sign if isinstance(node, exp.Neg) else sign
        node = node.this
    if isinstance(node, exp.Literal) and not node.is_string and node.name.isdigit():
        return sign * int(node.name)
    return None


def _time_rows(start: exp.Expression | None, end: exp.Expression | None, step: exp.Expression | None,
               ) -> int | None:
    """Rows of generate_series over timestamps, at most: the span over the step's shortest length (a month of 28
    days, a day of 24 hours); None unless both ends are timestamp constants and the step a positive interval."""
    low, high, interval = _moment(start), _moment(end), _interval(step)
    if low is None or high is None or interval is None or interval.sign != 1:
        return None
    seconds = (interval.months * _SECONDS_PER_STEP_UNIT["months"] + interval.days * _SECONDS_PER_STEP_UNIT["days"]
               + interval.micros / Decimal(1_000_000))
    span = Decimal((high - low).total_seconds())
    return max(0, int(span / Decimal(seconds)) + 1)


def _moment(node: exp.Expression | None) -> datetime | None:
    """A timestamp constant: '2025-01-01'::timestamptz, TIMESTAMP '...', or a quoted ISO string; UTC unless it says
    otherwise (an upper bound of the rows either way: a zone moves both ends alike)."""
    if isinstance(node, exp.Cast) and node.to.this in (exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ,
                                                        exp.DataType.Type.DATE):
        node = node.this
    if not isinstance(node, exp.Literal) or not node.is_string:
        return None
    try:
        moment = datetime.fromisoformat(node.name.strip())
    except ValueError:
        return None
    return moment.replace(tzinfo=None) if moment.tzinfo is None else moment.astimezone(UTC).replace(tzinfo=None)


def _interval(node: exp.Expression | None) -> tv.Interval | None:
    if isinstance(node, exp.Interval) and isinstance(node.this, exp.Literal):
        unit = node.args.get("unit")
        return tv.parse_interval(f"{node.this.name} {unit.name}" if isinstance(unit, exp.Var) else node.this.name)
    if isinstance(node, exp.Cast) and node.to.this == exp.DataType.Type.INTERVAL \
            and isinstance(node.this, exp.Literal) and node.this.is_string:
        return tv.parse_interval(node.this.name)
    return None
