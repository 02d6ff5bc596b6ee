"""Runs inside the Superset virtual environment (see run.py): charts through the proxy, one line per chart and role.

Reads a JSON job from stdin: {"home": dir, "databases": {role: sqlalchemy uri}}.
Sets up Superset with a SQLite metadata database in ``home``, logs in through
the REST API with Flask's test client, registers one database per role (the
proxy, as that role) and a dataset on public.adult for each, then posts the
chart-data requests of eight chart types, as Superset's frontend builds them,
and prints one JSON object per chart and role on stdout:
{"chart": ..., "role": ..., "works": bool, "rows": n, "error": message}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ADMIN = {"username": "admin", "password": "admin", "provider": "db", "refresh": True}
CONFIG = """\
SECRET_KEY = "anonproxy-benchmark-only-{token}"
SQLALCHEMY_DATABASE_URI = "sqlite:///{home}/superset.db"
WTF_CSRF_ENABLED = False
TALISMAN_ENABLED = False
CACHE_CONFIG = {{"CACHE_TYPE": "NullCache"}}
DATA_CACHE_CONFIG = {{"CACHE_TYPE": "NullCache"}}
FEATURE_FLAGS = {{"GENERIC_CHART_AXES": True}}
"""


def simple_metric(aggregate: str, column: str) -> dict[str, Any]:
    return {"expressionType": "SIMPLE", "aggregate": aggregate, "column": {"column_name": column},
            "label": f"{aggregate}({column})"}


def sql_metric(expression: str, label: str) -> dict[str, Any]:
    return {"expressionType": "SQL", "sqlExpression": expression, "label": label}


def query(**fields: Any) -> dict[str, Any]:
    """A query object; ``metrics=None`` leaves metrics out, as the histogram does (raw values, no GROUP BY)."""
    base = {"filters": [], "extras": {"having": "", "where": ""}, "row_limit": 10000, "orderby": [],
            "metrics": [], "columns": [], "post_processing": []}
    merged = {**base, **fields}
    return {key: value for key, value in merged.items() if not (key == "metrics" and value is None)}


# The queries of each chart type, as the frontend's buildQuery of Superset 6 makes them.
CHARTS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "bar chart": ("echarts_timeseries_bar", [query(
        columns=["education"], metrics=["count"], orderby=[["count", False]])]),
    "pie chart": ("pie", [query(columns=["sex"], metrics=["count"], orderby=[["count", False]], row_limit=100)]),
    "table with row count": ("table", [
        query(columns=["education"], metrics=["count", simple_metric("AVG", "age")], orderby=[["count", False]],
              row_limit=20, row_offset=0),
        query(columns=["education"], metrics=["count", simple_metric("AVG", "age")], orderby=[["count", False]],
              is_rowcount=True, row_limit=50000)]),
    "big number": ("big_number_total", [query(metrics=["count"])]),
    "big number, filtered": ("big_number_total", [query(
        metrics=[simple_metric("AVG", "hours_per_week")],
        filters=[{"col": "sex", "op": "IN", "val": ["Female"]}])]),
    "line chart with series limit": ("echarts_timeseries_line", [query(
        columns=["age", "education"], metrics=["count"], series_columns=["education"], series_limit=5,
        series_limit_metric="count", orderby=[["count", False]])]),
    "pivot table": ("pivot_table_v2", [query(
        columns=["sex", "race"], metrics=["count", simple_metric("AVG", "hours_per_week")],
        orderby=[["count", False]])]),
    "histogram": ("histogram_v2", [query(
        columns=["age"], metrics=None, post_processing=[{"operation": "histogram",
                                           "options": {"column": "age", "groupby": [], "bins": 10}}])]),
    "box plot": ("box_plot", [query(
        columns=["marital_status", "education"], series_columns=["education"],
        metrics=[simple_metric("AVG", "capital_loss")],
        post_processing=[{"operation": "boxplot", "options": {
            "groupby": ["education"], "metrics": ["AVG(capital_loss)"], "whisker_type": "tukey"}}])]),
    "bar chart, ratio metric": ("echarts_timeseries_bar", [query(
        columns=["income"], metrics=[sql_metric("SUM(capital_gain) / COUNT(*)", "gain per person")])]),
}


def superset(home: Path, *args: str) -> None:
    """A `superset` command of this environment, with the benchmark's configuration."""
    command = [str(Path(sys.executable).parent / "superset"), *args]
    done = subprocess.run(command, env=os.environ, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"superset {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def main() -> None:
    job = json.load(sys.stdin)
    home = Path(job["home"])
    config = home / "superset_config.py"
    config.write_text(CONFIG.format(home=home, token=os.urandom(8).hex()))
    os.environ["SUPERSET_CONFIG_PATH"] = str(config)
    os.environ["FLASK_APP"] = "superset.app:create_app()"
    superset(home, "db", "upgrade")
    superset(home, "fab", "create-admin", "--username", "admin", "--password", "admin", "--firstname", "a",
             "--lastname", "b", "--email", "admin@example.invalid")
    superset(home, "init")

    from superset.app import create_app

    app = create_app()
    client = app.test_client()
    login = client.post("/api/v1/security/login", json=ADMIN)
    assert login.status_code == 200, login.get_data(as_text=True)
    headers = {"Authorization": f"Bearer {login.get_json()['access_token']}"}

    for role, uri in job["databases"].items():
        created = client.post("/api/v1/database/", headers=headers, json={
            "database_name": f"anonproxy as {role}", "sqlalchemy_uri": uri, "expose_in_sqllab": True})
        if created.status_code != 201:
            report("register the database", role, False, None, created.get_data(as_text=True))
            continue
        report("register the database", role, True, None, "")
        dataset = client.post("/api/v1/dataset/", headers=headers, json={
            "database": created.get_json()["id"], "schema": "public", "table_name": "adult"})
        if dataset.status_code != 201:
            report("create the dataset", role, False, None, dataset.get_data(as_text=True))
            continue
        report("create the dataset", role, True, None, "")
        dataset_id = dataset.get_json()["id"]
        for chart, (viz_type, queries) in CHARTS.items():
            response = client.post("/api/v1/chart/data", headers=headers, json={
                "datasource": {"id": dataset_id, "type": "table"}, "force": True, "queries": queries,
                "form_data": {"viz_type": viz_type, "datasource": f"{dataset_id}__table"},
                "result_format": "json", "result_type": "full"})
            body = response.get_json(silent=True) or {}
            if response.status_code == 200:
                rows = sum(len(result.get("data") or []) for result in body.get("result", []))
                report(chart, role, True, rows, "", [result.get("query", "") for result in body.get("result", [])])
            else:
                report(chart, role, False, 0, error_text(body, response.get_data(as_text=True)),
                       chart_sql(client, headers, dataset_id, queries, viz_type))
        # The SQLite metadata database holds one dataset per table name: make room for the next role's.
        client.delete(f"/api/v1/dataset/{dataset_id}", headers=headers)


def error_text(body: dict[str, Any], raw: str) -> str:
    """Superset's error message for a chart, without the SQL it adds."""
    for key in ("message", "errors"):
        if key in body:
            value = body[key]
            if isinstance(value, list) and value:
                value = value[0].get("message", value[0])
            return " ".join(str(value).split()).split(" HINT:")[0][:400]
    return " ".join(raw.split())[:400]


def chart_sql(client: Any, headers: dict[str, str], dataset_id: int, queries: list[dict[str, Any]],
              viz_type: str) -> list[str]:
    """The SQL Superset generates for a chart, asked without running it (result_type "query")."""
    response = client.post("/api/v1/chart/data", headers=headers, json={
        "datasource": {"id": dataset_id, "type": "table"}, "queries": queries,
        "form_data": {"viz_type": viz_type, "datasource": f"{dataset_id}__table"},
        "result_format": "json", "result_type": "query"})
    body = response.get_json(silent=True) or {}
    return [result.get("query", "") for result in body.get("result", [])]


def report(chart: str, role: str, works: bool, rows: int | None, error: str, sql: list[str] | None = None) -> None:
    print(json.dumps({"chart": chart, "role": role, "works": works, "rows": rows, "error": error, "sql": sql or []}),
          flush=True)


if __name__ == "__main__":
    main()
