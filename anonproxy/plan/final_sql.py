"""The last check before SQL runs on the service connection: PostgreSQL's own grammar reads it again.

The suppression rewrite (:mod:`anonproxy.suppress.rewrite`) and the dp plan
(:mod:`anonproxy.dp.bounded_sql`) build SQL from the pieces of the client's
statement that sqlglot parsed and the analysis checked, each rendered from its
node (:mod:`anonproxy.plan.render`). Here the finished SQL is parsed with libpg_query (the
``pglast`` package, PostgreSQL's parser itself) and every node of the tree is
walked:

* every relation (RangeVar) is a protected, linked or reference table of the
  policy, or a CTE the statement itself defines; the dp plan's guard CTE may
  also read the four catalog tables it needs (pg_index, pg_attribute,
  pg_class, pg_opclass);
* every function call, operator and cast target is on an allowlist, resolved
  in pg_catalog (a name qualified with any other schema is refused); ``/``
  and ``%`` only with a ``NULLIF(divisor, 0)`` divisor (outer queries over
  released rows write every division so);
* every node type is on an allowlist, so a construct nobody thought about
  (XMLTABLE, TABLESAMPLE, SELECT INTO, FOR UPDATE, ...) is refused, not ignored.

A refusal means the rewriter let something through that it should not have:
:func:`verify` logs it (one line, WARNING) and the statement gets 42501.
:func:`check_final_sql` itself is pure.
"""

from __future__ import annotations

import logging
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson
from pglast import ast
from pglast.parser import ParseError, parse_sql_json

from anonproxy.plan.refusals import INSUFFICIENT_PRIVILEGE, Refusal
from anonproxy.policy.model import Policy, split_policy_name

log = logging.getLogger("anonproxy.final_sql")

CATALOG = "pg_catalog"
# The dp plan's guard CTE (anonproxy.dp.bounded_sql) reads these catalogs, and only it may.
GUARD_CTE = "anonproxy_guard"
GUARD_RELATIONS = frozenset({"pg_index", "pg_attribute", "pg_class", "pg_opclass"})

# Functions the generators emit (aggregates, window functions, clamping helpers, the dp plan's random order and
# public domains) and those the expression allowlist (anonproxy.plan.expressions) lets client text hold.
# coalesce, nullif, greatest and least are not function calls in PostgreSQL's tree (CoalesceExpr, A_Expr,
# MinMaxExpr). None of these reads a relation or a setting.
FUNCTIONS = frozenset({
    "count", "sum", "avg", "min", "max", "bool_or", "array_agg",  # aggregates
    "variance", "var_samp", "var_pop", "stddev", "stddev_samp", "stddev_pop",  # suppress mode's spreads
    "row_number", "dense_rank", "first_value",  # window functions (contribution bounding, ranking)
    # window functions over released rows (post-aggregate expressions: running totals, ranks, previous values)
    "rank", "percent_rank", "cume_dist", "ntile", "lag", "lead", "last_value",
    "abs", "random", "unnest", "generate_series",  # magnitudes, the dp plan's random row order, its public domains
    "lower", "upper", "date_trunc", "date_part", "extract", "width_bucket",  # client expressions
    "like_escape",  # LIKE ... ESCAPE in the tree: like_escape(pattern, escape) of constants
    "round", "trunc", "ceil", "ceiling", "floor", "sign",  # post-aggregate expressions (plan.post_aggregate)
    # derived values the no-error proof admits (anonproxy.plan.bounds); trim() is btrim/ltrim/rtrim in the tree
    "mod", "to_char", "substring", "substr", "left", "right", "btrim", "ltrim", "rtrim", "length", "char_length",
    # time functions the proof admits (AT TIME ZONE is timezone() in the tree) and the statement-stable clock
    "timezone", "date_bin", "date", "make_date", "to_timestamp", "now", "transaction_timestamp",
    "statement_timestamp",
    # suppress mode's buckets of people (anonproxy.suppress.one_pass): a unit's hash by its type's own hash function,
    # the buckets a group holds as the bits of a bigint, and their number
    "hash_array", "bit_or", "replace",
})  # fmt: skip
# The SQL keywords of the clock (SQLValueFunction): not CURRENT_USER, CURRENT_SCHEMA and the like, which read
# settings, nor the volatile-looking current_time variants.
CLOCK_KEYWORDS = frozenset({"SVFOP_CURRENT_DATE", "SVFOP_CURRENT_TIMESTAMP", "SVFOP_LOCALTIMESTAMP"})
# The functions outside pg_catalog: suppress mode's report to the proxy (sql/0022), which reads nothing, and the
# check that each row is still one person (sql/0023), which reads the catalog only.
ANONPROXY_FUNCTIONS = frozenset({("anonproxy", "suppression_report"), ("anonproxy", "one_row_per_person")})
# Comparison, LIKE/ILIKE (~~ and friends), and the arithmetic of the generators' thresholds and sums.
OPERATORS = frozenset({"=", "<>", "<", ">", "<=", ">=", "~~", "!~~", "~~*", "!~~*", "+", "-", "*",
                       "&", "<<"})  # and suppress mode's bucket of a unit, as a bit of a bigint
