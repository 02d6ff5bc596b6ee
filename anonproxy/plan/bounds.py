"""The no-error proof for row-level expressions: an abstract interpreter over sqlglot trees.

An expression that reaches a row of a protected table must give the same kind of
answer for every row: if it could raise an error for some values and not
others, the error itself would be a one-bit answer about a person
(``GROUP BY 1/(age - 37)`` fails exactly when someone is 37). Each node is
evaluated here, not on data but on what its inputs may hold:

* its SQL type, by PostgreSQL's rules (int4 op int4 is int4 and overflows past
  2^31 - 1; an integer and a numeric give numeric; a float makes the result
  float8, or float4 when both are float4; floor(int) is double precision);
* the interval of its finite values, from the column's type range or the
  bounds the policy declares for it (ColumnPolicy.lower/upper), and from the
  constants;
* ``scale``: every non-zero value is at least 10^-scale in magnitude (integers:
  0), which is what rules out float underflow;
* whether it may be NaN or ±Infinity (float and unbounded numeric columns,
  extract() of an infinite timestamp); for a date or timestamp, whether it may
  be ±infinity.

A node that may raise for some value within those raises :class:`Unsafe`, with
the reason and a hint showing the safe form: division and modulo only by
non-zero constants, no integer, numeric or float overflow or float underflow,
no cast that can fail (text to a number, a value out of the target's range,
NaN or Infinity to an integer), constant arguments where a function fails on
some (substring lengths, round's digits, to_char's format).

Subtrees without columns or parameters are constant: PostgreSQL folds them
when it plans the statement (an error there is the same for every row and
every database), so they are typed but not proved. Not the stable functions,
which the planner does not fold: PostgreSQL evaluates them when the statement
runs, for the rows that reach them (CASE WHEN age = 37 THEN 'x'::text::date END
fails only if someone is 37), so they are proved: the clock, to_timestamp(), a
typed constant cast to a date or timestamp, the time functions over constants
(they follow the session's TimeZone) and the text form of a date, timestamp or
interval (DateStyle, IntervalStyle). || of constants is computed before
(anonproxy.plan.analysis). A ``$n`` parameter is not constant (a generic plan
evaluates it per row), and is refused in arithmetic.

The proof trusts the bounds its caller gives as facts: in suppress mode the
declared bounds, the DBA's statement of what a column holds; in dp mode, which
tolerates values outside them, only those of columns read clamped into them
(:mod:`anonproxy.plan.clamp`) and declared time ranges where dp keeps rows
within them (:mod:`anonproxy.plan.expressions`). Dates and timestamps are
intervals of microseconds too, with ±infinity: where they lie without declared
bounds, and what each time function may do to them (truncations, time zones,
intervals, the clock), is :mod:`anonproxy.plan.time_values`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date
from decimal import (
    ROUND_CEILING,
    ROUND_FLOOR,
    ROUND_HALF_UP,
    Decimal,
    InvalidOperation,
    localcontext,
)

from sqlglot import exp
from sqlglot.errors import SqlglotError

from anonproxy.plan import time_values as tv

INF = Decimal("Infinity")
INTEGERS = {"int2": (Decimal(-(2**15)), Decimal(2**15 - 1)), "int4": (Decimal(-(2**31)), Decimal(2**31 - 1)),
            "int8": (Decimal(-(2**63)), Decimal(2**63 - 1))}
# The largest finite value, and n such that 10^-n is above the smallest normal value.
FLOATS = {"float4": (Decimal("3.4028235e38"), 37), "float8": (Decimal("1.7976931348623157e308"), 307)}
# numeric holds fewer than 131072 digits before the point.
NUMERIC_LIMIT = Decimal(10) ** 131072
NUMBERS = ("int2", "int4", "int8", "numeric", "float4", "float8")
TEXT = "text"
DATETIMES = ("date", "timestamp", "timestamptz")
# Constants a function takes as a length or position: far below where PostgreSQL's own arithmetic could overflow.
MAX_POSITION = 1_000_000
MAX_DIGITS = 1000  # round(x, n) / trunc(x, n)
MAX_WIDTH_BUCKETS = 10_000
# The largest magnitude a derived value added up by sum() or avg() may have (see expressions.MAX_SUMMED_CONSTANT).
MAX_SUMMED = Decimal("1e15")

_CAST_TYPES: dict[exp.DType, str] = {
    exp.DataType.Type.SMALLINT: "int2", exp.DataType.Type.INT: "int4", exp.DataType.Type.BIGINT: "int8",
    exp.DataType.Type.DECIMAL: "numeric", exp.DataType.Type.FLOAT: "float4", exp.DataType.Type.DOUBLE: "float8",
    exp.DataType.Type.TEXT: TEXT, exp.DataType.Type.VARCHAR: TEXT, exp.DataType.Type.CHAR: TEXT,
    exp.DataType.Type.NAME: TEXT, exp.DataType.Type.BOOLEAN: "bool", exp.DataType.Type.DATE: "date",
    exp.DataType.Type.TIMESTAMP: "timestamp", exp.DataType.Type.TIMESTAMPTZ: "timestamptz",
    exp.DataType.Type.TIME: "time", exp.DataType.Type.INTERVAL: "interval",
}  # fmt: skip

# Stable functions of the clock PostgreSQL spells as plain function calls (now() and the keywords are typed nodes).
STABLE_CLOCK = frozenset({"transaction_timestamp", "statement_timestamp"})
DECLARE_HINT = "have the DBA declare bounds for the columns involved (anonproxy.set_column(..., lower, upper))"


class Unsafe(Exception):
    """The expression may raise an error for some value within the declared bounds and types."""

    def __init__(self, reason: str, hint: str, rewrite: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hint = hint
        self.rewrite = rewrite  # what works whatever the declared bounds (dp mode, past the bounds it reads clamped)


@dataclass(frozen=True)
class ColumnFacts:
    """What the policy knows about a column: its SQL type as PostgreSQL names it (None: not known) and its
    declared bounds."""

    name: str
    type: str | None
    lower: Decimal | None = None
    upper: Decimal | None = None
    # a time column's declared bounds, in microseconds since 2000-01-01 (anonproxy.plan.time_values)
    earliest: Decimal | None = None
    latest: Decimal | None = None
    # without them: any value PostgreSQL holds, not only time_values.ASSUMED (dp's conditions assume nothing)
    whole_range: bool = False


@dataclass(frozen=True)
class Value:
    """What an expression may evaluate to."""

    type: str  # a name of NUMBERS or DATETIMES, text, bool, time, interval; unknown (a column whose type is not
    # known), literal (a quoted constant of no type yet), null, param, other
    low: Decimal = -INF  # bounds of its finite values (numbers; dates and timestamps: microseconds since 2000)
    high: Decimal = INF
    scale: int | None = 0  # non-zero values are at least 10^-scale in magnitude; None: arbitrarily close to zero
    nan: bool = False
    infinite: bool = False
    constant: bool = False  # no column or parameter below: folded when the statement is planned
    value: Decimal | str | None = None  # a constant's value, when known

    @property
    def magnitude(self) -> Decimal:
        return max(abs(self.low), abs(self.high))


Facts = Callable[[exp.Column], ColumnFacts]


def evaluate(node: exp.Expression, facts: Facts, zones: frozenset[str] | None = None) -> Value:
    """The value of ``node``; raises :class:`Unsafe` if some row could make it raise an error. ``zones``: the time
    zone names the server knows (Policy.zones; None: UTC and GMT only)."""
    with localcontext() as context:
        # Sums and products of bounds are exact at 400 digits; a quotient is rounded to nearest, which is monotone:
        # a bound at or past a limit (every limit is representable) never rounds back below it.
        context.prec, context.Emax, context.Emin = 400, 999_999, -999_999
        try:
            return _Interpreter(facts, zones).value(node)
        except ArithmeticError:  # decimal's own overflow: bounds beyond 10^999999
            raise Unsafe(f"{_sql(node)} computes values too large to bound", DECLARE_HINT[0].upper()
                         + DECLARE_HINT[1:] + ".") from None


def derived(node: exp.Expression) -> bool:
    """Whether ``node`` computes a new number from a column (arithmetic, rounding, a numeric cast, length ...)."""
    return any(isinstance(n, _DERIVED) and not _is_constant_tree(n) for n in node.walk())


def column_value(facts: ColumnFacts) -> Value:
    if facts.type is None:
        return Value("unknown")
    datatype = _datatype(facts.type)
    if datatype is None:
        return Value("other")
    kind = _cast_type(datatype)
    declared = facts.lower is not None and facts.upper is not None
    if kind in INTEGERS:
        low, high = INTEGERS[kind]
        value = Value(kind, low, high)
    elif kind == "numeric":
        precision, scale = _typmod(datatype)
        if precision is not None:
            limit = Decimal(10) ** (precision - scale) - Decimal(10) ** -scale
            value = Value(kind, -limit, limit, scale, nan=True)  # numeric(p, s) holds NaN, not Infinity
        else:
            # Bounded by 10^131072 (exclusive): a result that may reach it is refused, and rounding the bounds to
            # 400 digits is monotone, so it never takes a result past the limit back below it.
            value = Value(kind, -NUMERIC_LIMIT, NUMERIC_LIMIT, None, nan=True, infinite=True)
    elif kind in FLOATS:
        limit = FLOATS[kind][0]
        value = Value(kind, -limit, limit, None, nan=True, infinite=True)
    elif kind in DATETIMES:
        if facts.earliest is not None and facts.latest is not None:
            return Value(kind, facts.earliest, facts.latest)  # declared: within them, never infinite
        if facts.whole_range:
            return Value(kind, tv.TS_MIN, (tv.DATE_END - tv.DAY) if kind == "date" else tv.TS_END - 1, infinite=True)
        return Value(kind, *tv.ASSUMED, infinite=True)
    else:
        return Value(kind)
    if declared:
        # Declared bounds are what the column holds: no NaN or Infinity, and nothing outside them.
        assert facts.lower is not None and facts.upper is not None
        value = replace(value, low=max(value.low, facts.lower), high=min(value.high, facts.upper), nan=False,
                        infinite=False)
    return value


# --- the interpreter ---------------------------------------------------------------------------------------------

_ARITHMETIC = (exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Mod)
_DERIVED = (*_ARITHMETIC, exp.Neg, exp.Abs, exp.Floor, exp.Ceil, exp.Round, exp.Trunc, exp.Length, exp.Cast)
_PREDICATES = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ, exp.NullSafeNEQ, exp.And,
               exp.Or, exp.Not, exp.Is, exp.In, exp.Between, exp.Like, exp.ILike, exp.Escape, exp.Boolean)
_AGGREGATES = (exp.Count, exp.Sum, exp.Avg, exp.Min, exp.Max, exp.Variance, exp.VariancePop, exp.Stddev,
               exp.StddevSamp, exp.StddevPop, exp.Median, exp.WithinGroup)


class _Interpreter:
    def __init__(self, facts: Facts, zones: frozenset[str] | None) -> None:
        self.facts = facts
        self.zones = zones
        self.reads = 0  # columns and parameters evaluated so far: a subtree that read one is not constant

    def value(self, node: exp.Expression) -> Value:
        if isinstance(node, (exp.Paren, exp.Alias)):
            return self.value(node.this)
        if isinstance(node, _AGGREGATES):
            return self._aggregate(node)
        method = getattr(self, f"_{type(node).__name__.lower()}", None)
        if method is not None:
            reads = self.reads
            result: Value = method(node)
            if result.constant and self.reads > reads:  # CASE WHEN id = 17 THEN 'x' END is not constant
                result = replace(result, constant=False, value=None)
            return result
        if isinstance(node, _PREDICATES):
            children = [self.value(child) for child in _children(node)]
            if not isinstance(node, (exp.And, exp.Or, exp.Not, exp.Escape)):  # (ESCAPE: a LIKE and its character)
                _common(children, node)  # a numeric compared with a float is converted to float: it may not fit
            return Value("bool", constant=all(child.constant for child in children))
        # Anything else the expression allowlist admitted (intervals, a bare type name ...): typed opaquely.
        reads = self.reads
        for child in _children(node):
            self.value(child)
        return Value("other", constant=self.reads == reads)

    # -- leaves ----------------------------------------------------------------

    def _column(self, node: exp.Column) -> Value:
        self.reads += 1
        return column_value(self.facts(node))

    def _literal(self, node: exp.Literal) -> Value:
        if node.is_string:
            return Value("literal", constant=True, value=node.this)
        number = Decimal(node.this)
        if node.this.lstrip("-").isdigit():
            for kind in ("int4", "int8"):
                if number <= INTEGERS[kind][1]:
                    return Value(kind, number, number, 0, constant=True, value=number)
        return Value("numeric", number, number, _scale_of(number), constant=True, value=number)

    def _null(self, node: exp.Null) -> Value:
        return Value("null", constant=True)

    def _parameter(self, node: exp.Parameter) -> Value:
        self.reads += 1
        return Value("param")

    # -- conditionals ----------------------------------------------------------

    def _case(self, node: exp.Case) -> Value:
        if node.this is not None:
            self.value(node.this)
        arms = []
        for branch in node.args.get("ifs") or []:
            self.value(branch.this)
            arms.append(self.value(branch.args["true"]))
        if node.args.get("default") is not None:
            arms.append(self.value(node.args["default"]))
        return _join(arms, node)

    def _coalesce(self, node: exp.Coalesce) -> Value:
        return _join([self.value(node.this), *(self.value(e) for e in node.expressions)], node)

    def _nullif(self, node: exp.Nullif) -> Value:
        first = self.value(node.this)
        _common([first, self.value(node.expression)], node)  # nullif compares its arguments
        return replace(first, value=None)

    # -- arithmetic ------------------------------------------------------------

    def _neg(self, node: exp.Neg) -> Value:
        operand = self._number(node.this, node)
        if operand.constant and isinstance(operand.value, Decimal) and isinstance(node.this, exp.Literal):
            # PostgreSQL reads -2147483648 as one integer constant (an int4), not as minus an int8.
            number = -operand.value
            kind = next((k for k in ("int4", "int8") if operand.type in INTEGERS and INTEGERS[k][0] <= number),
                        operand.type)
            return replace(operand, type=kind, low=number, high=number, value=number)
        return _fit(replace(operand, low=-operand.high, high=-operand.low,
                            value=-operand.value if isinstance(operand.value, Decimal) else None), node)

    def _add(self, node: exp.Add) -> Value:
        a, b, kind = self._operands(node)
        if kind in DATETIMES:
            return self._time_arithmetic(node, a, b)
        return _fit(_result(kind, a, b, a.low + b.low, a.high + b.high, _sum_scale(kind, a, b)), node)

    def _sub(self, node: exp.Sub) -> Value:
        a, b, kind = self._operands(node)
        if kind in DATETIMES:
            return self._time_arithmetic(node, a, b)
        return _fit(_result(kind, a, b, a.low - b.high, a.high - b.low, _sum_scale(kind, a, b)), node)

    def _mul(self, node: exp.Mul) -> Value:
        scaled = self._scaled_interval(node)
        if scaled is not None:
            return scaled
        a, b, kind = self._operands(node)
        products = [_times(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
        scale = None if a.scale is None or b.scale is None else a.scale + b.scale
        growing = False
        for x, c in ((a, b), (b, a)):
            if c.constant and isinstance(c.value, Decimal) and abs(c.value) >= 1:
                scale, growing = x.scale, True  # |x * c| >= |x|: a non-zero x never gives 0
        result = _result(kind, a, b, min(products), max(products), scale)
        if kind in FLOATS and not growing:
            _no_underflow(kind, result, node)
        return _fit(result, node)

    def _div(self, node: exp.Div) -> Value:
        self._constant_divisor(node, "division")
        a, b, kind = self._operands(node)
        divisor = self._divisor(b, node, "division")
        quotients = [x / divisor for x in (a.low, a.high)]
        low, high = min(quotients), max(quotients)
        if kind in INTEGERS:  # integer division truncates toward zero
            low, high = _truncate(low), _truncate(high)
            scale: int | None = 0
        elif kind == "numeric":
            scale = None  # PostgreSQL picks the quotient's scale (16 significant digits or more)
        elif abs(divisor) <= 1:
            scale = a.scale  # |x / c| >= |x|: a non-zero x never gives 0
        else:
            scale = None if a.scale is None else a.scale + _digits_above_one(divisor)
        result = _result(kind, a, b, low, high, scale)
        if kind in FLOATS and abs(divisor) > 1:
            _no_underflow(kind, result, node)
        return _fit(result, node)

    def _mod(self, node: exp.Mod) -> Value:
        self._constant_divisor(node, "modulo")
        a, b, kind = self._operands(node)
        divisor = abs(self._divisor(b, node, "modulo"))
        if kind in FLOATS:
            raise Unsafe("% and mod() take integers or numeric values, not floating point",
                         f"Cast to numeric first: ({_sql(node.this)})::numeric % {_sql(node.expression)}.")
        largest = divisor - 1 if kind in INTEGERS else divisor  # |x % c| < |c|
        low = max(-largest, min(a.low, Decimal(0))) if a.low < 0 else Decimal(0)
        high = min(largest, max(a.high, Decimal(0))) if a.high > 0 else Decimal(0)
        return _fit(_result(kind, a, b, low, high, _sum_scale(kind, a, b)), node)

    def _operands(self, node: exp.Expression) -> tuple[Value, Value, str]:
        """The operands of an arithmetic operator, and the type it computes in; a date or timestamp operand of + or
        - gives its type (the operands are then checked by _time_arithmetic)."""
        a, b = self.value(node.this), self.value(node.expression)
        if isinstance(node, (exp.Add, exp.Sub)):
            moved = next((v.type for v in (a, b) if v.type in DATETIMES), None)
            if moved is not None:
                return a, b, moved
        a, b = self._checked_number(a, node.this, node), self._checked_number(b, node.expression, node)
        if a.constant and b.constant:
            kind = _promote(a.type, b.type)
            return a, b, kind
        kind = _promote(a.type, b.type)
        for operand in (a, b):
            _convert(operand, kind, node)
        return a, b, kind

    def _number(self, child: exp.Expression, node: exp.Expression) -> Value:
        return self._checked_number(self.value(child), child, node)

    def _checked_number(self, value: Value, child: exp.Expression, node: exp.Expression) -> Value:
        if value.type == "param":
            raise Unsafe(f"{_operation(node)} with a $n parameter ({_sql(node)}): its value is not known when the "
                         "statement is checked",
                         "Write the number as a constant; parameters may stand in comparisons.")
        if value.type == "unknown":
            raise Unsafe(f"{_operation(node)} ({_sql(node)}) needs the type of {_sql(child)}, which the proxy does not "
                         "know",
                         "Reload the policy (anonproxy policy reload, or any policy change) so the proxy reads the "
                         "column types; use the column bare or cast to text meanwhile.")
        if value.type == "null":
            return Value("int2", Decimal(0), Decimal(0), constant=True)  # NULL in arithmetic gives NULL
        if value.type == "literal":
            # PostgreSQL gives a quoted constant its sibling's type: the proof would have to guess it.
            raise Unsafe(f"string {_sql(child)} in arithmetic", "Write numbers without quotes.")
        if value.type not in NUMBERS:
            raise Unsafe(f"{_sql(node)} computes with a value of type {value.type}; only numbers may be computed "
                         "with in a query over protected tables",
                         "Use date_trunc(), extract() or to_char() on dates and timestamps, and text functions "
                         "(lower, upper, substring, left, right, trim, length) on text.")
        return value

    def _constant_divisor(self, node: exp.Expression, what: str) -> None:
        if not _is_constant_tree(node.expression):
            self._divisor(Value("other"), node, what)

    def _divisor(self, b: Value, node: exp.Expression, what: str) -> Decimal:
        if not b.constant or not isinstance(b.value, Decimal) or b.value == 0:
            raise Unsafe(f"{what} by {_sql(node.expression)}: a {what} by zero fails for the rows where the divisor "
                         "is zero, and that error reveals them", "Divide by a non-zero constant (x / 10).")
        return b.value

    def _abs(self, node: exp.Abs) -> Value:
        a = self._number(node.this, node)
        low = Decimal(0) if a.low <= 0 <= a.high else min(abs(a.low), abs(a.high))
        return _fit(replace(a, low=low, high=a.magnitude, value=None), node)

    def _rounded(self, node: exp.Expression) -> Value:
        """floor, ceil, round and trunc."""
        a = self._number(node.this, node)
        if set(_set_args(node)) - {"this", "decimals"}:
            raise Unsafe(f"{_sql(node)} has arguments that are not allowed", "floor(x), round(x) or round(x, 2).")
        decimals = node.args.get("decimals")
        if decimals is None:
            # floor/ceil/round/trunc exist for numeric and double precision; integers become double precision.
            kind = "numeric" if a.type == "numeric" else "float8"
            digits = 0
        else:
            digits_value = self.value(decimals)
            if not (digits_value.constant and isinstance(digits_value.value, Decimal)
                    and digits_value.value == digits_value.value.to_integral_value()
                    and abs(digits_value.value) <= MAX_DIGITS):
                raise Unsafe(f"the digits of {_sql(node)} must be an integer constant of at most {MAX_DIGITS}",
                             "round(x, 2)")
            if a.type in FLOATS:
                raise Unsafe(f"{_sql(node)}: round and trunc with digits take numeric values",
                             f"Cast to numeric first: round(({_sql(node.this)})::numeric, {_sql(decimals)}).")
            kind, digits = "numeric", int(digits_value.value)
        step = Decimal(10) ** -digits
        # Whatever the rounding mode, the result lies between the bounds rounded outward.
        low, high = _round_to(a.low, step, ROUND_FLOOR), _round_to(a.high, step, ROUND_CEILING)
        return _fit(Value(kind, low, high, max(digits, 0), a.nan, a.infinite, a.constant), node)

    _floor = _ceil = _round = _trunc = _rounded

    def _widthbucket(self, node: exp.WidthBucket) -> Value:
        operand = self.value(node.this)
        bounds = [self.value(node.args[key]) for key in ("min_value", "max_value", "num_buckets")]
        if not all(b.constant and isinstance(b.value, Decimal) for b in bounds):
            raise Unsafe("width_bucket needs constant bounds and bucket count", "width_bucket(x, 0, 100, 10)")
        low, high, count = (b.value for b in bounds)
        assert isinstance(low, Decimal) and isinstance(high, Decimal) and isinstance(count, Decimal)
        if low == high or count != count.to_integral_value() or not 1 <= count <= MAX_WIDTH_BUCKETS:
            raise Unsafe(f"width_bucket needs constant bounds low <> high and an integer count between 1 and "
                         f"{MAX_WIDTH_BUCKETS}", "width_bucket(x, 0, 100, 10)")
        if operand.type not in ("unknown", *NUMBERS):
            raise Unsafe(f"width_bucket takes a number, not a value of type {operand.type}",
                         "width_bucket(x, 0, 100, 10) over a numeric column.")
        _common([operand, *bounds[:2]], node)  # the operand converts to the bounds' type
        if operand.nan:
            raise Unsafe(f"width_bucket fails on NaN, which {_sql(node.this)} may hold",
                         f"Declare bounds for the column (a bounded column holds no NaN), or {DECLARE_HINT}.")
        return Value("int4", Decimal(0), count + 1, 0)

    def _cast(self, node: exp.Cast) -> Value:
        target = node.args.get("to")
        if not isinstance(target, exp.DataType):
            raise Unsafe("a malformed cast", "Cast to text, or between number types.")
        kind = _cast_type(target)
        source = self.value(node.this)
        if kind == TEXT:
            # Every value has a text form; a time's or an interval's follows DateStyle, TimeZone or IntervalStyle,
            # so PostgreSQL writes it for the rows that reach it, not when it plans: (date '2025-01-01')::text::int
            # is proved, not folded.
            return Value(TEXT, constant=source.constant and source.type not in (*DATETIMES, "interval"))
        if source.constant and source.type != "param" and (kind not in DATETIMES or _read_when_parsed(node.this)):
            return _constant_cast(kind, source)
        if kind in DATETIMES:
            if source.constant and source.type not in DATETIMES:
                raise Unsafe(f"{_sql(node)} converts a typed constant when a row reaches it (the conversion depends "
                             "on the session's settings, so PostgreSQL does not fold it when it plans the statement): "
                             "a constant it cannot read fails only if some row reaches it, and that error reveals "
                             "whether any did",
                             "Write the constant as DATE '2025-01-31' or TIMESTAMP '2025-01-31 12:00:00'.")
            return self._time_cast(source, kind, node)
        if source.type == "unknown":
            raise Unsafe(f"cast to {_sql(target)} of {_sql(node.this)}, whose type the proxy does not know: it may fail",
                         "Cast to text, or reload the policy so the proxy reads the column types.")
        if source.type == "param":
            raise Unsafe(f"cast of a parameter to {_sql(target)}: the client chooses the parameter's type, and a "
                         "cast that fails on some rows reveals data",
                         "Write $n without a cast (the server infers its type from the comparison), or cast it to "
                         "text.")
        if kind in INTEGERS and source.infinite and isinstance(_unparen(node.this), exp.Extract):
            raise Unsafe(f"{_sql(node)} fails for 'infinity' dates and timestamps, which the column may hold: their "
                         "fields are Infinity, which no integer holds",
                         "Have the DBA declare the time column's bounds (earliest and latest): a bounded column "
                         "holds no infinity.")
        if kind == "int4" and source.type == "bool":
            return Value("int4", Decimal(0), Decimal(1), 0)
        if kind not in NUMBERS or source.type not in NUMBERS:
            what = "text" if source.type in (TEXT, "literal") else source.type
            raise Unsafe(f"cast to {_sql(target)} of {_sql(node.this)} ({what}): a cast that fails on some values "
                         "reveals which rows hold them",
                         "Cast columns to text, or between number types; compare text with text "
                         f"({_sql(node.this)} = '42').")
        return _fit(_convert(source, kind, node, target), node)

    # -- dates and text --------------------------------------------------------

    def _timestamptrunc(self, node: exp.Expression) -> Value:
        source = self.value(node.this)
        unit_node = node.args.get("unit")
        name = unit_node.name if isinstance(unit_node, (exp.Var, exp.Literal)) else ""
        unit = tv.truncation_unit(name)
        if unit is None:
            raise Unsafe(f"date_trunc unit {name or (_sql(unit_node) if unit_node else '')} is not one PostgreSQL "
                         "accepts",
                         f"Use one of: {', '.join(tv.TRUNCATION)}.")
        zone = node.args.get("zone")
        if zone is not None:
            self._zone(zone, node)
        if source.type in ("interval", "unknown"):
            if unit == "week":
                raise Unsafe(f"date_trunc('week', ...) fails on an interval, and the proxy does not know the type of "
                             f"{_sql(node.this)}" if source.type == "unknown" else
                             "date_trunc('week', ...) fails on an interval (months have fractional weeks)",
                             "Truncate dates or timestamps to weeks; reload the policy if the column is one.")
            return Value(source.type, constant=source.constant)
        if source.type not in DATETIMES and not source.constant:
            raise Unsafe(f"date_trunc of a value of type {source.type}", "date_trunc('month', column) over a date or "
                         "timestamp column.")
        zoned = source.type in ("date", "timestamptz") or zone is not None  # truncated in a time zone's local time
        shift = (tv.SESSION_ZONE_SHIFT if zoned else Decimal(0)) + (tv.ZONE_SHIFT if zone is not None else 0)
        kind = "timestamp" if source.type == "timestamp" and zone is None else "timestamptz"
        moved = replace(source, type=kind, low=source.low - tv.TRUNCATION[unit], value=None)
        return self._in_range(moved, shift, node)

    _datetrunc = _timestamptrunc

    def _extract(self, node: exp.Extract) -> Value:
        source = self.value(node.expression)
        name = node.this.name if isinstance(node.this, (exp.Var, exp.Literal)) else ""
        field = tv.extract_field(name)
        if source.type == "interval" and field == "epoch":
            return _interval_epoch(source)
        if source.type in DATETIMES:
            fields = tv.extract_fields(source.type)
        elif source.constant or source.type == "unknown":
            fields = tv.extract_fields("date")  # valid on every date and timestamp
        else:
            raise Unsafe(f"extract/date_part of a value of type {source.type}",
                         "Extract fields of date and timestamp columns.")
        if field not in fields:
            raise Unsafe(f"extract/date_part field {name or _sql(node.this)} fails on a value of type "
                         f"{source.type} ({_sql(node.expression)})", f"Use one of: {', '.join(fields)}.")
        if source.type == "date" and source.high >= tv.TS_END:  # date_part(f, date) casts the date to a timestamp
            raise Unsafe(f"date_part of {_sql(node.expression)}, a date that may lie past 294276 AD, fails: its "
                         "cast to a timestamp overflows", f"Declare the column's bounds: {DECLARE_HINT}.")
        low, high, infinite = fields[field]
        # extract() gives numeric, date_part() double precision: checked as the stricter of the two.
        scale = 6 if field in ("epoch", "second", "milliseconds") else 0
        # Of a date or timestamp, evaluated for the rows that reach it (stable for a timestamptz): not folded, so
        # extract(year FROM timestamptz 'infinity')::int is proved, and refused.
        return Value("float8", low, high, scale, infinite=infinite and source.infinite,
                     constant=source.constant and source.type not in DATETIMES)

    def _scaled_interval(self, node: exp.Mul) -> Value | None:
        """A constant interval times a bounded number (Cube's INTERVAL '14 day' * floor(...)); None when neither
        side is an interval. PostgreSQL fails when a field of the product (months, days: 32 bits) overflows."""
        a, b = self.value(node.this), self.value(node.expression)
        if b.type == "interval":
            a, b = b, a
        if a.type != "interval":
            return None
        interval = tv.parse_interval(str(a.value)) if a.constant else None
        factor = self._checked_number(b, node.expression if a is not b else node.this, node)
        if interval is None or factor.nan or factor.infinite or not factor.magnitude.is_finite():
            raise Unsafe(f"{_sql(node)}: an interval may be multiplied only when it is a constant and the number is "
                         "bounded", f"INTERVAL '1 day' * n with n bounded: {DECLARE_HINT}.")
        most = factor.magnitude
        if max(abs(interval.months), abs(interval.days)) * most >= 2**31 or abs(interval.micros) * most >= 2**63:
            raise Unsafe(f"{_sql(node)} can overflow an interval for values the columns may hold",
                         f"Declare bounds: {DECLARE_HINT}.")
        reach = interval.reach * most
        return Value("interval", -reach, reach, constant=a.constant and b.constant)

    def _interval(self, node: exp.Interval) -> Value:
        """INTERVAL '1 day' (sqlglot may split it into '1' and the unit DAY)."""
        unit = node.args.get("unit")
        text = node.this.name if isinstance(node.this, exp.Literal) else ""
        return Value("interval", constant=True, value=f"{text} {unit.name}" if isinstance(unit, exp.Var) else text)

    # -- the clock and time constants --------------------------------------------------------------------------

    def _clock(self, node: exp.Expression) -> Value:
        """now(), current_timestamp, current_date, localtimestamp: the same value for every row of the statement,
        no one's data; within tv.CLOCK (evaluated when the statement runs, so not a folded constant)."""
        if _set_args(node):
            raise Unsafe(f"{_sql(node)} with a precision", "Write current_timestamp without a precision.")
        kind = "date" if isinstance(node, exp.CurrentDate) else (
            "timestamp" if isinstance(node, exp.Localtimestamp) else "timestamptz")
        return Value(kind, *tv.CLOCK)

    _currenttimestamp = _currentdate = _localtimestamp = _clock

    def _anonymous(self, node: exp.Anonymous) -> Value:
        name = node.name.lower()
        arguments = node.expressions
        if name in STABLE_CLOCK and not arguments:
            return Value("timestamptz", *tv.CLOCK)
        if name == "timezone" and len(arguments) == 2:
            return self._shifted_zone(arguments[1], arguments[0], node)
        if name == "make_date" and len(arguments) == 3:
            return self._make_date(node)
        raise Unsafe(f"function {node.name}() is not allowed", "Only a few built-in functions are allowed.")

    def _make_date(self, node: exp.Anonymous) -> Value:
        values = [self.value(argument) for argument in node.expressions]
        numbers = [v.value for v in values if v.constant and isinstance(v.value, Decimal) and v.type in INTEGERS]
        if len(numbers) != 3:
            raise Unsafe("make_date takes three integer constants", "make_date(2025, 1, 31)")
        year, month, day = (int(n) for n in numbers)
        # Immutable over constants: PostgreSQL folds it when it plans the statement, so even an invalid date fails
        # for every database alike; typed here (with its value, when valid: arithmetic over it is proved).
        if not _valid_date(year, month, day):
            return Value("date", constant=True)
        moment = tv.civil(year, month, day)
        return Value("date", moment, moment, constant=True)

    def _strtotime(self, node: exp.StrToTime) -> Value:
        """to_timestamp(text, format) of constants: evaluated when the statement runs (it is stable, not folded), so
        it must not fail: the text is read here with the format, strictly."""
        text, fmt = node.this, node.args.get("format")
        if set(_set_args(node)) - {"this", "format"} or not (
                isinstance(text, exp.Literal) and text.is_string and isinstance(fmt, exp.Literal) and fmt.is_string):
            raise Unsafe("to_timestamp takes a constant string and a constant format",
                         "to_timestamp('2025-01-01 00:00:00', 'YYYY-MM-DD HH24:MI:SS'), or TIMESTAMP '2025-01-01'.")
        moment = tv.strptime(text.this, fmt.this)
        if moment is None:
            raise Unsafe(f"{_sql(node)}: the proxy cannot read {text.sql(dialect='postgres')} with that format, and "
                         "PostgreSQL would raise its error only if some row reached the call",
                         "Write the constant as TIMESTAMP 'YYYY-MM-DD HH:MM:SS'.")
        return Value("timestamptz", moment - tv.SESSION_ZONE_SHIFT, moment + tv.SESSION_ZONE_SHIFT)

    # -- time zones, casts and arithmetic on dates and timestamps ---------------------------------------------

    def _zone(self, zone: exp.Expression, node: exp.Expression) -> None:
        if not (isinstance(zone, exp.Literal) and zone.is_string and tv.known_zone(zone.this, self.zones)):
            raise Unsafe(f"the time zone of {_sql(node)} must be a constant name of the server's tz database "
                         "(pg_timezone_names) or UTC: an unknown zone fails only when a row reaches it, and that error "
                         "reveals whether any did",
                         "AT TIME ZONE 'UTC', AT TIME ZONE 'Europe/Paris'.")

    def _attimezone(self, node: exp.AtTimeZone) -> Value:
        return self._shifted_zone(node.this, node.args["zone"], node)

    def _shifted_zone(self, operand: exp.Expression, zone: exp.Expression, node: exp.Expression) -> Value:
        """x AT TIME ZONE zone: a timestamptz to the zone's local timestamp, a timestamp (taken as the zone's local
        time) to a timestamptz; a date is first a timestamptz in the session's time zone."""
        self._zone(zone, node)
        source = self.value(operand)
        if source.type not in DATETIMES:
            raise Unsafe(f"AT TIME ZONE of a value of type {source.type} ({_sql(operand)})",
                         "Convert timestamp or timestamptz columns.")
        kind = "timestamptz" if source.type == "timestamp" else "timestamp"
        shift = tv.ZONE_SHIFT + (tv.SESSION_ZONE_SHIFT if source.type == "date" else 0)
        moved = replace(source, type=kind, low=source.low - shift, high=source.high + shift, value=None)
        return self._in_range(moved, Decimal(0), node)

    def _datebin(self, node: exp.DateBin) -> Value:
        """date_bin(stride, x, origin): fails for a stride of months, zero or negative, and out of range; both
        constants here, the stride as number-unit pairs."""
        stride_value = self.value(node.this)
        stride = tv.parse_interval(str(stride_value.value)) if stride_value.constant else None
        if stride is None or stride.months or stride.days * tv.DAY + stride.micros <= 0:
            raise Unsafe(f"the stride of {_sql(node)} must be a constant positive interval of days, hours, minutes or "
                         "seconds: PostgreSQL refuses months, zero and negative strides",
                         "date_bin('15 minutes', column, TIMESTAMP '2000-01-01').")
        source = self.value(node.expression)
        origin = self.value(node.args["origin"]) if node.args.get("origin") else None
        if origin is not None and origin.type == "literal" and source.type in DATETIMES:
            # A quoted origin takes the type of the overload the source picks when PostgreSQL plans the statement:
            # a date's is timestamptz (the preferred type of the implicit casts from date).
            kind = "timestamptz" if source.type == "date" else source.type
            origin = _constant_cast(kind, origin)
        # A finite origin: an infinite one fails for every finite row ("origin out of range").
        if origin is None or not origin.constant or origin.type not in ("timestamp", "timestamptz") \
                or not origin.low.is_finite():
            raise Unsafe(f"the origin of {_sql(node)} must be a finite timestamp constant",
                         "date_bin('15 minutes', column, TIMESTAMP '2000-01-01').")
        if source.type == "date":  # PostgreSQL casts a date to the origin's type (implicit cast, same bounds check)
            source = self._time_cast(source, origin.type, node)
        if source.type != origin.type:
            raise Unsafe(f"date_bin of {_sql(node.expression)} ({source.type}) from an origin of type {origin.type}",
                         "Give the origin the column's type: TIMESTAMP '...' or TIMESTAMPTZ '...'.")
        reach = stride.days * tv.DAY + stride.micros
        # PostgreSQL subtracts the origin in 64 bits of microseconds ("interval out of range" past them), then steps
        # back a stride below an origin: the timestamp range spans more than that, so being in it is not enough.
        if max(source.high - origin.low, origin.high - source.low + reach) >= 2**63:
            raise Unsafe(f"{_sql(node)}: values the column may hold are too far from the origin (over 292,000 years), "
                         "and PostgreSQL's error would reveal which rows hold them",
                         "Take an origin near the data (TIMESTAMP '2000-01-01'), or have the DBA declare the time "
                         "column's bounds.")
        moved = replace(source, low=min(source.low, origin.low) - reach, high=max(source.high, origin.high), value=None)
        return self._in_range(moved, Decimal(0), node)

    def _date(self, node: exp.Date) -> Value:
        """date(x), as Looker writes the cast to date."""
        if set(_set_args(node)) != {"this"}:
            raise Unsafe(f"{_sql(node)} takes one argument", "date(column)")
        return self._time_cast(self.value(node.this), "date", node)

    def _time_cast(self, source: Value, kind: str, node: exp.Expression) -> Value:
        """A cast between date, timestamp and timestamptz: a conversion through the session's time zone when one
        side has one; the value must stay within the timestamp range (a date past 294276 AD has no timestamp)."""
        if source.type == kind:
            return source
        if source.type not in DATETIMES:
            what = "text" if source.type in (TEXT, "literal") else source.type
            raise Unsafe(f"cast to {kind} of {_sql(node.this)} ({what}): a cast that fails on some values reveals "
                         "which rows hold them", "Cast date and timestamp columns; compare text with text.")
        zoned = "timestamptz" in (source.type, kind)
        shift = tv.SESSION_ZONE_SHIFT if zoned else Decimal(0)
        low, high = source.low - shift, source.high + shift
        if kind == "date":
            low, high = source.low - shift - tv.DAY, source.high + shift  # the day's midnight
        return self._in_range(replace(source, type=kind, low=low, high=high, value=None), Decimal(0), node)

    def _in_range(self, value: Value, shift: Decimal, node: exp.Expression) -> Value:
        """``value``, after checking its finite values (give or take ``shift``) are timestamps PostgreSQL holds; no
        folded constant, even over constants: the time functions that follow the session's time zone are stable,
        which PostgreSQL runs for the rows that reach them (date_trunc('day', timestamptz 'infinity') - ... fails
        only there), so what is computed from it is proved."""
        end = tv.DATE_END if value.type == "date" else tv.TS_END
        if value.low - shift < tv.TS_MIN or value.high + shift >= end:
            raise Unsafe(f"{_sql(node)} can leave PostgreSQL's range of dates and timestamps for values the column "
                         "may hold, and the error reveals which rows hold them",
                         "Have the DBA declare the time column's bounds (earliest and latest), or use a smaller "
                         "interval.")
        return replace(value, constant=False, value=None)

    def _time_arithmetic(self, node: exp.Expression, a: Value, b: Value) -> Value:
        """date/timestamp ± a constant or bounded interval, date ± an integer constant, the difference of two."""
        if b.type in DATETIMES and isinstance(node, exp.Add):
            a, b = b, a  # interval + timestamp
        if a.type in DATETIMES and b.type == a.type and isinstance(node, exp.Sub):
            return _difference(a, b, node)
        if a.type not in DATETIMES or b.type in DATETIMES:
            raise Unsafe(f"{_sql(node)} adds or subtracts dates or timestamps of different types",
                         "Add or subtract a constant interval: column + INTERVAL '1 day'.")
        direction = -1 if isinstance(node, exp.Sub) else 1
        if a.type == "date" and b.type in INTEGERS and b.constant and isinstance(b.value, Decimal):
            reach = abs(b.value) * tv.DAY
            return self._in_range(_moved(a, reach, direction * int(b.value.compare(0))), Decimal(0), node)
        interval = tv.parse_interval(str(b.value)) if b.type == "interval" and b.constant else None
        sign = interval.sign if interval is not None else 0
        if interval is None and b.type == "interval" and b.low.is_finite() and b.high.is_finite():
            interval = tv.Interval(micros=b.magnitude + tv.DAY)  # computed (days counted in 25 hours: the margin)
        if interval is None and b.constant and tv.read_by_interval_style(str(b.value)):
            raise Unsafe(f"{_sql(node)}: the interval's leading minus applies to its first field or to all of them "
                         "as the session's IntervalStyle says (sql_standard: all), so where it moves the values, and "
                         "whether they leave PostgreSQL's range, depends on the session",
                         "Give every field its own sign: INTERVAL '-1 day -2 hours'.")
        if interval is None:
            raise Unsafe(f"{_sql(node)}: dates and timestamps may be moved only by a constant interval written as "
                         "number-unit pairs", "column + INTERVAL '1 day', column - INTERVAL '30 days', date - 7.")
        kind = "timestamp" if a.type == "date" else a.type
        shift = tv.SESSION_ZONE_SHIFT if a.type == "timestamptz" else Decimal(0)  # months and days: in local time
        return self._in_range(replace(_moved(a, interval.reach, direction * sign), type=kind), shift, node)

    def _timetostr(self, node: exp.TimeToStr) -> Value:
        source = self.value(node.this)
        fmt = node.args.get("format")
        if not (isinstance(fmt, exp.Literal) and fmt.is_string):
            raise Unsafe("to_char needs a constant format string", "to_char(column, 'YYYY-MM')")
        if set(_set_args(node)) - {"this", "format"}:
            raise Unsafe("to_char takes a value and a format", "to_char(column, 'YYYY-MM')")
        if source.type not in (*DATETIMES, "literal"):
            raise Unsafe(f"to_char of a value of type {source.type} is not allowed (only dates and timestamps)",
                         f"Cast it to text: ({_sql(node.this)})::text.")
        # Stable: evaluated for the rows that reach it, so to_char(timestamptz '2025-01-01', 'Mon')::int is proved.
        return Value(TEXT, constant=source.constant and source.type not in DATETIMES)

    def _text(self, node: exp.Expression) -> Value:
        source = self.value(node.this)  # any text (a parameter's wrong type fails when the statement is planned)
        return Value(TEXT, constant=source.constant)

    _lower = _upper = _text

    def _trim(self, node: exp.Trim) -> Value:
        characters = node.args.get("expression")
        if characters is not None and not (isinstance(characters, exp.Literal) and characters.is_string):
            raise Unsafe("the characters trim removes must be a constant string", "trim(both 'x' from column)")
        return self._text(node)

    def _length(self, node: exp.Length) -> Value:
        self._text(node)
        return Value("int4", Decimal(0), Decimal(2**30), 0)

    def _substring(self, node: exp.Substring) -> Value:
        start = self._position(node, node.args.get("start"), allow_negative=True)
        length = node.args.get("length")
        if length is not None:
            self._position(node, length, allow_negative=False)
        if start is None:
            raise Unsafe("substring needs a start position", "substring(column from 1 for 3)")
        return self._text(node)

    def _left(self, node: exp.Expression) -> Value:
        self._position(node, node.expression, allow_negative=True)
        return self._text(node)

    _right = _left

    def _position(self, node: exp.Expression, argument: exp.Expression | None,
                  allow_negative: bool) -> Decimal | None:
        if argument is None:
            return None
        value = self.value(argument)
        number = value.value
        if not (value.constant and isinstance(number, Decimal) and value.type in INTEGERS):
            raise Unsafe(f"the positions and lengths of {_sql(node)} must be integer constants: a length that is "
                         "negative for some rows fails for them",
                         "substring(column from 1 for 3), left(column, 3)")
        if abs(number) > MAX_POSITION or (number < 0 and not allow_negative):
            raise Unsafe(f"{_sql(argument)} in {_sql(node)} must be between {0 if not allow_negative else -MAX_POSITION}"
                         f" and {MAX_POSITION}", "substring(column from 1 for 3)")
        return number

    # -- aggregates ------------------------------------------------------------

    def _aggregate(self, node: exp.Expression) -> Value:
        argument = node.this
        if isinstance(argument, exp.Distinct):
            argument = argument.expressions[0] if argument.expressions else None
        count = Value("int8", Decimal(0), INF, 0)
        if isinstance(node, exp.WithinGroup) or argument is None or isinstance(argument, exp.Star):
            return count if isinstance(node, exp.Count) else Value("other")
        value = self.value(argument)
        if isinstance(node, (exp.Sum, exp.Avg)) and derived(argument) and (
                value.magnitude > MAX_SUMMED or value.nan or value.infinite):
            raise Unsafe(f"{_sql(argument)} may exceed {MAX_SUMMED:.0e} in magnitude, and a sum of such values "
                         "can overflow for some groups and not others",
                         f"Add up values bounded by {MAX_SUMMED:.0e}: {DECLARE_HINT}.")
        return count if isinstance(node, exp.Count) else Value("other")


# --- helpers -----------------------------------------------------------------------------------------------------


def _children(node: exp.Expression) -> list[exp.Expression]:
    children: list[exp.Expression] = []
    for value in node.args.values():
        if isinstance(value, exp.Expression):
            children.append(value)
        elif isinstance(value, list):
            children.extend(item for item in value if isinstance(item, exp.Expression))
    return children


def _set_args(node: exp.Expression) -> list[str]:
    return [key for key, value in node.args.items() if value not in (None, False, [], "")]


def _unparen(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def _read_when_parsed(operand: exp.Expression) -> bool:
    """Whether PostgreSQL reads ``operand``, cast to a date or timestamp, when it parses the statement: a quoted
    constant of no type yet (or NULL) is read by the type's input function then, for every database alike. A typed
    constant ('x'::text, coalesce of strings, a timestamptz) is converted by a stable function, which the planner
    does not fold: it runs for the rows that reach it (CASE WHEN age = 37 THEN 'x'::text::date END), so it is proved
    like a column's cast."""
    return isinstance(_unparen(operand), (exp.Literal, exp.Null))


def _is_constant_tree(node: exp.Expression) -> bool:
    return not any(isinstance(n, (exp.Column, exp.Parameter)) for n in node.walk())


def _operation(node: exp.Expression) -> str:
    if isinstance(node, exp.Neg):
        return "unary minus"
    if isinstance(node, _ARITHMETIC):
        return "arithmetic"
    return f"{node.sql_name().lower()}()" if isinstance(node, exp.Func) else type(node).__name__.lower()


def _sql(node: exp.Expression) -> str:
    return node.sql(dialect="postgres")


@functools.lru_cache(maxsize=512)
def _datatype(name: str) -> exp.DataType | None:
    """A type as PostgreSQL's format_type() writes it ("integer", "numeric(10,2)"), parsed; None if unknown here."""
    try:
        return exp.DataType.build(name, dialect="postgres")
    except (SqlglotError, ValueError):
        return None


def _cast_type(datatype: exp.DataType) -> str:
    if datatype.this in (exp.DataType.Type.FLOAT, exp.DataType.Type.DOUBLE) and datatype.expressions:
        return "other"  # a float(p) PostgreSQL refuses (the parser reads the others as real or double precision)
    return _CAST_TYPES.get(datatype.this, "other")


def _typmod(datatype: exp.DataType) -> tuple[int | None, int]:
    params = [p.this if isinstance(p, exp.DataTypeParam) else p for p in datatype.expressions]
    numbers = [int(p.this) for p in params if isinstance(p, exp.Literal) and not p.is_string]
    if not numbers or len(numbers) != len(params):
        return None, 0
    return numbers[0], numbers[1] if len(numbers) > 1 else 0


def _scale_of(number: Decimal) -> int:
    exponent = number.as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _sum_scale(kind: str, a: Value, b: Value) -> int | None:
    """A sum's scale: exact types keep the larger; a float sum of a value and a constant c is 0 or at least about
    |c|·2^-53 (the constant's spacing), so it is as far from zero as the constant allows."""
    if a.scale is not None and b.scale is not None:
        return max(a.scale, b.scale)
    constant = b if b.constant else a if a.constant else None
    if kind in FLOATS and constant is not None and isinstance(constant.value, Decimal) and constant.value != 0:
        return _digits_above_one(1 / abs(constant.value)) + 17
    return None


def _digits_above_one(number: Decimal) -> int:
    """How many decimal digits dividing by ``number`` can take a value below 1 (0 for |number| <= 1)."""
    magnitude = abs(number)
    return 0 if magnitude <= 1 else int(magnitude.log10().to_integral_value(ROUND_CEILING))


def _times(x: Decimal, y: Decimal) -> Decimal:
    return Decimal(0) if x == 0 or y == 0 else x * y


def _truncate(x: Decimal) -> Decimal:
    return x if not x.is_finite() else x.to_integral_value(rounding="ROUND_DOWN")


def _round_to(x: Decimal, step: Decimal, rounding: str) -> Decimal:
    """``x`` rounded to a multiple of ``step`` in direction ``rounding`` (or moved one step that way when it is
    too large to round exactly)."""
    if not x.is_finite() or (step <= 1 and x == x.to_integral_value()):
        return x
    if abs(x) >= Decimal("1e300") or step < Decimal("1e-300"):
        return x - step if rounding == ROUND_FLOOR else x + step
    return x.quantize(step, rounding=rounding)


def _promote(a: str, b: str) -> str:
    """The type PostgreSQL computes ``a op b`` in."""
    if a in INTEGERS and b in INTEGERS:
        return max(a, b, key=NUMBERS.index)
    if a in FLOATS or b in FLOATS:
        return "float4" if a == b == "float4" else "float8"
    return "numeric"


def _result(kind: str, a: Value, b: Value, low: Decimal, high: Decimal, scale: int | None) -> Value:
    value = None
    if a.constant and b.constant and low == high:
        value = low
    return Value(kind, low, high, scale, nan=a.nan or b.nan, infinite=a.infinite or b.infinite,
                 constant=a.constant and b.constant, value=value)


def _common(values: list[Value], node: exp.Expression) -> str | None:
    """The number type ``values`` are compared or merged in, after checking each converts to it."""
    numbers = [v for v in values if v.type in NUMBERS and not v.constant]
    constants = [v for v in values if v.type in NUMBERS and v.constant]
    if not numbers:
        return None
    kind = numbers[0].type
    for other in [*numbers[1:], *constants]:
        kind = _promote(kind, other.type)
    for value in numbers:
        _convert(value, kind, node)
    return kind


def _join(values: list[Value], node: exp.Expression) -> Value:
    """The value of CASE or COALESCE: any of ``values`` (their common type, by PostgreSQL's rules)."""
    _common(values, node)
    typed = [v for v in values if v.type not in ("null", "literal")]
    if not typed:
        return Value("literal" if any(v.type == "literal" for v in values) else "null",
                     constant=all(v.constant for v in values))
    numbers = [v for v in typed if v.type in NUMBERS]
    if len(numbers) == len(typed):
        # A quoted constant takes the common type when the statement is planned: 'NaN' and 'Infinity' are numbers.
        numbers += [_quoted_number(v) for v in values if v.type == "literal"]
        kind = numbers[0].type
        for other in numbers[1:]:
            kind = _promote(kind, other.type)
        scales = [v.scale for v in numbers]
        return Value(kind, min(v.low for v in numbers), max(v.high for v in numbers),
                     None if None in scales else max(s for s in scales if s is not None),
                     any(v.nan for v in numbers), any(v.infinite for v in numbers),
                     all(v.constant for v in values))
    kinds = {v.type for v in typed}
    if "date" in kinds and kinds & {"timestamp", "timestamptz"}:
        raise Unsafe(f"{_sql(node)} mixes dates and timestamps: a date after 294276 AD does not convert to a timestamp",
                     "Give every branch the same type.")
    if kinds == {"timestamp", "timestamptz"}:
        typed = [_zoned(v, node) if v.type == "timestamp" else v for v in typed]
        kinds = {"timestamptz"}
    kind = kinds.pop() if len(kinds) == 1 else "other"
    low, high = (min(v.low for v in typed), max(v.high for v in typed)) if kind in DATETIMES else (-INF, INF)
    return Value(kind, low, high, infinite=any(v.infinite for v in typed), constant=all(v.constant for v in values))


def _zoned(value: Value, node: exp.Expression) -> Value:
    """A timestamp that CASE or coalesce merges with a timestamptz: PostgreSQL converts it to timestamptz, reading it
    in the session's time zone, and fails where that leaves its range (a row at 23:00 on its last day, 12 hours
    west of UTC): only for the rows that reach the conversion."""
    low, high = value.low - tv.SESSION_ZONE_SHIFT, value.high + tv.SESSION_ZONE_SHIFT
    if low < tv.TS_MIN or high >= tv.TS_END:
        raise Unsafe(f"{_sql(node)} merges a timestamp with a timestamptz: the timestamp is converted in the session's "
                     "time zone, which fails for values near the ends of PostgreSQL's range, and that error reveals "
                     "which rows hold them",
                     "Give every branch the same type, or have the DBA declare the timestamp column's bounds "
                     "(earliest and latest).")
    return replace(value, type="timestamptz", low=low, high=high)


def _quoted_number(value: Value) -> Value:
    try:
        number = Decimal(str(value.value).strip())
    except InvalidOperation:
        return Value("int2", Decimal(0), Decimal(0), constant=True)  # not a number: PostgreSQL refuses the statement
    if number.is_nan():
        return Value("int2", Decimal(0), Decimal(0), nan=True, constant=True)
    if number.is_infinite():
        return Value("int2", Decimal(0), Decimal(0), infinite=True, constant=True)
    return Value("int2", number, number, _scale_of(number), constant=True, value=number)


def _convert(value: Value, kind: str, node: exp.Expression, target: exp.DataType | None = None) -> Value:
    """``value`` converted to number type ``kind`` (implicitly in an operator, or by a cast to ``target``)."""
    if value.type == kind and (target is None or kind != "numeric"):
        return value
    if kind in INTEGERS:
        if value.nan or value.infinite:
            raise Unsafe(f"{_sql(node)} converts NaN or Infinity, which {value.type} values may be, to an integer: "
                         "that fails for the rows holding them",
                         f"Declare bounds for the column (a bounded column holds neither), or {DECLARE_HINT}.")
        low = _round_to(value.low, Decimal(1), ROUND_FLOOR)  # whichever way numeric and floats round halves
        high = _round_to(value.high, Decimal(1), ROUND_CEILING)
        return Value(kind, low, high, 0)
    if kind == "numeric":
        precision, scale = _typmod(target) if target is not None else (None, 0)
        if precision is None:
            return Value(kind, value.low, value.high, value.scale, value.nan, value.infinite)
        limit = Decimal(10) ** (precision - scale)
        if value.infinite or value.magnitude + Decimal(10) ** -scale / 2 >= limit:
            raise Unsafe(f"{_sql(node)} does not fit numeric({precision},{scale}) for every value the column may hold",
                         f"Cast to plain numeric, or {DECLARE_HINT}.")
        return Value(kind, value.low, value.high, scale, value.nan)
    # to float4 or float8
    limit, smallest = FLOATS[kind]
    if value.type in FLOATS and FLOATS[value.type][0] <= limit:
        return replace(value, type=kind)
    if value.type in INTEGERS:
        return replace(value, type=kind)
    if value.magnitude > limit:
        raise Unsafe(f"{_sql(node)} converts a value to {kind} that may exceed its range of ±{limit:.1e}",
                     f"Compute in numeric, or {DECLARE_HINT}.")
    if value.scale is None or value.scale > smallest:
        raise Unsafe(f"{_sql(node)} converts a value to {kind} that may be too close to zero for it (underflow)",
                     "Round it first: round(x, 6).")
    return replace(value, type=kind)


def _constant_cast(kind: str, source: Value) -> Value:
    """A cast PostgreSQL folds when it plans the statement: typed, not proved."""
    if kind == "interval" and isinstance(source.value, str):
        return Value(kind, constant=True, value=source.value)
    if kind in DATETIMES and isinstance(source.value, str):
        if tv.infinity(source.value):
            # ±infinity only: no finite value (an empty interval), so arithmetic keeps it infinite, as PostgreSQL does.
            return Value(kind, INF, -INF, infinite=True, constant=True)
        moment = tv.literal_instant(source.value)
        if moment is not None:  # within a day or so, whatever the zone: bounds for arithmetic over it
            return Value(kind, moment - tv.SESSION_ZONE_SHIFT, moment + tv.SESSION_ZONE_SHIFT, constant=True)
    if kind in NUMBERS and isinstance(source.value, (Decimal, str)):
        try:
            number = Decimal(str(source.value).strip())
        except InvalidOperation:
            return Value(kind, constant=True)
        if number.is_finite():
            if kind in INTEGERS:
                number = number.to_integral_value(rounding=ROUND_HALF_UP)
            return Value(kind, number, number, _scale_of(number), constant=True, value=number)
    return Value(kind, constant=True)


def _moved(value: Value, reach: Decimal, way: int) -> Value:
    """``value`` moved by at most ``reach``: later only (``way`` 1), earlier only (-1), or either way (0)."""
    return replace(value, low=value.low - (reach if way <= 0 else 0), high=value.high + (reach if way >= 0 else 0),
                   value=None)


def _difference(a: Value, b: Value, node: exp.Expression) -> Value:
    """date - date (days, an integer) or timestamp - timestamp (an interval): PostgreSQL refuses infinite operands,
    and the difference must fit 64 bits of microseconds."""
    if (a.infinite or b.infinite) and not (a.constant and b.constant):
        raise Unsafe(f"{_sql(node)} subtracts dates or timestamps that may be infinite, which fails for the rows "
                     "holding one", "Have the DBA declare the time column's bounds (earliest and latest): a bounded "
                     "column holds no infinity.")
    low, high = a.low - b.high, a.high - b.low
    if a.type == "date":
        return Value("int4", _round_to(low / tv.DAY, Decimal(1), ROUND_FLOOR),
                     _round_to(high / tv.DAY, Decimal(1), ROUND_CEILING), 0, constant=a.constant and b.constant)
    if max(abs(low), abs(high)) >= 2**63:
        raise Unsafe(f"{_sql(node)} can overflow an interval", f"Declare the time column's bounds: {DECLARE_HINT}.")
    return Value("interval", low, high, constant=a.constant and b.constant)


def _interval_epoch(source: Value) -> Value:
    """extract(epoch from an interval), in seconds (as PostgreSQL counts: the whole years of its months, truncated
    toward zero, as 365.25 days each, the months left as 30 days)."""
    if source.constant:
        interval = tv.parse_interval(str(source.value))
        if interval is not None:
            seconds = interval.epoch_seconds
            return Value("float8", seconds, seconds, 6, constant=True, value=seconds)
        return Value("float8", constant=True)
    if not (source.low.is_finite() and source.high.is_finite()):
        raise Unsafe("extract(epoch) of an interval the proxy cannot bound", f"Declare bounds: {DECLARE_HINT}.")
    return Value("float8", source.low / 1_000_000 - 1, source.high / 1_000_000 + 1, 6)


def _valid_date(year: int, month: int, day: int) -> bool:
    """Whether make_date(year, month, day) is a date (AD years here; PostgreSQL also reads negative ones as BC)."""
    try:
        date(year, month, day)
    except ValueError:
        return False
    return True


def _no_underflow(kind: str, result: Value, node: exp.Expression) -> None:
    if result.constant:
        return
    if result.scale is None or result.scale > FLOATS[kind][1]:
        raise Unsafe(f"{_sql(node)} may underflow: a {kind} product or quotient of a value too close to zero fails "
                     "for the rows holding one", "Compute in numeric (x::numeric / 10), or round first.")


def _fit(value: Value, node: exp.Expression) -> Value:
    """Raise unless every finite value of ``value`` fits its type."""
    if value.constant:
        return value
    kind = value.type
    if kind in INTEGERS:
        low, high = INTEGERS[kind]
        if value.low < low or value.high > high:
            name = {"int2": "smallint", "int4": "integer", "int8": "bigint"}[kind]
            cast = isinstance(node, exp.Cast)
            raise Unsafe(f"{_sql(node)} can overflow {name} for values the columns may hold, and the error reveals "
                         "which rows hold them",
                         f"{DECLARE_HINT[0].upper() + DECLARE_HINT[1:]}." if cast else
                         f"Cast to numeric first ({_hint_numeric(node)}), or {DECLARE_HINT}.",
                         None if cast else f"Cast to numeric first: {_hint_numeric(node)}.")
    elif kind == "numeric":
        if value.magnitude >= NUMERIC_LIMIT:
            raise Unsafe(f"{_sql(node)} can exceed numeric's range for values the columns may hold",
                         f"Declare bounds: {DECLARE_HINT}.")
    elif kind in FLOATS:
        if value.magnitude > FLOATS[kind][0]:
            raise Unsafe(f"{_sql(node)} can overflow {'real' if kind == 'float4' else 'double precision'} for values "
                         "the columns may hold, and the error reveals which rows hold them",
                         f"Declare bounds: {DECLARE_HINT}.")
    return value


def _hint_numeric(node: exp.Expression) -> str:
    operand = node.this if isinstance(node.this, exp.Expression) else node
    rest = node.expression if isinstance(node.args.get("expression"), exp.Expression) else None
    if isinstance(node, (exp.Add, exp.Sub, exp.Mul, exp.Div)) and rest is not None:
        symbol = {exp.Add: "+", exp.Sub: "-", exp.Mul: "*", exp.Div: "/"}[type(node)]
        return f"({_sql(operand)})::numeric {symbol} {_sql(rest)}"
    return f"({_sql(operand)})::numeric"
