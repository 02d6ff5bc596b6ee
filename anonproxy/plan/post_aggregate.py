"""Post-aggregate expressions: what a query computes from its aggregates after they are released.

``round(avg(age), 1)``, ``sum(x) / count(*)``, ``coalesce(sum(x), 0)``, a CASE
over aggregates, ``abs(0)``: expressions that may raise an error (division by
zero, overflow, a cast out of range) for some values. Evaluated on a group's
exact values before suppression decides, such an error would tell something
about a group that is never released (``1/(count(*) - 10)`` fails exactly
when a withheld group has 10 rows). So both modes compute them in a second
step, on released values only:

* suppress mode: an outer SELECT over the suppressed result, which is a
  ``MATERIALIZED`` CTE (PostgreSQL never pushes the outer conditions into it);
* dp mode: a statement over the noisy values the proxy released, passed as
  arrays (post-processing of noisy values costs no privacy).

:func:`compile_outer` turns the client's select list, HAVING and ORDER BY
into SQL over the columns of that released result: ``anonproxy_g<k>`` (the
GROUP BY expressions), ``anonproxy_c<i>`` (select items without aggregates)
and ``anonproxy_v<j>`` (each distinct aggregate). The SQL is generated here
from the parse tree, and every division ``a / b`` becomes ``a / NULLIF(b, 0)``
unless ``b`` is a non-zero constant: a division by zero gives NULL. Output
names are PostgreSQL's for the client's expressions (:func:`output_name`), so
a client sees the columns it would see without the proxy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sqlglot import exp

from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import fold, identifier, quote

RELEASED = "anonproxy_released"

_COMPARISONS: dict[type[exp.Expr], str] = {
    exp.EQ: "=", exp.NEQ: "<>", exp.GT: ">", exp.GTE: ">=", exp.LT: "<", exp.LTE: "<=",
    exp.NullSafeEQ: "IS NOT DISTINCT FROM", exp.NullSafeNEQ: "IS DISTINCT FROM"}
_ARITHMETIC: dict[type[exp.Expr], str] = {exp.Add: "+", exp.Sub: "-", exp.Mul: "*"}
_FUNCTIONS: dict[type[exp.Expr], str] = {
    exp.Round: "round", exp.Trunc: "trunc", exp.Abs: "abs", exp.Sign: "sign", exp.Ceil: "ceil", exp.Floor: "floor",
    exp.Greatest: "greatest", exp.Least: "least", exp.Coalesce: "coalesce", exp.Nullif: "nullif"}
# PostgreSQL's names for cast targets, as FigureColname reports them (the last part of the type's name).
_TYPE_NAMES: dict[exp.DType, str] = {
    exp.DataType.Type.SMALLINT: "int2", exp.DataType.Type.INT: "int4", exp.DataType.Type.BIGINT: "int8",
    exp.DataType.Type.DECIMAL: "numeric", exp.DataType.Type.DOUBLE: "float8", exp.DataType.Type.FLOAT: "float4",
    exp.DataType.Type.TEXT: "text", exp.DataType.Type.VARCHAR: "varchar", exp.DataType.Type.CHAR: "bpchar",
    exp.DataType.Type.BOOLEAN: "bool", exp.DataType.Type.DATE: "date", exp.DataType.Type.TIME: "time",
    exp.DataType.Type.TIMESTAMP: "timestamp", exp.DataType.Type.TIMESTAMPTZ: "timestamptz",
    exp.DataType.Type.INTERVAL: "interval",
}  # fmt: skip
# Window functions as the post statement writes them (expressions.WINDOW_FUNCTIONS allows these).
_WINDOW_FUNCTIONS = {exp.Sum: "sum", exp.Avg: "avg", exp.Count: "count", exp.Min: "min", exp.Max: "max",
                     exp.RowNumber: "row_number", exp.Rank: "rank", exp.DenseRank: "dense_rank",
                     exp.PercentRank: "percent_rank", exp.CumeDist: "cume_dist", exp.Ntile: "ntile",
                     exp.Lag: "lag", exp.Lead: "lead", exp.FirstValue: "first_value", exp.LastValue: "last_value"}
_NAMED: dict[type[exp.Expr], tuple[str, int]] = {
    exp.Case: ("case", 1), exp.Coalesce: ("coalesce", 2), exp.Nullif: ("nullif", 2), exp.Greatest: ("greatest", 2),
    exp.Least: ("least", 2), exp.Boolean: ("bool", 1),
    exp.AtTimeZone: ("timezone", 2)}  # x AT TIME ZONE z calls timezone(z, x)
Canonical = Callable[[exp.Expression], exp.Expression]  # makes two spellings of one expression compare equal
HINT = ("Post-aggregate expressions combine aggregates, GROUP BY expressions and constants with + - * /, round, "
        "trunc, abs, sign, ceil, floor, coalesce, nullif, greatest, least, CASE and casts.")


@dataclass(frozen=True)
class OuterItem:
    sql: str  # over the released columns, aliased with ``name``
    name: str
    computed: bool  # an expression over aggregates or a post-aggregate constant (else a plain or GROUP BY item)


@dataclass(frozen=True)
class PostAggregate:
    """The select list, HAVING and ORDER BY of a query, computed over its released values."""

    aggregates: tuple[exp.Expression, ...]  # anonproxy_v1, anonproxy_v2, ...: each distinct aggregate once
    items: tuple[OuterItem, ...]
    having: str | None  # a condition over the released columns (None: HAVING stays where it was, or is absent)
    order: tuple[str, ...]  # ORDER BY entries over the output columns or the released columns
    keys_used: bool  # whether a computed item, HAVING or ORDER BY reads a GROUP BY expression (anonproxy_g<k>)
    parameters: bool  # whether an expression holds a $n parameter
    windows: bool = False  # whether an expression holds a window function (computed over the rows HAVING keeps)


def value(index: int) -> str:
    return f"anonproxy_v{index}"


def key(index: int) -> str:
    return f"anonproxy_g{index}"


def plain(index: int) -> str:
    return f"anonproxy_c{index}"


def compile_outer(items: list[tuple[exp.Expression, str | None, bool]], having: exp.Expression | None,
                  order: list[tuple[exp.Expression | None, int | None, str]], keys: list[exp.Expression],
                  aggregate_kinds: tuple[type[exp.Expression], ...], canonical: Canonical,
                  source: str | None) -> PostAggregate:
    """``items``: (expression, alias, whether it holds an aggregate or post-aggregate node); ``order``: (expression,
    output position or None, suffix); ``keys``: the GROUP BY expressions, canonical; ``canonical``: the function
    that makes two spellings of one expression compare equal."""
    compiler = _Compiler(keys, aggregate_kinds, canonical)
    outer_items = []
    for position, (node, alias, computed) in enumerate(items, 1):
        name = alias if alias is not None else output_name(node, source)
        if computed:
            sql = compiler.sql(node)
        else:
            found = compiler.key_of(node)
            sql = key(found) if found is not None else plain(position)
        outer_items.append(OuterItem(f"{sql} AS {quote(name)}", name, computed))
    having_sql = compiler.sql(having) if having is not None else None
    order_sql = []
    for term, number, suffix in order:
        text = str(number) if number is not None else compiler.sql(term)  # type: ignore[arg-type]
        order_sql.append(f"{text} {suffix}".rstrip())
    return PostAggregate(tuple(compiler.aggregates), tuple(outer_items), having_sql, tuple(order_sql),
                         compiler.keys_used, compiler.parameters, compiler.windows)


class _Compiler:
    def __init__(self, keys: list[exp.Expression], kinds: tuple[type[exp.Expression], ...],
                 canonical: Canonical) -> None:
        self.keys = keys
        self.kinds = kinds
        self.canonical = canonical
        self.aggregates: list[exp.Expression] = []
        self._seen: list[exp.Expression] = []
        self.keys_used = False
        self.parameters = False
        self.windows = False

    def key_of(self, node: exp.Expression) -> int | None:
        wanted = self.canonical(node)
        return self.keys.index(wanted) + 1 if wanted in self.keys else None

    def aggregate(self, node: exp.Expression) -> str:
        wanted = self.canonical(node)
        if wanted not in self._seen:
            self._seen.append(wanted)
            self.aggregates.append(node)
        return value(self._seen.index(wanted) + 1)

    def sql(self, node: exp.Expression) -> str:
        if isinstance(node, self.kinds) or (isinstance(node, exp.Filter) and isinstance(node.this, self.kinds)):
            return self.aggregate(node)
        if not isinstance(node, (exp.Literal, exp.Null, exp.Boolean, exp.Parameter, exp.Paren)):
            found = self.key_of(node)
            if found is not None:
                self.keys_used = True
                return key(found)
        return self._node(node)

    def _node(self, node: exp.Expression) -> str:
        sql = self.sql
        if isinstance(node, exp.Paren):
            return f"({sql(node.this)})"
        if isinstance(node, exp.Literal):
            text: str = node.this
            return "'" + text.replace("'", "''") + "'" if node.is_string else text
        if isinstance(node, exp.Null):
            return "NULL"
        if isinstance(node, exp.Boolean):
            return "TRUE" if node.this else "FALSE"
        if isinstance(node, exp.Parameter):
            self.parameters = True
            return f"${node.this.name}"
        if isinstance(node, exp.Neg):
            return f"(- {sql(node.this)})"
        if type(node) in _ARITHMETIC:
            return f"({sql(node.this)} {_ARITHMETIC[type(node)]} {sql(node.expression)})"
        if isinstance(node, exp.Div):
            numerator, divisor = sql(node.this), sql(node.expression)
            if not _nonzero_constant(node.expression) and not _nullif_zero(node.expression):
                divisor = f"NULLIF({divisor}, 0)"  # a division by zero gives NULL, never an error
            return f"({numerator} / {divisor})"
        if type(node) in _FUNCTIONS:
            arguments = [node.this, *(node.args.get("expressions") or [])]
            for name in ("decimals", "expression"):
                if node.args.get(name) is not None:
                    arguments.append(node.args[name])
            return f"{_FUNCTIONS[type(node)]}({', '.join(sql(a) for a in arguments)})"
        if isinstance(node, exp.Cast):
            return f"CAST({sql(node.this)} AS {node.args['to'].sql(dialect='postgres')})"
        if isinstance(node, exp.Case):
            parts = ["CASE"]
            if node.this is not None:
                parts.append(sql(node.this))
            for branch in node.args.get("ifs") or []:
                parts.append(f"WHEN {sql(branch.this)} THEN {sql(branch.args['true'])}")
            if node.args.get("default") is not None:
                parts.append(f"ELSE {sql(node.args['default'])}")
            return " ".join([*parts, "END"])
        if type(node) in _COMPARISONS:
            return f"({sql(node.this)} {_COMPARISONS[type(node)]} {sql(node.expression)})"
        if isinstance(node, (exp.And, exp.Or)):
            return f"({sql(node.this)} {'AND' if isinstance(node, exp.And) else 'OR'} {sql(node.expression)})"
        if isinstance(node, exp.Not):
            return f"(NOT {sql(node.this)})"
        if isinstance(node, exp.Is):
            negate = "NOT " if node.args.get("negate") else ""
            return f"({sql(node.this)} IS {negate}{sql(node.expression)})"
        if isinstance(node, exp.In):
            negate = "NOT " if node.args.get("negate") else ""
            return f"({sql(node.this)} {negate}IN ({', '.join(sql(e) for e in node.expressions)}))"
        if isinstance(node, exp.Between):
            negate = "NOT " if node.args.get("negate") else ""
            return f"({sql(node.this)} {negate}BETWEEN {sql(node.args['low'])} AND {sql(node.args['high'])})"
        if isinstance(node, exp.Window):
            return self._window(node)
        keyed = self._over_keys(node)
        if keyed is not None:
            return keyed
        if isinstance(node, exp.Column):
            raise unsupported(f"column {node.sql(dialect='postgres')} in an expression over aggregates must be a "
                              "GROUP BY expression", HINT)
        raise unsupported(f"{node.sql(dialect='postgres')} cannot be computed over the released values: over "
                          "aggregates, a part without aggregates must be a GROUP BY expression or a constant", HINT)

    def _over_keys(self, node: exp.Expression) -> str | None:
        """A row expression whose columns all lie in GROUP BY expressions (Looker's to_char of the grouped
        date_trunc): the same expression over the released keys; None for anything else. The expression allowlist
        and its no-error proof already admitted it over every row, so over the released ones too."""
        if any(isinstance(part, (*self.kinds, exp.Window, exp.Parameter)) for part in node.walk()):
            return None
        used = False

        def replace(part: exp.Expression) -> exp.Expression:
            nonlocal used
            found = self.key_of(part) if isinstance(part, (exp.Column, exp.Func, exp.Cast, exp.Binary)) else None
            if found is None:
                return part
            used = True
            return exp.column(key(found))

        rewritten = node.copy().transform(replace)
        if not used or any(isinstance(part, exp.Column) and part.name not in self._key_names()
                           for part in rewritten.walk()):
            return None
        self.keys_used = True
        return rewritten.sql(dialect="postgres")

    def _key_names(self) -> set[str]:
        return {key(number) for number in range(1, len(self.keys) + 1)}

    def _window(self, node: exp.Window) -> str:
        """A window function over the released rows (checked by expressions.Checker: function, frame)."""
        self.windows = True
        function = node.this
        if isinstance(function, exp.Count) and isinstance(function.this, exp.Star):
            inside = "*"
        else:
            inside = ", ".join(self.sql(function.args[name]) for name in ("this", "offset", "default")
                               if function.args.get(name) is not None)
        call = f"{_WINDOW_FUNCTIONS[type(function)]}({inside})"
        window = []
        if node.args.get("partition_by"):
            window.append("PARTITION BY " + ", ".join(self.sql(key) for key in node.args["partition_by"]))
        order = node.args.get("order")
        if order is not None:
            window.append("ORDER BY " + ", ".join(
                f"{self.sql(ordered.this)} {'DESC' if ordered.args.get('desc') else 'ASC'} "
                f"NULLS {'FIRST' if ordered.args.get('nulls_first') else 'LAST'}" for ordered in order.expressions))
        spec = node.args.get("spec")
        if spec is not None:
            window.append(_frame(spec))
        return f"{call} OVER ({' '.join(window)})"


def _frame(spec: exp.WindowSpec) -> str:
    """ROWS | RANGE | GROUPS BETWEEN <start> AND <end>, from the checked frame's parts."""

    def bound(end: str) -> str:
        value, side = spec.args.get(end), spec.args.get(f"{end}_side")
        text = value.this if isinstance(value, exp.Literal) else str(value).upper()
        return f"{text} {str(side).upper()}" if side is not None else text

    kind = str(spec.args["kind"]).upper()
    if spec.args.get("end") is None:
        return f"{kind} {bound('start')}"
    return f"{kind} BETWEEN {bound('start')} AND {bound('end')}"


