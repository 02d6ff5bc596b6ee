"""The dashboard workload: aggregate queries over ``adult`` that a BI tool would send.

Each query is plain SQL as a ``reporter`` (suppress mode, k = 10) would type
it; the demo policy rewrites every one of them. Ids are stable, so figures of
different runs can be compared query by query.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    id: str
    kind: str  # count1, count2, magnitude, filtered: what the query is an example of
    sql: str


QUERIES: tuple[Query, ...] = (
    # Counts by one column.
    Query("q01", "count1", "SELECT sex, count(*) FROM adult GROUP BY sex"),
    Query("q02", "count1", "SELECT education, count(*) AS people FROM adult GROUP BY education ORDER BY people DESC"),
    Query("q03", "count1", "SELECT race, count(*) FROM adult GROUP BY race"),
    Query("q04", "count1", "SELECT marital_status, count(*) FROM adult GROUP BY marital_status ORDER BY 2 DESC"),
    Query(
        "q05",
        "count1",
        "SELECT native_country, count(*) FROM adult GROUP BY native_country ORDER BY count(*) DESC LIMIT 10",
    ),
    Query(
        "q06",
        "count1",
        "SELECT CASE WHEN age < 30 THEN 'under 30' WHEN age < 50 THEN '30-49' ELSE '50+' END AS age_band, "
        "count(*) FROM adult GROUP BY 1 ORDER BY 1",
    ),
    # Counts by two columns.
    Query("q07", "count2", "SELECT sex, income, count(*) FROM adult GROUP BY sex, income"),
    Query(
        "q08", "count2", "SELECT education, sex, count(*) FROM adult GROUP BY education, sex ORDER BY education, sex"
    ),
    Query("q09", "count2", "SELECT workclass, income, count(*) FROM adult GROUP BY 1, 2"),
    Query("q10", "count2", "SELECT race, sex, count(*) AS people FROM adult GROUP BY race, sex ORDER BY people DESC"),
    # Sums and averages of hours_per_week and capital_gain by category.
    Query("q11", "magnitude", "SELECT occupation, avg(hours_per_week) FROM adult GROUP BY occupation"),
    Query("q12", "magnitude", "SELECT education, sum(capital_gain) FROM adult GROUP BY education"),
    Query("q13", "magnitude", "SELECT sex, avg(hours_per_week), avg(capital_gain) FROM adult GROUP BY sex"),
    Query(
        "q14",
        "magnitude",
        "SELECT workclass, sum(hours_per_week) AS total_hours FROM adult GROUP BY workclass ORDER BY total_hours DESC",
    ),
    Query("q15", "magnitude", "SELECT income, avg(capital_gain), sum(capital_gain) FROM adult GROUP BY income"),
    Query(
        "q16",
        "magnitude",
        "SELECT relationship, count(*), avg(hours_per_week) FROM adult GROUP BY relationship ORDER BY 3 DESC",
    ),
    # Filtered variants.
    Query("q17", "filtered", "SELECT count(*) FROM adult WHERE sex = 'Female'"),
    Query("q18", "filtered", "SELECT education, count(*) FROM adult WHERE age BETWEEN 25 AND 34 GROUP BY education"),
    Query(
        "q19",
        "filtered",
        "SELECT occupation, avg(hours_per_week) FROM adult WHERE sex = 'Female' AND income = '>50K' "
        "GROUP BY occupation ORDER BY 2 DESC LIMIT 5",
    ),
    Query(
        "q20", "filtered", "SELECT marital_status, sum(capital_gain) FROM adult WHERE age >= 50 GROUP BY marital_status"
    ),
    Query("q21", "filtered", "SELECT sex, count(*) FROM adult WHERE income = '>50K' GROUP BY sex"),
    Query("q22", "filtered", "SELECT race, avg(capital_gain) FROM adult WHERE hours_per_week > 40 GROUP BY race"),
    Query("q23", "filtered", "SELECT avg(hours_per_week) FROM adult WHERE age < 30"),
    Query(
        "q24",
        "filtered",
        "SELECT education_num, count(*) FROM adult WHERE workclass = 'Private' GROUP BY education_num "
        "ORDER BY education_num",
    ),
    Query(
        "q25",
        "filtered",
        "SELECT sex, income, avg(hours_per_week) FROM adult WHERE age BETWEEN 30 AND 50 AND race = 'White' "
        "GROUP BY sex, income ORDER BY 1, 2",
    ),
)


def first_sight_text(query: Query, serial: int) -> str:
    """The query made new to the proxy: a leading comment with a serial number (the rewriter drops comments)."""
    return f"/* anonproxy-bench {query.id} #{serial} */ {query.sql}"
