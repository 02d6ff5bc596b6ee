"""Semi-joins on the privacy unit: WHERE filters that keep or drop each person whole.

Django writes a filter on a reverse relation as ``EXISTS (SELECT 1 AS "a" FROM "visits" U1 WHERE
(U1."channel" = 'web' AND U1."person_id" = ("adult"."id")) LIMIT 1)`` or ``"adult"."id" IN (SELECT
U0."person_id" FROM "visits" U0 WHERE ...)`` (Django 5: ``U0."person_id" AS "person_id"``). Such a condition
asks, of each person of the outer query, whether some row of that same person's (in a protected or linked table of
the same privacy unit) passes the inner conditions: the person is in or out, with all of their outer rows, never
repeated. It is a filter on the person's own data, like any WHERE condition, and the back-ends count, suppress and
charge the outer query as before.

Admitted as a top-level AND conjunct of the outer WHERE, in the forms ``EXISTS (...)``, ``NOT EXISTS (...)`` and
``<outer unit column> IN (SELECT <inner unit column> [AS name] ...)``, when the subquery reads one protected or
linked table of the outer query's privacy unit, without joins, grouping, aggregates or nested subqueries, ties
itself to the outer query only by ``<inner unit column> = <outer unit column>`` (EXISTS) or by the IN, and its other
conditions pass the checks of a WHERE condition over its own table (the allowlist and the no-error proof). An
EXISTS subquery may end in ORDER BY (which changes nothing, its expressions checked as the conditions are) and a
positive LIMIT; IN (SELECT ... LIMIT n) is refused (:data:`LIMIT_MESSAGE`). ``NOT IN`` is refused (a NULL among
the inner values makes it NULL for everyone), except over a reference table: ``<expression> [NOT] IN (SELECT
<column> FROM <reference table> ...)`` tests each row against a list of public values, answered as PostgreSQL
answers it (:func:`_check_reference_list`), and so is its correlated form ``[NOT] EXISTS (SELECT 1 FROM
<reference table> r WHERE r.<column> = <outer expression> AND ...)`` (:func:`_check_reference_exists`); anything
else with a subquery stays refused by the analysis. The
outer column may be a derived table's column that passes the unit column through under its own name
(:mod:`anonproxy.plan.flatten` substitutes it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlglot import exp

from anonproxy.plan.expressions import unparen
from anonproxy.plan.joins import Source, base_type, conjuncts
from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.render import sql
from anonproxy.plan.tables import PolicyIndex, ResolvedTable, identifier

REFERENCE_HINT = ("A subquery in WHERE may read a reference table: <column> [NOT] IN (SELECT <column> FROM "
                  "<reference table> WHERE <conditions on its columns>), or [NOT] EXISTS (SELECT 1 FROM <reference "
                  "table> r WHERE r.<column> = <table>.<column> [AND <conditions on its columns>]), the outer column "
                  "qualified and not identifying.")
HINT = ("A subquery in WHERE over protected tables may be a semi-join on the privacy unit: EXISTS (SELECT 1 FROM "
        "<linked> v WHERE v.<key> = <protected>.<unit> AND <conditions on v>), NOT EXISTS (...) or <protected>.<unit> "
        "IN (SELECT <key> FROM <linked> WHERE <conditions>), its columns qualified or its own.")

# IN (SELECT ... LIMIT n) keeps the people of n rows, chosen by the order of other people's rows (the order
# PostgreSQL reads them in): LIMIT 11 and LIMIT 10 differ by one person at most, whom two answers would give away.
LIMIT_MESSAGE = ("LIMIT is not allowed in IN (SELECT ...) over protected tables: it keeps the people of the first "
                 "rows only, which other people's rows decide (LIMIT n and LIMIT n + 1 differ by one person at most)")
LIMIT_HINT = ("Drop the LIMIT: IN (SELECT <key> FROM <linked> WHERE <conditions>) keeps every person with a "
              "matching row; EXISTS (SELECT 1 ... LIMIT 1) asks the same of each person.")


@dataclass(frozen=True)
class OuterChecks:
    """The outer query's checks: ``row(expression, clause)`` refuses what that clause may not hold,
    ``is_identifier(table, column)`` tells an identifying column (table None: a bare name)."""

    row: Callable[[exp.Expression, str], None]
    is_identifier: Callable[[str | None, str], bool]


@dataclass(frozen=True)
class SemiJoin:
    """One admitted conjunct: the node (as in the WHERE clause) and the subquery it reads."""

    node: exp.Expression
    select: exp.Select
    exists: bool  # EXISTS / NOT EXISTS (else IN)
    negated: bool = False  # NOT IN (answered over a reference table only)


@contextmanager
def set_aside(tree: exp.Select) -> Iterator[list[SemiJoin]]:
    """Take the semi-join conjuncts out of ``tree``'s WHERE clause for the analysis of the rest, and put the clause
    back as it was afterwards (the tree is the statement's, which other passes read again)."""
    where = tree.args.get("where")
    if where is None:
        yield []
        return
    found, rest = [], []
    for conjunct in conjuncts(where.this):
        semi = _semi_join(conjunct)
        if semi is None:
            rest.append(conjunct)
        else:
            found.append(semi)
    if not found:
        yield []
        return
    tree.set("where", exp.Where(this=exp.and_(*(c.copy() for c in rest))) if rest else None)
    try:
        yield found
    finally:
        tree.set("where", where)


def check(semi: SemiJoin, sources: list[Source], owner: str, index: PolicyIndex,
          row_check: Callable[[ResolvedTable, str, exp.Expression, str], None], outer: OuterChecks) -> None:
    """Refuse ``semi`` unless it is a semi-join on the privacy unit of protected table ``owner`` (the outer query's)
    or a test of a list of a reference table's values (:func:`_check_reference_list`); ``row_check(table,
    reference, expression, clause)`` checks an inner expression as a row-level expression of that clause over that
    table."""
    select = semi.select
    if semi.exists and _reads_reference(select, index):
        _check_reference_exists(semi, sources, index, row_check, outer)
        return
    if _reads_reference(select, index):
        _check_reference_list(semi, sources, index, row_check, outer)
        return
    if semi.negated:
        raise unsupported("NOT IN (SELECT ...) is not allowed over protected tables: a NULL among the values makes "
                          "it NULL for every row", "Write NOT EXISTS (SELECT 1 FROM ... WHERE <key> = <unit> AND "
                          "...) instead.")
    allowed = {"expressions", "from_", "where"} | ({"limit", "order"} if semi.exists else {"distinct"})
    extra = {key for key, value in select.args.items() if value not in (None, False, [], "")} - allowed
    if "limit" in extra:
        raise unsupported(LIMIT_MESSAGE, LIMIT_HINT)
    if extra or isinstance(select.args.get("distinct"), exp.Distinct) and select.args["distinct"].args.get("on"):
        raise unsupported(f"{', '.join(sorted(extra)).upper() or 'DISTINCT ON'} is not allowed in a semi-join "
                          "subquery over protected tables", HINT)
    if semi.exists and select.args.get("limit") is not None and not _positive(select.args["limit"]):
        raise unsupported("LIMIT in an EXISTS subquery over protected tables takes a positive constant", HINT)
    if any(node is not select and isinstance(node, (exp.Select, exp.Subquery, exp.Exists, exp.Lateral))
           for node in select.walk()):
        raise unsupported("a semi-join subquery over protected tables may not nest another query", HINT)
    table, reference = _inner_table(select, owner, index)
    unit = _unit_column(table)
    conditions = conjuncts(select.args["where"].this) if select.args.get("where") is not None else []
    if semi.exists:
        links = [c for c in conditions if _correlation(c, reference, unit, sources, owner, index)]
        if len(links) != 1:
            raise unsupported(f"an EXISTS subquery over protected tables must tie {reference}.{unit} to the outer "
                              "query's privacy unit with one equality, and nothing else of the outer query", HINT)
        conditions = [c for c in conditions if c is not links[0]]
        if not all(_constant_item(item) for item in select.expressions):
            raise unsupported("the select list of an EXISTS subquery over protected tables holds constants only",
                              HINT)
    else:
        if _outer_unit(_test(semi).this, sources, owner, index) is None:
            raise unsupported("IN (SELECT ...) over protected tables must test the outer query's privacy unit "
                              "column", HINT)
        items = select.expressions
        # IN compares values: a name given to the selected column changes nothing (Django 5 writes
        # U0."person_id" AS "person_id")
        if len(items) != 1 or not _is_inner_unit(_unaliased(items[0]), reference, unit):
            raise unsupported(f"the subquery of IN must select the privacy unit column {unit} of its table", HINT)
    for condition in conditions:
        _own_columns(condition, reference, table)
        row_check(table, reference, condition, "WHERE")
    # EXISTS ignores the order of its rows, but PostgreSQL may still evaluate the expressions: they must not fail
    for ordered in select.args["order"].expressions if select.args.get("order") is not None else []:
        _own_columns(ordered.this, reference, table)
        row_check(table, reference, ordered.this, "ORDER BY")


def _reads_reference(select: exp.Select, index: PolicyIndex) -> bool:
    """Whether ``select``'s one FROM item is a reference table of the policy."""
    from_ = select.args.get("from_")
    node = from_.this if from_ is not None else None
    return isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier) \
        and index.resolve(node).kind == "reference"


