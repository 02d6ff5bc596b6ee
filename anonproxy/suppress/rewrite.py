"""Build the suppression SQL for an analytic query (docs/suppression.md).

Two shapes:

* **simple** (a total without GROUP BY, no magnitude rule applies): the
  client's query with one more HAVING condition, query-set-size control: at
  least k distinct units, and nobody or at least k of the FROM clause's N
  people left out (a total over everyone is public; one over all but a few
  would single those few out by one subtraction).

* **cells** (every GROUP BY; a total with dominance or p % rules on
  SUM/AVG): CTEs compute each privacy unit's contribution per group
  (``anonproxy_cells``), rank contributions (``anonproxy_ranked``), decide
  per group alone (``anonproxy_primary``), then complementary suppression
  withholds the smallest groups that pass alone until the withheld groups
  pass together (:func:`_complementary`, ``anonproxy_groups.released``); the
  client's query keeps only the released groups through a hashed ``IN`` on
  ``ARRAY[key]`` (an array compares NULL keys as equal, like GROUP BY does).
  The rest row is a second branch of a UNION ALL over the rows of every
  withheld group, released only if that rest itself passes the same rules,
  query-set-size control included.

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
from decimal import Decimal
from itertools import combinations

from anonproxy.policy.model import SuppressionParams
from anonproxy.plan.analysis import AnalyticQuery, Item
from anonproxy.rewrite.decision import unsupported
from anonproxy.plan.post_aggregate import RELEASED, PostAggregate, key, plain, value

CELLS = "anonproxy_cells"
RANKED = "anonproxy_ranked"
GROUPS = "anonproxy_groups"
WITHHELD = "anonproxy_withheld"
PRIMARY = "anonproxy_primary"
ORDER = "anonproxy_order"
ANSWERED = "anonproxy_answered"
PEOPLE = "anonproxy_people"
STEPS = "anonproxy_steps"
STEP_CELLS = "anonproxy_step_cells"
STEP_RANKED = "anonproxy_step_ranked"
STEP_VERDICTS = "anonproxy_step_verdicts"
CHOSEN = "anonproxy_chosen"
MARGINS = "anonproxy_margins"
REST_CELLS = "anonproxy_rest_cells"
REST_RANKED = "anonproxy_rest_ranked"
REST = "anonproxy_rest"
REPORT = "anonproxy_report"
WITHHELD_PEOPLE = "anonproxy_withheld_people"
UNIVERSE = "anonproxy_universe"
ANSWER = "anonproxy_answer"
REPORT_FUNCTION = "anonproxy.suppression_report"  # sql/0022_complementary_report.sql

POLICY_HINT = "Ask the DBA to fix the role's suppression parameters."
# Complementary suppression checks the magnitude rules on the withheld groups together at this many steps (each
# adds the smallest released group); past them it withholds every group of the answer.
MAGNITUDE_STEPS = 8
# The margins of a GROUP BY of several columns that complementary suppression covers: those of one or two columns.
MARGIN_COLUMNS = 2


class _Rules:
    """The role's suppression parameters, validated."""

    def __init__(self, params: SuppressionParams) -> None:
        self.k = int(params.k)
        if self.k < 1:
            raise unsupported("the role's suppression threshold k must be at least 1", POLICY_HINT)
        if (params.dominance_n is None) != (params.dominance_percent is None):
            raise unsupported("the role's dominance rule needs both n and k%", POLICY_HINT)
        self.dominance: tuple[int, Decimal] | None = None
        if params.dominance_n is not None and params.dominance_percent is not None:
            n, percent = int(params.dominance_n), _decimal(params.dominance_percent)
            if n < 1 or not 0 < percent <= 100:
                raise unsupported("the role's dominance rule needs n >= 1 and 0 < k% <= 100", POLICY_HINT)
            self.dominance = (n, percent)
        self.p_percent: Decimal | None = None
        if params.p_percent is not None:
            self.p_percent = _decimal(params.p_percent)
            if self.p_percent < 0:
                raise unsupported("the role's p% rule needs p >= 0", POLICY_HINT)
        self.rest = params.suppressed_rest

    @property
    def magnitude_rules(self) -> bool:
        return self.dominance is not None or self.p_percent is not None


