"""Issue 24: where a person has several rows (a linked table), the two-level suppression SQL answers as the
per-person SQL did.

With a magnitude rule and a GROUP BY over a linked table (alone or joined to ``adult``), the suppression SQL
aggregates each person's part of each group once (``anonproxy_cells``: the client's aggregates over the person's
rows, the person's part of each SUM/AVG, whether they contribute) and takes every group's answer, people,
contributors, total and largest contribution from those cells (anonproxy.suppress.one_pass, "two level"); before,
the per-person SQL (anonproxy.suppress.rewrite, "cells") computed the same cells for the rules and then ran the
client's statement again for the answer. This test draws statements over a linked table whose people have 0 to 3
rows each, spread over several groups, with a few dominant contributors and small groups that are withheld, and
compares what the two SQL texts return (rows, their order where fixed, the report behind the NOTICE, errors),
for roles with dominance, p % and the suppressed-rest row; the released groups are also checked against the
independent oracle (tests/suppression_oracle.py), which adds up each person's rows and ranks every contribution.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import govern_by_demo_policy
from service_sql import run_as_service
from suppression_oracle import Magnitudes, suppress

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite
from anonproxy.suppress import one_pass

DATABASE = "linked_shapes"
STAYS = "public.stays"
TWO_LEVEL = "from its cells"  # the comment of the two-level summary CTE
STATEMENTS = 20  # per role
ROLES = {
    "reporter_like": SuppressionParams(k=10, dominance_n=2, dominance_percent=85, p_percent=10, suppressed_rest=True, allow_min_max=True),
    "dominance_1_50": SuppressionParams(k=5, dominance_n=1, dominance_percent=50, suppressed_rest=True, allow_min_max=True),
    "dominance_3_60": SuppressionParams(k=8, dominance_n=3, dominance_percent=60, allow_min_max=True),
    "p_40": SuppressionParams(k=10, p_percent=40, suppressed_rest=True, allow_min_max=True),
}
KEYS = ("s.ward", "a.sex", "a.race", "a.education", "(a.age / 10) * 10", "s.nights")
AGGREGATES = ("sum(s.nights)", "sum(s.cost)", "avg(s.nights)", "avg(s.cost)", "count(s.cost)", "min(s.cost)",
              "max(s.nights)", "count(*) FILTER (WHERE s.nights > 3)", "sum(s.cost) FILTER (WHERE s.nights > 1)")
WHERES = (None, "a.age > 60", "s.nights > 2", "a.sex = 'Female'", "s.ward <> 'a'")


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, pg_template: Any) -> Iterator[psycopg.Connection]:
    """A database of its own: the demo policy, and ``stays`` linked to adult: 0 to 3 rows per person in several
    wards, nights 0 to 8 (0: no contribution), costs mostly small with a few dominant ones, a rare ward."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"create table {STAYS} (person integer not null, ward text not null, nights integer not null, "
                     "cost numeric(10, 2) not null)")
        conn.execute(f"insert into {STAYS} select id, case when id % 911 = 0 then 'rare' "
                     "else (array['a', 'b', 'c', 'd', 'e'])[(id * 7 + n) % 5 + 1] end, (id * 13 + n) % 9, "
                     "case when id % 997 = 0 then 50000 else (id * 31 + n) % 50 end "
                     "from public.adult, generate_series(1, id % 4) n")
        conn.execute(f"analyze {STAYS}")
        link = LinkedTable(STAYS, "person", "public.adult", "id", {
            "person": ColumnPolicy("person", "identifier"),
            "ward": ColumnPolicy("ward", "quasi_identifier"),
            "nights": ColumnPolicy("nights", "sensitive", 0, 10),
            "cost": ColumnPolicy("cost", "sensitive", 0, 100000)})
        apply_policy(conn, dataclasses.replace(demo_policy(), links={STAYS: link}))
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        yield conn
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database {DATABASE} with (force)")


