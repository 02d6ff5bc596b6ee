"""Parameters decided at Bind: the ``$n`` that stand where the plan needs a constant.

Some places of a statement must hold a constant for the analysis to prove it safe: a LIKE/ILIKE pattern (a
pattern ending with the escape character fails only on the rows that reach it), a ``date_trunc`` unit, an
``extract``/``date_part`` field, a ``to_char`` format, the zone of ``AT TIME ZONE``, the operand of a cast to a
type other than text (a run-time cast that fails on some rows reveals them), the OFFSET of a derived table or
WITH query (only ``OFFSET 0`` is inlined there, and Prisma binds it: anonproxy/plan/flatten.py), a LIMIT, OFFSET
or FETCH count cast to an integer type (SQLAlchemy's ``LIMIT $1::INTEGER`` with psycopg or asyncpg: written as the
integer it is, which the checks of a constant count then read), and in dp mode
any operand of HAVING (dp evaluates HAVING in the proxy on the noisy values: anonproxy/dp/having.py), and in dp
mode the operand of a WHERE condition on a time column with declared bounds (``col >= $n``, ``>``, ``<``,
``<=``, ``=``, ``BETWEEN $n AND $m``, an AND of them at the top of the WHERE: a constant there narrows the public
time domain, anonproxy/dp/time_domains.py; which columns those are: anonproxy/dp/bound_times.py), and a value that
sum(), avg() or a variance adds up (not one it compares: Django's ``SUM(CASE WHEN "income" = $1 THEN $2 ELSE $3
END)``, where $2 and $3 are slots and $1 is not): its size decides whether the sum can overflow, and what one
person adds to it. A client that
binds its values at Bind (server-side binding: Django, SQLAlchemy with psycopg, Peewee with psycopg 3, asyncpg,
Metabase, Prisma) sends a ``$n`` there.

:func:`slots` finds those parameters on the statement's one parse (a parameter may stand there bare, or under a
cast to text or varchar, or inside upper()/lower() or concat() in a LIKE pattern). :func:`bound_text` writes the
statement again with each of them replaced, everywhere it appears, by a literal built from its value (a string
literal, cast to the type the client declared when that is not a text type; NULL for a NULL; a bare integer for a
count) — the statement as if the client had written the constant, rendered from the tree (never cut from the
client's text). A plain ``CAST($n AS text|varchar)`` in a pattern, unit, field, format or zone slot is replaced as
a whole: these places read text, so the cast changes nothing there.
The proxy decides that text like any other; its text is the value class, which the decision cache keys on.

Which parameters are not decided at Bind: every other ``$n`` (a comparison's operand but a dp time filter's, an
IN list, the statement's own LIMIT and OFFSET unless cast) is decided at Parse as it is, and those the analysis
refuses there stay refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache

from sqlglot import exp

from anonproxy.plan.expressions import SPREADS, unparen
from anonproxy.plan.joins import conjuncts
from anonproxy.plan.refusals import unsupported
from anonproxy.plan.render import sql as render
from anonproxy.plan.statements import parse_statement, split

TEXT_OID = 25
BIGINT_OID = 20
# Declared types whose values are written as plain string literals (text, varchar, unknown, unspecified).
_PLAIN = frozenset({0, TEXT_OID, 1043, 705})
# Other declared types a value can be cast to as a constant: OID -> SQL type.
_CASTS: Mapping[int, str] = {
    16: "BOOLEAN", 20: "BIGINT", 21: "SMALLINT", 23: "INT", 700: "REAL", 701: "DOUBLE PRECISION", 1700: "NUMERIC",
    1082: "DATE", 1114: "TIMESTAMP", 1184: "TIMESTAMPTZ", 1186: "INTERVAL",
}
_OIDS = {
    exp.DataType.Type.BOOLEAN: 16, exp.DataType.Type.BIGINT: 20, exp.DataType.Type.SMALLINT: 21,
    exp.DataType.Type.INT: 23, exp.DataType.Type.FLOAT: 700, exp.DataType.Type.DOUBLE: 701,
    exp.DataType.Type.DECIMAL: 1700, exp.DataType.Type.DATE: 1082, exp.DataType.Type.TIMESTAMP: 1114,
    exp.DataType.Type.TIMESTAMPTZ: 1184, exp.DataType.Type.INTERVAL: 1186, exp.DataType.Type.TEXT: TEXT_OID,
    exp.DataType.Type.VARCHAR: 1043,
}  # fmt: skip
_TEXT = (exp.DataType.Type.TEXT, exp.DataType.Type.VARCHAR)
_INTEGERS = (exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT)  # a count's casts
# A value every statement of each kind accepts: the statement is decided with it at Parse, and described with it.
# A value added up is 1, not 0: dp refuses a sum whose every term is 0 (SQLAlchemy's case((c, $2), else_=$3)).
_REPRESENTATIVE = {"pattern": "%", "unit": "year", "field": "year", "format": "YYYY", "zone": "UTC", "offset": "0",
                   "count": "0", "summed": "1"}
_REPRESENTATIVE_CAST = {1082: "2000-01-01", 1114: "2000-01-01 00:00:00", 1184: "2000-01-01 00:00:00+00",
                        1186: "1 day", 16: "true"}


@dataclass(frozen=True)
class Slot:
    """A parameter decided at Bind: its number, the kind of place it stands in, and the type it has when the
    client declares none (what PostgreSQL infers there: the cast's target, an aggregate's result type beside it,
    else text)."""

    number: int
    kind: str  # "pattern", "unit", "field", "format", "zone", "offset", "count", "cast", "having", "time", "summed"
    type_oid: int = TEXT_OID

    def representative(self) -> str:
        return _REPRESENTATIVE.get(self.kind) or _REPRESENTATIVE_CAST.get(self.type_oid, "0")


# A column reference -> the type OID of the time column with declared bounds it reads, else None.
TimeColumns = Callable[[exp.Column], "int | None"]
# A column reference -> its SQL type (format_type's name) as the policy read it, else None.
ColumnTypes = Callable[[exp.Column], "str | None"]


def slots(tree: exp.Expression, *, having: bool = False, times: TimeColumns | None = None,
          columns: ColumnTypes | None = None) -> tuple[Slot, ...]:
    """The parameters of ``tree`` that stand where a constant is needed, one per number, by number; with
    ``having`` (dp mode), every parameter of a HAVING clause too; with ``times`` (dp mode), every parameter a
    top-level WHERE condition compares with a time column it names (typed as the column when undeclared);
    ``columns`` types a bare operand compared with sum() or avg() of a column, as PostgreSQL does."""
    found: dict[int, Slot] = {}
    for node, kind in _places(tree, having):
        parameter = _parameter(node, kind)
        if parameter is not None:
            number = _number(parameter)
            cast = parameter.parent if isinstance(parameter.parent, exp.Cast) else None
            oid = _OIDS.get(cast.to.this, TEXT_OID) if cast is not None and not cast.to.expressions \
                else _compared_with_aggregate(parameter, columns)
            found.setdefault(number, Slot(number, kind, oid))
    for parameter, oid in _time_places(tree, times) if times is not None else ():
        found.setdefault(_number(parameter), Slot(_number(parameter), "time", oid))
    return tuple(found[number] for number in sorted(found))


def _compared_with_aggregate(parameter: exp.Expression, columns: ColumnTypes | None) -> int:
    """The type PostgreSQL infers for a bare parameter compared with an aggregate: the aggregate's result type
    (HAVING count(*) > $1: bigint; HAVING avg(age) > $1: numeric, age being an integer; asyncpg encodes its value
    as the type described), else (not compared with an aggregate, or of a type not known here) text."""
    parent = parameter.parent
    if isinstance(parent, (*_COMPARISONS, exp.NEQ)):
        other = parent.expression if parent.this is parameter else parent.this
    elif isinstance(parent, exp.Between) and parent.this is not parameter:
        other = parent.this
    else:
        return TEXT_OID
    other = unparen(other)
    if isinstance(other, exp.Count):
        return BIGINT_OID
    argument = unparen(other.this) if isinstance(other, (exp.Sum, exp.Avg)) else None
    sql_type = columns(argument) if columns is not None and isinstance(argument, exp.Column) else None
    results = _SUM_RESULTS if isinstance(other, exp.Sum) else _AVG_RESULTS
    return results.get(re.sub(r"\(.*\)", "", sql_type), TEXT_OID) if sql_type is not None else TEXT_OID


# A column's SQL type (without its typmod) -> the OID of sum()'s or avg()'s result over it (PostgreSQL's pg_aggregate).
_SUM_RESULTS = {"smallint": BIGINT_OID, "integer": BIGINT_OID, "bigint": 1700, "numeric": 1700, "real": 700,
                "double precision": 701}
_AVG_RESULTS = {"smallint": 1700, "integer": 1700, "bigint": 1700, "numeric": 1700, "real": 701,
                "double precision": 701}


def representative_text(tree: exp.Expression, found: tuple[Slot, ...]) -> str:
    """``tree``'s statement with each slot's representative value: what Parse decides and Describe describes (a
    value added up is the number 1, which sum() reads as PostgreSQL reads an integer bound there)."""
    return _rendered(tree, {slot.number: exp.Literal.number(1) if slot.kind == "summed" and slot.type_oid == TEXT_OID
                            else exp.Literal.string(slot.representative()) for slot in found})


def bound_text(sql: str, values: tuple[tuple[int, str | None, int], ...]) -> str:
    """Statement ``sql`` (one statement that :func:`slots` found slots in) with each ``(number, value, declared
    type OID)`` written as a constant: the text decided at Bind. Raises Refusal for a type it cannot write."""
    return _rendered(_template(sql), {number: _literal(number, value, oid) for number, value, oid in values})


@lru_cache(maxsize=64)
def _template(sql: str) -> exp.Expression:
    """The one statement of ``sql``, parsed (kept: a dashboard binds the same statement again and again)."""
    (statement,) = split(sql)
    return parse_statement(statement)


def _literal(number: int, value: str | None, oid: int) -> exp.Expression:
    if value is None:
        return exp.Null() if oid in _PLAIN else exp.cast(exp.Null(), _type(number, oid))
    literal = exp.Literal.string(value)
    return literal if oid in _PLAIN else exp.cast(literal, _type(number, oid))


def _type(number: int, oid: int) -> str:
    name = _CASTS.get(oid)
    if name is None:
        raise unsupported(f"parameter ${number} is declared with type OID {oid}, which anonproxy cannot write as a "
                          "constant where the statement needs one",
                          "Declare it as text (or leave its type unspecified), or write the constant in the "
                          "statement.")
    return name


def _rendered(tree: exp.Expression, literals: Mapping[int, exp.Expression]) -> str:
    copy = tree.copy()
    for node, kind in list(_places(copy, having=False)):
        parameter = _parameter(node, kind)
        if parameter is not None and kind == "count":
            node.replace(_count(literals[_number(parameter)], _number(parameter)))
        elif parameter is not None and kind != "cast" and parameter.parent is node and isinstance(node, exp.Cast):
            node.replace(literals[_number(parameter)].copy())  # CAST($n AS text) where text is read: the value
    for parameter in list(copy.find_all(exp.Parameter)):
        literal = literals.get(_number(parameter)) if _numbered(parameter) else None
        if literal is not None:
            parameter.replace(literal.copy())
    return render(copy)


def _count(literal: exp.Expression, number: int) -> exp.Expression:
    """A LIMIT, OFFSET or FETCH count bound under an integer cast, as the integer constant it is."""
    text = literal.this.name if isinstance(literal, exp.Cast) else literal.name
    if not (text.isascii() and text.isdigit()):
        raise unsupported(f"parameter ${number} of a LIMIT, OFFSET or FETCH count must be a non-negative integer",
                          "Bind a row count (0, 1, 2, ...).")
    return exp.Literal.number(int(text))


def _places(tree: exp.Expression, having: bool) -> Iterator[tuple[exp.Expression, str]]:
    """The nodes that must hold a constant, with their kind (with ``having``, the parameters of HAVING too)."""
    for node in tree.walk():
        if having and isinstance(node, exp.Having):
            yield from ((parameter, "having") for parameter in node.find_all(exp.Parameter))
        if isinstance(node, _ADDING) and node.this is not None:
            yield from ((parameter, "summed") for parameter in _added_up(node.this))
        if isinstance(node, (exp.Like, exp.ILike)):
            yield from _pattern_parts(node.expression)
        elif isinstance(node, (exp.TimestampTrunc, exp.DateTrunc)) and node.args.get("unit") is not None:
            yield node.args["unit"], "unit"
        elif isinstance(node, exp.Extract):
            yield node.this, "field"
        elif isinstance(node, exp.TimeToStr) and node.args.get("format") is not None:
            yield node.args["format"], "format"
        elif isinstance(node, exp.AtTimeZone) and node.args.get("zone") is not None:
            yield node.args["zone"], "zone"
        elif isinstance(node, exp.Cast) and isinstance(node.this, exp.Parameter) and node.to.this in _INTEGERS \
                and not node.to.expressions and isinstance(node.parent, (exp.Limit, exp.Offset, exp.Fetch)):
            yield node, "count"
        elif isinstance(node, exp.Cast) and isinstance(node.this, exp.Parameter) and node.to.this not in _TEXT:
            yield node, "cast"
        elif isinstance(node, exp.Offset) and isinstance(node.parent, exp.Select) \
                and isinstance(node.parent.parent, (exp.Subquery, exp.CTE)):
            yield node.expression, "offset"


_COMPARISONS = (exp.GT, exp.GTE, exp.LT, exp.LTE, exp.EQ)
# The aggregates that add their argument's values up, and the nodes whose operands are compared, not added
# (as the analysis reads them: anonproxy/plan/expressions.py refuses a parameter it finds added up).
_ADDING = (exp.Sum, exp.Avg, *SPREADS)
_COMPARING = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ, exp.NullSafeNEQ, exp.In,
              exp.Between, exp.Like, exp.ILike, exp.Escape, exp.Is)


def _added_up(node: exp.Expression) -> Iterator[exp.Parameter]:
    """The parameters whose values an aggregate's argument ``node`` adds up: not the operands of a comparison, nor
    a CASE's operand or WHEN values (CASE x WHEN v THEN ...), nor a searched CASE's conditions."""
    if isinstance(node, _COMPARING):
        return
    if isinstance(node, exp.Parameter) and _numbered(node):
        yield node
        return
    for key, value in node.args.items():
        if key == "this" and isinstance(node, (exp.Case, exp.If)):
            continue  # compared: CASE x WHEN v, or a WHEN condition
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, exp.Expression):
                yield from _added_up(child)


def _time_places(tree: exp.Expression, times: TimeColumns) -> Iterator[tuple[exp.Parameter, int]]:
    """The bare parameters compared with a time column in the conjuncts of ``tree``'s WHERE, with its type."""
    where = tree.args.get("where") if isinstance(tree, exp.Select) else None
    for condition in conjuncts(where.this) if where is not None else []:
        if isinstance(condition, exp.Between) and not condition.args.get("symmetric"):
            pairs = [(condition.this, condition.args["low"]), (condition.this, condition.args["high"])]
        elif isinstance(condition, _COMPARISONS):
            pairs = [(condition.this, condition.expression), (condition.expression, condition.this)]
        else:
            continue
        for column, operand in pairs:
            column, operand = unparen(column), unparen(operand)
            oid = times(column) if isinstance(column, exp.Column) else None
            if oid is not None and isinstance(operand, exp.Parameter) and _numbered(operand):
                yield operand, oid


