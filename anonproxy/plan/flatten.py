"""Inline derived tables and WITH queries that filter, project or rename their tables into one SELECT.

BI tools wrap the table they query: Power BI selects from
``(select "_"."education" from "public"."adult" "_") "rows"``, Superset's
virtual datasets from ``(SELECT * FROM public.adult) AS virtual_table``, and
hand-written SQL names a filtered table in a ``WITH`` query. Such a derived
table computes nothing per row that the outer query could not compute itself:
:func:`flatten` substitutes its select items into the outer query, moves its
FROM items (and joins) into the outer FROM clause and its WHERE into the outer
WHERE (into the JOIN's ON condition when the derived table is joined), so the
back-ends analyse one plain SELECT.

Inlined only: select items that are column references or row expressions (the
back-ends check them where they end up), renames (``AS``, column lists of the
alias), ``*`` and ``t.*``, WHERE, and joins; an ``OFFSET 0`` is dropped, as it
skips no row (Prisma reads the rows it aggregates in a derived table with
``OFFSET $1``, bound to 0 without a skip). A derived table with aggregates,
DISTINCT, GROUP BY or HAVING is left for :mod:`anonproxy.plan.outer`, and so
is every derived table above one that reads nothing else (:func:`over_released`:
Power BI's TOPN filters the aggregate's rows in a derived table of its own):
those post-process released rows, and so do set operations of aggregate
queries (:func:`released`, :mod:`anonproxy.plan.set_operations`), whose
branches are flattened each on its own. Over tables, a derived table with
ORDER BY, LIMIT, another OFFSET, window functions, other set operations and
every other clause is refused, and so is a WITH query unused or recursive. WITH
queries around a set operation are visible in its branches.

A WITH query read more than once (MetricFlow reads one in each of two
aggregate queries it joins) is a copy of its body at each read, as if the
client had written it there: each copy is then checked where it stands (two
reads inside one aggregate query are a self-join, which the joins' rules
decide). At most ``MAX_CTE_READS`` reads in all.

Names follow PostgreSQL: identifiers fold unless quoted; a WITH query shadows
a table of the same name in the statement that defines it (not in its own
body); the derived table's alias hides the names of the tables inside it, so
an inner table is renamed (``adult_1``) when the outer query already uses its
name. ``*`` is expanded lazily, because the policy does not list every column
of a table: a column the outer query names through ``*`` becomes a column of
the derived table's one table; an outer ``*`` over it stays a ``*`` (and the
back-ends refuse it as row-level). An unqualified name in an outer query that
reads several tables must be qualified when it could belong to a derived
table, since only PostgreSQL knows every table's columns.
"""

from __future__ import annotations

from collections import Counter

from sqlglot import exp

from anonproxy.plan.names import output_name, own_nodes, reference, sources
from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.set_operations import selects
from anonproxy.plan.spines import is_spine
from anonproxy.plan.tables import identifier

HINT = ("A derived table or WITH query over protected tables may select columns and row expressions, rename them, "
        "filter with WHERE and join linked tables: SELECT ... FROM (SELECT a, b AS c FROM t WHERE ...) AS d "
        "GROUP BY ...; an aggregate query may be nested as the one FROM item of the derived tables above it, which "
        "then read only its released rows.")
QUALIFY_HINT = "Qualify the column with the alias of its table or derived table (alias.column)."
# Each read of a WITH query is a copy of its body (a WITH query that reads another twice doubles it): a bound.
MAX_CTE_READS = 16
SAMPLE_MESSAGE = ("TABLESAMPLE applies to tables only, not to a derived table or WITH query (PostgreSQL refuses it "
                  "there too)")

# The clauses of a derived table that can be inlined, and why the others cannot.
_INLINED = frozenset({"expressions", "from_", "joins", "where"})
_AGGREGATING = frozenset({"group", "having", "distinct"})
_REASONS = {
    "order": "ORDER BY", "limit": "LIMIT", "offset": "OFFSET",
    "windows": "WINDOW", "qualify": "QUALIFY", "laterals": "LATERAL", "locks": "FOR UPDATE/SHARE",
    "into": "SELECT INTO", "sample": "TABLESAMPLE", "with_": "WITH",
}

