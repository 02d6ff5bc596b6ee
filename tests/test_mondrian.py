"""anonproxy.anonymize_mondrian, called directly on a staged `input` table (docs/views-internals.md).

Every property is checked by an oracle in this file that reads only the input
rows, the generalized output cells and the stored hierarchies: equivalence
classes are the rows sharing all generalized cells; counts are of distinct
privacy units; entropy, recursive diversity and the three EMDs are computed
here from their definitions (docs/glossary.md), not by the SQL under test.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

ADULT_QI = [
    ("age", "numeric", None),
    ("workclass", "categorical", "adult.workclass"),
    ("education_num", "numeric", None),
    ("marital_status", "categorical", "adult.marital_status"),
    ("occupation", "categorical", "adult.occupation"),
    ("race", "categorical", "adult.race"),
    ("sex", "categorical", "adult.sex"),
    ("native_country", "categorical", "adult.native_country"),
]

# Seed 000 Table 4.2: Nationality, Age, Disease.
TABLE_4_2 = [
    ("Russian", 20, "HIV"), ("Russian", 21, "Flu"), ("Russian", 24, "Flu"),
    ("German", 21, "Cancer"), ("German", 23, "Hepatitis"), ("French", 25, "Cancer"),
    ("French", 25, "HIV"), ("Japanese", 20, "Bronchitis"), ("Japanese", 24, "Hepatitis"),
    ("Japanese", 25, "Flu"), ("Chinese", 22, "Hepatitis"), ("Korean", 21, "Flu"),
]  # fmt: skip
NATIONALITY_TREE = [
    [leaf, "European", "*"] for leaf in ("Russian", "German", "French")
] + [[leaf, "Asian", "*"] for leaf in ("Japanese", "Chinese", "Korean")]


@dataclass
class Release:
    facts: dict[str, Any]
    qi: list[tuple[str, str, str | None]]
    rows: list[
        dict[str, Any]
    ]  # input row (with _unit) plus "cells": the generalized QI cells

    def classes(self) -> dict[tuple[str, ...], list[dict[str, Any]]]:
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
        for row in self.rows:
            groups[row["cells"]].append(row)
        return groups


def qi_spec(qi: Sequence[tuple[str, str, str | None]]) -> list[dict[str, Any]]:
    return [
        {"name": name, "kind": kind, "hierarchy": hierarchy}
        for name, kind, hierarchy in qi
    ]


def run(
    conn: psycopg.Connection,
    select: str,
    qi: Sequence[tuple[str, str, str | None]],
    **spec: Any,
) -> Release:
    """Stage `select` (columns _row, _unit, QIs, maybe a sensitive column) as input; run Mondrian."""
    conn.execute("drop table if exists pg_temp.input, pg_temp.out")
    conn.execute(f"create temp table input as {select}")
    full = {
        "qi": qi_spec(qi),
        "sensitive": None,
        "k": 2,
        "l": None,
        "l_kind": "entropy",
        "c": None,
        "t": None,
        "t_distance": "ordered",
        "suppression_limit": 0.0,
        "variant": "strict",
        "output": "out",
    }
    full.update(spec)
    facts = scalar(
        conn,
        "select anonproxy.anonymize_mondrian('pg_temp.input', %s)",
        json.dumps(full),
    )
    names = [name for name, _, _ in qi]
    cursor = conn.execute(
        "select i.*, "
        + ", ".join(f"o.{n} as g_{n}" for n in names)
        + " from pg_temp.input i join pg_temp.out o using (_row) order by _row"
    )
    assert cursor.description is not None
    columns = [d.name for d in cursor.description]
    rows = []
    for values in cursor.fetchall():
        row = dict(zip(columns, values, strict=True))
        row["cells"] = tuple(row.pop(f"g_{n}") for n in names)
        rows.append(row)
    input_rows = scalar(conn, "select count(*) from pg_temp.input")
    assert len(rows) == input_rows, (
        "Mondrian suppresses nothing: every input row has an output row"
    )
    return Release(facts, list(qi), rows)


def scalar(conn: psycopg.Connection, query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def hierarchy(
    conn: psycopg.Connection, name: str
) -> tuple[int, dict[str, dict[int, str]]]:
    """(levels, leaf → {level: node}) as stored."""
    levels = scalar(
        conn, "select levels from anonproxy.hierarchies where name = %s", name
    )
    tree: dict[str, dict[int, str]] = defaultdict(dict)
    for leaf, level, node in conn.execute(
        "select leaf, level, node from anonproxy.hierarchy_nodes where hierarchy = %s",
        (name,),
    ):
        tree[leaf][level] = node
    return levels, tree


def interval(cell: str) -> tuple[float, float]:
    """The range of a numeric cell: "lo-hi" or one value (a negative number starts with '-')."""
    head, sep, tail = cell[1:].partition("-")
    if not sep:
        return float(cell), float(cell)
    return float(cell[0] + head), float(tail)


def members(conn: psycopg.Connection, cell: str, tree_name: str | None) -> set[str]:
    """The values a categorical cell stands for: a text[] set, a hierarchy node's leaves, or the value."""
    if cell.startswith("{"):
        return {
            value for (value,) in conn.execute("select unnest(%s::text[])", (cell,))
        }
    if tree_name is not None:
        _, tree = hierarchy(conn, tree_name)
        return {leaf for leaf, nodes in tree.items() if cell in nodes.values()}
    return {cell}


