"""The one-pass suppression SQL (docs/suppression.md, "The one-pass shape").

One aggregation pass (``anonproxy_summary``) computes, per group, the client's
own aggregates next to everything the rules need; every rule after it is
arithmetic on one row per group, and the client's select list, HAVING and
ORDER BY run over the released groups (:attr:`AnalyticQuery.post`).

* **Each row one person** (:attr:`AnalyticQuery.one_row_per_person`: the
  catalog makes the protected table's unit unique and not null, and it is
  joined only to reference tables): ``count(*)`` counts a group's people, a
  person's contribution to a SUM/AVG is the row's value, the groups' counts
  add up (nobody is in two groups), and the total ``t`` and largest ``m``
  absolute contribution per SUM/AVG decide the magnitude rules for most
  groups (:func:`anonproxy.suppress.rules.magnitude_bounds`); only the rows
  of the groups they leave open are ranked. N is the groups' people added
  up, plus the rows a WHERE leaves out counted up to k (:func:`_universe`),
  once the catalog still says so (sql/0023).
* **Otherwise, a GROUP BY** (people may have several rows; :func:`_bounded`): the answer comes from one pass
  over the FROM clause that PostgreSQL can split over workers (``anonproxy_rows``), next to each group's rows with
  a unit, the buckets of people it holds (by the unit: people in different buckets are different people) and, per
  SUM/AVG, ``|sum|`` and the largest bucket's total of ``|x|``. Those bound each group's people, contributors and
  contributions without a pass per person; when they prove that every group passes (``anonproxy_sure``), nothing
  else reads the table but N, counted up to a limit that gives every verdict N gives. Otherwise each group's exact
  figures: its distinct units (no magnitude rule to apply), or, under a magnitude rule whose figures follow from
  each person's rows (:func:`two_level`), each person's part of each group (``anonproxy_cells``), from which the
  rules, complementary suppression and the rest row are decided, with N itself. Where each person is in one group
  (:func:`_one_group_per_person`), the other groups' buckets also bound the people a group leaves out, once the
  catalog still says so.

The suppressed-rest row comes from the withheld groups' rows of the summary
where the client's aggregates follow from them (counts, sums of exact types,
extremes, averages of exact types); else it reads their rows again, only when
it is released.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from sqlglot import exp

from anonproxy.catalog_check import one_row_per_person
from anonproxy.plan.analysis import AggregateText, AnalyticQuery
from anonproxy.plan.post_aggregate import RELEASED, PostAggregate, key, plain, value
from anonproxy.plan.tables import ResolvedTable, quote
from anonproxy.suppress.complementary import complementary
from anonproxy.suppress.rules import (
    ANSWERED,
    CELLS,
    COUNTED,
    COVERED,
    GROUP_PEOPLE,
    GROUPS,
    PRIMARY,
    REST,
    REST_CELLS,
    REST_EXACT,
    REST_RANKED,
    ROWS,
    SUMMARY,
    SURE,
    UNIVERSE,
    WITHHELD,
    Ctes,
    Rules,
    bounded_verdicts,
    contributes,
    key_tuple,
    left_out,
    magnitude_bounds,
    query_set_size,
    ranked_verdict,
    surely_hold,
)

PLAIN_PREFIX = plain(1)[:-1]  # the summary's columns of plain select items: anonproxy_c<i>
# Aggregate arguments whose absolute value is summed as bigint: abs() of the type itself could overflow.
_SMALL_INTEGERS = ("int2", "int4")
_INTEGERS = ("smallint", "integer", "bigint")  # as the policy reads column types (format_type)
# Unit types PostgreSQL hashes (a default hash operator class), as format_type names them less a modifier
# ("character varying(20)"). Others may have no hash function (bit, varbit, money, tsvector, tsquery, a composite or
# array type that holds one), and hash_array would fail on them: their people all fall in one bucket.
_HASHED_TYPES = frozenset({
    "text", "character varying", "character", "bpchar", "name", "uuid", "numeric", "bytea", "boolean", "date",
    "time without time zone", "time with time zone", "timestamp without time zone", "timestamp with time zone",
    "interval", "inet", "cidr", "macaddr", "macaddr8", "oid", "real", "double precision", "jsonb",
})
# Buckets of people for the bounds of each person's part of a SUM/AVG: the largest holds about an eighth of a large
# group's total, within dominance (n, k %) where n / 8 is well below k %, and p % up to 100.
_SUM_BUCKETS = 8
# Argument types whose sums are exact: the rest row's sums and averages follow from the groups' own.
_EXACT_TYPES = ("int2", "int4", "int8", "numeric")


def applies(query: AnalyticQuery, rules: Rules) -> bool:
    """Whether :func:`parts` writes the suppression SQL of ``query``: its select list runs over released values,
    and each row is one person, or it has a GROUP BY and no magnitude rule applies (the count rules: each group's
    people bounded by its rows, counted only when the bounds leave them open), or :func:`two_level` (a total
    without them is the simple shape, one pass already)."""
    if query.post is None:
        return False
    if query.one_row_per_person:
        return True
    return query.grouped and (not (rules.magnitude_rules and query.magnitudes) or two_level(query, rules))


def two_level(query: AnalyticQuery, rules: Rules) -> bool:
    """Whether the rules' exact figures come from per-person cells (``anonproxy_cells``, computed only when the
    bounds leave a group open): a person may have several rows, the query has a GROUP BY and a magnitude rule
    applies (which needs each person's part of each group), every aggregate of the answer follows exactly from its
    values over each person's rows (counts, sums of exact types, extremes, averages of exact types: the rest row
    adds up the withheld groups' own values), and every plain select item is a grouping expression or a constant.
    Otherwise the per-person shape of anonproxy.suppress.rewrite. (Without a magnitude rule, counting each group's
    distinct people is cheaper than a pass per group and person.)"""
    post = query.post
    if query.one_row_per_person or not query.grouped or post is None or not (rules.magnitude_rules
                                                                                and query.magnitudes):
        return False
    aggregates = _aggregate_names(post)
    for column in _columns(query, post):
        if column.name in aggregates and column.rest is None:
            return False
        if column.name.startswith(PLAIN_PREFIX) and column.rest == "NULL" and _cell_key(query, column) is None:
            return False
    return True


def parts(query: AnalyticQuery, rules: Rules) -> tuple[Ctes, str, list[str]]:
    """The CTEs, the statement that follows them, and the names of the grouping columns of the verdicts."""
    post = query.post
    assert post is not None
    magnitudes = query.magnitudes if rules.magnitude_rules else ()
    rest = rules.rest and query.grouped
    keys = [key(k) for k in range(1, len(query.keys) + 1)]
    sums = [f"s{j}" for j in range(1, len(magnitudes) + 1)]
    flags = [f"n{j}" for j in range(1, len(query.contributors) + 1)]
    rows = query.one_row_per_person
    columns = _columns(query, post)
    linked = two_level(query, rules)
    covered: str | None = None  # the answer's people, counted before the summary (the bounded summary)
    bounded = query.grouped and not rows
    if bounded:
        ctes, covered = _bounded(query, rules, columns, magnitudes, flags, linked)
        query = replace(query, universe=f"SELECT n FROM {UNIVERSE}")
        if not linked:
            ctes.append((CELLS, _cells(query, keys, magnitudes, flags), ("each person's part of each group, read "
                         "only to follow people in several groups")))
    else:
        ctes = [(SUMMARY, _summary(query, columns, magnitudes, flags), ("one pass: each group's answer, "
                 "people, contributors, and total and largest contribution per SUM/AVG"))]
        ctes.append((f"{UNIVERSE}(n)", _universe(query, rules.k), "N: the people of the FROM clause"))
        query = replace(query, universe=f"SELECT n FROM {UNIVERSE}")
        ctes.append((CELLS, _cells(query, keys, magnitudes, flags), ("each person's part of each group, read only "
                     "to rank contributions, or to follow people in several groups")))
    verdict = PRIMARY if query.grouped else GROUPS
    # Bounds that settle every group settle primary suppression: a group's rows, standing in for its people, may
    # leave 1 to k - 1 of N out where its people leave k out (through the other groups' rows).
    settled = f"(SELECT sure FROM {SURE})" if bounded else None
    ctes += bounded_verdicts(query, rules, keys, sums, flags, verdict, settled)
    if query.grouped:
        if rows:
            ctes.append((f"{ANSWERED}(n, disjoint)", f"SELECT coalesce(sum(units), 0), true FROM {PRIMARY}",
                         "the people of the answer; each is in one group"))
        # The answer's people from its rows, not from the cells, which are then computed only if a group is withheld
        # (unless the summary comes from the cells).
        where = f" WHERE {query.where}" if query.where is not None else ""
        units = f"SELECT {query.unit} AS unit FROM {query.from_sql}{where} GROUP BY 1"
        ctes += complementary(query, rules, keys, sums, flags, rest, rows=rows, units=units, covered=covered)
        ctes.append((WITHHELD, f"SELECT {', '.join(keys)} FROM {GROUPS} WHERE NOT released",
                     "the groups that were suppressed"))
        released = f"{key_tuple(keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {GROUPS} WHERE released)"
    else:
        released = f"(SELECT released FROM {GROUPS})"
    answer = [f"SELECT {', '.join(column.name for column in columns if column.answer)}", f"FROM {SUMMARY}",
              f"WHERE {released}"]
    if rest:
        ctes += _rest(query, rules, keys, sums, flags)
        answer += ["UNION ALL", _rest_row(query, columns, keys)]
    # Materialized: the client's post-aggregate expressions, which may raise errors, run on released rows only.
    ctes.append((f"{RELEASED}", "\n".join(answer), "the released groups, and the suppressed-rest row"))
    return ctes, over_released(query, post), keys


def _bounded(query: AnalyticQuery, rules: Rules, columns: list[_Column], magnitudes: tuple[str, ...],
             flags: list[str], linked: bool) -> tuple[Ctes, str | None]:
    """The summary of a GROUP BY whose rows are not known to be people: the answer and each group's bounds in one
    pass PostgreSQL can split over workers (``anonproxy_rows``); each group's exact people, contributors and
    contributions only when the bounds cannot prove that every group passes (``anonproxy_group_people``, from the
    per-person cells where a magnitude rule applies: ``linked``, :func:`two_level`).

    The bounds need no pass per person. Each person falls in one of 64 buckets by their unit (:func:`_unit_number`):
    people in different buckets are different people, so a group holds at least as many people as it has buckets
    with a unit (``unit_low``), and contributors likewise. A person's part of a SUM/AVG is at most the total of the
    absolute values in their bucket (one of :data:`_SUM_BUCKETS`, fewer, so that each holds a share of a large
    group), and the total of the absolute parts is at least ``|sum(x)|``. A group of ``r`` rows with a unit holds at
    most ``r`` people, so it leaves out of N at least ``N - r``; where each person is in one group, at least the
    other groups' people. When every group surely holds k people and k contributors per aggregate, surely leaves k
    of N out, surely passes the magnitude rules at those bounds, and the answer leaves out of N nobody or k people,
    every group is released whatever its exact figures (``anonproxy_sure``): primary suppression releases every
    group on that proof (not on the bounds, which are not the figures), complementary suppression stops at step 0
    and reads none of them, and the summary carries the bounds in their place. Otherwise the exact figures, as
    before. Returns the CTEs and the SQL of the answer's people with a WHERE (None without: N)."""
    k, unit = rules.k, query.unit
    protected = _one_group_per_person(query)
    number = _unit_number(query)
    bucket = f"1::bigint << (({number}) & 63)::int"
    tests = [contributes(rule, argument) for rule, argument in query.contributors]
    bounds = [f"count({unit}) AS unit_rows", f"{_buckets_held(f'bit_or({bucket})')} AS unit_low",
              *(f"{_buckets_held(f'bit_or({bucket}) FILTER (WHERE {test})')} AS unit_low_{flag}"
                for test, flag in zip(tests, flags, strict=True))]
    for j, argument in enumerate(magnitudes, 1):
        # Rows without a unit fall in bucket 0: the exact path counts them as one contribution.
        parts = [f"sum({_contribution(query, argument)}) FILTER (WHERE coalesce(({number}) & {_SUM_BUCKETS - 1}, 0) "
                 f"= {b})" for b in range(_SUM_BUCKETS)]
        bounds += [f"coalesce(abs(sum({argument})::numeric), 0) AS least_t{j}",
                   f"coalesce(greatest({', '.join(parts)}), 0)::numeric AS largest_part{j}"]
    select = [f"{column.expression} AS {column.name}" for column in columns]
    ctes: Ctes = [(ROWS, _grouped(query, [*select, *bounds]), ("one pass: each group's answer, its rows with a unit, "
                   "the buckets of people it holds (per aggregate those that contribute), and per SUM/AVG the "
                   "bounds of its contributions"))]
    counted = f"(SELECT n FROM {COUNTED})"
    if protected is not None:  # the other groups' people are not in this one: the statement checks the catalog
        left = f"all_low - unit_low >= {k}"
        compared: list[str] = []
        rows = f"SELECT *, sum(unit_low) OVER () AS all_low FROM {ROWS} WHERE {one_row_per_person(*protected)}"
    else:
        left = f"unit_rows <= {counted} - {k}"
        compared = [f"(SELECT coalesce(max(unit_rows), 0) FROM {ROWS})"]
        rows = f"SELECT * FROM {ROWS}"
    surely = [f"unit_low >= {k}", left, *(f"unit_low_{flag} >= {k}" for flag in flags)]
    for j in range(1, len(magnitudes) + 1):
        surely += surely_hold(rules, f"least_t{j}", f"largest_part{j}")
    sure = f"NOT EXISTS (SELECT FROM ({rows}) AS r\n  WHERE ({' AND '.join(surely)}) IS NOT TRUE)"
    covered = None
    if query.where is not None:
        # count(unit): rows without a unit are nobody (counted as one person, a WHERE that left out one was not).
        ctes.append((f"{COVERED}(n)", (f"SELECT count(unit) FROM (SELECT {unit} AS unit FROM {query.from_sql}\n"
                                       f"WHERE {query.where} GROUP BY 1) AS people"), "the people of the answer"))
        covered = f"SELECT n FROM {COVERED}"
        compared.append(f"({covered})")
        sure += f"\n  AND {left_out(f'{counted} - ({covered})', rules)}"
    limit = f"greatest({', '.join(compared)}) + {k}" if len(compared) > 1 else " + ".join([*compared, str(k)])
    people = f"{_units(query, unit_not_null=True)} LIMIT {limit}"
    ctes.append((f"{COUNTED}(n)", f"SELECT count(*) FROM ({people}) AS anonproxy_units",
                 "N counted up to k more than every figure the bounds compare with it"))
    ctes.append((f"{SURE}(sure)", f"SELECT {sure}", ("every group surely passes the rules at its bounds, and the "
                 "answer leaves out of N nobody or k people")))
    everyone = f"(SELECT count(unit) FROM ({_units(query)}) AS anonproxy_units)"
    ctes.append((f"{UNIVERSE}(n)", f"SELECT CASE WHEN (SELECT sure FROM {SURE}) THEN {counted} ELSE {everyone} END",
                 ("N: counted up to a limit when the bounds settle every group (every verdict is then the same), "
                  "else every person")))
    unsure = f"NOT (SELECT sure FROM {SURE})"
    keys = [key(i) for i in range(1, len(query.keys) + 1)]
    sums = [f"s{j}" for j in range(1, len(magnitudes) + 1)]
    exact: list[str]
    if linked:
        ctes.append((CELLS, _linked_cells(query, keys, magnitudes, flags, unsure), ("each person's part of each "
                     "group and of each SUM/AVG, computed only when the bounds do not settle the rules")))
        exact = _cell_counts(sums, flags)
        body = "\n".join([f"SELECT {', '.join([*keys, *exact])}", f"FROM {CELLS}", f"GROUP BY {', '.join(keys)}"])
    else:
        exact = [f"{expression} AS {name}" for expression, name in zip(query.keys, keys, strict=True)]
        exact += [f"count(DISTINCT {unit}) AS units",
                  *(f"count(DISTINCT {unit}) FILTER (WHERE {test}) AS {flag}" for test, flag in zip(tests, flags,
                                                                                                      strict=True))]
        body = _grouped(query, exact, unsure)
    ctes.append((GROUP_PEOPLE, body, ("each group's people, contributors and contributions, counted only when the "
                 "bounds do not settle the rules" + (", from its cells" if linked else ""))))
    chosen = f"CASE WHEN (SELECT sure FROM {SURE}) THEN r.{{}} ELSE p.{{}} END AS {{}}"
    summary = [f"r.{column.name}" for column in columns]
    summary += [chosen.format("unit_rows", "units", "units"),
                *(chosen.format(f"unit_low_{flag}", flag, flag) for flag in flags)]
    for j in range(1, len(magnitudes) + 1):
        summary += [chosen.format(f"least_t{j}", f"t{j}", f"t{j}"),
                    chosen.format(f"largest_part{j}", f"m{j}", f"m{j}")]
    on = " AND ".join(f"ARRAY[r.{name}] = ARRAY[p.{name}]" for name in keys)
    ctes.append((SUMMARY, "\n".join([f"SELECT {', '.join(summary)}",
                                      f"FROM {ROWS} AS r LEFT JOIN {GROUP_PEOPLE} AS p ON {on}"]),
                 ("each group's answer, with its people, contributors and contributions (the bounds standing in "
                  "when they settle the rules)")))
    return ctes, covered


def _units(query: AnalyticQuery, unit_not_null: bool = False) -> str:
    """The distinct units of the FROM clause (the WHERE not), in the unit's order where indexes give it: PostgreSQL
    then reads them along the indexes (a merge join for a linked table), where unordered it plans a hash of every
    person when the table is small, twice as slow."""
    lines = [f"SELECT {query.unit} AS unit FROM {query.from_sql}"]
    if unit_not_null:
        lines.append(f"WHERE {query.unit} IS NOT NULL")
    lines.append("GROUP BY 1" + (" ORDER BY 1" if _indexed_units(query) else ""))
    return " ".join(lines)


def _unit_number(query: AnalyticQuery) -> str:
    """An integer of each person's unit, the same for units GROUP BY takes as one, NULL for rows without a unit: the
    unit itself where the catalog types it as an integer; else, where its type is one PostgreSQL hashes (or was not
    read), its hash by that type's own hash function (hash_array, with the unit's collation; it hashes NULL too);
    else 0: every person in one bucket, so that the bounds prove one person a group and the exact path answers."""
    unit_type = _unit_type(query)
    if unit_type in _INTEGERS:
        return query.unit
    hashed = unit_type is None or re.sub(r"\(.*?\)", "", unit_type) in _HASHED_TYPES
    number = f"hash_array(ARRAY[{query.unit}])" if hashed else "0"
    return f"CASE WHEN {query.unit} IS NOT NULL THEN {number} END"


def _unit_type(query: AnalyticQuery) -> str | None:
    """The unit's type as the policy read it from the catalog (a domain's base type, format_type), if it did."""
    for reference, table in query.sources:
        if table.protected is not None:
            column, types = table.protected.unit_column, table.protected.types
        elif table.linked is not None:
            column, types = table.linked.column, table.linked.types
        else:
            continue
        if f"{quote(reference)}.{quote(column)}" == query.unit:
            return (types or {}).get(column)
    return None


def _buckets_held(mask: str) -> str:
    """The bits set in a bigint ``mask`` (0 for NULL): the buckets a group's people fall in."""
    return f"coalesce(length(replace(({mask})::bit(64)::text, '0', '')), 0)"


def _grouped(query: AnalyticQuery, select: list[str], condition: str | None = None) -> str:
    """``select`` over the FROM clause, the client's WHERE (and ``condition``), grouped by the client's keys."""
    conditions = [*([condition] if condition is not None else []),
                  *([f"({query.where})"] if query.where is not None else [])]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if conditions:
        lines.append("WHERE " + " AND ".join(conditions))
    lines.append(f"GROUP BY {', '.join(query.keys)}")
    return "\n".join(lines)


def _universe(query: AnalyticQuery, k: int) -> str:
    """N, or where each row is one person a figure that decides every rule as N does. One row per person: the groups'
    people add up to the answer's people, and without a WHERE every row is in a group, so that N is their sum without
    another scan. With a WHERE, N is that sum plus the rows the WHERE leaves out; those are counted only up to k (a
    scan that stops at the k-th): every rule compares N - x with 1..k-1 for some x between 0 and the answer's people,
    and at k rows left out or more, N - x and the sum plus k, minus x, are both at least k. Either way, once the
    catalog says each row is still one person (sql/0023: a condition that reads no column, checked once). Otherwise
    the distinct units of the FROM clause."""
    if not query.one_row_per_person:
        return query.universe
    relation, unit = _protected(query)
    check = f"WHERE {one_row_per_person(relation, unit)}"
    n = "coalesce(sum(units), 0)"
    if query.where is not None:
        outside = f"SELECT FROM {query.from_sql} WHERE ({query.where}) IS NOT TRUE LIMIT {k}"
        n += f" + (SELECT count(*) FROM ({outside}) AS left_out)"
    return f"SELECT {n} FROM {SUMMARY}\n{check}"


def _protected(query: AnalyticQuery) -> tuple[str, str]:
    """The protected table (quoted, schema-qualified) and its unit column's name."""
    tables = [table for _, table in query.sources if table.protected is not None]
    assert len(tables) == 1 and tables[0].protected is not None
    return tables[0].qualified, tables[0].protected.unit_column


def withheld_people(query: AnalyticQuery, keys: list[str]) -> str:
    """The people of the withheld groups, for the report: their groups' own counts add up where each row is one
    person; else their distinct units."""
    if query.one_row_per_person:
        return f"SELECT coalesce(sum(units), 0) FROM {PRIMARY}\nWHERE {_withheld(keys)}"
    return f"SELECT count(DISTINCT unit) FROM {CELLS}\nWHERE {_withheld(keys)}"


def _withheld(keys: list[str]) -> str:
    """The rows of the withheld groups. The EXISTS reads no column: PostgreSQL checks it once, and when nothing was
    withheld it never reads the rows (nor computes anonproxy_cells for them)."""
    return (f"EXISTS (SELECT FROM {WITHHELD}) AND {key_tuple(keys)} IN "
            f"(SELECT {key_tuple(keys, bare=True)} FROM {WITHHELD})")


@dataclass(frozen=True)
class _Column:
    """A column of the summary."""

    name: str
    expression: str  # computed per group
    rest: str | None  # its value in the rest row, from the withheld groups' rows of the summary (None: not so)
    answer: bool = True  # a column of the released rows (False: a part of another column's rest value)


def _columns(query: AnalyticQuery, post: PostAggregate) -> list[_Column]:
    """The summary's answer columns: the GROUP BY expressions, the plain select items and each distinct aggregate,
    named as the post-aggregate select list reads them, with the hidden parts of the rest row's averages."""
    columns = [_Column(key(k), expression, "NULL") for k, expression in enumerate(query.keys, 1)]
    columns += [_Column(plain(i), item.expression, "NULL" if item.kind == "group" else item.expression)
                for i, item in enumerate(query.items, 1) if item.kind in ("group", "constant")]
    types = {typed.sql: typed.type for typed in query.argument_types}
    for j, node in enumerate(post.aggregates, 1):
        aggregate = query.text_of(node)
        columns += _combined(value(j), aggregate, types.get(aggregate.argument or ""), j)
    return columns


def _combined(name: str, aggregate: AggregateText, argument_type: str | None, j: int) -> list[_Column]:
    """The summary column of ``aggregate`` and, where its value over several groups follows exactly from the groups'
    own values, how the rest row computes it so: count and sum add up (in the aggregate's own result type), min and
    max are the least and greatest, avg is the sum of the groups' sums over the sum of their counts. Not for
    DISTINCT, spreads or floating-point sums, whose value over the rows the rest row reads them again for."""
    node = aggregate.node.this if isinstance(aggregate.node, exp.Filter) else aggregate.node
    filtered = f" FILTER (WHERE {aggregate.filter})" if aggregate.filter is not None else ""
    exact = argument_type in _EXACT_TYPES
    rest: str | None = None
    hidden: list[_Column] = []
    if isinstance(node.this, exp.Distinct):
        pass
    elif isinstance(node, exp.Count) or (isinstance(node, exp.Sum) and argument_type in _SMALL_INTEGERS):
        rest = f"sum({name})::bigint"  # count's type, and sum's of smallint and integer
    elif isinstance(node, exp.Sum) and exact:
        rest = f"sum({name})"  # numeric, as sum of bigint and numeric
    elif isinstance(node, (exp.Min, exp.Max)):
        rest = f"{'min' if isinstance(node, exp.Min) else 'max'}({name})"
    elif isinstance(node, exp.Avg) and exact:
        parts = (f"anonproxy_sum{j}", f"anonproxy_count{j}")
        hidden = [_Column(parts[0], f"sum({aggregate.argument}){filtered}", None, answer=False),
                  _Column(parts[1], f"count({aggregate.argument}){filtered}", None, answer=False)]
        # PostgreSQL's avg of these types is their exact sum divided by their count, as numeric.
        rest = f"sum({parts[0]})::numeric / NULLIF(sum({parts[1]}), 0)"
    return [_Column(name, aggregate.text, rest), *hidden]


def _contribution(query: AnalyticQuery, argument: str) -> str:
    """A person's absolute contribution to a SUM/AVG of ``argument``, in a type whose abs() cannot overflow."""
    types = {typed.sql: typed.type for typed in query.argument_types}
    target = "bigint" if types.get(argument) in _SMALL_INTEGERS else "numeric"
    return f"abs(({argument})::{target})"


def _summary(query: AnalyticQuery, columns: list[_Column], magnitudes: tuple[str, ...], flags: list[str]) -> str:
    select = [f"{column.expression} AS {column.name}" for column in columns]
    if query.one_row_per_person:
        select.append("count(*) AS units")
        select += [f"count(*) FILTER (WHERE {contributes(rule, argument)}) AS {flag}"
                   for (rule, argument), flag in zip(query.contributors, flags, strict=True)]
    else:
        select.append(f"count(DISTINCT {query.unit}) AS units")
        select += [f"count(DISTINCT {query.unit}) FILTER (WHERE {contributes(rule, argument)}) AS {flag}"
                   for (rule, argument), flag in zip(query.contributors, flags, strict=True)]
    for j, argument in enumerate(magnitudes, 1):
        contribution = _contribution(query, argument)
        select += [f"coalesce(sum({contribution}), 0)::numeric AS t{j}",
                   f"coalesce(max({contribution}), 0)::numeric AS m{j}"]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    if query.grouped:
        lines.append(f"GROUP BY {', '.join(query.keys)}")
    return "\n".join(lines)


def _cells(query: AnalyticQuery, keys: list[str], magnitudes: tuple[str, ...], flags: list[str]) -> str:
    """Each person's part of each group. One row per person: the rows themselves. Otherwise (no magnitude rule
    then) one row per group and person, and whether one of the person's rows contributes to each aggregate."""
    select = [f"{expression} AS {name}" for expression, name in zip(query.keys, keys, strict=True)]
    select.append(f"{query.unit} AS unit")
    select += [f"{argument} AS s{j}" for j, argument in enumerate(magnitudes, 1)]
    tests = [contributes(rule, argument) for rule, argument in query.contributors]
    if query.one_row_per_person:
        select += [f"{test} AS {flag}" for test, flag in zip(tests, flags, strict=True)]
    else:
        select += [f"bool_or({test}) AS {flag}" for test, flag in zip(tests, flags, strict=True)]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    if not query.one_row_per_person:
        lines.append(f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 2))}")
    return "\n".join(lines)


