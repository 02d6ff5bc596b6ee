"""Build the suppression SQL for an analytic query (docs/suppression.md, "The rewritten SQL").

* **one pass** (:mod:`anonproxy.suppress.one_pass`): where each row is one
  person, every query; elsewhere a GROUP BY without a magnitude rule to apply.

* **simple** (otherwise, a total without GROUP BY, no magnitude rule applies):
  the client's query with one more HAVING condition, query-set-size control:
  at least k distinct units, and nobody or at least k of the FROM clause's N
  people left out (a total over everyone is public; one over all but a few
  would single those few out by one subtraction).

* **cells**, the per-person shape (otherwise: a sum under dominance or p %
  where a person may have several rows, in a total, or in a GROUP BY whose
  aggregates the one-pass module's two levels cannot combine from each
  person's rows): CTEs compute each privacy unit's
  contribution per group (``anonproxy_cells``), summarize each group
  (``anonproxy_summary``), decide per group alone (``anonproxy_primary``,
  ranking contributions only where the group's total and largest leave a
  magnitude rule open), then complementary suppression withholds the
  smallest groups that pass alone until the withheld groups pass together
  (:func:`complementary`, ``anonproxy_groups.released``); the client's query
  keeps only the released groups through a hashed ``IN`` on ``ARRAY[key]``
  (an array compares NULL keys as equal, like GROUP BY does). The rest row is
  a second branch of a UNION ALL over the rows of every withheld group,
  released only if that rest itself passes the same rules, query-set-size
  control included.

The client's HAVING is evaluated on released groups and on the rest row only,
never on a withheld group: the rest row holds every withheld group, and no
verdict reads the HAVING. The client's select list, WHERE, GROUP BY, HAVING,
ORDER BY and LIMIT are rendered from the checked tree, so output names and
types, and ``$n`` parameters, are unchanged; ORDER BY and LIMIT apply after
suppression.

* **released** (post-aggregate expressions: ``round(avg(x), 1)``,
  ``sum(x) / count(*)``, a HAVING over them, ...): one of the shapes above
  selects the GROUP BY expressions, the plain select items and each distinct
  aggregate (``anonproxy_g<k>``, ``anonproxy_c<i>``, ``anonproxy_v<j>``) and
  becomes a ``MATERIALIZED`` CTE, ``anonproxy_released``; an outer SELECT
  computes the client's select list, HAVING (as WHERE), ORDER BY and LIMIT
  from it (:mod:`anonproxy.plan.post_aggregate`). A materialized CTE is an
  optimization fence: PostgreSQL evaluates the outer expressions, which may
  raise errors, on released rows only, never on a withheld group.
"""

from __future__ import annotations

from dataclasses import replace

from anonproxy.plan.analysis import AnalyticQuery, Item
from anonproxy.plan.post_aggregate import RELEASED, PostAggregate, key, plain, value
from anonproxy.plan.refusals import unsupported
from anonproxy.policy.model import SuppressionParams
from anonproxy.suppress import one_pass
from anonproxy.suppress.complementary import complementary
from anonproxy.suppress.rules import (
    ANSWER,
    ANSWERED,
    CELLS,
    GROUPS,
    PRIMARY,
    REPORT,
    REPORT_FUNCTION,
    REST,
    REST_CELLS,
    REST_RANKED,
    SUMMARY,
    UNIVERSE,
    WITHHELD,
    WITHHELD_PEOPLE,
    Ctes,
    Rules,
    bounded_verdicts,
    contributes,
    key_tuple,
    left_out,
    query_set_size,
    ranked_verdict,
    string,
    with_ctes,
)


def rewrite(query: AnalyticQuery, params: SuppressionParams) -> str:
    rules = Rules(params)
    if one_pass.applies(query, rules):
        ctes, body, _ = one_pass.parts(query, rules)
        return with_ctes(ctes, materialized=(RELEASED,)) + "\n" + body
    if query.outer is not None:
        return _released(query, query.outer, rules)
    return _suppressed(query, rules)