def rewrite(query: AnalyticQuery, params: SuppressionParams) -> str:
    rules = _Rules(params)
    if query.outer is not None:
        return _released(query, query.outer, rules)
    return _suppressed(query, rules)


def _suppressed(query: AnalyticQuery, rules: _Rules) -> str:
    magnitudes = query.magnitudes if rules.magnitude_rules else ()
    if _is_simple(query, magnitudes):
        return _simple(query, rules)
    return _cells(query, rules, magnitudes, rules.rest and query.grouped)


def _is_simple(query: AnalyticQuery, magnitudes: tuple[str, ...]) -> bool:
    """One total and no magnitude rule: the rules are one HAVING condition. A GROUP BY always needs the cells
    shape, whose per-person cells complementary suppression counts."""
    return not query.grouped and not magnitudes


def _released(query: AnalyticQuery, outer: PostAggregate, rules: _Rules) -> str:
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
    lines = [f"WITH {RELEASED} AS MATERIALIZED (", _suppressed(suppressed, rules), ")",
             f"SELECT {'DISTINCT ' if query.distinct else ''}{', '.join(item.sql for item in outer.items)}",
             f"FROM {RELEASED}"]
    if outer.having is not None:
        lines.append(f"WHERE {outer.having}")
    if outer.order:
        lines.append(f"ORDER BY {', '.join(outer.order)}")
    if query.tail is not None:
        lines.append(query.tail)
    return "\n".join(lines)


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
    rules = _Rules(params)
    magnitudes = query.magnitudes if rules.magnitude_rules else ()
    rest = rules.rest and query.grouped
    simple = _is_simple(query, magnitudes)
    counted, query = _counted_universe(query)
    if simple:
        keys: list[str] = []
        ctes = _simple_verdict(query, rules)
        body = _simple(query, rules)
    else:
        ctes, body = _cells_parts(query, rules, magnitudes, rest)
        keys = [f"g{i}" for i in range(1, len(query.keys) + 1)]
    if query.grouped:
        withheld_people = (f"SELECT count(DISTINCT unit) FROM {CELLS}\n"
                           f"WHERE {_key_tuple(keys)} IN (SELECT {_key_tuple(keys, bare=True)} FROM {WITHHELD})")
        ctes.append((f"{WITHHELD_PEOPLE}(n)", withheld_people, "the people withheld"))
    ctes.append((REPORT, _report(query, rules, keys, rest, simple), "what the proxy says about suppression, in a "
                 "NOTICE"))
    # The body is not indented: a string constant of the client's may span lines.
    return "\n".join([_with(counted + ctes), "SELECT *", "FROM (", body, f") AS {ANSWER}",
                      f"WHERE (SELECT reported FROM {REPORT})"])


def _report(query: AnalyticQuery, rules: _Rules, keys: list[str], rest: bool, simple: bool) -> str:
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
        labels = "ARRAY[" + ", ".join(_string(item.alias or item.expression)
                                      for item in query.items if item.kind == "group") + "]::text[]"
        sayable = _query_set_size(f"(SELECT n FROM {WITHHELD_PEOPLE})", query, rules)
        groups = f"CASE WHEN {sayable} THEN (SELECT count(*) FROM {WITHHELD}) END"
        complementary = f"CASE WHEN {sayable} THEN (SELECT count(*) FROM {GROUPS} WHERE NOT released AND step > 0) END"
        if rest:
            rest_released = f"(SELECT released FROM {REST})"
            # Whether the client's HAVING keeps that group is not asked: it would be evaluated on every group.
            null_group = (f"EXISTS (SELECT 1 FROM {GROUPS} WHERE released AND "
                          f"{' AND '.join(f'{key} IS NULL' for key in keys)})")
    else:
        units = f"(SELECT units FROM {GROUPS})" if simple else f"(SELECT count(unit) FROM {CELLS})"
        sized = _query_set_size(units, query, rules)
        total = f"CASE WHEN (SELECT released FROM {GROUPS}) THEN NULL WHEN {sized} THEN 'rules' ELSE 'qss' END"
    arguments = [str(rules.k), _string(query.table), labels, groups, complementary, total, rest_released, null_group]
    return f"SELECT {REPORT_FUNCTION}(\n  " + ",\n  ".join(arguments) + "\n) AS reported"