_INTEGERS = (exp.DataType.Type.SMALLINT, exp.DataType.Type.INT, exp.DataType.Type.BIGINT)


def is_aggregate(select: exp.Select) -> bool:
    """Whether ``select`` groups rows: GROUP BY, HAVING, DISTINCT, or an aggregate in its select list."""
    if any(select.args.get(key) for key in _AGGREGATING):
        return True
    return any(isinstance(node, (exp.AggFunc, exp.WithinGroup)) for node in own_nodes(select)
               if not isinstance(node, exp.Window) and _outside_window(node, select))


def over_released(select: exp.Select) -> bool:
    """Whether ``select`` reads nothing but the rows of aggregate queries: each FROM and JOIN item is an aggregate
    derived table, or a derived table that is itself over released rows (Power BI's TOPN nests a filter between
    the aggregate and the outer query; MetricFlow joins two aggregate queries' rows), or a constant relation beside
    them (a time spine, :mod:`anonproxy.plan.spines`)."""
    read = [isinstance(item, exp.Subquery) and released(item.this) for item in sources(select)]
    return any(read) and all(found or is_spine(item) for found, item in zip(read, sources(select), strict=True))


def released(body: exp.Expression) -> bool:
    """Whether ``body`` (a derived table's, or a statement) gives released rows only: an aggregate query, a query
    over released rows, or a set operation of those (:mod:`anonproxy.plan.set_operations`)."""
    if isinstance(body, exp.SetOperation):
        return all(released(branch) for branch in selects(body))
    return isinstance(body, exp.Select) and (is_aggregate(body) or over_released(body))


def inline_ctes(tree: exp.Expression) -> bool:
    """Replace every reference to a WITH query by a derived table holding a copy of its body; whether any."""
    if not isinstance(tree, (exp.Select, exp.SetOperation)):
        if any(select.args.get("with_") for select in tree.find_all(exp.Select)) or tree.args.get("with_"):
            raise unsupported("WITH is supported over protected tables only around a SELECT or a set operation",
                              HINT)
        return False
    uses: Counter[int] = Counter()
    defined: list[exp.CTE] = []
    _inline_ctes(tree, {}, uses, defined)
    for cte in defined:
        if uses[id(cte)] == 0:
            raise unsupported(f"WITH query {identifier(cte.args['alias'].this)} is never used", HINT)
    return bool(defined)