def _check_reference_list(semi: SemiJoin, sources: list[Source], index: PolicyIndex,
                          row_check: Callable[[ResolvedTable, str, exp.Expression, str], None],
                          outer: OuterChecks) -> None:
    """``<outer expression> [NOT] IN (SELECT <column> FROM <reference table> [WHERE ...])``: the subquery reads only
    a table of public values, so the condition is a test of each row's own value against a list that holds no
    one's data, as ``IN ('a', 'b')`` is (the outer expression checked as such a test is); PostgreSQL answers it,
    NULLs and NOT IN included. An identifying column tested so is refused, as a reference table joined on one is
    (a list of ids picks people out). The subquery: one column of its table, DISTINCT, WHERE conditions over its
    own columns checked as a reference table's row expressions, no other clause."""
    select = semi.select
    extra = {key for key, value in select.args.items() if value not in (None, False, [], "")} \
        - {"expressions", "from_", "where", "distinct"}
    if extra or isinstance(select.args.get("distinct"), exp.Distinct) and select.args["distinct"].args.get("on"):
        raise unsupported(f"{', '.join(sorted(extra)).upper() or 'DISTINCT ON'} is not allowed in IN (SELECT ... "
                          "FROM <reference table>) over protected tables", REFERENCE_HINT)
    if any(node is not select and isinstance(node, (exp.Select, exp.Subquery, exp.Exists, exp.Lateral))
           for node in select.walk()):
        raise unsupported("IN (SELECT ... FROM <reference table>) over protected tables may not nest another query",
                          REFERENCE_HINT)
    table, reference = _reference_source(select, index)
    items = select.expressions
    core = items[0].this if len(items) == 1 and isinstance(items[0], exp.Alias) else (items or [None])[0]
    if len(items) != 1 or not isinstance(core, exp.Column) or not isinstance(core.this, exp.Identifier):
        raise unsupported("the subquery of IN over a reference table must select one of its columns",
                          REFERENCE_HINT)
    _own_columns(core, reference, table, REFERENCE_HINT)
    where = select.args.get("where")
    for condition in conjuncts(where.this) if where is not None else []:
        _own_columns(condition, reference, table, REFERENCE_HINT)
        row_check(table, reference, condition, "WHERE")
    _check_tested(_test(semi).this, table, identifier(core.this) or "", sources, outer)


