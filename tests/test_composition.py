"""The composition audit (sql/0010_composition.sql): Ganta et al.'s (2008) intersection attack and the release guard.

Expected values are derived by hand from the tables typed in below (Ganta et al. 2008
Table 1, and a small clinic with a microaggregated release), or computed by an
independent oracle in this file that reads the generalized cells itself.
"""

from __future__ import annotations

import csv
import json
import random
import re
import subprocess
import sys
from decimal import Decimal
from typing import NamedTuple

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres


def register(conn: psycopg.Connection, source: str, target: str, method: str, qi: list[str], sensitive: str,
             parameters: str) -> int:
    """Record a release typed in by hand in the registry, as create_anonymized_view would."""
    row = conn.execute(
        """insert into anonproxy.releases (source, target, method, quasi_identifiers, sensitive, parameters,
                                           method_facts, achieved, metrics)
           values (%s, %s, %s, %s, %s, %s, '{}', '{}', '{}') returning id""",
        (source, target, method, qi, sensitive, parameters)).fetchone()
    assert row is not None
    return row[0]


def load_table(conn: psycopg.Connection, ddl: str, name: str, rows: list[tuple]) -> None:
    conn.execute(ddl)
    with conn.cursor() as cur:
        cur.executemany(f"insert into {name} values ({', '.join(['%s'] * len(rows[0]))})", rows)


# --- Ganta et al. 2008 Table 1: two hospitals ---------------------------------------------------------------

# Patients of each hospital (id, zip, age, nationality, condition), consistent with Table 1's
# generalization. Alice (id 1, 28, 13012) is H1's row 1 and H2's row 1; Bob (id 7, 45) is H1's
# row 7 and H2's row 11; Carol (id 9, 36) is H1's row 9 and H2's row 7. Nobody else is in both.
H1_PATIENTS = [
    (1, "13012", 28, "American", "AIDS"), (2, "13021", 22, "Japanese", "Heart Disease"),
    (3, "13033", 25, "Indian", "Viral Infection"), (4, "13044", 29, "American", "Viral Infection"),
    (5, "13051", 45, "Russian", "Cancer"), (6, "13062", 50, "American", "Heart Disease"),
    (7, "13068", 45, "Indian", "Viral Infection"), (8, "13071", 61, "Japanese", "Viral Infection"),
    (9, "13053", 36, "American", "Cancer"), (10, "13014", 31, "Indian", "Cancer"),
    (11, "13027", 38, "Russian", "Cancer"), (12, "13018", 33, "American", "Cancer"),
]
H2_PATIENTS = [
    (1, "13012", 28, "American", "AIDS"), (201, "13025", 19, "Indian", "Tuberculosis"),
    (202, "13031", 31, "Japanese", "Flu"), (203, "13047", 24, "American", "Tuberculosis"),
    (204, "13015", 33, "Russian", "Cancer"), (205, "13019", 27, "Indian", "Cancer"),
    (9, "13053", 36, "American", "Cancer"), (206, "13066", 52, "Japanese", "Cancer"),
    (207, "13072", 41, "Indian", "Cancer"), (208, "13034", 39, "Russian", "Tuberculosis"),
    (7, "13068", 45, "Indian", "Viral Infection"), (209, "13010", 58, "American", "Viral Infection"),
]
# Table 1 (a) and (b) as printed: (zip, age, nationality, condition).
TABLE_1A = [("130**", "<30", "*", c) for c in ("AIDS", "Heart Disease", "Viral Infection", "Viral Infection")] + \
    [("130**", "≥40", "*", c) for c in ("Cancer", "Heart Disease", "Viral Infection", "Viral Infection")] + \
    [("130**", "3*", "*", "Cancer")] * 4
TABLE_1B = [("130**", "<35", "*", c) for c in ("AIDS", "Tuberculosis", "Flu", "Tuberculosis", "Cancer", "Cancer")] + \
    [("130**", "≥35", "*", c) for c in ("Cancer", "Cancer", "Cancer", "Tuberculosis", "Viral Infection",
                                        "Viral Infection")]


