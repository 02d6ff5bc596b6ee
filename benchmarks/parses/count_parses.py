"""How many times sqlglot and pglast parse a statement on first sight, per mode, shape and role's cost.

Counts calls of sqlglot's ``Parser.parse`` (the classifier's parse, ``sqlglot.parse_one`` and every other entry
point go through it) and of pglast's ``parse_sql_json`` in the final SQL check (PostgreSQL's own parser) while one
statement is decided as a suppress role would be (``decide``: the classification and the suppression rewrite, with
its final check) and as a dp role would be before its first ledger round trip: ``decide`` (which measures a dp
statement, from its one parse) and the measurement priced with its final check (``priced_checked``), at the
proxy's default per-query cost (ε 0.5, δ 1e-7) and, for a role whose cost is not the default, at the default and
again at the role's cost, as a worker that has not yet read that role's cost does (the second pricing does not
check the same SQL again). On a tree before issue 18 (no ``priced_checked``) the dp steps are what the proxy did
then: ``plan_checked`` of the text at the default cost and, for the role's own cost, again at it.

The policy is tests/test_rewrite.py's, with a declared public domain on ``education`` (so that a WHERE on it is
read for the domain, anonproxy.dp.domains). For the series limit, dp counts the first question only: the second
is measured when the first one's released keys are known. Run from the repository root:
``python3 benchmarks/parses/count_parses.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlglot.parser import Parser

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "tests")]

from test_rewrite import ADULT, POLICY, SUPPRESS  # noqa: E402

from anonproxy.dp.model import DPParams  # noqa: E402
from anonproxy.plan import final_sql  # noqa: E402
from anonproxy.policy.model import ColumnPolicy  # noqa: E402
from anonproxy.route.decide import decide  # noqa: E402
from anonproxy.route.decision import Noisy  # noqa: E402

try:  # measure, then price (issue 18)
    from anonproxy.dp.answers import priced_checked  # noqa: E402
except ImportError:
    priced_checked = None
from anonproxy.dp.answers import plan_checked  # noqa: E402

DOMAINS = dataclasses.replace(POLICY, tables={"public.adult": dataclasses.replace(
    ADULT, columns={**ADULT.columns, "education": ColumnPolicy("education", domain=["Bachelors", "Masters", "Doctorate"])})})
DP = dataclasses.replace(SUPPRESS, mode="dp")
DEFAULT = DPParams(epsilon=0.5, delta=1e-7)
OWN = DPParams(epsilon=1, delta=1e-6)
STATEMENTS = {
    "flat": "select education, count(*) from adult where age > 30 group by education order by 2 desc",
    "domain": "select education, count(*) from adult where education in ('Bachelors', 'Masters') "
              "group by education",
    "power bi": 'select "_"."education", count(*) as "a0" from (select "_"."education" from "public"."adult" "_" '
                'where "_"."age" > 30) "_" group by "_"."education"',
    "rowcount": "select count(*) as rowcount from (select education, count(*) from adult group by education) "
                "as rowcount_qry",
    "series": "SELECT education, count(*) FROM adult JOIN (SELECT education AS education__, count(*) AS m__ "
              "FROM adult GROUP BY education ORDER BY m__ DESC LIMIT 5) AS series_limit "
              "ON education = series_limit.education__ GROUP BY education",
}

_calls = {"sqlglot": 0, "pglast": 0}
_parse, _pglast = Parser.parse, final_sql.parse_sql_json


def _sqlglot_counted(self: Parser, *args: Any, **kwargs: Any) -> Any:
    _calls["sqlglot"] += 1
    return _parse(self, *args, **kwargs)


def _pglast_counted(sql: str) -> Any:
    _calls["pglast"] += 1
    return _pglast(sql)


def _count(action: Callable[[], None]) -> tuple[int, int]:
    Parser.parse = _sqlglot_counted  # type: ignore[method-assign]
    final_sql.parse_sql_json = _pglast_counted  # type: ignore[attr-defined]
    _calls.update(sqlglot=0, pglast=0)
    try:
        action()
    finally:
        Parser.parse = _parse  # type: ignore[method-assign]
        final_sql.parse_sql_json = _pglast  # type: ignore[attr-defined]
    return _calls["sqlglot"], _calls["pglast"]


def _dp(sql: str, params: DPParams) -> None:
    decision = decide(sql, DP, DOMAINS)
    if not isinstance(decision, Noisy):
        return
    if priced_checked is None:  # before issue 18
        plan_checked(decision.sql, DP, DOMAINS, DEFAULT)
        if params != DEFAULT:
            plan_checked(decision.sql, DP, DOMAINS, params)
        return
    first = priced_checked(decision.plan, DP, DOMAINS, DEFAULT)
    if params != DEFAULT:
        checked = frozenset({first.sql, *([first.post.sql] if first.post is not None else [])})
        priced_checked(decision.plan, DP, DOMAINS, params, checked)


def measure_both() -> dict[str, tuple[int, int]]:
    """(sqlglot parses, pglast parses) per statement and mode."""
    figures = {}
    for name, sql in STATEMENTS.items():
        figures[f"{name}, suppress"] = _count(lambda sql=sql: decide(sql, SUPPRESS, DOMAINS))
        figures[f"{name}, dp"] = _count(lambda sql=sql: _dp(sql, DEFAULT))
        figures[f"{name}, dp own cost"] = _count(lambda sql=sql: _dp(sql, OWN))
    return figures


def measure() -> dict[str, int]:
    """sqlglot parses per statement and mode."""
    return {key: sqlglot for key, (sqlglot, _) in measure_both().items()}


if __name__ == "__main__":
    for key, (sqlglot, pglast) in measure_both().items():
        print(f"{key:26} {sqlglot:3d} sqlglot {pglast:3d} pglast parses")