def assert_cells_cover(conn: psycopg.Connection, release: Release) -> None:
    cache: dict[tuple[str, str], set[str]] = {}
    for row in release.rows:
        for (name, kind, tree), cell in zip(release.qi, row["cells"], strict=True):
            if kind == "numeric":
                low, high = interval(cell)
                assert low <= float(row[name]) <= high, (name, row[name], cell)
            else:
                if (name, cell) not in cache:
                    cache[name, cell] = members(conn, cell, tree)
                assert row[name] in cache[name, cell], (name, row[name], cell)


def units(rows: list[dict[str, Any]]) -> int:
    return len({row["_unit"] for row in rows})


def assert_k(release: Release, k: int) -> None:
    sizes = [units(rows) for rows in release.classes().values()]
    assert min(sizes) >= k, (
        f"an equivalence class has {min(sizes)} distinct units < k = {k}"
    )


def distribution(rows: list[dict[str, Any]], sensitive: str) -> dict[Any, float]:
    """p(s): distinct units holding s, normalized over the values."""
    holders: dict[Any, set[str]] = defaultdict(set)
    for row in rows:
        holders[row[sensitive]].add(row["_unit"])
    total = sum(len(u) for u in holders.values())
    return {value: len(u) / total for value, u in holders.items()}


def entropy(p: dict[Any, float]) -> float:
    return -sum(x * math.log(x) for x in p.values() if x > 0)


def emd_equal(p: dict[Any, float], q: dict[Any, float]) -> float:
    return 0.5 * sum(abs(p.get(v, 0.0) - q[v]) for v in q)


def emd_ordered(p: dict[Any, float], q: dict[Any, float]) -> float:
    values = sorted(q)
    cumulative, total = 0.0, 0.0
    for value in values:
        cumulative += p.get(value, 0.0) - q[value]
        total += abs(cumulative)
    return total / (len(values) - 1)


def emd_hierarchical(
    p: dict[Any, float],
    q: dict[Any, float],
    levels: int,
    tree: dict[str, dict[int, str]],
) -> float:
    """Σ over internal nodes N of height(N)/H · min(positive, negative extra of N's children)."""
    cost = 0.0
    for level in range(1, levels + 1):
        children: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for leaf, share in q.items():
            children[tree[leaf][level]][tree[leaf][level - 1]] += (
                p.get(leaf, 0.0) - share
            )
        for extras in children.values():
            positive = sum(e for e in extras.values() if e > 0)
            negative = -sum(e for e in extras.values() if e < 0)
            cost += level / levels * min(positive, negative)
    return cost


