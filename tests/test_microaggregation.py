"""anonproxy.anonymize_mdav and anonproxy.anonymize_tclose_first (microaggregation).

Expected answers are derived by hand (small sets) or by an independent Python
oracle in this file (MDAV from Domingo-Ferrer, Sánchez, Soria-Comas, *Database Anonymization*,
2016, §3.2; the ordered EMD of Li, Li, Venkatasubramanian 2007; the cluster size of the
book's Eq. 7.3 with the floor fix of Eq. 7.4).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from statistics import fmean, pstdev

import psycopg
import pytest
from psycopg.types.json import Jsonb


def make_input(conn: psycopg.Connection, columns: str, rows: Sequence[tuple], units: Sequence[str] | None = None) -> None:
    """The dispatcher's temp table `input`: _row, _unit, then the given columns."""
    conn.execute(f"create temp table input (_row bigint, _unit text, {columns})")
    names = [c.split()[0] for c in columns.split(",")]
    with conn.cursor().copy(f"copy input (_row, _unit, {', '.join(names)}) from stdin") as copy:
        for i, row in enumerate(rows, start=1):
            copy.write_row((i, units[i - 1] if units else str(i), *row))


def spec_for(numeric: Sequence[str], categorical: Sequence[str] = (), k: int = 2, sensitive: dict | None = None,
             **model: object) -> dict:
    qi = [{"name": n, "kind": "numeric", "hierarchy": None} for n in numeric]
    qi += [{"name": n, "kind": "categorical", "hierarchy": None} for n in categorical]
    return {"qi": qi, "sensitive": sensitive, "k": k, "l": None, "l_kind": "entropy", "c": None, "t": None,
            "t_distance": "ordered", "suppression_limit": 0.0, "variant": "strict", "output": "ma_out", **model}


def run(conn: psycopg.Connection, method: str, spec: dict) -> tuple[dict, dict[int, tuple]]:
    facts = conn.execute(f"select anonproxy.anonymize_{method}('input', %s)", (Jsonb(spec),)).fetchone()[0]
    names = ", ".join(q["name"] for q in spec["qi"])
    out = conn.execute(f"select _row, {names} from pg_temp.ma_out").fetchall()
    # centroids are numeric (Decimal); compare them as floats
    return facts, {r[0]: tuple(float(v) if isinstance(v, Decimal) else v for v in r[1:]) for r in out}


def classes(out: dict[int, tuple]) -> list[list[int]]:
    found: dict[tuple, list[int]] = defaultdict(list)
    for row, cells in out.items():
        found[cells].append(row)
    return sorted(sorted(rows) for rows in found.values())


# ---------------------------------------------------------------- oracles

