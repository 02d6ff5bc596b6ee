"""Public time domains: the buckets of a calendar key over a time column's declared range (docs/dp.md).

A GROUP BY key that a calendar function derives from one time column with declared bounds (``earliest``,
``latest``: sql/0033) — ``date_trunc`` of a unit, ``date_bin`` with a constant stride and origin,
``extract``/``date_part`` of a calendar field, ``to_char`` with a constant format, a cast of the column to
``date``, Grafana's epoch bins ``floor(extract(epoch from col) / n) * n``, and casts and arithmetic with numbers
of these — takes a value that only the calendar decides, for each instant of the declared range. Those values are
public: they are listed as the key's domain, every bucket is released (noisy, zero-filled where empty) and no
partition selection is needed.

PostgreSQL lists them, in the statement that measures, from the statement's own key expression applied to the
instants of a grid over the range (no row is read): the grid's step is the unit (date_bin's stride, the epoch
bins' seconds) of the calendar function applied to the column (the innermost one), its start that function's
bucket of the range's first instant, so each bucket that one instant of the range falls in holds a grid point,
or the range's first or last instant. The same session computes the buckets and the rows' keys (time zone and
all), so they agree. Decided on the statement's tree and the policy only.

A WHERE clause read as an AND of conditions narrows the range: ``col >= c``, ``col > c``, ``col < c``,
``col <= c``, ``col = c`` and ``col BETWEEN c1 AND c2``, each constant a string literal, or a literal cast to the
column's own type or to a narrower time type (a date, or a timestamp with a timestamptz column: widened to the
column's type as PostgreSQL compares them). A client's ``$n`` there is bound at Bind and arrives here as such a
constant (anonproxy/plan/bind_values.py, "time" slots). Whatever else it says leaves the range as it is: a
bucket listed that no row can reach is answered as an empty one.

Rows outside the declared range are left out of a calendar key's buckets (the SQL keeps only rows within the
bounds, as a numeric argument is clamped into its bounds): one person's timestamp far outside the range creates
no bucket and counts in none.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlglot import exp

from anonproxy.plan.render import sql as render

MAX_TIME_BUCKETS = 20_000  # buckets of the time keys, and of all keys with them, listed at most (else: selection)
POINT = "anonproxy_t"  # the grid's column in the listing SQL
_POINTS = "anonproxy_points"
_RANGE = "anonproxy_range"

# The SQL type of a time column (format_type's name, without a precision) -> the name its casts use.
TIME_TYPES = {"date": "date", "timestamp without time zone": "timestamp", "timestamp with time zone": "timestamptz"}


class _Grid(enum.Enum):
    """A grid step: each bucket of the key holds an instant of the grid. Its shortest length in seconds (a day
    may last 23 hours, a month 28 days) bounds how many buckets a range has."""

    SECOND = 1
    MINUTE = 60
    HOUR = 3600
    DAY = 23 * 3600
    MONTH = 28 * 86400


_TRUNC_UNITS = {"second": _Grid.SECOND, "minute": _Grid.MINUTE, "hour": _Grid.HOUR, "day": _Grid.DAY,
                "week": _Grid.DAY, "month": _Grid.MONTH, "quarter": _Grid.MONTH, "year": _Grid.MONTH,
                "decade": _Grid.MONTH, "century": _Grid.MONTH, "millennium": _Grid.MONTH}
_FIELDS = {"year": _Grid.MONTH, "quarter": _Grid.MONTH, "month": _Grid.MONTH, "decade": _Grid.MONTH,
           "century": _Grid.MONTH, "millennium": _Grid.MONTH, "isoyear": _Grid.DAY, "week": _Grid.DAY,
           "day": _Grid.DAY, "dow": _Grid.DAY, "isodow": _Grid.DAY, "doy": _Grid.DAY, "hour": _Grid.HOUR,
           "minute": _Grid.MINUTE}
# to_char's patterns as the parser spells them (strftime codes): the finest field each prints.
_FORMAT_CODES = {"Y": _Grid.MONTH, "y": _Grid.MONTH, "m": _Grid.MONTH, "b": _Grid.MONTH, "B": _Grid.MONTH,
                 "G": _Grid.DAY, "d": _Grid.DAY, "j": _Grid.DAY, "a": _Grid.DAY, "A": _Grid.DAY, "u": _Grid.DAY,
                 "w": _Grid.DAY, "V": _Grid.DAY, "U": _Grid.DAY, "W": _Grid.DAY, "H": _Grid.HOUR, "I": _Grid.HOUR,
                 "p": _Grid.HOUR, "M": _Grid.MINUTE, "S": _Grid.SECOND}
_CODE = re.compile(r"%(.)")
_QUOTED = re.compile(r'"[^"]*"')
_TRUNC_NAMES = {_Grid.SECOND: "second", _Grid.MINUTE: "minute", _Grid.HOUR: "hour", _Grid.DAY: "day",
                _Grid.MONTH: "month"}
_EXACT = "exact"  # the column's own value (or a cast that keeps it): no grid yet
_EPOCH = "epoch"  # its seconds since 1970 (extract(epoch from col)): a number, bins only by floor(… / n)
_ARITHMETIC = (exp.Add, exp.Sub, exp.Mul, exp.Div)
_STRIDE = re.compile(r"\s*(\d+)\s*(second|sec|minute|min|hour|day|week)s?\s*", re.IGNORECASE)
_STRIDE_SECONDS = {"second": 1, "sec": 1, "minute": 60, "min": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}


@dataclass(frozen=True)
class _Steps:
    """A grid: its first point from the range's first instant (SQL), its step (an interval, SQL), and the step's
    shortest length in seconds (how many buckets a range may hold)."""

    start: str  # SQL over the range's first instant, anonproxy_range.lo
    step: str
    seconds: float


def _calendar_steps(grid: _Grid) -> _Steps:
    name = _TRUNC_NAMES[grid]
    return _Steps(f"date_trunc('{name}', {_RANGE}.lo)", f"interval '1 {name}'", grid.value)


@dataclass(frozen=True)
class TimeColumn:
    """A time column with declared bounds, as the planner resolves a column reference."""

    identity: object  # the same for two references to the same column of the same table
    sql_type: str  # date, timestamp or timestamptz
    earliest: datetime
    latest: datetime


@dataclass(frozen=True)
class TimeDomain:
    """The buckets of a calendar key: ``sql`` lists them (a SELECT of one column, reading no row), about
    ``buckets`` of them (an estimate from the range and the WHERE's constants, which decides whether they are
    listed; the planner never sizes noise on it); ``within`` is the condition that keeps the rows in the declared
    range."""

    sql: str
    buckets: int
    within: str

    def __len__(self) -> int:
        return self.buckets


# A column reference -> its time column with declared bounds, or None (another column, or none declared).
TimeColumnOf = Callable[[exp.Expression], "TimeColumn | None"]


def calendar_domain(key: exp.Expression, where: exp.Expression | None, column_of: TimeColumnOf) -> TimeDomain | None:
    """The public domain of GROUP BY key ``key`` (a checked node), narrowed by ``where``; None when it is not a
    calendar key of a bounded time column, or has more than MAX_TIME_BUCKETS buckets."""
    columns = list(key.find_all(exp.Column))
    if len(columns) != 1 or any(key.find_all(exp.Parameter)):
        return None
    column = column_of(columns[0])
    grid = _grid(key)
    if column is None or not isinstance(grid, _Steps):
        return None
    low, high = [_moment(column.earliest, column.sql_type)], [_moment(column.latest, column.sql_type)]
    first, last = _naive(column.earliest), _naive(column.latest)
    for condition in _conjuncts(where):
        for side, moment in _narrow(condition, column, column_of, low, high):
            # a literal without an offset is read in the session's time zone: a day either way covers any
            wider = _day_wider(moment, side)
            first, last = (max(first, wider), last) if side == "low" else (first, min(last, wider))
    buckets = max(0, math.floor((last - first).total_seconds() / grid.seconds)) + 3
    if buckets > MAX_TIME_BUCKETS:
        return None
    lo, hi = (_extreme("GREATEST", low), _extreme("LEAST", high))
    point = key.copy()
    for node in point.find_all(exp.Column):
        node.replace(exp.column(POINT, table=_POINTS))
    cast = column.sql_type
    valid = f"FROM (SELECT {lo} AS lo, {hi} AS hi) AS {_RANGE} WHERE {_RANGE}.lo <= {_RANGE}.hi"
    points = (f"SELECT CAST(generate_series({grid.start}, {_RANGE}.hi, {grid.step}) AS {cast}) AS {POINT} {valid} "
              f"UNION ALL SELECT {_RANGE}.lo {valid} UNION ALL SELECT {_RANGE}.hi {valid}")
    listing = f"SELECT DISTINCT {render(point)} FROM ({points}) AS {_POINTS}"
    return TimeDomain(listing, buckets, within_range(columns[0], column))


def within_range(node: exp.Column, column: TimeColumn) -> str:
    """The condition that keeps the rows of time column ``column`` (read as ``node``) within its declared range."""
    return (f"{render(node)} BETWEEN {_moment(column.earliest, column.sql_type)} "
            f"AND {_moment(column.latest, column.sql_type)}")


def within_assumed(node: exp.Column, sql_type: str) -> str:
    """The condition that keeps the rows of a date or time column without declared bounds (of type ``sql_type``,
    read as ``node``) where the no-error proof takes its values to lie (anonproxy.plan.time_values.ASSUMED: 2000
    BC to 200000 AD, or ±infinity). A year inside each end: whatever TimeZone the constants are read under."""
    low, high, minus, plus = (f"CAST({text_literal(text)} AS {sql_type})"
                              for text in ("1999-01-01 BC", "199999-12-31", "-infinity", "infinity"))
    column = render(node)
    return f"{column} BETWEEN {low} AND {high} OR {column} IN ({minus}, {plus})"


def _grid(node: exp.Expression) -> _Steps | str | None:
    """The grid of a key: the unit of the calendar function applied to the column (``_EXACT``: the column itself,
    None: not a calendar key)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return _EXACT
    if isinstance(node, exp.Cast):
        inner = _grid(node.this)
        if inner != _EXACT:
            return inner
        target = node.to.this
        if target == exp.DataType.Type.DATE:
            return _calendar_steps(_Grid.DAY)
        return _EXACT if target in (exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ) else None
    if isinstance(node, exp.DateBin):
        inner = _grid(node.expression)
        return _bins(node) if inner == _EXACT else inner
    if isinstance(node, exp.Extract) and isinstance(node.this, exp.Var) and node.this.name.lower() == "epoch":
        return _EPOCH if _grid(node.expression) == _EXACT else None
    if isinstance(node, exp.Floor) and node.args.get("decimals") is None:
        return _epoch_bins(node.this)
    if isinstance(node, _ARITHMETIC):  # a calendar value and a number: constant wherever the value is
        left, right = node.this, node.expression
        value = left if _is_number(right) else right if _is_number(left) else None
        inner = _grid(value) if value is not None else None
        return inner if isinstance(inner, _Steps) else None
    unit = _unit(node)
    if unit is None:
        return None
    inner = _grid(node.this if not isinstance(node, exp.Extract) else node.expression)
    return _calendar_steps(unit) if inner == _EXACT else inner