def _suppressed(query: AnalyticQuery, rules: Rules) -> str:
    magnitudes = query.magnitudes if rules.magnitude_rules else ()
    if _is_simple(query, magnitudes):
        return _simple(query, rules)
    return _cells(query, rules, magnitudes, rules.rest and query.grouped)


def _is_simple(query: AnalyticQuery, magnitudes: tuple[str, ...]) -> bool:
    """One total and no magnitude rule: the rules are one HAVING condition. A GROUP BY always needs the cells
    shape, whose per-person cells complementary suppression counts."""
    return not query.grouped and not magnitudes


def _released(query: AnalyticQuery, outer: PostAggregate, rules: Rules) -> str:
    """The suppressed values of the GROUP BY expressions, plain items and aggregates, as a materialized CTE; the
    client's select list, HAVING, ORDER BY and LIMIT computed over it."""
    # A HAVING over post-aggregate expressions may raise an error, so it runs outside, over the released rows (the
    # rest row among them); a plain HAVING stays in the suppressed query, which evaluates it on released rows too.
    inner = [Item(f"{expression} AS {key(k)}", expression, "group", None)
             for k, expression in enumerate(query.keys, 1)]
    inner += [Item(f"{item.expression} AS {plain(i)}", item.expression, item.kind, None)
              for i, item in enumerate(query.items, 1) if item.kind in ("group", "constant")]
    inner += [Item(f"{query.text_of(node).text} AS {value(j)}", query.text_of(node).text, "aggregate", None)
              for j, node in enumerate(outer.aggregates, 1)]
    suppressed = replace(query, items=tuple(inner), distinct=False, group_by=query.keys, order=(), tail=None,
                         having=None if query.having_outer else query.having)
    # The body is not indented: a string constant of the client's may span lines.
    return "\n".join([f"WITH {RELEASED} AS MATERIALIZED (", _suppressed(suppressed, rules), ")",
                      one_pass.over_released(query, outer)])


def reported(query: AnalyticQuery, params: SuppressionParams) -> str:
    """:func:`rewrite`'s statement, wrapped so that running it also reports what suppression withheld.

    The answer is the same statement as a subquery (``SELECT * FROM (...) AS anonproxy_answer``: the same rows,
    order, column names and types). Next to it, CTEs count what was withheld: the cells shape's own verdicts, or,
    for the simple shape, one more pass deciding its total. A call of
    ``anonproxy.suppression_report()`` (sql/0022) hands those figures to the proxy as an INFO message, which the
    proxy turns into a NOTICE of its own words (anonproxy.suppress.explain) and never forwards. The call sits in a
    WHERE that reads no column, which PostgreSQL evaluates once, before the first row, even when the answer is
    empty. Only figures safe to release leave the database: see :func:`_report`.
    """
    rules = Rules(params)
    magnitudes = query.magnitudes if rules.magnitude_rules else ()
    rest = rules.rest and query.grouped
    if one_pass.applies(query, rules):
        ctes, body, keys = one_pass.parts(query, rules)
        query = replace(query, universe=f"SELECT n FROM {UNIVERSE}")
        withheld_people = one_pass.withheld_people(query, keys)
        total_units = f"(SELECT units FROM {GROUPS})"
    else:
        simple = _is_simple(query, magnitudes)
        if simple:
            keys = []
            counted, query = _counted_universe(query)
            ctes = counted + _simple_verdict(query, rules)
            body = _simple(query, rules)
        else:
            ctes, body = _cells_parts(query, rules, magnitudes, rest)
            query = replace(query, universe=f"SELECT n FROM {UNIVERSE}")
            keys = [f"g{i}" for i in range(1, len(query.keys) + 1)]
        withheld_people = (f"SELECT count(DISTINCT unit) FROM {CELLS}\n"
                           f"WHERE {key_tuple(keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {WITHHELD})")
        total_units = f"(SELECT units FROM {GROUPS})" if simple else f"(SELECT count(unit) FROM {CELLS})"
    if query.grouped:
        ctes.append((f"{WITHHELD_PEOPLE}(n)", withheld_people, "the people withheld"))
    ctes.append((REPORT, _report(query, rules, keys, rest, total_units),
                 "what the proxy says about suppression, in a NOTICE"))
    # The body is not indented: a string constant of the client's may span lines.
    return "\n".join([with_ctes(ctes, materialized=(RELEASED,)), "SELECT *", "FROM (", body, f") AS {ANSWER}",
                      f"WHERE (SELECT reported FROM {REPORT})"])