def _string(text: str) -> str:
    """A standard SQL string constant (the service session keeps standard_conforming_strings on)."""
    return "'" + text.replace("'", "''") + "'"


def _contributes(rule: str, argument: str) -> str:
    """Whether a row makes its unit a contributor to an aggregate of ``argument``."""
    return f"({argument}) IS NOT NULL" if rule == "nonnull" else f"({argument}) <> 0"


def _query_set_size(units: str, query: AnalyticQuery, rules: _Rules) -> str:
    """``units >= k``, and ``units`` leaves out of the FROM clause's N people nobody or at least k: a released total
    over everyone is the public total, one over all but a few would single those few out."""
    return f"{units} >= {rules.k} AND {_left_out(f'({query.universe}) - {units}', rules)}"


def _left_out(people: str, rules: _Rules) -> str:
    """``people`` is 0 or at least k: a set of people a subtraction could single out holds nobody or k people."""
    return f"{people} NOT BETWEEN 1 AND {rules.k - 1}"


def _simple(query: AnalyticQuery, rules: _Rules) -> str:
    return _client_select(query, _group_rules(query, rules), with_order=True)


def _group_rules(query: AnalyticQuery, rules: _Rules) -> str:
    """The simple shape's condition on its total: query-set-size control, and k contributing units per aggregate."""
    conditions = [_query_set_size(f"count(DISTINCT {query.unit})", query, rules)]
    conditions += [f"count(DISTINCT CASE WHEN {_contributes(rule, argument)} THEN {query.unit} END) >= {rules.k}"
                   for rule, argument in query.contributors]
    return "\n   AND ".join(conditions)


def _simple_verdict(query: AnalyticQuery, rules: _Rules) -> Ctes:
    """``anonproxy_groups`` for the simple shape: whether its one total is released, and its distinct units; one
    pass over the rows, like the answer's."""
    select = [f"{_group_rules(query, rules)}\n     AS released", f"count(DISTINCT {query.unit}) AS units"]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    return [(GROUPS, "\n".join(lines), "whether the total is released, and its people")]


def _cells(query: AnalyticQuery, rules: _Rules, magnitudes: tuple[str, ...], rest: bool) -> str:
    counted, query = _counted_universe(query)
    ctes, body = _cells_parts(query, rules, magnitudes, rest)
    return _with(counted + ctes) + "\n" + body


def _counted_universe(query: AnalyticQuery) -> tuple[Ctes, AnalyticQuery]:
    """N, the people of the FROM clause, as a CTE counted once, and ``query`` reading it from there: the verdicts,
    the steps and the report all compare with it, and each uncorrelated subquery would be a scan of its own."""
    return ([(f"{UNIVERSE}(n)", query.universe, "N: the people of the FROM clause")],
            replace(query, universe=f"SELECT n FROM {UNIVERSE}"))


Ctes = list[tuple[str, str, str | None]]  # (name, body, comment)


