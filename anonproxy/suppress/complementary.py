"""Complementary suppression: the CTEs that withhold more groups until no subtraction singles anyone out.

The groups that pass the rules alone (``anonproxy_primary``) are ordered
smallest first (``step`` 1, 2, ...; the primarily withheld groups are step 0),
and the groups up to the first step ``j`` at which the withheld groups together
pass the rules are withheld (docs/suppression.md, "Complementary suppression").

Two ways to count the people of a union of groups:

* ``per_person`` (``anonproxy_cells``: one row per group and person): when a
  person may be in several groups, each person's first and last step, counted
  once; when the answer shows each person is in one group, the groups' own
  counts.
* ``rows`` (each row of the FROM clause is one person, so each person is in
  one group): the groups' own counts, totals and largest contributions,
  always; no per-person pass is written.

Pure functions: SQL text from the analysed query and the role's rules.
"""

from __future__ import annotations

from itertools import combinations

from anonproxy.plan.analysis import AnalyticQuery
from anonproxy.suppress.rules import (
    ANSWERED,
    CELLS,
    CHOSEN,
    GROUPS,
    MAGNITUDE_STEPS,
    MARGIN_COLUMNS,
    MARGINS,
    ORDER,
    PEOPLE,
    PRIMARY,
    STEP_CELLS,
    STEP_RANKED,
    STEP_VERDICTS,
    STEPS,
    TRIED,
    Ctes,
    Rules,
    key_tuple,
    left_out,
    magnitude_bounds,
    ranked_verdict,
)