def _inline_ctes(query: exp.Expression, visible: dict[str, exp.CTE], uses: Counter[int],
                 defined: list[exp.CTE]) -> None:
    if isinstance(query, exp.Subquery):
        _inline_ctes(query.this, visible, uses, defined)
        return
    if not isinstance(query, (exp.Select, exp.SetOperation)):
        return
    scope = dict(visible)
    with_ = query.args.get("with_")
    if with_ is not None:
        if with_.args.get("recursive"):
            raise unsupported("WITH RECURSIVE is not supported over protected tables", HINT)
        for cte in with_.expressions:
            alias = cte.args.get("alias")
            extra = {key for key, value in cte.args.items() if value not in (None, False, [], "")} - {"this", "alias"}
            if extra or not isinstance(alias, exp.TableAlias) or alias.this is None:
                raise unsupported("WITH ... AS [NOT] MATERIALIZED and other WITH options are not supported over "
                                  "protected tables", HINT)
            body = cte.this
            if not isinstance(body, (exp.Select, exp.SetOperation)):
                raise unsupported(f"WITH query {identifier(alias.this)} must be a SELECT or a set operation (no "
                                  "VALUES or data-modifying statement)", HINT)
            _inline_ctes(body, scope, uses, defined)  # earlier WITH queries are visible in later ones, not itself
            scope[identifier(alias.this) or ""] = cte
            defined.append(cte)
        query.set("with_", None)
    if isinstance(query, exp.SetOperation):  # the WITH queries of a set operation are visible in its branches
        _inline_ctes(query.this, scope, uses, defined)
        _inline_ctes(query.expression, scope, uses, defined)
        return
    select = query
    for item in sources(select):
        if isinstance(item, exp.Subquery) and isinstance(item.this, (exp.Select, exp.SetOperation)):
            _inline_ctes(item.this, scope, uses, defined)  # a set operation's branches read WITH queries too
            continue
        cte = _cte_of(item, scope)
        if cte is None:
            continue
        uses[id(cte)] += 1
        name = identifier(cte.args["alias"].this)
        if sum(uses.values()) > MAX_CTE_READS:
            raise unsupported(f"WITH queries are read more than {MAX_CTE_READS} times in all (WITH query {name} "
                              "among them): each read is a copy of its body", "Repeat fewer WITH queries.")
        alias = item.args.get("alias")
        columns = [column.copy() for column in cte.args["alias"].args.get("columns") or []]
        if alias is not None and alias.args.get("columns"):
            columns = [column.copy() for column in alias.args["columns"]]
        label = alias.this.copy() if alias is not None and alias.this is not None else exp.Identifier(
            this=name, quoted=True)
        body = cte.this.copy()
        item.replace(exp.Subquery(this=body, alias=exp.TableAlias(this=label, columns=columns or None),
                                  sample=item.args.get("sample")))  # kept, to be refused as on a derived table
    # Subqueries elsewhere (WHERE, select list) see the same WITH queries; the back-ends refuse them, but a name
    # there must never fall through to the table it shadows.
    for nested in _nested_selects(select):
        _inline_ctes(nested, scope, uses, defined)


def _nested_selects(select: exp.Select) -> list[exp.Select]:
    """The SELECTs directly nested in ``select`` outside its FROM and JOIN items and its WITH clause."""
    found: list[exp.Select] = []
    stack = [value for key, value in select.args.items() if key not in ("with_", "from_", "joins")]
    stack += [join.args.get("on") for join in select.args.get("joins") or []]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, exp.Select):
            found.append(value)
        elif isinstance(value, exp.Expression):
            stack.extend(value.args.values())
    return found


def _cte_of(item: exp.Expression, scope: dict[str, exp.CTE]) -> exp.CTE | None:
    if not isinstance(item, exp.Table) or item.args.get("db") is not None or not isinstance(item.this, exp.Identifier):
        return None
    return scope.get(identifier(item.this) or "")


def flatten(select: exp.Select, source: str) -> bool:
    """Inline the derived tables of ``select`` (and of its derived tables) that only filter, project or rename;
    whether any was. Derived tables that aggregate stay (see :mod:`anonproxy.plan.outer`).

    A select item the outer query does not read is dropped; a $n parameter only such an item holds is refused, as
    the statement would otherwise take fewer parameters than the client declares and binds."""
    before = _parameters(select)
    holders = _item_parameters(select, source)
    changed = _flatten(select, source)
    lost = sorted(before - _parameters(select))
    if lost:
        number = lost[0]
        raise unsupported(f"parameter ${number} is held only by select item {holders.get(number, '?column?')} of a "
                          "derived table, which the outer query does not read: anonproxy drops that item when it "
                          "inlines the derived table, and the parameter could not be bound",
                          "Remove the unused select item from the derived table, or use the parameter in its WHERE "
                          "or in a column the outer query reads.")
    return changed


def flatten_branches(operation: exp.SetOperation, source: str) -> bool:
    """:func:`flatten` each SELECT branch of a set operation; whether any changed."""
    changed = False
    for branch in selects(operation):
        if isinstance(branch, exp.Select):
            changed = flatten(branch, source) or changed
    return changed