def _cells_parts(query: AnalyticQuery, rules: _Rules, magnitudes: tuple[str, ...], rest: bool) -> tuple[Ctes, str]:
    """The cells shape: its CTEs, and the statement that follows them."""
    keys, sums, flags, ctes = _group_verdicts(query, rules, magnitudes, rest)
    if query.grouped:
        released = f"{_key_tuple(query.keys)} IN (SELECT {_key_tuple(keys, bare=True)} FROM {GROUPS} WHERE released)"
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
        f"WHERE {_key_tuple(keys)} IN (SELECT {_key_tuple(keys, bare=True)} FROM {WITHHELD})",
        "GROUP BY 1",
    ]), "each privacy unit's part of the withheld rows"))
    # Query-set-size control, as for a query without GROUP BY: the rest row is a total over its own people, and
    # with the released rows it adds up to a total over everyone the answer covers; both must leave out of N
    # nobody or at least k people.
    population = (f"{_query_set_size('count(unit)', query, rules)}\n"
                  f"         AND {_left_out(f'({query.universe}) - (SELECT n FROM {ANSWERED})', rules)}")
    ctes += _verdict(REST_CELLS, REST_RANKED, REST, [], sums, flags, population, rules,
                     "the rest row is released only if it passes the same rules, query-set-size control included")

    first = _client_select(query, released, with_order=False)
    items = ", ".join("NULL" if item.kind == "group" else item.expression for item in query.items)
    second = [f"SELECT {items}", f"FROM {query.from_sql}"]
    rows = f"{_key_tuple(query.keys)} IN (SELECT {_key_tuple(keys, bare=True)} FROM {WITHHELD})"
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


def _group_verdicts(query: AnalyticQuery, rules: _Rules, magnitudes: tuple[str, ...],
                    rest: bool) -> tuple[list[str], list[str], list[str], Ctes]:
    """CTEs deciding each group (``anonproxy_groups.released``) from each unit's contribution to it, and the names
    of the key, sum and contributor columns of ``anonproxy_cells``."""
    keys = [f"g{i}" for i in range(1, len(query.keys) + 1)]
    sums = [f"s{j}" for j in range(1, len(magnitudes) + 1)]
    flags = [f"n{j}" for j in range(1, len(query.contributors) + 1)]
    ctes: Ctes = []

    select = [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select.append(f"{query.unit} AS unit")
    select += [f"sum({argument}) AS {name}" for argument, name in zip(magnitudes, sums, strict=True)]
    select += [f"bool_or({_contributes(rule, argument)}) AS {name}"
               for (rule, argument), name in zip(query.contributors, flags, strict=True)]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}"]
    if query.where is not None:
        lines.append(f"WHERE {query.where}")
    lines.append(f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 2))}")
    ctes.append((CELLS, "\n".join(lines), ("one row per group and privacy unit: its part of each SUM/AVG, and "
                 "whether it contributes to each aggregate")))

    threshold = _query_set_size("count(unit)", query, rules)
    if not query.grouped:
        ctes += _verdict(CELLS, RANKED, GROUPS, keys, sums, flags, threshold, rules,
                         "released: k people, and nobody or k people left out of N, magnitude rules")
        return keys, sums, flags, ctes
    ctes += _verdict(CELLS, RANKED, PRIMARY, keys, sums, flags, threshold, rules,
                     "primary suppression: each group alone holds k people, leaves nobody or k people out of N"
                     + (", passes the magnitude rules" if sums else ""))
    ctes += _complementary(query, rules, keys, sums, flags, rest)
    return keys, sums, flags, ctes