def _is_number(node: exp.Expression) -> bool:
    while isinstance(node, exp.Paren):
        node = node.this
    return isinstance(node, exp.Literal) and not node.is_string


def _number(node: exp.Expression) -> int | None:
    """A positive whole number written as a constant, else None."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Literal) and not node.is_string and node.this.isdigit() and int(node.this) > 0:
        return int(node.this)
    return None


def _epoch_bins(node: exp.Expression) -> _Steps | str | None:
    """floor(x)'s grid: bins of n seconds when x is extract(epoch from col) / n (any grid of step n has one point in
    each bin, whatever its start), the grid of x when x is already a calendar value, else None."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Div) and _grid(node.this) == _EPOCH:
        seconds = _number(node.expression)
        return None if seconds is None else _Steps(f"{_RANGE}.lo", f"interval '{seconds} seconds'", seconds)
    inner = _grid(node)
    return inner if isinstance(inner, _Steps) else None


def _bins(node: exp.DateBin) -> _Steps | None:
    """date_bin(stride, col, origin)'s grid: its bins from the range's first instant's, a stride apart; None unless
    the stride is a constant of whole seconds to weeks and the origin a constant (a string, or one cast)."""
    stride, origin = node.this, node.args.get("origin")
    text = None
    if isinstance(stride, exp.Literal) and stride.is_string:
        text = stride.this
    elif isinstance(stride, exp.Interval) and isinstance(stride.this, exp.Literal) and stride.unit is not None:
        text = f"{stride.this.this} {stride.unit.name}"
    match = _STRIDE.fullmatch(text) if text is not None else None
    while isinstance(origin, exp.Cast):
        origin = origin.this
    if match is None or not (isinstance(origin, exp.Literal) and origin.is_string) or int(match[1]) < 1:
        return None
    start = node.copy()
    start.set("expression", exp.column("lo", table=_RANGE))
    seconds = int(match[1]) * _STRIDE_SECONDS[match[2].lower()]
    return _Steps(render(start), f"CAST({render(stride)} AS interval)", seconds)