def _pattern_parts(pattern: exp.Expression) -> Iterator[tuple[exp.Expression, str]]:
    """A LIKE pattern, seen through upper(), lower() and parentheses (Django's UPPER(%s)), or the parts of a
    concat() (Spring Data's and MyBatis's CONCAT('%', $1, '%'): constants at Bind, which the analysis folds)."""
    while isinstance(pattern, (exp.Upper, exp.Lower, exp.Paren)):
        pattern = pattern.this
    if type(pattern) is exp.Concat:  # not concat_ws
        yield from ((part, "pattern") for part in pattern.expressions)
        return
    yield pattern, "pattern"


def _parameter(node: exp.Expression, kind: str) -> exp.Parameter | None:
    """The $n standing in ``node``: ``node`` itself, or the operand of a cast (to text, outside "cast" slots)."""
    if isinstance(node, exp.Parameter) and _numbered(node):
        return node
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Parameter) and _numbered(node.this) and (
            kind in ("cast", "count") or (node.to.this in _TEXT and not node.to.expressions)):
        return node.this
    return None


def _numbered(parameter: exp.Parameter) -> bool:
    return isinstance(parameter.this, exp.Literal) and parameter.this.name.isdigit()


def _number(parameter: exp.Parameter) -> int:
    return int(parameter.this.name)
