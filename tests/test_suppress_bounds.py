"""Issue 24: a GROUP BY whose rows are not people decides from bounds when they settle every group.

Over a linked table (several rows per person), the count rule needs each group's distinct people and the
magnitude rules each person's part of each group: one aggregation with as many groups as people. The suppression
SQL first computes, in the pass that answers the statement, each group's rows with a unit, the buckets of people it
holds (64, by the unit) and, per SUM/AVG, the absolute value of its sum and the absolute total of each of 8 buckets;
these bound the people (the buckets held to ``rows``), the largest part of a person (the largest bucket's total) and
the total of the parts (at least ``|sum|``). When the bounds prove that every group passes (``anonproxy_sure``), the
exact figures are never computed (anonproxy.suppress.one_pass, ``_bounded``; docs/suppression.md).

Checked here on a linked table with 1 to 4 rows per person: the bounds are used (the exact pass reads no row),
the answer is PostgreSQL's own answer to the client's statement (every group released), and it is the same, rows
and report, as the same SQL forced onto its exact path; with one person given ten thousand rows of a large value
(more rows than a group can hold beside N, a part larger than the rest of the group's) the bounds settle nothing
and the exact path answers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import psycopg
import pytest
from conftest import database_of_its_own, unit_of_type
from service_sql import SURE, exact_path, reporter_sql, service_answer

from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "suppress_bounds"
SESSIONS = "public.sessions"
SESSIONS_TEXT = "public.sessions_text"  # the same rows, the person as text
STATEMENTS = {
    # a count by a column of the linked table (each group's people counted only when needed)
    "count by kind": ("SELECT s.kind, count(*) AS n FROM public.sessions s GROUP BY 1", 0),
    # a sum under the magnitude rules, by a column of adult (each person in one group)
    "sum by sex": (("SELECT a.sex, count(*) AS n, sum(s.minutes) AS total FROM public.adult a JOIN public.sessions s "
                   "ON s.person = a.id GROUP BY 1"), 0),
    # a WHERE: the answer's people are counted too
    "avg by education, filtered": (("SELECT a.education, count(*) AS n, avg(s.minutes) AS mean FROM public.adult a "
                                   "JOIN public.sessions s ON s.person = a.id WHERE a.age > 30 GROUP BY 1"), 1),
    # a sum by a column of the linked table: a person's rows in several groups
    "sum by kind": (("SELECT s.kind, sum(s.minutes) AS total, count(s.minutes) AS counted FROM public.sessions s "
                    "GROUP BY 1"), 0),
}
# The statements whose people may be in several groups: their bounds compare each group's rows with N counted up to
# the largest group's rows and k more, a scan of the people's index of its own.
SEVERAL = {"count by kind", "sum by kind"}


def _sessions(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy, and ``sessions`` linked to adult, 1 to 4 rows per person, minutes 1 to 60 (no dominant
    contribution), three kinds; ``sessions_text``, the same rows, its key text and linked to a text unit."""
    conn.execute(f"create table {SESSIONS} (person integer not null, kind text not null, minutes integer not null)")
    conn.execute(f"insert into {SESSIONS} select id, (array['web', 'app', 'phone'])[(id + n) % 3 + 1], "
                 "1 + (id * 7 + n) % 60 from public.adult, generate_series(1, 1 + id % 4) n")
    conn.execute(f"analyze {SESSIONS}")
    conn.execute(f"create table {SESSIONS_TEXT} as select person::text as person, kind, minutes from {SESSIONS}")
    conn.execute(f"analyze {SESSIONS_TEXT}")
    columns = {"person": ColumnPolicy("person", "identifier"), "kind": ColumnPolicy("kind", "quasi_identifier"),
               "minutes": ColumnPolicy("minutes", "sensitive", 0, 1000)}
    people = unit_of_type(conn, "public.sessions_people", "text")
    links = {SESSIONS: LinkedTable(SESSIONS, "person", "public.adult", "id", columns),
             SESSIONS_TEXT: LinkedTable(SESSIONS_TEXT, "person", people.name, "id", columns)}
    policy = demo_policy()
    return dataclasses.replace(policy, tables={**policy.tables, people.name: people}, links=links)