def _unit(node: exp.Expression) -> _Grid | None:
    """The cells a calendar function is constant on, or None for any other node."""
    if isinstance(node, (exp.TimestampTrunc, exp.DateTrunc)) and node.args.get("zone") is None:
        unit = node.args.get("unit")
        name = unit.name.lower() if isinstance(unit, (exp.Var, exp.Literal)) else ""
        return _TRUNC_UNITS.get(name.removesuffix("s") if name != "millennium" else name)
    if isinstance(node, exp.Extract):
        field = node.this
        name = field.name.lower() if isinstance(field, (exp.Var, exp.Literal, exp.Identifier)) else ""
        return _FIELDS.get(name)
    if isinstance(node, exp.TimeToStr):
        form = node.args.get("format")
        if not (isinstance(form, exp.Literal) and form.is_string) or node.args.get("zone") is not None:
            return None
        return _format_unit(form.this)
    return None


def _format_unit(form: str) -> _Grid | None:
    """The finest field a to_char format prints; None if it prints one finer than a second, or holds letters
    outside quotes that are no known pattern."""
    units = []
    for code in _CODE.findall(form):
        if code not in _FORMAT_CODES:
            return None
        units.append(_FORMAT_CODES[code])
    rest = _CODE.sub("", _QUOTED.sub("", form))
    if not units or any(character.isascii() and character.isalpha() for character in rest):
        return None
    return min(units, key=lambda unit: unit.value)