@pytest.fixture
def hospitals(postgresql: psycopg.Connection) -> psycopg.Connection:
    conn = postgresql
    for name, rows in (("h1_patients", H1_PATIENTS), ("h2_patients", H2_PATIENTS)):
        load_table(conn, f"create table {name} (id integer primary key, zip text, age integer, nationality text, "
                         "condition text)", name, rows)
    for name, rows in (("h1_release", TABLE_1A), ("h2_release", TABLE_1B)):
        load_table(conn, f"create table {name} (zip text, age text, nationality text, condition text)", name, rows)
    # The age bands and ZIP masking of Table 1 as hierarchies: their nodes are the printed cells.
    conn.execute("""select anonproxy.load_hierarchy('hospital1.age', (select array_agg(array[a::text,
                        case when a < 30 then '<30' when a < 40 then '3*' else '≥40' end, '*'])
                        from generate_series(0, 99) a))""")
    conn.execute("""select anonproxy.load_hierarchy('hospital2.age', (select array_agg(array[a::text,
                        case when a < 35 then '<35' else '≥35' end, '*']) from generate_series(0, 99) a))""")
    conn.execute("""select anonproxy.load_hierarchy('hospital.zip', (select array_agg(array[zip, '130**', '*'])
                        from (select zip from h1_patients union select zip from h2_patients) s))""")
    qi = ["zip", "age", "nationality"]
    register(conn, "public.h1_patients", "public.h1_release", "full_domain", qi, "condition",
             '{"k": 4, "hierarchies": {"age": "hospital1.age", "zip": "hospital.zip"}}')
    register(conn, "public.h2_patients", "public.h2_release", "full_domain", qi, "condition",
             '{"k": 6, "hierarchies": {"age": "hospital2.age", "zip": "hospital.zip"}}')
    conn.commit()
    return conn


def test_two_hospitals_alice_is_narrowed_to_aids(hospitals: psycopg.Connection) -> None:
    rows = hospitals.execute(
        "select * from anonproxy.composition_persons(array['h1_release', 'h2_release']::regclass[])").fetchall()
    # (person, EA per release, partition sizes, posterior EA, drop, confidence, values left)
    assert rows == [
        ("1", [3, 4], [4, 6], 1, 2, Decimal("1.0000"), ["AIDS"]),  # Alice: the paper's perfect breach
        ("7", [3, 3], [4, 6], 2, 1, Decimal("0.5000"), ["Cancer", "Viral Infection"]),  # Bob: ≥40 ∩ ≥35
        ("9", [1, 3], [4, 6], 1, 0, Decimal("1.0000"), ["Cancer"]),  # Carol: H1's 3* class was all Cancer
    ]


def test_two_hospitals_summary(hospitals: psycopg.Connection) -> None:
    risk = hospitals.execute(
        "select anonproxy.composition_risk(array['h1_release', 'h2_release']::regclass[])").fetchone()[0]
    assert (risk["overlap"], risk["located"]) == (3, 3)
    assert [(r["release"], r["k"], r["classes"], r["avg_partition_size"], r["avg_prior_ea"])
            for r in risk["releases"]] == [("public.h1_release", 4, 3, 4, 2.333), ("public.h2_release", 6, 2, 6, 3.333)]
    assert risk["avg_min_prior_ea"] == 2.333  # (3 + 3 + 1) / 3
    assert risk["avg_posterior_ea"] == 1.333  # (1 + 2 + 1) / 3
    assert risk["avg_drop"] == 1  # (2 + 1 + 0) / 3
    assert risk["vulnerable_pct"] == 66.67
    assert risk["posterior_ea_distribution"] == {"1": 2, "2": 1}
    assert risk["pvp"] == {"100": 66.67, "50": 100, "33": 100, "25": 100}


def audit(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "audit", "--dsn", dsn, *args], check=False,
                          capture_output=True, text=True, timeout=120)


def test_audit_command_on_named_releases(hospitals: psycopg.Connection, pg_server: EmbeddedPostgres,
                                        dbname: str) -> None:
    dsn = pg_server.conninfo(dbname=dbname)
    named = ("--release", "h1_release", "--release", "h2_release")
    done = audit(dsn, *named, "--json")
    assert done.returncode == 0, done.stderr
    [risk] = json.loads(done.stdout)
    assert risk["pvp"] == {"100": 66.67, "50": 100, "33": 100, "25": 100}
    text = audit(dsn, *named).stdout
    assert "overlap 3 persons, located in every release 3" in text
    assert "PVP: 100 % confidence 66.67 %, 50 % confidence 100.00 %" in text
    # Each release has its own source: grouping by source finds nothing to compose.
    alone = audit(dsn)
    assert alone.returncode == 0 and "nothing to compose" in alone.stdout


