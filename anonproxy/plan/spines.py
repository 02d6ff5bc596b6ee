"""Constant relations (time spines) beside the released rows of aggregate queries.

Cube, MetricFlow and Grafana fill the gaps of a series by LEFT JOINing a list of the periods to the aggregate
query: ``FROM generate_series('2025-03-01'::timestamptz, '2025-03-31'::timestamptz, interval '1 day') AS d(day)
LEFT JOIN (SELECT date_trunc('day', visited_at) AS day, count(*) AS n FROM visits GROUP BY 1) AS q ON q.day =
d.day``, or ``(VALUES (...), ...) AS dates(date_from, date_to)`` and a derived table over it. Such a relation
holds constants only, no person's data: an outer query over released rows (:mod:`anonproxy.plan.outer`) may read
it beside them. A period without a released row (none happened, or its group was withheld) gets the NULLs of the
LEFT JOIN. Its size is bounded: :data:`MAX_ROWS` rows at most, counted from its constant arguments.

A ``generate_series`` spine joined to a table's rows and grouped by the spine (``FROM generate_series(...) AS
d(day) LEFT JOIN visits v ON date_trunc('day', v.visited_at) = d.day GROUP BY d.day``; MetricFlow's offset
metric joins ``ON ... = spine.ds - interval '7 day'``) is rewritten into that form first
(:func:`rewrite_joined`): the rows grouped by the join's key in an aggregate query, which the back-ends gate
like any other, and the spine joined to its released rows.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

from sqlglot import exp

from anonproxy.plan import time_values as tv
from anonproxy.plan.expressions import unparen
from anonproxy.plan.joins import conjuncts
from anonproxy.plan.names import output_name, own_nodes, sources
from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import identifier

MAX_ROWS = 20_000  # as many buckets as dp mode lists for a time key at most (anonproxy.dp.time_domains)
HINT = ("A time spine is generate_series(<start>, <stop>, <step>) of constants (numbers, or timestamps and an "
        "interval), or a VALUES list, of at most 20000 rows, LEFT JOINed to an aggregate query: FROM "
        "generate_series('2025-01-01'::timestamptz, '2025-01-31'::timestamptz, interval '1 day') AS d(day) LEFT "
        "JOIN (SELECT date_trunc('day', t) AS day, count(*) AS n FROM ... GROUP BY 1) AS q ON q.day = d.day.")
# The shortest month and day a step can be: 28 days, a day of 23 hours (a step across the spring's time change).
_SECONDS_PER_STEP_UNIT = {"months": 28 * 86400 - 3600, "days": 23 * 3600}


def is_spine(item: exp.Expression) -> bool:
    """Whether FROM item ``item`` is a constant relation by its form: generate_series, VALUES, or a derived table
    that reads only those (its size and arguments are checked by :func:`columns`)."""
    if isinstance(item, exp.Table):
        return isinstance(item.this, exp.ExplodingGenerateSeries)
    if isinstance(item, exp.Values):
        return True
    if isinstance(item, exp.Subquery) and isinstance(item.this, exp.Select):
        body = item.this
        inner = sources(body)
        return {key for key, value in body.args.items() if value not in (None, False, [], "")} <= {
            "expressions", "from_"} and bool(inner) and all(is_spine(other) for other in inner) \
            and not any(isinstance(node, (exp.AggFunc, exp.Window)) for node in own_nodes(body))
    return False


def reference(item: exp.Expression) -> str:
    """The name the outer query reads the spine by (its alias; generate_series without one)."""
    alias = item.args.get("alias")
    name = identifier(alias.this) if alias is not None and alias.this else None
    return name or "generate_series"


def columns(item: exp.Expression, source: str) -> tuple[str, ...]:
    """The spine's column names, after checking it is constant and at most MAX_ROWS rows."""
    alias = item.args.get("alias")
    listed = tuple(identifier(column) or "" for column in alias.args.get("columns") or []) if alias else ()
    if isinstance(item, exp.Table):
        _check_series(item.this)
        return listed[:1] or (reference(item),)  # a function's alias names its column too
    if isinstance(item, exp.Values):
        rows = item.expressions
        if len(rows) > MAX_ROWS or any(_reads_data(row) for row in rows):
            raise unsupported(f"a VALUES list beside aggregate queries holds at most {MAX_ROWS} rows of constants",
                              HINT)
        width = len(rows[0].expressions) if rows and isinstance(rows[0], exp.Tuple) else 1
        return listed + tuple(f"column{i}" for i in range(len(listed) + 1, width + 1))
    body = item.this
    for inner in sources(body):
        columns(inner, source)
    if any(_reads_data(node) for node in body.expressions):
        raise unsupported("a derived table over a time spine may compute only over its constants", HINT)
    names = tuple(output_name(node, source) or "?column?" for node in body.expressions)
    return listed + names[len(listed):]