def text_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _moment(value: datetime, sql_type: str) -> str:
    if sql_type == "date":
        return f"CAST({text_literal(value.date().isoformat())} AS date)"
    text = value.replace(tzinfo=None).isoformat(" ") + ("+00" if sql_type == "timestamptz" else "")
    return f"CAST({text_literal(text)} AS {sql_type})"


def _extreme(function: str, values: list[str]) -> str:
    return values[0] if len(values) == 1 else f"{function}({', '.join(values)})"


def _conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    while isinstance(node, exp.Paren):
        node = node.this
    if node is None:
        return []
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    return [node]


_FLIPPED: dict[type[exp.Expression], type[exp.Expression]] = {exp.GT: exp.LT, exp.GTE: exp.LTE, exp.LT: exp.GT,
                                                               exp.LTE: exp.GTE, exp.EQ: exp.EQ}


def _narrow(condition: exp.Expression, column: TimeColumn, column_of: TimeColumnOf, low: list[str],
            high: list[str]) -> list[tuple[str, datetime]]:
    """Add to ``low`` and ``high`` the bounds one condition sets on the column (inclusive), if it sets any; return
    them as Python reads them, naive, for the estimate of the buckets ("low" or "high", the moment)."""
    if isinstance(condition, exp.Between) and _is(condition.this, column, column_of) \
            and not condition.args.get("symmetric"):
        first, last = _constant(condition.args.get("low"), column), _constant(condition.args.get("high"), column)
        if first is None or last is None:
            return []
        low.append(first[0])
        high.append(last[0])
        return _read([("low", first[1]), ("high", last[1])])
    kind = type(condition)
    if kind not in _FLIPPED:
        return []
    assert isinstance(condition, exp.Binary)
    left, right = condition.this, condition.expression
    if _is(right, column, column_of):
        left, right, kind = right, left, _FLIPPED[kind]
    if not _is(left, column, column_of):
        return []
    constant = _constant(right, column)
    if constant is None:
        return []
    value = constant[0]
    # a strict bound excludes its own instant: the next one (a day for a date column, else a microsecond)
    step = "1" if column.sql_type == "date" else "interval '1 microsecond'"
    if kind in (exp.GTE, exp.EQ):
        low.append(value)
    if kind in (exp.LTE, exp.EQ):
        high.append(value)
    if kind is exp.GT:
        low.append(f"{value} + {step}")
    if kind is exp.LT:
        high.append(f"{value} - {step}")
    return _read([(side, constant[1]) for side in _SIDES[kind]])