def test_bad_arguments(hospitals: psycopg.Connection) -> None:
    conn = hospitals
    cases = [
        ("array['h1_release']::regclass[]", "22023", "at least two releases"),
        ("array['h1_release', 'h1_release']::regclass[]", "22023", "distinct"),
        ("array['h1_release', 'h2_patients']::regclass[]", "42704", "h2_patients is not a registered release"),
    ]
    for releases, sqlstate, message in cases:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(f"select anonproxy.composition_risk({releases})")
        assert caught.value.sqlstate == sqlstate and message in str(caught.value)
        conn.rollback()
    conn.execute("update anonproxy.releases set sensitive = 'zip' where target = 'public.h2_release'")
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("select anonproxy.composition_risk(array['h1_release', 'h2_release']::regclass[])")
    assert caught.value.sqlstate == "22023" and "different sensitive attributes" in str(caught.value)


def test_a_dropped_hierarchy_cannot_be_read(hospitals: psycopg.Connection) -> None:
    hospitals.execute("select anonproxy.drop_hierarchy('hospital2.age')")
    with pytest.raises(psycopg.Error) as caught:
        hospitals.execute("select anonproxy.composition_risk(array['h1_release', 'h2_release']::regclass[])")
    assert caught.value.sqlstate == "55000"
    assert caught.value.diag.message_primary == ("hierarchy 'hospital2.age', which release public.h2_release used "
                                                 "for column age, no longer exists: its cells cannot be read")


# --- a hierarchy whose node labels look like ranges but are not (ARX's adult age hierarchy) ---------

def test_full_domain_cells_are_nodes_even_when_they_look_like_ranges(postgresql: psycopg.Connection) -> None:
    conn = postgresql
    load_table(conn, "create table people (id integer primary key, age integer, disease text)", "people",
               [(1, 25, "flu"), (2, 26, "cold"), (3, 30, "gout"), (4, 31, "acne")])
    # Labels shifted by one, as in ARX's age file: '25-29' stands for 26..30.
    conn.execute("""select anonproxy.load_hierarchy('shifted.age', (select array_agg(array[a::text,
                        case when a <= 25 then '20-24' when a <= 30 then '25-29' else '30-34' end, '*'])
                        from generate_series(21, 35) a))""")
    load_table(conn, "create table people_fd (age text, disease text)", "people_fd",
               [("20-24", "flu"), ("25-29", "cold"), ("25-29", "gout"), ("30-34", "acne")])
    load_table(conn, "create table people_m (age text, disease text)", "people_m",
               [("25-30", "flu"), ("25-30", "cold"), ("25-30", "gout"), ("31", "acne")])
    hierarchy = '{"k": 1, "hierarchies": {"age": "shifted.age"}}'
    register(conn, "public.people", "public.people_fd", "full_domain", ["age"], "disease", hierarchy)
    register(conn, "public.people", "public.people_m", "mondrian", ["age"], "disease", hierarchy)
    rows = conn.execute("""select person, prior_ea, posterior_ea, possible_values
                           from anonproxy.composition_persons(array['people_fd', 'people_m']::regclass[])""").fetchall()
    # full_domain's '25-29' is the node (26..30); Mondrian's '25-30' and '31' are a range and a number.
    assert rows == [("1", [1, 3], 1, ["flu"]), ("2", [2, 3], 2, ["cold", "gout"]),
                    ("3", [2, 3], 2, ["cold", "gout"]), ("4", [1, 1], 1, ["acne"])]


# --- a clinic released twice: microaggregated and generalized -----------------------------------

CLINIC = [(1, 20, "F", "flu"), (2, 22, "F", "cold"), (3, 24, "M", "asthma"),
          (4, 40, "M", "flu"), (5, 42, "F", "diabetes"), (6, 44, "M", "gout")]
# MDAV-style: classes {1,2,3} (age centroid 22, sex mode F) and {4,5,6} (42, M).
CLINIC_M = [(22, "F", "flu"), (22, "F", "cold"), (22, "F", "asthma"),
            (42, "M", "flu"), (42, "M", "diabetes"), (42, "M", "gout")]
# Generalized: {1,2,3,4} and {5,6}.
CLINIC_G = [("20-41", "*", "flu"), ("20-41", "*", "cold"), ("20-41", "*", "asthma"), ("20-41", "*", "flu"),
            ("42-44", "*", "diabetes"), ("42-44", "*", "gout")]


@pytest.fixture
def clinic(postgresql: psycopg.Connection) -> psycopg.Connection:
    conn = postgresql
    load_table(conn, "create table clinic (id integer primary key, age integer, sex text, diagnosis text)",
               "clinic", CLINIC)
    load_table(conn, "create table clinic_g (age text, sex text, diagnosis text)", "clinic_g", CLINIC_G)
    load_table(conn, "create table clinic_m (age numeric, sex text, diagnosis text)", "clinic_m", CLINIC_M)
    register(conn, "public.clinic", "public.clinic_g", "mondrian", ["age", "sex"], "diagnosis", '{"k": 2}')
    conn.commit()
    return conn


