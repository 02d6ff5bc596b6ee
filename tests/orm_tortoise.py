"""What an async application asks of the demo tables with Tortoise ORM (its asyncpg backend).

The models (``Adult`` over public.adult, ``Visit`` over public.visits with ``person`` a foreign key) are the app
"models" of :func:`config`, one connection per alias. Each :class:`Step` is one query set as its user writes it,
run with ``using_db`` on one connection; the kind says what a gated role must get, as in tests/orm_sqlalchemy.py
(``counts``: the groups the suppression oracle releases; ``exact``: PostgreSQL's answer; ``refused``: a refusal
naming ``refusal``). Used by tests/test_orm_tortoise.py.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tortoise import fields, models
from tortoise.functions import Avg, Count, Max, Sum

Rows = list[dict[str, Any]]


class Adult(models.Model):
    id = fields.IntField(primary_key=True)
    age = fields.IntField()
    workclass = fields.TextField(null=True)
    education = fields.TextField()
    occupation = fields.TextField(null=True)
    race = fields.TextField()
    sex = fields.TextField()
    capital_gain = fields.IntField()
    hours_per_week = fields.IntField()
    income = fields.TextField()

    class Meta:
        table = "adult"


class Visit(models.Model):
    visit_id = fields.BigIntField(primary_key=True)
    person: Any = fields.ForeignKeyField("models.Adult", related_name="visits", source_field="person_id")
    visited_at = fields.DatetimeField()
    channel = fields.TextField()
    amount = fields.DecimalField(max_digits=10, decimal_places=2)

    class Meta:
        table = "visits"


def config(credentials: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tortoise's configuration: an asyncpg connection per alias (``credentials``: host, port, user, password,
    database, and server_settings where a direct connection runs as a role), this module's models."""
    return {"connections": {alias: {"engine": "tortoise.backends.asyncpg", "credentials": settings}
                            for alias, settings in credentials.items()},
            "apps": {"models": {"models": ["orm_tortoise"], "default_connection": next(iter(credentials))}}}


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # counts, exact or refused
    what: str  # the query set, as its user writes it
    run: Callable[[Any], Awaitable[Any]]  # a connection to the step's result
    keys: tuple[str, ...] = ()  # the grouping fields (counts: the count of people is field "n")
    per_person: bool = True  # over public.adult (one row per person), not the linked visits
    refusal: str = ""  # refused: what the message must name


def _plain(value: Any) -> Any:
    """Comparable across connections: Decimals and floats to 9 significant digits (a rewritten statement may add
    up in another order), whole Decimals to int."""
    if isinstance(value, Decimal) and value == value.to_integral():
        return int(value)
    if isinstance(value, (float, Decimal)):
        return float(f"{float(value):.9g}")
    return value


def rows(result: Any) -> Rows:
    """A query set's values, one dict, a count or a model instance, as rows of plain values."""
    if isinstance(result, models.Model):
        result = {"id": result.pk}
    if not isinstance(result, list):
        result = [result if isinstance(result, dict) else {"value": result}]
    return [{name: _plain(value) for name, value in row.items()} for row in result]


def _by(*keys: str, **filters: Any) -> Callable[[Any], Awaitable[Any]]:
    return lambda db: Adult.filter(**filters).using_db(db).annotate(n=Count("id")).group_by(*keys) \
        .order_by(*keys).values(*keys, "n")


START = dt.datetime(2025, 3, 1, tzinfo=dt.timezone.utc)

STEPS: tuple[Step, ...] = (
    Step("tt-count-by-sex", "counts", "Adult.annotate(n=Count('id')).group_by('sex').values('sex', 'n')",
         _by("sex"), keys=("sex",)),
    Step("tt-in-two", "counts", "Adult.filter(race__in=[...]).annotate(n=Count('id')).group_by('sex', 'race')",
         _by("sex", "race", race__in=["White", "Black", "Other"]), keys=("sex", "race")),
    Step("tt-range", "counts", "Adult.filter(sex='Female', age__gte=30, age__lt=40)...group_by('education')",
         _by("education", sex="Female", age__gte=30, age__lt=40), keys=("education",)),
    Step("tt-count", "exact", "Adult.filter(occupation__icontains='sales').count()",
         lambda db: Adult.filter(occupation__icontains="sales").using_db(db).count()),
    Step("tt-isnull", "exact", "Adult.filter(workclass__isnull=False).count()",
         lambda db: Adult.filter(workclass__isnull=False).using_db(db).count()),
    Step("tt-aggregates", "exact", "Adult.filter(age__gte=18).annotate(total=Sum(...), mean=Avg(...)).values(...)",
         lambda db: Adult.filter(age__gte=18).using_db(db).annotate(total=Sum("capital_gain"), mean=Avg("age"))
         .values("total", "mean")),
    Step("tt-top-n", "exact", "Adult.annotate(n=Count('id')).group_by('occupation').order_by('-n').limit(5)",
         lambda db: Adult.all().using_db(db).annotate(n=Count("id")).group_by("occupation").order_by("-n")
         .limit(5).values("occupation", "n"), keys=("occupation",)),
    Step("tt-having", "exact", "Adult.annotate(n=Count('id')).group_by('education').filter(n__gt=500)",
         lambda db: Adult.all().using_db(db).annotate(n=Count("id"), hours=Avg("hours_per_week"))
         .group_by("education").filter(n__gt=500).order_by("education").values("education", "n", "hours"),
         keys=("education",)),
    Step("tt-date-range", "exact", "Visit.filter(visited_at__gte=start, visited_at__lt=end).count()",
         lambda db: Visit.filter(visited_at__gte=START, visited_at__lt=START + dt.timedelta(days=31)).using_db(db)
         .count(), per_person=False),
    Step("tt-join-sum", "exact", "Visit.annotate(amount=Sum('amount')).group_by('person__sex')",
         lambda db: Visit.all().using_db(db).annotate(total=Sum("amount")).group_by("person__sex")
         .order_by("person__sex").values("person__sex", "total"), keys=("person__sex",), per_person=False),
    Step("tt-max", "refused", "Adult.annotate(oldest=Max('age')).values('oldest')",
         lambda db: Adult.all().using_db(db).annotate(oldest=Max("age")).values("oldest"), refusal="max()"),
    Step("tt-get", "refused", "Adult.get(id=1)", lambda db: Adult.get(id=1).using_db(db), refusal="row-level"),
    Step("tt-exists", "refused", "Adult.filter(age__gt=90).exists()",
         lambda db: Adult.filter(age__gt=90).using_db(db).exists(), refusal="must aggregate"),
)