# Division and modulo only by NULLIF(divisor, 0) or a non-zero constant, as post-aggregate expressions
# (anonproxy.plan.post_aggregate), outer queries over released rows (anonproxy.plan.outer) and the derived
# values of the no-error proof (anonproxy.plan.bounds) write them: a zero divisor gives NULL or cannot occur.
DIVISIONS = frozenset({"/", "%"})
_BETWEEN = frozenset({"BETWEEN", "NOT BETWEEN", "BETWEEN SYMMETRIC", "NOT BETWEEN SYMMETRIC"})
_EXPRESSION_KINDS = frozenset({
    "AEXPR_OP", "AEXPR_DISTINCT", "AEXPR_NOT_DISTINCT", "AEXPR_NULLIF", "AEXPR_IN", "AEXPR_LIKE", "AEXPR_ILIKE",
    "AEXPR_BETWEEN", "AEXPR_NOT_BETWEEN", "AEXPR_BETWEEN_SYM", "AEXPR_NOT_BETWEEN_SYM",
})  # fmt: skip
# Cast targets: the types constants may be cast to (expressions._CONSTANT_CAST_TYPES), text for columns, and
# the dp plan's numeric sums and name/oid/regclass in its guard, and bit for suppress mode's buckets of people. A
# cast runs the type's input or cast function: a type of some other schema could run anything.
TYPES = frozenset({
    "bool", "int2", "int4", "int8", "numeric", "float4", "float8", "text", "varchar", "bpchar", "date", "time",
    "timetz", "timestamp", "timestamptz", "interval", "name", "oid", "bit",
})  # fmt: skip
GUARD_TYPES = frozenset({"regclass"})  # a name looked up in pg_class: the guard's own table names

# Node types of a plain read-only SELECT. Anything else is refused. (List: a list inside a list, e.g. the
# functions of a RangeFunction; A_Const: a constant, whose value holds nothing to check; Integer: array bounds
# of a type.)
NODES = frozenset({
    "SelectStmt", "WithClause", "CommonTableExpr", "ResTarget", "RangeVar", "Alias", "JoinExpr", "RangeSubselect",
    "RangeFunction", "SubLink", "ColumnRef", "A_Star", "A_Const", "String", "Integer", "ParamRef", "FuncCall", "A_Expr",
    "BoolExpr", "NullTest", "BooleanTest", "CaseExpr", "CaseWhen", "CoalesceExpr", "MinMaxExpr", "TypeCast",
    "TypeName", "A_ArrayExpr", "RowExpr", "SortBy", "WindowDef", "List", "SQLValueFunction",
})  # fmt: skip
GUARD_NODES = frozenset({"A_Indirection", "A_Indices"})  # i.indkey[0]

HINT = ("A gated statement reads only the policy's protected tables and their linked tables, with the functions "
        "and operators of the supported subset; query other relations in statements of their own.")


def _typed_fields() -> dict[tuple[str, str], str]:
    """(node type, field) -> the field's node type, for the fields libpg_query's JSON writes without the type's
    name around them (those declared as one node type, such as ``Alias *alias``, rather than ``Node *``)."""
    typed = {}
    for name in (NODES | GUARD_NODES) - {"List"}:
        for field, info in getattr(ast, name).__slots__.items():
            target = info.c_type.removesuffix("*")
            if info.c_type.endswith("*") and target not in ("Node", "List", "Expr", "char") \
                    and isinstance(getattr(ast, target, None), type):
                typed[(name, field)] = target
    return typed


_TYPED_FIELDS = _typed_fields()