def _check_tested(tested: exp.Expression, table: ResolvedTable, column: str, sources: list[Source],
                  outer: OuterChecks) -> None:
    """The outer expression tested against a reference table's ``column``: checked as the outer query's test of a
    list of constants is; an identifying column in it refused (a list of its values picks people out, as a
    reference table joined on one would). Unless the reference column is a string, the tested expression is a
    column of the same type: a comparison that converts one side can fail on a value (a numeric too large for a
    double precision), and the error would tell whether some row reached it."""
    for found in tested.find_all(exp.Column):
        if isinstance(found.this, exp.Identifier) \
                and outer.is_identifier(identifier(found.args.get("table")), identifier(found.this) or ""):
            raise forbidden(f"identifying column {sql(found)} cannot be tested against reference table "
                            f"{table.policy_name}: a list of its values picks people out", REFERENCE_HINT)
    outer.row(exp.In(this=tested.copy(), expressions=[exp.Literal.string("")]), "WHERE")
    wanted = base_type(table, column)
    if wanted is not None and wanted not in _STRINGS and _type_of(tested, sources) != wanted:
        raise unsupported(f"{sql(tested)} is compared with {table.policy_name}.{column} ({wanted}), whose type it "
                          "may not have: a comparison that converts one side can fail on a value", REFERENCE_HINT)