# What a spine's values may be built of: constants, the spine's own columns, casts and arithmetic. Anything else (a
# query, a parameter, a function call such as query_to_xml(), which runs a query of its text) is refused.
_CONSTANT_PARTS = (exp.Literal, exp.Null, exp.Boolean, exp.Column, exp.Identifier, exp.Star, exp.Tuple, exp.Alias,
                   exp.Paren, exp.Neg, exp.Add, exp.Sub, exp.Mul, exp.Cast, exp.DataType, exp.DataTypeParam,
                   exp.Interval, exp.Var)


def _reads_data(node: exp.Expression) -> bool:
    """Whether ``node`` holds anything but constants and the spine's own columns, with casts and arithmetic."""
    return any(type(part) not in _CONSTANT_PARTS for part in node.walk())


def _check_series(series: exp.ExplodingGenerateSeries) -> None:
    start, end, step = series.args.get("start"), series.args.get("end"), series.args.get("step")
    rows = _number_rows(start, end, step) if step is None or _integer(step) is not None else None
    if rows is None:
        rows = _time_rows(start, end, step)
    if rows is None:
        raise unsupported("generate_series beside aggregate queries takes constants: integers, or two timestamps "
                          "and an interval", HINT)
    if rows > MAX_ROWS:
        raise unsupported(f"generate_series beside aggregate queries gives at most {MAX_ROWS} rows; this one "
                          f"gives {rows}", HINT)