_DAY = timedelta(days=1)
_SIDES: dict[type[exp.Expression], tuple[str, ...]] = {exp.GT: ("low",), exp.GTE: ("low",), exp.LT: ("high",),
                                                       exp.LTE: ("high",), exp.EQ: ("low", "high")}


def _read(texts: list[tuple[str, str]]) -> list[tuple[str, datetime]]:
    """The constants Python reads as ISO dates and times, naive (in UTC when written with an offset); not one whose
    UTC instant lies outside Python's years (0001-01-01 00:00+05): it then narrows the estimate not at all."""
    read = []
    for side, text in texts:
        try:
            read.append((side, _naive(datetime.fromisoformat(text.strip()))))
        except (ValueError, OverflowError):
            continue
    return read


def _day_wider(moment: datetime, side: str) -> datetime:
    """A day before a low bound or after a high one; Python's first or last instant past its years (an "all time"
    range an ORM writes from datetime.min to datetime.max)."""
    try:
        return moment - _DAY if side == "low" else moment + _DAY
    except OverflowError:
        return datetime.min if side == "low" else datetime.max


def _naive(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo is not None else moment


def _is(node: exp.Expression, column: TimeColumn, column_of: TimeColumnOf) -> bool:
    while isinstance(node, exp.Paren):
        node = node.this
    if not isinstance(node, exp.Column):
        return False
    found = column_of(node)
    return found is not None and found.identity == column.identity


def _constant(node: exp.Expression | None, column: TimeColumn) -> tuple[str, str] | None:
    """A constant compared with the column, as SQL of the column's type, and its text: a string literal (read as
    the column's type, as PostgreSQL reads it), or a string literal cast to that very type; None for anything
    else."""
    while isinstance(node, exp.Paren):
        node = node.this
    cast = TIME_TYPES.get(_type_name(node.to)) if isinstance(node, exp.Cast) else None
    if cast is not None and cast != column.sql_type and (cast, column.sql_type) not in _WIDENED:
        return None
    if isinstance(node, exp.Cast) and cast is not None:
        node = node.this
    if not (isinstance(node, exp.Literal) and node.is_string):
        return None
    value = text_literal(node.this)
    if cast is not None and cast != column.sql_type:  # compared as PostgreSQL does: the value widened
        value = f"CAST({value} AS {cast})"
    return f"CAST({value} AS {column.sql_type})", node.this


# A constant of the first type compared with a column of the second: PostgreSQL casts the constant to the column's
# type (the other way round, it casts the column, which a bound on the column does not follow exactly).
_WIDENED = frozenset({("date", "timestamp"), ("date", "timestamptz"), ("timestamp", "timestamptz")})


def _type_name(node: exp.DataType) -> str:
    return {exp.DataType.Type.DATE: "date", exp.DataType.Type.TIMESTAMP: "timestamp without time zone",
            exp.DataType.Type.TIMESTAMPTZ: "timestamp with time zone"}.get(node.this, "")
