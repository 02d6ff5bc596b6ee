"""Lightdash's fan-out keys, answered where the catalog proves them harmless: a SELECT DISTINCT derived table of
a protected table's unique unit joined back to that table is the table's own rows, filtered.

Lightdash computes a metric of a table that a one-to-many join repeats over that table's distinct keys::

    SELECT k.sex, sum(adult.age) FROM (SELECT DISTINCT adult.sex, adult.id AS pk FROM adult
        LEFT JOIN visits ON adult.id = visits.person_id WHERE visits.channel = 'web') AS k
    LEFT JOIN adult ON k.pk = adult.id GROUP BY 1

When the catalog makes ``adult.id`` unique and not null (``ProtectedTable.unique_unit``), the keys table is
first in its FROM clause, every other key is a column of that same row, and the join back equates the key with
the unit, each row of the keys table is one row of ``adult``, and the join back finds that row and no other: the
statement is the one over ``adult`` alone, keeping the rows that had a match::

    SELECT adult.sex, sum(adult.age) FROM adult
    WHERE adult.id IN (SELECT visits.person_id FROM visits WHERE visits.channel = 'web') GROUP BY 1

:func:`rewrite` makes that change on the tree when it can prove it: the keys table reads the protected table
alone (its WHERE moves over) or joined (INNER or LEFT) on its declared key to one linked table, whose conditions
become a semi-join on the unit (:mod:`anonproxy.plan.semi_joins`); under a LEFT JOIN each such condition must be
false for a row without a match (a comparison of one of its columns, its negation, or ``IS NOT NULL``), and with
none every row is kept. Anything
else (a unit the catalog does not prove unique; conditions over both tables; a linked table not joined on its
declared key) is left as it is, for the analysis to refuse (:func:`anonproxy.plan.refusals.fanout_keys`).

Keys of the joined table (Lightdash's usual dimension of the many side, ``SELECT DISTINCT visits.channel,
adult.id ...``) are (values, person) pairs: each adult once per distinct channel of its visits that pass the
linked table's conditions, or once with NULLs under a LEFT JOIN without such conditions (an adult without a
visit). The linked table's distinct rows of those columns and its key are exactly those pairs, so the statement
is the one that joins them to the table::

    SELECT k.channel, sum(adult.age) FROM adult
    JOIN (SELECT DISTINCT visits.channel, visits.person_id FROM visits WHERE visits.channel <> 'web') AS k
      ON k.person_id = adult.id
    GROUP BY 1

(``LEFT JOIN`` when the keys joined visits with LEFT JOIN and no condition on it; the table's own conditions stay in
WHERE.) A time dimension of the linked table (``DATE_TRUNC('MONTH', visits.visited_at) AS m``) is computed in those
distinct rows, as the keys computed it. The analysis admits that derived table as a linked table
(:mod:`anonproxy.plan.distinct_pairs`). A bare name in the outer query that the derived table would newly show (its
columns' names) keeps the statement as it is.
"""

from __future__ import annotations

from sqlglot import exp

from anonproxy.plan import distinct_pairs
from anonproxy.plan.expressions import unparen
from anonproxy.plan.joins import conjuncts
from anonproxy.plan.names import own_nodes, reference, sources
from anonproxy.plan.tables import PolicyIndex, ResolvedTable, identifier

# A condition of these forms over a column of a LEFT JOINed table is NULL on a row without a match: strict operators.
_STRICT = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.Like, exp.ILike, exp.In, exp.Between)
_KEYS_ARGS = frozenset({"expressions", "from_", "joins", "where", "distinct"})


def rewrite(tree: exp.Expression, index: PolicyIndex) -> bool:
    """Rewrite every SELECT of ``tree`` that joins provably harmless fan-out keys back to their table; whether any."""
    changed = False
    for select in list(tree.find_all(exp.Select)):
        changed = _rewrite(select, index) or changed
    return changed


