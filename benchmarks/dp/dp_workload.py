"""The dp benchmark's workload: aggregate questions over public.adult, shared by both systems.

Plain Python, no third-party imports (and not named workload.py: that is the
suppress benchmark's module, which run.py also loads): run.py imports it under
the project's interpreter and smartnoise_side.py under SmartNoise's own venv. Every query is
asked verbatim of both systems and of PostgreSQL for the truth. ``keys`` is
the number of leading GROUP BY columns of the result; the rest are the
aggregates compared. The two JOIN queries use public.adult_region, a second
table keyed by the privacy unit (one row per adult.id) that run.py creates.
"""

from __future__ import annotations

from dataclasses import dataclass

# One row per adult.id: a region and a household size derived from the id, so the truth is reproducible.
REGION_TABLE_SQL = """
CREATE TABLE public.adult_region AS
SELECT id, (ARRAY['North', 'South', 'East', 'West'])[1 + id % 4] AS region, 1 + id % 5 AS household_size
FROM public.adult;
ALTER TABLE public.adult_region ADD PRIMARY KEY (id);
"""
# The policy declares it linked to public.adult through id, with a public domain for region and bounds for
# household_size (run.py gives the planner it calls directly the same as a LinkedTable).
REGION_POLICY_SQL = """
SELECT anonproxy.link_table('public.adult_region', 'id', 'public.adult');
SELECT anonproxy.set_column('public.adult_region', 'region', 'quasi_identifier',
                            domain => ARRAY['North', 'South', 'East', 'West']);
SELECT anonproxy.set_column('public.adult_region', 'household_size', 'quasi_identifier', 1, 5);
"""


@dataclass(frozen=True)
class Query:
    id: str
    kind: str
    sql: str
    keys: int = 0  # leading group-key columns


QUERIES: tuple[Query, ...] = (
    Query("q01", "count", "SELECT count(*) FROM public.adult"),
    Query("q02", "count", "SELECT count(age) FROM public.adult"),
    Query("q03", "count distinct unit", "SELECT count(DISTINCT id) FROM public.adult"),
    Query("q04", "sum", "SELECT sum(age) FROM public.adult"),
    Query("q05", "avg", "SELECT avg(age) FROM public.adult"),
    Query("q06", "avg", "SELECT avg(hours_per_week) FROM public.adult"),
    Query("q07", "sum", "SELECT sum(capital_gain) FROM public.adult"),
    Query("q08", "avg", "SELECT avg(capital_gain) FROM public.adult"),
    Query("q09", "count, filtered", "SELECT count(*) FROM public.adult WHERE age >= 40"),
    Query("q10", "sum, filtered", "SELECT sum(hours_per_week) FROM public.adult WHERE sex = 'Female'"),
    Query("q11", "avg, filtered", "SELECT avg(age) FROM public.adult WHERE income = '>50K'"),
    Query("q12", "count by", "SELECT sex, count(*) FROM public.adult GROUP BY sex", 1),
    Query("q13", "count by", "SELECT race, count(*) FROM public.adult GROUP BY race", 1),
    Query("q14", "count by", "SELECT education, count(*) FROM public.adult GROUP BY education", 1),
    Query("q15", "avg by", "SELECT workclass, avg(hours_per_week) FROM public.adult GROUP BY workclass", 1),
    Query("q16", "avg by", "SELECT sex, avg(age) FROM public.adult GROUP BY sex", 1),
    Query("q17", "sum by", "SELECT income, sum(capital_gain) FROM public.adult GROUP BY income", 1),
    Query("q18", "count+avg by",
          "SELECT marital_status, count(*), avg(age) FROM public.adult GROUP BY marital_status", 1),
    Query("q19", "count by, filtered",
          "SELECT occupation, count(*) FROM public.adult WHERE sex = 'Male' GROUP BY occupation", 1),
    Query("q20", "count by 2 keys", "SELECT race, sex, count(*) FROM public.adult GROUP BY race, sex", 2),
    Query("q21", "top-5 count by",
          "SELECT occupation, count(*) AS n FROM public.adult GROUP BY occupation ORDER BY n DESC LIMIT 5", 1),
    Query("q22", "count by, filtered, small groups",
          "SELECT native_country, count(*) FROM public.adult WHERE age < 30 GROUP BY native_country", 1),
    Query("q23", "JOIN count by",
          "SELECT r.region, count(*) FROM public.adult a JOIN public.adult_region r ON r.id = a.id GROUP BY r.region",
          1),
    Query("q24", "JOIN avg, filtered",
          "SELECT avg(a.age) FROM public.adult a JOIN public.adult_region r ON r.id = a.id "
          "WHERE r.household_size >= 3"),
)