def _report(query: AnalyticQuery, rules: Rules, keys: list[str], rest: bool, total_units: str) -> str:
    """The call of ``anonproxy.suppression_report(k, relation, labels, groups, complementary, total, rest,
    null_group)``.

    * ``groups``: how many groups were withheld, and ``complementary``: how many of them only so that the withheld
      groups together pass the rules (complementary suppression); both only when those groups hold k people or
      more together and leave out of N nobody or k people (NULL otherwise, which the proxy cannot tell from
      none). The counts are then counts over a query set that query-set-size control would release (a
      ``count(DISTINCT key)`` over their rows tells as much); without that condition they would say whether a
      filter matches anybody at all (``WHERE <one person's attributes> AND income = '>50K'``: 1 group or none).
    * ``total`` (no GROUP BY): ``qss`` when the one total was withheld by query-set-size control, ``rules`` when by
      the contributor or magnitude rules (a count(*) with the same WHERE tells which), NULL when it was released;
      the client's HAVING is left out, so the notice never says whether it held for a withheld total.
    * ``rest``: whether the suppressed-rest row was released (NULL: no rest row); ``null_group``: whether a
      released group also has NULL in every grouping column, so that two rows look alike.
    """
    labels: str = "NULL"
    groups = complementary = total = rest_released = null_group = "NULL"
    if query.grouped:
        labels = "ARRAY[" + ", ".join(string(item.alias or item.expression)
                                      for item in query.items if item.kind == "group") + "]::text[]"
        sayable = query_set_size(f"(SELECT n FROM {WITHHELD_PEOPLE})", query, rules)
        groups = f"CASE WHEN {sayable} THEN (SELECT count(*) FROM {WITHHELD}) END"
        complementary = f"CASE WHEN {sayable} THEN (SELECT count(*) FROM {GROUPS} WHERE NOT released AND step > 0) END"
        if rest:
            rest_released = f"(SELECT released FROM {REST})"
            # Whether the client's HAVING keeps that group is not asked: it would be evaluated on every group.
            null_group = (f"EXISTS (SELECT 1 FROM {GROUPS} WHERE released AND "
                          f"{' AND '.join(f'{key} IS NULL' for key in keys)})")
    else:
        sized = query_set_size(total_units, query, rules)
        total = f"CASE WHEN (SELECT released FROM {GROUPS}) THEN NULL WHEN {sized} THEN 'rules' ELSE 'qss' END"
    arguments = [str(rules.k), string(query.table), labels, groups, complementary, total, rest_released, null_group]
    return f"SELECT {REPORT_FUNCTION}(\n  " + ",\n  ".join(arguments) + "\n) AS reported"


def _simple(query: AnalyticQuery, rules: Rules) -> str:
    return _client_select(query, _group_rules(query, rules), with_order=True)


def _group_rules(query: AnalyticQuery, rules: Rules) -> str:
    """The simple shape's condition on its total: query-set-size control, and k contributing units per aggregate."""
    conditions = [query_set_size(f"count(DISTINCT {query.unit})", query, rules)]
    conditions += [f"count(DISTINCT CASE WHEN {contributes(rule, argument)} THEN {query.unit} END) >= {rules.k}"
                   for rule, argument in query.contributors]
    return "\n   AND ".join(conditions)


