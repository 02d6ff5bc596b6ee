"""Issue 24: where the unit (link) column leads an index, the suppression SQL counts the people in its order.

Over a linked table, N (``anonproxy_universe``), and N counted up to a limit for the bounds (``anonproxy_counted``),
group the rows by person. Unordered, PostgreSQL hashes every person where the table is small; in the unit's order
it reads the index (a merge join with ``adult``'s primary key) and counts without a hash. The policy reads which
tables have such an index (``indexed_unit``: a B-tree index of every row whose first column is the unit or link
column), and the SQL asks for that order only then: it changes how N is counted, not what it is. Checked here: the
fact as read from the catalog (index of its own, primary key, partial index, index led by another column, none), and
the answers of statements over an indexed linked table: PostgreSQL's own, and the same as over an identical table
without the index.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from conftest import database_of_its_own
from service_sql import reporter_sql, run_as_service, sorted_rows

from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "suppress_indexed_units"
ORDERED = "GROUP BY 1 ORDER BY 1) AS anonproxy_units"  # N's people, in the unit's order
# Linked tables of adult with the same rows, and the index each has (None: none).
INDEXES = {
    "stays_indexed": "create index on public.stays_indexed (person)",
    "stays_partial": "create index on public.stays_partial (person) where nights > 0",
    "stays_second": "create index on public.stays_second (ward, person)",
    "stays_plain": None,
}
STATEMENTS = (
    "SELECT s.ward, count(*) AS n FROM public.{table} s GROUP BY 1",
    "SELECT a.sex, count(*) AS n, sum(s.nights) AS total FROM public.adult a JOIN public.{table} s "
    "ON s.person = a.id GROUP BY 1",
    "SELECT a.race, count(*) AS n, avg(s.nights) AS mean FROM public.adult a JOIN public.{table} s "
    "ON s.person = a.id WHERE s.nights > 2 GROUP BY 1",
)


def _stays(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy and four linked tables of adult, 1 to 4 rows per person."""
    links = {}
    for table, index in INDEXES.items():
        conn.execute(f"create table public.{table} (person integer not null, ward text not null, "
                     "nights integer not null)")
        conn.execute(f"insert into public.{table} select id, (array['a', 'b', 'c'])[(id + n) % 3 + 1], "
                     "1 + (id * 7 + n) % 9 from public.adult, generate_series(1, 1 + id % 4) n")
        if index is not None:
            conn.execute(index)
        conn.execute(f"analyze public.{table}")
        links[f"public.{table}"] = LinkedTable(f"public.{table}", "person", "public.adult", "id", {
            "person": ColumnPolicy("person", "identifier"),
            "ward": ColumnPolicy("ward", "quasi_identifier"),
            "nights": ColumnPolicy("nights", "sensitive", 0, 100)})
    return dataclasses.replace(demo_policy(), links=links)


owner = database_of_its_own(DATABASE, _stays)


def test_the_policy_reads_which_unit_columns_lead_an_index(owner: psycopg.Connection) -> None:
    policy = load_policy(owner)
    assert policy.tables["public.adult"].indexed_unit  # its primary key
    indexed = {name.removeprefix("public."): link.indexed_unit for name, link in policy.links.items()}
    # A partial index does not hold every row; an index led by another column does not give the unit's order.
    assert indexed == {"stays_indexed": True, "stays_partial": False, "stays_second": False, "stays_plain": False}


@pytest.mark.parametrize("statement", STATEMENTS)
def test_people_are_counted_in_the_index_s_order_with_the_same_answer(owner: psycopg.Connection,
                                                                      statement: str) -> None:
    ordered = reporter_sql(owner, statement.format(table="stays_indexed"))
    plain = reporter_sql(owner, statement.format(table="stays_plain"))
    assert ORDERED in ordered and ORDERED not in plain
    assert ordered.replace("stays_indexed", "stays_plain").replace("GROUP BY 1 ORDER BY 1", "GROUP BY 1") == plain
    rows, details, error = run_as_service(owner, ordered)
    assert error is None, error
    # Every group holds thousands of people: released as PostgreSQL answers the client's statement.
    truth = owner.execute(statement.format(table="stays_indexed")).fetchall()
    assert sorted_rows(rows) == sorted_rows(truth)
    plain_rows, plain_details, _ = run_as_service(owner, plain)
    assert sorted_rows(plain_rows) == sorted_rows(rows)
    assert [d.replace("stays_indexed", "stays_plain") for d in details] == plain_details  # the report names the table
