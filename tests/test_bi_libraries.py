"""Analysts' and application developers' libraries, run for real through the gated proxy (tests/bi_libraries.py).

pandas (read_sql over SQLAlchemy and over a psycopg connection, read_sql_table), Polars (read_database), Ibis
(list_tables, get_schema, group_by/aggregate, topk, time buckets, a window over groups) and Peewee (introspection,
ORM aggregates, date_trunc and EXTRACT, a join to the linked table, a bound HAVING) each run their steps:

- as ``dba`` (direct): what the library returns through the proxy equals what it returns connected to PostgreSQL
  itself;
- as ``reporter`` (suppress) and a dp analyst with a budget of its own: every catalog and aggregate step is
  answered; every row-level step is refused with 42501 or 0A000, a message and a hint.

The SQL these steps send is in the corpus (tests/bi_corpus/<library>.yaml), which test_bi_corpus replays.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from bi_libraries import LIBRARIES, Library, opened, psycopg_error
from conftest import Endpoint, fresh_dp_role

from anonproxy.embedded import EmbeddedPostgres

REFUSAL_STATES = ("42501", "0A000")
DP_ROLE = "library_analyst"


def outcomes(library: Library, url: str) -> dict[str, object]:
    """Each step's result, or the psycopg error it raised."""
    results: dict[str, object] = {}
    with opened(library, url) as handle:
        for step in library.steps:
            try:
                results[step.id] = step.run(handle)
            except Exception as error:
                cause = psycopg_error(error)
                if cause is None:
                    raise
                results[step.id] = cause
    return results


@pytest.fixture(scope="module")
def analyst(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A dp role with enough budget for every step of every library (ε 0.5 each)."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=100, delta=0.001) as role:
        yield role


@pytest.mark.timeout(600)
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda library: library.tool)
def test_direct_role_gets_what_postgresql_gives(library: Library, pg_server: EmbeddedPostgres,
                                                gated_proxy: Endpoint, gated_database: str) -> None:
    server = f"postgresql://{pg_server.superuser}:{pg_server.password}@{pg_server.host}:{pg_server.port}/" \
             f"{gated_database}"
    through_proxy = outcomes(library, gated_proxy.url(gated_database, user="dba"))
    assert not [step for step, result in through_proxy.items() if isinstance(result, psycopg.Error)], through_proxy
    assert through_proxy == outcomes(library, server)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["reporter", DP_ROLE])
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda library: library.tool)
def test_gated_roles_get_aggregates_and_no_rows(library: Library, role: str, analyst: str, gated_proxy: Endpoint,
                                                gated_database: str) -> None:
    results = outcomes(library, gated_proxy.url(gated_database, user=role))
    failures = []
    for step in library.steps:
        result = results[step.id]
        refused = isinstance(result, psycopg.Error)
        if step.kind != "row-level" and refused:
            failures.append(f"{step.id} ({step.kind}) refused: {result.sqlstate} {result.diag.message_primary}")
        elif step.kind == "row-level" and not refused:
            failures.append(f"{step.id}: row-level step answered")
        elif step.kind == "row-level" and isinstance(result, psycopg.Error) and (
                result.sqlstate not in REFUSAL_STATES or not result.diag.message_primary
                or not result.diag.message_hint):
            failures.append(f"{step.id}: not a clean refusal: {result.sqlstate} {result.diag.message_primary} "
                            f"(hint: {result.diag.message_hint})")
    assert not failures, "\n".join(failures)