def ncp(conn: psycopg.Connection, release: Release) -> float:
    """Average over cells: numeric (hi−lo)/(table range); hierarchy (leaves under node − 1)/(leaves − 1)."""
    spans = {}
    leaves: dict[str, int] = {}
    for name, kind, tree in release.qi:
        if kind == "numeric":
            values = [float(row[name]) for row in release.rows]
            spans[name] = max(values) - min(values)
        else:
            assert tree is not None, "NCP of a categorical QI needs its hierarchy"
            leaves[name] = len(hierarchy(conn, tree)[1])
    cache: dict[tuple[str, str], float] = {}
    total = 0.0
    for row in release.rows:
        for (name, kind, tree), cell in zip(release.qi, row["cells"], strict=True):
            if (name, cell) not in cache:
                if kind == "numeric":
                    low, high = interval(cell)
                    cache[name, cell] = (high - low) / spans[name]
                else:
                    cache[name, cell] = (len(members(conn, cell, tree)) - 1) / (
                        leaves[name] - 1
                    )
            total += cache[name, cell]
    return total / (len(release.rows) * len(release.qi))


def table_4_2(conn: psycopg.Connection) -> str:
    conn.execute(
        "select anonproxy.load_hierarchy('test.nationality', %s::text[])",
        (NATIONALITY_TREE,),
    )
    conn.execute(
        "create temp table table_4_2 (nationality text, age integer, disease text)"
    )
    with conn.cursor().copy("copy table_4_2 from stdin") as copy:
        for row in TABLE_4_2:
            copy.write_row(row)
    return (
        "select row_number() over ()::bigint as _row, (row_number() over ())::text as _unit, "
        "nationality, age::numeric as age, disease from table_4_2"
    )


NATIONALITY_AGE = [
    ("nationality", "categorical", "test.nationality"),
    ("age", "numeric", None),
]


def test_table_4_2_k6_splits_once_on_age(postgresql: psycopg.Connection) -> None:
    # By hand: the nationality split (European 7 | Asian 5) leaves 5 < 6, so
    # the cut is on age at the median 22: 6 rows ≤ 22 and 6 rows ≥ 23.
    release = run(postgresql, table_4_2(postgresql), NATIONALITY_AGE, k=6)
    assert sorted(Counter(row["cells"] for row in release.rows).items()) == [
        (("*", "20-22"), 6),
        (("*", "23-25"), 6),
    ]
    assert release.facts["partitions"] == 2
    assert release.facts["variant"] == "strict"


def test_table_4_2_k3_by_hand(postgresql: psycopg.Connection) -> None:
    # By hand. Root: both QIs have normalized width 1, nationality comes first:
    # European 7 | Asian 5. European (R20 R21 R24 G21 G23 F25 F25): age is
    # wider (1 > 2/5); median 23, and cutting at 23 or at 21 balances equally
    # (4|3, 3|4), so ≤ 23 | > 23. Asian (J20 J24 J25 C22 K21): age ≤ 22 leaves
    # 2 < 3 above, and Chinese alone is 1 < 3, so it stays whole.
    release = run(postgresql, table_4_2(postgresql), NATIONALITY_AGE, k=3)
    assert Counter(row["cells"] for row in release.rows) == {
        ("European", "20-23"): 4,
        ("European", "24-25"): 3,
        ("Asian", "20-25"): 5,
    }
    by_row = {
        (row["nationality"], int(row["age"])): row["cells"] for row in release.rows
    }
    assert by_row[("German", 23)] == ("European", "20-23")
    assert by_row[("Russian", 24)] == ("European", "24-25")
    assert_k(release, 3)
    assert_cells_cover(postgresql, release)


