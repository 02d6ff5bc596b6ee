"""The expression allowlist for queries over protected tables.

Everything that reaches a row of a protected table (WHERE, GROUP BY, JOIN
conditions, aggregate arguments) must be *total*: it may not raise an error
for some rows and not others. An error is a one-bit answer about a row that
suppression never sees: ``CASE WHEN id = 17 AND income = '>50K' THEN 1/0 END``
tells whether person 17 earns more than 50K. So there is no concatenation (but of constants,
computed before), regular expressions, user functions, subqueries (but (SELECT x)
of constants, inlined before: anonproxy.plan.analysis), windows or set-returning
functions; LIKE patterns are constants that cannot fail; date_trunc/extract
units are constants checked here (the proof checks they suit the argument's
type). Arithmetic, division and modulo, rounding, casts between number types,
width_bucket, to_char, the text functions and the time functions (date_bin,
AT TIME ZONE, casts between time types, intervals added to dates, the clock,
make_date and to_timestamp of constants) are admitted only where the no-error
proof of :mod:`anonproxy.plan.bounds` shows that no value within the columns'
types and declared bounds can make them fail (every entry point below runs it
on the whole expression).

Select items, HAVING and ORDER BY may also hold aggregates: COUNT(*),
COUNT(x), COUNT(DISTINCT x), SUM, AVG, and MIN/MAX when the role allows them,
each with an optional FILTER (WHERE <row condition>), checked like the
aggregate's argument (FILTER (WHERE c) computes the aggregate of CASE WHEN c).
COUNT(DISTINCT x) takes a column, or a cast of one that keeps its values
apart (``distinct_column``: the same number); in dp mode, whose noise covers
what one person's values add, any row expression.
Over aggregates (and over constants alone) these clauses may also compute
*post-aggregate expressions*: + - * /, round, trunc, abs, sign, ceil, floor,
coalesce, nullif, greatest, least, casts and CASE. They may raise errors
(division by zero, overflow, a bad cast), so they are never evaluated on a
group before it is released: both modes compute them over the released values
only (:mod:`anonproxy.plan.post_aggregate`).

Identifying columns (the privacy unit, linked keys, columns the policy marks
``identifier``) may filter rows in WHERE, where the group-size rules then
apply. Everywhere else they could label one person's rows without removing
anyone, so they are refused inside aggregates (but count(DISTINCT id)), in JOIN
conditions, and in any expression of GROUP BY, the select list, HAVING or
ORDER BY; there they may stand only bare (GROUP BY id: every group is one
person).

Every node type is checked together with the arguments sqlglot filled in, so
a modifier this module does not know about (a new sqlglot argument, FILTER,
ORDER BY inside an aggregate, ...) is refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import NoReturn

from sqlglot import exp

from anonproxy.plan import bounds, clamp, time_values
from anonproxy.plan.interval_calls import interval_call
from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.tables import ResolvedTable, fold, identifier
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    ProtectedTable,
    ReferenceTable,
    SuppressionParams,
)

SYSTEM_COLUMNS = frozenset({"ctid", "xmin", "xmax", "cmin", "cmax", "tableoid"})

# What a row-level expression may be built from (WHERE, GROUP BY, JOIN conditions, aggregate arguments).
ROW_EXPRESSIONS = (
    "column references, constants, $n parameters, comparisons, AND/OR/NOT, IN (list), BETWEEN, IS [NOT] NULL, "
    "LIKE/ILIKE with a constant pattern (ESCAPE of one character or none), CASE, coalesce, nullif, lower, upper, "
    "width_bucket, casts of constants, and casts to text; the clock (now(), current_timestamp, current_date, "
    "localtimestamp, transaction_timestamp(), statement_timestamp()); and where no value can make them fail: + - * "
    "and unary minus, / and % by non-zero constants, abs, floor, ceil, round, trunc, casts between number types, "
    "date_trunc (with a constant time zone), date_bin, extract/date_part of a field the type has, to_char of dates "
    "and timestamps with a constant format, casts between date, timestamp and timestamptz, date(x), AT TIME ZONE and "
    "timezone() with a constant IANA zone, a constant interval added to or subtracted from a date or timestamp (date "
    "± integer), make_date and to_timestamp of constants, substring/left/right with constant positions, trim and "
    "length; || of constants and (SELECT x) of constants and the clock are computed before the checks"
)
# The aggregates of each mode, as the hints list them.
SUPPRESS_AGGREGATES = ("count(*), count(x), count(DISTINCT x), sum(x), avg(x), "
                       "variance/var_samp/var_pop/stddev/stddev_samp/stddev_pop(x){minmax}")
DP_AGGREGATE_LIST = (
    "count(*), count(x), count(DISTINCT x), sum(x), avg(x), "
    "variance/var_samp/var_pop/stddev/stddev_samp/stddev_pop(x), median(x), "
    "percentile_cont/percentile_disc(q) WITHIN GROUP (ORDER BY x)"
)
# Clauses evaluated once per group: aggregates are allowed there.
_GROUPED_CLAUSES = ("the select list", "HAVING", "ORDER BY")
# Why an aggregate does not belong in a row-level clause, and where it goes instead.
_NO_AGGREGATE_HINTS = {
    "WHERE": "WHERE filters rows before they are grouped: put a condition on an aggregate in HAVING.",
    "GROUP BY": "Group by columns or row expressions; put the aggregates in the select list.",
    "a JOIN condition": "A JOIN condition compares columns of the joined rows; put aggregates in the select list "
                        "or HAVING.",
}

# date_trunc units and extract/date_part fields PostgreSQL knows; the proof (anonproxy.plan.bounds) decides by the
# argument's type which apply ('week' fails on intervals, hour on dates, timezone on timestamps).
TRUNC_UNITS = time_values.ALL_UNITS
EXTRACT_UNITS = time_values.ALL_FIELDS
# Functions sqlglot leaves as plain calls that the proof knows (anonproxy.plan.bounds: the clock, timezone(zone, x),
# make_date of constants).
_CALLS = frozenset({"transaction_timestamp", "statement_timestamp", "timezone", "make_date"})
# The largest constant a SUM or AVG may add up. A sum of a few huge constants overflows (numeric past 1e131072,
# real past 3.4e38, the rules' own arithmetic), and that error would say how many rows the constant reached:
# sum(CASE WHEN <condition> THEN 9e131071 ELSE 0 END) fails exactly when two rows of a withheld group meet the
# condition. 1e15 per row stays finite over 1e9 rows in every numeric type, squared too (avg of floats).
MAX_SUMMED_CONSTANT = Decimal("1e15")
# Nodes whose operands are compared, not added up: a constant there never reaches a sum.
_PREDICATES = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ, exp.NullSafeNEQ, exp.In,
               exp.Between, exp.Like, exp.ILike, exp.Escape, exp.Is)

# Types a constant may be cast to (folded at plan time, so a failure never depends on data).
_CONSTANT_CAST_TYPES = frozenset({
    exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT, exp.DataType.Type.DECIMAL,
    exp.DataType.Type.DOUBLE, exp.DataType.Type.FLOAT, exp.DataType.Type.BOOLEAN, exp.DataType.Type.TEXT,
    exp.DataType.Type.VARCHAR, exp.DataType.Type.CHAR, exp.DataType.Type.DATE, exp.DataType.Type.TIME,
    exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ, exp.DataType.Type.INTERVAL,
})  # fmt: skip
# Casts to these of dates and timestamps are admitted when the proof shows they fit (anonproxy.plan.bounds).
_TIME_TYPES = frozenset({exp.DataType.Type.DATE, exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ})
# Any value casts to text without error.
_TEXT_TYPES = frozenset({exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR, exp.DataType.Type.CHAR})
# Casts of a value to these are admitted when the proof shows it fits (anonproxy.plan.bounds).
_NUMBER_TYPES = frozenset({exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT,
                           exp.DataType.Type.DECIMAL, exp.DataType.Type.FLOAT, exp.DataType.Type.DOUBLE})

# A column's SQL type (as format_type() writes it, without a type modifier) -> the cast targets that hold every one
# of its values: integers widen to any wider integer, numeric and the floats (no error, at most rounding); real to
# double precision. Not the floats to numeric: before PostgreSQL 14 an infinity fails to convert. numeric converts
# to double precision only under a type modifier that keeps it within its range (_NUMERIC_TO_FLOAT).
_T = exp.DataType.Type
WIDENING: dict[str, frozenset[exp.DType]] = {
    "smallint": frozenset({_T.SMALLINT, _T.INT, _T.BIGINT, _T.DECIMAL, _T.FLOAT, _T.DOUBLE}),
    "integer": frozenset({_T.INT, _T.BIGINT, _T.DECIMAL, _T.FLOAT, _T.DOUBLE}),
    "bigint": frozenset({_T.BIGINT, _T.DECIMAL, _T.FLOAT, _T.DOUBLE}),
    "numeric": frozenset({_T.DECIMAL}),
    "real": frozenset({_T.FLOAT, _T.DOUBLE}),
    "double precision": frozenset({_T.DOUBLE}),
}
# The types whose values each have one text form, so that a cast to text keeps distinct values apart and equal ones
# together (dates and timestamps: in the session's DateStyle and TimeZone, fixed for a statement; character: its
# trailing blanks are insignificant both ways). Not numeric (1.0 and 1.00 are equal, their texts are not), nor the
# floats (0 and -0).
DISTINCT_TO_TEXT = frozenset({"smallint", "integer", "bigint", "text", "character varying", "character", "boolean",
                              "date", "timestamp without time zone", "timestamp with time zone", "uuid"})
# Integer cast targets, by the type name a column of that type has.
_INTEGER_NAMES = {_T.SMALLINT: "smallint", _T.INT: "integer", _T.BIGINT: "bigint"}
# numeric(p, s) holds no nonzero value below 10^-s in magnitude and none from 10^(p-s) up: within double
# precision's range (about 2.2e-308 to 1.8e308) when s <= 307 and p - s <= 308. A plain numeric may hold 1e-400,
# whose conversion fails.
_NUMERIC_TO_FLOAT = (307, 308)


# The spreads (variance, stddev and their _pop/_samp forms) are computed by PostgreSQL in suppress mode, from noisy
# sums in dp mode.
SPREADS = (exp.Variance, exp.VariancePop, exp.Stddev, exp.StddevSamp, exp.StddevPop)
AGGREGATES = (exp.Count, exp.Sum, exp.Avg, exp.Min, exp.Max, *SPREADS)
# Also aggregates in dp mode only, where the proxy computes them with noise (quantiles with the exponential
# mechanism): percentile_cont/disc(q) WITHIN GROUP (ORDER BY x) and median(x).
DP_AGGREGATES = AGGREGATES + (exp.Median, exp.WithinGroup)

# Node type -> the arguments it may carry. Anything else set on the node is refused.
_ROW_NODES: dict[type[exp.Expression], frozenset[str]] = {
    exp.Column: frozenset({"this", "table", "db"}),
    exp.Literal: frozenset({"this", "is_string"}),
    exp.Boolean: frozenset({"this"}),
    exp.Null: frozenset(),
    exp.Parameter: frozenset({"this"}),
    exp.Paren: frozenset({"this"}),
    exp.EQ: frozenset({"this", "expression"}),
    exp.NEQ: frozenset({"this", "expression"}),
    exp.GT: frozenset({"this", "expression"}),
    exp.GTE: frozenset({"this", "expression"}),
    exp.LT: frozenset({"this", "expression"}),
    exp.LTE: frozenset({"this", "expression"}),
    exp.NullSafeEQ: frozenset({"this", "expression"}),
    exp.NullSafeNEQ: frozenset({"this", "expression"}),
    exp.And: frozenset({"this", "expression"}),
    exp.Or: frozenset({"this", "expression"}),
    exp.Not: frozenset({"this"}),
    exp.Is: frozenset({"this", "expression", "negate"}),
    exp.In: frozenset({"this", "expressions", "negate"}),
    exp.Between: frozenset({"this", "low", "high", "symmetric", "negate"}),
    exp.Like: frozenset({"this", "expression", "negate"}),
    exp.ILike: frozenset({"this", "expression", "negate"}),
    exp.Escape: frozenset({"this", "expression"}),
    exp.Case: frozenset({"this", "ifs", "default"}),
    exp.If: frozenset({"this", "true", "false"}),
    exp.Coalesce: frozenset({"this", "expressions"}),
    exp.Nullif: frozenset({"this", "expression"}),
    exp.Lower: frozenset({"this"}),
    exp.Upper: frozenset({"this"}),
    exp.TimestampTrunc: frozenset({"this", "unit", "zone"}),
    exp.DateTrunc: frozenset({"this", "unit"}),
    exp.DateBin: frozenset({"this", "expression", "origin"}),
    exp.AtTimeZone: frozenset({"this", "zone"}),
    exp.Date: frozenset({"this"}),
    exp.CurrentTimestamp: frozenset(),
    exp.CurrentDate: frozenset(),
    exp.Localtimestamp: frozenset(),
    exp.StrToTime: frozenset({"this", "format"}),
    exp.Anonymous: frozenset({"this", "expressions"}),
    exp.Extract: frozenset({"this", "expression"}),
    exp.WidthBucket: frozenset({"this", "min_value", "max_value", "num_buckets"}),
    exp.Cast: frozenset({"this", "to"}),
    exp.Interval: frozenset({"this", "unit"}),
    exp.Neg: frozenset({"this"}),
    # Derived values, admitted when anonproxy.plan.bounds proves that no value can make them fail.
    exp.Add: frozenset({"this", "expression"}),
    exp.Sub: frozenset({"this", "expression"}),
    exp.Mul: frozenset({"this", "expression"}),
    exp.Div: frozenset({"this", "expression", "typed"}),
    exp.Mod: frozenset({"this", "expression"}),
    exp.Abs: frozenset({"this"}),
    exp.Floor: frozenset({"this"}),
    exp.Ceil: frozenset({"this"}),
    exp.Round: frozenset({"this", "decimals"}),
    exp.Trunc: frozenset({"this", "decimals"}),
    exp.TimeToStr: frozenset({"this", "format"}),
    exp.Substring: frozenset({"this", "start", "length"}),
    exp.Left: frozenset({"this", "expression"}),
    exp.Right: frozenset({"this", "expression"}),
    exp.Trim: frozenset({"this", "expression", "position"}),
    exp.Length: frozenset({"this"}),
}
# The node types above that compute new values (proved by anonproxy.plan.bounds).
_DERIVED = (exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Mod, exp.Neg, exp.Abs, exp.Floor, exp.Ceil, exp.Round, exp.Trunc,
            exp.TimeToStr, exp.Substring, exp.Left, exp.Right, exp.Trim, exp.Length)
_AGGREGATE_ARGS: dict[type[exp.Expression], frozenset[str]] = {
    exp.Count: frozenset({"this", "big_int"}),
    exp.Sum: frozenset({"this"}),
    exp.Avg: frozenset({"this"}),
    exp.Min: frozenset({"this"}),
    exp.Max: frozenset({"this"}),
    exp.Variance: frozenset({"this"}),
    exp.VariancePop: frozenset({"this"}),
    exp.Stddev: frozenset({"this"}),
    exp.StddevSamp: frozenset({"this"}),
    exp.StddevPop: frozenset({"this"}),
    exp.Median: frozenset({"this"}),
    exp.WithinGroup: frozenset({"this", "expression"}),
}

# Post-aggregate expressions: node type -> the arguments it may carry. Allowed in the select list, HAVING and ORDER
# BY over a subtree that holds an aggregate, or holds no column at all (abs(0)); computed on released values only.
POST_NODES: dict[type[exp.Expression], frozenset[str]] = {
    exp.Add: frozenset({"this", "expression"}),
    exp.Sub: frozenset({"this", "expression"}),
    exp.Mul: frozenset({"this", "expression"}),
    exp.Div: frozenset({"this", "expression", "typed"}),
    exp.Neg: frozenset({"this"}),
    exp.Round: frozenset({"this", "decimals"}),
    exp.Trunc: frozenset({"this", "decimals"}),
    exp.Abs: frozenset({"this"}),
    exp.Sign: frozenset({"this"}),
    exp.Ceil: frozenset({"this"}),
    exp.Floor: frozenset({"this"}),
    exp.Greatest: frozenset({"this", "expressions", "ignore_nulls"}),
    exp.Least: frozenset({"this", "expressions", "ignore_nulls"}),
    exp.Coalesce: frozenset({"this", "expressions"}),
    exp.Nullif: frozenset({"this", "expression"}),
    exp.Cast: frozenset({"this", "to"}),
    exp.Case: frozenset({"this", "ifs", "default"}),
    exp.If: frozenset({"this", "true"}),
    exp.Paren: frozenset({"this"}),
    exp.Window: frozenset({"this", "partition_by", "order", "spec", "over"}),
}
# Window functions over the released rows (a running total, a share of the total, the previous group's value):
# the function -> the arguments it may carry. Its arguments, PARTITION BY and ORDER BY are post-aggregate
# expressions (Metabase's cumulative count: sum(count(*)) OVER (ORDER BY key ROWS UNBOUNDED PRECEDING)).
WINDOW_FUNCTIONS: dict[type[exp.Expression], frozenset[str]] = {
    exp.Sum: frozenset({"this"}), exp.Avg: frozenset({"this"}), exp.Count: frozenset({"this", "big_int"}),
    exp.Min: frozenset({"this"}), exp.Max: frozenset({"this"}), exp.RowNumber: frozenset(),
    exp.Rank: frozenset(), exp.DenseRank: frozenset(), exp.PercentRank: frozenset(), exp.CumeDist: frozenset(),
    exp.Ntile: frozenset({"this"}), exp.Lag: frozenset({"this", "offset", "default"}),
    exp.Lead: frozenset({"this", "offset", "default"}), exp.FirstValue: frozenset({"this"}),
    exp.LastValue: frozenset({"this"}),
}  # fmt: skip
_FRAME_KINDS = frozenset({"ROWS", "RANGE", "GROUPS"})
_FRAME_SIDES = frozenset({"PRECEDING", "FOLLOWING"})
# The types a post-aggregate value may be cast to (its type's cast functions are the only code a cast runs).
POST_CAST_TYPES = frozenset({
    exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT, exp.DataType.Type.DECIMAL,
    exp.DataType.Type.DOUBLE, exp.DataType.Type.FLOAT, exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR,
    exp.DataType.Type.CHAR,
})  # fmt: skip
POST_EXPRESSIONS = ("+ - * / (a division by zero gives NULL), round, trunc, abs, sign, ceil, floor, coalesce, "
                    "nullif, greatest, least, CASE, casts to numeric or text types and window functions over the "
                    "released rows (sum, avg, count, min, max, row_number, rank, dense_rank, percent_rank, "
                    "cume_dist, ntile, lag, lead, first_value, last_value), over aggregates, GROUP BY "
                    "expressions and constants")


# How PostgreSQL spells each allowed function. sqlglot reads other dialects' names into the same nodes (ifnull,
# nvl -> coalesce, lcase -> lower, stdev -> stddev ...); the client's spelling is what runs, so it must be one of
# these. Nodes without a position (extract/date_part, casts, CASE) are keywords and need no check.
SPELLINGS: dict[type[exp.Expression], frozenset[str]] = {
    exp.Coalesce: frozenset({"coalesce"}), exp.Nullif: frozenset({"nullif"}), exp.Lower: frozenset({"lower"}),
    exp.Upper: frozenset({"upper"}), exp.TimestampTrunc: frozenset({"date_trunc"}),
    exp.DateBin: frozenset({"date_bin"}), exp.Date: frozenset({"date"}), exp.StrToTime: frozenset({"to_timestamp"}),
    exp.CurrentTimestamp: frozenset({"now", "current_timestamp"}), exp.CurrentDate: frozenset({"current_date"}),
    exp.Localtimestamp: frozenset({"localtimestamp"}),
    exp.DateTrunc: frozenset({"date_trunc"}), exp.WidthBucket: frozenset({"width_bucket"}),
    exp.Count: frozenset({"count"}), exp.Sum: frozenset({"sum"}), exp.Avg: frozenset({"avg"}),
    exp.Min: frozenset({"min"}), exp.Max: frozenset({"max"}), exp.Variance: frozenset({"variance", "var_samp"}),
    exp.VariancePop: frozenset({"var_pop"}), exp.Stddev: frozenset({"stddev"}),
    exp.StddevSamp: frozenset({"stddev_samp"}), exp.StddevPop: frozenset({"stddev_pop"}),
    exp.Median: frozenset({"median"}),
    exp.Round: frozenset({"round"}), exp.Trunc: frozenset({"trunc"}), exp.Abs: frozenset({"abs"}),
    exp.Sign: frozenset({"sign"}), exp.Ceil: frozenset({"ceil", "ceiling"}), exp.Floor: frozenset({"floor"}),
    exp.Greatest: frozenset({"greatest"}), exp.Least: frozenset({"least"}), exp.Mod: frozenset({"mod"}),
    exp.TimeToStr: frozenset({"to_char"}), exp.Substring: frozenset({"substring", "substr"}),
    exp.Left: frozenset({"left"}), exp.Right: frozenset({"right"}),
    exp.Trim: frozenset({"btrim", "ltrim", "rtrim"}), exp.Length: frozenset({"length", "char_length"}),
}  # fmt: skip

# pg_catalog functions PostgreSQL also calls with a column's syntax: ``a.f`` means ``f(a)`` when table ``a`` has no
# column ``f`` (functional notation), so ``a.json_agg`` aggregates whole rows and ``a.to_json`` reads one, while the
# tree shows a column. The service connection's search path is pg_catalog, so these are all the names it can reach
# there (PostgreSQL 15; tests/test_attacks_relations.py compares the list with the server's own catalog).
ROW_FUNCTIONS = frozenset({
    "any_out", "anycompatible_out", "anycompatiblenonarray_out", "anyelement_out", "anynonarray_out", "array_agg",
    "concat", "count", "hash_record", "json_agg", "json_build_array", "json_build_object", "jsonb_agg",
    "jsonb_build_array", "jsonb_build_object", "num_nonnulls", "num_nulls", "pg_collation_for",
    "pg_column_compression", "pg_column_size", "pg_typeof", "quote_literal", "quote_nullable", "record_out",
    "record_send", "row_to_json", "to_json", "to_jsonb",
})  # fmt: skip

# Friendlier names for refused constructs: (what, why).
_REFUSED: list[tuple[tuple[type[exp.Expression], ...], str, str]] = [
    ((exp.Div, exp.IntDiv, exp.Mod, exp.SafeDivide), "division and modulo", "a division by zero reveals data"),
    ((exp.Add, exp.Sub, exp.Mul, exp.Pow), "arithmetic", "an overflow error reveals data"),
    ((exp.DPipe,), "string concatenation (||)", "it is outside the supported subset"),
    ((exp.Subquery, exp.Select, exp.Exists, exp.SetOperation), "subqueries", "they can reach rows unchecked"),
    ((exp.Window,), "window functions", "they can return row-level values"),
    ((exp.Filter,), "FILTER on something other than an aggregate", "it is outside the supported subset"),
    ((exp.WithinGroup,), "ordered-set aggregates", "they can return a single row's value"),
    ((exp.Explode, exp.Unnest, exp.GenerateSeries, exp.ExplodingGenerateSeries), "set-returning functions",
     "they produce rows per input row"),
    ((exp.Star,), "* (all columns)", "it returns row-level data"),
    ((exp.RegexpLike, exp.RegexpILike, exp.SimilarTo), "regular expressions", "a bad pattern raises errors"),
    ((exp.Collate,), "COLLATE", "it is outside the supported subset"),
    ((exp.Any, exp.All), "ANY/ALL other than = ANY(ARRAY[...]) and <> ALL(ARRAY[...])",
     "an array parameter's element type is the client's choice; write x IN ($1, $2, ...) or x = ANY(ARRAY[...])"),
    ((exp.Array, exp.Tuple, exp.Struct), "arrays and row constructors", "they are outside the supported subset"),
    ((exp.ByteString, exp.National, exp.UnicodeString), "E'', N'' and U&'' strings",
     "write a standard-quoted string"),
    ((exp.Dot, exp.Bracket), "field and element access", "it is outside the supported subset"),
]


def _set_args(node: exp.Expression) -> set[str]:
    return {key for key, value in node.args.items() if value not in (None, False, [], "")}


def refused_construct(node: exp.Expression) -> tuple[str, str]:
    interval = interval_call(node)
    if interval is not None:  # reached here only outside dp mode: suppress-mode answers are exact
        return (f"function {interval[0]}()", ("it gives the 95 % interval of a noisy aggregate, answered only as a "
                                               "select item of its own of a dp-mode aggregate query; a "
                                               "suppress-mode answer is exact and has no interval"))
    if isinstance(node, exp.Dot) and isinstance(node.expression, exp.Func):  # schema.function(...)
        function = node.expression
        name = function.name if isinstance(function, exp.Anonymous) else function.sql_name().lower()
        return f"function {node.this.sql(dialect='postgres')}.{name}()", "only a few built-in functions are allowed"
    for types, what, why in _REFUSED:
        if isinstance(node, types):
            return what, why
    if isinstance(node, exp.Anonymous) and node.name.lower() == "all":  # sqlglot reads x <> ALL(...) so
        return refused_construct(exp.All())
    if isinstance(node, exp.Anonymous):
        return f"function {node.name}()", "only a few built-in functions are allowed"
    if isinstance(node, exp.Func):
        return f"function {node.sql_name().lower()}()", "only a few built-in functions are allowed"
    return f"{type(node).__name__} expressions", "they are outside the supported subset"


@dataclass
class Scope:
    """The tables of a query's FROM clause as its expressions can name them."""

    references: dict[str, ResolvedTable] = field(default_factory=dict)  # alias or table name -> table
    unaliased: dict[tuple[str, str], str] = field(default_factory=dict)  # (schema, table) of unaliased tables
    identifiers: dict[str, frozenset[str]] = field(default_factory=dict)  # reference -> identifying columns

    def owners(self, column: str) -> list[str] | None:
        """The references whose table has ``column``; None when some table's columns are not known."""
        models = {reference: _model(table) for reference, table in self.references.items()}
        if any(model is None or model.types is None for model in models.values()):
            return None
        return [reference for reference, model in models.items()
                if column in model.types]  # type: ignore[union-attr, operator]

    def is_identifier(self, table: str | None, column: str) -> bool:
        if table is not None:
            return column in self.identifiers.get(table, frozenset())
        return any(column in columns for columns in self.identifiers.values())


