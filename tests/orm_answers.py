"""Checks shared by the tests that run ORMs for real through the proxy (test_orm_django, test_orm_sqlalchemy,
test_orm_tortoise): an answer's rows as dicts, keyed by their GROUP BY columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

POLICY = Path(__file__).parent.parent / "anonproxy" / "data" / "demo_policy.yaml"
Row = dict[str, Any]


def group_key(row: Row, keys: tuple[str, ...]) -> Any:
    """A row's group: the value of its one key column, or the tuple of several."""
    values = tuple(row[name] for name in keys)
    return values if len(values) > 1 else values[0]


def groups_of_public_domains(keys: tuple[str, ...], got: list[Row], truth: list[Row]) -> None:
    """Each group of a dp answer over public.adult's columns is one of the column's public domain; every group of
    1,000 or more people is there (partition selection drops only small ones)."""
    domains = yaml.safe_load(POLICY.read_text())["tables"]["public.adult"]["columns"]
    for row in got:
        for name in keys:
            assert name not in domains or row[name] in domains[name]["domain"], (name, row)
    big = {group_key(row, keys) for row in truth if row.get("n", 0) >= 1000}
    assert big <= {group_key(row, keys) for row in got}