# Reference column types any tested expression may be compared with: a conversion to a string cannot fail, and a
# type without such a comparison is refused by PostgreSQL when it plans the statement, whatever the data.
_STRINGS = frozenset({"text", "character varying", "character", "name"})


def _type_of(node: exp.Expression, sources: list[Source]) -> str | None:
    """The type of ``node`` when it is a column of one of ``sources`` whose type was read with the policy."""
    node = unparen(node)
    if not isinstance(node, exp.Column) or not isinstance(node.this, exp.Identifier):
        return None
    qualifier, name = identifier(node.args.get("table")), identifier(node.this) or ""
    types = {base_type(source.table, name) for source in sources if qualifier in (None, source.reference)}
    types.discard(None)
    return types.pop() if len(types) == 1 else None


def _check_reference_exists(semi: SemiJoin, sources: list[Source], index: PolicyIndex,
                            row_check: Callable[[ResolvedTable, str, exp.Expression, str], None],
                            outer: OuterChecks) -> None:
    """``[NOT] EXISTS (SELECT 1 FROM <reference table> r WHERE r.<column> = <outer expression> [AND ...])``: the
    correlated form of ``<outer expression> IN (SELECT r.<column> FROM <reference table> r WHERE ...)``, a test of
    each row's own values against public ones, answered as PostgreSQL answers it (EXISTS is never NULL). Each
    equality between a column of the reference table and an expression over the outer query's tables is checked
    as the IN form checks its test (:func:`_check_tested`); the other conditions are over the reference table's own
    columns and pass its row checks; the select list holds constants, ``*`` or its plain columns (a function there
    could still run); a positive LIMIT changes nothing; no other clause, no nested query."""
    select = semi.select
    extra = {key for key, value in select.args.items() if value not in (None, False, [], "")} \
        - {"expressions", "from_", "where", "limit"}
    if extra:
        raise unsupported(f"{', '.join(sorted(extra)).upper()} is not allowed in EXISTS (SELECT ... FROM <reference "
                          "table>) over protected tables", REFERENCE_HINT)
    if select.args.get("limit") is not None and not _positive(select.args["limit"]):
        raise unsupported("LIMIT in an EXISTS subquery over protected tables takes a positive constant",
                          REFERENCE_HINT)
    if any(node is not select and isinstance(node, (exp.Select, exp.Subquery, exp.Exists, exp.Lateral))
           for node in select.walk()):
        raise unsupported("EXISTS (SELECT ... FROM <reference table>) over protected tables may not nest another "
                          "query", REFERENCE_HINT)
    alias = select.args["from_"].this.args.get("alias")
    if alias is not None and alias.args.get("columns"):
        raise unsupported("column aliases on a reference table in EXISTS are not supported over protected tables",
                          REFERENCE_HINT)
    table, reference = _reference_source(select, index)
    for item in select.expressions:
        core = item.this if isinstance(item, exp.Alias) else item
        if not _constant_item(item) and not _is_own_column(core, reference, table):
            raise unsupported("the select list of an EXISTS subquery over a reference table holds constants or its "
                              "columns", REFERENCE_HINT)
    where = select.args.get("where")
    tested = []
    for condition in conjuncts(where.this) if where is not None else []:
        found = _reference_correlation(condition, reference, table, sources)
        if found is not None:
            tested.append(found)
            continue
        _own_columns(condition, reference, table, REFERENCE_HINT)
        row_check(table, reference, condition, "WHERE")
    if not tested:
        raise unsupported(f"an EXISTS subquery over reference table {table.policy_name} must tie one of its columns "
                          "to the outer query with an equality (<reference>.<column> = <outer table>.<column>)",
                          REFERENCE_HINT)
    for column, expression in tested:
        _check_tested(expression, table, column, sources, outer)


