"""Knex's query builder and the Sequelize, Drizzle and TypeORM ORMs over node-postgres, through the real gated proxy
(tests/clients/node_builders/orms.js, the packages pinned in its package.json and installed by npm ci).

Each library's connection start-up (Sequelize's ``SET client_min_messages``/``SET TIME ZONE`` and its pg_type
reads), its introspection (Knex's hasTable and columnInfo, Sequelize's showAllTables and describeTable), and what an
application's dashboard asks of ``public.adult`` and the linked ``public.visits``: counts by one and two columns,
``whereIn``, ``whereBetween(...).first()``, sums, averages, a distinct count, ``havingRaw`` with a binding, top-N, a
join, a bound monthly range; Sequelize's ``count({group})``, ``findAll`` with ``fn('COUNT', col('id'))``,
``Op.between``/``Op.in``/``Op.iLike``, ``sum``, an ``include`` counted distinct, ``date_trunc`` by month; Drizzle's
``select({..., n: count()}).groupBy()`` with ``inArray``, ``and(eq, gte, lt)``, ``ilike``, ``db.$count``, ``sum``,
``avg``, ``countDistinct``, ``sql`` FILTER and CASE templates with bound values, ``limit`` (bound: ``LIMIT $1``),
``having(gt(n, 500))``, ``between`` dates, ``innerJoin``; TypeORM's data source start-up (``SELECT version()``,
``current_schema()``), ``queryRunner.hasTable``/``getTable`` (information_schema and pg_catalog reads), query
builders' ``getRawMany``/``getRawOne`` (grouped counts, ``IN (:...list)``, ``BETWEEN``, a CASE sum with a parameter,
``limit``, ``having`` with a parameter, ``date_trunc`` grouped by its alias, ``innerJoin`` of the relation), and
``countBy`` (with ``ILike``, ``Not(IsNull())``), ``sum``, ``average``; and what reads rows or an extreme (``max``,
``first()`` of rows, ``findAll`` of rows, Drizzle's ``select()`` of rows, TypeORM's ``maximum``, ``find``,
``findOneBy``):

- as ``dba`` (direct): the same results through the proxy as from PostgreSQL itself;
- as ``reporter`` (suppress, k = 10, a suppressed-rest row): catalog reads are PostgreSQL's answer for the role
  (``-c role=reporter`` on a direct connection); counts by groups release exactly the groups the suppression oracle
  (tests/suppression_oracle.py) releases, with PostgreSQL's counts, and the rest row when it releases it; the other
  aggregates (every group holds thousands of people) are PostgreSQL's answer; the rest is refused with a hint;
- as a dp role: catalog reads as PostgreSQL answers the role; aggregates answered with the library's field names,
  groups of the columns' public domains (the big ones all present), counts of people near PostgreSQL's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from bi_builders import run
from conftest import Endpoint, fresh_dp_role
from suppression_oracle import suppress

from anonproxy.embedded import EmbeddedPostgres

DP_ROLE = "node_orm_analyst"
REFUSAL_STATES = ("42501", "0A000")
K = 10  # the demo reporter's
POLICY = Path(__file__).parent.parent / "anonproxy" / "data" / "demo_policy.yaml"
Steps = dict[str, dict[str, Any]]


def _by_id(steps: list[dict[str, Any]]) -> Steps:
    return {step["id"]: step for step in steps}


@pytest.fixture(scope="module")
def runs(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[dict[str, Steps]]:
    """orms.js's steps on each connection: ``truth`` (PostgreSQL, superuser), ``as_<role>`` (PostgreSQL under
    ``-c role=<role>``), and ``dba``, ``reporter`` and the dp role through the proxy."""
    superuser = (pg_server.host, pg_server.port, gated_database, pg_server.superuser, pg_server.password)
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, DP_ROLE, epsilon=1000, delta=0.5):
        results = {"truth": _by_id(run(*superuser, script="orms.js"))}
        for role in ("dba", "reporter", DP_ROLE):
            results[f"as_{role}"] = _by_id(run(*superuser, script="orms.js", options=f"-c role={role}"))
        for role in ("dba", "reporter", DP_ROLE):
            results[role] = _by_id(run(gated_proxy.host, gated_proxy.port, gated_database, role, role,
                                       script="orms.js"))
        yield results


def _rows(result: Any) -> list[dict[str, Any]]:
    """A library's result as rows: a list of objects, one object (first(), describeTable), or a scalar."""
    if isinstance(result, list):
        return [row if isinstance(row, dict) else {"value": row} for row in result]
    return [result] if isinstance(result, dict) else [{"value": result}]


def _outcome(step: dict[str, Any]) -> Any:
    return step.get("rows", step.get("error"))