def register_clinic_m(conn: psycopg.Connection) -> int:
    return register(conn, "public.clinic", "public.clinic_m", "mdav", ["age", "sex"], "diagnosis", '{"k": 3}')


def test_nearest_centroid_and_ranges(clinic: psycopg.Connection) -> None:
    register_clinic_m(clinic)
    rows = clinic.execute("""select person, prior_ea, posterior_ea, anonymity_drop, possible_values
                             from anonproxy.composition_persons(array['clinic_m', 'clinic_g']::regclass[])""").fetchall()
    # Ages standardized by their spread (sd 10.13): person 3 (24, M) is nearer the (22, F) centroid
    # (0.04 + 1) than (42, M) (3.16); person 5 (42, F) nearer (42, M) (1) than (22, F) (3.9).
    assert rows == [
        ("1", [3, 3], 3, 0, ["asthma", "cold", "flu"]),
        ("2", [3, 3], 3, 0, ["asthma", "cold", "flu"]),
        ("3", [3, 3], 3, 0, ["asthma", "cold", "flu"]),
        ("4", [3, 3], 1, 2, ["flu"]),  # {flu, diabetes, gout} ∩ {flu, cold, asthma}
        ("5", [3, 2], 2, 0, ["diabetes", "gout"]),
        ("6", [3, 2], 2, 0, ["diabetes", "gout"]),
    ]


class Notice(NamedTuple):
    severity: str
    message: str
    hint: str | None


def notices(conn: psycopg.Connection) -> list[Notice]:
    """Collect the notices the server sends (a Diagnostic is only readable inside the handler)."""
    seen: list[Notice] = []
    conn.add_notice_handler(lambda d: seen.append(Notice(d.severity_nonlocalized, d.message_primary, d.message_hint)))
    return seen


def test_guard_warns_and_records_the_finding(clinic: psycopg.Connection) -> None:
    seen = notices(clinic)
    first = clinic.execute("select anonproxy.check_composition(id, false) from anonproxy.releases "
                           "where target = 'public.clinic_g'").fetchone()[0]
    assert first["exceeded"] is False and first["risk"] is None and not seen  # nothing to compose with yet
    release = register_clinic_m(clinic)
    finding = clinic.execute("select anonproxy.check_composition(%s, false)", (release,)).fetchone()[0]
    assert finding["exceeded"] is True and finding["forced"] is False
    assert finding["releases"] == ["public.clinic_m", "public.clinic_g"]
    assert finding["risk"]["pvp"] == {"100": 16.67, "50": 50, "33": 100, "25": 100}  # person 4 of 6 exactly
    warnings = [n for n in seen if n.severity == "WARNING"]
    assert len(warnings) == 1
    assert ("public.clinic_m combined with public.clinic_g reveals diagnosis exactly for 16.67 % of the 6 people "
            "located of the 6 they share (limit 0 %)") in warnings[0].message
    stored = clinic.execute("select composition, forced from anonproxy.releases where id = %s", (release,)).fetchone()
    assert stored == (finding, False)


def test_guard_threshold(clinic: psycopg.Connection) -> None:
    seen = notices(clinic)
    clinic.execute("update anonproxy.composition_settings set max_pvp_100 = 20, action = 'refuse'")
    finding = clinic.execute("select anonproxy.check_composition(%s, false)", (register_clinic_m(clinic),)).fetchone()[0]
    assert finding["exceeded"] is False and finding["max_pvp_100"] == 20 and not seen


def test_guard_refuses_unless_forced(clinic: psycopg.Connection) -> None:
    clinic.execute("update anonproxy.composition_settings set action = 'refuse'")
    release = register_clinic_m(clinic)
    clinic.commit()
    with pytest.raises(psycopg.Error) as caught:
        clinic.execute("select anonproxy.check_composition(%s, false)", (release,))
    assert caught.value.sqlstate == "APC01"
    assert "public.clinic_m combined with public.clinic_g" in caught.value.diag.message_primary
    assert "force => true" in caught.value.diag.message_hint
    clinic.rollback()
    seen = notices(clinic)
    finding = clinic.execute("select anonproxy.check_composition(%s, true)", (release,)).fetchone()[0]
    assert finding["exceeded"] is True and finding["forced"] is True
    assert clinic.execute("select forced from anonproxy.releases where id = %s", (release,)).fetchone() == (True,)
    assert [n.severity for n in seen] == ["WARNING"]
    assert "force => true is recorded" in seen[0].hint