def _reference_source(select: exp.Select, index: PolicyIndex) -> tuple[ResolvedTable, str]:
    """The reference table ``select`` reads and the name its columns use for it."""
    node = select.args["from_"].this
    table = index.resolve(node)
    alias = node.args.get("alias")
    return table, (identifier(alias.this) if alias is not None else None) or table.name


def _reference_correlation(condition: exp.Expression, reference: str, table: ResolvedTable,
                           sources: list[Source]) -> tuple[str, exp.Expression] | None:
    """The reference column and the outer expression when ``condition`` is ``<reference column> = <expression over
    the outer query's tables>`` (either way round): every column of that expression qualified with the name of a
    FROM item of the outer query that is not the reference table's own name inside the subquery (a bare name, or
    that name, is the reference table's when it has such a column)."""
    node = unparen(condition)
    if not isinstance(node, exp.EQ):
        return None
    outer = {source.reference for source in sources} - {reference}
    sides = [unparen(node.this), unparen(node.expression)]
    for mine, other in (sides, sides[::-1]):
        columns = list(other.find_all(exp.Column))
        if _is_own_column(mine, reference, table) and columns \
                and all(column.args.get("db") is None and identifier(column.args.get("table")) in outer
                        for column in columns):
            return identifier(mine.this) or "", other
    return None


def _is_own_column(node: exp.Expression, reference: str, table: ResolvedTable) -> bool:
    """Whether ``node`` is a plain column of the subquery's table: qualified with its name, or bare and known."""
    if not isinstance(node, exp.Column) or not isinstance(node.this, exp.Identifier) or node.args.get("db"):
        return False
    qualifier = identifier(node.args.get("table"))
    known = _known_columns(table)
    return qualifier == reference or (qualifier is None and known is not None and identifier(node.this) in known)


def _test(semi: SemiJoin) -> exp.In:
    """The IN node of an IN or NOT IN semi-join."""
    node = unparen(semi.node.this) if semi.negated else semi.node
    assert isinstance(node, exp.In)
    return node


def render(semi: SemiJoin, index: PolicyIndex) -> str:
    """The conjunct as SQL, its table schema-qualified (as the analysis renders the FROM clause)."""
    node = semi.node.copy()
    inner = node.find(exp.Select)
    assert inner is not None
    table = inner.args["from_"].this
    resolved = index.resolve(table)
    table.set("this", exp.Identifier(this=resolved.name, quoted=True))
    table.set("db", exp.Identifier(this=resolved.schema, quoted=True))
    return sql(node)


def _semi_join(node: exp.Expression) -> SemiJoin | None:
    """``node`` as a semi-join conjunct by its form (checked later), or None."""
    node = unparen(node)
    negated = isinstance(node, exp.Not)
    inner = unparen(node.this) if negated else node
    if isinstance(inner, exp.Exists) and isinstance(inner.this, exp.Select):
        return SemiJoin(node, inner.this, exists=True)
    if isinstance(inner, exp.In) and isinstance(inner.args.get("query"), exp.Subquery) \
            and isinstance(inner.args["query"].this, exp.Select):
        return SemiJoin(node, inner.args["query"].this, exists=False, negated=negated)
    return None


def _inner_table(select: exp.Select, owner: str, index: PolicyIndex) -> tuple[ResolvedTable, str]:
    from_ = select.args.get("from_")
    node = from_.this if from_ is not None else None
    if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier) \
            or {key for key, value in node.args.items() if value} - {"this", "db", "alias"} \
            or (node.args.get("alias") is not None and node.args["alias"].args.get("columns")):
        raise unsupported("a semi-join subquery over protected tables reads one table", HINT)
    table = index.resolve(node)
    if _owner(table, index) != owner:
        raise unsupported(f"a semi-join subquery may read only protected table {owner} or its linked tables", HINT)
    alias = node.args.get("alias")
    return table, (identifier(alias.this) if alias is not None else None) or table.name