class FinalCheckRefusal(Refusal):
    """The final SQL holds something not allowed; ``name`` is the relation, function, operator or construct."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(INSUFFICIENT_PRIVILEGE, message, HINT)
        self.name = name


def verify(sql: str, policy: Policy, role: str) -> tuple[str, ...]:
    """:func:`check_final_sql`, logging a refusal with the role and the offending name."""
    try:
        return check_final_sql(sql, policy)
    except FinalCheckRefusal as refusal:
        log.warning("final SQL check refused a statement of role %s: %s", role, refusal.name)
        raise


def check_final_sql(sql: str, policy: Policy) -> tuple[str, ...]:
    """Raise :class:`FinalCheckRefusal` unless ``sql`` is one SELECT reading only what ``policy`` declares; the
    tables it reads (``schema.table``, sorted: what the audit trail records)."""
    try:
        # The JSON form of the tree: several times faster to read than pglast's Python objects.
        statements = orjson.loads(parse_sql_json(sql))["stmts"]
    except (RecursionError, orjson.JSONDecodeError):  # orjson stops at 1024 levels of nesting
        raise FinalCheckRefusal("(too deep)", "anonproxy's final check found the SQL it generated nested too "
                                "deeply to read") from None
    except ParseError as exc:
        raise FinalCheckRefusal("(unparseable)", "anonproxy's final check could not parse the SQL it generated "
                                f"with PostgreSQL's grammar: {exc}") from None
    top = statements[0]["stmt"] if len(statements) == 1 else {}
    if list(top) != ["SelectStmt"]:
        raise FinalCheckRefusal("(not one SELECT)", "anonproxy's final check found generated SQL that is not "
                                "exactly one SELECT")
    allowed = {split_policy_name(name) for name in [*policy.tables, *policy.links, *policy.references]}
    walk = _Walk(allowed)
    try:
        walk.statement(top["SelectStmt"])
    except RecursionError:
        raise FinalCheckRefusal("(too deep)", "anonproxy's final check found the SQL it generated nested too "
                                "deeply to walk") from None
    return tuple(sorted(f"{schema}.{name}" for schema, name in walk.read))


class _Walk:
    def __init__(self, allowed: set[tuple[str, str]]) -> None:
        self.allowed = allowed
        self.read: set[tuple[str, str]] = set()  # the allowed tables met

    def statement(self, select: dict[str, Any]) -> None:
        """The top SELECT: only its own WITH clause may hold the dp plan's guard."""
        ctes = _cte_names(select)
        _refuse_recursive(select.get("withClause", {}))
        for cte in select.get("withClause", {}).get("ctes", ()):
            self.value(cte, ctes, _node(cte)[1].get("ctename") == GUARD_CTE)
        self.node("SelectStmt", {key: value for key, value in select.items() if key != "withClause"}, ctes, False)

    def value(self, value: Any, ctes: frozenset[str | None], guard: bool) -> None:
        """A node written with its type's name around it, or a list of them (lists nest)."""
        if value.__class__ is list:
            for item in value:
                if item.__class__ is dict or item.__class__ is list:
                    self.value(item, ctes, guard)
        elif value.__class__ is dict and value:
            self.node(*_node(value), ctes, guard)

    def node(self, kind: str, fields: dict[str, Any], ctes: frozenset[str | None], guard: bool) -> None:
        if kind not in NODES and not (guard and kind in GUARD_NODES):
            raise FinalCheckRefusal(kind, f"anonproxy's final check found a {kind} node in the SQL it generated, "
                                    "which a gated statement may not hold")
        if kind == "A_Const":
            return
        if kind == "SelectStmt":
            ctes = ctes | _cte_names(fields)
        elif kind == "WithClause":
            _refuse_recursive(fields)
        elif kind == "RangeVar":
            self._relation(fields, ctes, guard)
        elif kind == "FuncCall":
            _function(fields)
        elif kind == "A_Expr":
            _operator(fields)
        elif kind == "SubLink" and "operName" in fields:
            _operator_name(fields["operName"])
        elif kind == "SortBy" and "useOp" in fields:
            _operator_name(fields["useOp"])
        elif kind == "TypeName":
            _type(fields, guard)
        elif kind == "SQLValueFunction" and fields.get("op") not in CLOCK_KEYWORDS:
            raise FinalCheckRefusal(f"SQLValueFunction {fields.get('op')}", "anonproxy's final check found a SQL value function "
                                    f"{fields.get('op')} in the SQL it generated, which is not on its allowlist")
        elif kind in ("RangeSubselect", "RangeFunction") and fields.get("lateral"):
            raise FinalCheckRefusal("LATERAL", "anonproxy's final check found LATERAL in the SQL it generated")
        for field, value in fields.items():  # scalars, most fields, hold nothing to check
            if value.__class__ is dict:
                if value:
                    typed = _TYPED_FIELDS.get((kind, field))  # a field of one node type is written bare
                    if typed is None:
                        self.node(*_node(value), ctes, guard)
                    else:
                        self.node(typed, value, ctes, guard)
            elif value.__class__ is list:
                self.value(value, ctes, guard)

    def _relation(self, fields: dict[str, Any], ctes: frozenset[str | None], guard: bool) -> None:
        catalog, schema, name = fields.get("catalogname"), fields.get("schemaname"), fields.get("relname")
        if catalog is None:
            if schema is None and name in ctes:
                return
            if schema is not None and name is not None and (schema, name) in self.allowed:
                self.read.add((schema, name))
                return
            if guard and schema == CATALOG and name in GUARD_RELATIONS:
                return
        shown = ".".join(part for part in (catalog, schema, name) if part)
        raise FinalCheckRefusal(shown, f"anonproxy's final check found relation {shown} in the SQL it generated; "
                                "a gated statement may read only the policy's protected and linked tables")