def _rewrite(select: exp.Select, index: PolicyIndex) -> bool:
    """Rewrite ``select`` when it is ``FROM (SELECT DISTINCT ...) k [LEFT] JOIN <protected> ON k.<key> = <unit>``
    with keys :func:`_keys` proves to be that table's rows."""
    items = sources(select)
    joins = select.args.get("joins") or []
    if len(items) != 2 or not _plain_join(joins[0], ("", "LEFT")):
        return False
    keys, table = items
    if not isinstance(keys, exp.Subquery):
        return False
    body = keys.this
    alias = reference(keys)
    if not isinstance(body, exp.Select) or not isinstance(table, exp.Table) or alias is None \
            or keys.args["alias"].args.get("columns") or _extra(keys, {"this", "alias"}):
        return False
    resolved = index.resolve(table)
    protected = resolved.protected
    if protected is None or not protected.unique_unit or _extra(table, {"this", "db", "alias"}):
        return False
    key = _joined_key(joins[0].args["on"], alias, reference(table), protected.unit_column)
    rows = _keys(body, resolved, index, key, alias) if key is not None else None
    if key is None or rows is None:
        return False
    conditions, own, pairs = rows
    hidden = set(pairs.this.this.named_selects) if pairs is not None else set()
    if not _reads_keys_qualified(select, keys, alias, own, hidden):
        return False
    target = reference(table) or ""
    mine = own[key][0]
    _substitute(select, alias, own, {mine: target})
    if pairs is not None:
        _requalify(pairs.args["on"], mine, target)  # before it is placed: _requalify skips what is in a subquery
    select.set("from_", exp.From(this=table))
    select.set("joins", [pairs] if pairs is not None else None)
    for condition in conditions:
        _requalify(condition, mine, target)
        select.where(condition, copy=False)
    return True


def _keys(body: exp.Select, table: ResolvedTable, index: PolicyIndex, key: str, alias: str,
          ) -> tuple[list[exp.Expression], dict[str, tuple[str, str]], exp.Join | None] | None:
    """When ``body`` gives the rows of ``table`` (once each: its DISTINCT keys hold the unit, named ``key``, and
    columns of that row only), or (row, values) pairs with the linked table's columns among its keys: the
    conditions that keep those rows (over its own reference, or a semi-join), each key's (reference, column), and
    for pairs the join of the linked table's distinct rows (named ``alias``) that replaces the keys; else None."""
    distinct = body.args.get("distinct")
    if not isinstance(distinct, exp.Distinct) or distinct.args.get("on") or _extra(body, _KEYS_ARGS):
        return None
    if any(isinstance(node, (exp.Select, exp.Subquery, exp.Star)) for node in body.walk() if node is not body):
        return None
    first = body.args["from_"].this
    if not isinstance(first, exp.Table) or _extra(first, {"this", "db", "alias"}) \
            or index.resolve(first).policy_name != table.policy_name:
        return None
    own_reference = reference(first) or ""
    joins = body.args.get("joins") or []
    other = reference(joins[0].this) if len(joins) == 1 and isinstance(joins[0].this, exp.Table) else None
    qualifiers = {own_reference, *([other] if other else [])}
    own: dict[str, tuple[str, str]] = {}
    columns: dict[str, exp.Expression] = {}  # the linked table's distinct rows: output name -> select item
    for item in body.expressions:
        core = item.this if isinstance(item, exp.Alias) else item
        if not isinstance(item, exp.Alias) and not isinstance(core.this, exp.Identifier):
            return None
        name = identifier(item.args.get("alias")) if isinstance(item, exp.Alias) else identifier(core.this)
        if name is None or name in own:
            return None
        if other is not None and isinstance(item, exp.Alias) and distinct_pairs.truncated(core, other):
            if name in columns:
                return None
            own[name] = (other, name)  # a time dimension of the linked table, computed in its distinct rows
            columns[name] = exp.Alias(this=core.copy(), alias=exp.Identifier(this=name, quoted=True))
            continue
        if not isinstance(core, exp.Column) or not isinstance(core.this, exp.Identifier) \
                or identifier(core.args.get("table")) not in qualifiers or core.args.get("db") is not None:
            return None
        own[name] = (identifier(core.args.get("table")) or "", identifier(core.this) or "")
        if own[name][0] != own_reference:
            if not isinstance(columns.setdefault(own[name][1], exp.column(own[name][1], other, quoted=True)),
                              exp.Column):
                return None  # a computed key's name is that of a column the keys also hold
    assert table.protected is not None
    if own.get(key) != (own_reference, table.protected.unit_column):
        return None
    where = body.args.get("where")
    conditions = conjuncts(where.this) if where is not None else []
    kept = _conditions(body, conditions, own_reference, table, index, columns, alias)
    if kept is None:
        return None
    return kept[0], {name: (alias, column) if qualifier != own_reference else (qualifier, column)
                     for name, (qualifier, column) in own.items()}, kept[1]