def _simple_verdict(query: AnalyticQuery, rules: Rules) -> Ctes:
    """``anonproxy_groups`` for the simple shape: whether its one total is released, and its distinct units; one
    pass over the rows, like the answer's."""
    select = [f"{_group_rules(query, rules)}\n     AS released", f"count(DISTINCT {query.unit}) AS units"]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    return [(GROUPS, "\n".join(lines), "whether the total is released, and its people")]


def _cells(query: AnalyticQuery, rules: Rules, magnitudes: tuple[str, ...], rest: bool) -> str:
    ctes, body = _cells_parts(query, rules, magnitudes, rest)
    return with_ctes(ctes) + "\n" + body


def _counted_universe(query: AnalyticQuery) -> tuple[Ctes, AnalyticQuery]:
    """N, the people of the FROM clause, as a CTE counted once, and ``query`` reading it from there: the verdicts,
    the steps and the report all compare with it, and each uncorrelated subquery would be a scan of its own."""
    return ([(f"{UNIVERSE}(n)", query.universe, "N: the people of the FROM clause")],
            replace(query, universe=f"SELECT n FROM {UNIVERSE}"))


def _cells_parts(query: AnalyticQuery, rules: Rules, magnitudes: tuple[str, ...], rest: bool) -> tuple[Ctes, str]:
    """The cells shape: its CTEs, and the statement that follows them."""
    universe = query.universe
    query = replace(query, universe=f"SELECT n FROM {UNIVERSE}")
    keys, sums, flags, ctes = _group_verdicts(query, rules, magnitudes, rest, universe)
    if query.grouped:
        released = f"{key_tuple(query.keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {GROUPS} WHERE released)"
    else:
        released = f"(SELECT released FROM {GROUPS})"

    if query.grouped:
        ctes += _withheld(keys)
    if not rest:
        return ctes, _client_select(query, released, with_order=True)

    rest_select = ["unit"] + [f"sum({name}) AS {name}" for name in sums] + [f"bool_or({f}) AS {f}" for f in flags]
    ctes.append((REST_CELLS, "\n".join([
        f"SELECT {', '.join(rest_select)}",
        f"FROM {CELLS}",
        f"WHERE {key_tuple(keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {WITHHELD})",
        "GROUP BY 1",
    ]), "each privacy unit's part of the withheld rows"))
    # Query-set-size control, as for a query without GROUP BY: the rest row is a total over its own people, and
    # with the released rows it adds up to a total over everyone the answer covers; both must leave out of N
    # nobody or at least k people.
    population = (f"{query_set_size('count(unit)', query, rules)}\n"
                  f"         AND {left_out(f'({query.universe}) - (SELECT n FROM {ANSWERED})', rules)}")
    ctes += ranked_verdict(REST_CELLS, REST_RANKED, REST, [], sums, flags, population, rules,
                     "the rest row is released only if it passes the same rules, query-set-size control included")

    first = _client_select(query, released, with_order=False)
    items = ", ".join("NULL" if item.kind == "group" else item.expression for item in query.items)
    second = [f"SELECT {items}", f"FROM {query.from_sql}"]
    rows = f"{key_tuple(query.keys)} IN (SELECT {key_tuple(keys, bare=True)} FROM {WITHHELD})"
    second.append(f"WHERE ({query.where})\n  AND {rows}" if query.where is not None else f"WHERE {rows}")
    # The rest row holds every withheld group, whatever the client's HAVING would say of it (HAVING cannot be
    # evaluated on a withheld group without reading it); HAVING then filters the rest row as a released row.
    if query.having is not None:
        second.append(f"HAVING (SELECT released FROM {REST})\n   AND ({query.having})")
    else:
        second.append(f"HAVING (SELECT released FROM {REST})")
    tail = []
    if query.order:
        positions = []
        for item in query.order:
            if item.position is None:
                raise unsupported(
                    f"ORDER BY {item.text} must name an output column when the suppressed-rest row is on",
                    "Order by a select-list position (ORDER BY 2 DESC) or an output alias.")
            positions.append(f"{item.position} {item.suffix}".rstrip())
        tail.append(f"ORDER BY {', '.join(positions)}")
    if query.tail is not None:
        tail.append(query.tail)
    return ctes, "\n".join([first, "UNION ALL", *second, *tail])