def _parameters(node: exp.Expression) -> set[int]:
    """The numbers of the $n parameters ``node`` holds (its nested queries included)."""
    return {int(found.this.name) for found in node.find_all(exp.Parameter)
            if isinstance(found.this, exp.Literal) and found.this.name.isdigit()}


def _item_parameters(select: exp.Select, source: str) -> dict[int, str]:
    """The name of the first derived-table select item that holds each $n parameter."""
    found: dict[int, str] = {}
    for subquery in select.find_all(exp.Subquery):
        if isinstance(subquery.this, exp.Select):
            for item in subquery.this.expressions:
                name = output_name(item, source) or "?column?"
                for number in _parameters(item):
                    found.setdefault(number, name)
    return found


def _flatten(select: exp.Select, source: str) -> bool:
    changed = False
    if any(isinstance(item, exp.Subquery) for item in sources(select)):
        _check_qualifiers(select)
    position = 0
    while position < len(sources(select)):
        item = sources(select)[position]
        if isinstance(item, exp.Subquery) and not is_spine(item):  # a spine stays, for anonproxy.plan.outer
            body = item.this
            if isinstance(body, exp.SetOperation):
                changed = flatten_branches(body, source) or changed
            if not isinstance(body, exp.Select):
                if released(body):
                    position += 1
                    continue  # a set operation of aggregate queries: left for anonproxy.plan.outer
                raise unsupported("UNION, INTERSECT, EXCEPT and VALUES are not supported as derived tables over "
                                  "protected tables, except a set operation of aggregate queries", HINT)
            changed = _flatten(body, source) or changed
            if not is_aggregate(body) and not over_released(body):
                _inline(select, position, item, body, source)
                changed = True
                continue  # the inlined table now stands at this position
        position += 1
    return changed


def _check_qualifiers(select: exp.Select) -> None:
    """Every qualified column names a FROM item of its own SELECT (the names inside a derived table are hidden
    from the outer query: once inlined, they must not become visible to it)."""
    visible = {reference(item) for item in sources(select)}
    for node in own_nodes(select):
        if isinstance(node, exp.Column) and node.args.get("table") is not None \
                and (node.args.get("db") is not None or identifier(node.args["table"]) not in visible):
            raise unsupported(f"column reference {node.sql(dialect='postgres')} names no table of the FROM clause "
                              "(the tables inside a derived table are known only by the derived table's alias)",
                              QUALIFY_HINT)


def _inline(outer: exp.Select, position: int, item: exp.Subquery, body: exp.Select, source: str) -> None:
    offset = body.args.get("offset")
    if offset is not None and is_zero(offset.expression):
        body.set("offset", None)  # skips no row
    _check_inlinable(item, body)
    inner = sources(body)
    if position > 0 and (len(inner) != 1 or body.args.get("joins")):
        raise unsupported("a joined derived table over protected tables must read one table", HINT)
    alias = reference(item)
    _qualify(body, inner)
    taken = {reference(other) for index, other in enumerate(sources(outer)) if index != position}
    _rename_inner(body, inner, taken)
    outputs, star = _outputs(item, body, source)
    others = [other for index, other in enumerate(sources(outer)) if index != position]
    # Who else an unqualified name may belong to: a table (any name: only PostgreSQL knows its columns), or an
    # aggregate query left nested (the names of its select items).
    rivals: set[str] | None = set()
    for other in others:
        if isinstance(other, exp.Subquery) and isinstance(other.this, exp.Select) and rivals is not None:
            rivals |= {output_name(expression, source) or "?column?" for expression in other.this.expressions}
        else:
            rivals = None
    names = [output_name(item, source) for item in outer.expressions]
    _substitute(outer, alias, outputs, star, rivals, output_names=set(names) - {None})
    _pass_through_subqueries(outer, alias, outputs, star)
    _keep_names(outer, names, source)
    condition = body.args.get("where")
    if position == 0:
        outer.set("from_", body.args["from_"])
        outer.set("joins", [*(body.args.get("joins") or []), *(outer.args.get("joins") or [])] or None)
        if condition is not None:
            where = outer.args.get("where")
            merged = condition.this if where is None else exp.and_(exp.paren(condition.this, copy=False),
                                                                   exp.paren(where.this, copy=False), copy=False)
            outer.set("where", exp.Where(this=merged))
    else:
        join = outer.args["joins"][position - 1]
        join.set("this", inner[0])
        if condition is not None:
            on = join.args.get("on")
            if on is None:
                raise unsupported("a derived table with WHERE must be joined with ON", HINT)
            join.set("on", exp.and_(exp.paren(on, copy=False), exp.paren(condition.this, copy=False), copy=False))