def _refused_cleanly(step: dict[str, Any]) -> None:
    """Refused with 42501 or 0A000, the message naming what, a hint saying what is allowed."""
    error = step.get("error")
    assert error is not None, f"{step['id']} answered: {step.get('rows')}"
    assert error["code"] in REFUSAL_STATES and step["refusal"] in error["message"], error
    assert error["hint"] and ("allowed" in error["hint"].lower() or "aggregate" in error["hint"].lower()), error


def _key(row: dict[str, Any], step: dict[str, Any]) -> Any:
    values = tuple(row[name] for name in step["keys"])
    return values if len(values) > 1 else values[0]


def _released_as_oracle(step: dict[str, Any], truth: dict[str, Any], everyone: int) -> None:
    """Counts of people by groups of public.adult (one row per person): the oracle's released groups with
    PostgreSQL's rows, and the rest row (its key NULL) exactly when the oracle releases it."""
    count = step["count"]
    exact = {_key(row, step): row for row in _rows(truth["rows"])}
    verdict = suppress({key: int(row[count]) for key, row in exact.items()}, k=K, everyone=everyone, rest=True)
    got = _rows(step["rows"])
    rest = [row for row in got if _key(row, step) in (None, (None,) * len(step["keys"]))]
    assert {_key(row, step): row for row in got if row not in rest} == {key: exact[key] for key in verdict.released}
    assert len(rest) == int(verdict.rest), (got, verdict)
    if rest:
        assert int(rest[0][count]) == sum(int(exact[key][count]) for key in verdict.withheld)


def _ids(kind: str | None = None) -> list[str]:
    """The step ids of orms.js (read from its source, so that each is a test of its own)."""
    source = (Path(__file__).parent / "clients" / "node_builders" / "orms.js").read_text()
    ids = []
    for line in source.splitlines():
        parts = line.strip().split('"')
        if line.strip().startswith('["') and len(parts) > 5 and (kind is None or parts[5] == kind):
            ids.append(parts[3])
    return ids


@pytest.mark.parametrize("step_id", _ids())
def test_direct_role_gets_what_postgresql_gives(step_id: str, runs: dict[str, Steps]) -> None:
    """dba through the proxy gets what dba gets from PostgreSQL (not the superuser's catalog answers: Sequelize's
    describeTable reads information_schema.table_constraints, which shows a non-owner no primary key)."""
    through, truth = runs["dba"][step_id], runs["as_dba"][step_id]
    assert "error" not in through and "error" not in truth, (through, truth)
    assert through["rows"] == truth["rows"]


@pytest.mark.parametrize("step_id", _ids())
def test_reporter_gets_what_suppression_releases(step_id: str, runs: dict[str, Steps]) -> None:
    step, truth = runs["reporter"][step_id], runs["truth"][step_id]
    if step["kind"] == "refused":
        _refused_cleanly(step)
        return
    assert "error" not in step, step
    if step["kind"] == "catalog":
        assert step["rows"] == _outcome(runs["as_reporter"][step_id])
    elif step["kind"] == "exact":
        assert step["rows"] == truth["rows"]
    else:
        _released_as_oracle(step, truth, _everyone(runs))


def _everyone(runs: dict[str, Steps]) -> int:
    """N, the people of public.adult: Knex's grouped counts by education added up (every value is in a group)."""
    return sum(int(row["n"]) for row in runs["truth"]["kx-count-group"]["rows"])


@pytest.mark.parametrize("step_id", _ids())
def test_dp_role_gets_noisy_aggregates_of_the_same_shape(step_id: str, runs: dict[str, Steps]) -> None:
    step, truth = runs[DP_ROLE][step_id], runs["truth"][step_id]
    if step["kind"] == "refused":
        _refused_cleanly(step)
        return
    assert "error" not in step, step
    if step["kind"] == "catalog":
        assert step["rows"] == _outcome(runs[f"as_{DP_ROLE}"][step_id])
        return
    got, exact = _rows(step["rows"]), _rows(truth["rows"])
    assert got and {tuple(row) for row in got} == {tuple(exact[0])}, (got, exact)
    if step["keys"]:
        domains = yaml.safe_load(POLICY.read_text())["tables"]["public.adult"]["columns"]
        assert all(row[name] in domains[name]["domain"] for row in got for name in step["keys"]), got
        big = {_key(row, step) for row in exact if int(row[step["count"]]) >= 1000}
        assert big <= {_key(row, step) for row in got}
    if step["per_person"] and step["count"]:
        _counts_near(step, got, exact)


def _counts_near(step: dict[str, Any], got: list[dict[str, Any]], exact: list[dict[str, Any]]) -> None:
    """Counts of people (the step's ``count`` field) of a thousand or more within 5 % of PostgreSQL's (ε 0.5's
    noise on a count is a few units)."""
    name = step["count"]
    truth = {_key(row, step) if step["keys"] else (): row for row in exact}
    for row in got:
        match = truth.get(_key(row, step) if step["keys"] else ())
        if match is not None and int(match[name]) >= 1000:
            assert math.isclose(float(row[name]), float(match[name]), rel_tol=0.05), (row, match)