class Checker:
    """Validates expressions of one query; raises a Refusal naming the first construct not allowed."""

    def __init__(self, scope: Scope, params: SuppressionParams, table: str, dp: bool = False,
                 source: str | None = None, released: bool = False, zones: frozenset[str] | None = None) -> None:
        self.scope = scope
        self.zones = zones  # the time zone names the server knows (Policy.zones), for the no-error proof
        # The columns are released values (an outer query over an aggregate query's answer): what is allowed over
        # aggregates (casts, windows) is allowed over them, and they need no no-error proof.
        self.released = released
        self.params = params
        self.table = table
        self.dp = dp
        self.aggregates = DP_AGGREGATES if dp else AGGREGATES
        self.source = source  # the text node positions index into, to check function spellings
        self._proved: dict[int, bounds.Value] = {}  # what each proved node evaluates to, by id (see typed)
        self._in_aggregate = False
        self._summed = False  # inside the value a SUM or AVG adds up (not inside a comparison there)
        self._in_join = False
        # Where an expression labels rows rather than filtering them (GROUP BY, select items, HAVING, ORDER BY
        # outside aggregates), an identifying column may stand only bare: the node allowed to be one.
        self._labels = False
        self._bare: exp.Expression | None = None

    # -- hints: they name what the clause and the role's mode allow -------------

    def aggregate_hint(self) -> str:
        if self.dp:
            return f"Aggregates in dp mode: {DP_AGGREGATE_LIST}; x needs declared bounds except in count."
        minmax = ", min(x), max(x)" if self.params.allow_min_max else ""
        return f"Allowed aggregates: {SUPPRESS_AGGREGATES.format(minmax=minmax)}."

    def clause_hint(self, clause: str) -> str:
        """What ``clause`` may hold: row expressions, plus aggregates where it is evaluated per group."""
        if clause in _GROUPED_CLAUSES:
            aggregates = DP_AGGREGATE_LIST if self.dp else SUPPRESS_AGGREGATES.format(
                minmax=", min(x), max(x)" if self.params.allow_min_max else "")
            return (f"Allowed in {clause}: the GROUP BY expressions and aggregates ({aggregates}, each with an "
                    f"optional FILTER clause), built from {ROW_EXPRESSIONS}; over aggregates also "
                    f"{POST_EXPRESSIONS}.")
        return f"Allowed in {clause}: {ROW_EXPRESSIONS}."

    # -- entry points ---------------------------------------------------------

    def row(self, node: exp.Expression, clause: str) -> None:
        """A row-level expression: no aggregates."""
        self._walk(node, clause, aggregates=False)
        self._prove(node, clause)

    def grouped(self, node: exp.Expression, clause: str) -> None:
        """An expression evaluated per group: aggregates allowed, their arguments row-level; outside aggregates, an
        identifying column only bare."""
        self._labelling(node, clause, aggregates=True)
        if not contains_aggregate(node, self.aggregates):
            self._prove(node, clause)
            return
        # Over aggregates the expression is computed on released values only (post_aggregate); what runs on the
        # rows is each aggregate's argument and FILTER condition: those must be total.
        for aggregate in node.find_all(*self.aggregates):
            if window_function(aggregate):
                continue  # computed over the released rows: its arguments are aggregates, not rows
            for argument in _row_arguments(aggregate):
                self._prove(argument, clause)
        for filtered in node.find_all(exp.Filter):
            self._prove(filtered.expression.this if isinstance(filtered.expression, exp.Where)
                        else filtered.expression, clause)

    def key(self, node: exp.Expression, clause: str) -> None:
        """A grouping expression: row-level, and an identifying column only bare (GROUP BY id, never id = 17)."""
        self._labelling(node, clause, aggregates=False)
        self._prove(node, clause)

    def typed(self, node: exp.Expression) -> bounds.Value:
        """What a checked row-level expression evaluates to: its type and, for a number, its bounds (as its proof
        found, when the node was proved on its own)."""
        proved = self._proved.get(id(node))
        return proved if proved is not None else bounds.evaluate(node, self.facts, self.zones)

    def join_condition(self, node: exp.Expression) -> None:
        """A JOIN condition next to the declared key: row-level, and without identifying columns."""
        self._in_join = True
        try:
            self._walk(node, "a JOIN condition", aggregates=False)
        finally:
            self._in_join = False
        self._prove(node, "a JOIN condition")

    # -- the no-error proof ---------------------------------------------------

    def _prove(self, node: exp.Expression, clause: str) -> None:
        """Refuse ``node`` unless no value of the columns it reads, within their types and declared bounds, can make
        it raise an error (anonproxy.plan.bounds). In dp mode declared number bounds are facts only for the columns
        read clamped into them: an expression proved only with them reads its bounded columns clamped."""
        if self.released:
            return  # an error over released values depends on nothing the client could not see in the answer
        # the tree outlives the checker: ids hold
        filters = {"WHERE": self.where_facts, "a JOIN condition": self.join_facts} if self.dp else {}
        facts = filters.get(clause, self.facts)
        try:
            self._proved[id(node)] = bounds.evaluate(node, facts, self.zones)
            return
        except bounds.Unsafe as unsafe:
            refused = unsafe
        marked = self._clamp(node) if self.dp else []
        if marked:
            try:
                self._proved[id(node)] = bounds.evaluate(node, facts, self.zones)
                return
            except bounds.Unsafe as unsafe:
                refused = unsafe
            for column in marked:  # refused: nothing is read clamped that the proof does not trust
                clamp.unmark(column)
        # past the bounds already read clamped, what works is another spelling (numeric arithmetic)
        hint = refused.rewrite if marked and refused.rewrite else refused.hint
        raise unsupported(f"not allowed in {clause} of a query over protected table {self.table}: "
                          f"{refused.reason}", hint) from None

    def _clamp(self, node: exp.Expression) -> list[exp.Column]:
        """Mark every column reference in ``node`` that has declared bounds it can be clamped into (anonproxy.plan.
        clamp) and is not marked yet; the references marked."""
        marked = []
        for column in node.find_all(exp.Column):
            declared = self._declared(column)
            if declared is None or clamp.clamp_of(column) is not None:
                continue
            sql_type, policy = declared
            if policy is None or policy.lower is None or policy.upper is None:
                continue
            found = clamp.clamp_for(sql_type, Decimal(repr(policy.lower)), Decimal(repr(policy.upper)))
            if found is not None:
                clamp.mark(column, found)
                marked.append(column)
        return marked

    def facts(self, node: exp.Column) -> bounds.ColumnFacts:
        """The type and declared bounds of the column ``node`` names; type None when the policy does not know it.
        In dp mode a number's declared bounds are where its values are clamped, not facts: a value outside them
        (which dp tolerates) must not make an expression proved within them fail on its row, un-noised. There the
        facts of a reference read clamped are its clamp's."""
        name = identifier(node.this) or ""
        declared = self._declared(node)
        if declared is None:
            return bounds.ColumnFacts(name, None)  # unknown, or ambiguous (which PostgreSQL refuses)
        sql_type, policy = declared
        lower = upper = earliest = latest = None
        if policy is not None and policy.earliest is not None and policy.latest is not None:
            earliest, latest = time_values.bound_micros(policy.earliest), time_values.bound_micros(policy.latest)
        clamped = clamp.clamp_of(node)
        if clamped is not None:
            return bounds.ColumnFacts(name, clamped.type, clamped.low, clamped.high, earliest, latest)
        if policy is not None and policy.lower is not None and policy.upper is not None and not self.dp:
            lower, upper = Decimal(repr(policy.lower)), Decimal(repr(policy.upper))
        return bounds.ColumnFacts(name, sql_type, lower, upper, earliest, latest)

    def _declared(self, node: exp.Column) -> tuple[str, ColumnPolicy | None] | None:
        """The SQL type of the column ``node`` names and its policy (None: a reference table's, or none declared);
        None when no table of the FROM clause, or more than one, has it."""
        name = identifier(node.this) or ""
        table = identifier(node.args.get("table"))
        schema = identifier(node.args.get("db"))
        if table is not None:
            reference = self.scope.unaliased.get((schema, table)) if schema is not None else table
            candidates = [self.scope.references[reference]] if reference in self.scope.references else []
        else:
            candidates = list(self.scope.references.values())
        found = [model for model in (_model(source) for source in candidates)
                 if model is not None and model.types is not None and name in model.types]
        if len(found) != 1:
            return None
        model = found[0]
        assert model.types is not None
        return model.types[name], None if isinstance(model, ReferenceTable) else model.columns.get(name)

    def where_facts(self, node: exp.Column) -> bounds.ColumnFacts:
        """:meth:`facts` for dp's WHERE clause: a time column with declared bounds within them (dp runs the clause
        only on rows within them wherever it reads the column inside an expression: anonproxy.dp.plan), any other
        anywhere PostgreSQL holds (294276 AD, 4714 BC: dp assumes nothing of the data)."""
        return replace(self.facts(node), whole_range=True)

    def join_facts(self, node: exp.Column) -> bounds.ColumnFacts:
        """:meth:`facts` for a dp JOIN condition, which PostgreSQL evaluates as it joins, before any condition of
        dp's own: a time column anywhere PostgreSQL holds, outside its declared range ('infinity') included."""
        return replace(self.facts(node), earliest=None, latest=None, whole_range=True)

    def input_column(self, name: str) -> bool | None:
        """Whether ``name`` is a column of a table of the FROM clause: None when some table's columns are not
        known (PostgreSQL reads a bare GROUP BY name as an input column first, as an output alias only if none)."""
        owners = self.scope.owners(name)
        return None if owners is None else bool(owners)

    def _labelling(self, node: exp.Expression, clause: str, aggregates: bool) -> None:
        self._labels, self._bare = True, unwrap(node)
        try:
            self._walk(node, clause, aggregates)
        finally:
            self._labels, self._bare = False, None

    # -- walking --------------------------------------------------------------

    def _walk(self, node: exp.Expression, clause: str, aggregates: bool) -> None:
        if self._summed and isinstance(node, _PREDICATES):
            self._compared(node, clause, aggregates)
            return
        self._check_spelling(node, clause)
        if aggregates and isinstance(node, exp.Filter):
            self._filtered(node, clause)
            return
        if aggregates and type(node) in POST_NODES and (self.released or is_post_aggregate(node, self.aggregates)):
            self._post_aggregate(node, clause)
            return
        if isinstance(node, self.aggregates):
            if not aggregates:
                raise unsupported(f"aggregate {_function_name(node)}() is not allowed in {clause}",
                                  _NO_AGGREGATE_HINTS.get(clause, "Aggregates cannot be nested: aggregate the "
                                                                  "column once."))
            labels, self._labels = self._labels, False  # an aggregate's argument has a rule of its own
            try:
                self._aggregate(node, clause)
            finally:
                self._labels = labels
            return
        allowed = _ROW_NODES.get(type(node))
        if allowed is None or (aggregates and isinstance(node, _DERIVED) and contains_aggregate(node, self.aggregates)):
            self._refuse(node, clause)  # (derived values are row-level: computing on aggregates is another matter)
        extra = _set_args(node) - allowed
        if extra:
            raise unsupported(
                f"{self._written(node) or type(node).__name__.lower()} with {', '.join(sorted(extra))} is not "
                f"allowed in {clause} "
                f"of a query over {self.table}", self.clause_hint(clause))
        check = getattr(self, f"_check_{type(node).__name__.lower()}", None)
        if check is not None and check(node, clause, aggregates):
            return  # the checker validated the children itself
        for child in _children(node):
            self._walk(child, clause, aggregates)

    def _compared(self, node: exp.Expression, clause: str, aggregates: bool) -> None:
        """``node``'s operands are compared, not added up (CASE WHEN age > 40 ... inside a SUM)."""
        self._summed = False
        try:
            self._walk(node, clause, aggregates)
        finally:
            self._summed = True

    def _written(self, node: exp.Expression) -> str | None:
        """How the client spelled the function ``node`` calls; None when its position is not known."""
        start, end = node.meta.get("start"), node.meta.get("end")
        if self.source is None or start is None or end is None or not isinstance(node, exp.Func):
            return None
        return fold(self.source[start:end + 1], False)

    def _check_spelling(self, node: exp.Expression, clause: str) -> None:
        spellings = SPELLINGS.get(type(node))
        start, end = node.meta.get("start"), node.meta.get("end")
        if spellings is None or self.source is None or start is None or end is None:
            return
        written = fold(self.source[start:end + 1], False)
        if written not in spellings:
            raise unsupported(f"function {written}() is not allowed in {clause} of a query over protected table "
                              f"{self.table}", f"Write PostgreSQL's name for it: {', '.join(sorted(spellings))}().")

    def _refuse(self, node: exp.Expression, clause: str) -> NoReturn:
        what, why = refused_construct(node)
        written = self._written(node)
        if written is not None and what.startswith("function "):
            what = f"function {written}()"  # the client's name, not sqlglot's (to_timestamp, not str_to_time)
        message = f"not allowed in {clause} of a query over protected table {self.table}: {what} ({why})"
        if isinstance(node, exp.Star):
            raise forbidden(message, "Select aggregates such as count(*), sum(x), avg(x), grouped by columns.")
        raise unsupported(message, self.clause_hint(clause))

    def _filtered(self, node: exp.Filter, clause: str) -> None:
        """``aggregate FILTER (WHERE condition)``: the condition is a row expression, checked like the argument of
        the aggregate it filters, because that is what it is: ``count(*) FILTER (WHERE c)`` computes
        ``count(CASE WHEN c THEN 1 END)``. So an identifying column is refused there as inside an aggregate
        (``count(*) FILTER (WHERE id <> 17)`` next to ``count(*)`` is one person's membership); other conditions
        pass, and suppression counts the contributors of the filtered rows."""
        where = node.expression
        if not isinstance(node.this, self.aggregates) or not isinstance(where, exp.Where) \
                or _set_args(where) != {"this"}:
            self._refuse(node, clause)
        if isinstance(node.this, (exp.WithinGroup, exp.Median)):
            raise unsupported("FILTER on a quantile is not supported in dp mode", self.aggregate_hint())
        self._walk(node.this, clause, aggregates=True)
        labels, self._labels = self._labels, False
        self._in_aggregate = True
        try:
            self._walk(where.this, "FILTER (WHERE ...)", aggregates=False)
        finally:
            self._labels, self._in_aggregate = labels, False

    def _post_aggregate(self, node: exp.Expression, clause: str) -> None:
        """An expression over aggregates, GROUP BY expressions and constants, computed on released values."""
        extra = _set_args(node) - POST_NODES[type(node)]
        if extra:
            raise unsupported(f"{type(node).__name__.lower()} with {', '.join(sorted(extra))} is not allowed in "
                              f"{clause}", self.clause_hint(clause))
        if isinstance(node, exp.Cast):
            target = node.args.get("to")
            # a type modifier only where PostgreSQL's own types take one: numeric(p, s), varchar(n), char(n)
            # (Hibernate's float(53) is read as double precision by the parser, as PostgreSQL's grammar reads it)
            modified = isinstance(target, exp.DataType) and bool(target.expressions)
            if not isinstance(target, exp.DataType) or target.this not in POST_CAST_TYPES or (
                    modified and target.this not in _TEXT_TYPES | {exp.DataType.Type.DECIMAL}):
                raise unsupported(f"cast to {target.sql(dialect='postgres') if target else None} is not allowed in "
                                  f"{clause}", "Cast aggregates to smallint, integer, bigint, numeric, real, double "
                                  "precision or text.")
        if isinstance(node, exp.Case):
            for branch in node.args.get("ifs") or []:
                if not isinstance(branch, exp.If) or _set_args(branch) - {"this", "true"}:
                    raise unsupported("malformed CASE branch", self.clause_hint(clause))
        if isinstance(node, exp.If) and not isinstance(node.parent, exp.Case):
            raise unsupported("if() is not allowed", self.clause_hint(clause))
        if isinstance(node, exp.Window):
            self._window(node, clause)
            return
        for child in _children(node):
            if isinstance(child, exp.DataType):
                continue
            self._walk(child, clause, aggregates=True)

    def _window(self, node: exp.Window, clause: str) -> None:
        """A window function over the released rows: its arguments, PARTITION BY and ORDER BY are post-aggregate
        expressions; its frame is ROWS, RANGE or GROUPS between UNBOUNDED, CURRENT ROW or a constant offset."""
        function = node.this
        allowed = WINDOW_FUNCTIONS.get(type(function))
        if allowed is None or _set_args(function) - allowed or (
                isinstance(function, exp.Count) and isinstance(function.this, exp.Distinct)):
            raise unsupported(f"window function {function.sql(dialect='postgres')} is not allowed in {clause}",
                              self.clause_hint(clause))
        if clause in ("HAVING", "WHERE") or str(node.args.get("over") or "").upper() != "OVER":
            raise unsupported(f"window functions are not allowed in {clause}", self.clause_hint(clause))
        spec = node.args.get("spec")
        if spec is not None:
            self._frame(spec, clause)
        for argument in _children(function):
            if not isinstance(argument, exp.Star):
                self._walk(argument, clause, aggregates=True)
        for key in node.args.get("partition_by") or []:
            self._walk(key, clause, aggregates=True)
        order = node.args.get("order")
        for ordered in order.expressions if order is not None else []:
            if not isinstance(ordered, exp.Ordered) or _set_args(ordered) - {"this", "desc", "nulls_first"}:
                raise unsupported(f"unsupported ORDER BY in a window of {clause}", self.clause_hint(clause))
            self._walk(ordered.this, clause, aggregates=True)

    def _frame(self, spec: exp.WindowSpec, clause: str) -> None:
        """A frame the post statement can write back (post_aggregate._frame): each end UNBOUNDED, CURRENT ROW or a
        constant offset, PRECEDING or FOLLOWING; no EXCLUDE."""
        kind = str(spec.args.get("kind") or "").upper()
        bounds_ok = all(
            (spec.args.get(end) is None and spec.args.get(f"{end}_side") is None)
            or (str(spec.args.get(end)).upper() == "CURRENT ROW" and spec.args.get(f"{end}_side") is None)
            or ((str(spec.args.get(end)).upper() == "UNBOUNDED" or _offset(spec.args.get(end)))
                and str(spec.args.get(f"{end}_side") or "").upper() in _FRAME_SIDES)
            for end in ("start", "end"))
        if kind not in _FRAME_KINDS or not bounds_ok or _set_args(spec) - {"kind", "start", "start_side", "end",
                                                                              "end_side"}:
            raise unsupported(f"window frame {spec.sql(dialect='postgres')} is not allowed in {clause}",
                              "A frame is ROWS, RANGE or GROUPS between UNBOUNDED PRECEDING, n PRECEDING, "
                              "CURRENT ROW, n FOLLOWING and UNBOUNDED FOLLOWING (n a constant).")

    def _aggregate(self, node: exp.Expression, clause: str) -> None:
        name = _function_name(node)
        if isinstance(node, (exp.Min, exp.Max)) and self.dp:
            raise forbidden(f"{name}() is not available in dp mode: an extreme is often a single person's value",
                            f"For a value near the extreme, ask for a percentile, e.g. percentile_cont(0.95) "
                            f"WITHIN GROUP (ORDER BY x). {self.aggregate_hint()}")
        if isinstance(node, (exp.Min, exp.Max)) and not self.params.allow_min_max:
            raise forbidden(f"{name}() is not allowed for this role: extremes are often a single person's value",
                            self.aggregate_hint())
        extra = _set_args(node) - _AGGREGATE_ARGS[type(node)]
        if extra:
            raise unsupported(f"{name}() with {', '.join(sorted(extra))} is not allowed",
                              self.aggregate_hint())
        argument = node.this
        if isinstance(node, exp.WithinGroup):
            argument = _percentile_argument(node)
        if isinstance(node, exp.Count):
            if isinstance(argument, exp.Star):
                return
            if isinstance(argument, exp.Distinct):
                if _set_args(argument) != {"expressions"} or len(argument.expressions) != 1:
                    raise unsupported("count(DISTINCT ...) takes exactly one expression",
                                      self.aggregate_hint())
                argument = unwrap(argument.expressions[0])  # count(DISTINCT (t.id)) is count(DISTINCT t.id)
                column = distinct_column(argument, self._column_type)
                if column is not None:
                    argument = column  # count(DISTINCT id::text) is count(DISTINCT id)
                elif not self.dp:
                    raise unsupported(
                        "count(DISTINCT ...) takes a column, or a cast of one that keeps its values apart (to "
                        "text of an integer, text, boolean, date or timestamp column): the number of distinct "
                        "values of another expression can single out a person (CASE WHEN <one person> THEN 'x' "
                        "ELSE 'y' END)", self.aggregate_hint())
                else:  # dp: noise calibrated to the values one person adds, whatever the expression
                    self._in_aggregate = True
                    try:
                        self._walk(argument, f"the argument of {name}()", aggregates=False)
                    finally:
                        self._in_aggregate = False
                    return
        elif isinstance(argument, exp.Distinct):
            raise unsupported(f"{name}(DISTINCT ...) is not allowed", self.aggregate_hint())
        if argument is None:
            raise unsupported(f"{name}() needs an argument", self.aggregate_hint())
        if isinstance(node, exp.Count) and (isinstance(node.this, exp.Distinct) or isinstance(argument, exp.Column)):
            # count(DISTINCT id) counts people; count(id) counts the rows where id is not null, what count(*)
            # FILTER (WHERE id IS NOT NULL) says: a bare column, even an identifying one, labels no row.
            self._walk(argument, f"the argument of {name}()", aggregates=False)
            return
        if not isinstance(node, exp.Count):
            self._check_reference_values(argument, name)
        if isinstance(node, SPREADS) and not self.dp:
            self._check_squared(argument, name)
        cast = _widening_cast(argument)
        if cast is not None and self._widens(cast):
            argument = cast.this  # the column is checked as if bare; any other cast meets the row rules
        self._in_aggregate = True
        self._summed = not isinstance(node, (exp.Count, exp.Min, exp.Max, exp.Median, exp.WithinGroup))
        try:
            self._walk(argument, f"the argument of {name}()", aggregates=False)
        finally:
            self._in_aggregate = self._summed = False

    def _column_type(self, column: exp.Column) -> str | None:
        """A column's SQL type as the policy read it (None: unknown, or the column's table is not known)."""
        source, name = self._source(column)
        return _sql_type(source, name) if source is not None and name is not None else None

    def _widens(self, cast: exp.Cast) -> bool:
        """Whether ``cast(column AS type)``, the whole argument of an aggregate (Tableau's sum(CAST(x AS BIGINT))),
        converts every value of the column's SQL type, read with the policy, without error (:data:`WIDENING`)."""
        source, name = self._source(cast.this)
        sql_type = _sql_type(source, name) if source is not None and name is not None else None
        return sql_type is not None and _converts(sql_type, cast.args["to"])

    def _check_reference_values(self, argument: exp.Expression, function: str) -> None:
        """A reference table's values are not the person's own: sum(region.population) over people adds a region's
        figure once per person, and has no declared bounds to make its sensitivity true. They may be counted, and
        compared (in CASE conditions, FILTER, WHERE, GROUP BY), not added up or ranked."""
        for column in _value_columns(argument):
            source, name = self._source(column)
            if source is None and column.args.get("table") is None:  # unqualified, several tables: whose is it?
                source = next((table for table in self.scope.references.values() if table.reference is not None
                               and name in (table.reference.types or {})), None)
            if source is not None and source.kind == "reference":
                raise unsupported(
                    f"{function}() of {column.sql(dialect='postgres')} is not allowed: it is a value of reference "
                    f"table {source.policy_name}, not of the people counted, and has no declared bounds",
                    "Group by the reference column, count it, or use it in a condition (WHERE, FILTER, CASE WHEN); "
                    "aggregate the protected table's own columns.")

    def _check_squared(self, argument: exp.Expression, function: str) -> None:
        """PostgreSQL squares the values of variance and stddev: in floating point, a value past 1.3e154 overflows
        (an error that would say someone holds it). So in suppress mode their values come from integer columns, or
        from columns whose declared bounds stay within 1e15 (constants are held there by the summed-value rule)."""
        for column in _value_columns(argument):
            source, name = self._source(column)
            if source is None or name is None or not _squares_fit(source, name):
                raise unsupported(
                    f"{function}() of {column.sql(dialect='postgres')} is not allowed in suppress mode: its values "
                    "are squared, and a huge floating-point value overflows with an error that reveals it",
                    f"Take {function}() of an integer column, or ask the DBA to declare bounds for "
                    f"{name or 'the column'} (within 1e15).")

    def _source(self, column: exp.Column) -> tuple[ResolvedTable | None, str | None]:
        """The table a column reference reads (None when unqualified and the FROM clause has several), its name."""
        name = identifier(column.this)
        table = identifier(column.args.get("table"))
        schema = identifier(column.args.get("db"))
        reference = self.scope.unaliased.get((schema, table)) if schema is not None and table else table
        source = self.scope.references.get(reference) if reference is not None else (
            next(iter(self.scope.references.values())) if len(self.scope.references) == 1 else None)
        return source, name

    # -- per-node rules (return True when children were handled) --------------

    def _check_column(self, node: exp.Column, clause: str, aggregates: bool) -> bool:
        if isinstance(node.this, exp.Star):
            raise forbidden(f"{node.sql(dialect='postgres')} is not allowed over protected table {self.table}: "
                            "it returns row-level data",
                            "Select aggregates such as count(*), sum(x), avg(x), grouped by columns.")
        name = identifier(node.this)
        if name in SYSTEM_COLUMNS:
            raise forbidden(f"system column {name} is not allowed in a query over protected table {self.table}",
                            "Use the table's ordinary columns.")
        table = identifier(node.args.get("table"))
        schema = identifier(node.args.get("db"))
        if table is not None and name in ROW_FUNCTIONS:
            reference = self.scope.unaliased.get((schema, table)) if schema is not None else table
            source = self.scope.references.get(reference or "")
            if source is None or not _declares(source, name):
                raise forbidden(f"{table}.{name} is not allowed over protected table {self.table}: PostgreSQL reads "
                                f"it as {name}({table}), a function of the whole row, unless the table has a column "
                                f"{name}", f"Name the table's columns; if {name} is one, ask the DBA to declare it "
                                "in the policy.")
        reference = self.scope.unaliased.get((schema, table)) if schema is not None and table else table
        identifying = name is not None and self.scope.is_identifier(reference, name)
        if identifying and self._in_join:
            raise forbidden(
                f"identifying column {name} is not allowed in a JOIN condition over protected table "
                f"{self.table} other than in the declared key: in an outer join such a condition marks the "
                f"rows it names instead of filtering them, like CASE WHEN {name} = 17 ... in every aggregate",
                f"Filter on {name} in WHERE, where the group-size rules apply; join on the declared key only.")
        if identifying and self._labels and node is not self._bare:
            raise forbidden(
                f"identifying column {name} is not allowed inside an expression in {clause} of a query over "
                f"protected table {self.table}: a group such as {name} = 17 or CASE WHEN {name} = 17 ... splits "
                "one person from everyone else, and the large group's total differs from the whole table's by "
                "that person",
                f"Group by {name} itself, or filter on {name} in WHERE." if self.dp else
                f"Group by {name} itself (every group is then one person, and withheld), or filter on {name} in "
                "WHERE, where the group-size rules apply.")
        if identifying and self._in_aggregate:
            raise forbidden(
                f"identifying column {name} is not allowed inside an aggregate over protected table "
                f"{self.table}: it can single out one person (count(CASE WHEN {name} = 17 ...))",
                f"Filter on {name} in WHERE, where the group-size rules apply, or count people with "
                f"count(DISTINCT {name}).")
        if table is None:
            if name in self.scope.references:
                raise forbidden(f"{name} names a whole row of {self.scope.references[name].policy_name}; "
                                "whole-row references are not allowed",
                                "Name a column, qualified with the table alias if needed (alias.column).")
            return True
        if schema is not None:
            if (schema, table) not in self.scope.unaliased:
                raise unsupported(f"column reference {schema}.{table}.{name} does not name a table of the FROM clause",
                                  "Qualify columns with the table alias.")
            return True
        if table not in self.scope.references:
            raise unsupported(f"column reference {table}.{name} does not name a table of the FROM clause",
                              "Qualify columns with the table alias or name used in FROM.")
        return True

    def _check_parameter(self, node: exp.Parameter, clause: str, aggregates: bool) -> bool:
        if not (isinstance(node.this, exp.Literal) and not node.this.is_string and node.this.name.isdigit()):
            raise unsupported("only $n parameters are allowed", "Use $1, $2, ...")
        if self._summed:
            raise unsupported(f"a parameter is not allowed as a value added up in {clause}: its size is not known "
                              "when the statement is checked, and a sum of huge values fails for some rows and "
                              "not others", "Write the value as a constant, or use the parameter in a comparison "
                              "(CASE WHEN x > $1 THEN ...).")
        return True

    def _check_literal(self, node: exp.Literal, clause: str, aggregates: bool) -> bool:
        if self._summed:
            try:
                value = Decimal(node.this)
            except InvalidOperation:
                value = None
            if value is None or not value.is_finite() or abs(value) > MAX_SUMMED_CONSTANT:
                raise unsupported(f"constant {node.sql(dialect='postgres')} is not allowed as a value added up in "
                                  f"{clause}: a sum of huge, infinite or NaN values overflows or defeats the "
                                  "suppression rules for some rows and not others",
                                  "Add up finite numbers of at most 1e15 in absolute value.")
        return True

    def _check_is(self, node: exp.Is, clause: str, aggregates: bool) -> bool:
        if not isinstance(node.expression, (exp.Null, exp.Boolean)):
            raise unsupported(f"IS {node.expression.sql(dialect='postgres')} is not allowed", self.clause_hint(clause))
        self._walk(node.this, clause, aggregates)
        return True

    def _check_in(self, node: exp.In, clause: str, aggregates: bool) -> bool:
        if not node.expressions:
            raise unsupported("IN needs a list of values", self.clause_hint(clause))
        return False

    def _check_like(self, node: exp.Like | exp.ILike, clause: str, aggregates: bool, escape: str = "\\") -> bool:
        pattern = node.expression
        cased = False
        while isinstance(pattern, (exp.Upper, exp.Lower, exp.Paren)):  # Django's UPPER('%x%'): case leaves \ be
            cased = cased or not isinstance(pattern, exp.Paren)
            pattern = pattern.this
        if isinstance(pattern, exp.Null):  # LIKE NULL (a parameter bound to NULL): no row matches, none fails
            self._walk(node.this, clause, aggregates)
            return True
        if not (isinstance(pattern, exp.Literal) and pattern.is_string):
            raise unsupported(f"LIKE/ILIKE patterns must be constant strings in {clause}",
                              "Write the pattern as a string literal; an invalid pattern would raise errors.")
        if cased and escape.lower() != escape.upper():  # upper()/lower() would make other escape characters
            raise unsupported(f"ESCAPE {escape!r} with upper() or lower() of the pattern is not supported",
                              "Use an escape character without case, such as '\\' or '!'.")
        trailing = len(pattern.this) - len(pattern.this.rstrip(escape)) if escape else 0
        if trailing % 2:
            raise unsupported("a LIKE pattern must not end with the escape character",
                              "Remove the trailing escape character.")
        self._walk(node.this, clause, aggregates)
        return True

    _check_ilike = _check_like

    def _check_escape(self, node: exp.Escape, clause: str, aggregates: bool) -> bool:
        """LIKE/ILIKE ... ESCAPE 'c' (Spring Data's derived Containing queries: ESCAPE '\\'), or ESCAPE '' (none):
        the pattern is checked with that escape character; PostgreSQL refuses any longer escape string."""
        like, escape = node.this, node.expression
        if not isinstance(like, (exp.Like, exp.ILike)) or _set_args(like) - _ROW_NODES[type(like)]:
            raise unsupported(f"ESCAPE is allowed after LIKE and ILIKE only, in {clause}", self.clause_hint(clause))
        if not (isinstance(escape, exp.Literal) and escape.is_string and len(escape.this) <= 1):
            raise unsupported(f"ESCAPE takes a constant string of one character or none in {clause}",
                              "Write ESCAPE '\\' (or another single character), or ESCAPE '' for none.")
        return self._check_like(like, clause, aggregates, escape.this)

    def _check_case(self, node: exp.Case, clause: str, aggregates: bool) -> bool:
        for branch in node.args.get("ifs") or []:
            if not isinstance(branch, exp.If) or _set_args(branch) - {"this", "true"}:
                raise unsupported("malformed CASE branch", self.clause_hint(clause))
        if not (self._summed and node.this is not None):
            return False
        # CASE x WHEN v THEN ...: x and the v are compared, the results added up.
        summed, self._summed = self._summed, False
        try:
            self._walk(node.this, clause, aggregates)
            for branch in node.args["ifs"]:
                self._walk(branch.this, clause, aggregates)
        finally:
            self._summed = summed
        for branch in node.args["ifs"]:
            self._walk(branch.args["true"], clause, aggregates)
        if node.args.get("default") is not None:
            self._walk(node.args["default"], clause, aggregates)
        return True

    def _check_if(self, node: exp.If, clause: str, aggregates: bool) -> bool:
        if not isinstance(node.parent, exp.Case):
            raise unsupported("if() is not allowed", self.clause_hint(clause))
        return False

    def _check_timestamptrunc(self, node: exp.Expression, clause: str, aggregates: bool) -> bool:
        unit = node.args.get("unit")
        if not isinstance(unit, exp.Var) or time_values.folded(unit.name) not in TRUNC_UNITS:
            raise unsupported(f"date_trunc unit {unit.sql(dialect='postgres') if unit else None} is not allowed",
                              f"Use one of: {', '.join(time_values.TRUNCATION)} as a string constant.")
        self._walk(node.this, clause, aggregates)
        return True  # the zone: a constant the proof checks

    def _check_attimezone(self, node: exp.AtTimeZone, clause: str, aggregates: bool) -> bool:
        self._walk(node.this, clause, aggregates)
        return True  # the zone: a constant the proof checks

    def _check_anonymous(self, node: exp.Anonymous, clause: str, aggregates: bool) -> bool:
        if node.name.lower() not in _CALLS:
            self._refuse(node, clause)
        return False

    def _check_extract(self, node: exp.Extract, clause: str, aggregates: bool) -> bool:
        unit = node.this
        name = time_values.folded(unit.name) if isinstance(unit, (exp.Var, exp.Literal)) else None
        if name not in EXTRACT_UNITS:
            raise unsupported(f"extract/date_part field {name or unit.sql(dialect='postgres')} is not allowed",
                              f"Use one of: {', '.join(sorted(time_values.extract_fields('timestamptz')))}.")
        self._walk(node.expression, clause, aggregates)
        return True

    def _check_cast(self, node: exp.Cast, clause: str, aggregates: bool) -> bool:
        target = node.args.get("to")
        if not isinstance(target, exp.DataType):
            raise unsupported("malformed cast", self.clause_hint(clause))
        kind = target.this
        inner = node.this
        while isinstance(inner, exp.Paren):
            inner = inner.this
        # Not a $n: the client may declare its type in Parse (text, say), and then $1::int is a run-time cast,
        # evaluated only for the rows that reach it once the service connection plans the statement generically.
        constant = isinstance(inner, (exp.Literal, exp.Null, exp.Interval)) or (
            isinstance(inner, exp.Neg) and isinstance(inner.this, exp.Literal))
        if constant and kind in _CONSTANT_CAST_TYPES:
            self._walk(inner, clause, aggregates)
            return True
        if kind in _TIME_TYPES and not isinstance(inner, exp.Parameter):
            self._walk(node.this, clause, aggregates)  # the proof checks the source is a time that fits
            return True
        if kind in _TEXT_TYPES or (kind in _NUMBER_TYPES and not isinstance(inner, exp.Parameter)):
            self._walk(node.this, clause, aggregates)  # to a number: the proof checks the value fits
            return True
        if isinstance(inner, exp.Parameter):
            raise unsupported(f"cast of a parameter to {target.sql(dialect='postgres')} is not allowed in {clause}: "
                              "the client chooses the parameter's type, and a cast that fails on some rows reveals "
                              "data", "Write $n without a cast (the server infers its type from the comparison), "
                              "or cast it to text.")
        raise unsupported(f"cast to {target.sql(dialect='postgres')} is not allowed in {clause}: "
                          "a cast that fails on some rows reveals data",
                          "Cast constants freely; cast columns to text or between number types.")

    def _check_interval(self, node: exp.Interval, clause: str, aggregates: bool) -> bool:
        if not (isinstance(node.this, exp.Literal) and node.this.is_string):
            raise unsupported("INTERVAL takes a constant string", self.clause_hint(clause))
        return True