def _one_group_per_person(query: AnalyticQuery) -> tuple[str, str] | None:
    """The protected table (quoted, schema-qualified) and its unit column when each person is in one group: the
    catalog makes that unit unique and not null (one row per person in that table), it is the query's unit, and
    every grouping expression reads only that table's columns, so that a person's rows of a linked table all share
    their group. None otherwise: a bare column name another table of the query also has, a table whose columns are
    not known, or the protected table LEFT JOINed to the linked one (the unit is then the linked table's key, and a
    condition next to the join's key sends some of a person's rows to the NULL group, the others to their own)."""
    protected = [(reference, table) for reference, table in query.sources
                 if table.protected is not None and table.protected.unique_unit]
    if len(protected) != 1:
        return None
    reference, table = protected[0]
    assert table.protected is not None
    if query.unit != f"{quote(reference)}.{quote(table.protected.unit_column)}":
        return None
    others: set[str] = set()
    for other_reference, other in query.sources:
        if other_reference != reference:
            known = _known_columns(other)
            if known is None:
                return None
            others |= known
    own = _known_columns(table) or set()
    for node in query.key_nodes:
        for column in node.find_all(exp.Column):
            qualifier = column.table
            if qualifier != reference and (qualifier or column.name not in own or column.name in others):
                return None
    return table.qualified, table.protected.unit_column