def test_table_4_2_entropy_l2(postgresql: psycopg.Connection) -> None:
    release = run(
        postgresql,
        table_4_2(postgresql),
        NATIONALITY_AGE,
        k=2,
        l=2,
        l_kind="entropy",
        sensitive={"name": "disease", "kind": "categorical", "hierarchy": None},
    )
    assert_k(release, 2)
    assert_cells_cover(postgresql, release)
    for rows in release.classes().values():
        assert entropy(distribution(rows, "disease")) >= math.log(2) - 1e-12
    assert len(release.classes()) > 1  # the table itself is far more diverse than ℓ = 2


def test_value_sets_without_hierarchy(postgresql: psycopg.Connection) -> None:
    release = run(
        postgresql, table_4_2(postgresql), [("nationality", "categorical", None)], k=4
    )
    assert_k(release, 4)
    assert_cells_cover(postgresql, release)
    cells = {row["cells"][0] for row in release.rows}
    assert all(cell.startswith("{") for cell in cells), (
        cells
    )  # no single nationality has 4 rows
    # strict: the sets are disjoint
    sets = [members(postgresql, cell, None) for cell in cells]
    assert sum(len(m) for m in sets) == len(set().union(*sets)) == 6


def test_strict_and_relaxed_differ_on_a_heavy_median(
    postgresql: psycopg.Connection,
) -> None:
    # Ages 30 ×8, 31, 32 and k = 4. Strict cannot cut: ≤ 30 leaves 2 rows
    # above. Relaxed sends 5 of the 30s low and the rest high.
    select = (
        "select g::bigint as _row, g::text as _unit, "
        "(case when g <= 8 then 30 when g = 9 then 31 else 32 end)::numeric as age "
        "from generate_series(1, 10) g"
    )
    strict = run(postgresql, select, [("age", "numeric", None)], k=4)
    assert Counter(row["cells"] for row in strict.rows) == {("30-32",): 10}
    relaxed = run(
        postgresql, select, [("age", "numeric", None)], k=4, variant="relaxed"
    )
    assert Counter(row["cells"] for row in relaxed.rows) == {("30",): 5, ("30-32",): 5}
    assert relaxed.facts["variant"] == "relaxed"
    assert_k(relaxed, 4)


def test_k_larger_than_the_table_gives_one_class(
    postgresql: psycopg.Connection,
) -> None:
    release = run(postgresql, table_4_2(postgresql), NATIONALITY_AGE, k=13)
    assert {row["cells"] for row in release.rows} == {("*", "20-25")}
    assert release.facts["partitions"] == 1


def test_units_with_several_rows_count_once(postgresql: psycopg.Connection) -> None:
    # Unit A has ages 20, 21, 22; B 20; C 24; D 25; E 26; k = 2 units. Cut at
    # 22: {A, B} | {C, D, E}. Neither half splits again without leaving a
    # side with one unit (e.g. {20} | {21, 22} is A alone), though counting
    # rows would allow it.
    select = (
        "select row_number() over ()::bigint as _row, u as _unit, a::numeric as age "
        "from (values ('A', 20), ('A', 21), ('A', 22), ('B', 20), ('C', 24), ('D', 25), ('E', 26)) v(u, a)"
    )
    release = run(postgresql, select, [("age", "numeric", None)], k=2)
    assert Counter(row["cells"] for row in release.rows) == {
        ("20-22",): 4,
        ("24-26",): 3,
    }
    assert_k(release, 2)


def adult_input(sensitive: str | None = None) -> str:
    columns = ", ".join(name for name, _, _ in ADULT_QI)
    extra = f", {sensitive}" if sensitive else ""
    return f"select id::bigint as _row, id::text as _unit, {columns}{extra} from adult"


def test_adult_k10_strict(postgresql: psycopg.Connection) -> None:
    release = run(postgresql, adult_input(), ADULT_QI, k=10)
    assert_k(release, 10)
    assert_cells_cover(postgresql, release)
    # The public strict Mondrian of qiyuangong/Mondrian reaches NCP 11.24 % with 1,795 classes.
    assert ncp(postgresql, release) <= 0.1124
    assert release.facts["partitions"] == len(release.classes())