owner = database_of_its_own(DATABASE, _sessions)


def _scans(conn: psycopg.Connection[Any], sql: str, relation: str = "sessions") -> int:
    """How many scans of ``relation`` the statement runs (one process, so that each scan is one plan node)."""
    with conn.transaction():
        conn.execute("SET LOCAL search_path = pg_catalog")
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        row = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}").fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])

    def count(node: dict[str, Any]) -> int:
        here = int(node.get("Relation Name") == relation and node.get("Actual Loops", 0) > 0)
        return here + sum(count(child) for child in node.get("Plans", []))

    return count(plan[0]["Plan"])


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_bounds_settle_every_group_and_the_answer_is_postgresqls(owner: psycopg.Connection, name: str) -> None:
    statement, filtered = STATEMENTS[name]
    sql = reporter_sql(owner, statement)
    assert SURE in sql, sql
    rows, report = service_answer(owner, sql)
    assert rows == service_answer(owner, statement)[0]  # every group released: the client's own answer
    assert (rows, report) == service_answer(owner, exact_path(sql))
    # the answering pass, N counted up to a limit (and the WHERE's people): not exact N nor the exact pass
    assert _scans(owner, sql) == 2 + filtered
    assert _scans(owner, exact_path(sql)) == 3 + filtered


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_a_person_with_many_rows_leaves_the_bounds_open(owner: psycopg.Connection, name: str) -> None:
    """One person with ten thousand rows of 1,000 minutes: the 'web' group then has more rows than N less k, and the
    person's part is more than the rest of their group's: the bounds settle nothing, and the exact path answers (the
    answering pass, exact N and the exact pass; N counted up to a limit too where the bounds compared rows with it),
    as the SQL forced onto it does."""
    statement, filtered = STATEMENTS[name]
    with owner.transaction(force_rollback=True):
        owner.execute(f"insert into {SESSIONS} select 17, 'web', 1000 from generate_series(1, 10000)")
        sql = reporter_sql(owner, statement)
        assert service_answer(owner, sql) == service_answer(owner, exact_path(sql))
        assert _scans(owner, sql) == 3 + filtered + (name in SEVERAL)


def test_people_in_one_bucket_leave_the_bounds_open(owner: psycopg.Connection) -> None:
    """Twenty people whose ids are multiples of 64, in a kind of their own: their rows fall in one bucket, so the
    bounds prove one person where k are needed, and the exact path answers. It releases the kind (20 people), as
    PostgreSQL's own answer and the SQL forced onto the exact path do: how the units spread over the buckets costs
    time, never a verdict."""
    statement = STATEMENTS["count by kind"][0]
    with owner.transaction(force_rollback=True):
        owner.execute(f"insert into {SESSIONS} select id, 'fax', 5 from public.adult where id % 64 = 0 "
                      "order by id limit 20")
        sql = reporter_sql(owner, statement)
        rows, report = service_answer(owner, sql)
        assert ("fax", 20) in rows
        assert rows == service_answer(owner, statement)[0]  # every kind released
        assert (rows, report) == service_answer(owner, exact_path(sql))
        assert _scans(owner, sql) >= 3  # more than the bounds path's two: N and the exact pass


def test_a_unit_that_is_not_an_integer_falls_in_a_bucket_by_its_hash(owner: psycopg.Connection) -> None:
    """The person as text: the buckets come from the hash of the unit's own type (``hash_array``). The bounds settle
    every group (the answering pass and N counted up to a limit: two scans), and the answer is PostgreSQL's own and
    the exact path's."""
    statement = ("SELECT s.kind, count(*) AS n, sum(s.minutes) AS total FROM public.sessions_text s GROUP BY 1")
    sql = reporter_sql(owner, statement)
    assert 'hash_array(ARRAY["s"."person"])' in sql
    rows, report = service_answer(owner, sql)
    assert rows == service_answer(owner, statement)[0]
    assert (rows, report) == service_answer(owner, exact_path(sql))
    assert _scans(owner, sql, "sessions_text") == 2
