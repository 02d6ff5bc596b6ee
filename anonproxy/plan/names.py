"""Column references as the FROM clause names its tables.

PostgreSQL accepts ``schema.table.column`` for a table listed in FROM without
an alias (it matches the relation, so ``public.adult.age`` names a column of
``FROM adult``). The back-ends read columns as ``reference.column``, where the
reference is the alias or the bare table name, so :func:`normalize` rewrites
three-part names to that form, per SELECT (each derived table and CTE body is
its own scope). A three-part name that matches no unaliased table of its
SELECT is left alone: the back-ends refuse it as naming no table of the FROM
clause, as PostgreSQL would.

A table name may carry the database too (``"postgres"."public"."adult"``:
Lightdash and dbt write every relation so). :func:`drop_database` removes
that part when it names the database the policy governs (the only one a gated
role may be connected to); another database is refused as PostgreSQL refuses
it, 0A000 "cross-database references are not implemented".
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlglot import exp

from anonproxy.plan.refusals import unsupported
from anonproxy.plan.statements import DATE_PART
from anonproxy.plan.tables import PolicyIndex, identifier

_NESTED = (exp.Select, exp.Subquery, exp.SetOperation)


def own_nodes(select: exp.Select) -> Iterator[exp.Expression]:
    """Every node of ``select`` outside its nested queries (derived tables, CTEs, subqueries)."""
    stack: list[exp.Expression] = [value for key, value in _children(select) if key != "with_"]
    while stack:
        node = stack.pop()
        if isinstance(node, _NESTED):
            continue
        yield node
        stack.extend(value for _, value in _children(node))


def sources(select: exp.Select) -> list[exp.Expression]:
    """The FROM item and the joined items of ``select``, in order."""
    from_ = select.args.get("from_")
    items = [from_.this] if from_ is not None else []
    return items + [join.this for join in select.args.get("joins") or []]


def reference(item: exp.Expression) -> str | None:
    """The name a FROM item is known by in its SELECT: its alias, else a table's own name."""
    alias = item.args.get("alias")
    if isinstance(alias, exp.TableAlias) and alias.this is not None:
        return identifier(alias.this)
    if isinstance(item, exp.Table) and isinstance(item.this, exp.Identifier):
        return identifier(item.this)
    return None


def drop_database(tree: exp.Expression, database: str | None) -> None:
    """Remove the database part of every table name in ``tree`` that names ``database``. A table name qualified
    with another database (or any, when ``database`` is unknown) is refused."""
    for table in tree.find_all(exp.Table):
        catalog = table.args.get("catalog")
        if catalog is None:
            continue
        if not isinstance(catalog, exp.Identifier) or database is None or identifier(catalog) != database:
            written = ".".join(part.sql(dialect="postgres") for part in (catalog, table.args.get("db"), table.this)
                               if part is not None)
            where = f"the connected database, {database}" if database is not None else "the connected database"
            raise unsupported(f"cross-database references are not implemented: {written}",
                              f"Name tables of {where}, or leave the database out: schema.table.")
        table.set("catalog", None)


def normalize(tree: exp.Expression, index: PolicyIndex) -> bool:
    """Rewrite ``schema.table.column`` to ``table.column`` in every SELECT of ``tree``; whether anything changed."""
    changed = False
    for select in list(tree.find_all(exp.Select)):
        unaliased: dict[tuple[str, str], str] = {}
        for item in sources(select):
            if isinstance(item, exp.Table) and isinstance(item.this, exp.Identifier) \
                    and item.args.get("alias") is None and item.args.get("catalog") is None:
                resolved = index.resolve(item)
                unaliased[(resolved.schema, resolved.name)] = resolved.name
        for node in list(own_nodes(select)):
            if not isinstance(node, exp.Column) or node.args.get("db") is None:
                continue
            if node.args.get("catalog") is not None:
                raise unsupported(f"column reference {node.sql(dialect='postgres')} has too many dotted names",
                                  "Qualify columns with the table alias or name used in FROM.")
            key = (identifier(node.args["db"]) or "", identifier(node.args.get("table")) or "")
            if key in unaliased:
                node.set("db", None)
                node.set("table", exp.Identifier(this=unaliased[key], quoted=True))
                changed = True
    return changed


def _children(node: exp.Expression) -> Iterator[tuple[str, exp.Expression]]:
    for key, value in node.args.items():
        if isinstance(value, exp.Expression):
            yield key, value
        elif isinstance(value, list):
            yield from ((key, item) for item in value if isinstance(item, exp.Expression))


