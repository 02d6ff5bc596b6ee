"""Column labels after AS: every keyword PostgreSQL accepts there (its ColLabel), reserved ones included.

The keyword list is PostgreSQL's own (pg_get_keywords() on the test server). Each keyword is tried as a label
in a passed statement and in a gated one (suppress and dp), decided by the classifier and planner; a sample
of them runs through the real proxy, where the answers' column names must be the folded keywords.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from test_rewrite import POLICY, SUPPRESS

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.statements import split
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Pass, Rewrite

DP = dataclasses.replace(SUPPRESS, mode="dp")


@pytest.fixture(scope="module")
def keywords(pg_server: EmbeddedPostgres) -> Iterator[list[str]]:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        words = [row[0] for row in conn.execute("select word from pg_get_keywords() order by word")]
    assert len(words) > 400 and {"select", "from", "union", "all", "table", "order"} <= set(words)
    yield words


def test_postgresql_accepts_every_keyword_as_a_label(pg_server: EmbeddedPostgres, keywords: list[str]) -> None:
    """The premise: after AS, any keyword is a label for PostgreSQL."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        for word in keywords:
            assert conn.execute(f"select 1 as {word}").description[0].name == word


def test_every_keyword_label_passes_in_a_catalog_query(keywords: list[str]) -> None:
    for role in (SUPPRESS, DP):
        for word in keywords:
            for text in (f"select 1 as {word}", f"select relname as {word.upper()}, 2 as x from pg_class",
                         f"select (select 1 as {word}) as {word}"):
                assert decide(text, role, POLICY) == Pass(), (role.mode, text)


def test_every_keyword_label_is_gated(keywords: list[str]) -> None:
    for word in keywords:
        text = f"select education as {word}, count(*) as {word}_n from adult group by education"
        assert isinstance(decide(text, SUPPRESS, POLICY), Rewrite), text
        noisy = decide(text, DP, POLICY)
        assert isinstance(noisy, Noisy), text
        plan = plan_dp(noisy.sql, DP, POLICY, DPParams(epsilon=1, delta=1e-6))
        assert isinstance(plan, DPPlan), (text, plan)
        assert [column.name for column in plan.columns] == [word, f"{word}_n"]


def test_as_elsewhere_is_not_a_label() -> None:
    """Type names in casts, table aliases and window definitions stay what they are."""
    statement = split("select cast(x as int) as int, y from t as u window w as (order by y)")[0]
    kinds = [(token.token_type.name, token.text) for token in statement.tokens]
    assert kinds[4:6] == [("ALIAS", "as"), ("INT", "int")]  # cast(x AS int)
    assert kinds[7:9] == [("ALIAS", "as"), ("IDENTIFIER", "int")]  # ... AS int (the label)
    assert kinds[13:15] == [("ALIAS", "as"), ("VAR", "u")]  # a table alias
    assert kinds[16:19] == [("VAR", "w"), ("ALIAS", "as"), ("L_PAREN", "(")]  # a window definition
    # PostgreSQL refuses a reserved word as a table alias; so does the classifier (not read as a label).
    assert decide("select 1 from pg_class as select", SUPPRESS, POLICY) != Pass()


@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_labels_through_the_proxy(gated_proxy: Endpoint, gated_database: str, role: str) -> None:
    words = ["select", "from", "union", "all", "table", "order", "limit", "for", "insert", "user", "with", "case"]
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        cursor = conn.execute(", ".join(f"select 1 as {w}" if i == 0 else f"{i + 1} as {w}" for i, w in
                                        enumerate(words)))
        assert [column.name for column in cursor.description] == words
        cursor = conn.execute("select education as select, count(*) as from from adult group by education "
                              "order by 1")
        assert [column.name for column in cursor.description] == ["select", "from"]
        assert len(cursor.fetchall()) > 5


def test_the_word_unknown(gated_proxy: Endpoint, gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """`unknown` is a keyword (`IS [NOT] UNKNOWN`), not an unexpected character: a label, and a total predicate
    in a gated statement, answered as PostgreSQL computes it."""
    query = "select sex, count(*) as unknown from adult where (age > 40) is not unknown group by sex order by sex"
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        cursor = conn.execute(query)
        got = cursor.fetchall()
        assert [column.name for column in cursor.description] == ["sex", "unknown"]
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        assert got == conn.execute(query).fetchall()


@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_group_by_names_resolve_as_in_postgresql(gated_proxy: Endpoint, gated_database: str, mode: str,
                                                 truth: psycopg.Connection) -> None:
    """A bare GROUP BY name is a column of a FROM table if one has it, else an output alias; a column named bare
    and qualified is one expression. Each statement is answered with the groups PostgreSQL forms."""
    with contextlib.ExitStack() as stack:
        role = "reporter" if mode == "suppress" else stack.enter_context(
            fresh_dp_role(truth, gated_proxy, gated_database, "dp_group_names", epsilon=10))
        _group_by_names(gated_proxy, gated_database, role, truth)


def _group_by_names(gated_proxy: Endpoint, gated_database: str, role: str, truth: psycopg.Connection) -> None:
    sexes = {row[0] for row in truth.execute("select sex from adult group by sex")}
    educations = {row[0] for row in truth.execute("select education from adult group by education")}
    answered = {
        'select sex as "Sex", count(*) as "Count" from adult group by "Sex"': sexes,
        "select education as degree, count(*) from adult group by degree order by degree": educations,
        "select sex, count(*) from public.adult as a group by a.sex": sexes,
        "select a.sex, count(*) from public.adult a group by sex order by sex": sexes,
        "select a.education, count(*) as n from adult a group by education order by a.education desc": educations,
        'select "public"."adult"."sex" as sex, count(*) from "public"."adult" group by sex': sexes,
    }
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        for sql, groups in answered.items():
            rows = conn.execute(sql).fetchall()
            assert {row[0] for row in rows} <= groups and len(rows) >= len(groups) - 2, sql  # small ones may go
        descending = conn.execute("select a.education, count(*) as n from adult a group by education "
                                  "order by a.education desc").fetchall()
        assert [row[0] for row in descending] == sorted((row[0] for row in descending), reverse=True)
        # An output alias of an aggregate is not a grouping expression (PostgreSQL refuses it too).
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="GROUP BY n must name a column expression"):
            conn.execute("select count(*) as n, sex from adult group by n")