def test_guard_off(clinic: psycopg.Connection) -> None:
    clinic.execute("update anonproxy.composition_settings set action = 'off'")
    release = register_clinic_m(clinic)
    assert clinic.execute("select anonproxy.check_composition(%s, false)", (release,)).fetchone() == (None,)


# --- adult: two differently generalized releases, checked person by person -----------------------

QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]


@pytest.fixture
def adult_releases(postgresql: psycopg.Connection) -> psycopg.Connection:
    """Two releases of adult generalized differently: ranges, hierarchy nodes and value sets."""
    conn = postgresql
    conn.execute("""create table rel_a as
        select (a.age / 5 * 5)::text || '-' || (a.age / 5 * 5 + 4)::text as age, a.workclass, e.node as education,
               a.marital_status, a.race, a.sex,
               case when a.native_country = 'United-States' then a.native_country
                    else array[a.native_country, 'Mexico']::text end as native_country, a.occupation
        from adult a join anonproxy.hierarchy_nodes e
          on e.hierarchy = 'adult.education' and e.leaf = a.education and e.level = 1""")
    conn.execute("""create table rel_b as
        select ((a.age + 3) / 10 * 10 - 3)::text || '-' || ((a.age + 3) / 10 * 10 + 6)::text as age,
               w.node as workclass, a.education, m.node as marital_status, a.race, '*' as sex, a.native_country,
               a.occupation
        from adult a
        join anonproxy.hierarchy_nodes w on w.hierarchy = 'adult.workclass' and w.leaf = a.workclass and w.level = 1
        join anonproxy.hierarchy_nodes m
          on m.hierarchy = 'adult.marital_status' and m.leaf = a.marital_status and m.level = 1""")
    for target in ("public.rel_a", "public.rel_b"):
        register(conn, "public.adult", target, "mondrian", QI, "occupation", '{"k": 5}')
    return conn


RANGE = re.compile(r"(-?\d+(?:\.\d+)?)(?:-(-?\d+(?:\.\d+)?))?")


def covers(cell: str, value: object, domain: set[str], leaves: dict[str, set[str]]) -> bool:
    """The oracle's reading of a generalized cell (docs/views-internals.md, "Generalized values"), in the order
    value, '*', numeric range, set, hierarchy node."""
    text = str(value)
    if cell in domain:
        return cell == text
    if cell == "*":
        return True
    bounds = RANGE.fullmatch(cell)
    if isinstance(value, int) and bounds:
        return Decimal(bounds[1]) <= value <= Decimal(bounds[2] or bounds[1])
    if cell.startswith("{") and cell.endswith("}"):
        return text in next(csv.reader([cell[1:-1]]))
    return text in leaves.get(cell, set())


def test_adult_audit_matches_an_oracle(adult_releases: psycopg.Connection) -> None:
    conn = adult_releases
    nodes: dict[str, dict[str, set[str]]] = {}
    for column in QI:
        tree = nodes.setdefault(column, {})
        for leaf, node in conn.execute("select leaf, node from anonproxy.hierarchy_nodes where hierarchy = %s",
                                       (f"adult.{column}",)):
            tree.setdefault(node, set()).add(leaf)
    classes = {}
    for table in ("rel_a", "rel_b"):
        classes[table] = conn.execute(
            f"select {', '.join(QI)}, count(*), array_agg(distinct occupation) from {table} "
            f"group by {', '.join(QI)}").fetchall()
    persons = conn.execute(f"select id::text, {', '.join(QI)} from adult").fetchall()
    domains = [{str(p[i + 1]) for p in persons} for i in range(len(QI))]
    sample = random.Random(6).sample(persons, 150)

    expected = {}
    for person, *values in sample:
        located = []
        for table in ("rel_a", "rel_b"):
            found = [c for c in classes[table]
                     if all(covers(cell, v, dom, nodes[q]) for cell, v, dom, q in zip(c[:7], values, domains, QI))]
            located.append((len({s for c in found for s in c[8]}), sum(c[7] for c in found),
                            {s for c in found for s in c[8]}))
        common = located[0][2] & located[1][2]
        expected[person] = ([e for e, _, _ in located], [n for _, n, _ in located], len(common), sorted(common))

    got = {row[0]: (row[1], row[2], row[3], row[4]) for row in conn.execute(
        """select person, prior_ea, partition_size, posterior_ea, possible_values
           from anonproxy.composition_persons(array['rel_a', 'rel_b']::regclass[])
           where person = any(%s)""", ([p for p, *_ in sample],))}
    assert got == expected
    risk = conn.execute("select anonproxy.composition_risk(array['rel_a', 'rel_b']::regclass[])").fetchone()[0]
    assert (risk["overlap"], risk["located"]) == (30162, 30162)
    # Perfect breaches happen (some classes of rel_a are narrow), but not to everybody.
    assert 0 < risk["pvp"]["100"] < risk["pvp"]["50"] < risk["pvp"]["25"] <= 100