def _model(table: ResolvedTable) -> ProtectedTable | LinkedTable | ReferenceTable | None:
    return table.protected or table.linked or table.reference


def _declares(table: ResolvedTable, column: str) -> bool:
    """Whether the policy declares ``column`` for ``table`` (applying a policy checks the column exists); every
    column of a reference table, read from the catalog with the policy; of a relation the proxy builds, its own."""
    if table.columns is not None:
        return column in table.columns
    if table.reference is not None:
        return column in (table.reference.types or {})
    declared = table.protected.columns if table.protected is not None else (
        table.linked.columns if table.linked is not None else {})
    return column in declared


def _children(node: exp.Expression) -> Iterable[exp.Expression]:
    for value in node.args.values():
        if isinstance(value, exp.Expression):
            yield value
        elif isinstance(value, list):
            yield from (item for item in value if isinstance(item, exp.Expression))


def _function_name(node: exp.Expression) -> str:
    return node.sql_name().lower() if isinstance(node, exp.Func) else type(node).__name__.lower()


def _number(node: exp.Expression | None) -> Decimal | None:
    sign = 1
    if isinstance(node, exp.Neg):
        sign, node = -1, node.this
    if not (isinstance(node, exp.Literal) and not node.is_string):
        return None
    try:
        return sign * Decimal(node.this)
    except InvalidOperation:
        return None