def _group_verdicts(query: AnalyticQuery, rules: Rules, magnitudes: tuple[str, ...], rest: bool,
                    universe: str) -> tuple[list[str], list[str], list[str], Ctes]:
    """CTEs deciding each group (``anonproxy_groups.released``) from each unit's contribution to it, and the names
    of the key, sum and contributor columns of ``anonproxy_cells``. ``universe``: the SQL of N, counted once in
    ``anonproxy_universe``, which ``query`` reads."""
    keys = [f"g{i}" for i in range(1, len(query.keys) + 1)]
    sums = [f"s{j}" for j in range(1, len(magnitudes) + 1)]
    flags = [f"n{j}" for j in range(1, len(query.contributors) + 1)]
    ctes: Ctes = []

    select = [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select.append(f"{query.unit} AS unit")
    select += [f"sum({argument}) AS {name}" for argument, name in zip(magnitudes, sums, strict=True)]
    select += [f"bool_or({contributes(rule, argument)}) AS {name}"
               for (rule, argument), name in zip(query.contributors, flags, strict=True)]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    lines.append(f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 2))}")
    ctes.append((CELLS, "\n".join(lines), ("one row per group and privacy unit: its part of each SUM/AVG, and "
                 "whether it contributes to each aggregate")))
    if query.where is None:  # every row of the FROM clause is in a cell: N is the cells' distinct units (not NULL)
        ctes.append((f"{UNIVERSE}(n)", f"SELECT count(unit) FROM (SELECT unit FROM {CELLS} GROUP BY unit) AS people",
                     "N: the people of the FROM clause, all in the cells"))
    else:
        ctes.insert(0, (f"{UNIVERSE}(n)", universe, "N: the people of the FROM clause"))

    summary = [*keys, "count(unit) AS units", *(f"count(unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]
    for s in sums:
        contribution = f"abs(coalesce({s}, 0))::numeric"
        summary += [f"coalesce(sum({contribution}), 0) AS t{s[1:]}", f"coalesce(max({contribution}), 0) AS m{s[1:]}"]
    lines = [f"SELECT {', '.join(summary)}", f"FROM {CELLS}"]
    if keys:
        lines.append(f"GROUP BY {', '.join(keys)}")
    ctes.append((SUMMARY, "\n".join(lines), ("per group: its people, contributors, and total and largest "
                 "contribution per SUM/AVG")))
    ctes += bounded_verdicts(query, rules, keys, sums, flags, PRIMARY if query.grouped else GROUPS)
    if query.grouped:
        ctes += complementary(query, rules, keys, sums, flags, rest, rows=False)
    return keys, sums, flags, ctes


def _withheld(keys: list[str]) -> Ctes:
    """``anonproxy_withheld``: the groups that were suppressed, whatever the client's HAVING would say of them: it is
    evaluated on released groups and the rest row only."""
    return [(WITHHELD, f"SELECT {', '.join(keys)} FROM {GROUPS} WHERE NOT released", "the groups that were suppressed")]


def _client_select(query: AnalyticQuery, condition: str, with_order: bool) -> str:
    distinct = "DISTINCT " if query.distinct else ""
    lines = [f"SELECT {distinct}{', '.join(item.text for item in query.items)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    if query.group_by:
        lines.append(f"GROUP BY {', '.join(query.group_by)}")
    if query.having is not None:
        lines.append(f"HAVING ({query.having})\n   AND {condition}")
    else:
        lines.append(f"HAVING {condition}")
    if with_order:
        if query.order:
            lines.append(f"ORDER BY {', '.join(item.text for item in query.order)}")
        if query.tail is not None:
            lines.append(query.tail)
    return "\n".join(lines)
