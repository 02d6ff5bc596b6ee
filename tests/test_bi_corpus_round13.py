"""Round 13 of the BI corpus: Lightdash's fan-out protection (metrics of a joined table computed over its
deduplicated keys, in CTEs joined back on the dimensions) and Superset's time shift, series limit and row limit
over grouped rows ordered by a metric, written over the demo tables in the shape each generator gives.

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the same statement; as a dp role each is answered with PostgreSQL's column names.

Superset's shapes were all answered before this round. Lightdash's fan-out CTEs were refused in this round: its
metrics CTE joins ``SELECT DISTINCT <dimensions>, <key> ...`` (``cte_keys_<table>``) back to the repeated table,
so each group's metric is over a set of distinct rows the proxy would have to prove counts each person once per
group. (Round 14 answers the keys that are the repeated table's own rows, the catalog proving its unit unique:
tests/test_bi_corpus_round14.py; round 16 answers a dimension of the joined table, as here:
tests/test_bi_corpus_round16.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import corpus_roles, dp_answers, suppress_answers_as_postgresql

# read: the fan-out CTEs cte_keys_<table>, cte_metrics_<table>, cte_unaffected and the final join
LIGHTDASH = "lightdash/lightdash packages/backend/src/utils/QueryBuilder/MetricQueryBuilder.ts (read)"
# written from memory of get_sqla_query: the series_limit inner query, its "__" aliases, the row limit
SUPERSET = "apache/superset superset/models/helpers.py get_sqla_query (from memory)"
# written from memory: the time offset query is the chart's query with the time range moved
SUPERSET_OFFSET = "apache/superset superset/common/query_context_processor.py processing_time_offsets (from memory)"

_JOIN = ("FROM \"public\".\"adult\" AS \"adult\" LEFT OUTER JOIN \"public\".\"visits\" AS \"visits\" ON "
         "(\"adult\".id) = (\"visits\".person_id)")


def _fanout(where: str = "") -> str:
    """Lightdash's fan-out protected query: by channel, the number of visits and the sum of the ages of the adults
    who visited through it, each adult (the table the one-to-many join repeats) counted once through its key."""
    return ("WITH cte_keys_adult AS (SELECT DISTINCT \"visits\".channel AS \"visits_channel\", \"adult\".id AS "
            f"\"pk_id\" {_JOIN}{where}), cte_metrics_adult AS (SELECT cte_keys_adult.\"visits_channel\", "
            "SUM(\"adult\".age) AS \"adult_total_age\" FROM cte_keys_adult LEFT JOIN \"public\".\"adult\" AS "
            "\"adult\" ON cte_keys_adult.\"pk_id\" = \"adult\".id GROUP BY 1), cte_unaffected AS (SELECT "
            f"\"visits\".channel AS \"visits_channel\", COUNT(\"visits\".visit_id) AS \"visits_count\" {_JOIN}{where} "
            "GROUP BY 1) SELECT cte_unaffected.*, cte_metrics_adult.\"adult_total_age\" AS \"adult_total_age\" FROM "
            "cte_unaffected INNER JOIN cte_metrics_adult ON ( cte_unaffected.\"visits_channel\" = "
            "cte_metrics_adult.\"visits_channel\" OR ( cte_unaffected.\"visits_channel\" IS NULL AND "
            "cte_metrics_adult.\"visits_channel\" IS NULL ) ) ORDER BY \"adult_total_age\" DESC LIMIT 500")


# Lightdash's fan-out CTEs by a dimension of visits (refused until round 16, see the module's doc)
FANOUT = [
    _fanout(),
    _fanout(" WHERE ((\"visits\".channel) IN ('web', 'app'))"),
    # round 14 answers the third statement of this round (no dimension: the keys are adult's own rows) and other
    # keys of adult's columns: tests/test_bi_corpus_round14.py
]


@dataclass(frozen=True)
class Shape:
    source: str  # the repository and file whose shape the statement follows, and whether it was read
    what: str
    sql: str
    complete: bool = True  # every group holds at least k people: suppression withholds nothing


CORPUS = [
    # what the refusal's hint asks for: the same question as one aggregate over the join, each adult counted once
    Shape(LIGHTDASH, "without fan-out CTEs: count distinct of the repeated table's key over the join",
          "SELECT \"visits\".channel AS \"visits_channel\", COUNT(\"visits\".visit_id) AS \"visits_count\", "
          "COUNT(DISTINCT \"adult\".id) AS \"adult_count\" " + _JOIN + " GROUP BY 1 ORDER BY \"adult_count\" DESC "
          "LIMIT 500"),
    Shape(SUPERSET, "series limit: the top series by a metric in a subquery joined on the dimension",
          "SELECT DATE_TRUNC('month', visited_at) AS visited_at, channel AS channel, sum(amount) AS \"SUM(amount)\" "
          "FROM public.visits JOIN (SELECT channel AS channel__, sum(amount) AS mme_inner__ FROM public.visits "
          "GROUP BY channel ORDER BY mme_inner__ DESC LIMIT 2) AS series_limit ON channel = channel__ GROUP BY "
          "DATE_TRUNC('month', visited_at), channel ORDER BY \"SUM(amount)\" DESC LIMIT 10000"),
    Shape(SUPERSET, "row limit over grouped rows ordered by a metric: LIMIT",
          "SELECT education AS education, count(*) AS count FROM public.adult GROUP BY education ORDER BY count DESC "
          "LIMIT 5"),
    # SQLAlchemy renders Superset's row limit as LIMIT for PostgreSQL; FETCH FIRST is the standard's spelling
    Shape(SUPERSET, "row limit over grouped rows ordered by a metric: FETCH FIRST",
          "SELECT education AS education, AVG(hours_per_week) AS \"AVG(hours_per_week)\" FROM public.adult GROUP BY "
          "education ORDER BY \"AVG(hours_per_week)\" DESC FETCH FIRST 5 ROWS ONLY"),
    Shape(SUPERSET_OFFSET, "time shift: the chart's query with its time range moved back a month",
          "SELECT DATE_TRUNC('day', visited_at) AS visited_at, channel AS channel, sum(amount) AS \"SUM(amount)\" "
          "FROM public.visits WHERE visited_at >= TO_TIMESTAMP('2025-02-01 00:00:00.000000', 'YYYY-MM-DD "
          "HH24:MI:SS.US') AND visited_at < TO_TIMESTAMP('2025-03-01 00:00:00.000000', 'YYYY-MM-DD HH24:MI:SS.US') "
          "GROUP BY DATE_TRUNC('day', visited_at), channel LIMIT 10000"),
    # Superset joins the shifted answer to the current one in pandas; here that join is written in SQL
    Shape(SUPERSET_OFFSET, "time comparison: the current and the shifted range joined on the dimension",
          "SELECT cur.channel, cur.\"SUM(amount)\", prev.\"SUM(amount)\" AS \"SUM(amount)__1 month ago\" FROM "
          "(SELECT channel AS channel, sum(amount) AS \"SUM(amount)\" FROM public.visits WHERE visited_at >= "
          "'2025-03-01' AND visited_at < '2025-04-01' GROUP BY channel) AS cur LEFT JOIN (SELECT channel AS "
          "channel, sum(amount) AS \"SUM(amount)\" FROM public.visits WHERE visited_at >= '2025-02-01' AND "
          "visited_at < '2025-03-01' GROUP BY channel) AS prev ON cur.channel = prev.channel"),
]


reporter, analyst = corpus_roles("dp_round13")


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.source.split()[0]}: {shape.what}" for shape in CORPUS])
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.source.split()[0]}: {shape.what}" for shape in CORPUS])
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


@pytest.mark.parametrize("sql", FANOUT, ids=["by channel", "by channel, filtered"])
def test_fanout_ctes_answered_since_round_16(sql: str, reporter: psycopg.Connection[Any],
                                             analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """Refused until round 16 (0A000, naming the DISTINCT keys subquery); now the keys by channel are rewritten to
    visits' distinct (channel, person) rows joined to adult (tests/test_bi_corpus_round16.py): as ``reporter`` the
    answer is PostgreSQL's, as a dp role it has PostgreSQL's column names."""
    suppress_answers_as_postgresql(reporter, truth, sql)
    dp_answers(analyst, truth, sql)