def _percentile_argument(node: exp.WithinGroup) -> exp.Expression:
    """x of percentile_cont/disc(q) WITHIN GROUP (ORDER BY x), after checking q and the ordering."""
    function, order = node.this, node.expression
    hint = "percentile_cont(q) or percentile_disc(q) WITHIN GROUP (ORDER BY column), q a constant in [0, 1]."
    if not isinstance(function, (exp.PercentileCont, exp.PercentileDisc)) or _set_args(function) != {"this"}:
        raise unsupported("only percentile_cont and percentile_disc are allowed WITHIN GROUP", hint)
    q = _number(function.this)
    if q is None or not 0 <= q <= 1:
        raise unsupported("the fraction of percentile_cont/disc must be a constant in [0, 1]", hint)
    if not isinstance(order, exp.Order) or _set_args(order) != {"expressions"} or len(order.expressions) != 1:
        raise unsupported("WITHIN GROUP takes one ORDER BY expression", hint)
    (ordered,) = order.expressions
    if not isinstance(ordered, exp.Ordered) or _set_args(ordered) - {"this", "nulls_first"}:
        raise unsupported("WITHIN GROUP (ORDER BY x) must order ascending", hint)
    argument: exp.Expression = ordered.this
    return argument


def _row_arguments(aggregate: exp.Expression) -> list[exp.Expression]:
    """The row-level expressions an aggregate computes on (``*`` and DISTINCT unwrapped)."""
    found = []
    for child in _children(aggregate):
        parts = child.expressions if isinstance(child, exp.Distinct) else [child]
        found += [part for part in parts if not isinstance(part, exp.Star)]
    return found