def _node(value: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A node written with its type's name around it: {"RangeVar": {...}}."""
    if len(value) != 1:
        raise FinalCheckRefusal("(unknown node)", "anonproxy's final check could not read the tree of the SQL it "
                                "generated")
    ((kind, fields),) = value.items()
    if not isinstance(fields, dict):
        raise FinalCheckRefusal(kind, "anonproxy's final check could not read the tree of the SQL it generated")
    return kind, fields


def _cte_names(select: dict[str, Any]) -> frozenset[str | None]:
    return frozenset(_node(cte)[1].get("ctename") for cte in select.get("withClause", {}).get("ctes", ()))


def _refuse_recursive(with_clause: dict[str, Any]) -> None:
    if with_clause.get("recursive"):
        raise FinalCheckRefusal("WITH RECURSIVE", "anonproxy's final check found WITH RECURSIVE in the SQL it "
                                "generated")


def _names(parts: list[dict[str, Any]]) -> tuple[str, ...]:
    names = []
    for part in parts:
        kind, fields = _node(part)
        if kind != "String":
            raise FinalCheckRefusal(kind, "anonproxy's final check found a name it cannot read in the SQL it "
                                    "generated")
        names.append(fields.get("sval", ""))
    return tuple(names)


def _catalog_name(parts: tuple[str, ...]) -> str | None:
    """The object's name when it is unqualified or qualified with pg_catalog; None otherwise."""
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == CATALOG):
        return parts[-1]
    return None


def _function(fields: dict[str, Any]) -> None:
    parts = _names(fields.get("funcname", []))
    if (_catalog_name(parts) not in FUNCTIONS and parts not in ANONPROXY_FUNCTIONS) or fields.get("func_variadic"):
        shown = ".".join(parts)
        raise FinalCheckRefusal(f"{shown}()", f"anonproxy's final check found a call of function {shown}() in the "
                                "SQL it generated, which is not on its allowlist")


def _operator(fields: dict[str, Any]) -> None:
    kind = fields.get("kind")
    if kind not in _EXPRESSION_KINDS:
        shown = str(kind).removeprefix("AEXPR_")
        raise FinalCheckRefusal(shown, f"anonproxy's final check found a {shown} expression in the SQL it "
                                "generated, which is not on its allowlist")
    if "BETWEEN" in kind and _names(fields.get("name", [])) in {(word,) for word in _BETWEEN}:
        return
    operator = _catalog_name(_names(fields.get("name", [])))
    if kind == "AEXPR_OP" and operator in DIVISIONS:
        if not _safe_divisor(fields.get("rexpr")):
            raise FinalCheckRefusal(f"operator {operator}", f"anonproxy's final check found operator {operator} in "
                                    "the SQL it generated with a divisor that is neither NULLIF(..., 0) nor a "
                                    "non-zero constant")
        return
    _operator_name(fields.get("name", []))


def _safe_divisor(value: Any) -> bool:
    """``NULLIF(b, 0)`` or a non-zero numeric constant: the divisions post-aggregate expressions generate."""
    if not isinstance(value, dict) or not value:
        return False
    kind, fields = _node(value)
    if kind == "A_Const":
        number = fields.get("ival", fields.get("fval"))
        text = str(next(iter(number.values()), "0")) if isinstance(number, dict) else "0"
        try:
            return Decimal(text) != 0
        except InvalidOperation:
            return False
    if kind == "A_Expr" and fields.get("kind") == "AEXPR_NULLIF":
        zero = fields.get("rexpr")
        return isinstance(zero, dict) and _node(zero)[0] == "A_Const" and not _safe_divisor(zero) \
            and "sval" not in _node(zero)[1]
    return False


def _operator_name(parts_: list[dict[str, Any]]) -> None:
    parts = _names(parts_)
    if _catalog_name(parts) not in OPERATORS:
        shown = ".".join(parts)
        raise FinalCheckRefusal(f"operator {shown}", f"anonproxy's final check found operator {shown} in the SQL "
                                "it generated, which is not on its allowlist")


def _type(fields: dict[str, Any], guard: bool) -> None:
    parts = _names(fields.get("names", []))
    name = _catalog_name(parts)
    if fields.get("setof") or fields.get("pct_type") or not (name in TYPES or (guard and name in GUARD_TYPES)):
        shown = ".".join(parts)
        raise FinalCheckRefusal(f"type {shown}", f"anonproxy's final check found a cast to type {shown} in the SQL "
                                "it generated, which is not on its allowlist")