def is_zero(node: exp.Expression) -> bool:
    """Whether ``node`` is the constant 0 as PostgreSQL reads an OFFSET or a LIMIT: ``0``, ``'0'`` (a bound value
    written as a constant), either cast to an integer type."""
    if isinstance(node, exp.Cast) and node.to.this in _INTEGERS and not node.to.expressions:
        node = node.this
    if not isinstance(node, exp.Literal):
        return False
    # PostgreSQL's integer input skips ASCII white space only and reads ASCII digits only (Python's isdigit()
    # also takes '\u0660', and int() fails on '\u00b2')
    digits = node.name.strip(" \t\n\r\v\f")
    return digits.isascii() and digits.isdigit() and int(digits) == 0


def _keep_names(select: exp.Select, names: list[str | None], source: str) -> None:
    """Alias the select items whose name the substitution changed with the name they had (``metric_time__day``
    stays the name of the column that read it, now ``DATE_TRUNC('day', t.visited_at) AS metric_time__day``): an
    outer query may read it by that name."""
    for item, name in zip(list(select.expressions), names, strict=True):
        if name is not None and not isinstance(item, exp.Alias) and output_name(item, source) != name:
            item.replace(exp.Alias(this=item.copy(), alias=exp.Identifier(this=name, quoted=True)))


def _check_inlinable(item: exp.Subquery, body: exp.Select) -> None:
    extra = {key for key, value in item.args.items() if value not in (None, False, [], "")} - {"this", "alias"}
    if "sample" in extra:
        raise unsupported(SAMPLE_MESSAGE, HINT)
    if extra:
        raise unsupported(f"{', '.join(sorted(extra)).upper()} on a derived table is not supported over protected "
                          "tables", HINT)
    for key, value in body.args.items():
        if value in (None, False, [], "") or key in _INLINED:
            continue
        what = _REASONS.get(key, key.upper())
        refusal = forbidden if key in ("into", "sample") else unsupported
        raise refusal(f"{what} inside a derived table is not supported over protected tables: only column "
                      "selections, renames, WHERE, joins and OFFSET 0 are inlined", HINT)
    if body.args.get("from_") is None:
        raise unsupported("a derived table or WITH query over protected tables needs a FROM clause", HINT)
    for node in own_nodes(body):
        if isinstance(node, exp.Window):
            raise unsupported("window functions inside a derived table are not supported over protected tables",
                              HINT)
    for source in sources(body):
        if not isinstance(source, exp.Table):
            raise unsupported("an aggregate query nested in FROM must be the only FROM item of the derived table "
                              "that reads it (no join), and other table expressions are not supported", HINT)


def _qualify(body: exp.Select, inner: list[exp.Expression]) -> None:
    """Qualify the derived table's unqualified columns with its one table (they must not be captured outside)."""
    for node in list(own_nodes(body)):
        if isinstance(node, exp.Column) and node.args.get("table") is None and isinstance(node.this, exp.Identifier):
            if len(inner) != 1:
                raise unsupported(f"column {identifier(node.this)} inside a derived table that joins tables must be "
                                  "qualified", QUALIFY_HINT)
            node.set("table", exp.Identifier(this=reference(inner[0]), quoted=True))


