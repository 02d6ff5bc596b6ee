"""Knex and Kysely over node-postgres, run for real through the gated proxy (tests/clients/node_builders).

Their introspection (Knex's hasTable and columnInfo over information_schema, Kysely's getTables over pg_catalog),
grouped counts and averages, a monthly and a daily series (the daily one with its date_trunc unit bound as $1), a
distinct count, a bound HAVING, a join to the linked table, and a row-level read each:

- as ``dba`` (direct): the same rows through the proxy as from PostgreSQL itself;
- as ``reporter`` (suppress) and a dp analyst with a budget of its own: catalog and aggregate steps answered,
  row-level steps refused with 42501 or 0A000, a message and a hint.

The SQL is in the corpus (tests/bi_corpus/knex.yaml, kysely.yaml), which test_bi_corpus replays.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from bi_builders import run
from conftest import Endpoint, fresh_dp_role

from anonproxy.embedded import EmbeddedPostgres

REFUSAL_STATES = ("42501", "0A000")
DP_ROLE = "builder_analyst"


def results(steps: list[dict[str, Any]]) -> dict[str, object]:
    return {step["id"]: step.get("rows", step.get("error")) for step in steps}


@pytest.fixture(scope="module")
def analyst(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=100, delta=0.001) as role:
        yield role


@pytest.mark.timeout(600)
def test_direct_role_gets_what_postgresql_gives(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                gated_database: str) -> None:
    through_proxy = run(gated_proxy.host, gated_proxy.port, gated_database, "dba", "dba")
    assert not [step["id"] for step in through_proxy if "error" in step], through_proxy
    server = run(pg_server.host, pg_server.port, gated_database, pg_server.superuser, pg_server.password)
    assert results(through_proxy) == results(server)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["reporter", DP_ROLE])
def test_gated_roles_get_aggregates_and_no_rows(role: str, analyst: str, gated_proxy: Endpoint,
                                                gated_database: str) -> None:
    failures = []
    for step in run(gated_proxy.host, gated_proxy.port, gated_database, role, role):
        error = step.get("error")
        if step["kind"] != "row-level" and error:
            failures.append(f"{step['id']} ({step['kind']}) refused: {error}")
        elif step["kind"] == "row-level" and not error:
            failures.append(f"{step['id']}: row-level step answered")
        elif step["kind"] == "row-level" and (error["code"] not in REFUSAL_STATES or not error["message"]
                                              or not error["hint"]):
            failures.append(f"{step['id']}: not a clean refusal: {error}")
    assert not failures, "\n".join(failures)