def _number_rows(start: exp.Expression | None, end: exp.Expression | None, step: exp.Expression | None,
                 ) -> int | None:
    low, high = _integer(start), _integer(end)
    by = 1 if step is None else _integer(step)
    if low is None or high is None or by is None or by == 0:
        return None
    return max(0, (high - low) // by + 1)


def _integer(node: exp.Expression | None) -> int | None:
    sign = 1
    while isinstance(node, (exp.Paren, exp.Neg)):
        sign = -sign if isinstance(node, exp.Neg) else sign
        node = node.this
    if isinstance(node, exp.Literal) and not node.is_string and node.name.isdigit():
        return sign * int(node.name)
    return None


def _time_rows(start: exp.Expression | None, end: exp.Expression | None, step: exp.Expression | None,
               ) -> int | None:
    """Rows of generate_series over timestamps, at most: the span over the step's shortest length; None unless both
    ends are timestamp constants and the step a positive interval."""
    low, high, interval = _moment(start), _moment(end), _interval(step)
    if low is None or high is None or interval is None or interval.sign != 1:
        return None
    seconds = (interval.months * _SECONDS_PER_STEP_UNIT["months"] + interval.days * _SECONDS_PER_STEP_UNIT["days"]
               + interval.micros / Decimal(1_000_000))
    span = Decimal((high - low).total_seconds())
    return max(0, int(span / Decimal(seconds)) + 1)


def _moment(node: exp.Expression | None) -> datetime | None:
    """A timestamp constant: '2025-01-01'::timestamptz, TIMESTAMP '...', or a quoted ISO string; UTC unless it says
    otherwise (an upper bound of the rows either way: a zone moves both ends alike)."""
    if isinstance(node, exp.Cast) and node.to.this in (exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ,
                                                        exp.DataType.Type.DATE):
        node = node.this
    if not isinstance(node, exp.Literal) or not node.is_string:
        return None
    try:
        moment = datetime.fromisoformat(node.name.strip())
    except ValueError:
        return None
    return moment.replace(tzinfo=None) if moment.tzinfo is None else moment.astimezone(UTC).replace(tzinfo=None)


def _interval(node: exp.Expression | None) -> tv.Interval | None:
    if isinstance(node, exp.Interval) and isinstance(node.this, exp.Literal):
        unit = node.args.get("unit")
        return tv.parse_interval(f"{node.this.name} {unit.name}" if isinstance(unit, exp.Var) else node.this.name)
    if isinstance(node, exp.Cast) and node.to.this == exp.DataType.Type.INTERVAL \
            and isinstance(node.this, exp.Literal) and node.this.is_string:
        return tv.parse_interval(node.this.name)
    return None


# --- generate_series in the select list of a query without FROM ---------------------------------------------

_SERIES_NAME = "anonproxy_series"


def give_series_a_from(tree: exp.Expression) -> None:
    """Rewrite each derived table ``(SELECT generate_series(...) [AS name]) AS d`` (MetricFlow's spine of a time
    dimension) into ``generate_series(...) AS d(name)``, and such a WITH query into ``SELECT name FROM
    generate_series(...) AS anonproxy_series(name)``: PostgreSQL gives the same rows, in the form of a spine
    (:func:`is_spine`), whose constants :func:`columns` then checks."""
    for select in list(tree.find_all(exp.Select)):
        parent, series = select.parent, _selected_series(select)
        if series is None or not isinstance(parent, (exp.Subquery, exp.CTE)):
            continue
        item = select.expressions[0]
        name = exp.to_identifier(item.alias if isinstance(item, exp.Alias) else "generate_series", quoted=True)
        alias = parent.args.get("alias")
        if isinstance(parent, exp.Subquery) and alias is not None and alias.this and not alias.columns:
            parent.replace(exp.Table(this=series.copy(), alias=exp.TableAlias(this=alias.this.copy(), columns=[name])))
        else:  # a WITH query, or a derived table without a plain alias: its body reads the series in FROM
            select.set("expressions", [exp.column(name.copy())])
            select.set("from_", exp.From(this=exp.Table(this=series.copy(), alias=exp.TableAlias(
                this=exp.to_identifier(_SERIES_NAME, quoted=True), columns=[name]))))


def _selected_series(select: exp.Select) -> exp.ExplodingGenerateSeries | None:
    """The generate_series call that is the one item of ``select``, when nothing else is in it (no FROM)."""
    used = {key for key, value in select.args.items() if value not in (None, False, [], "")}
    if used != {"expressions"} or len(select.expressions) != 1:
        return None
    item = select.expressions[0]
    item = item.this if isinstance(item, exp.Alias) else item
    return item if isinstance(item, exp.ExplodingGenerateSeries) else None


# --- a spine joined to the rows, then grouped by the spine ---------------------------------------------------

ROWS = "anonproxy_spine_rows"  # the aggregate query's released rows, in the rewritten statement
_GROUPED_ARGS = frozenset({"expressions", "from_", "joins", "where", "group", "order", "limit", "offset"})
JOINED_HINT = ("A time spine joined to a table's rows: FROM generate_series(...) AS d(day) [LEFT] JOIN <table> v ON "
               "<expression of v> = <expression of d> [WHERE <conditions on v or on d>] GROUP BY d.day, with "
               "aggregates of v's columns; or the spine LEFT JOIN an aggregate query.")


def rewrite_joined(tree: exp.Expression, source: str) -> None:
    """:func:`aggregate_first` every SELECT of ``tree`` that is a spine joined to a table's rows, at any depth
    (MetricFlow nests its offset metric in a derived table)."""
    for select in [node for node in tree.find_all(exp.Select) if joined_to_rows(node)]:
        aggregate_first(select, source)


def joined_to_rows(select: exp.Select) -> bool:
    """Whether ``select`` has the form of a spine joined to one table's rows and grouped (MetricFlow's offset
    metrics, a spine LEFT JOINed to the rows, Cube's rolling window): a spine first in FROM, one table joined,
    GROUP BY."""
    from_ = select.args.get("from_")
    joins = select.args.get("joins") or []
    return from_ is not None and is_spine(from_.this) and len(joins) == 1 \
        and isinstance(joins[0].this, exp.Table) and isinstance(joins[0].this.this, exp.Identifier) \
        and select.args.get("group") is not None


def aggregate_first(select: exp.Select, source: str) -> None:
    """Rewrite ``select`` (:func:`joined_to_rows`) in place into the spine joined to an aggregate query: the
    table's rows grouped by the join's key, each aggregate computed there, and the spine reading the released
    groups (INNER JOIN). A group of the spine is the rows of its key, so every released row is PostgreSQL's; a
    spine row without released rows (no rows, or a group withheld) is left out, as a group of fewer than k people
    is (a count over no one is no exception). Anything outside this form is refused."""
    spine, join = select.args["from_"].this, select.args["joins"][0]
    extra = {key for key, value in select.args.items() if value not in (None, False, [], "")} - _GROUPED_ARGS
    if extra or join.args.get("side") not in (None, "", "LEFT") or join.args.get("kind") not in (None, "", "INNER",
                                                                                             "OUTER") \
            or join.args.get("using") or join.args.get("method") or join.args.get("on") is None:
        raise unsupported(f"{', '.join(sorted(extra)).upper() or 'this join'} is not supported for a time spine "
                          "joined to a table's rows", JOINED_HINT)
    spine_name, names = reference(spine), columns(spine, source)
    table = join.this

    def reads(node: exp.Expression) -> set[str]:
        """What ``node`` reads: "spine", "table", or "released" (an aggregate already replaced by its column of
        the released rows). A bare name is the spine's if it has it (the analysis of each part refuses what it
        does not own)."""
        found = set()
        for column in node.find_all(exp.Column):
            qualifier = identifier(column.args.get("table"))
            bare = qualifier is None and identifier(column.this) in names
            found.add("released" if qualifier == ROWS else "spine" if qualifier == spine_name or bare else "table")
        return found

    key, point = _join_key(join.args["on"], reads)
    # VALUES, or a derived table's select items, may repeat a row, which PostgreSQL's GROUP BY would merge
    if not isinstance(spine, exp.Table):
        raise unsupported(f"{_spine_kind(spine)} joined to a table's rows is not supported: join generate_series "
                          f"itself, or LEFT JOIN the {_spine_kind(spine, short=True)} to an aggregate query",
                          JOINED_HINT)
    inner_where, outer_where = [], []
    where = select.args.get("where")
    for condition in conjuncts(where.this) if where is not None else []:
        part = reads(condition)
        if part == {"table"}:
            inner_where.append(condition.copy())
        elif part <= {"spine"}:
            outer_where.append(condition.copy())
        else:
            raise unsupported("a WHERE condition of a time spine joined to a table's rows must read the spine or "
                              "the table, not both", JOINED_HINT)
    _check_groups(select, reads, names, spine_name)
    for item in list(select.expressions):  # an aggregate item keeps its name when its column replaces it
        if not isinstance(item, exp.Alias) and item.find(exp.AggFunc) is not None:
            item.replace(exp.alias_(item.copy(), output_name(item, source) or "?column?", quoted=True))
    aggregates = _take_aggregates(select, reads)
    inner = exp.Select(
        expressions=[exp.alias_(key.copy(), "anonproxy_key", quoted=True)]
        + [exp.alias_(node, f"anonproxy_a{i}", quoted=True) for i, node in enumerate(aggregates, 1)],
        from_=exp.From(this=table.copy()), group=exp.Group(expressions=[key.copy()]))
    if inner_where:
        inner.set("where", exp.Where(this=exp.and_(*inner_where)))
    on = exp.EQ(this=exp.column("anonproxy_key", ROWS, quoted=True), expression=exp.paren(point.copy()))
    select.set("joins", [exp.Join(this=exp.Subquery(this=inner, alias=exp.TableAlias(
        this=exp.Identifier(this=ROWS, quoted=True))), on=on)])
    select.set("where", exp.Where(this=exp.and_(*outer_where)) if outer_where else None)
    select.set("group", None)


def _spine_kind(spine: exp.Expression, short: bool = False) -> str:
    """What the client wrote as a spine that is not generate_series itself, for a message."""
    if isinstance(spine, exp.Values):
        return "VALUES list" if short else "a VALUES spine"
    over = "generate_series" if spine.find(exp.ExplodingGenerateSeries) is not None else "VALUES"
    return "derived table" if short else f"a derived table over {over} as a spine"


def _join_key(on: exp.Expression, reads: Callable[[exp.Expression], set[str]],
              ) -> tuple[exp.Expression, exp.Expression]:
    """The ON condition's two sides: (the table's expression, the spine's); one equality, each side of one."""
    on = unparen(on)
    if isinstance(on, exp.EQ):
        for mine, other in ((on.this, on.expression), (on.expression, on.this)):
            if reads(mine) == {"table"} and reads(other) == {"spine"}:
                return mine, other
    raise unsupported("a time spine joined to a table's rows takes one ON equality between an expression of the "
                      "table and one of the spine (a range, as in a rolling window, is not answered)", JOINED_HINT)


def _check_groups(select: exp.Select, reads: Callable[[exp.Expression], set[str]], names: tuple[str, ...],
                  spine_name: str) -> None:
    """The GROUP BY keys read the spine only, and one of them is its column (moved by a constant at most): each
    group is one spine row, so the rewritten statement needs no GROUP BY."""
    items = select.expressions
    aliases = {item.alias: item.this for item in items if isinstance(item, exp.Alias)}
    keys = []
    for key in select.args["group"].expressions:
        if isinstance(key, exp.Literal) and not key.is_string and key.name.isdigit() \
                and 1 <= int(key.name) <= len(items):
            item = items[int(key.name) - 1]
            key = item.this if isinstance(item, exp.Alias) else item
        elif isinstance(key, exp.Column) and key.args.get("table") is None and identifier(key.this) in aliases \
                and identifier(key.this) not in names:
            key = aliases[identifier(key.this) or ""]
        keys.append(unparen(key))
    if any(reads(key) != {"spine"} for key in keys) or not any(_moved_column(key, names, spine_name) for key in keys):
        raise unsupported("a time spine joined to a table's rows must be grouped by the spine's column", JOINED_HINT)


def _moved_column(node: exp.Expression, names: tuple[str, ...], spine_name: str) -> bool:
    """Whether ``node`` is the spine's column, or it plus or minus an integer or an interval without months (one
    value per spine row: a month is not, '2025-01-30' and '2025-01-31' plus a month are both '2025-02-28')."""
    node = unparen(node)
    if isinstance(node, (exp.Add, exp.Sub)) and _shift(unparen(node.expression)):
        node = unparen(node.this)
    return isinstance(node, exp.Column) and identifier(node.this) in names \
        and identifier(node.args.get("table")) in (None, spine_name)


def _shift(node: exp.Expression) -> bool:
    """Whether ``node`` is a constant that moves distinct values to distinct values: an integer, or an interval
    without months."""
    interval = _interval(node)
    return _integer(node) is not None or (interval is not None and interval.months == 0)


def _take_aggregates(select: exp.Select, reads: Callable[[exp.Expression], set[str]]) -> list[exp.Expression]:
    """Replace each aggregate of the select list and ORDER BY by its column of the released rows; the aggregates
    (each read only the table). What is left outside them must read the spine only."""
    found: dict[str, exp.Expression] = {}
    order = select.args.get("order")
    parts = [*select.expressions, *(order.expressions if order is not None else [])]
    for part in parts:
        if part.find(exp.Window) is not None:
            raise unsupported("window functions are not supported in a time spine joined to a table's rows",
                              JOINED_HINT)
        for node in [n for n in part.find_all(exp.AggFunc) if n.find_ancestor(exp.AggFunc) is None]:
            whole = node.parent if isinstance(node.parent, exp.Filter) else node
            if reads(whole) - {"table"}:
                raise unsupported("an aggregate of a time spine joined to a table's rows reads the table's columns "
                                  "only", JOINED_HINT)
            text = whole.sql(dialect="postgres")
            found.setdefault(text, whole.copy())
            whole.replace(exp.column(f"anonproxy_a{list(found).index(text) + 1}", ROWS, quoted=True))
    if any(reads(part) - {"spine", "released"} for part in parts):
        raise unsupported("outside its aggregates, a time spine joined to a table's rows reads the spine only",
                          JOINED_HINT)
    return list(found.values())