def _offset(node: object) -> bool:
    """A window frame's offset: a non-negative integer constant."""
    return isinstance(node, exp.Literal) and not node.is_string and node.this.isdigit()


def window_function(node: exp.Expr) -> bool:
    """Whether ``node`` is the function of a window (sum(...) in sum(...) OVER (...)): computed over the released
    rows, not an aggregate of the query."""
    return isinstance(node.parent, exp.Window) and node.parent.this is node


def contains_aggregate(node: exp.Expression, kinds: tuple[type[exp.Expression], ...] = AGGREGATES) -> bool:
    """Whether ``node`` holds an aggregate of the query (a window's function is not one: count(*) OVER ())."""
    return any(isinstance(child, kinds) and not window_function(child) for child in node.walk())


def is_post_aggregate(node: exp.Expression, kinds: tuple[type[exp.Expression], ...] = AGGREGATES) -> bool:
    """Whether ``node`` is computed after aggregation: it holds an aggregate, or it is a post-aggregate function of
    constants only (abs(0)); a constant the row rules allow (a cast of a constant, -1) keeps those rules."""
    if contains_aggregate(node, kinds):
        return True
    return type(node) not in _ROW_NODES and not any(isinstance(child, exp.Column) for child in node.walk())


def has_post_aggregate(node: exp.Expression, kinds: tuple[type[exp.Expression], ...] = AGGREGATES) -> bool:
    """Whether a grouped clause's expression needs the post-aggregate evaluation: a post-aggregate node (not a
    bare aggregate, a comparison or a boolean connective) anywhere outside the aggregates' arguments."""
    if isinstance(node, kinds) or isinstance(node, exp.Filter):
        return False
    if type(node) in POST_NODES and not isinstance(node, (exp.Paren, exp.If)) and is_post_aggregate(node, kinds):
        return True
    return any(has_post_aggregate(child, kinds) for child in _children(node))