def draw(rng: random.Random) -> tuple[str, bool]:
    """A statement over stays (joined to adult or alone), and whether its ORDER BY fixes the order of every row."""
    joined = rng.random() < 0.7
    keys = rng.sample([key for key in KEYS if joined or key.startswith("s.")], rng.choice((1, 1, 1, 2)))
    aggregates = rng.sample(AGGREGATES, rng.choice((1, 2, 3)))
    items = [f"{key} AS k{i}" for i, key in enumerate(keys, 1)]
    items += ["count(*) AS n"] + [f"{aggregate} AS a{i}" for i, aggregate in enumerate(aggregates, 1)]
    if rng.random() < 0.2:
        items.append("round(avg(s.nights), 1) AS rounded")
    source = "stays s JOIN adult a ON s.person = a.id" if joined else "stays s"
    parts = [f"SELECT {', '.join(items)}", f"FROM {source}"]
    where = rng.choice([w for w in WHERES if joined or w is None or w.startswith("s.")])
    if where is not None:
        parts.append(f"WHERE {where}")
    parts.append(f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 1))}")
    if rng.random() < 0.2:
        parts.append(rng.choice(("HAVING count(*) > 30", "HAVING sum(s.nights) > 100")))
    ordered = False
    if rng.random() < 0.4:
        parts.append(f"ORDER BY n DESC, {', '.join(str(i) for i in range(1, len(keys) + 1))}")
        ordered = True
        if rng.random() < 0.5:
            parts.append(f"LIMIT {rng.randint(1, 6)}")
    return " ".join(parts), ordered


def _comparable(rows: list[tuple[Any, ...]], ordered: bool) -> list[tuple[Any, ...]]:
    # numeric as text: the same value must come with the same scale (1.50 is not 1.5 to a client)
    normal = [tuple(str(v) if isinstance(v, Decimal) else v for v in row) for row in rows]
    return normal if ordered else sorted(normal, key=lambda row: tuple((v is None, str(v)) for v in row))


