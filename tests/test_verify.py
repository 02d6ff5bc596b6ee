"""The verification functions of sql/0009_verify.sql against known answers.

Expected values come from small tables of the literature (typed in from the
papers, answers worked out by hand in the comments), from a
brute-force oracle written here, and from pycanon (an independent
implementation, PyPI) on generalizations of adult.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from itertools import product
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb
from pycanon import anonymity  # type: ignore[import-untyped]

from anonproxy import cli, sample_data
from anonproxy.embedded import EmbeddedPostgres

Row = tuple[Any, ...]


@pytest.fixture
def db(postgresql: psycopg.Connection) -> psycopg.Connection:
    postgresql.commit()
    postgresql.autocommit = True
    return postgresql


def make_table(db: psycopg.Connection, name: str, columns: dict[str, str], rows: list[Row]) -> None:
    db.execute(sql.SQL("create table {} ({})").format(
        sql.Identifier(name),
        sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in columns.items())))
    with db.cursor().copy(sql.SQL("copy {} from stdin").format(sql.Identifier(name))) as copy:
        for row in rows:
            copy.write_row(row)


def scalar(db: psycopg.Connection, query: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> Any:
    row = db.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def k_of(db: psycopg.Connection, table: str, qi: list[str]) -> int:
    return scalar(db, "select anonproxy.k_anonymity(%s, %s)", (table, qi))


def l_of(db: psycopg.Connection, table: str, qi: list[str], sensitive: str, kind: str,
         l: int | None = None) -> Decimal:
    return scalar(db, "select anonproxy.l_diversity(%s, %s, %s, %s, %s)", (table, qi, sensitive, kind, l))


def t_of(db: psycopg.Connection, table: str, qi: list[str], sensitive: str, distance: str,
         hierarchy: str | None = None) -> Decimal:
    return scalar(db, "select anonproxy.t_closeness(%s, %s, %s, %s, %s)", (table, qi, sensitive, distance, hierarchy))


def utility(db: psycopg.Connection, source: str, target: str, qi: list[str], **named: Any) -> dict[str, Any]:
    """anonproxy.utility(source, target, qi, name => value, ...)."""
    params = {"source": source, "target": target, "qi": qi,
              **{name: Jsonb(value) if isinstance(value, dict) else value for name, value in named.items()}}
    arguments = "".join(f", {name} => %({name})s" for name in named)
    return scalar(db, f"select anonproxy.utility(%(source)s, %(target)s, %(qi)s{arguments})", params)


def load_hierarchy(db: psycopg.Connection, name: str, rows: list[list[str]]) -> None:
    db.execute("select anonproxy.load_hierarchy(%s, %s::text[])", (name, rows))


# --- Chen et al. 2009, Tables 1.1-1.3 -----------------------------------------------------------------------

PATIENTS = {"age": "integer", "gender": "text", "zip": "text", "nationality": "text", "condition": "text"}
TABLE_1_1: list[Row] = [
    (28, "F", "13053", "Russian", "Heart disease"), (29, "M", "13068", "Chinese", "Heart disease"),
    (21, "F", "13068", "Japanese", "Viral infection"), (23, "M", "13053", "American", "Viral infection"),
    (50, "M", "14853", "Indian", "Cancer"), (55, "M", "14750", "Japanese", "Flu"),
    (47, "M", "14562", "Chinese", "Heart disease"), (49, "F", "14821", "Korean", "Flu"),
    (31, "M", "13222", "American", "Cancer"), (37, "F", "13227", "American", "Cancer"),
    (36, "M", "13228", "American", "Cancer"), (35, "M", "13221", "American", "Cancer"),
]
GENERALIZED = dict.fromkeys(("age", "gender", "zip", "nationality", "condition"), "text")
TABLE_1_2: list[Row] = (
    [("20-29", "Any", "130**", "Any", c) for c in ("Heart disease", "Heart disease", "Viral infection",
                                                   "Viral infection")]
    + [("40-59", "Any", "14***", "Asian", c) for c in ("Cancer", "Flu", "Heart disease", "Flu")]
    + [("30-39", "Any", "1322*", "American", "Cancer")] * 4
)
TABLE_1_3: list[Row] = (
    [("20-59", "F", "1****", "Any", c) for c in ("Heart disease", "Flu", "Viral infection", "Cancer")]
    + [("20-59", "M", "1****", "Asian", c) for c in ("Cancer", "Flu", "Heart disease", "Heart disease")]
    + [("20-39", "M", "13***", "American", c) for c in ("Cancer", "Viral infection", "Cancer", "Cancer")]
)
PATIENT_QI = ["age", "gender", "zip", "nationality"]
# The hierarchies Tables 1.2 and 1.3 generalize with (ages are plain ranges).
GENDER_TREE = [["F", "Any"], ["M", "Any"]]
NATIONALITY_TREE = [[n, "Asian", "Any"] for n in ("Chinese", "Japanese", "Indian", "Korean")] + [
    ["Russian", "European", "Any"], ["American", "American", "Any"]]
ZIP_TREE = [[z] + [z[:5 - i] + "*" * i for i in range(1, 6)] for z in sorted({r[2] for r in TABLE_1_1})]


@pytest.fixture
def patients(db: psycopg.Connection) -> psycopg.Connection:
    make_table(db, "table_1_1", PATIENTS, TABLE_1_1)
    make_table(db, "table_1_2", GENERALIZED, TABLE_1_2)
    make_table(db, "table_1_3", GENERALIZED, TABLE_1_3)
    load_hierarchy(db, "table_1_1.gender", GENDER_TREE)
    load_hierarchy(db, "table_1_1.nationality", NATIONALITY_TREE)
    load_hierarchy(db, "patients.zip", ZIP_TREE)
    return db


def test_table_1_2_is_4_anonymous_with_dm_48_and_distinct_l_1(patients: psycopg.Connection) -> None:
    assert k_of(patients, "table_1_2", PATIENT_QI) == 4
    # EC 3 is all Cancer.
    assert l_of(patients, "table_1_2", PATIENT_QI, "condition", "distinct") == 1
    metrics = utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"zip": "patients.zip"})
    assert metrics["discernibility"] == 48  # 3 ECs of 4: 3 * 4²
    assert metrics["equivalence_classes"] == 3
    assert metrics["suppressed_rows"] == 0
    assert metrics["avg_ec_size"] == 4 and metrics["c_avg"] == 1
    assert metrics["prosecutor_max_risk"] == pytest.approx(0.25)
    assert metrics["records_above_risk_threshold"] == 1  # every record: 1/4 > 0.1
    assert metrics["ec_per_record"] == pytest.approx(3 / 12)


def test_table_1_2_information_loss_by_hand(patients: psycopg.Connection) -> None:
    metrics = utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"zip": "patients.zip"})
    # age spans 21..55 (34): ranges 20-29, 40-59, 30-39 clipped to it are 8, 15, 9 wide, 4 rows each.
    age = Fraction(8 + 15 + 9, 3 * 34)
    gender = Fraction(1)  # Any covers both of 2 values
    # 10 distinct ZIP codes: 130** covers 2, 14*** 4, 1322* 4 -> (1 + 3 + 3) / 9 per EC.
    zip_code = Fraction(1 + 3 + 3, 3 * 9)
    # 6 nationalities: Any covers 6 -> 1, Asian 4 -> 3/5, American is an original value -> 0.
    nationality = (1 + Fraction(3, 5) + 0) / 3
    assert metrics["ncp_per_qi"] == pytest.approx(
        {"age": float(age), "gender": float(gender), "zip": float(zip_code), "nationality": float(nationality)})
    assert metrics["ncp"] == pytest.approx(float((age + gender + zip_code + nationality) / 4))
    assert metrics["kl_divergence"] == pytest.approx(kl_oracle(TABLE_1_1, TABLE_1_2), rel=1e-9)


def kl_oracle(source: list[Row], target: list[Row]) -> float:
    """KL(source || reconstruction spreading each EC uniformly over the domain points its cells cover).

    Brute force over the product of the source columns' distinct values; reads
    the cells of Tables 1.2/1.3 directly (ranges, masks, the trees above).
    """
    width = len(PATIENT_QI)
    domains = [sorted({row[i] for row in source}) for i in range(width)]
    trees = [{}, {leaf: set(path) for leaf, *path in GENDER_TREE},
             {leaf: set(path) for leaf, *path in ZIP_TREE}, {leaf: set(path) for leaf, *path in NATIONALITY_TREE}]

    def covers(i: int, cell: str, value: Any) -> bool:
        if i == 0:
            low, high = (int(part) for part in cell.split("-"))
            return low <= value <= high
        return cell == value or cell in trees[i][value]

    n = len(source)
    classes = Counter(row[:width] for row in target)
    volume = {cells: math.prod(sum(covers(i, cells[i], v) for v in domains[i]) for i in range(width))
              for cells in classes}
    observed = Counter(row[:width] for row in source)
    total = 0.0
    for point in product(*domains):
        p = observed[point] / n
        if p:
            q = sum(size / (n * volume[cells]) for cells, size in classes.items()
                    if all(covers(i, cells[i], point[i]) for i in range(width)))
            total += p * math.log(p / q)
    return total


def test_table_1_3_entropy_and_recursive_diversity(patients: psycopg.Connection) -> None:
    assert k_of(patients, "table_1_3", PATIENT_QI) == 4
    assert l_of(patients, "table_1_3", PATIENT_QI, "condition", "distinct") == 2
    # Condition counts per EC (1,1,1,1), (2,1,1), (3,1): the least entropy is the (3,1) class,
    # -(3/4 ln 3/4 + 1/4 ln 1/4) = 0.5623 nats, so entropy l = e^0.5623 = 1.755.
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropy == pytest.approx(0.5623, abs=1e-4)
    assert float(l_of(patients, "table_1_3", PATIENT_QI, "condition", "entropy")) == pytest.approx(
        math.exp(entropy), abs=1e-9)
    # Recursive (c,3): the (3,1) class has no third value, so no c makes it (c,3)-diverse.
    assert l_of(patients, "table_1_3", PATIENT_QI, "condition", "recursive", 3) == Decimal("Infinity")
    # Without it, (2,1,1) needs 2 < c * 1: the table is (c,3)-diverse exactly for c > 2, so not (2,3)-diverse.
    patients.execute("delete from table_1_3 where age = '20-39'")
    assert l_of(patients, "table_1_3", PATIENT_QI, "condition", "recursive", 3) == 2
    # ... and (c,2)-diverse for c > max(1/3, 2/2) = 1.
    assert l_of(patients, "table_1_3", PATIENT_QI, "condition", "recursive", 2) == 1


def test_table_1_3_kl_matches_the_oracle(patients: psycopg.Connection) -> None:
    metrics = utility(patients, "table_1_1", "table_1_3", PATIENT_QI, hierarchies={"zip": "patients.zip"})
    assert metrics["discernibility"] == 48
    assert metrics["kl_divergence"] == pytest.approx(kl_oracle(TABLE_1_1, TABLE_1_3), rel=1e-9)


# --- Chen et al. 2009, Table 4.4: multidimensional recoding of Table 4.2 -------------------------------------------

# Nationality is generalized to the continent (the survey's Table 4.3(b)); ages as printed in Table 4.4(a).
TABLE_4_4: list[Row] = [
    ("European", "20-22", "HIV"), ("European", "20-22", "Flu"), ("European", "23-24", "Flu"),
    ("European", "20-22", "Cancer"), ("European", "23-24", "Hepatitis"), ("European", "25", "Cancer"),
    ("European", "25", "HIV"), ("Asian", "20-22", "Bronchitis"), ("Asian", "23-25", "Hepatitis"),
    ("Asian", "23-25", "Flu"), ("Asian", "20-22", "Hepatitis"), ("Asian", "20-22", "Flu"),
]


def test_table_4_4_is_2_anonymous_and_entropy_2_diverse(db: psycopg.Connection) -> None:
    make_table(db, "table_4_4", {"nationality": "text", "age": "text", "disease": "text"}, TABLE_4_4)
    qi = ["nationality", "age"]
    assert k_of(db, "table_4_4", qi) == 2
    # Every EC has distinct diseases only; the two-row ECs have entropy ln 2 exactly.
    assert l_of(db, "table_4_4", qi, "disease", "entropy") == 2
    assert l_of(db, "table_4_4", qi, "disease", "distinct") == 2


# --- Domingo-Ferrer et al. 2016, Table 5.2: 4-anonymous generalization of Table 5.1 -------------------------------------------

TABLE_5_2: list[Row] = (
    [("[20-30]", "230**", c) for c in ("Heart Disease", "Heart Disease", "Viral Infection", "Viral Infection")]
    + [("[40-50]", "230**", c) for c in ("Kidney Stone", "Heart Disease", "Viral Infection", "Viral Infection")]
    + [("[30-40]", "230**", c) for c in ("Kidney Stone", "Kidney Stone", "AIDS", "AIDS")]
)


def test_table_5_2_emd_and_distinct_diversity(db: psycopg.Connection) -> None:
    make_table(db, "table_5_2", {"age": "text", "zip": "text", "condition": "text"}, TABLE_5_2)
    qi = ["age", "zip"]
    assert k_of(db, "table_5_2", qi) == 4
    assert l_of(db, "table_5_2", qi, "condition", "distinct") == 2  # 2, 3, 2
    # Whole table: HD 3, VI 4, KS 3, AIDS 2 of 12. Equal-distance EMD of the ECs:
    # ½(|½-¼| + |½-⅓| + ¼ + ⅙) = 5/12, ½(0 + ⅙ + 0 + ⅙) = 1/6, ½(¼ + ⅓ + ¼ + ⅓) = 7/12.
    assert t_of(db, "table_5_2", qi, "condition", "equal") == pytest.approx(Decimal(7) / 12, abs=Decimal("1e-18"))
    # Without EC 3 the other two are the farthest, each 1/8 from the rest:
    db.execute("delete from table_5_2 where age = '[30-40]'")
    # Now HD 3, VI 4, KS 1 of 8: EC 1 ½(|½-⅜| + |½-½| + ⅛) = 1/8, EC 2 ½(|¼-⅜| + 0 + |¼-⅛|) = 1/8.
    assert t_of(db, "table_5_2", qi, "condition", "equal") == Decimal(1) / 8


def test_table_5_2_ordered_emd_by_hand(db: psycopg.Connection) -> None:
    make_table(db, "table_5_2", {"age": "text", "zip": "text", "condition": "text"}, TABLE_5_2)
    # Text order AIDS < Heart Disease < Kidney Stone < Viral Infection, q = (2, 3, 3, 4)/12.
    # EC 3: p - q = (⅓, -¼, ¼, -⅓), running sums ⅓, 1/12, ⅓, 0: (3/4) / (m - 1 = 3) = 1/4;
    # EC 1: 5/36, EC 2: 1/6.
    assert t_of(db, "table_5_2", ["age", "zip"], "condition", "ordered") == Decimal(1) / 4


# --- De Capitani di Vimercati et al., Fig. 3: 4-anonymous, distinct 3-diverse, not entropy 3-diverse -----------------------------

FIGURE_3: list[Row] = (
    [("1970/**/**", "M", "9415*", d) for d in ("High Cholesterol", "Angina Pectoris", "Hepatitis", "Pneumonia")]
    + [("1970/**/**", "F", "9414*", d) for d in ("Cardiomyopathy", "Eczema", "High Cholesterol", "Erythema")]
    + [("1960/**/**", "F", "9415*", d) for d in ("Stroke", "Stroke", "Angina Pectoris", "Cardiomyopathy")]
    + [("1960/**/**", "M", "9414*", d) for d in ("Stroke", "Stroke", "Hepatitis", "Flu")]
)


def test_figure_3_is_distinct_but_not_entropy_3_diverse(db: psycopg.Connection) -> None:
    make_table(db, "figure_3", {"dob": "text", "sex": "text", "zip": "text", "disease": "text"}, FIGURE_3)
    qi = ["dob", "sex", "zip"]
    assert k_of(db, "figure_3", qi) == 4
    assert l_of(db, "figure_3", qi, "disease", "distinct") == 3
    # The (2,1,1) classes: entropy ln 4 - ½ ln 2 = 1.5 ln 2, so entropy l = 2^1.5 = 2.828 < 3.
    entropy_l = l_of(db, "figure_3", qi, "disease", "entropy")
    assert float(entropy_l) == pytest.approx(2 ** 1.5, abs=1e-9)
    assert entropy_l < 3


# --- hierarchical EMD, worked by hand -------------------------------------------------------------------------------

def test_hierarchical_emd_by_hand(db: psycopg.Connection) -> None:
    # Tree of height 2: a1, a2 under A; b1 under B; both under *.
    load_hierarchy(db, "test.tree", [["a1", "A", "*"], ["a2", "A", "*"], ["b1", "B", "*"]])
    make_table(db, "tree_table", {"g": "text", "s": "text"},
               [("x", "a1"), ("x", "a1"), ("y", "a2"), ("y", "b1"), ("y", "b1"), ("y", "b1")])
    # Whole table q = (a1 2/6, a2 1/6, b1 3/6). EC x: p = (1, 0, 0): moving 1/6 a1->a2 costs ½ (same
    # parent), 1/2 a1->b1 costs 1: 1/12 + 1/2 = 7/12. EC y: p = (0, ¼, ¾): 1/12 * ½ + ¼ * 1 = 7/24.
    assert t_of(db, "tree_table", ["g"], "s", "hierarchical", "test.tree") == pytest.approx(
        Decimal(7) / 12, abs=Decimal("1e-18"))
    # Equal distance for comparison: EC x ½(⅔ + ⅙ + ½) = 2/3.
    assert t_of(db, "tree_table", ["g"], "s", "equal") == pytest.approx(Decimal(2) / 3, abs=Decimal("1e-18"))


def test_hierarchical_emd_needs_every_value_in_the_tree(db: psycopg.Connection) -> None:
    load_hierarchy(db, "test.tree", [["a1", "A", "*"], ["b1", "B", "*"]])
    make_table(db, "tree_table", {"g": "text", "s": "text"}, [("x", "a1"), ("x", "c9")])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="'c9' of column s is not a leaf"):
        t_of(db, "tree_table", ["g"], "s", "hierarchical", "test.tree")
    with pytest.raises(psycopg.errors.UndefinedObject, match="hierarchy 'tree_table.s' does not exist"):
        t_of(db, "tree_table", ["g"], "s", "hierarchical")


# --- privacy units, microaggregation, suppression --------------------------------------------------------------------

def test_k_counts_distinct_units_when_asked(db: psycopg.Connection) -> None:
    make_table(db, "stays", {"person": "text", "age": "text"},
               [("ann", "20-29"), ("ann", "20-29"), ("bob", "20-29"), ("cy", "30-39"), ("dan", "30-39")])
    assert k_of(db, "stays", ["age"]) == 2
    assert scalar(db, "select anonproxy.k_anonymity('stays', array['age'], unit => 'person')") == 2
    db.execute("insert into stays values ('ann', '20-29')")
    assert k_of(db, "stays", ["age"]) == 2  # rows: 4 and 2
    db.execute("delete from stays where person = 'bob'")
    assert scalar(db, "select anonproxy.k_anonymity('stays', array['age'], unit => 'person')") == 1


def test_k_counts_rows_for_a_unique_unit_and_distinct_units_once_it_is_not(db: psycopg.Connection) -> None:
    """sql/0023: a primary-key unit makes each row one unit, so k counts rows (no sort per class); a unit whose key
    was dropped, or that gained a child table, is counted as distinct units again, whatever was true before."""
    make_table(db, "people", {"person": "text", "age": "text"},
               [("ann", "20-29"), ("bob", "20-29"), ("cy", "30-39"), ("dan", "30-39"), ("eve", "30-39")])
    k = "select anonproxy.k_anonymity('people', array['age'], unit => 'person')"
    plan = "select anonproxy._unit_is_unique('people', 'person')"
    assert not scalar(db, plan) and scalar(db, k) == 2  # no key yet: distinct units
    db.execute("alter table people add primary key (person)")
    assert scalar(db, plan) and scalar(db, k) == 2
    db.execute("alter table people drop constraint people_pkey")
    db.execute("insert into people values ('ann', '20-29'), ('ann', '20-29')")
    assert not scalar(db, plan) and scalar(db, k) == 2  # ann counted once, not three times
    db.execute("delete from people where person = 'ann' and ctid <> (select min(ctid) from people where person = 'ann')")
    db.execute("alter table people add primary key (person)")
    db.execute("create table people_child () inherits (people)")
    db.execute("insert into people_child values ('ann', '20-29'), ('ann', '20-29')")
    assert not scalar(db, plan) and scalar(db, k) == 2  # the child's rows are read, and not covered by the key


def test_microaggregated_column_reports_sse_over_sst(db: psycopg.Connection) -> None:
    make_table(db, "measures", {"x": "integer", "sex": "text"},
               [(1, "F"), (2, "F"), (3, "F"), (10, "M"), (11, "M"), (12, "M")])
    make_table(db, "centroids", {"x": "numeric", "sex": "text"}, [(2, "F")] * 3 + [(11, "M")] * 3)
    metrics = utility(db, "measures", "centroids", ["x", "sex"])
    # mean 6.5, SST = 2 * (5.5² + 4.5² + 3.5²) = 125.5; SSE = 2 * (1 + 0 + 1) = 4.
    assert metrics["sse_sst_per_qi"] == {"x": pytest.approx(4 / 125.5, abs=1e-12)}
    assert metrics["ncp_per_qi"] == {"x": 0, "sex": 0}
    assert metrics["kl_divergence"] is None  # a centroid is not a cell of the source domain


def test_suppressed_rows_count_in_discernibility_and_as_fully_generalized(db: psycopg.Connection) -> None:
    make_table(db, "people", {"age": "integer", "sex": "text"},
               [(20, "F"), (21, "F"), (22, "M"), (23, "M"), (40, "F")])
    make_table(db, "released", {"age": "text", "sex": "text"},
               [("20-21", "F"), ("20-21", "F"), ("22-23", "M"), ("22-23", "M")])
    metrics = utility(db, "people", "released", ["age", "sex"], k=2, risk_threshold=0.4)
    assert metrics["suppressed_rows"] == 1
    assert metrics["discernibility"] == 2 * 2 + 2 * 2 + 5 * 1
    # age spans 20..40: widths 1, 1 of 20 on 4 rows, 1 suppressed row -> (4/20 + 1) / 5.
    assert metrics["ncp_per_qi"]["age"] == pytest.approx((4 / 20 + 1) / 5)
    assert metrics["ncp_per_qi"]["sex"] == pytest.approx(1 / 5)
    assert metrics["c_avg"] == 1
    assert metrics["records_above_risk_threshold"] == 1  # 1/2 > 0.4
    # Reconstruction: classes of 2, 2 and the suppressed row spread over 5 ages x 2 sexes.
    # Source points are all distinct: P = 1/5 each. A released row's class covers 2 ages x 1 sex:
    # P* >= (2/5) / 2 = 1/5 (+ 1/50 from the suppressed class, which the measure leaves out);
    # the suppressed row: (1/5) / 10. KL = 4/5 ln 1 + 1/5 ln 10.
    assert metrics["kl_divergence"] == pytest.approx(math.log(10) / 5, rel=1e-12)
    # On age alone the classes are the same; KL: 4/5 ln(1/5 / (2/5 / 2)) + 1/5 ln(1/5 / (1/5 / 5)) = ln(5) / 5.
    alone = utility(db, "people", "released", ["age"])
    assert alone["discernibility"] == 13 and alone["ncp_per_qi"] == {"age": metrics["ncp_per_qi"]["age"]}
    assert alone["kl_divergence"] == pytest.approx(math.log(5) / 5, rel=1e-12)


# --- arguments -------------------------------------------------------------------------------------------------------

def test_bad_arguments_fail_with_named_errors(db: psycopg.Connection) -> None:
    make_table(db, "table_5_2", {"age": "text", "zip": "text", "condition": "text"}, TABLE_5_2)
    with pytest.raises(psycopg.errors.UndefinedColumn, match="column agee of the quasi-identifiers"):
        k_of(db, "table_5_2", ["agee"])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="non-empty list"):
        k_of(db, "table_5_2", [])
    with pytest.raises(psycopg.errors.DuplicateColumn, match="named twice"):
        k_of(db, "table_5_2", ["age", "age"])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="both a quasi-identifier and the sensitive"):
        l_of(db, "table_5_2", ["age", "zip"], "zip", "distinct")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="unknown l-diversity kind 'entropic'"):
        l_of(db, "table_5_2", ["age"], "condition", "entropic")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="needs l >= 2"):
        l_of(db, "table_5_2", ["age"], "condition", "recursive")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="not an argument of entropy"):
        l_of(db, "table_5_2", ["age"], "condition", "entropy", 3)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="unknown t-closeness distance 'manhattan'"):
        t_of(db, "table_5_2", ["age"], "condition", "manhattan")
    with pytest.raises(psycopg.errors.UndefinedTable):
        k_of(db, "no_such_table", ["age"])


def test_utility_refuses_cells_it_cannot_read(patients: psycopg.Connection) -> None:
    # Without the ZIP hierarchy, '130**' is no form of the contract.
    with pytest.raises(psycopg.errors.InvalidTextRepresentation,
                       match="cannot read the value '1.*' of column zip of public.table_1_2"):
        utility(patients, "table_1_1", "table_1_2", PATIENT_QI)
    with pytest.raises(psycopg.errors.UndefinedObject, match="hierarchy 'nope' named for column zip"):
        utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"zip": "nope"})
    # A JSON null is no hierarchy, not the default one.
    with pytest.raises(psycopg.errors.InvalidTextRepresentation, match="cannot read the value 'Any' of column gender"):
        utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"zip": "patients.zip", "gender": None})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="hierarchies must be a JSON object"):
        utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"condition": "patients.zip"})
    patients.execute("insert into table_1_2 select * from table_1_2")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="more than its source"):
        utility(patients, "table_1_1", "table_1_2", PATIENT_QI, hierarchies={"zip": "patients.zip"})


def test_names_are_quoted(db: psycopg.Connection) -> None:
    odd = 'a"; drop table victim; --'
    db.execute("create table victim ()")
    make_table(db, "Odd Table", {odd: "text", "s": "text"}, [("x", "1"), ("x", "2"), ("y", "1"), ("y", "1")])
    assert k_of(db, '"Odd Table"', [odd]) == 2
    assert l_of(db, '"Odd Table"', [odd], "s", "distinct") == 1
    assert t_of(db, '"Odd Table"', [odd], "s", "equal") == Decimal(1) / 4
    assert scalar(db, "select to_regclass('victim')") is not None


# --- cross-check against pycanon on adult ---------------------------------------------------------------------------

# Generalizations of adult built by plain SQL; each keeps income (text) and hours_per_week (numeric) as
# candidate sensitive columns.
ADULT_GENERALIZATIONS = {
    "decades": "select (age / 10 * 10) || '-' || (age / 10 * 10 + 9) as age, '*' as workclass, sex, race, "
               "income, hours_per_week from adult",
    "coarse": "select case when age < 40 then '17-39' else '40-90' end as age, marital_status as workclass, sex, "
              "'*' as race, income, hours_per_week from adult",
    "fine": "select age::text, workclass, sex, race, income, hours_per_week from adult where age between 30 and 34",
}


@pytest.mark.parametrize("name", sorted(ADULT_GENERALIZATIONS))
def test_levels_agree_with_pycanon_on_adult(db: psycopg.Connection, name: str) -> None:
    db.execute(f"create table release as {ADULT_GENERALIZATIONS[name]}")
    qi = ["age", "workclass", "sex", "race"]
    frame = pd.DataFrame(db.execute("select * from release").fetchall(),
                         columns=["age", "workclass", "sex", "race", "income", "hours_per_week"])
    assert k_of(db, "release", qi) == anonymity.k_anonymity(frame, qi)
    assert l_of(db, "release", qi, "income", "distinct") == anonymity.l_diversity(frame, qi, ["income"])
    for sensitive in ("income", "hours_per_week"):
        # pycanon reports entropy l rounded down to an integer.
        assert int(l_of(db, "release", qi, sensitive, "entropy")) == anonymity.entropy_l_diversity(
            frame, qi, [sensitive])
    # pycanon: equal-distance EMD for a text column, ordered EMD for a numeric one.
    assert float(t_of(db, "release", qi, "income", "equal")) == pytest.approx(
        anonymity.t_closeness(frame, qi, ["income"]), abs=1e-12)
    assert float(t_of(db, "release", qi, "hours_per_week", "ordered")) == pytest.approx(
        anonymity.t_closeness(frame, qi, ["hours_per_week"]), abs=1e-12)


# --- anonproxy verify -----------------------------------------------------------------------------------------------

ADULT_QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]


def run_verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_recomputes_a_release_and_flags_a_damaged_one(
        db: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.conninfo(dbname=db.info.dbname)
    db.execute("create table adult_part as select * from adult where id <= 3000")
    db.execute("select anonproxy.create_anonymized_view(source => 'public.adult_part', target => 'public.part_k5', "
               "quasi_identifiers => %s, sensitive => 'occupation', k => 5, l => 2, l_kind => 'distinct', "
               "hierarchies => '{\"age\": \"adult.age\"}')", (ADULT_QI,))
    code, out, err = run_verify(capsys, "public.part_k5", "--dsn", dsn, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["method"] == "mondrian" and report["quasi_identifiers"] == ADULT_QI
    assert report["now"]["k"] == report["registry"]["k"] >= 5
    assert report["now"]["l_distinct"] >= 2
    # Discernibility and the class count, from the release's rows in Python.
    sizes = Counter(db.execute(sql.SQL("select {} from part_k5").format(
        sql.SQL(", ").join(map(sql.Identifier, ADULT_QI)))).fetchall())
    assert report["metrics"]["discernibility"] == sum(n * n for n in sizes.values())
    assert report["metrics"]["equivalence_classes"] == len(sizes)
    assert report["shortfalls"] == []

    code, out, _ = run_verify(capsys, "part_k5", "--dsn", dsn)
    assert code == 0
    assert "release public.part_k5" in out and "meets its parameters" in out
    assert re.search(rf"^  equivalence classes +{len(sizes)}$", out, re.MULTILINE), out

    # Damage it: keep one row of the smallest class.
    smallest = min(sizes, key=sizes.__getitem__)
    db.execute(sql.SQL("delete from part_k5 where ({cols}) = ({values}) and ctid <> "
                       "(select min(ctid) from part_k5 where ({cols}) = ({values}))").format(
        cols=sql.SQL(", ").join(map(sql.Identifier, ADULT_QI)), values=sql.SQL(", ").join(map(sql.Literal, smallest))))
    code, out, _ = run_verify(capsys, "part_k5", "--dsn", dsn)
    assert code == 3
    assert "DOES NOT MEET its parameters now: k = 1 < 5" in out


def test_verify_does_not_judge_a_release_made_per_unit(
        db: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    """Its levels count privacy units; the table has none, so verify shows row levels and passes no verdict."""
    dsn = pg_server.conninfo(dbname=db.info.dbname)
    db.execute("create table stays as select id % 700 as person, age, sex, occupation from adult where id <= 2100")
    db.execute("select anonproxy.create_anonymized_view(source => 'public.stays', target => 'public.visits_k5', "
               "quasi_identifiers => array['age', 'sex'], sensitive => 'occupation', k => 5, l => 3, "
               "unit => 'person')")
    db.commit()
    code, out, err = run_verify(capsys, "visits_k5", "--dsn", dsn)
    assert (code, err) == (0, "")
    assert ("not judged: the release counts privacy units (person), but its table has no unit column: the levels "
            "above count rows and cannot be rechecked per unit on the target") in out
    assert "meets" not in out and "DOES NOT MEET" not in out
    code, out, _ = run_verify(capsys, "visits_k5", "--dsn", dsn, "--json")
    assert code == 0 and json.loads(out)["shortfalls"] == []


def test_verify_an_emptied_release(
        db: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.conninfo(dbname=db.info.dbname)
    db.execute("select anonproxy.create_anonymized_view(source => 'public.adult', target => 'public.adult_k5', "
               "quasi_identifiers => array['age', 'sex'], sensitive => 'occupation', k => 5, l => 2)")
    db.execute("delete from adult_k5")
    db.commit()
    code, out, err = run_verify(capsys, "adult_k5", "--dsn", dsn)
    assert (code, err) == (0, "")
    assert "not judged: the table has no rows, so it has no levels to check" in out


def test_verify_a_release_with_a_money_column(
        db: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    """money is of the numeric category but its text is '$1.00': it is a category, not a number."""
    dsn = pg_server.conninfo(dbname=db.info.dbname)
    db.execute("create table paid as select (age % 4)::money as wage, sex, occupation from adult where id <= 1000")
    db.execute("select anonproxy.create_anonymized_view(source => 'public.paid', target => 'public.paid_k5', "
               "quasi_identifiers => array['wage', 'sex'], sensitive => 'occupation', k => 5)")
    db.commit()
    code, out, err = run_verify(capsys, "paid_k5", "--dsn", dsn)
    assert (code, err) == (0, "")
    assert "meets its parameters" in out
    assert scalar(db, "select anonproxy.release_column_kind('money'::regtype)") == "categorical"
    assert scalar(db, "select anonproxy.release_column_kind('real'::regtype)") == "numeric"
    assert scalar(db, "select anonproxy.release_column_kind('regclass'::regtype)") == "categorical"


def test_verify_an_unregistered_table(
        db: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.conninfo(dbname=db.info.dbname)
    make_table(db, "table_5_2", {"age": "text", "zip": "text", "condition": "text"}, TABLE_5_2)
    code, out, _ = run_verify(capsys, "table_5_2", "--dsn", dsn, "--qi", "age,zip", "--sensitive", "condition")
    assert code == 0
    assert "table table_5_2 (not a registered release)" in out
    assert re.search(r"^  t \(equal EMD\) +- +0\.5833$", out, re.MULTILINE), out
    assert re.search(r"^  distinct ℓ +- +2$", out, re.MULTILINE), out

    code, _, err = run_verify(capsys, "table_5_2", "--dsn", dsn)
    assert code == 1
    assert "table_5_2 is not a registered release: name its quasi-identifiers with --qi" in err
    code, _, err = run_verify(capsys, "table_5_2", "--dsn", dsn, "--qi", "age,nope")
    assert code == 1
    assert "column nope of the quasi-identifiers does not exist in public.table_5_2 (SQLSTATE 42703)" in err


# --- the acceptance check: releases of adult as pycanon sees them --------------------------------------------

@pytest.mark.parametrize("asked", [{}, {"l": 3, "l_kind": "entropy"}, {"t": Decimal("0.2"), "t_distance": "equal"}],
                         ids=["k", "entropy-l", "t"])
def test_adult_release_meets_its_parameters_according_to_pycanon(db: psycopg.Connection, asked: dict[str, Any]) -> None:
    arguments = {"qi": ADULT_QI, "k": 10, **asked}
    db.execute("select anonproxy.create_anonymized_view(source => 'public.adult', target => 'public.adult_release', "
               "quasi_identifiers => %(qi)s, sensitive => 'occupation', k => %(k)s"
               + "".join(f", {name} => %({name})s" for name in asked) + ")", arguments)
    frame = pd.DataFrame(db.execute(sql.SQL("select {}, occupation from adult_release").format(
        sql.SQL(", ").join(map(sql.Identifier, ADULT_QI)))).fetchall(), columns=[*ADULT_QI, "occupation"])
    assert len(frame) > 0.9 * sample_data.ADULT_ROW_COUNT
    assert anonymity.k_anonymity(frame, ADULT_QI) >= 10
    if "l" in asked:
        # Exactly, in integers: entropy >= ln 3  <=>  N^N >= 3^N * prod(n_i^n_i) for the counts n_i of an EC of N rows.
        classes = Counter(map(tuple, frame[ADULT_QI].itertuples(index=False)))
        counts: dict[tuple[Any, ...], Counter[str]] = {ec: Counter() for ec in classes}
        for *ec, value in frame.itertuples(index=False):
            counts[tuple(ec)][value] += 1
        margins = [size ** size - 3 ** size * math.prod(n ** n for n in counts[ec].values())
                   for ec, size in classes.items()]
        assert min(margins) >= 0
        # pycanon floors a floating-point exp(entropy): a class exactly at ln 3 (e.g. counts 8,1,1,1,1)
        # comes out as 2.999…, reported as 2. Anything else it must report as at least 3.
        assert anonymity.entropy_l_diversity(frame, ADULT_QI, ["occupation"]) >= (2 if 0 in margins else 3)
    if "t" in asked:
        assert anonymity.t_closeness(frame, ADULT_QI, ["occupation"]) <= 0.2


def test_verify_with_a_source_and_hierarchies(
        patients: psycopg.Connection, pg_server: EmbeddedPostgres, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.conninfo(dbname=patients.info.dbname)
    args = ["table_1_2", "--dsn", dsn, "--qi", ",".join(PATIENT_QI), "--sensitive", "condition",
            "--source", "table_1_1", "--json"]
    code, out, _ = run_verify(capsys, *args, "--hierarchy", "zip=patients.zip")
    assert code == 0
    report = json.loads(out)
    assert report["metrics"]["discernibility"] == 48
    # Equal-distance EMD: ECs 1 and 3 are 7/12 from the whole table (HD 3, VI 2, Cancer 5, Flu 2 of 12).
    assert report["now"] == {"k": 4, "l_distinct": 1, "l_entropy": 1, "t": pytest.approx(7 / 12), "t_distance": "equal"}
    # gender= : no hierarchy for gender, so its cell 'Any' cannot be read.
    code, _, err = run_verify(capsys, *args, "--hierarchy", "zip=patients.zip", "--hierarchy", "gender=")
    assert code == 1
    assert "cannot read the value 'Any' of column gender" in err
