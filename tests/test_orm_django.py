"""Django's ORM (5.2, psycopg 3, ``USE_TZ=True``) through the real gated proxy (tests/orm_django.py).

Django's connection start-up, its introspection (``get_table_list``, ``inspectdb``) and what an application or admin
dashboard asks of ``public.adult`` and the linked ``public.visits``: counts by one and two columns, filtered by
equality, range, IN, ``icontains``/``istartswith``, ``isnull``; several aggregates at once, a distinct count,
``Count(filter=Q(...))`` and ``Sum(Case(When(...)))``, top-N, ``values().annotate().filter()`` (HAVING), subqueries
(``id__in`` and ``Subquery(OuterRef)`` averaged), ``distinct().values_list(flat=True)``, ``TruncMonth`` and
``ExtractYear`` in Europe/Paris, a date range, joins both ways; and calls that read rows (``exists()``,
``first()``, a slice of values):

- as ``dba`` (direct): what Django returns through the proxy equals what it returns from PostgreSQL itself;
- as ``reporter`` (suppress, k = 10, a suppressed-rest row): catalog reads are PostgreSQL's answer for the role;
  grouped counts of people release exactly the groups the suppression oracle (tests/suppression_oracle.py)
  releases, with PostgreSQL's counts, and the rest row when the oracle releases it; the other aggregates (every
  group holds thousands of people) are PostgreSQL's answer; row reads are refused with a hint;
- as a dp role: catalog reads as PostgreSQL answers the role; aggregates answered with Django's field names, groups
  of the columns' public domains (the big ones all present), counts near PostgreSQL's; row reads refused.

The gated roles run every step twice: with Django's default client-side binding (values inlined by psycopg) and
with ``server_side_binding`` ($n parameters). Refused before this round: ``id__in`` (Django 5 names the subquery's
column, ``U0."person_id" AS "person_id"``: anonproxy/plan/semi_joins.py) and, with server-side binding,
``Sum(Case(When(..., then=1), default=0))`` (the values added up are bound: anonproxy/plan/bind_values.py).
Min/Max, ``exists()``, ``first()``, row slices, inspectdb's one-row read and a Subquery(OuterRef) per person stay
refused (docs/bi-tools.md, "ORMs run for real"); ``annotate(n=Count('visits')).aggregate(Avg('n'))``, answered
before over the suppressed-rest row alone (a misleading 90242.0 as reporter, NULL as a dp role), is now refused:
its inner query is grouped by the privacy unit adult.id (anonproxy/plan/unit_groups.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from orm_answers import group_key, groups_of_public_domains
from orm_django import STEPS, Rows, Step, configure, database
from suppression_oracle import suppress

from anonproxy.embedded import EmbeddedPostgres

DP_ROLE = "django_analyst"
REFUSAL_STATES = ("42501", "0A000")
K = 10  # the demo reporter's


@pytest.fixture(scope="module")
def aliases(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """Django configured with the connections of the module: through the proxy as dba, reporter and the dp role;
    directly as the superuser, and as each gated role (``-c role=...``) for PostgreSQL's own catalog answers."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=1000, delta=0.5):
        superuser = (pg_server.host, pg_server.port, gated_database, pg_server.superuser, pg_server.password)
        configure({
            "default": database(*superuser),
            **{role: database(gated_proxy.host, gated_proxy.port, gated_database, role, role)
               for role in ("dba", "reporter", DP_ROLE)},
            **{f"{role}_bound": database(gated_proxy.host, gated_proxy.port, gated_database, role, role,
                                         server_side_binding=True) for role in ("reporter", DP_ROLE)},
            **{f"as_{role}": database(*superuser, options=f"-c role={role}") for role in ("reporter", DP_ROLE)},
        })
        yield
        from django.db import connections

        connections.close_all()


def outcome(step: Step, alias: str) -> Rows | psycopg.Error:
    """The step's rows on ``alias``, or the PostgreSQL error (from the proxy) that Django raised."""
    from django.db import Error

    try:
        return step.run(alias)
    except Error as error:
        assert isinstance(error.__cause__, psycopg.Error), error
        return error.__cause__


def _describe(result: Rows | psycopg.Error) -> str:
    if isinstance(result, psycopg.Error):
        return f"{result.sqlstate} {result.diag.message_primary} (hint: {result.diag.message_hint})"
    return repr(result)[:500]


@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_direct_role_gets_what_postgresql_gives(step: Step, aliases: None) -> None:
    if step.kind == "refused":
        assert outcome(step, "dba") == outcome(step, "default")
        return
    through = outcome(step, "dba")
    assert not isinstance(through, psycopg.Error), _describe(through)
    assert through == outcome(step, "default")


def _refused_cleanly(step: Step, result: Rows | psycopg.Error) -> None:
    """Refused with 42501 or 0A000, the message naming what (``step.refusal``), a hint of what is allowed."""
    assert isinstance(result, psycopg.Error), f"answered: {_describe(result)}"
    assert result.sqlstate in REFUSAL_STATES, _describe(result)
    assert step.refusal in (result.diag.message_primary or ""), _describe(result)
    assert "allowed" in (result.diag.message_hint or "").lower() or "supported" in (result.diag.message_hint or "") \
        or "aggregate" in (result.diag.message_hint or "").lower(), _describe(result)