def _nullif_zero(node: exp.Expression) -> bool:
    """``NULLIF(b, 0)`` as written: already never zero."""
    while isinstance(node, exp.Paren):
        node = node.this
    return isinstance(node, exp.Nullif) and isinstance(node.expression, exp.Literal) \
        and not node.expression.is_string and _number(node.expression) == 0


def _number(node: exp.Literal) -> Decimal | None:
    try:
        return Decimal(node.this)
    except InvalidOperation:
        return None


def _nonzero_constant(node: exp.Expression) -> bool:
    while isinstance(node, (exp.Paren, exp.Neg)):
        node = node.this
    if not (isinstance(node, exp.Literal) and not node.is_string):
        return False
    try:
        number = Decimal(node.this)
    except InvalidOperation:
        return False
    return number.is_finite() and number != 0


def output_name(node: exp.Expression, source: str | None = None) -> str:
    """PostgreSQL's name for a select item without an alias (its FigureColname): a column's name, a function's
    name as written, the inner name of a cast or else the type's name, ``case``, else ``?column?``."""
    name, _ = _figure(node, source)
    return name


def _figure(node: exp.Expression, source: str | None) -> tuple[str, int]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.Column):
        return identifier(node.this) or "?column?", 2
    if isinstance(node, (exp.Filter, exp.Window)):
        node = node.this
    if isinstance(node, exp.WithinGroup):
        node = node.this
    if isinstance(node, exp.Cast):
        name, strength = _figure(node.this, source)
        if strength > 1:
            return name, strength
        target = node.args.get("to")
        kind = target.this if isinstance(target, exp.DataType) else None
        return _TYPE_NAMES.get(kind, "?column?"), 1  # type: ignore[arg-type]
    if type(node) in _NAMED:
        return _NAMED[type(node)]
    if isinstance(node, exp.Func) and not isinstance(node, (exp.Neg, exp.Binary, exp.If)):
        start, end = node.meta.get("start"), node.meta.get("end")
        if source is not None and start is not None and end is not None:
            return fold(source[start:end + 1], False), 2
        if isinstance(node, exp.Anonymous):
            return node.name.lower(), 2
        return node.sql_name().lower(), 2
    return "?column?", 0