def output_name(item: exp.Expression, source: str) -> str | None:
    """The name PostgreSQL gives select item ``item`` (FigureColname), when this module can tell it: an alias, a
    column reference's column, a function's name as written in ``source``, a cast's operand name or else its type's
    name, CASE's ELSE name or else ``case``; None otherwise (PostgreSQL's ``?column?``)."""
    if isinstance(item, exp.Alias):
        return identifier(item.args.get("alias"))
    name, _ = _figure(item, source)
    return name


# Types whose name PostgreSQL reports under another name than the one sqlglot prints (FigureColname uses the
# catalog name of a cast's type: integer is int4, double precision float8).
_TYPE_NAMES = {exp.DataType.Type.INT: "int4", exp.DataType.Type.BIGINT: "int8", exp.DataType.Type.SMALLINT: "int2",
               exp.DataType.Type.DOUBLE: "float8", exp.DataType.Type.FLOAT: "float4",
               exp.DataType.Type.DECIMAL: "numeric", exp.DataType.Type.CHAR: "bpchar",
               exp.DataType.Type.BOOLEAN: "bool", exp.DataType.Type.VARBINARY: "bytea"}
# Functions whose name sqlglot does not place in the text (special syntax mostly): PostgreSQL's name for them.
# date_part(...) parses as EXTRACT too; the classifier's parser marks it (statements.DATE_PART).
_SPECIAL_NAMES: dict[type[exp.Expression], str] = {exp.Substring: "substring", exp.StrPosition: "position",
                                                   exp.CurrentDate: "current_date", exp.Coalesce: "coalesce",
                                                   exp.Greatest: "greatest", exp.Least: "least",
                                                   exp.Nullif: "nullif", exp.Extract: "extract", exp.Floor: "floor",
                                                   exp.Ceil: "ceil", exp.Initcap: "initcap",
                                                   exp.GroupConcat: "string_agg", exp.Overlay: "overlay",
                                                   exp.CurrentTimestamp: "current_timestamp",
                                                   exp.Localtimestamp: "localtimestamp", exp.Array: "array"}


def _figure(item: exp.Expression, source: str) -> tuple[str | None, int]:
    """FigureColnameInternal: a name and its strength (2: a name of its own, 1: a fallback, 0: none)."""
    while isinstance(item, exp.Paren):
        item = item.this
    if isinstance(item, exp.Column) and isinstance(item.this, exp.Identifier):
        return identifier(item.this), 2
    if isinstance(item, exp.Cast):
        name, strength = _figure(item.this, source)
        if strength > 1:
            return name, strength
        return _type_name(item.to), 1
    if isinstance(item, exp.Case):
        default = item.args.get("default")
        name, strength = _figure(default, source) if default is not None else (None, 0)
        return (name, strength) if strength > 1 else ("case", 1)
    # count(*) FILTER (...), percentile_cont(q) WITHIN GROUP, count(*) OVER (): the function's own name
    if isinstance(item, (exp.Filter, exp.WithinGroup, exp.Window)):
        return _figure(item.this, source)
    if isinstance(item, exp.Anonymous):
        return identifier(exp.Identifier(this=item.name, quoted=False)), 2
    if isinstance(item, exp.AtTimeZone):  # x AT TIME ZONE z calls timezone(z, x)
        return "timezone", 2
    if isinstance(item, exp.Trim):  # trim(x) calls btrim; trim(leading ...) ltrim, trim(trailing ...) rtrim
        position = (item.args.get("position") or "").upper()
        return {"LEADING": "ltrim", "TRAILING": "rtrim"}.get(position, "btrim"), 2
    start, end = item.meta.get("start"), item.meta.get("end")
    if isinstance(item, (exp.Func, exp.Binary)) and start is not None and end is not None:  # a call: mod(x, 3)
        written = source[start:end + 1]
        return (None, 0) if '"' in written else (identifier(exp.Identifier(this=written, quoted=False)), 2)
    if isinstance(item, exp.Extract) and item.meta.get(DATE_PART):
        return "date_part", 2  # date_part(...), which sqlglot reads as extract
    if isinstance(item, exp.Func):
        special = _SPECIAL_NAMES.get(type(item))
        return (special, 2) if special is not None else (None, 0)
    return None, 0  # an operator (x ^ 2, which the rendered SQL may spell as a call: POWER(x, 2)), a constant


def _type_name(to: exp.DataType) -> str | None:
    """The catalog name of a cast's type (the last part of a qualified one)."""
    named = _TYPE_NAMES.get(to.this)
    if named is not None:
        return named
    if to.this == exp.DataType.Type.USERDEFINED:
        kind = to.args.get("kind")
        return str(kind).split(".")[-1].strip('"') if kind else None
    return to.this.value.lower() if isinstance(to.this, exp.DataType.Type) else None
