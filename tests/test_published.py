"""Published relations: anonymized releases that suppress and dp roles read row by row through the proxy.

Through the real gated proxy (tests/conftest.py): `reporter` is in mode suppress, `analyst` in mode dp. The
release here is a small anonymized table made from adult (age by decade, sex; groups of at least 10 people).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import PublishedRelation
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import (
    PolicyApplyError,
    apply_policy,
    demo_policy,
    parse_policy,
)
from anonproxy.route.decide import decide
from anonproxy.route.decision import Pass

RELEASE = "public.adult_by_decade"
DEMO_POLICY_TEXT = (Path(__file__).parents[1] / "anonproxy" / "data" / "demo_policy.yaml").read_text()


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """The owner of the gated database's tables (a superuser), in autocommit mode."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        yield conn


@pytest.fixture
def release(owner: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A small anonymized table; afterwards the demo policy is back in force and the table is gone."""
    owner.execute(f"""
        create table {RELEASE} as
        select (age / 10 * 10) || '-' || (age / 10 * 10 + 9) as age, sex, count(*) as people
          from public.adult group by 1, 2 having count(*) >= 10
    """)
    try:
        yield RELEASE
    finally:
        apply_and_wait(owner, gated_proxy, gated_database, DEMO_POLICY_TEXT)
        owner.execute(f"drop table {RELEASE} cascade")


def apply_and_wait(owner: psycopg.Connection[Any], proxy: Endpoint, dbname: str, text: str) -> None:
    """Apply a YAML policy to the gated database and wait until the proxy has loaded it."""
    wait_for_policy(proxy, dbname, apply_policy(owner, parse_policy(text)))


def published_to(*roles: str, relation: str = RELEASE) -> str:
    """The demo policy with ``relation`` published to ``roles``."""
    return DEMO_POLICY_TEXT + f"published:\n  {relation}: {{roles: [{', '.join(roles)}]}}\n"


def rows(proxy: Endpoint, dbname: str, user: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(proxy.dsn(dbname, user=user), autocommit=True) as conn:
        return conn.execute(query).fetchall()


def refusal(proxy: Endpoint, dbname: str, user: str, query: str) -> psycopg.Error:
    with psycopg.connect(proxy.dsn(dbname, user=user), autocommit=True) as conn, \
            pytest.raises(psycopg.Error) as caught:
        conn.execute(query)
    return caught.value


# Through the proxy ------------------------------------------------------------------


def test_a_published_release_is_read_row_by_row(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                gated_database: str, release: str) -> None:
    query = f"select age, sex, people from {release} order by age, sex"
    truth = owner.execute(query).fetchall()
    assert len(truth) > 10 and min(people for _, _, people in truth) >= 10  # the release itself, read as its owner

    # Not published: the proxy passes the query (it reads no protected table) and PostgreSQL refuses.
    for user in ("reporter", "analyst"):
        error = refusal(gated_proxy, gated_database, user, query)
        assert error.sqlstate == "42501" and f"permission denied for table {release.split('.')[1]}" in str(error)

    apply_and_wait(owner, gated_proxy, gated_database, published_to("reporter", "analyst"))
    assert load_policy(owner).published == {release: PublishedRelation(release, ("reporter", "analyst"))}
    for user in ("reporter", "analyst"):
        assert rows(gated_proxy, gated_database, user, query) == truth, user
        # Row-level: filters, single rows, no suppression and no noise; the extended protocol too.
        assert rows(gated_proxy, gated_database, user, f"select * from {release} where age = '30-39' and sex = 'Male'"
                    ) == [row for row in truth if row[:2] == ("30-39", "Male")]
        with psycopg.connect(gated_proxy.dsn(gated_database, user=user), autocommit=True) as conn:
            assert conn.execute(f"select * from {release} where sex = %s order by age", ["Female"]).fetchall() == \
                [row for row in truth if row[1] == "Female"]


def test_a_release_is_readable_only_by_the_roles_it_is_published_to(owner: psycopg.Connection[Any],
                                                                    gated_proxy: Endpoint, gated_database: str,
                                                                    release: str) -> None:
    apply_and_wait(owner, gated_proxy, gated_database, published_to("analyst"))
    assert rows(gated_proxy, gated_database, "analyst", f"select count(*) from {release}") == \
        owner.execute(f"select count(*) from {release}").fetchall()
    assert refusal(gated_proxy, gated_database, "reporter", f"select * from {release}").sqlstate == "42501"

    # Unpublished again (the demo policy has no published relations): the grant is taken back.
    apply_and_wait(owner, gated_proxy, gated_database, DEMO_POLICY_TEXT)
    assert refusal(gated_proxy, gated_database, "analyst", f"select * from {release}").sqlstate == "42501"


@pytest.mark.parametrize("user", ["reporter", "analyst"])
def test_a_release_joined_with_protected_data_is_refused(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                         gated_database: str, release: str, user: str) -> None:
    apply_and_wait(owner, gated_proxy, gated_database, published_to("reporter", "analyst"))
    for query in [
        f"select r.age, count(*) from adult a join {release} r on r.sex = a.sex group by r.age",
        "select sex, count(*) from adult where sex in (select sex from adult_by_decade) group by sex",
    ]:
        error = refusal(gated_proxy, gated_database, user, query)
        assert error.sqlstate == "42501", (query, error)
        assert error.diag.message_primary is not None
        assert error.diag.message_primary.startswith("the statement reads published relation "), error
        assert "together with protected tables" in error.diag.message_primary
    with psycopg.connect(gated_proxy.dsn(gated_database, user=user), autocommit=True) as conn, \
            pytest.raises(psycopg.errors.InsufficientPrivilege, match="reads published relation"):
        conn.execute(f"select r.age, count(*) from adult a join {release} r on r.sex = a.sex where a.age > %s "
                     "group by r.age", [30])  # extended protocol
    # Each on its own is answered.
    assert rows(gated_proxy, gated_database, user, f"select count(*) from {release}")


def test_a_view_over_protected_data_cannot_be_published(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                        gated_database: str, release: str) -> None:
    owner.execute("create view public.adult_ages as select age, sex from public.adult")
    try:
        before = load_policy(owner)
        with pytest.raises(PolicyApplyError) as caught:
            apply_policy(owner, parse_policy(published_to("reporter", relation="public.adult_ages")))
        assert caught.value.problems[0] == ("published.public.adult_ages: published relation public.adult_ages "
                                            "reads protected table public.adult (SQLSTATE 42501)")
        assert load_policy(owner) == before  # nothing changed
        assert refusal(gated_proxy, gated_database, "reporter", "select * from adult_ages").sqlstate == "42501"
    finally:
        owner.execute("drop view public.adult_ages")


def test_a_release_of_create_anonymized_view_is_published_as_is(owner: psycopg.Connection[Any],
                                                                gated_proxy: Endpoint, gated_database: str) -> None:
    target = "public.adult_k10_published"
    notices: list[str] = []
    owner.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
    owner.execute("select anonproxy.create_anonymized_view(source => 'public.adult', target => %s, "
                  "quasi_identifiers => array['age', 'sex'], k => 10, method => 'mondrian')", (target,))
    try:
        notices.clear()
        apply_and_wait(owner, gated_proxy, gated_database, published_to("reporter", relation=target))
        assert not [n for n in notices if "is not a release" in n]  # a registered release: nothing to vouch for
        query = f"select age, sex from {target} order by 1, 2"
        seen = rows(gated_proxy, gated_database, "reporter", query)
        assert seen == owner.execute(query).fetchall() and len(seen) == 30162
        # What the reporter reads row by row is 10-anonymous (counted here, not taken from the registry).
        classes: dict[tuple[Any, ...], int] = {}
        for row in seen:
            classes[row] = classes.get(row, 0) + 1
        assert min(classes.values()) >= 10

        # A table the registry does not know can be published too, with a NOTICE: the DBA vouches for it.
        owner.execute(f"create table public.hand_made as table {target}")
        notices.clear()
        apply_policy(owner, parse_policy(published_to("reporter", relation="public.hand_made")))
        assert notices == [("public.hand_made is not a release in anonproxy.releases; publishing it vouches that it "
                            "holds anonymized data only")]
    finally:
        apply_and_wait(owner, gated_proxy, gated_database, DEMO_POLICY_TEXT)
        owner.execute("drop table if exists public.hand_made")
        owner.execute("select anonproxy.drop_release(%s)", (target,))


# The decision, without the proxy -------------------------------------------------------


POLICY = dataclasses.replace(
    demo_policy(), published={RELEASE: PublishedRelation(RELEASE, ("reporter", "analyst"))})


@pytest.mark.parametrize("query", [
    "select * from adult_by_decade",
    "select age, sum(people) from public.adult_by_decade where sex = 'Female' group by age",
    "with r as (select * from adult_by_decade) select * from r",
    "select count(*) from adult_by_decade a join pg_catalog.pg_class c on false",
])
def test_queries_over_published_relations_only_pass(query: str) -> None:
    for role in ("reporter", "analyst"):
        assert decide(query, POLICY.role(role), POLICY) == Pass()


@pytest.mark.parametrize("query", [
    "select a.sex, count(*) from adult a join adult_by_decade r on a.sex = r.sex group by 1",
    "select sex, count(*) from adult where sex in (select sex from public.adult_by_decade) group by sex",
    "select sex, count(*) from adult a, lateral (select 1 from adult_by_decade) r group by sex",
    "select sex, count(*) from adult group by sex union all select sex, people from adult_by_decade",
])
def test_queries_mixing_published_and_protected_are_refused(query: str) -> None:
    for role in ("reporter", "analyst"):
        decision = decide(query, POLICY.role(role), POLICY)
        assert isinstance(decision, Reject) and decision.sqlstate == "42501", (role, decision)
        assert decision.message.startswith("the statement reads published relation"), decision


def test_a_relation_of_the_same_name_in_another_schema_is_not_published() -> None:
    # other.adult_by_decade is an ordinary table, not the release: joined to adult it is refused as a relation
    # outside the policy (issue 10; the rewriter used to join it), not as a published relation.
    query = "select a.sex, count(*) from adult a join other.adult_by_decade r on a.sex = r.sex group by 1"
    decision = decide(query, POLICY.role("reporter"), POLICY)
    assert isinstance(decision, Reject) and decision.sqlstate == "42501", decision
    assert decision.message.startswith("relation other.adult_by_decade is not part of the privacy policy"), decision