def complementary(query: AnalyticQuery, rules: Rules, keys: list[str], sums: list[str], flags: list[str],
                  rest: bool, rows: bool, units: str = f"SELECT unit FROM {CELLS} GROUP BY unit",
                  covered: str | None = None) -> Ctes:
    """The CTEs from ``anonproxy_order`` to ``anonproxy_groups`` (``released`` per group):

    * the withheld groups (step <= j) hold no one, or at least k people, with k contributors per aggregate and
      passing the magnitude rules; and
    * the people outside the released groups (those of withheld groups and those the WHERE left out) are nobody
      or at least k of N, or the rest row, which then covers them, is released.

    Withholding every group always meets both: then nothing is released. The magnitude rules are checked for the
    first few steps at which the counts already pass (``MAGNITUDE_STEPS``); past them, every group is withheld.
    ``rows``: each person is in one group, and ``anonproxy_primary`` has each group's total ``t<j>`` and largest
    contribution ``m<j>`` per SUM/AVG argument, which decide most steps without ranking anyone. Otherwise
    ``units`` is the SQL of the answer's distinct units (a column ``unit``), for ``anonproxy_answered``, unless
    ``covered``, the SQL of their number (a column ``n``), counted already.
    """
    k = rules.k
    universe = f"({query.universe})"
    on = " AND ".join(f"ARRAY[c.{key}] = ARRAY[o.{key}]" for key in keys)
    totals = [f"{name}{s[1:]}" for s in sums for name in ("t", "m")] if rows else []
    ctes: Ctes = []
    order = ", ".join(["units", *keys])
    ctes.append((ORDER, "\n".join([
        f"SELECT {', '.join([*keys, 'units', *flags, *totals])},",
        f"       CASE WHEN released THEN row_number() OVER (PARTITION BY released ORDER BY {order}) ELSE 0 END AS step",
        f"FROM {PRIMARY}",
    ]), "the order of complementary suppression: withheld groups first (0), then the smallest released ones"))
    if not rows:
        if query.where is None or covered is not None:  # N (the answer covers everyone), or counted already
            people = query.universe if covered is None else covered
            answered = f"SELECT n, n = (SELECT sum(units) FROM {PRIMARY})\nFROM ({people}) AS everyone(n)"
        else:
            # count(unit): rows without a unit (a NULL in ``units``) are nobody.
            answered = "\n".join([f"SELECT count(unit), count(unit) = (SELECT sum(units) FROM {PRIMARY})",
                                  f"FROM ({units}) AS people"])
        ctes.append((f"{ANSWERED}(n, disjoint)", answered,
                     "the people of the answer, and whether each is in one group only"))
        # People in several groups (several rows per person, in different groups): each person's first step
        # (withheld from it on), last step (in no released group from it on) and first step at which they contribute.
        firsts = [f"min(o.step) FILTER (WHERE c.{flag}) AS first_{flag}" for flag in flags]
        ctes.append((PEOPLE, "\n".join([
            f"SELECT c.unit, min(o.step) AS first, max(o.step) AS last{''.join(', ' + f for f in firsts)}",
            f"FROM {CELLS} AS c JOIN {ORDER} AS o ON {on}",
            "WHERE c.unit IS NOT NULL",  # rows without a unit are nobody: not one more person withheld
            "GROUP BY c.unit",
        ]), "each person's first and last step, read only when people are in several groups"))
    ctes.append((STEPS, _steps(flags, sums, rows), ("per step j: the people withheld, the people in no released "
                 "group, the contributors withheld")))
    counts = [f"withheld >= {k}", left_out(f"{universe} - withheld", rules)]
    counts += [f"contributors_{flag} >= {k}" for flag in flags]
    counts_pass = " AND ".join(counts)
    within = counts_pass
    if sums:
        ctes.append((TRIED, f"SELECT step FROM {STEPS} WHERE {counts_pass}\nORDER BY step LIMIT {MAGNITUDE_STEPS}",
                     "the first steps whose counts pass: the magnitude rules are checked at these"))
        bounds = [magnitude_bounds(rules, f"s.t{s[1:]}", f"s.m{s[1:]}") for s in sums] if rows else []
        ranked = f"(SELECT v.released FROM {STEP_VERDICTS} AS v WHERE v.step = s.step)"
        if rows:
            # Only the steps the totals leave undecided rank each person's part of the withheld groups.
            undecided = " OR ".join(b.undecided for b in bounds)
            ranked_steps = f"SELECT t.step FROM {TRIED} AS t JOIN {STEPS} AS s USING (step) WHERE {undecided}"
            verdict = " AND ".join(b.verdict(ranked) for b in bounds)
        else:
            ranked_steps = f"SELECT step FROM {TRIED}"
            verdict = f"coalesce({ranked}, false)"
        select = ["s.step", "c.unit", *(f"sum(c.{name}) AS {name}" for name in sums)]
        ctes.append((STEP_CELLS, "\n".join([
            f"SELECT {', '.join(select)}",
            f"FROM ({ranked_steps}) AS s",
            f"JOIN {ORDER} AS o ON o.step <= s.step",
            f"JOIN {cells_of(keys, f'(SELECT max(step) FROM ({ranked_steps}) AS ranked)')} AS c ON {on}",
            "GROUP BY 1, 2",
        ]), "each person's part of the withheld groups, at the steps to rank"))
        ctes += ranked_verdict(STEP_CELLS, STEP_RANKED, STEP_VERDICTS, ["step"], sums, [], "true", rules,
                               "the magnitude rules on the withheld groups together, per step")
        within += f"\n       AND s.step IN (SELECT step FROM {TRIED})\n       AND {verdict}"
    outside = left_out(f"{universe} - ((SELECT n FROM {ANSWERED}) - gone)", rules)
    if rest:
        # The rest row covers the withheld groups when it is released: then the released rows cover the whole
        # answer, which must leave out of N nobody or k people.
        answered = left_out(f"{universe} - (SELECT n FROM {ANSWERED})", rules)
        outside = f"({outside} OR (withheld > 0 AND {answered}))"
    # Step 0 passes when no group is withheld alone and the answer leaves out of N nobody or k people: then the
    # steps (in the per-person shape, each person followed through them) are never computed.
    nothing_withheld = (f"NOT EXISTS (SELECT FROM {ORDER} WHERE step = 0) AND "
                        + left_out(f"{universe} - (SELECT n FROM {ANSWERED})", rules))
    ctes.append((CHOSEN, "\n".join([
        f"SELECT CASE WHEN {nothing_withheld} THEN 0 ELSE (",
        "  SELECT coalesce(min(step) FILTER (WHERE",
        f"             (withheld = 0 OR ({within}))",
        f"             AND {outside}),",
        "         max(step))",
        f"  FROM {STEPS} AS s) END AS step",
    ]), "the first step at which the withheld groups pass together (the last step withholds everything)"))
    released = f"step > (SELECT step FROM {CHOSEN})"
    if len(keys) > 1:
        ctes.append((MARGINS, _margins(keys, flags, rules, rows), ("the smallest released group of each margin "
                     "whose withheld groups hold fewer than k people or contributors")))
        released += f" AND step NOT IN (SELECT step FROM {MARGINS} WHERE step IS NOT NULL)"
    ctes.append((GROUPS, "\n".join([
        f"SELECT {', '.join(keys)}, units, step, {released} AS released",
        f"FROM {ORDER}",
    ]), "released: the groups after the chosen step, but for those withheld for a margin"))
    return ctes