def _indexed_units(query: AnalyticQuery) -> bool:
    """Whether an index leads with the unit (link) column of every protected and linked table of the FROM clause."""
    tables = [table.protected or table.linked for _, table in query.sources if table.reference is None]
    return all(table is not None and table.indexed_unit for table in tables)


def _known_columns(table: ResolvedTable) -> set[str] | None:
    """A table's columns as the catalog said when the policy was read; None when not read."""
    declared = table.protected or table.linked or table.reference
    types = declared.types if declared is not None else None
    return set(types) if types is not None else None


def _cell_key(query: AnalyticQuery, column: _Column) -> str | None:
    """The grouping column (``anonproxy_g<k>``) a plain select item of a grouping expression reads, if it is one."""
    for k, expression in enumerate(query.keys, 1):
        if column.expression == expression:
            return key(k)
    return None


def _linked_cells(query: AnalyticQuery, keys: list[str], magnitudes: tuple[str, ...], flags: list[str],
                  condition: str) -> str:
    """One row per group and person (when ``condition`` holds): the person's part of each SUM/AVG argument, and
    whether one of their rows contributes to each aggregate."""
    select = [f"{expression} AS {name}" for expression, name in zip(query.keys, keys, strict=True)]
    select.append(f"{query.unit} AS unit")
    select += [f"sum({argument}) AS s{j}" for j, argument in enumerate(magnitudes, 1)]
    select += [f"bool_or({contributes(rule, argument)}) AS {flag}"
               for (rule, argument), flag in zip(query.contributors, flags, strict=True)]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}",
             "WHERE " + " AND ".join([condition, *([f"({query.where})"] if query.where is not None else [])]),
             f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 2))}"]
    return "\n".join(lines)