def _complementary(query: AnalyticQuery, rules: _Rules, keys: list[str], sums: list[str], flags: list[str],
                   rest: bool) -> Ctes:
    """Complementary suppression: the groups that pass alone are ordered smallest first (``step`` 1, 2, ...; the
    primarily withheld groups are step 0), and the groups up to the first step ``j`` at which the withheld groups
    together pass the rules are withheld, so that no subtraction of released rows from a total singles out fewer
    than k people:

    * the withheld groups (step <= j) hold no one, or at least k people, with k contributors per aggregate and
      passing the magnitude rules; and
    * the people outside the released groups (those of withheld groups and those the WHERE left out) are nobody
      or at least k of N, or the rest row, which then covers them, is released.

    Withholding every group always meets both: then nothing is released. The magnitude rules are checked for the
    first few steps at which the counts already pass (``MAGNITUDE_STEPS``); past them, every group is withheld.
    """
    k = rules.k
    universe = f"({query.universe})"
    on = " AND ".join(f"ARRAY[c.{key}] = ARRAY[o.{key}]" for key in keys)
    ctes: Ctes = []
    order = ", ".join(["units", *keys])
    ctes.append((ORDER, "\n".join([
        f"SELECT {', '.join([*keys, 'units', *flags])},",
        f"       CASE WHEN released THEN row_number() OVER (PARTITION BY released ORDER BY {order}) ELSE 0 END AS step",
        f"FROM {PRIMARY}",
    ]), "the order of complementary suppression: withheld groups first (0), then the smallest released ones"))
    ctes.append((f"{ANSWERED}(n, disjoint)", "\n".join([
        f"SELECT count(*), count(*) = (SELECT sum(units) FROM {PRIMARY})",
        f"FROM (SELECT unit FROM {CELLS} GROUP BY unit) AS people",
    ]), "the people of the answer, and whether each is in one group only"))
    counted = ["withheld", "gone", *(f"contributors_{flag}" for flag in flags)]
    # Each person in one group (one row per person, the common case): the running sums of the groups' own counts.
    by_group = ["sum(sum(units)) OVER (ORDER BY step) AS withheld", "sum(sum(units)) OVER (ORDER BY step) AS gone",
                *(f"sum(sum({flag})) OVER (ORDER BY step) AS contributors_{flag}" for flag in flags)]
    zeros = ", ".join(["0 AS step", "0 AS units", *(f"0 AS {flag}" for flag in flags)])
    disjoint = "\n".join([
        f"SELECT step, {', '.join(by_group)}",
        f"FROM (SELECT {zeros} UNION ALL SELECT {', '.join(['step', 'units', *flags])} FROM {ORDER}) AS groups",
        f"WHERE (SELECT disjoint FROM {ANSWERED})",
        "GROUP BY step",
    ])
    # People in several groups (several rows per person, in different groups): each person's first step (withheld
    # from it on), last step (in no released group from it on) and first step at which they contribute.
    firsts = [f"min(o.step) FILTER (WHERE c.{flag}) AS first_{flag}" for flag in flags]
    ctes.append((PEOPLE, "\n".join([
        f"SELECT c.unit, min(o.step) AS first, max(o.step) AS last{''.join(', ' + f for f in firsts)}",
        f"FROM {CELLS} AS c JOIN {ORDER} AS o ON {on}",
        "GROUP BY c.unit",
    ]), "each person's first and last step, read only when people are in several groups"))
    columns = ["first", "last", *(f"first_{flag}" for flag in flags)]
    joins = [f"LEFT JOIN (SELECT {column} AS step, count(*) AS n FROM {PEOPLE} GROUP BY 1) AS {name} USING (step)"
             for column, name in zip(columns, counted, strict=True)]
    running = [f"sum(coalesce({name}.n, 0)) OVER (ORDER BY step) AS {name}" for name in counted]
    several = "\n".join([
        f"SELECT step, {', '.join(running)}",
        f"FROM (SELECT 0 AS step UNION ALL SELECT step FROM {ORDER} WHERE step > 0) AS steps",
        *joins,
        f"WHERE NOT (SELECT disjoint FROM {ANSWERED})",
    ])
    ctes.append((STEPS, f"{disjoint}\nUNION ALL\n{several}",
                 "per step j: the people withheld, the people in no released group, the contributors withheld"))
    counts = [f"withheld >= {k}", _left_out(f"{universe} - withheld", rules)]
    counts += [f"contributors_{flag} >= {k}" for flag in flags]
    counts_pass = " AND ".join(counts)
    within = counts_pass
    if sums:
        # Each person's part of the withheld groups at the first MAGNITUDE_STEPS steps whose counts pass.
        tried = (f"SELECT step FROM {STEPS} WHERE {counts_pass}\n"
                 f"ORDER BY step LIMIT {MAGNITUDE_STEPS}")
        select = ["s.step", "c.unit", *(f"sum(c.{name}) AS {name}" for name in sums)]
        ctes.append((STEP_CELLS, "\n".join([
            f"SELECT {', '.join(select)}",
            f"FROM ({tried}) AS s",
            f"JOIN {ORDER} AS o ON o.step <= s.step",
            f"JOIN {_cells_of(keys, f'(SELECT max(step) FROM ({tried}) AS tried)')} AS c ON {on}",
            "GROUP BY 1, 2",
        ]), "each person's part of the withheld groups, at the steps whose counts pass"))
        ctes += _verdict(STEP_CELLS, STEP_RANKED, STEP_VERDICTS, ["step"], sums, [], "true", rules,
                         "the magnitude rules on the withheld groups together, per step")
        within += f"\n       AND coalesce((SELECT v.released FROM {STEP_VERDICTS} AS v WHERE v.step = s.step), false)"
    outside = _left_out(f"{universe} - ((SELECT n FROM {ANSWERED}) - gone)", rules)
    if rest:
        # The rest row covers the withheld groups when it is released: then the released rows cover the whole
        # answer, which must leave out of N nobody or k people.
        answered = _left_out(f"{universe} - (SELECT n FROM {ANSWERED})", rules)
        outside = f"({outside} OR (withheld > 0 AND {answered}))"
    ctes.append((CHOSEN, "\n".join([
        "SELECT coalesce(min(step) FILTER (WHERE",
        f"           (withheld = 0 OR ({within}))",
        f"           AND {outside}),",
        "       max(step)) AS step",
        f"FROM {STEPS} AS s",
    ]), "the first step at which the withheld groups pass together (the last step withholds everything)"))
    released = f"step > (SELECT step FROM {CHOSEN})"
    if len(keys) > 1:
        ctes.append((MARGINS, _margins(keys, flags, rules), ("the smallest released group of each margin whose "
                     "withheld groups hold fewer than k people or contributors")))
        released += f" AND step NOT IN (SELECT step FROM {MARGINS} WHERE step IS NOT NULL)"
    ctes.append((GROUPS, "\n".join([
        f"SELECT {', '.join(keys)}, units, step, {released} AS released",
        f"FROM {ORDER}",
    ]), "released: the groups after the chosen step, but for those withheld for a margin"))
    return ctes


