"""Superset's series limit in dp mode over a key with a declared public domain, and an outer LIMIT.

The second question (the chart, restricted to the keys the first one released) lists every value of a declared
domain, released or not; its rows are then kept only for the released keys. The outer query's ORDER BY, OFFSET and
LIMIT must apply after that filter: a LIMIT smaller than the domain would otherwise pick unreleased keys first and
return fewer rows than asked.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

TOP = ("SELECT education AS education__, count(*) AS mme_inner__ FROM public.adult GROUP BY education "
       "ORDER BY mme_inner__ DESC LIMIT {top}")
SERIES = ("SELECT education AS education, count(*) AS count FROM public.adult JOIN (" + TOP + ") AS series_limit "
          "ON education = series_limit.education__ GROUP BY education ORDER BY {order} LIMIT {limit}{offset}")


@pytest.fixture(scope="module")
def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_series_domain", epsilon=100) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        yield conn


def top_keys(truth: psycopg.Connection, top: int) -> set[str]:
    rows = truth.execute(f"select education from adult group by 1 order by count(*) desc limit {top}").fetchall()
    return {education for (education,) in rows}


# Ascending orders put the domain's empty (unreleased) groups first: a LIMIT before the filter keeps none of them.
@pytest.mark.parametrize("order", ["count ASC", "education ASC", "education DESC", "count DESC"])
def test_the_limit_counts_released_rows(analyst: psycopg.Connection, truth: psycopg.Connection, order: str) -> None:
    rows = analyst.execute(SERIES.format(top=5, order=order, limit=3, offset="")).fetchall()
    assert len(rows) == 3, rows
    released = top_keys(truth, 5)  # the five largest education groups are far apart: the noisy top 5 is theirs
    assert {education for education, _ in rows} <= released, rows
    if order.startswith("education"):
        expected = sorted(released, reverse=order.endswith("DESC"))[:3]
        assert [education for education, _ in rows] == expected


def test_offset_and_limit_page_through_the_released_rows(analyst: psycopg.Connection,
                                                         truth: psycopg.Connection) -> None:
    pages = [analyst.execute(SERIES.format(top=5, order="education", limit=2, offset=f" OFFSET {offset}")).fetchall()
             for offset in (0, 2, 4)]
    assert [education for page in pages for education, _ in page] == sorted(top_keys(truth, 5))
    assert [len(page) for page in pages] == [2, 2, 1]


def test_a_limit_beyond_the_released_keys_returns_them_all(analyst: psycopg.Connection,
                                                           truth: psycopg.Connection) -> None:
    rows = analyst.execute(SERIES.format(top=4, order="education", limit=100, offset="")).fetchall()
    assert [education for education, _ in rows] == sorted(top_keys(truth, 4))
