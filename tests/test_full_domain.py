"""anonproxy.anonymize_full_domain: optimal full-domain generalization over hierarchy levels.

Expected answers come from the example of Domingo-Ferrer, Sánchez, Soria-Comas,
*Database Anonymization* (2016), Table 5.1 and Fig. 5.3, and from a brute-force Python oracle in this file that enumerates the whole
lattice with the documented metric (NCP, suppressed rows fully generalized).
"""

from __future__ import annotations

import csv
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

# The ARX hierarchies of the Adult columns, as shipped with anonproxy.
ADULT_HIERARCHIES = Path(__file__).resolve().parent.parent / "anonproxy" / "data" / "hierarchies"
Hierarchy = dict[str, list[str]]  # leaf -> node per level (level 0 = the leaf)

# Table 5.1 of Domingo-Ferrer et al. 2016: (age, zip, condition).
TABLE_5_1 = [(21, 23058, "HD"), (24, 23059, "HD"), (26, 23060, "VI"), (27, 23061, "VI"),
             (43, 23058, "KS"), (43, 23059, "HD"), (47, 23060, "VI"), (49, 23061, "VI"),
             (32, 23058, "KS"), (34, 23059, "KS"), (35, 23060, "AIDS"), (38, 23061, "AIDS")]


def age_hierarchy(ages: Sequence[int]) -> Hierarchy:
    """Fig. 5.1: Age0 values, Age1 5-year ranges, Age2 10-year ranges, Age3 one value."""
    return {str(a): [str(a), f"{a // 5 * 5}-{a // 5 * 5 + 4}", f"{a // 10 * 10}-{a // 10 * 10 + 9}", "*"]
            for a in ages}


def zip_hierarchy(zips: Sequence[int]) -> Hierarchy:
    """Fig. 5.2: Zip0 values, Zip1 last digit masked, Zip2 one value."""
    return {str(z): [str(z), str(z)[:4] + "*", "*"] for z in zips}


def store_hierarchy(conn: psycopg.Connection, name: str, hierarchy: Hierarchy) -> None:
    levels = len(next(iter(hierarchy.values()))) - 1
    conn.execute("insert into anonproxy.hierarchies (name, levels, kind) values (%s, %s, 'explicit')", (name, levels))
    with conn.cursor().copy("copy anonproxy.hierarchy_nodes (hierarchy, leaf, level, node) from stdin") as copy:
        for leaf, nodes in hierarchy.items():
            for level, node in enumerate(nodes):
                copy.write_row((name, leaf, level, node))


@pytest.fixture
def conn(postgresql: psycopg.Connection) -> psycopg.Connection:
    return postgresql


def make_input(conn: psycopg.Connection, rows: Sequence[tuple], columns: str, units: Sequence[str] | None = None) -> None:
    """The dispatcher's temp table `input`: _row, _unit, then the given columns."""
    conn.execute(f"create temp table input (_row bigint, _unit text, {columns})")
    names = [c.split()[0] for c in columns.split(",")]
    with conn.cursor().copy(f"copy input (_row, _unit, {', '.join(names)}) from stdin") as copy:
        for i, row in enumerate(rows, start=1):
            copy.write_row((i, units[i - 1] if units else str(i), *row))


def run(conn: psycopg.Connection, spec: dict) -> tuple[dict, dict[int, tuple]]:
    facts = conn.execute("select anonproxy.anonymize_full_domain('input', %s)", (Jsonb(spec),)).fetchone()[0]
    names = [q["name"] for q in spec["qi"]]
    out = conn.execute(f"select _row, {', '.join(names)} from pg_temp.{spec['output']}").fetchall()
    return facts, {r[0]: tuple(r[1:]) for r in out}


def spec_for(qis: Sequence[tuple[str, str, str]], k: int, limit: float = 0.0, sensitive: dict | None = None,
             **model: object) -> dict:
    return {"qi": [{"name": n, "kind": kind, "hierarchy": h} for n, kind, h in qis], "sensitive": sensitive,
            "k": k, "l": None, "l_kind": "entropy", "c": None, "t": None, "t_distance": "ordered",
            "suppression_limit": limit, "variant": "strict", "output": "fd_out", **model}