def test_second_mondrian_release_of_adult_warns(postgresql: psycopg.Connection) -> None:
    conn = postgresql
    seen = notices(conn)
    for target, k in (("public.adult_k5", 5), ("public.adult_k10", 10)):
        conn.execute("""select anonproxy.create_anonymized_view(source => 'public.adult', target => %s,
                            quasi_identifiers => %s, sensitive => 'occupation', k => %s, method => 'mondrian')""",
                     (target, QI, k))
    warnings = [n for n in seen if n.severity == "WARNING"]
    assert len(warnings) == 1
    assert warnings[0].message.startswith("composition risk: public.adult_k10 combined with public.adult_k5 reveals "
                                          "occupation exactly for ")
    stored, forced = conn.execute("select composition, forced from anonproxy.releases "
                                  "where target = 'public.adult_k10'").fetchone()
    assert stored["exceeded"] is True and forced is False
    assert stored["risk"]["located"] == 30162  # Mondrian's cells are disjoint: everybody is found in both
    again = conn.execute("select anonproxy.composition_risk(array['adult_k10', 'adult_k5']::regclass[])").fetchone()[0]
    assert again["pvp"] == stored["risk"]["pvp"] and 0 < again["pvp"]["100"] < 100
    assert conn.execute("select composition from anonproxy.releases where target = 'public.adult_k5'").fetchone()[0][
        "risk"] is None


# --- fail closed: people the audit cannot locate are an unknown risk, not no risk -------------------

@pytest.fixture
def years(postgresql: psycopg.Connection) -> psycopg.Connection:
    """A source whose QI is a domain over integer, and a release of it in ranges."""
    conn = postgresql
    conn.execute("create domain years as integer check (value >= 0)")
    load_table(conn, "create table dpeople (id integer primary key, age years, disease text)", "dpeople",
               [(1, 21, "flu"), (2, 23, "cold"), (3, 27, "gout"), (4, 28, "acne")])
    load_table(conn, "create table dp_a (age text, disease text)", "dp_a",
               [("20-24", "flu"), ("20-24", "cold"), ("25-29", "gout"), ("25-29", "acne")])
    register(conn, "public.dpeople", "public.dp_a", "mondrian", ["age"], "disease", '{"k": 2}')
    conn.commit()
    return conn


def test_a_domain_over_integer_is_read_as_a_number(years: psycopg.Connection) -> None:
    load_table(years, "create table dp_b (age text, disease text)", "dp_b",
               [("21-27", "flu"), ("21-27", "cold"), ("21-27", "gout"), ("28", "acne")])
    release = register(years, "public.dpeople", "public.dp_b", "mondrian", ["age"], "disease", '{"k": 1}')
    finding = years.execute("select anonproxy.check_composition(%s, false)", (release,)).fetchone()[0]
    # 21, 23: {flu, cold} in both; 27: {gout, acne} ∩ {flu, cold, gout} = {gout}; 28: {acne}.
    assert (finding["risk"]["overlap"], finding["risk"]["located"]) == (4, 4)
    assert finding["risk"]["pvp"]["100"] == 50 and finding["exceeded"] is True and finding["unmeasured"] == 0


def test_people_who_cannot_be_located_are_an_unknown_risk(years: psycopg.Connection) -> None:
    # 'twenties' is no range and no node of any hierarchy: 21 and 23 are in no class of dp_c.
    load_table(years, "create table dp_c (age text, disease text)", "dp_c",
               [("twenties", "flu"), ("twenties", "cold"), ("25-29", "gout"), ("28", "acne")])
    release = register(years, "public.dpeople", "public.dp_c", "mondrian", ["age"], "disease", '{"k": 1}')
    years.execute("update anonproxy.composition_settings set action = 'refuse'")
    years.commit()
    with pytest.raises(psycopg.Error) as caught:
        years.execute("select anonproxy.check_composition(%s, false)", (release,))
    assert caught.value.sqlstate == "APC01"
    # 27: {gout} ∩ {gout, acne} is certain; 28 is in '25-29' and '28': {gout, acne}. 1 of the 2 located.
    assert caught.value.diag.message_primary == (
        "composition risk: public.dp_c combined with public.dp_a reveals disease exactly for 50.00 % of the 2 people "
        "located of the 4 they share (limit 0 %); the risk could not be measured for 2 of the 4 people they share: "
        "2 could not be located (2 not in any class of public.dp_c)")
    years.rollback()
    seen = notices(years)
    finding = years.execute("select anonproxy.check_composition(%s, true)", (release,)).fetchone()[0]
    assert (finding["unmeasured"], finding["forced"], finding["risk"]["unlocated"]) == (2, True, 2)
    assert [(r["release"], r["unlocated"]) for r in finding["risk"]["releases"]] == [("public.dp_c", 2),
                                                                                     ("public.dp_a", 0)]
    assert [n.severity for n in seen] == ["WARNING"]