def _cell_counts(sums: list[str], flags: list[str]) -> list[str]:
    """A group's people, contributors, and total and largest absolute contribution per SUM/AVG, from its cells (one
    per person of the group)."""
    counted = ["count(unit) AS units", *(f"count(unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]
    for s in sums:
        contribution = f"abs(coalesce({s}, 0))::numeric"
        counted += [f"coalesce(sum({contribution}), 0) AS t{s[1:]}", f"coalesce(max({contribution}), 0) AS m{s[1:]}"]
    return counted


def _aggregate_names(post: PostAggregate) -> set[str]:
    return {value(j) for j in range(1, len(post.aggregates) + 1)}


def _rest(query: AnalyticQuery, rules: Rules, keys: list[str], sums: list[str], flags: list[str]) -> Ctes:
    """``anonproxy_rest``: whether the rest row passes the rules, from the withheld groups' own counts and totals;
    their rows are ranked only when the totals leave a magnitude rule open."""
    ctes: Ctes = []
    withheld = _withheld(keys)
    # Query-set-size control, as for a query without GROUP BY: the rest row is a total over its own people, and
    # with the released rows it adds up to a total over everyone the answer covers; both must leave out of N
    # nobody or at least k people.
    conditions = [query_set_size("units", query, rules),
                  left_out(f"({query.universe}) - (SELECT n FROM {ANSWERED})", rules),
                  *(f"{flag} >= {rules.k}" for flag in flags)]
    if sums and not query.one_row_per_person:
        return _linked_rest(query, rules, keys, sums, flags, conditions)
    if sums:
        ctes += ranked_verdict(f"(SELECT * FROM {CELLS} WHERE {withheld}) AS withheld", REST_RANKED, REST_EXACT,
                               [], sums, [], "true", rules, "the magnitude rules on the rest row's ranked contributions")
        exact = f"(SELECT released FROM {REST_EXACT})"
        conditions += [magnitude_bounds(rules, f"t{s[1:]}", f"m{s[1:]}").verdict(exact) for s in sums]
    if query.one_row_per_person:  # each person in one group: the groups' own counts and totals add up
        counted = ["coalesce(sum(units), 0) AS units", *(f"coalesce(sum({flag}), 0) AS {flag}" for flag in flags),
                   *(f"coalesce(sum(t{s[1:]}), 0) AS t{s[1:]}, coalesce(max(m{s[1:]}), 0) AS m{s[1:]}" for s in sums)]
        source = PRIMARY
    else:  # people may be in several withheld groups: each counted once
        counted = ["count(DISTINCT unit) AS units",
                   *(f"count(DISTINCT unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]
        source = CELLS
    ctes.append((REST, "\n".join([
        "SELECT " + "\n       AND ".join(conditions) + " AS released",
        f"FROM (SELECT {', '.join(counted)} FROM {source} WHERE {withheld}) AS rest",
    ]), "the rest row is released only if it passes the same rules, query-set-size control included"))
    return ctes


def _linked_rest(query: AnalyticQuery, rules: Rules, keys: list[str], sums: list[str], flags: list[str],
                 conditions: list[str]) -> Ctes:
    """``anonproxy_rest`` where a person may be in several withheld groups and a magnitude rule applies: each
    person's part of the withheld groups (``anonproxy_rest_cells``), counted once, their total and largest
    contribution per SUM/AVG; ranked only when those leave a rule open."""
    parts = ["unit", *(f"sum({s}) AS {s}" for s in sums), *(f"bool_or({flag}) AS {flag}" for flag in flags)]
    ctes: Ctes = [(REST_CELLS, f"SELECT {', '.join(parts)}\nFROM {CELLS}\nWHERE {_withheld(keys)}\nGROUP BY 1",
                   "each person's part of the withheld groups")]
    ctes += ranked_verdict(REST_CELLS, REST_RANKED, REST_EXACT, [], sums, [], "true", rules,
                           "the magnitude rules on the rest row's ranked contributions")
    exact = f"(SELECT released FROM {REST_EXACT})"
    conditions = conditions + [magnitude_bounds(rules, f"t{s[1:]}", f"m{s[1:]}").verdict(exact) for s in sums]
    counted = ["count(unit) AS units", *(f"count(unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]
    for s in sums:
        contribution = f"abs(coalesce({s}, 0))::numeric"
        counted += [f"coalesce(sum({contribution}), 0) AS t{s[1:]}", f"coalesce(max({contribution}), 0) AS m{s[1:]}"]
    ctes.append((REST, "\n".join([
        "SELECT " + "\n       AND ".join(conditions) + " AS released",
        f"FROM (SELECT {', '.join(counted)} FROM {REST_CELLS}) AS rest",
    ]), "the rest row is released only if it passes the same rules, query-set-size control included"))
    return ctes


def _rest_row(query: AnalyticQuery, columns: list[_Column], keys: list[str]) -> str:
    """The suppressed-rest row: the client's aggregates over every withheld group, NULL for the grouping columns.
    From the withheld groups' rows of the summary where each aggregate follows from them; else from the rows of
    those groups, read only when the rest row is released (a condition PostgreSQL checks once)."""
    answer = [column for column in columns if column.answer]
    withheld = f"IN (SELECT {key_tuple(keys, bare=True)} FROM {WITHHELD})"
    released = f"(SELECT released FROM {REST})"
    if all(column.rest is not None for column in answer):
        return "\n".join([f"SELECT {', '.join(str(column.rest) for column in answer)}", f"FROM {SUMMARY}",
                          f"WHERE {key_tuple(keys)} {withheld}", f"HAVING {released}"])
    items = ", ".join("NULL" if column.rest == "NULL" else column.expression for column in answer)
    conditions = [released, *([f"({query.where})"] if query.where is not None else []),
                  f"{key_tuple(query.keys)} {withheld}"]
    return "\n".join([f"SELECT {items}", f"FROM {query.from_sql}", "WHERE " + "\n  AND ".join(conditions),
                      f"HAVING {released}"])


def over_released(query: AnalyticQuery, post: PostAggregate) -> str:
    """The client's select list, HAVING (as WHERE), ORDER BY and LIMIT over ``anonproxy_released``: the answer of
    this shape and of the released shape (anonproxy.suppress.rewrite)."""
    lines = [f"SELECT {'DISTINCT ' if query.distinct else ''}{', '.join(item.sql for item in post.items)}",
             f"FROM {RELEASED}"]
    if post.having is not None:
        lines.append(f"WHERE {post.having}")
    if post.order:
        lines.append(f"ORDER BY {', '.join(post.order)}")
    if query.tail is not None:
        lines.append(query.tail)
    return "\n".join(lines)
