"""Issue 24: the "bounds first" suppression of a GROUP BY over rows that are not people releases exactly what its
exact path releases, on generated data.

A linked table ``acts`` (several rows per person, some with no person) reaches the protected table ``folks`` (one
row per person). Each draw generates the data (people with 1 to ``most`` rows, a few heavy people, NULL units,
negative and positive values, zeros that do not contribute, skewed groups), the role's rules (k, the
suppressed-rest row, dominance (n, k%), p %, each on or off) and statements of the shapes the bounds path takes
(a GROUP BY of one or two columns of either table, joined or the linked table alone, counts, contributor counts,
sums, averages, extremes, a WHERE or none). For each, the suppression SQL runs as the service runs it and, forced
onto its exact path (``anonproxy_sure`` false), again: the rows and the report's details must be the same. The
draw must take the bounds path (``anonproxy_sure`` true) in a good share of the statements, or it proves nothing.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import psycopg
from conftest import database_of_its_own
from service_sql import bounds_settle, exact_path, rewritten, service_answer, sorted_rows

from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "suppress_bounds_property"
DATASETS = 12
STATEMENTS = 25  # per data set
KEYS = ("f.region", "f.band", "a.kind")
AGGREGATES = ("count(*)", "count(a.v)", "sum(a.v)", "avg(a.v)", "min(a.v)", "max(a.v)", "sum(a.w)",
              "count(*) FILTER (WHERE a.v > 0)", "sum(a.v) FILTER (WHERE a.kind <> 'c')")
WHERES = (None, None, "f.age > 30", "a.v > -20", "f.region <> 'r3'", "a.kind <> 'b'")


def _folks_and_acts(conn: psycopg.Connection[Any]) -> Policy:
    """``folks`` (protected, id its primary key) and ``acts`` linked to it, empty, beside the demo policy."""
    conn.execute("create table public.folks (id integer primary key, region text not null, band integer, "
                 "age integer not null)")
    conn.execute("create table public.acts (person integer, kind text not null, v integer not null, "
                 "w numeric(8, 2))")
    folks = ProtectedTable("public.folks", "id", {
        "id": ColumnPolicy("id", "identifier"),
        "region": ColumnPolicy("region", "quasi_identifier"),
        "band": ColumnPolicy("band", "quasi_identifier", 0, 10),
        "age": ColumnPolicy("age", "quasi_identifier", 0, 120)})
    acts = LinkedTable("public.acts", "person", "public.folks", "id", {
        "person": ColumnPolicy("person", "identifier"),
        "kind": ColumnPolicy("kind", "quasi_identifier"),
        "v": ColumnPolicy("v", "sensitive", -10000, 10000),
        "w": ColumnPolicy("w", "sensitive", -10000, 10000)})
    demo = demo_policy()
    return dataclasses.replace(demo, tables={**demo.tables, folks.name: folks}, links={acts.name: acts})


owner = database_of_its_own(DATABASE, _folks_and_acts)


def fill(conn: psycopg.Connection[Any], rng: random.Random) -> None:
    """New data: 40 to 400 people in skewed regions, 1 to ``most`` rows each, a few heavy people, or (one data set
    in three) crowded; maybe rows with no person, values mostly small (zero, negative or positive), maybe a dominant
    one."""
    people = rng.randint(40, 400)
    weights = [rng.choice((1, 1, 3, 20)) for _ in range(rng.randint(1, 4))]
    regions = rng.choices([f"r{i}" for i in range(len(weights))], weights, k=people)
    bands = [rng.choice((0, 1, 2, None)) if rng.random() < 0.9 else 7 for _ in range(people)]
    ages = [rng.randint(18, 80) for _ in range(people)]
    most = rng.choice((1, 2, 2, 3))
    counts = [rng.randint(1, most) for _ in range(people)]
    for heavy in rng.sample(range(people), rng.choice((0, 0, 0, 1, 3))):
        counts[heavy] = rng.randint(most, 4 * most + 3)
    if rng.random() < 1 / 3:
        regions, counts = crowded(rng, people)
    low = rng.choice((0, -10, -60))
    acts: list[tuple[int | None, str, int, str | None]] = []
    for person, rows in enumerate(counts):
        for _ in range(rows):
            v = rng.randint(low, 60)
            acts.append((person, rng.choice("aabc"), v, None if rng.random() < 0.1 else f"{v / 4:.2f}"))
    for _ in range(rng.choice((0, 0, 5))):
        acts.append((None, rng.choice("abc"), rng.randint(1, 60), "1.00"))
    if rng.random() < 0.2:
        acts[rng.randrange(len(acts))] = (rng.randrange(people), "a", 5000, "5000.00")
    load(conn, list(zip(range(people), regions, bands, ages, strict=True)), acts)


def crowded(rng: random.Random, people: int) -> tuple[list[str], list[int]]:
    """Regions and rows per person where r0 holds all but 20 to 40 people (r1, one row each), and r0's rows
    outnumber its people by nearly as many: N - rows of r0 is 1 to 4, while its people leave 20 to 40 out of N
    (the bounds settle it through the other groups' rows, at most 2 per person)."""
    others = rng.randint(20, min(40, people // 2))
    doubled = others - rng.randint(1, 4)
    regions = ["r1"] * others + ["r0"] * (people - others)
    counts = [1] * others + [2] * doubled + [1] * (people - others - doubled)
    return regions, counts


def load(conn: psycopg.Connection[Any], folks: list[tuple[int, str, int | None, int]],
         acts: list[tuple[int | None, str, int, str | None]]) -> None:
    conn.execute("truncate public.acts, public.folks")
    with conn.cursor() as cursor:
        cursor.executemany("insert into public.folks values (%s, %s, %s, %s)", folks)
        cursor.executemany("insert into public.acts values (%s, %s, %s, %s)", acts)
    conn.execute("analyze public.folks, public.acts")


def rules(rng: random.Random) -> SuppressionParams:
    dominance = rng.choice((None, (1, 60.0), (2, 85.0)))
    return SuppressionParams(k=rng.choice((2, 3, 5, 5, 10)), dominance_n=dominance and dominance[0],
                             dominance_percent=dominance and dominance[1],
                             p_percent=rng.choice((None, 10.0, 30.0)), suppressed_rest=rng.random() < 0.5,
                             allow_min_max=True)


def statement(rng: random.Random) -> str:
    """A GROUP BY over acts, joined to folks (each person in one group where the keys are folks' columns) or
    alone."""
    joined = rng.random() < 0.75
    keys = rng.sample([key for key in KEYS if joined or key.startswith("a.")], rng.choice((1, 1, 2)) if joined else 1)
    aggregates = rng.sample(AGGREGATES, rng.choice((1, 2, 3)))
    items = [f"{key} AS k{i}" for i, key in enumerate(keys, 1)] + [f"{a} AS a{i}" for i, a in enumerate(aggregates)]
    source = "public.acts a JOIN public.folks f ON a.person = f.id" if joined else "public.acts a"
    where = rng.choice([w for w in WHERES if joined or w is None or w.startswith("a.")])
    return " ".join([f"SELECT {', '.join(items)} FROM {source}", *([f"WHERE {where}"] if where else []),
                     f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 1))}"])


def _rewrite(policy: Policy, params: SuppressionParams, text: str) -> str:
    return rewritten(text, RolePolicy("reporter", "suppress", params), policy)


def test_the_bounds_path_answers_as_the_exact_path(owner: psycopg.Connection) -> None:
    rng = random.Random("issue 24 bounds first, generated")
    policy = load_policy(owner)
    settled = withheld = cases = 0
    for _ in range(DATASETS):
        fill(owner, rng)
        for _ in range(STATEMENTS):
            params, text = rules(rng), statement(rng)
            sql = _rewrite(policy, params, text)
            answer = service_answer(owner, sql)
            assert answer == service_answer(owner, exact_path(sql)), (params, text)
            settled += bounds_settle(owner, sql)
            withheld += any('"groups": null' not in d and '"groups": 0' not in d for d in answer[1])
            cases += 1
    assert settled >= cases // 4, (settled, cases)  # the bounds path is taken, not only the exact one
    assert withheld >= cases // 10, (withheld, cases)  # and the exact path withholds groups


def test_a_group_settled_by_the_other_groups_rows_is_released(owner: psycopg.Connection) -> None:
    """100 people with 140 rows in r0 (40 of them with two), 45 people with one row each in r1; k = 10. r0 settles
    through the other groups' rows (45 >= k * most = 20), though N - rows = 145 - 140 = 5: its people leave 45 out
    of N, and the exact path releases it, as the bounds path must (it withheld it when a group's rows stood in for
    its people in primary suppression)."""
    folks = [(i, "r0" if i < 100 else "r1", 1, 40) for i in range(145)]
    acts = [(i, "a", 10 + i % 7, "1.00") for i in range(145)] + [(i, "b", 12, "1.00") for i in range(40)]
    load(owner, folks, acts)
    text = ("SELECT f.region, count(*) AS n, sum(a.v) AS total FROM public.acts a JOIN public.folks f "
            "ON a.person = f.id GROUP BY 1")
    params = SuppressionParams(k=10, dominance_n=2, dominance_percent=85, p_percent=10, suppressed_rest=True)
    sql = _rewrite(load_policy(owner), params, text)
    assert bounds_settle(owner, sql)
    rows, details = service_answer(owner, sql)
    assert rows == sorted_rows(owner.execute(text).fetchall())  # both groups, PostgreSQL's own answer
    assert (rows, details) == service_answer(owner, exact_path(sql))