def _conditions(body: exp.Select, conditions: list[exp.Expression], own: str, table: ResolvedTable,
                index: PolicyIndex, columns: dict[str, exp.Expression], alias: str,
                ) -> tuple[list[exp.Expression], exp.Join | None] | None:
    """The keys table's conditions as conditions on the protected table's rows: its own as they are, a linked
    table's as one semi-join on the unit; with ``columns`` of the linked table among the keys a linked table's
    conditions go into the join of its distinct rows instead (:func:`_pairs`). None when they cannot be (see the
    module's doc)."""
    joins = body.args.get("joins") or []
    if any(_columns_of(condition) - {own} for condition in conditions) and not joins:
        return None
    if not joins:
        return [condition.copy() for condition in conditions], None
    linked = joins[0].this
    if len(joins) != 1 or not _plain_join(joins[0], ("", "LEFT")) or not isinstance(linked, exp.Table) \
            or _extra(linked, {"this", "db", "alias"}):
        return None
    link = index.resolve(linked).linked
    other = reference(linked) or ""
    assert table.protected is not None
    unit = table.protected.unit_column
    if link is None or link.references != table.policy_name or link.references_column != unit or other == own \
            or _joined_key(joins[0].args["on"], other, own, unit) != link.column:
        return None
    mine = [c.copy() for c in conditions if _columns_of(c) == {own}]
    theirs = [c for c in conditions if _columns_of(c) == {other}]
    if len(mine) + len(theirs) != len(conditions):
        return None  # a condition over both tables, or over neither
    if joins[0].args.get("side") and not all(_rejects_nulls(c, other) for c in theirs):
        return None
    if isinstance(columns.get(link.column, exp.Column()), exp.Alias):
        return None  # a computed key named as the linked table's key: not the person
    if columns:
        # each (person, values) once: the linked rows' distinct values, LEFT JOINed when the keys keep every row
        side = "LEFT" if joins[0].args.get("side") and not theirs else None
        return mine, _pairs(linked, other, columns, link.column, theirs, alias, unit, own, side)
    if joins[0].args.get("side") and not theirs:
        return mine, None  # a LEFT JOIN without conditions on the joined table keeps every row
    inner = exp.select(exp.column(link.column, other, quoted=True)).from_(linked.copy())
    for condition in theirs:
        inner.where(condition.copy(), copy=False)
    semi = exp.In(this=exp.column(unit, own, quoted=True),
                  query=exp.Subquery(this=inner))
    return [*mine, semi], None


def _pairs(linked: exp.Table, other: str, columns: dict[str, exp.Expression], key: str,
           theirs: list[exp.Expression], alias: str, unit: str, own: str, side: str | None) -> exp.Join:
    """``[LEFT] JOIN (SELECT DISTINCT <columns>, <other>.<key> FROM <linked> WHERE <theirs>) AS <alias> ON
    <alias>.<key> = <own>.<unit>``: each person once per distinct values of the linked table's rows that pass
    ``theirs``, as the keys held them (:mod:`anonproxy.plan.distinct_pairs`)."""
    items = {**columns, key: columns.get(key, exp.column(key, other, quoted=True))}
    inner = exp.select(*(item.copy() for item in items.values())).from_(linked.copy()).distinct()
    for condition in theirs:
        inner.where(condition.copy(), copy=False)
    on = exp.EQ(this=exp.column(key, alias, quoted=True), expression=exp.column(unit, own, quoted=True))
    derived = exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.Identifier(this=alias, quoted=True)))
    return exp.Join(this=derived, on=on, side=side)


def _rejects_nulls(condition: exp.Expression, other: str) -> bool:
    """Whether ``condition`` is a strict comparison whose left side is a column of ``other`` (NULL on a row that
    LEFT JOIN filled with NULLs), its negation (NOT NULL is NULL), or ``<that column> IS NOT NULL`` (false)."""
    node = unparen(condition)
    if isinstance(node, exp.Is) and isinstance(node.expression, exp.Null) and node.args.get("negate"):
        return _is_column_of(node.this, other)
    if isinstance(node, exp.Not):
        inner = unparen(node.this)
        if isinstance(inner, exp.Is) and isinstance(inner.expression, exp.Null) and not inner.args.get("negate"):
            return _is_column_of(inner.this, other)
        return not isinstance(inner, exp.Is) and _rejects_nulls(inner, other)
    return isinstance(node, _STRICT) and _is_column_of(node.this, other)


