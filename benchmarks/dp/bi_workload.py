"""A BI dashboard's workload over public.adult, for budget.py: what Superset and Metabase send for their charts.

Plain Python, no imports from the project (budget.py plans these with whichever tree it measures). 64 queries,
in the order a user building three dashboards would ask them:

* big-number tiles (a count, a filtered count, an average, a sum),
* bar and pie charts: ``GROUP BY`` one public-domain key, ``count(*)`` or an aggregate, Superset's
  ``ORDER BY <metric> DESC LIMIT 10000`` or Metabase's quoted ``"public"."adult"."col"`` spelling,
* tables with a count next to an average (``count(*), avg(x)``), or a sum next to an average,
* stacked bars: ``GROUP BY`` two keys,
* filtered charts (``WHERE`` on a key, on income, on an age range),
* top-N charts (``ORDER BY count DESC LIMIT 5/10``),
* histograms over a derived bucket (``age / 10 * 10``, ``hours_per_week / 10 * 10``): keys without a declared
  domain, released through partition selection (they need δ).

Each query is asked once per pass; budget.py cycles through the list (a dashboard refreshed on new data asks
the same charts again, and pays again).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BIQuery:
    id: str
    chart: str
    sql: str


_A = "public.adult"
_M = '"public"."adult"'  # Metabase's spelling


def _superset_bar(key: str, metric: str = "count(*)", name: str = "count", where: str = "") -> str:
    filt = f" WHERE {where}" if where else ""
    return (f"SELECT {key} AS {key}, {metric} AS {name} FROM {_A}{filt} GROUP BY {key} "
            f"ORDER BY {name} DESC LIMIT 10000")


def _metabase_bar(key: str, metric: str = "count(*)", name: str = "count") -> str:
    return (f'SELECT {_M}."{key}" AS "{key}", {metric} AS "{name}" FROM {_M} GROUP BY {_M}."{key}" '
            f'ORDER BY {_M}."{key}" ASC')


_SQL: tuple[tuple[str, str], ...] = (
    # dashboard 1: population overview
    ("big number", f"SELECT count(*) AS count FROM {_A}"),
    ("big number", f"SELECT avg(age) AS avg_age FROM {_A}"),
    ("bar", _superset_bar("sex")),
    ("bar", _superset_bar("race")),
    ("bar", _superset_bar("education")),
    ("bar", _superset_bar("marital_status")),
    ("pie", _superset_bar("relationship")),
    ("bar", _superset_bar("workclass")),
    ("bar", _metabase_bar("occupation")),
    ("bar", _metabase_bar("native_country")),
    ("table", f"SELECT sex, count(*) AS count, avg(age) AS avg_age FROM {_A} GROUP BY sex"),
    ("table", f"SELECT education, count(*) AS count, avg(age) AS avg_age FROM {_A} GROUP BY education"),
    ("table", f"SELECT marital_status, count(*) AS count, avg(age) AS avg_age FROM {_A} GROUP BY marital_status"),
    ("stacked bar", f"SELECT race, sex, count(*) AS count FROM {_A} GROUP BY race, sex"),
    ("stacked bar", f"SELECT marital_status, sex, count(*) AS count FROM {_A} GROUP BY marital_status, sex"),
    ("histogram", f"SELECT age / 10 * 10 AS decade, count(*) AS count FROM {_A} GROUP BY age / 10 * 10"),
    ("top 5", f"SELECT occupation, count(*) AS count FROM {_A} GROUP BY occupation ORDER BY count DESC LIMIT 5"),
    ("top 10", (f"SELECT native_country, count(*) AS count FROM {_A} GROUP BY native_country "
                "ORDER BY count DESC LIMIT 10")),
    ("big number", f"SELECT count(*) AS count FROM {_A} WHERE age >= 65"),
    ("big number", f"SELECT count(*) AS count, avg(age) AS avg_age FROM {_A} WHERE sex = 'Female'"),
    # dashboard 2: work and hours
    ("big number", f"SELECT avg(hours_per_week) AS avg_hours FROM {_A}"),
    ("big number", f"SELECT sum(hours_per_week) AS total_hours FROM {_A}"),
    ("bar", _superset_bar("workclass", "avg(hours_per_week)", "avg_hours")),
    ("bar", _superset_bar("occupation", "avg(hours_per_week)", "avg_hours")),
    ("bar", _superset_bar("sex", "avg(hours_per_week)", "avg_hours")),
    ("bar", _superset_bar("education", "sum(hours_per_week)", "total_hours")),
    ("table", f"SELECT workclass, count(*) AS count, avg(hours_per_week) AS avg_hours FROM {_A} GROUP BY workclass"),
    ("table", (f"SELECT occupation, count(*) AS count, avg(hours_per_week) AS avg_hours FROM {_A} "
               "GROUP BY occupation")),
    ("table", (f"SELECT sex, sum(hours_per_week) AS total_hours, avg(hours_per_week) AS avg_hours FROM {_A} "
               "GROUP BY sex")),
    ("stacked bar", f"SELECT workclass, sex, count(*) AS count FROM {_A} GROUP BY workclass, sex"),
    ("stacked bar", f"SELECT occupation, sex, avg(hours_per_week) AS avg_hours FROM {_A} GROUP BY occupation, sex"),
    ("histogram", (f"SELECT hours_per_week / 10 * 10 AS hours, count(*) AS count FROM {_A} "
                   "GROUP BY hours_per_week / 10 * 10")),
    ("bar", _superset_bar("occupation", where="sex = 'Female'")),
    ("bar", _superset_bar("workclass", where="age >= 50")),
    ("top 5", (f"SELECT occupation, avg(hours_per_week) AS avg_hours FROM {_A} GROUP BY occupation "
               "ORDER BY avg_hours DESC LIMIT 5")),
    ("table", (f"SELECT count(*) AS count, count(hours_per_week) AS answered, avg(hours_per_week) AS avg_hours "
               f"FROM {_A} WHERE age < 30")),
    ("bar", _metabase_bar("workclass", 'avg("public"."adult"."hours_per_week")', "avg")),
    ("bar", _metabase_bar("relationship", 'avg("public"."adult"."age")', "avg")),
    ("big number", f"SELECT count(*) AS count FROM {_A} WHERE hours_per_week > 40"),
    ("big number", f"SELECT avg(age) AS avg_age FROM {_A} WHERE hours_per_week > 40"),
    # dashboard 3: income
    ("big number", f"SELECT count(*) AS count FROM {_A} WHERE income = '>50K'"),
    ("pie", _superset_bar("income")),
    ("bar", _superset_bar("income", "avg(age)", "avg_age")),
    ("bar", _superset_bar("income", "sum(capital_gain)", "capital_gain")),
    ("bar", _superset_bar("income", "avg(capital_gain)", "avg_gain")),
    ("bar", _superset_bar("education", "avg(capital_gain)", "avg_gain")),
    ("table", f"SELECT income, count(*) AS count, avg(age) AS avg_age FROM {_A} GROUP BY income"),
    ("table", f"SELECT income, count(*) AS count, avg(hours_per_week) AS avg_hours FROM {_A} GROUP BY income"),
    ("table", (f"SELECT income, sum(capital_gain) AS total_gain, avg(capital_gain) AS avg_gain FROM {_A} "
               "GROUP BY income")),
    ("stacked bar", f"SELECT income, sex, count(*) AS count FROM {_A} GROUP BY income, sex"),
    ("stacked bar", f"SELECT education, income, count(*) AS count FROM {_A} GROUP BY education, income"),
    ("stacked bar", f"SELECT race, income, count(*) AS count FROM {_A} GROUP BY race, income"),
    ("bar", _superset_bar("education", where="income = '>50K'")),
    ("bar", _superset_bar("occupation", where="income = '>50K'")),
    ("bar", _superset_bar("marital_status", "avg(capital_gain)", "avg_gain", where="income = '>50K'")),
    ("top 10", (f"SELECT education, avg(capital_gain) AS avg_gain FROM {_A} GROUP BY education "
                "ORDER BY avg_gain DESC LIMIT 10")),
    ("top 5", (f"SELECT occupation, count(*) AS count FROM {_A} WHERE income = '>50K' GROUP BY occupation "
               "ORDER BY count DESC LIMIT 5")),
    ("histogram", (f"SELECT age / 10 * 10 AS decade, count(*) AS count FROM {_A} WHERE income = '>50K' "
                   "GROUP BY age / 10 * 10")),
    ("table", (f"SELECT sex, count(*) AS count, avg(capital_gain) AS avg_gain FROM {_A} WHERE age >= 40 "
               "GROUP BY sex")),
    ("big number", f"SELECT sum(capital_gain) AS total_gain FROM {_A}"),
    ("big number", f"SELECT avg(capital_loss) AS avg_loss FROM {_A} WHERE income = '<=50K'"),
    ("big number", (f"SELECT count(*) AS count, sum(capital_gain) AS total_gain, avg(capital_gain) AS avg_gain "
                    f"FROM {_A} WHERE income = '>50K'")),
    ("bar", _metabase_bar("income", "count(*)", "count")),
    ("bar", _metabase_bar("sex", 'avg("public"."adult"."capital_gain")', "avg")),
)

BI_QUERIES: tuple[BIQuery, ...] = tuple(BIQuery(f"b{n:02d}", chart, sql) for n, (chart, sql) in enumerate(_SQL, 1))