def test_unlocated_people_alone_warn(years: psycopg.Connection) -> None:
    load_table(years, "create table dp_d (age text, disease text)", "dp_d",
               [("20-24", "flu"), ("20-24", "cold"), ("late twenties", "gout"), ("late twenties", "acne")])
    release = register(years, "public.dpeople", "public.dp_d", "mondrian", ["age"], "disease", '{"k": 2}')
    seen = notices(years)
    finding = years.execute("select anonproxy.check_composition(%s, false)", (release,)).fetchone()[0]
    # The located (21, 23) keep {flu, cold}: nothing measured is above the limit, yet 2 are unknown.
    assert (finding["exceeded"], finding["unmeasured"], finding["forced"]) == (False, 2, False)
    assert [n.severity for n in seen] == ["WARNING"]
    assert seen[0].message == ("composition risk: public.dp_d combined with public.dp_a: the risk could not be measured "
                               "for 2 of the 4 people they share: 2 could not be located (2 not in any class of "
                               "public.dp_d)")


def test_a_set_cell_that_equals_a_value_leaves_people_unknown(postgresql: psycopg.Connection) -> None:
    conn = postgresql
    load_table(conn, "create table tags (id integer primary key, tag text, d text)", "tags",
               [(1, "a", "flu"), (2, "b", "cold"), (3, "{a,b}", "gout"), (4, "c", "acne")])
    # Mondrian's set {a,b} is also a value of the column: read as that value, it covers person 3 only.
    load_table(conn, "create table tags_m (tag text, d text)", "tags_m",
               [("{a,b}", "flu"), ("{a,b}", "cold"), ('{"{a,b}",c}', "gout"), ('{"{a,b}",c}', "acne")])
    load_table(conn, "create table tags_any (tag text, d text)", "tags_any",
               [("*", "flu"), ("*", "cold"), ("*", "gout"), ("*", "acne")])
    register(conn, "public.tags", "public.tags_any", "mondrian", ["tag"], "d", '{"k": 4}')
    release = register(conn, "public.tags", "public.tags_m", "mondrian", ["tag"], "d", '{"k": 2}')
    risk = conn.execute("select anonproxy.composition_risk(array['tags_m', 'tags_any']::regclass[])").fetchone()[0]
    assert (risk["overlap"], risk["located"], risk["unlocated"], risk["null_qi"]) == (4, 2, 2, 0)
    assert [r["unlocated"] for r in risk["releases"]] == [2, 0]
    conn.execute("update anonproxy.composition_settings set action = 'refuse'")
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("select anonproxy.check_composition(%s, false)", (release,))
    assert caught.value.sqlstate == "APC01"
    assert "the risk could not be measured for 2 of the 4 people they share" in caught.value.diag.message_primary


# --- sources without a key -------------------------------------------------------------------------

def anonymize_clinic_view(conn: psycopg.Connection, target: str, k: int) -> None:
    conn.execute("""select anonproxy.create_anonymized_view(source => 'public.clinic_v', target => %s,
                        quasi_identifiers => array['age', 'sex'], sensitive => 'diagnosis', k => %s,
                        method => 'mondrian')""", (target, k))


@pytest.fixture
def clinic_view(postgresql: psycopg.Connection) -> psycopg.Connection:
    """A view with no key (a view has no row identity either), released once."""
    conn = postgresql
    load_table(conn, "create table clinic_nokey (age integer, sex text, diagnosis text)", "clinic_nokey",
               [row[1:] for row in CLINIC])
    conn.execute("create view clinic_v as select age, sex, diagnosis from clinic_nokey")
    anonymize_clinic_view(conn, "public.clinic_v2", 2)
    conn.commit()
    return conn