# ---------------------------------------------------------------- the oracle

class Oracle:
    """Brute force over the whole lattice, written from the definitions, sharing nothing with the SQL."""

    def __init__(self, values: list[tuple], units: list[str], hierarchies: list[Hierarchy], kinds: list[str],
                 sensitive: list[str] | None = None) -> None:
        self.values, self.units, self.h, self.sensitive = values, units, hierarchies, sensitive
        self.heights = [len(next(iter(h.values()))) - 1 for h in hierarchies]
        self.ncp = [self._ncp(i, kinds[i]) for i in range(len(hierarchies))]

    def _ncp(self, i: int, kind: str) -> list[dict[str, float]]:
        present = sorted({str(v[i]) for v in self.values})
        per_level = []
        for level in range(self.heights[i] + 1):
            members: dict[str, list[str]] = defaultdict(list)
            for leaf in present:
                members[self.h[i][leaf][level]].append(leaf)
            if kind == "numeric":
                span = max(float(x) for x in present) - min(float(x) for x in present)
                per_level.append({node: (max(map(float, ls)) - min(map(float, ls))) / span if span else 0.0
                                  for node, ls in members.items()})
            else:
                per_level.append({node: (len(ls) - 1) / (len(present) - 1) if len(present) > 1 else 0.0
                                  for node, ls in members.items()})
        return per_level

    def lattice(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(h + 1) for h in self.heights)))

    def generalize(self, row: tuple, node: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(self.h[i][str(v)][node[i]] for i, v in enumerate(row))

    def evaluate(self, node: tuple[int, ...], k: int, limit: float, l_distinct: int | None = None,
                 t_equal: float | None = None) -> tuple[bool, float, set[int]]:
        """(satisfies, loss, suppressed row indexes) of one node."""
        classes: dict[tuple, list[int]] = defaultdict(list)
        for r, row in enumerate(self.values):
            classes[self.generalize(row, node)].append(r)
        suppressed = {r for rs in classes.values() if len({self.units[x] for x in rs}) < k for r in rs}
        if l_distinct is not None:
            suppressed |= {r for rs in classes.values() if len({self.sensitive[x] for x in rs}) < l_distinct
                           for r in rs}
        while t_equal is not None:
            kept = [r for r in range(len(self.values)) if r not in suppressed]
            whole = Counter(self.sensitive[r] for r in kept)
            failing = set()
            for rs in classes.values():
                live = [r for r in rs if r not in suppressed]
                if live:
                    local = Counter(self.sensitive[r] for r in live)
                    emd = sum(abs(local[s] / len(live) - whole[s] / len(kept)) for s in whole) / 2
                    if emd > t_equal + 1e-12:
                        failing |= set(live)
            if not failing:
                break
            suppressed |= failing
        n, m = len(self.values), len(node)
        cost = sum(m if r in suppressed else
                   sum(self.ncp[i][node[i]][self.h[i][str(v)][node[i]]] for i, v in enumerate(row))
                   for r, row in enumerate(self.values))
        ok = len(suppressed) <= math.floor(limit * n) and len(suppressed) < n
        return ok, cost / (n * m), suppressed

    def optimum(self, k: int, limit: float, **model: float) -> tuple[tuple[int, ...], float, set[int]]:
        scored = [(loss, sum(node), node, supp) for node in self.lattice()
                  for ok, loss, supp in [self.evaluate(node, k, limit, **model)] if ok]
        loss, _, node, supp = min(scored)
        return node, loss, supp

    def minimal_satisfying(self, k: int, limit: float) -> set[tuple[int, ...]]:
        good = {node for node in self.lattice() if self.evaluate(node, k, limit)[0]}
        return {g for g in good if not any(o != g and all(a <= b for a, b in zip(o, g)) for o in good)}


# ---------------------------------------------------------------- Table 5.1

def table_5_1(conn: psycopg.Connection, extra: Sequence[tuple] = (), units: Sequence[str] | None = None) -> Oracle:
    rows = [*TABLE_5_1, *extra]
    ages, zips = age_hierarchy([r[0] for r in rows]), zip_hierarchy([r[1] for r in rows])
    store_hierarchy(conn, "t51.age", ages)
    store_hierarchy(conn, "t51.zip", zips)
    make_input(conn, rows, "age numeric, zip text, condition text", units)
    unit_ids = list(units) if units else [str(i) for i in range(1, len(rows) + 1)]
    return Oracle([(r[0], r[1]) for r in rows], unit_ids, [ages, zips], ["numeric", "categorical"],
                  [r[2] for r in rows])


T51_QI = [("age", "numeric", "t51.age"), ("zip", "categorical", "t51.zip")]


def test_table_5_1_k2_finds_the_optimal_minimal_generalization(conn: psycopg.Connection) -> None:
    oracle = table_5_1(conn)
    # The book (Domingo-Ferrer et al. 2016): the minimal 2-anonymous generalizations are (Age1, Zip1) and (Age3, Zip0).
    assert oracle.minimal_satisfying(2, 0.0) == {(1, 1), (3, 0)}
    expected, loss, _ = oracle.optimum(2, 0.0)
    assert expected in {(1, 1), (3, 0)}

    facts, out = run(conn, spec_for(T51_QI, 2))

    assert tuple(facts["level_vector"]) == expected == (1, 1)
    assert facts["levels"] == {"age": 1, "zip": 1}
    assert facts["loss"] == pytest.approx(loss)
    assert facts["suppressed_rows"] == 0
    assert facts["equivalence_classes"] == 6
    assert out == {i: oracle.generalize(row, expected) for i, row in enumerate(oracle.values, start=1)}
    assert out[1] == ("20-24", "2305*") and out[12] == ("35-39", "2306*")
    # Pruning: fewer nodes evaluated than the 12 of the lattice.
    assert facts["lattice_size"] == 12 and facts["nodes_evaluated"] < 12


def test_suppression_limit_lets_an_outlier_go(conn: psycopg.Connection) -> None:
    oracle = table_5_1(conn, extra=[(62, 23070, "HD")])  # row 13: no other row near it
    qis = T51_QI

    # Within the limit (1 of 13 rows): the outlier is suppressed and (Age1, Zip1) is kept.
    node, loss, suppressed = oracle.optimum(2, 1 / 13)
    assert node == (1, 1) and suppressed == {12}
    facts, out = run(conn, spec_for(qis, 2, limit=1 / 13))
    assert tuple(facts["level_vector"]) == node
    assert facts["suppressed_rows"] == 1 and facts["loss"] == pytest.approx(loss)
    assert sorted(out) == list(range(1, 13))  # row 13 is absent

    # Below it, nothing may be suppressed: only the top node keeps the outlier in a class of 2.
    conn.execute("drop table pg_temp.fd_out")
    node, loss, suppressed = oracle.optimum(2, 0.07)
    assert node == (3, 2) and not suppressed
    facts, out = run(conn, spec_for(qis, 2, limit=0.07))
    assert tuple(facts["level_vector"]) == (3, 2) and facts["suppressed_rows"] == 0
    assert set(out.values()) == {("*", "*")} and len(out) == 13


def test_l_diversity_and_t_closeness_move_the_choice(conn: psycopg.Connection) -> None:
    oracle = table_5_1(conn)
    sensitive = {"name": "condition", "kind": "categorical", "hierarchy": None}
    model = {"l": 2, "l_kind": "distinct", "t": 0.5, "t_distance": "equal"}
    node, loss, _ = oracle.optimum(2, 0.0, l_distinct=2, t_equal=0.5)
    # (Age1, Zip1) has the class {HD, HD}; (Age3, Zip0) has classes with EMD at most 0.5.
    assert node == (3, 0)
    facts, out = run(conn, spec_for(T51_QI, 2, sensitive=sensitive, **model))
    assert tuple(facts["level_vector"]) == node and facts["loss"] == pytest.approx(loss)
    conditions = defaultdict(set)
    for r, cells in out.items():
        conditions[cells].add(TABLE_5_1[r - 1][2])
    assert min(len(c) for c in conditions.values()) >= 2


def test_counts_distinct_privacy_units(conn: psycopg.Connection) -> None:
    # Rows 1-2, 3-4 … are one person each at (Age1, Zip1): every class there has one unit.
    units = [str((i + 1) // 2) for i in range(1, 13)]
    oracle = table_5_1(conn, units=units)
    node, loss, _ = oracle.optimum(2, 0.0)
    assert node != (1, 1)
    facts, out = run(conn, spec_for(T51_QI, 2))
    assert tuple(facts["level_vector"]) == node and facts["loss"] == pytest.approx(loss)
    people = defaultdict(set)
    for r, cells in out.items():
        people[cells].add(units[r - 1])
    assert min(len(p) for p in people.values()) >= 2


@pytest.mark.parametrize("hierarchy, message", [(None, "needs a hierarchy for quasi-identifier zip"),
                                                ("t51.short", "value 23061 of quasi-identifier zip")])
def test_missing_hierarchy_fails_cleanly(conn: psycopg.Connection, hierarchy: str | None, message: str) -> None:
    table_5_1(conn)
    store_hierarchy(conn, "t51.short", zip_hierarchy([23058, 23059, 23060]))
    spec = spec_for([T51_QI[0], ("zip", "categorical", hierarchy)], 2)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        run(conn, spec)


def test_unsatisfiable_model_fails_cleanly(conn: psycopg.Connection) -> None:
    table_5_1(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="no full-domain generalization"):
        run(conn, spec_for(T51_QI, 13))


# ---------------------------------------------------------------- adult

ADULT_QI = ["age", "workclass", "education_num", "marital_status", "occupation", "race", "sex", "native_country"]


def adult_hierarchies(conn: psycopg.Connection) -> dict[str, Hierarchy]:
    found: dict[str, Hierarchy] = {}
    for column in ADULT_QI:
        if column == "education_num":  # numeric 1..16: ranges of width 2, 4, 8, then everything
            found[column] = {str(v): [str(v), *(f"{(v - 1) // w * w + 1}-{(v - 1) // w * w + w}" for w in (2, 4, 8)),
                                      "*"] for v in range(1, 17)}
        elif column == "age":  # ARX's age hierarchy for 1..100: ranges of width 5, 10, 20 from 0, then everything
            found[column] = {str(v): [str(v), *(f"{(v - 1) // w * w}-{(v - 1) // w * w + w - 1}" for w in (5, 10, 20)),
                                      "*"] for v in range(1, 101)}
        else:
            path = ADULT_HIERARCHIES / f"{column}.csv"
            with path.open(newline="") as f:
                found[column] = {row[0]: row for row in csv.reader(f, delimiter=";")}
        store_hierarchy(conn, f"h3.{column}", found[column])
    return found


def test_adult_k10_is_k_anonymous_and_minimal(conn: psycopg.Connection) -> None:
    hierarchies = adult_hierarchies(conn)
    conn.execute(
        "create temp table input as select id::bigint as _row, id::text as _unit, age::numeric as age, workclass, "
        "education_num::numeric as education_num, marital_status, occupation, race, sex, native_country from adult")
    kinds = {"age": "numeric", "education_num": "numeric"}
    spec = spec_for([(c, kinds.get(c, "categorical"), f"h3.{c}") for c in ADULT_QI], 10)

    facts, out = run(conn, spec)

    source = conn.execute(f"select id, {', '.join(ADULT_QI)} from adult").fetchall()
    node = facts["level_vector"]
    assert facts["suppressed_rows"] == 0 and len(out) == len(source) == 30162
    # Every released cell is the source value's ancestor at the chosen level.
    for row in source:
        assert out[row[0]] == tuple(hierarchies[c][str(v)][node[i]] for i, (c, v) in enumerate(zip(ADULT_QI, row[1:])))
    sizes = Counter(out.values())
    assert min(sizes.values()) >= 10 and facts["equivalence_classes"] == len(sizes)
    # Minimal: lowering any one attribute by a level breaks 10-anonymity.
    for i in range(len(node)):
        if node[i] > 0:
            lower = [*node[:i], node[i] - 1, *node[i + 1:]]
            finer = Counter(tuple(hierarchies[c][str(v)][lower[j]] for j, (c, v) in enumerate(zip(ADULT_QI, row[1:])))
                            for row in source)
            assert min(finer.values()) < 10, lower