def _steps(flags: list[str], sums: list[str], rows: bool) -> str:
    """``anonproxy_steps``: per step, the people withheld up to it, the people in no released group, the
    contributors withheld, and (``rows``) the withheld groups' total and largest contribution per SUM/AVG."""
    # Each person in one group (one row per person, the common case): the running sums of the groups' own counts.
    by_group = ["sum(sum(units)) OVER (ORDER BY step) AS withheld", "sum(sum(units)) OVER (ORDER BY step) AS gone",
                *(f"sum(sum({flag})) OVER (ORDER BY step) AS contributors_{flag}" for flag in flags)]
    columns = ["step", "units", *flags]
    if rows:
        by_group += [f"sum(sum({t})) OVER (ORDER BY step) AS {t}" for t in (f"t{s[1:]}" for s in sums)]
        by_group += [f"max(max({m})) OVER (ORDER BY step) AS {m}" for m in (f"m{s[1:]}" for s in sums)]
        columns += [f"{name}{s[1:]}" for s in sums for name in ("t", "m")]
    zeros = ", ".join(f"0 AS {column}" for column in columns)
    disjoint = "\n".join([
        f"SELECT step, {', '.join(by_group)}",
        f"FROM (SELECT {zeros} UNION ALL SELECT {', '.join(columns)} FROM {ORDER}) AS groups",
        *([] if rows else [f"WHERE (SELECT disjoint FROM {ANSWERED})"]),
        "GROUP BY step",
    ])
    if rows:
        return disjoint
    # People in several groups: the running counts of each person's first and last steps (anonproxy_people).
    counted = ["withheld", "gone", *(f"contributors_{flag}" for flag in flags)]
    people = ["first", "last", *(f"first_{flag}" for flag in flags)]
    joins = [f"LEFT JOIN (SELECT {column} AS step, count(*) AS n FROM {PEOPLE} GROUP BY 1) AS {name} USING (step)"
             for column, name in zip(people, counted, strict=True)]
    running = [f"sum(coalesce({name}.n, 0)) OVER (ORDER BY step) AS {name}" for name in counted]
    several = "\n".join([
        f"SELECT step, {', '.join(running)}",
        f"FROM (SELECT 0 AS step UNION ALL SELECT step FROM {ORDER} WHERE step > 0) AS steps",
        *joins,
        f"WHERE NOT (SELECT disjoint FROM {ANSWERED})",
    ])
    return f"{disjoint}\nUNION ALL\n{several}"


def cells_of(keys: list[str], step: str) -> str:
    """The cells of the groups up to ``step``, as a derived table: a hashed filter on the cells, where a join with
    the groups' order would sort every cell."""
    return (f"(SELECT * FROM {CELLS} WHERE {key_tuple(keys)} IN\n"
            f"  (SELECT {key_tuple(keys, bare=True)} FROM {ORDER} WHERE step <= {step}))")


def _margins(keys: list[str], flags: list[str], rules: Rules, rows: bool) -> str:
    """Complementary suppression in the margins of a GROUP BY of several columns: a margin (the groups sharing the
    values of one or two of the grouping columns) is itself a total another GROUP BY releases, so its withheld
    groups must hold no one, or k people with k contributors per aggregate. Where they do not, its smallest
    released group is withheld with them. One pass suffices: that group alone holds k people and contributors,
    so every other margin it lies in gains as many (the magnitude rules are not checked per margin). A margin
    with no withheld group has no row in ``w``. ``rows``: each person is in one group, and the groups' own counts
    add up."""
    chosen = f"(SELECT step FROM {CHOSEN})"
    short = [f"w.people < {rules.k}", *(f"w.{flag} < {rules.k}" for flag in flags)]
    if rows:
        counted = ["sum(c.units) AS people", *(f"sum(c.{flag}) AS {flag}" for flag in flags)]
        withheld = f"(SELECT * FROM {ORDER} WHERE step <= {chosen})"
    else:
        counted = ["count(DISTINCT c.unit) AS people", *(f"count(DISTINCT c.unit) FILTER (WHERE c.{flag}) AS {flag}"
                                                         for flag in flags)]
        withheld = cells_of(keys, chosen)
    width = min(len(keys) - 1, MARGIN_COLUMNS)
    margins = [columns for size in range(1, width + 1) for columns in combinations(keys, size)]
    # Only the withheld groups are counted (few, as a rule); the smallest released group of a margin comes from the
    # groups' order, one row per group.
    branches = ["\n".join([
        "SELECT min(o.step) AS step",
        f"FROM (SELECT {', '.join(f'ARRAY[c.{key}] AS {key}' for key in columns)}, {', '.join(counted)}",
        f"      FROM {withheld} AS c",
        f"      GROUP BY {', '.join(str(i) for i in range(1, len(columns) + 1))}) AS w",
        f"JOIN {ORDER} AS o ON {' AND '.join(f'ARRAY[o.{key}] = w.{key}' for key in columns)}",
        f"WHERE o.step > {chosen} AND ({' OR '.join(short)})",
        f"GROUP BY {', '.join(f'w.{key}' for key in columns)}",
    ]) for columns in margins]
    return "\nUNION ALL\n".join(branches)