def unwrap(node: exp.Expression) -> exp.Expression:
    """The expression under an alias and parentheses."""
    while isinstance(node, (exp.Alias, exp.Paren)):
        node = node.this
    return node


def unparen(node: exp.Expression) -> exp.Expression:
    """The expression under parentheses."""
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def distinct_column(argument: exp.Expression, column_type: Callable[[exp.Column], str | None]) -> exp.Column | None:
    """The column ``argument`` is, under parentheses and casts that keep its values apart (to text of
    :data:`DISTINCT_TO_TEXT`, to a wider integer), or None: count(DISTINCT CAST(col AS TEXT)) is then
    count(DISTINCT col), the same number. ``column_type``: a column's SQL type as the policy read it (None when
    unknown: then no cast is known to keep values apart)."""
    targets: list[exp.Expression] = []
    node = unwrap(argument)
    while isinstance(node, exp.Cast) and _set_args(node) == {"this", "to"}:
        targets.append(node.args["to"])
        node = unwrap(node.this)
    if not isinstance(node, exp.Column):
        return None
    sql_type = column_type(node) if targets else None
    for target in reversed(targets):
        sql_type = _distinct_cast(sql_type, target)
    return node if not targets or sql_type is not None else None


def _distinct_cast(sql_type: str | None, target: exp.Expression) -> str | None:
    """The type a value of ``sql_type`` has after a cast to ``target`` that maps equal values, and only those, to
    equal values; None for any other cast."""
    if sql_type is None or not isinstance(target, exp.DataType) or _set_args(target) != {"this"}:
        return None  # varchar(2): a modifier cuts values short (and char without one is char(1), below)
    base = sql_type.partition("(")[0]
    if target.this in (_T.TEXT, _T.VARCHAR):
        return "text" if base in DISTINCT_TO_TEXT else None
    if base in _INTEGER_NAMES.values() and target.this in WIDENING[base]:
        return _INTEGER_NAMES.get(target.this)  # a wider integer; not numeric, whose texts split equal values
    return None