def test_adult_relaxed_k10(postgresql: psycopg.Connection) -> None:
    release = run(postgresql, adult_input(), ADULT_QI, k=10, variant="relaxed")
    assert_k(release, 10)
    assert_cells_cover(postgresql, release)


SMALL_QI = [
    ("age", "numeric", None),
    ("education_num", "numeric", None),
    ("sex", "categorical", "adult.sex"),
    ("race", "categorical", "adult.race"),
]


def adult_small(sensitive: str) -> str:
    return f"select id::bigint as _row, id::text as _unit, age, education_num, sex, race, {sensitive} from adult"


def test_adult_entropy_l3_on_occupation(postgresql: psycopg.Connection) -> None:
    release = run(
        postgresql,
        adult_small("occupation"),
        SMALL_QI,
        k=5,
        l=3,
        l_kind="entropy",
        sensitive={
            "name": "occupation",
            "kind": "categorical",
            "hierarchy": "adult.occupation",
        },
    )
    assert_k(release, 5)
    assert len(release.classes()) > 20
    for rows in release.classes().values():
        assert entropy(distribution(rows, "occupation")) >= math.log(3) - 1e-9


def test_adult_recursive_and_distinct_diversity(postgresql: psycopg.Connection) -> None:
    sensitive = {"name": "occupation", "kind": "categorical", "hierarchy": None}
    recursive = run(
        postgresql,
        adult_small("occupation"),
        SMALL_QI,
        k=5,
        l=3,
        l_kind="recursive",
        c=2,
        sensitive=sensitive,
    )
    assert len(recursive.classes()) > 20
    for rows in recursive.classes().values():
        counts = sorted(
            Counter(row["occupation"] for row in rows).values(), reverse=True
        )
        assert counts[0] < 2 * sum(counts[2:])
    distinct = run(
        postgresql,
        adult_small("occupation"),
        SMALL_QI,
        k=5,
        l=6,
        l_kind="distinct",
        sensitive=sensitive,
    )
    assert len(distinct.classes()) > 20
    assert (
        min(
            len({row["occupation"] for row in rows})
            for rows in distinct.classes().values()
        )
        >= 6
    )


@pytest.mark.parametrize(("sensitive", "kind", "tree", "distance", "t"), [
    ("hours_per_week", "numeric", None, "ordered", 0.1),
    ("marital_status", "categorical", None, "equal", 0.3),
    ("occupation", "categorical", "adult.occupation", "hierarchical", 0.1),
])  # fmt: skip
def test_adult_t_closeness(
    postgresql: psycopg.Connection,
    sensitive: str,
    kind: str,
    tree: str | None,
    distance: str,
    t: float,
) -> None:
    release = run(
        postgresql,
        adult_small(sensitive),
        SMALL_QI,
        k=5,
        t=t,
        t_distance=distance,
        sensitive={"name": sensitive, "kind": kind, "hierarchy": tree},
    )
    assert_k(release, 5)
    assert len(release.classes()) > 10
    q = distribution(release.rows, sensitive)
    levels, nodes = hierarchy(postgresql, tree) if tree is not None else (0, {})
    for rows in release.classes().values():
        p = distribution(rows, sensitive)
        if distance == "ordered":
            emd = emd_ordered(p, q)
        elif distance == "equal":
            emd = emd_equal(p, q)
        else:
            emd = emd_hierarchical(p, q, levels, nodes)
        assert emd <= t + 1e-9, (distance, emd)