def _cells_of(keys: list[str], step: str) -> str:
    """The cells of the groups up to ``step``, as a derived table: a hashed filter on the cells, where a join with
    the groups' order would sort every cell."""
    return (f"(SELECT * FROM {CELLS} WHERE {_key_tuple(keys)} IN\n"
            f"  (SELECT {_key_tuple(keys, bare=True)} FROM {ORDER} WHERE step <= {step}))")


def _margins(keys: list[str], flags: list[str], rules: _Rules) -> str:
    """Complementary suppression in the margins of a GROUP BY of several columns: a margin (the groups sharing the
    values of one or two of the grouping columns) is itself a total another GROUP BY releases, so its withheld
    groups must hold no one, or k people with k contributors per aggregate. Where they do not, its smallest
    released group is withheld with them. One pass suffices: that group alone holds k people and contributors,
    so every other margin it lies in gains as many (the magnitude rules are not checked per margin). A margin
    with no withheld group has no row in ``w``."""
    chosen = f"(SELECT step FROM {CHOSEN})"
    short = [f"w.people < {rules.k}", *(f"w.{flag} < {rules.k}" for flag in flags)]
    counted = ["count(DISTINCT c.unit) AS people", *(f"count(DISTINCT c.unit) FILTER (WHERE c.{flag}) AS {flag}"
                                                     for flag in flags)]
    width = min(len(keys) - 1, MARGIN_COLUMNS)
    margins = [columns for size in range(1, width + 1) for columns in combinations(keys, size)]
    # Only the withheld cells are counted (few, as a rule); the smallest released group of a margin comes from the
    # groups' order, one row per group.
    branches = ["\n".join([
        "SELECT min(o.step) AS step",
        f"FROM (SELECT {', '.join(f'ARRAY[c.{key}] AS {key}' for key in columns)}, {', '.join(counted)}",
        f"      FROM {_cells_of(keys, chosen)} AS c",
        f"      GROUP BY {', '.join(str(i) for i in range(1, len(columns) + 1))}) AS w",
        f"JOIN {ORDER} AS o ON {' AND '.join(f'ARRAY[o.{key}] = w.{key}' for key in columns)}",
        f"WHERE o.step > {chosen} AND ({' OR '.join(short)})",
        f"GROUP BY {', '.join(f'w.{key}' for key in columns)}",
    ]) for columns in margins]
    return "\nUNION ALL\n".join(branches)