def _is_column_of(node: exp.Expression, other: str) -> bool:
    node = unparen(node)
    return isinstance(node, exp.Column) and identifier(node.args.get("table")) == other


def _joined_key(on: exp.Expression, keys: str, table: str | None, unit: str) -> str | None:
    """The column of ``keys`` when ``on`` is exactly ``keys.<column> = table.<unit>`` (either way round)."""
    node = unparen(on)
    if not isinstance(node, exp.EQ):
        return None
    sides = [unparen(node.this), unparen(node.expression)]
    for mine, theirs in (sides, sides[::-1]):
        if isinstance(mine, exp.Column) and isinstance(theirs, exp.Column) \
                and identifier(mine.args.get("table")) == keys and identifier(theirs.args.get("table")) == table \
                and identifier(theirs.this) == unit and not mine.args.get("db") and not theirs.args.get("db"):
            return identifier(mine.this)
    return None


def _reads_keys_qualified(select: exp.Select, keys: exp.Subquery, alias: str, names: dict[str, tuple[str, str]],
                          hidden: set[str]) -> bool:
    """Whether ``select`` names the keys' columns only qualified, and only those the keys table has (a bare name
    could be the keys' or the table's; ``*`` would read both), no bare name in ``hidden`` (the linked table's
    columns the rewrite makes visible), and holds no other subquery."""
    for node in own_nodes(select):
        if isinstance(node, exp.Star) or (isinstance(node, exp.Column) and isinstance(node.this, exp.Star)):
            return False
        if isinstance(node, exp.Column) and isinstance(node.this, exp.Identifier):
            qualifier = identifier(node.args.get("table"))
            if (qualifier == alias and identifier(node.this) not in names) \
                    or (qualifier is None and (identifier(node.this) in names or identifier(node.this) in hidden)):
                return False
    return all(node is keys for node in select.find_all(exp.Subquery))


def _substitute(select: exp.Select, alias: str, own: dict[str, tuple[str, str]], rename: dict[str, str]) -> None:
    """Replace ``alias.<key>`` in ``select`` by the column the key holds (its reference renamed by ``rename``: the
    table's row, or the linked table's distinct rows); a select item that is such a reference keeps the key's name
    (an outer query reads it by that name: Cube's q_1."adult__sex")."""
    for item in list(select.expressions):
        if isinstance(item, exp.Column) and identifier(item.args.get("table")) == alias:
            item.replace(exp.Alias(this=item.copy(), alias=exp.Identifier(this=identifier(item.this), quoted=True)))
    for node in list(own_nodes(select)):
        if isinstance(node, exp.Column) and identifier(node.args.get("table")) == alias \
                and isinstance(node.this, exp.Identifier):
            qualifier, column = own[identifier(node.this) or ""]
            node.replace(exp.column(column, rename.get(qualifier, qualifier), quoted=True))


def _requalify(condition: exp.Expression, old: str, new: str) -> None:
    """Name the protected table of the keys table (``old``) as the outer query does (``new``), outside subqueries."""
    for node in list(condition.walk()):
        if isinstance(node, exp.Column) and identifier(node.args.get("table")) == old \
                and node.find_ancestor(exp.Subquery) is None:
            node.set("table", exp.Identifier(this=new, quoted=True))


def _columns_of(condition: exp.Expression) -> set[str | None]:
    """The qualifiers of the columns of ``condition`` (None: a bare column)."""
    return {identifier(column.args.get("table")) for column in condition.find_all(exp.Column)}


def _plain_join(join: exp.Join, sides: tuple[str, ...]) -> bool:
    side = (join.args.get("side") or "").upper()
    kind = (join.args.get("kind") or "").upper()
    return side in sides and kind in ("", "INNER", "OUTER") and join.args.get("on") is not None \
        and not _extra(join, {"this", "on", "side", "kind"})


def _extra(node: exp.Expression, allowed: set[str] | frozenset[str]) -> set[str]:
    return {key for key, value in node.args.items() if value not in (None, False, [], "")} - set(allowed)