def _widening_cast(argument: exp.Expression) -> exp.Cast | None:
    """``argument`` when it is cast(column AS type) of a plain column to a type other than text."""
    argument = unwrap(argument)
    if not (isinstance(argument, exp.Cast) and _set_args(argument) == {"this", "to"}):
        return None
    target = argument.args["to"]
    if not (isinstance(target, exp.DataType) and isinstance(argument.this, exp.Column)):
        return None
    return None if target.this in _TEXT_TYPES else argument  # any value casts to text (the row rule)


def _sql_type(table: ResolvedTable, column: str) -> str | None:
    """``column``'s SQL type as the policy read it; None when unknown (a policy built in memory)."""
    source = _model(table)
    types = source.types if source is not None else None
    return types.get(column) if types else None


def _converts(sql_type: str, target: exp.DataType) -> bool:
    """Whether every value of ``sql_type`` converts to ``target`` (without a type modifier) without error."""
    if _set_args(target) != {"this"}:
        return False  # numeric(3, 0), varchar(2): a modifier narrows
    base, _, modifier = sql_type.partition("(")
    if base == "numeric" and modifier:
        precision, _, scale = modifier.removesuffix(")").partition(",")
        if not (modifier.endswith(")") and precision.isdigit() and scale.lstrip("-").isdigit()):
            return False  # an array of numeric(p, s), say
        digits, places = int(precision), int(scale)
        if target.this == _T.DOUBLE:
            return places <= _NUMERIC_TO_FLOAT[0] and digits - places <= _NUMERIC_TO_FLOAT[1]
        return target.this in WIDENING["numeric"]
    return target.this in WIDENING.get(sql_type, frozenset())


