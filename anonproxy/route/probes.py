"""Privilege probes: what a BI tool asks before it lists a table, answered as the proxy will answer queries.

BI tools hide the tables they think they cannot read: Metabase's sync calls
``has_table_privilege(current_user, '"schema"."table"', 'SELECT')``, other
tools read ``information_schema.table_privileges`` and its kin. A role in
suppress or dp mode holds no SELECT on protected and linked tables (direct
SELECT must fail inside PostgreSQL), so PostgreSQL's own answer is "no", and
the tables vanish from the tool although the proxy answers aggregate queries
over them.

A statement that reads no protected table and calls one of these functions
or reads one of these views is rewritten on its tree to use the functions and
views of the same name and signature in the ``anonproxy`` schema (migration
0015). They ask PostgreSQL first, so its errors stay (42P01 unknown table,
22023 unknown privilege type, 42704 unknown role) and so do its answers for
every other privilege and table; where PostgreSQL says no, they say SELECT
for a protected or linked table and a role the proxy answers (suppress, dp).
Tools that parse access lists themselves get ``pg_class.relacl`` and
``pg_attribute.attacl`` through ``anonproxy.relacl`` / ``anonproxy.attacl``,
which add that SELECT the same way.
The rewritten SQL runs on the client's own connection, under its own login
(:class:`~anonproxy.route.decision.Relayed`), so PostgreSQL's privileges
still decide what it reads.
"""

from __future__ import annotations

from sqlglot import exp
from sqlglot.errors import SqlglotError

from anonproxy.plan.statements import DIALECT
from anonproxy.plan.tables import CATALOG_SCHEMA, fold, identifier

PROBE_SCHEMA = "anonproxy"
PROBE_FUNCTIONS = frozenset({"has_table_privilege", "has_any_column_privilege", "has_column_privilege"})
PROBE_VIEWS = frozenset({"table_privileges", "column_privileges", "role_table_grants", "role_column_grants"})
_VIEW_SCHEMA = "information_schema"
# Access-list columns read and parsed by the tools themselves (pgjdbc's getTablePrivileges and
# getColumnPrivileges, psql's \dp): catalog -> (column, the catalog's column holding the relation's oid).
ACL_COLUMNS = {"pg_class": ("relacl", "oid"), "pg_attribute": ("attacl", "attrelid")}


def redirect_probes(tree: exp.Expression) -> str | None:
    """The SQL of ``tree`` with its privilege probes answered by the anonproxy schema; None: it has none.

    ``tree`` is rewritten in place; the SQL is generated from it. The caller checks that the SQL parses back
    to the same tree (so what runs is the statement the client sent, probes aside), else runs the client's own
    text, and PostgreSQL answers the probes itself: under the client's own login either way, so nothing is
    read that PostgreSQL would not show it. None as well when sqlglot cannot write the tree.
    """
    found = False
    for node in list(tree.walk()):  # listed first: the nodes put in are not visited
        if isinstance(node, exp.Anonymous) and _probe_function(node):
            found = True
            call = exp.Anonymous(this=fold(_function_name(node) or "", False), expressions=node.expressions)
            outer = node.parent if isinstance(node.parent, exp.Dot) and node.parent.expression is node else node
            outer.replace(exp.Dot(this=exp.to_identifier(PROBE_SCHEMA), expression=call))
        elif isinstance(node, exp.Table) and _probe_view(node):
            found = True
            node.set("db", exp.to_identifier(PROBE_SCHEMA))
        elif isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
            acl = _acl_call(node)
            if acl is not None:
                found = True
                node.replace(acl)
    if not found:
        return None
    for alias in tree.find_all(exp.Alias):
        # Column labels are written quoted, in the spelling PostgreSQL gives them: the splitter reads a word
        # after AS in a select list as such a quoted identifier, so the SQL parses back to this very tree.
        label = alias.args.get("alias")
        if isinstance(label, exp.Identifier):
            label.replace(exp.to_identifier(identifier(label), quoted=True))
    try:
        return tree.sql(dialect=DIALECT)
    except SqlglotError:
        return None


def _acl_call(column: exp.Column) -> exp.Expression | None:
    """``c.relacl`` of pg_class (``a.attacl`` of pg_attribute) as ``anonproxy.relacl(c.oid, c.relacl)``: the
    access list with the SELECT the proxy stands for. The call's output name is the column's (``relacl``).
    An unqualified column counts when one catalog of that kind is in the FROM clause of its SELECT."""
    name = identifier(column.this if isinstance(column.this, exp.Identifier) else None)
    catalogs = [catalog for catalog, (acl, _) in ACL_COLUMNS.items() if acl == name]
    select = column.find_ancestor(exp.Select)
    if not catalogs or select is None or column.args.get("db") is not None:
        return None
    qualifier = identifier(column.args.get("table"))
    sources = [table for table in _from_tables(select) if identifier(table.this) == catalogs[0]
               and identifier(table.args.get("db")) in (None, CATALOG_SCHEMA)]
    names = [identifier(table.args["alias"].this) if table.args.get("alias") else identifier(table.this)
             for table in sources]
    reference = qualifier if qualifier in names else names[0] if qualifier is None and len(names) == 1 else None
    if reference is None:
        return None
    acl, relation = ACL_COLUMNS[catalogs[0]]
    return exp.Dot(this=exp.to_identifier(PROBE_SCHEMA), expression=exp.Anonymous(this=acl, expressions=[
        exp.column(relation, table=reference, quoted=True), exp.column(acl, table=reference, quoted=True)]))


def _from_tables(select: exp.Select) -> list[exp.Table]:
    """The tables named in the FROM clause and joins of ``select`` itself (not in its subqueries)."""
    items = [select.args.get("from_") or select.args.get("from")] + list(select.args.get("joins") or [])
    return [item.this for item in items if item is not None and isinstance(item.this, exp.Table)
            and isinstance(item.this.this, exp.Identifier)]


def _function_name(node: exp.Anonymous) -> str | None:
    name = node.this
    if isinstance(name, exp.Identifier):
        return identifier(name)
    return fold(name, False) if isinstance(name, str) else None


def _probe_function(node: exp.Anonymous) -> bool:
    """``has_table_privilege(...)`` or ``pg_catalog.has_table_privilege(...)`` (and the column ones)."""
    if _function_name(node) not in PROBE_FUNCTIONS:
        return False
    parent = node.parent
    if isinstance(parent, exp.Dot) and parent.expression is node:
        return isinstance(parent.this, exp.Identifier) and identifier(parent.this) == CATALOG_SCHEMA
    return True


def _probe_view(table: exp.Table) -> bool:
    """``information_schema.table_privileges`` and the other privilege views (schema-qualified only)."""
    return (isinstance(table.this, exp.Identifier) and identifier(table.this) in PROBE_VIEWS
            and identifier(table.args.get("db")) == _VIEW_SCHEMA)