def _rename_inner(body: exp.Select, inner: list[exp.Expression], taken: set[str | None]) -> None:
    """Give the derived table's tables names the outer query does not use already."""
    own = {reference(table) for table in inner}
    for table in inner:
        old = reference(table)
        if old not in taken:
            continue
        number = 1
        while f"{old}_{number}" in taken or f"{old}_{number}" in own:
            number += 1
        new = f"{old}_{number}"
        own.add(new)
        table.set("alias", exp.TableAlias(this=exp.Identifier(this=new, quoted=True)))
        for node in own_nodes(body):
            if isinstance(node, exp.Column) and identifier(node.args.get("table")) == old \
                    and node.args.get("db") is None:
                node.set("table", exp.Identifier(this=new, quoted=True))


def _outputs(item: exp.Subquery, body: exp.Select, source: str,
             ) -> tuple[dict[str, exp.Expression | None], str | None]:
    """The derived table's columns by name (None: the name is ambiguous), and the table its ``*`` reads."""
    outputs: dict[str, exp.Expression | None] = {}
    named: list[tuple[str | None, exp.Expression]] = []
    star = None
    for expression in body.expressions:
        core = expression.this if isinstance(expression, exp.Alias) else expression
        if isinstance(core, exp.Star) or (isinstance(core, exp.Column) and isinstance(core.this, exp.Star)):
            tables = sources(body)
            qualifier = identifier(core.args.get("table")) if isinstance(core, exp.Column) else None
            if qualifier is None and len(tables) != 1:
                raise unsupported("SELECT * in a derived table that joins tables is not supported over protected "
                                  "tables", "Name the columns the outer query uses.")
            if star is not None:
                raise unsupported("a derived table may hold one * over protected tables", HINT)
            if qualifier is not None and qualifier not in {reference(table) for table in tables}:
                raise unsupported(f"{qualifier}.* names no table of the derived table's FROM clause", QUALIFY_HINT)
            star = qualifier or reference(tables[0])
            continue
        if isinstance(expression, exp.Alias):
            named.append((identifier(expression.args.get("alias")), expression.this))
        elif isinstance(expression, exp.Column):
            named.append((identifier(expression.this), expression))
        else:  # PostgreSQL names it after its function (upper(x) is "upper"), or ?column?, not referable
            named.append((output_name(expression, source), expression))
    alias = item.args.get("alias")
    columns = alias.args.get("columns") if alias is not None else None
    if columns:
        if star is not None or len(columns) > len(named):
            raise unsupported("a derived table's column list must name its select items, without *", HINT)
        named = [(identifier(column), expression) for column, (_, expression) in zip(columns, named, strict=False)] \
            + named[len(columns):]
    for name, expression in named:
        if name is None:
            continue
        outputs[name] = None if name in outputs else expression
    return outputs, star