def _value_columns(node: exp.Expression) -> Iterable[exp.Column]:
    """The columns whose values an aggregate adds up in ``node``: not those compared in conditions."""
    if isinstance(node, exp.Column):
        yield node
    elif isinstance(node, exp.Case):  # the operand of CASE x WHEN ... and the WHEN conditions are compared
        for branch in node.args.get("ifs") or []:
            yield from _value_columns(branch.args["true"])
        if node.args.get("default") is not None:
            yield from _value_columns(node.args["default"])
    elif not isinstance(node, (*_PREDICATES, exp.And, exp.Or, exp.Not)):
        for child in _children(node):
            yield from _value_columns(child)


# The largest declared bound whose square PostgreSQL's variance accumulates without overflow in any numeric type.
MAX_SQUARED_BOUND = Decimal("1e15")


def _squares_fit(table: ResolvedTable, column: str) -> bool:
    """Whether the squares of ``column``'s values cannot overflow: an integer type, or declared bounds (which the
    no-error rules trust) within :data:`MAX_SQUARED_BOUND`."""
    if _sql_type(table, column) in ("smallint", "integer", "bigint"):
        return True
    source = table.protected if table.protected is not None else table.linked
    policy = source.columns.get(column) if source is not None else None
    if policy is None or policy.lower is None or policy.upper is None:
        return False
    return max(abs(Decimal(str(policy.lower))), abs(Decimal(str(policy.upper)))) <= MAX_SQUARED_BOUND
