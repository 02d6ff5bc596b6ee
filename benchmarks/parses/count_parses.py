"""How many times sqlglot parses a statement on first sight, per mode and shape.

Counts calls of sqlglot's ``Parser.parse`` (the classifier's parse, ``sqlglot.parse_one`` and every other
entry point go through it) while one statement is decided as a suppress role would be (``decide``: the
classification and the suppression rewrite) and as a dp role would be (``decide``, then ``plan_checked``:
the plan and the final SQL check the proxy runs on first sight). pglast's parse in the final check is
PostgreSQL's parser, not counted. Run from the repository root: ``python3 benchmarks/parses/count_parses.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sqlglot.parser import Parser

sys.path[:0] = [str(Path(__file__).parents[2]), str(Path(__file__).parents[2] / "tests")]

from test_rewrite import POLICY, SUPPRESS  # noqa: E402

from anonproxy.dp.answers import plan_checked  # noqa: E402
from anonproxy.dp.model import DPParams  # noqa: E402
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy

DP = dataclasses.replace(SUPPRESS, mode="dp")
STATEMENTS = {
    "flat": "select education, count(*) from adult where age > 30 group by education order by 2 desc",
    "power bi": 'select "_"."education", count(*) as "a0" from (select "_"."education" from "public"."adult" "_" '
                'where "_"."age" > 30) "_" group by "_"."education"',
    "rowcount": "select count(*) as rowcount from (select education, count(*) from adult group by education) "
                "as rowcount_qry",
    "series": "SELECT education, count(*) FROM adult JOIN (SELECT education AS education__, count(*) AS m__ "
              "FROM adult GROUP BY education ORDER BY m__ DESC LIMIT 5) AS series_limit "
              "ON education = series_limit.education__ GROUP BY education",
}

_calls = 0
_parse = Parser.parse


def _counting(self: Parser, *args: object, **kwargs: object) -> object:
    global _calls
    _calls += 1
    return _parse(self, *args, **kwargs)


def _count(action: object) -> int:
    global _calls
    Parser.parse = _counting  # type: ignore[method-assign]
    _calls = 0
    try:
        action()  # type: ignore[operator]
    finally:
        Parser.parse = _parse  # type: ignore[method-assign]
    return _calls


def _dp(sql: str) -> None:
    decision = decide(sql, DP, POLICY)
    if isinstance(decision, Noisy):
        plan_checked(decision.sql, DP, POLICY, DPParams(epsilon=1, delta=1e-6))


def measure() -> dict[str, int]:
    figures = {}
    for name, sql in STATEMENTS.items():
        figures[f"{name}, suppress"] = _count(lambda sql=sql: decide(sql, SUPPRESS, POLICY))
        figures[f"{name}, dp"] = _count(lambda sql=sql: _dp(sql))
    return figures


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key:20} {value:3d} sqlglot parses")