def _substitute(outer: exp.Select, alias: str | None, outputs: dict[str, exp.Expression | None], star: str | None,
                rivals: set[str] | None, output_names: set[str | None]) -> None:
    """Replace the outer query's references to the derived table by the expressions they name. ``rivals``: the
    names the outer query's other FROM items have (None: unknown, one is a table); ``output_names``: the outer
    query's column names, which a bare name in its ORDER BY means first."""
    for node in list(own_nodes(outer)):
        if not isinstance(node, exp.Column) or not isinstance(node.this, exp.Identifier):
            continue
        table = identifier(node.args.get("table"))
        name = identifier(node.this) or ""
        if node.args.get("db") is not None or (table is not None and table != alias):
            continue
        if table is None:
            clause = _clause(node, outer)
            if clause == "order" and name in output_names:
                continue  # ORDER BY a bare name means the output column first
            # A name an aggregate query next to it gives one of its columns is that column, unless this derived
            # table names one so too (a * is assumed not to: Superset's series limit names its keys k__).
            if (rivals is None and (name in outputs or star is not None)) or (rivals and name in rivals
                                                                                and name in outputs):
                raise unsupported(f"column {name} is ambiguous next to a derived table", QUALIFY_HINT)
            if rivals is None or name in rivals:
                continue
            if clause == "group" and name not in outputs and name in output_names \
                    and not _bare_column(outer, name):
                if star is None:
                    continue  # GROUP BY an output alias
                raise unsupported(f"GROUP BY {name} is ambiguous: it is an output alias, and maybe a column of the "
                                  "derived table's *", "Group by the expression itself or by its position.")
        if name in outputs:
            expression = outputs[name]
            if expression is None:
                raise unsupported(f"column {name} of derived table {alias} is ambiguous: it names two select items",
                                  "Give each select item of the derived table its own name.")
            replacement = expression.copy()
        elif star is not None:
            replacement = exp.Column(this=exp.Identifier(this=name, quoted=True),
                                     table=exp.Identifier(this=star, quoted=True))
        else:
            shown = f"{alias}.{name}" if alias else name
            raise unsupported(f"column {shown} does not exist in the derived table", QUALIFY_HINT)
        if not isinstance(replacement, (exp.Column, exp.Literal, exp.Paren, exp.Func)):
            replacement = exp.paren(replacement, copy=False)
        node.replace(replacement)


def _pass_through_subqueries(outer: exp.Select, alias: str | None, outputs: dict[str, exp.Expression | None],
                             star: str | None) -> None:
    """Replace ``alias.<name>`` in the subqueries of the outer WHERE (semi-joins on the privacy unit,
    :mod:`anonproxy.plan.semi_joins`) where the derived table passes a column through under its own name
    (``SELECT * FROM adult a``, ``SELECT id, sex FROM adult``): Django and SQLAlchemy tie a semi-join to the
    unit column of a wrapped queryset so. A renamed or computed column (``age AS id``) stays a name of no table,
    which the semi-join check refuses; so does one whose table the subquery's own FROM item would shadow."""
    where = outer.args.get("where")
    stack: list[exp.Expression] = [where] if where is not None and alias is not None else []
    while stack:
        node = stack.pop()
        if not isinstance(node, exp.Select):
            stack.extend(node.iter_expressions())
            continue
        shadowed = {reference(item) for item in sources(node)}
        if alias in shadowed:
            continue
        for column in list(own_nodes(node)):
            if not isinstance(column, exp.Column) or identifier(column.args.get("table")) != alias \
                    or column.args.get("db") is not None or not isinstance(column.this, exp.Identifier):
                continue
            name = identifier(column.this) or ""
            if name in outputs:
                passed = outputs[name]
            elif star is not None:
                passed = exp.column(name, star, quoted=True)
            else:
                continue
            if isinstance(passed, exp.Column) and identifier(passed.this) == name \
                    and identifier(passed.args.get("table")) not in shadowed:
                column.replace(passed.copy())


def _bare_column(select: exp.Select, name: str) -> bool:
    """Whether output column ``name`` of ``select`` is the unqualified column of that name."""
    for expression in select.expressions:
        alias = identifier(expression.args.get("alias")) if isinstance(expression, exp.Alias) else None
        core = expression.this if isinstance(expression, exp.Alias) else expression
        own = identifier(core.this) if isinstance(core, exp.Column) and isinstance(core.this, exp.Identifier) else None
        if (alias or own) == name:
            return own == name and core.args.get("table") is None
    return False


def _clause(node: exp.Expr, select: exp.Select) -> str | None:
    """The clause of ``select`` that holds ``node`` ("group", "order", "where", ...)."""
    while node.parent is not None and node.parent is not select:
        node = node.parent
    return node.arg_key


def _outside_window(node: exp.Expression, select: exp.Select) -> bool:
    """An aggregate used as a window function (sum(x) OVER ()) does not group rows."""
    parent = node.parent
    while parent is not None and parent is not select:
        if isinstance(parent, exp.Window):
            return False
        parent = parent.parent
    return True