def standardize(points: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    columns = list(zip(*points))
    scaled = [[(x - fmean(c)) / pstdev(c) if pstdev(c) else 0.0 for x in c] for c in columns]
    return list(zip(*scaled))


def mdav(points: list[tuple[float, ...]], k: int) -> list[list[int]]:
    """MDAV as Domingo-Ferrer et al. 2016 §3.2 states it, on 1-based row numbers (data without distance ties)."""
    z = dict(enumerate(standardize(points), start=1))

    def dist(a: tuple[float, ...], b: Sequence[float]) -> float:
        return sum((x - y) ** 2 for x, y in zip(a, b))

    def centre(rows: set[int]) -> list[float]:
        return [fmean(z[r][j] for r in rows) for j in range(len(points[0]))]

    def farthest(point: Sequence[float], rows: set[int]) -> int:
        return max(rows, key=lambda r: dist(z[r], point))

    def group(point: Sequence[float], rows: set[int]) -> set[int]:
        return set(sorted(rows, key=lambda r: dist(z[r], point))[:k])

    left, groups = set(z), []
    while len(left) >= 3 * k:
        r = farthest(centre(left), left)
        s = farthest(z[r], left)
        for seed in (r, s):
            g = group(z[seed], left)
            groups.append(g)
            left -= g
    if len(left) >= 2 * k:
        g = group(z[farthest(centre(left), left)], left)
        groups.append(g)
        left -= g
    if left:
        groups.append(left)
    return sorted(sorted(g) for g in groups)


def ordered_emd(local: Sequence[float], whole: Sequence[float]) -> float:
    values = sorted(set(whole))
    p, q = Counter(local), Counter(whole)
    running, total = Fraction(0), Fraction(0)
    for v in values:
        running += Fraction(p[v], len(local)) - Fraction(q[v], len(whole))
        total += abs(running)
    return float(total / (len(values) - 1))


def equal_emd(local: Sequence[str], whole: Sequence[str]) -> float:
    p, q = Counter(local), Counter(whole)
    return sum(abs(p[v] / len(local) - q[v] / len(whole)) for v in q) / 2


def cluster_size(n: int, k: int, t: float) -> int:
    """Seed 001 Eq. 7.3, then Eq. 7.4 with the floor."""
    k = max(k, math.ceil(n / (2 * (n - 1) * t + 1)))
    return k + (n % k) // (n // k)


# ---------------------------------------------------------------- MDAV

# Three tight triples far apart and a loose five: by hand, MDAV (k = 3) first takes the
# farthest record from the mean, (21, 1), with its triple; then the record farthest from
# it, (10, 11), with its triple; the 5 left (fewer than 2k) form the last group.
HAND = [(1, 1, "a"), (2, 1, "a"), (1, 2, "b"), (10, 10, "a"), (11, 10, "b"), (10, 11, "b"),
        (20, 1, "a"), (21, 1, "a"), (20, 2, "b"), (5, 5, "a"), (6, 5, "b")]


def test_mdav_hand_checked_groups_and_centroids(postgresql: psycopg.Connection) -> None:
    make_input(postgresql, "x numeric, y numeric, c text", HAND)
    facts, out = run(postgresql, "mdav", spec_for(["x", "y"], ["c"], k=3))

    expected = [[1, 2, 3, 10, 11], [4, 5, 6], [7, 8, 9]]
    assert classes(out) == expected == mdav([(x, y) for x, y, _ in HAND], 3)
    assert sorted(out) == list(range(1, 12))  # every record, once
    assert facts["clusters"] == 3 and facts["smallest_cluster"] == 3 and facts["largest_cluster"] == 5
    for group in expected:
        assert 3 <= len(group) <= 5
        for r in group:  # centroids are means; the categorical QI is the mode
            x, y, c = out[r]
            assert x == pytest.approx(fmean(HAND[g - 1][0] for g in group))
            assert y == pytest.approx(fmean(HAND[g - 1][1] for g in group))
            assert c == Counter(HAND[g - 1][2] for g in group).most_common(1)[0][0]
    assert out[7][:2] == (pytest.approx(61 / 3), pytest.approx(4 / 3))


def test_mdav_matches_the_oracle_on_random_points(postgresql: psycopg.Connection) -> None:
    rng = random.Random(5)
    points = [(rng.uniform(0, 100), rng.uniform(0, 10), rng.uniform(-5, 5)) for _ in range(157)]
    make_input(postgresql, "a numeric, b numeric, c numeric", points)
    _, out = run(postgresql, "mdav", spec_for(["a", "b", "c"], k=5))
    expected = mdav(points, 5)
    assert classes(out) == expected
    assert all(5 <= len(g) <= 9 for g in expected) and sum(map(len, expected)) == 157


def test_mdav_counts_privacy_units(postgresql: psycopg.Connection) -> None:
    # 30 rows of 15 people, each person's two rows close together: groups by rows would
    # hold k rows but fewer than k people.
    rows = [(float(i // 2 * 10 + i % 2), 0.0) for i in range(30)]
    units = [f"p{i // 2}" for i in range(30)]
    make_input(postgresql, "x numeric, y numeric", rows, units)
    _, out = run(postgresql, "mdav", spec_for(["x", "y"], k=3))
    assert sorted(out) == list(range(1, 31))
    for group in classes(out):
        assert len({units[r - 1] for r in group}) >= 3


def test_mdav_merges_clusters_until_t_closeness(postgresql: psycopg.Connection) -> None:
    # The sensitive value follows x, so plain MDAV clusters are far from t-close.
    rows = [(float(i), float(i % 7), "high" if i >= 40 else "low") for i in range(60)]
    sensitive = {"name": "s", "kind": "categorical", "hierarchy": None}
    make_input(postgresql, "x numeric, y numeric, s text", rows)
    facts, out = run(postgresql, "mdav", spec_for(["x", "y"], k=4, sensitive=sensitive, t=0.2, t_distance="equal"))
    whole = [s for _, _, s in rows]
    assert facts["merges"] > 0
    for group in classes(out):
        assert len(group) >= 4
        assert equal_emd([rows[r - 1][2] for r in group], whole) <= 0.2 + 1e-9


def test_mdav_needs_a_numeric_quasi_identifier(postgresql: psycopg.Connection) -> None:
    make_input(postgresql, "c text", [("a",), ("b",), ("c",)])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="none of the quasi-identifiers is numeric"):
        run(postgresql, "mdav", spec_for([], ["c"], k=2))


ADULT_QI = ["age", "education_num", "hours_per_week"]


def adult_input(conn: psycopg.Connection) -> None:
    conn.execute(f"create temp table input as select id::bigint as _row, id::text as _unit, "
                 f"{', '.join(f'{q}::numeric as {q}' for q in ADULT_QI)}, income from adult")


def test_mdav_adult_k10(postgresql: psycopg.Connection) -> None:
    qis = ADULT_QI
    adult_input(postgresql)
    progress: list[str] = []
    postgresql.add_notice_handler(lambda d: progress.append(d.message_primary))
    facts, out = run(postgresql, "mdav", spec_for(qis, k=10))
    assert "anonproxy progress 30162 of 30162: mdav clustering" in progress
    source = {r[0]: r[1:] for r in postgresql.execute(f"select id, {', '.join(qis)} from adult")}
    assert sorted(out) == sorted(source)
    groups = classes(out)
    assert min(map(len, groups)) >= 10
    assert facts["clusters"] >= len(groups)  # clusters with equal centroids make one class
    for group in groups:
        for j in range(3):
            assert out[group[0]][j] == pytest.approx(fmean(source[r][j] for r in group))


# ---------------------------------------------------------------- t-closeness-first

def test_tclose_first_clusters_are_within_the_bound(postgresql: psycopg.Connection) -> None:
    n, t = 20, 0.11
    rows = [((g * 7) % 20, (g * 3) % 11, 100 + g * 13 % 20) for g in range(1, n + 1)]  # 20 distinct values of s
    sensitive = {"name": "s", "kind": "numeric", "hierarchy": None}
    make_input(postgresql, "x numeric, y numeric, s numeric", rows)
    facts, out = run(postgresql, "tclose_first", spec_for(["x", "y"], k=2, sensitive=sensitive, t=t))

    k = cluster_size(n, 2, t)
    assert k == 4 == facts["effective_k"]
    bound = (n - k) / (2 * (n - 1) * k)
    assert facts["emd_bound"] == pytest.approx(bound) and bound <= t
    whole = [s for _, _, s in rows]
    groups = classes(out)
    assert sorted(map(len, groups)) == [4] * 5
    for group in groups:
        values = sorted(rows[r - 1][2] for r in group)
        # one record from each stratum of 5 consecutive values
        assert [(v - 100) // 5 for v in values] == [0, 1, 2, 3]
        assert ordered_emd(values, whole) <= bound + 1e-12


def test_tclose_first_floor_fix_n11_k4(postgresql: psycopg.Connection) -> None:
    # Eq. 7.4 with the ceiling gives k = 6: one stratum record per cluster and 5 left over
    # for one cluster. The floor gives k = 5: strata of 2, 2, 3, 2, 2 and two clusters.
    assert 4 + math.ceil((11 % 4) / (11 // 4)) == 6 and cluster_size(11, 4, 1.0) == 5
    rows = [((g * 7) % 11, g) for g in range(1, 12)]
    sensitive = {"name": "s", "kind": "numeric", "hierarchy": None}
    make_input(postgresql, "x numeric, s numeric", rows)
    facts, out = run(postgresql, "tclose_first", spec_for(["x"], k=4, sensitive=sensitive, t=1.0))
    assert facts["effective_k"] == 5
    groups = classes(out)
    assert sorted(map(len, groups)) == [5, 6] and sorted(out) == list(range(1, 12))
    strata = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 3, 9: 3, 10: 4, 11: 4}
    for group in groups:
        assert {strata[r] for r in group} == {0, 1, 2, 3, 4}
        assert ordered_emd([rows[r - 1][1] for r in group], [s for _, s in rows]) <= 1.0


def test_tclose_first_with_ties_still_reaches_t(postgresql: psycopg.Connection) -> None:
    # Two sensitive values: strata mix them, so the bound of distinct values does not hold
    # by construction; the clusters that miss t are merged.
    rows = [(float(i), float(i % 5), "yes" if i % 7 == 0 else "no") for i in range(80)]
    sensitive = {"name": "s", "kind": "categorical", "hierarchy": None}
    make_input(postgresql, "x numeric, y numeric, s text", rows)
    facts, out = run(postgresql, "tclose_first", spec_for(["x", "y"], k=3, sensitive=sensitive, t=0.04,
                                                          t_distance="equal"))
    whole = [s for _, _, s in rows]
    assert facts["effective_k"] == cluster_size(80, 3, 0.04) == 11 and facts["merges"] > 0
    for group in classes(out):
        assert len(group) >= 11
        assert equal_emd([rows[r - 1][2] for r in group], whole) <= 0.04 + 1e-9


def test_tclose_first_refuses_several_rows_per_unit(postgresql: psycopg.Connection) -> None:
    make_input(postgresql, "x numeric, s numeric", [(1, 1), (2, 2), (3, 3), (4, 4)], units=["a", "a", "b", "c"])
    sensitive = {"name": "s", "kind": "numeric", "hierarchy": None}
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="one row per privacy unit"):
        run(postgresql, "tclose_first", spec_for(["x"], k=2, sensitive=sensitive, t=0.5))


def test_tclose_first_adult(postgresql: psycopg.Connection) -> None:
    adult_input(postgresql)
    sensitive = {"name": "income", "kind": "categorical", "hierarchy": None}
    facts, out = run(postgresql, "tclose_first", spec_for(ADULT_QI, k=10, sensitive=sensitive, t=0.02,
                                                          t_distance="equal"))
    k = cluster_size(30162, 10, 0.02)
    assert facts["effective_k"] == k == 25
    income = dict(postgresql.execute("select id, income from adult").fetchall())
    whole = list(income.values())
    groups = classes(out)
    assert sorted(out) == sorted(income)
    for group in groups:
        assert len(group) >= k
        assert equal_emd([income[r] for r in group], whole) <= 0.02 + 1e-9