def _both(statement: str, rules: RolePolicy, policy: Policy, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The two-level SQL and the per-person SQL of the same statement."""
    fast = decide(statement, rules, policy)
    with monkeypatch.context() as patch:
        patch.setattr(one_pass, "two_level", lambda query, rules: False)
        slow = decide(statement, rules, policy)
    assert isinstance(fast, Rewrite) and isinstance(slow, Rewrite), (statement, fast, slow)
    return fast.runs, slow.runs


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_two_level_sql_answers_as_the_per_person_sql(owner: psycopg.Connection, role: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy(owner)
    rules = RolePolicy(role=role, mode="suppress", suppression=ROLES[role])
    rng = random.Random(f"issue 24 linked {role}")
    withheld = 0
    for _ in range(STATEMENTS):
        statement, ordered = draw(rng)
        fast, slow = _both(statement, rules, policy, monkeypatch)
        assert TWO_LEVEL not in slow
        # every drawn aggregate follows from the cells: a SUM or AVG (a magnitude rule applies) takes the two levels
        assert (TWO_LEVEL in fast) == ("sum(" in statement or "avg(" in statement), statement
        fast_rows, fast_report, fast_error = run_as_service(owner, fast)
        slow_rows, slow_report, slow_error = run_as_service(owner, slow)
        assert fast_error == slow_error, statement
        assert _comparable(fast_rows, ordered) == _comparable(slow_rows, ordered), statement
        assert fast_report == slow_report, statement
        assert fast_error is None, (statement, fast_error)
        withheld += any('"groups": null' not in report and '"groups": 0' not in report for report in fast_report)
    assert withheld >= 3  # the draw reaches withheld groups


ORACLE_KEYS = ("s.ward", "a.education", "s.nights", "a.race")
ORACLE_WHERES = (None, "a.age > 50", "s.nights > 4")


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_two_level_sql_releases_what_the_oracle_releases(owner: psycopg.Connection, role: str) -> None:
    """The released groups and the rest row against the oracle, which adds up each person's rows per group."""
    policy = load_policy(owner)
    params = ROLES[role]
    rules = RolePolicy(role=role, mode="suppress", suppression=params)
    dominance = None if params.dominance_n is None else (params.dominance_n, params.dominance_percent)
    magnitudes = Magnitudes(dominance, params.p_percent)  # type: ignore[arg-type]
    source = "stays s JOIN adult a ON s.person = a.id"
    everyone = owner.execute(f"SELECT count(DISTINCT s.person) FROM {source}").fetchone()[0]  # type: ignore[index]
    for key in ORACLE_KEYS:
        for where in ORACLE_WHERES:
            filtered = f" WHERE {where}" if where is not None else ""
            groups: dict[Any, set[int]] = {}
            helping: dict[Any, set[int]] = {}
            parts: dict[Any, dict[int, Any]] = {}
            for person, group, cost in owner.execute(f"SELECT s.person, {key}, s.cost FROM {source}{filtered}"):
                groups.setdefault(group, set()).add(person)
                by_person = parts.setdefault(group, {})
                by_person[person] = by_person.get(person, 0) + cost
                if cost != 0:
                    helping.setdefault(group, set()).add(person)
            verdict = suppress(groups, k=params.k, everyone=everyone, contributors={"sum": helping},
                               sums={"sum": parts}, magnitudes=magnitudes, rest=params.suppressed_rest)
            statement = f"SELECT {key} AS k1, count(*) AS n, sum(s.cost) AS total FROM {source}{filtered} GROUP BY 1"
            decision = decide(statement, rules, policy)
            assert isinstance(decision, Rewrite) and TWO_LEVEL in decision.runs, statement
            answer, _, error = run_as_service(owner, decision.runs)
            assert error is None, statement
            assert {row[0] for row in answer if row[0] is not None} == set(verdict.released), statement
            assert any(row[0] is None for row in answer) == verdict.rest, statement


def test_the_catalog_is_checked_only_where_each_person_is_in_one_group(owner: psycopg.Connection) -> None:
    """Where every grouping expression reads only adult's columns (adult.id unique: a person's stays all share their
    group), the bounds count the other groups' people as left out of N (anonproxy.suppress.one_pass, "_bounded"),
    with or without a WHERE, and the statement checks the catalog when it runs; a key of the linked table (a
    person's stays in several wards) does not rest on it."""
    policy = load_policy(owner)
    rules = RolePolicy(role="reporter_like", mode="suppress", suppression=ROLES["reporter_like"])
    check = "anonproxy.one_row_per_person("
    adds_up = ["SELECT a.sex, count(*), sum(s.cost) FROM stays s JOIN adult a ON s.person = a.id GROUP BY 1",
               "SELECT sex, race, sum(cost) FROM stays JOIN adult ON stays.person = adult.id GROUP BY 1, 2",
               "SELECT (a.age / 10) * 10, avg(s.nights) FROM adult a JOIN stays s ON s.person = a.id GROUP BY 1",
               "SELECT a.sex, sum(s.cost) FROM stays s JOIN adult a ON s.person = a.id WHERE a.age > 30 GROUP BY 1"]
    distinct = ["SELECT s.ward, count(*), sum(s.cost) FROM stays s JOIN adult a ON s.person = a.id GROUP BY 1",
                "SELECT a.sex, s.ward, sum(s.cost) FROM stays s JOIN adult a ON s.person = a.id GROUP BY 1, 2",
                "SELECT ward, sum(cost) FROM stays GROUP BY 1"]
    for statement in adds_up + distinct:
        decision = decide(statement, rules, policy)
        assert isinstance(decision, Rewrite) and TWO_LEVEL in decision.runs, statement
        assert (check in decision.runs) == (statement in adds_up), statement
    decision = decide(adds_up[0], rules, policy)
    assert isinstance(decision, Rewrite)
    before, _, error = run_as_service(owner, decision.runs)
    assert error is None and len(before) == 2
    owner.execute("alter table adult drop constraint adult_pkey")
    try:
        _, _, error = run_as_service(owner, decision.runs)
        assert error == ('55000 anonproxy: "public"."adult".id is no longer unique and not null in the catalog, as it '
                         'was when the policy was read')
    finally:
        owner.execute("alter table adult add constraint adult_pkey primary key (id)")
    assert run_as_service(owner, decision.runs)[0] == before
