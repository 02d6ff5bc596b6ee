#!/usr/bin/env python3
"""The SmartNoise SQL side of the dp benchmark; runs under SmartNoise's own venv (not the project's).

    /tmp/snsql-venv/bin/python smartnoise_side.py ADULT_CSV OUT_JSON --repeat N --epsilon E --delta D [--nominal]

Each workload query, ``--repeat`` times, through snsql.from_df over the adult
rows run.py exported (pandas reader), with metadata declaring the same bounds
as anonproxy's demo policy: id the private id, max_ids 1, SmartNoise's other
options at their defaults (censor_dims on, i.e. thresholding of GROUP BY keys
with δ). Writes, per query, every answer (rows as lists) or the error, the
ms each execute() took, and what SmartNoise's own accountant says the query
cost (``reader.get_privacy_cost``).

SmartNoise applies its ``Privacy(epsilon, delta)`` to *each* noisy
measurement of a query and composes them: ``SELECT avg(age)`` measures a
count, a sum and another count and costs 3ε. By default each query gets the
ε and δ per measurement that make its total cost the given ε and δ, the
cost anonproxy charges for the same query; ``--nominal`` passes ε and δ as
they are (the total is then 1–4 times more).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from pathlib import Path

import pandas as pd
import snsql
from snsql import Privacy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_workload import QUERIES

BOUNDS = {  # as anonproxy/data/demo_policy.yaml
    "age": (17, 90), "fnlwgt": (13769, 1484705), "education_num": (1, 16), "capital_gain": (0, 99999),
    "capital_loss": (0, 4356), "hours_per_week": (1, 99),
}
STRINGS = ("workclass", "education", "marital_status", "occupation", "relationship", "race", "sex",
           "native_country", "income")


def table_metadata() -> dict[str, object]:
    columns: dict[str, object] = {"id": {"type": "int", "private_id": True}}
    columns |= {name: {"type": "int", "lower": lo, "upper": hi} for name, (lo, hi) in BOUNDS.items()}
    columns |= {name: {"type": "string"} for name in STRINGS}
    return {"max_ids": 1, "row_privacy": False, **columns}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("adult_csv", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeat", type=int, required=True)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--nominal", action="store_true", help="ε and δ per measurement, not per query")
    args = parser.parse_args()
    df = pd.read_csv(args.adult_csv, keep_default_na=False)
    # The pandas reader takes one DataFrame, i.e. one table: public.adult_region is not available to it, so the
    # JOIN queries fail (recorded as not answered).
    meta = {"": {"public": {"adult": table_metadata()}}}
    nominal = snsql.from_df(df, privacy=Privacy(epsilon=args.epsilon, delta=args.delta), metadata=meta)
    results: dict[str, object] = {}
    for query in QUERIES:
        runs, ms, error, cost = [], [], None, None
        reader = nominal
        try:
            epsilon, delta = (float(x) for x in nominal.get_privacy_cost(query.sql))
            if not args.nominal:
                # 1 − 1e-9: SmartNoise's float composition must not come out above the target.
                privacy = Privacy(epsilon=args.epsilon * args.epsilon / epsilon * (1 - 1e-9),
                                  delta=args.delta * args.delta / delta * (1 - 1e-6))
                reader = snsql.from_df(df, privacy=privacy, metadata=meta)
            cost = [float(x) for x in reader.get_privacy_cost(query.sql)]
        except Exception as exc:  # noqa: BLE001 - a query SmartNoise cannot plan is "not answered"
            error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        for _ in range(0 if error else args.repeat):
            start = time.perf_counter()
            try:
                rows = reader.execute(query.sql)
            except Exception as exc:  # noqa: BLE001 - any refusal is "not answered", with its message
                error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                break
            ms.append((time.perf_counter() - start) * 1000)
            runs.append([[_plain(v) for v in row] for row in rows[1:]])  # rows[0] is the header
        results[query.id] = {"runs": runs, "ms": ms, "error": error, "cost": cost}
        print(f"smartnoise {query.id}: {'refused: ' + error if error else f'{len(runs)} answers'}",
              file=sys.stderr, flush=True)
    versions = {name: metadata.version(name) for name in ("smartnoise-sql", "opendp", "pandas")}
    args.out.write_text(json.dumps({"versions": versions, "python": sys.version.split()[0], "nominal": args.nominal,
                                    "queries": results}))
    return 0


def _plain(value: object) -> object:
    if value is None or isinstance(value, (str, int, float)):
        return value
    try:
        return float(value)  # numpy scalars
    except (TypeError, ValueError):
        return str(value)


if __name__ == "__main__":
    sys.exit(main())