def _owner(table: ResolvedTable, index: PolicyIndex) -> str | None:
    """The policy name of the protected table whose privacy unit ``table`` carries."""
    if table.protected is not None:
        return table.policy_name
    if table.linked is not None:
        return index.lookup(table.linked.references).policy_name
    return None


def _unit_column(table: ResolvedTable) -> str:
    if table.protected is not None:
        return table.protected.unit_column
    assert table.linked is not None
    return table.linked.column


def _correlation(condition: exp.Expression, reference: str, unit: str, sources: list[Source], owner: str,
                 index: PolicyIndex) -> bool:
    """Whether ``condition`` is ``<inner unit> = <outer unit>`` (either way round). The outer column's qualifier
    must not be the inner table's name: inside the subquery that name is the inner table (``FROM visits WHERE
    EXISTS (SELECT 1 FROM visits WHERE visits.person_id = visits.person_id ...)`` ties nothing, and would tell
    whether anyone's row passes)."""
    if not isinstance(condition, exp.EQ):
        return False
    sides = [unparen(condition.this), unparen(condition.expression)]
    for mine, other in (sides, sides[::-1]):
        if _is_inner_unit(mine, reference, unit) and isinstance(other, exp.Column) \
                and other.args.get("table") is not None and identifier(other.args["table"]) != reference \
                and _outer_unit(other, sources, owner, index) is not None:
            return True
    return False


def _unaliased(node: exp.Expression) -> exp.Expression:
    return node.this if isinstance(node, exp.Alias) else node


def _is_inner_unit(node: exp.Expression, reference: str, unit: str) -> bool:
    node = unparen(node)
    return isinstance(node, exp.Column) and identifier(node.this) == unit \
        and identifier(node.args.get("table")) in (None, reference) and node.args.get("db") is None


def _outer_unit(node: exp.Expression, sources: list[Source], owner: str, index: PolicyIndex) -> Source | None:
    """The outer source whose privacy unit column ``node`` names (qualified, or bare when one source has it)."""
    node = unparen(node)
    if not isinstance(node, exp.Column) or node.args.get("db") is not None:
        return None
    table, name = identifier(node.args.get("table")), identifier(node.this)
    found = [source for source in sources
             if (table is None or source.reference == table) and _owner(source.table, index) == owner
             and _unit_column(source.table) == name]
    return found[0] if len(found) == 1 else None


def _own_columns(condition: exp.Expression, reference: str, table: ResolvedTable, hint: str = HINT) -> None:
    """Every column of an inner condition is the inner table's: qualified with its name, or bare and known to be
    one of its columns (PostgreSQL resolves any other bare name to the outer query, unchecked)."""
    types = _known_columns(table)
    for column in condition.find_all(exp.Column):
        name, qualifier = identifier(column.this), identifier(column.args.get("table"))
        if column.args.get("db") is not None or qualifier not in (None, reference) \
                or (qualifier is None and (types is None or name not in types)):
            raise unsupported(f"{column.sql(dialect='postgres')} in a semi-join subquery must be a column of its "
                              f"table {reference} (write {reference}.<column>)", hint)


def _known_columns(table: ResolvedTable) -> frozenset[str] | None:
    model = table.protected or table.linked or table.reference
    return frozenset(model.types) if model is not None and model.types is not None else None


def _constant_item(item: exp.Expression) -> bool:
    core = item.this if isinstance(item, exp.Alias) else item
    return isinstance(core, (exp.Literal, exp.Null, exp.Boolean, exp.Star))


def _positive(limit: exp.Expression) -> bool:
    count = limit.expression if isinstance(limit, exp.Limit) else None
    return isinstance(count, exp.Literal) and not count.is_string and count.name.isdigit() and int(count.name) > 0