def _sample_refused(got: Rows) -> None:
    """inspectdb's output for a gated role: each table's one-row read refused as row-level data, said so."""
    for table in ("adult", "visits"):
        assert f"# Unable to inspect table '{table}'\n# The error was: SELECT * is not allowed over protected " \
               "tables" in got[0]["models"], got


@pytest.mark.parametrize("binding", ["", "_bound"], ids=["client-binding", "server-binding"])
@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_reporter_gets_what_suppression_releases(step: Step, binding: str, aliases: None) -> None:
    got = outcome(step, f"reporter{binding}")
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, psycopg.Error), _describe(got)
    if step.kind == "row-sample":
        _sample_refused(got)
    elif step.kind == "catalog":
        assert got == outcome(step, "as_reporter")
    elif step.kind == "exact":
        assert got == outcome(step, "default")
    else:
        _released_as_oracle(step, got, outcome(step, "default"))


def _released_as_oracle(step: Step, got: Rows, truth: Rows | psycopg.Error) -> None:
    """Counts by groups: the groups the oracle releases (from each group's people, N the people of public.adult,
    every one of whom has visits) with PostgreSQL's rows, and the rest row (its key NULL) exactly when the oracle
    releases it, holding the withheld groups' count."""
    assert not isinstance(truth, psycopg.Error), _describe(truth)
    everyone = outcome(STEPS_BY_ID["dj-isnull"], "default")
    assert not isinstance(everyone, psycopg.Error)
    people: dict[Any, Any] = defaultdict(set)
    if step.people is None:  # one row per person: "n" counts people
        people = {group_key(row, step.keys): row["n"] for row in truth}
    else:
        for row in step.people("default"):
            people[group_key(row, step.keys)].add(row["person_id"])
    verdict = suppress(people, k=K, everyone=everyone[0]["count"], rest=True)
    exact = {group_key(row, step.keys): row for row in truth}
    rest = [row for row in got if group_key(row, step.keys) in (None, (None,) * len(step.keys))]
    assert {group_key(row, step.keys): row for row in got if row not in rest} == \
        {key: exact[key] for key in verdict.released}
    assert len(rest) == int(verdict.rest), (got, verdict)
    if rest and "n" in rest[0]:
        assert rest[0]["n"] == sum(exact[key]["n"] for key in verdict.withheld)


@pytest.mark.parametrize("binding", ["", "_bound"], ids=["client-binding", "server-binding"])
@pytest.mark.parametrize("step", STEPS, ids=lambda step: step.id)
def test_dp_role_gets_noisy_aggregates_of_the_same_shape(step: Step, binding: str, aliases: None) -> None:
    got = outcome(step, f"{DP_ROLE}{binding}")
    if step.kind == "refused":
        _refused_cleanly(step, got)
        return
    assert not isinstance(got, psycopg.Error), _describe(got)
    if step.kind == "row-sample":
        _sample_refused(got)
        return
    if step.kind == "catalog":
        assert got == outcome(step, f"as_{DP_ROLE}")
        return
    truth = outcome(step, "default")
    assert not isinstance(truth, psycopg.Error)
    assert got and {tuple(row) for row in got} == {tuple(truth[0])}, (got, truth)
    if step.keys:
        groups_of_public_domains(step.keys, got, truth)
    if step.per_person:
        _counts_near(got, truth)


def _counts_near(got: Rows, truth: Rows) -> None:
    """Counts of thousands of people are within 5 % of PostgreSQL's (the noise of ε 0.5 on a count of people is a
    few units; counts of visits are not compared: dp bounds each person's rows)."""
    exact = {tuple(v for v in row.values() if not isinstance(v, (int, float))): row for row in truth}
    for row in got:
        match = exact.get(tuple(v for v in row.values() if not isinstance(v, (int, float))))
        for name in ("n", "count"):
            if match is not None and name in row and match[name] >= 1000:
                assert math.isclose(row[name], match[name], rel_tol=0.05), (row, match)


STEPS_BY_ID = {step.id: step for step in STEPS}


def test_in_subquery_naming_another_column_as_the_unit_stays_refused(aliases: None) -> None:
    """The name Django gives the selected column is not what the check reads: visit_id named "person_id" is no
    privacy unit (each visit id would stand for a person)."""
    from django.db import Error, connections

    with pytest.raises(Error) as raised, connections["reporter"].cursor() as cursor:
        cursor.execute('SELECT COUNT("adult"."id") FROM "adult" WHERE "adult"."id" IN (SELECT U0."visit_id" AS '
                       '"person_id" FROM "visits" U0 WHERE U0."channel" = %s)', ["web"])
    error = raised.value.__cause__
    assert isinstance(error, psycopg.Error) and error.sqlstate == "0A000"
    assert error.diag.message_primary == "the subquery of IN must select the privacy unit column person_id of its " \
                                        "table"
