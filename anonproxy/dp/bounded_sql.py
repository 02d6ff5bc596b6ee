"""The SQL a dp plan runs on the service connection: exact, contribution-bounded per-group statistics.

Each privacy unit's rows are bounded (at most ``max_rows_per_unit`` per group, ``max_groups_per_unit`` groups),
each aggregate's argument clamped into its bounds, then the statistics of :class:`anonproxy.dp.model.Statistic`
computed per group (a count of distinct values over the bounded rows too, so that one unit adds at most its c
rows' values to a group, however many rows of distinct values it has); groups of declared public domains are listed
whether or not a row falls in them. Noise is added in the proxy (:mod:`anonproxy.dp.finish`), never in SQL.

Where each row is one unit, no row needs to be dropped: each unit contributes one row to one group. Two ways to
know it:

* **from the policy** (:attr:`AnalyticQuery.one_row_per_person`, read from the catalog with the policy: the
  protected table alone, its unit column unique and not null): the SQL is the statistics over the client's rows,
  no bounding written at all, and it checks the fact once, before its scan (``anonproxy.one_row_per_person``,
  sql/0023, which raises an error when a key was dropped since the policy was read, as suppress mode's one-pass
  SQL does);
* **at run time** (otherwise): a guard CTE reads the catalog, and of two branches only one runs, the rows as
  they are or the bounded rows.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

from anonproxy.catalog_check import one_row_per_person
from anonproxy.dp.model import Statistic
from anonproxy.dp.time_domains import TimeDomain
from anonproxy.plan.analysis import AnalyticQuery

# The public domain of a GROUP BY key: its declared values (as text), or a calendar key's buckets.
Domain = tuple[str, ...] | TimeDomain

# Column names in the generated SQL (prefixed so they cannot collide with the client's).
ROWS = "anonproxy_rows"
CELLS = "anonproxy_cells"
BOUNDED = "anonproxy_bounded"
STATS = "anonproxy_stats"
GUARD = "anonproxy_guard"
PLAIN = "anonproxy_plain"
DOMAIN = "anonproxy_domain"
UNIT = "anonproxy_unit"
UNREAD = "anonproxy_unread"
HAVING_TYPES = "anonproxy_having_types"

def _literal(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    decimal = Decimal(value.numerator) / Decimal(value.denominator)
    return f"{decimal:f}"


def text_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def bounded_sql(query: AnalyticQuery, statistics: list[Statistic], public: list[Domain] | None, rows_cap: int,
         groups_cap: int, checks: list[str]) -> str:
    keys = [f"anonproxy_g{i}" for i in range(1, len(query.keys) + 1)]
    arguments: dict[str, str] = {}
    for stat in statistics:
        if stat.argument is not None and stat.argument not in arguments:
            arguments[stat.argument] = f"anonproxy_a{len(arguments) + 1}"

    where = [f"WHERE {query.where}"] if query.where is not None else []
    # CTEs that nothing references are never run (PostgreSQL plans no unreferenced SELECT CTE) but still parsed:
    # names are checked, $n parameters typed, and HAVING's comparisons of keys with constants type-checked.
    typecheck = [(HAVING_TYPES, "\n".join([f"SELECT FROM {query.from_sql}",
                                           f"WHERE {' AND '.join(f'({check})' for check in checks)}"]),
                  "HAVING's comparisons of grouping keys with constants: never run")] if checks else []
    if public is not None and not statistics:  # the domains, reading no row
        unread = (UNREAD, "\n".join([f"SELECT FROM {query.from_sql}", *where]),
                  "the client's FROM and WHERE: never run, nothing references it")
        return _with([unread, *typecheck, _domain_cte(public, keys)]) + f"\nSELECT {', '.join(keys)} FROM {DOMAIN}"
    select = [f"{query.unit} AS {UNIT}"]
    select += [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select += [f"{argument} AS {name}" for argument, name in arguments.items()]
    # Without bounding nothing reads the unit (each row is one): leaving it out spares decoding it (SELECT FROM t
    # with no column is valid PostgreSQL).
    plain = [f"SELECT {', '.join(select[1:])}", f"FROM {query.from_sql}", *where]
    if _single_by_policy(query):
        return _single(query, statistics, public, keys, arguments, typecheck)
    rows = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}", *where]
    ctes = [*typecheck,
            (GUARD, _guard(query), ("true when every table holds at most one row per unit (a valid unique index on "
             "its non-null unit column, no child table), as of this statement's snapshot: then no row needs to be "
             "dropped")),
            (PLAIN, "\n".join(plain), "the client's FROM and WHERE, when each unit has at most one row"),
            (ROWS, "\n".join(rows), "the client's FROM and WHERE, with the unit")]
    bounded = _bounded(keys, rows_cap, groups_cap)
    # Two branches, only one of which runs: the guard is a one-time condition above each (_only_if).
    single = f"(SELECT single FROM {GUARD})"
    branches = []
    for source, condition, bounded_rows in ((PLAIN, single, False), (bounded, f"NOT {single}", True)):
        aggregates = [f"{_aggregate(stat, arguments, bounded_rows)} AS {stat.name}" for stat in statistics]
        branch = [f"SELECT {', '.join([*keys, *aggregates])}", f"FROM {source}"]
        if bounded_rows and keys and not (rows_cap == 1 and groups_cap == 1):
            branch.append(f"WHERE anonproxy_group_rank <= {groups_cap}")
        branch += [f"GROUP BY {', '.join(keys)}"] if keys else []
        branches.append(_only_if(branch, condition))
    final = "\nUNION ALL\n".join(branches)
    if public is None:
        return _with(ctes) + "\n" + final
    ctes.append((STATS, final, f"at most {groups_cap} group(s) per unit; exact per-group statistics"))
    ctes.append(_domain_cte(public, keys))
    return _with(ctes) + "\n" + _over_domain(statistics, keys, public)


def keys_sql(query: AnalyticQuery) -> str:
    """The GROUP BY keys as the client's FROM and WHERE read them. Never run: prepared for PostgreSQL's
    description of the answer's key columns (a plain column's table and number, a type's modifier), which the
    measurement's SQL does not keep (its branches' UNION ALL describes no table)."""
    where = [f"WHERE {query.where}"] if query.where is not None else []
    return "\n".join([f"SELECT {', '.join(query.keys)}", f"FROM {query.from_sql}", *where])


def _only_if(branch: list[str], condition: str) -> str:
    """The rows of ``branch`` (a SELECT's lines) when ``condition``, a one-time condition, holds. OFFSET 0 keeps the
    condition out of the branch: PostgreSQL then checks it once, above the branch's plan, and when it is false
    never starts the branch, nor the parallel workers of its scan. (A condition inside the branch is pushed down to
    its scan and checked in each worker, once PostgreSQL has launched them.) Above the branch, it also drops the
    row an aggregate without GROUP BY returns for no input."""
    inner = "\n".join("  " + line for line in "\n".join([*branch, "OFFSET 0"]).split("\n"))
    return f"SELECT * FROM (\n{inner}\n) AS anonproxy_branch WHERE {condition}"


def _bounded(keys: list[str], rows_cap: int, groups_cap: int) -> str:
    """The bounded rows of ``anonproxy_rows``, as a subquery of the FROM that reads them. Not a CTE: the random
    numbers make it volatile, and PostgreSQL materializes a volatile CTE (every row written to a tuplestore, on disk
    past work_mem), where a subquery streams and leaves the rows' CTE inlined, so that an index leading with the
    unit can give the window its order (an incremental sort of each unit's rows)."""
    if rows_cap == 1 and (groups_cap == 1 or not keys):
        # One random row per unit (so one group): a single sort. Each group then has one row per unit. "<= 1", not
        # "= 1" (the same rows): its default estimate for "=" keeps 0.5 % of the rows, and PostgreSQL then sorted the
        # kept rows by group (on disk past work_mem) where it hashes them now.
        return "\n".join([
            "(SELECT * FROM (",
            f"  SELECT *, row_number() OVER (PARTITION BY {UNIT} ORDER BY random()) AS anonproxy_row_rank",
            f"  FROM {ROWS}",
            ") AS anonproxy_ranked WHERE anonproxy_row_rank <= 1",
            f") AS {BOUNDED}  -- one row per unit, chosen at random"])
    cell = ", ".join([UNIT, *keys])
    # The first random number of a cell (unit, group) in the cell's random order is the cell's own. It is a column
    # of the subquery below it: an argument of first_value would be evaluated again for each row.
    cells = "\n".join([
        "(SELECT *, row_number() OVER cell AS anonproxy_row_rank,",
        "    first_value(anonproxy_r) OVER cell AS anonproxy_cell_r",
        f"  FROM (SELECT *, random() AS anonproxy_r FROM {ROWS}) AS anonproxy_drawn",
        f"  WINDOW cell AS (PARTITION BY {cell} ORDER BY anonproxy_r)",
        f") AS {CELLS}  -- a random order of each unit's rows per group, a random number per (unit, group)"])
    ranked = "SELECT *"
    if keys:
        ranked = (f"SELECT *, dense_rank() OVER (PARTITION BY {UNIT} ORDER BY anonproxy_cell_r, {', '.join(keys)}) "
                  "AS anonproxy_group_rank")
    comment = f"at most {rows_cap} row(s) per unit and group" + (", groups ranked at random per unit" if keys else "")
    return "\n".join([f"({ranked}", f"FROM {cells}", f"WHERE anonproxy_row_rank <= {rows_cap}",
                      f") AS {BOUNDED}  -- {comment}"])


def _over_domain(statistics: list[Statistic], keys: list[str], public: list[Domain]) -> str:
    """Every group of the public domains, with its statistics (those of a group without rows: empty). A declared
    domain's values are text; a calendar key's buckets are values of the key's own type."""
    on = " AND ".join(f"s.{key}::text = d.{key}" if isinstance(domain, tuple) else f"s.{key} = d.{key}"
                      for key, domain in zip(keys, public, strict=True))
    return "\n".join([f"SELECT {', '.join(f'd.{key}' for key in keys)}, "
                      + ", ".join(f"coalesce(s.{stat.name}, {_EMPTY[stat.kind]}) AS {stat.name}" for stat in statistics),
                      f"FROM {DOMAIN} AS d LEFT JOIN {STATS} AS s ON {on}"])


def _single_by_policy(query: AnalyticQuery) -> bool:
    """Whether the policy's catalog facts make each row of the FROM clause one unit: the protected table alone
    (a reference table's key is not checked again at run time), its unit unique and not null."""
    return query.one_row_per_person and len(query.sources) == 1


def _single(query: AnalyticQuery, statistics: list[Statistic], public: list[Domain] | None,
            keys: list[str], arguments: dict[str, str], typecheck: list[tuple[str, str, str]]) -> str:
    """The statistics over the client's rows, each row one unit: no per-unit window, no guard, no second branch.
    The catalog fact is checked once, in the leader, before the scan, by a condition that reads no column."""
    ((_, table),) = query.sources
    assert table.protected is not None
    check = one_row_per_person(table.qualified, table.protected.unit_column)
    conditions = [check] if query.where is None else [check, f"({query.where})"]
    select = [f"{key} AS {name}" for key, name in zip(query.keys, keys, strict=True)]
    select += [f"{_aggregate(stat, {a: a for a in arguments}, False)} AS {stat.name}" for stat in statistics]
    lines = [f"SELECT {', '.join(select)}", f"FROM {query.from_sql}", "WHERE " + "\n  AND ".join(conditions)]
    lines += [f"GROUP BY {', '.join(query.keys)}"] if keys else []
    final = "\n".join(lines)
    if public is None:
        return (_with(typecheck) + "\n" if typecheck else "") + final
    ctes = [*typecheck, (STATS, final, "exact per-group statistics, each row one unit"), _domain_cte(public, keys)]
    return _with(ctes) + "\n" + _over_domain(statistics, keys, public)


def _domain_cte(public: list[Domain], keys: list[str]) -> tuple[str, str, str]:
    domain_from = []
    for i, (values, key) in enumerate(zip(public, keys, strict=True)):
        if isinstance(values, TimeDomain):  # the buckets of the declared range, listed from the calendar alone
            domain_from.append(f"({values.sql}) AS d{i + 1}({key})")
            continue
        array = ", ".join(text_literal(v) for v in values)
        domain_from.append(f"unnest(ARRAY[{array}]::text[]) AS d{i + 1}({key})")
    domain = [f"SELECT {', '.join(f'd{i + 1}.{key}' for i, key in enumerate(keys))}",
              f"FROM {' CROSS JOIN '.join(domain_from)}"]
    return DOMAIN, "\n".join(domain), "every value of the public domains (declared, or a calendar's buckets)"


def _guard(query: AnalyticQuery) -> str:
    """SQL: whether each table of the query has a valid, live, non-partial unique index on exactly its unit column
    (the linked key for a linked table) under the column's own collation and default operator class, that column
    is NOT NULL, and the table has no inheritance child or partition: FROM t reads those too, and the index does not
    cover them. (relhassubclass may stay true after the last child is dropped, until a VACUUM: then bounding runs,
    which is safe.)"""
    if any(table.reference is not None for _, table in query.sources):
        # A reference table's unique key was read with the policy; one dropped since (duplicates added) would let a
        # unit's row match twice until the proxy loads the policy again. Bounding keeps one row per unit whatever
        # the catalog says now.
        return "SELECT false AS single"
    pairs = set()
    for _, table in query.sources:
        column = table.protected.unit_column if table.protected is not None else table.linked.column  # type: ignore[union-attr]
        pairs.add(f"({text_literal(table.qualified)}::regclass::oid, {text_literal(column)}::name)")
    return "\n".join([
        "SELECT count(DISTINCT i.indrelid) = " + str(len(pairs)) + " AS single",
        "FROM pg_catalog.pg_index AS i",
        "JOIN pg_catalog.pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]",
        "JOIN pg_catalog.pg_class AS c ON c.oid = i.indrelid AND NOT c.relhassubclass",
        # unique under the unit's own equality: its collation and its type's default operator class ('r1' and 'R1'
        # are one person under a case-insensitive unit, two keys of an index under "C")
        "JOIN pg_catalog.pg_opclass AS o ON o.oid = i.indclass[0] AND o.opcdefault",
        "WHERE i.indisunique AND i.indisvalid AND i.indislive AND i.indnkeyatts = 1 AND i.indpred IS NULL",
        "  AND i.indexprs IS NULL AND a.attnotnull AND i.indcollation[0] = a.attcollation",
        f"  AND (i.indrelid, a.attname) IN ({', '.join(sorted(pairs))})"])


# an empty group's value
_EMPTY = {"units": "0", "rows": "0", "count": "0", "distinct": "0", "sum": "0", "values": "'{}'"}


def _aggregate(stat: Statistic, arguments: dict[str, str], bounded: bool) -> str:
    if stat.kind == "units":  # distinct units: every row without bounding, else each unit's first row in the group
        return "count(*) FILTER (WHERE anonproxy_row_rank = 1)" if bounded else "count(*)"
    if stat.kind == "rows":
        return "count(*)"
    argument = arguments[stat.argument]  # type: ignore[index]
    if stat.kind == "count":
        return f"count({argument})"
    if stat.kind == "distinct":  # over the bounded rows: a unit's c rows per group hold at most c distinct values
        return f"count(DISTINCT {argument})"
    assert stat.clamp is not None
    # GREATEST/LEAST skip NULLs (GREATEST(NULL, 17) = 17): a NULL must stay NULL, so that sum and array_agg skip it.
    clamped = (f"CASE WHEN {argument} IS NOT NULL THEN LEAST(GREATEST({argument}, {_literal(stat.clamp[0])}), "
               f"{_literal(stat.clamp[1])}) END")
    if stat.kind == "values":
        return f"array_agg({clamped}) FILTER (WHERE {argument} IS NOT NULL)"
    if stat.power == 1 and stat.offset == 0:
        total = f"coalesce(sum({clamped}), 0)"  # in the column's own type, like PostgreSQL's sum
        # Σ(x − c) = Σx − c·n: the same number, without per-row numeric arithmetic
        return total if stat.center == 0 else f"{total} - {_literal(stat.center)} * count({argument})"
    centred = f"({clamped})::numeric - {_literal(stat.center)}"  # numeric: no overflow, exact
    term = centred if stat.power == 1 else f"({centred}) * ({centred})"
    if stat.offset:
        term = f"{term} - {_literal(stat.offset)}"
    return f"coalesce(sum({term}), 0)"


def _with(ctes: list[tuple[str, str, str]]) -> str:
    parts = []
    for name, body, comment in ctes:
        indented = "\n".join("  " + line for line in body.split("\n"))
        parts.append(f"{name} AS (\n  -- {comment}\n{indented}\n)")
    return "WITH " + ",\n".join(parts)