@pytest.mark.parametrize(("spec", "sqlstate", "words"), [
    ({"variant": "loose"}, "22023", "variant"),
    ({"k": 0}, "22023", "k"),
    ({"l": 2}, "22023", "sensitive"),
    ({"t": 0.2, "t_distance": "hierarchical",
      "sensitive": {"name": "disease", "kind": "categorical", "hierarchy": None}}, "22023", "hierarchy"),
])  # fmt: skip
def test_bad_spec_fails_cleanly(
    postgresql: psycopg.Connection, spec: dict[str, Any], sqlstate: str, words: str
) -> None:
    with pytest.raises(psycopg.Error) as failure:
        run(postgresql, table_4_2(postgresql), NATIONALITY_AGE, **spec)
    assert failure.value.sqlstate == sqlstate
    assert words in str(failure.value)


def test_value_outside_the_hierarchy_fails(postgresql: psycopg.Connection) -> None:
    select = table_4_2(postgresql) + " union all select 13, '13', 'Martian', 30, 'Flu'"
    with pytest.raises(psycopg.Error) as failure:
        run(postgresql, select, NATIONALITY_AGE)
    assert failure.value.sqlstate == "22023"
    assert "Martian" in str(failure.value)


def boxes_overlap(conn: psycopg.Connection, release: Release) -> int:
    """How many pairs of classes share a point of the QI space (covers intersect on every QI)."""
    covers = [
        [
            interval(cell) if kind == "numeric" else members(conn, cell, tree)
            for (_, kind, tree), cell in zip(release.qi, cells, strict=True)
        ]
        for cells in release.classes()
    ]
    overlapping = 0
    for i, first in enumerate(covers):
        for second in covers[i + 1 :]:
            if all(meet(a, b) for a, b in zip(first, second, strict=True)):
                overlapping += 1
    return overlapping


def meet(a: tuple[float, float] | set[str], b: tuple[float, float] | set[str]) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a[0] <= b[1] and b[0] <= a[1]
    assert isinstance(a, set) and isinstance(b, set)
    return bool(a & b)


def test_strict_classes_are_disjoint_and_relaxed_ones_share_median_values(
    postgresql: psycopg.Connection,
) -> None:
    strict = run(postgresql, adult_input(), ADULT_QI, k=50)
    assert len(strict.classes()) > 100
    assert boxes_overlap(postgresql, strict) == 0
    relaxed = run(postgresql, adult_input(), ADULT_QI, k=50, variant="relaxed")
    assert_k(relaxed, 50)
    assert boxes_overlap(postgresql, relaxed) > 0


def test_null_quasi_identifier_fails(postgresql: psycopg.Connection) -> None:
    select = table_4_2(postgresql) + " union all select 13, '13', 'Korean', null, 'Flu'"
    with pytest.raises(psycopg.Error) as failure:
        run(postgresql, select, NATIONALITY_AGE)
    assert failure.value.sqlstate == "22004"
    assert "age" in str(failure.value)


def test_column_and_output_names_are_quoted(postgresql: psycopg.Connection) -> None:
    age, kind, output = 'a"ge; drop', "Select", 'out "put"'
    postgresql.execute(
        sql.SQL(
            "create temp table input as select g::bigint as _row, g::text as _unit, "
            "(g % 7)::numeric as {}, (g % 3)::text as {} from generate_series(1, 40) g"
        ).format(sql.Identifier(age), sql.Identifier(kind))
    )
    spec = {
        "qi": qi_spec([(age, "numeric", None), (kind, "categorical", None)]),
        "sensitive": None,
        "k": 5,
        "variant": "strict",
        "output": output,
    }
    postgresql.execute(
        "select anonproxy.anonymize_mondrian('pg_temp.input', %s)", (json.dumps(spec),)
    )
    rows = postgresql.execute(
        sql.SQL(
            "select o.{}, o.{} from pg_temp.input i join pg_temp.{} o using (_row)"
        ).format(sql.Identifier(age), sql.Identifier(kind), sql.Identifier(output))
    ).fetchall()
    assert len(rows) == 40
    sizes = Counter(rows)
    assert min(sizes.values()) >= 5 and len(sizes) > 1