def _withheld(keys: list[str]) -> Ctes:
    """``anonproxy_withheld``: the groups that were suppressed, whatever the client's HAVING would say of them: it is
    evaluated on released groups and the rest row only."""
    return [(WITHHELD, f"SELECT {', '.join(keys)} FROM {GROUPS} WHERE NOT released", "the groups that were suppressed")]


def _verdict(source: str, ranked: str, name: str, keys: list[str], sums: list[str], flags: list[str],
             threshold: str, rules: _Rules, comment: str) -> list[tuple[str, str, str | None]]:
    """CTEs ranking each unit's contributions in ``source`` and deciding ``released`` per group of ``keys``."""
    ctes: list[tuple[str, str, str | None]] = []
    table = source
    if sums:
        partition = f"PARTITION BY {', '.join(keys)} " if keys else ""
        contributions = ", ".join([*keys, "unit", *flags,
                                   *(f"abs(coalesce({s}, 0))::numeric AS c{s[1:]}" for s in sums)])
        ranks = ", ".join(f"row_number() OVER ({partition}ORDER BY c{s[1:]} DESC) AS r{s[1:]}" for s in sums)
        body = "\n".join([
            f"SELECT {', '.join([*keys, 'unit', *flags, *(f'c{s[1:]}' for s in sums)])}, {ranks}",
            f"FROM (SELECT {contributions} FROM {source}) AS contributions",
        ])
        ctes.append((ranked, body, "absolute contributions, largest first"))
        table = ranked
    conditions = [threshold]
    conditions += [f"count(unit) FILTER (WHERE {flag}) >= {rules.k}" for flag in flags]
    for s in sums:
        c, r = f"c{s[1:]}", f"r{s[1:]}"
        total = f"coalesce(sum({c}), 0)"
        if rules.dominance is not None:
            n, percent = rules.dominance
            conditions.append(f"100 * coalesce(sum({c}) FILTER (WHERE {r} <= {n}), 0) <= {_literal(percent)} * {total}")
        if rules.p_percent is not None:
            x1 = f"coalesce(max({c}) FILTER (WHERE {r} = 1), 0)"
            x2 = f"coalesce(max({c}) FILTER (WHERE {r} = 2), 0)"
            conditions.append(f"100 * ({total} - {x1} - {x2}) >= {_literal(rules.p_percent)} * {x1}")
    lines = ["SELECT " + "".join(f"{key},\n       " for key in keys) + "\n       AND ".join(conditions)
             + "\n         AS released" + "".join(f", {column}" for column in _group_counts(keys, flags)),
             f"FROM {table}"]
    if keys:
        lines.append(f"GROUP BY {', '.join(keys)}")
    ctes.append((name, "\n".join(lines), comment))
    return ctes


def _group_counts(keys: list[str], flags: list[str]) -> list[str]:
    """A group's people, and its contributors per aggregate (named as the cells' flags), for complementary
    suppression; none for a verdict without groups."""
    if not keys:
        return []
    return ["count(unit) AS units", *(f"count(unit) FILTER (WHERE {flag}) AS {flag}" for flag in flags)]


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


def _with(ctes: list[tuple[str, str, str | None]]) -> str:
    parts = []
    for name, body, comment in ctes:
        note = f"-- {comment}\n" if comment else ""
        # Bodies are not indented: a string constant of the client's may span lines, and every copy of its text
        # must read the same rows.
        parts.append(f"{name} AS (\n{note}{body}\n)")
    return "WITH " + ",\n".join(parts)


def _key_tuple(expressions: list[str] | tuple[str, ...], bare: bool = False) -> str:
    """ARRAY[...] per key: arrays compare NULL elements as equal, and a row of them is hashable."""
    arrays = [f"ARRAY[{expression}]" for expression in expressions]
    if len(arrays) == 1 or bare:
        return ", ".join(arrays)
    return f"({', '.join(arrays)})"


def _decimal(value: float) -> Decimal:
    return Decimal(str(value))


def _literal(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return text
