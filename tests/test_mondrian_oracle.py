"""anonproxy.anonymize_mondrian against a strict Mondrian written here, on generated tables full of ties.

The oracle below reads only the input rows and the hierarchy it loads, and
follows the rules docs/views.md states for strict Mondrian: values coded per
QI (numbers and plain categories by rank, hierarchy leaves in depth-first
order); a partition's candidates are the QIs with two codes or more; an
ordered QI is cut after its weighted median or after the value below it,
whichever balances the halves better, a hierarchy QI into the children of the
lowest common ancestor of its values; a cut is allowed when every part keeps
k units; among the allowed cuts the partition takes the one of best gain
(units × width removed on the cut QI, divided by the smallest part), ties to
the widest QI, then the first. Widths and gains are exact fractions here, so
the test also checks that no choice it makes is an exact tie, where rounding
in the database could legitimately pick the other cut.

The release must have exactly the oracle's equivalence classes (same rows
together, same cells), and every class at least k units.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from fractions import Fraction

import psycopg
import pytest

# Leaves of a three-level tree (leaf, parent, top): two branches of three.
TREE = [[leaf, "left", "*"] for leaf in ("la", "lb", "lc")] + [[leaf, "right", "*"] for leaf in ("ra", "rb", "rc")]
LEAVES = [row[0] for row in TREE]
COLORS = ["blue", "green", "red", "white"]  # a categorical QI without hierarchy (a value set)


@dataclass(frozen=True)
class Qi:
    name: str
    kind: str  # numeric, set or tree
    values: tuple  # every value of the domain, in code order (code = index + 1)


def tree_domain() -> list[str]:
    """Leaves in depth-first order: sorted by their path from the top."""
    return [leaf for _, leaf in sorted((tuple(reversed(row)), row[0]) for row in TREE)]


def width(qi: Qi, lo: int, hi: int) -> Fraction:
    """Normalized width of the codes lo..hi (1-based): the range of a number, codes of a set, leaves of the LCA."""
    if qi.kind == "numeric":
        return Fraction(qi.values[hi - 1] - qi.values[lo - 1], qi.values[-1] - qi.values[0])
    if qi.kind == "set":
        return Fraction(hi - lo, len(qi.values) - 1)
    node_lo, node_hi = lca_range(qi, lo, hi)
    return Fraction(node_hi - node_lo, len(qi.values) - 1)


def lca_path(qi: Qi, lo: int, hi: int) -> list[str]:
    """Nodes from the top down to the lowest common ancestor of the leaves coded lo..hi."""
    paths = [list(reversed(next(row for row in TREE if row[0] == leaf))) for leaf in qi.values[lo - 1:hi]]
    common = []
    for nodes in zip(*paths, strict=False):
        if len(set(nodes)) > 1:
            break
        common.append(nodes[0])
    return common


def lca_range(qi: Qi, lo: int, hi: int) -> tuple[int, int]:
    """The codes covered by the lowest common ancestor of the leaves coded lo..hi."""
    common = lca_path(qi, lo, hi)
    under = [code for code, leaf in enumerate(qi.values, 1)
             if list(reversed(next(row for row in TREE if row[0] == leaf)))[:len(common)] == common]
    return min(under), max(under)


def cell(qi: Qi, codes: list[int]) -> str:
    lo, hi = min(codes), max(codes)
    if qi.kind == "numeric":
        return str(qi.values[lo - 1]) if lo == hi else f"{qi.values[lo - 1]}-{qi.values[hi - 1]}"
    if qi.kind == "set":
        present = sorted({qi.values[c - 1] for c in codes})
        return present[0] if lo == hi else "{" + ",".join(present) + "}"
    return lca_path(qi, lo, hi)[-1]


def sides(qi: Qi, codes: list[int]) -> list[int]:
    """The side of each row's code in the partition's cut on this QI."""
    lo, hi = min(codes), max(codes)
    if qi.kind == "tree":
        depth = len(lca_path(qi, lo, hi))
        child = {leaf: list(reversed(next(row for row in TREE if row[0] == leaf)))[depth] for leaf in qi.values}
        return [sorted(set(child.values())).index(child[qi.values[c - 1]]) for c in codes]
    counts = Counter(codes)
    total, cum, cum_below, below, median, at_median = len(codes), 0, 0, None, None, 0
    for code in sorted(counts):
        cum += counts[code]
        if 2 * cum < total:
            below, cum_below = code, cum
        elif median is None:
            median, at_median = code, cum
    assert median is not None  # the last code always reaches half the units
    if below is None:
        start = median + 1
    elif at_median == total:
        start = below + 1
    elif min(at_median, total - at_median) >= min(cum_below, total - cum_below):
        start = median + 1
    else:
        start = below + 1
    return [int(c >= start) for c in codes]


def oracle(qis: list[Qi], rows: list[tuple[int, ...]], k: int) -> list[list[int]]:
    """Strict Mondrian over rows of codes (one unit each): the row indexes of every final partition."""
    final, stack = [], [list(range(len(rows)))]
    while stack:
        part = stack.pop()
        options = []
        for dim, qi in enumerate(qis):
            codes = [rows[r][dim] for r in part]
            if min(codes) == max(codes):
                continue
            side = sides(qi, codes)
            groups: dict[int, list[int]] = defaultdict(list)
            for r, s in zip(part, side, strict=True):
                groups[s].append(r)
            whole = width(qi, min(codes), max(codes))
            if len(groups) < 2 or min(map(len, groups.values())) < k:
                continue
            gain = sum(len(g) * (whole - width(qi, min(rows[r][dim] for r in g), max(rows[r][dim] for r in g)))
                       for g in groups.values()) / min(map(len, groups.values()))
            options.append((gain, whole, dim, list(groups.values())))
        if not options:
            final.append(part)
            continue
        options.sort(key=lambda o: (-o[0], -o[1], o[2]))
        if len(options) > 1:
            assert options[0][0] != options[1][0], "the oracle met an exact tie of gains; change the data"
        stack.extend(options[0][3])
    return final


def generated(seed: int, n: int) -> list[tuple]:
    """Rows (age, grade, leaf, color) with few distinct values: ties everywhere, skewed on purpose."""
    rng = random.Random(seed)
    return [(rng.choice([20, 20, 21, 23, 23, 23, 30, 34, 40, 41, 41, 60]), rng.randint(1, 5),
             rng.choice(LEAVES[:4] * 3 + LEAVES), rng.choice(COLORS + COLORS[:1] * 3)) for _ in range(n)]


def compare(conn: psycopg.Connection, columns: list[tuple[str, str, str | None]], data: list[tuple], k: int) -> None:
    """Stage data (one unit per row) as input, run anonymize_mondrian, compare with the oracle's classes."""
    conn.execute("create temp table input (_row bigint, _unit text, {})".format(
        ", ".join(f"{name} {'numeric' if kind == 'numeric' else 'text'}" for name, kind, _ in columns)))
    with conn.cursor().copy("copy input from stdin") as copy:
        for i, row in enumerate(data, 1):
            copy.write_row((i, f"u{i}", *row))
    spec = {"qi": [{"name": name, "kind": kind, "hierarchy": tree} for name, kind, tree in columns],
            "sensitive": None, "k": k, "variant": "strict", "output": "out"}
    conn.execute("select anonproxy.anonymize_mondrian('pg_temp.input', %s)", (json.dumps(spec),))
    names = ", ".join(name for name, _, _ in columns)
    released = {r[0]: tuple(r[1:]) for r in conn.execute(f"select _row, {names} from pg_temp.out")}

    qis = [Qi(name, "numeric", tuple(sorted({r[d] for r in data}))) if kind == "numeric"
           else Qi(name, "tree", tuple(tree_domain())) if tree
           else Qi(name, "set", tuple(sorted({r[d] for r in data})))
           for d, (name, kind, tree) in enumerate(columns)]
    coded = [tuple(qi.values.index(value) + 1 for qi, value in zip(qis, row, strict=True)) for row in data]
    expected = {}
    for part in oracle(qis, coded, k):
        cells = tuple(cell(qi, [coded[r][dim] for r in part]) for dim, qi in enumerate(qis))
        expected.update({r + 1: cells for r in part})

    assert released == expected
    assert min(Counter(released.values()).values()) >= k
    assert len(set(expected.values())) > 4, "the data should split several times"


@pytest.mark.parametrize(("seed", "n", "k"), [(1, 240, 5), (2, 400, 10), (3, 97, 3)])
def test_same_classes_as_the_oracle(postgresql: psycopg.Connection, seed: int, n: int, k: int) -> None:
    postgresql.execute("select anonproxy.load_hierarchy('test.leaves', %s::text[])", (TREE,))
    columns = [("age", "numeric", None), ("grade", "numeric", None), ("leaf", "categorical", "test.leaves"),
               ("color", "categorical", None)]
    compare(postgresql, columns, generated(seed, n), k)


def test_more_combinations_than_a_bigint_holds(postgresql: psycopg.Connection) -> None:
    # 9 QIs of 150 distinct values each: 150^9 ≈ 3.8e19 combinations do not fit a bigint key, so rows and
    # atoms are keyed by numeric.
    rng = random.Random(4)
    columns_of_values = [rng.sample(range(1000), 150) for _ in range(9)]
    data = list(zip(*columns_of_values, strict=True))
    compare(postgresql, [(f"q{d}", "numeric", None) for d in range(9)], data, 4)