def test_a_view_without_key_warns_that_people_cannot_be_told_apart(clinic_view: psycopg.Connection) -> None:
    seen = notices(clinic_view)
    anonymize_clinic_view(clinic_view, "public.clinic_v3", 3)
    finding = clinic_view.execute(
        "select composition from anonproxy.releases where target = 'public.clinic_v3'").fetchone()[0]
    assert finding["risk"] is None and finding["unmeasured"] is None
    assert finding["problem"].startswith("cannot tell people apart in public.clinic_v")
    warnings = [n for n in seen if n.severity == "WARNING"]
    assert len(warnings) == 1
    assert warnings[0].message.startswith("composition risk: public.clinic_v3 combined with public.clinic_v2 could "
                                          "not be measured: cannot tell people apart in public.clinic_v")
    assert "give the source a primary key" in warnings[0].hint


def test_a_view_without_key_is_refused(clinic_view: psycopg.Connection) -> None:
    clinic_view.execute("update anonproxy.composition_settings set action = 'refuse'")
    with pytest.raises(psycopg.Error) as caught:
        anonymize_clinic_view(clinic_view, "public.clinic_v3", 3)
    assert caught.value.sqlstate == "APC01" and "cannot tell people apart" in caught.value.diag.message_primary
    clinic_view.rollback()
    assert clinic_view.execute("select to_regclass('public.clinic_v3')").fetchone() == (None,)


def test_a_partitioned_source_without_key_counts_rows_of_every_partition(postgresql: psycopg.Connection) -> None:
    conn = postgresql
    conn.execute("create table sites (site integer, age integer, disease text) partition by list (site)")
    conn.execute("create table sites_1 partition of sites for values in (1)")
    conn.execute("create table sites_2 partition of sites for values in (2)")
    # The first row of each partition has the same ctid, (0,1), and the same age: still two people.
    conn.execute("insert into sites values (1, 30, 'flu'), (2, 30, 'cold'), (1, 50, 'gout'), (2, 50, 'acne')")
    load_table(conn, "create table sites_r1 (age text, disease text)", "sites_r1",
               [("30", "flu"), ("30", "cold"), ("50", "gout"), ("50", "acne")])
    load_table(conn, "create table sites_r2 (age text, disease text)", "sites_r2",
               [("*", "flu"), ("*", "cold"), ("*", "gout"), ("*", "acne")])
    for target in ("public.sites_r1", "public.sites_r2"):
        register(conn, "public.sites", target, "mondrian", ["age"], "disease", '{"k": 2}')
    risk = conn.execute("select anonproxy.composition_risk(array['sites_r1', 'sites_r2']::regclass[])").fetchone()[0]
    assert (risk["overlap"], risk["located"]) == (4, 4)


# --- QIs named like the audit's own columns ---------------------------------------------------------

def test_quasi_identifiers_named_like_the_work_tables_columns(postgresql: psycopg.Connection) -> None:
    conn = postgresql
    load_table(conn, "create table sz (id integer primary key, size integer, ec text, sens text, t text, q1 text, "
                     "s text)", "sz",
               [(1, 10, "a", "x", "u", "m", "flu"), (2, 12, "a", "x", "u", "m", "cold"),
                (3, 30, "b", "y", "v", "n", "gout"), (4, 32, "b", "y", "v", "n", "acne")])
    qi = ["size", "ec", "sens", "t", "q1"]
    load_table(conn, "create table sz_1 (size text, ec text, sens text, t text, q1 text, s text)", "sz_1",
               [("10-12", "a", "x", "u", "m", "flu"), ("10-12", "a", "x", "u", "m", "cold"),
                ("30-32", "b", "y", "v", "n", "gout"), ("30-32", "b", "y", "v", "n", "acne")])
    load_table(conn, "create table sz_2 (size text, ec text, sens text, t text, q1 text, s text)", "sz_2",
               [("10-30", "*", "*", "*", "*", "flu"), ("10-30", "*", "*", "*", "*", "cold"),
                ("10-30", "*", "*", "*", "*", "gout"), ("32", "*", "*", "*", "*", "acne")])
    register(conn, "public.sz", "public.sz_1", "mondrian", qi, "s", '{"k": 2}')
    register(conn, "public.sz", "public.sz_2", "mondrian", qi, "s", '{"k": 1}')
    rows = conn.execute("""select person, prior_ea, partition_size, posterior_ea, possible_values
                           from anonproxy.composition_persons(array['sz_1', 'sz_2']::regclass[])""").fetchall()
    assert rows == [("1", [2, 3], [2, 3], 2, ["cold", "flu"]), ("2", [2, 3], [2, 3], 2, ["cold", "flu"]),
                    ("3", [2, 3], [2, 3], 1, ["gout"]), ("4", [2, 1], [2, 1], 1, ["acne"])]
