"""What a Django application or admin dashboard asks of the demo tables, with the real Django ORM.

Django is configured once per process (:func:`configure`) with one database alias per connection the tests need
(through the proxy as each role, and directly to PostgreSQL as its superuser or under ``-c role=...``), settings
``USE_TZ=True`` and ``TIME_ZONE='Europe/Paris'`` (so its date functions send ``AT TIME ZONE``), and this module as
its one app (so the reverse relation ``Adult.visits`` exists). Unmanaged models over ``public.adult`` and the linked
``public.visits`` (:func:`models`) are defined once Django is set up.

Each :class:`Step` is one ORM call as its user writes it; ``run(alias)`` returns its result as rows (a list of
dicts), so the same call can be compared across connections. The kind says what a gated role must get:

* ``catalog``: PostgreSQL's own answer for that role (the role's privileges on the catalogs);
* ``counts``: counts by groups, some of them small: a suppress role's rows are those the suppression oracle
  releases (``people(alias)`` lists each group's people, when "n" does not count them), a dp role's groups come
  from the column's public domain;
* ``exact``: an aggregate whose every group holds thousands of people: a suppress role gets PostgreSQL's answer;
* ``row-sample``: ``inspectdb``, which reads one row of each table for its column types (``SELECT * ... LIMIT
  1``): that read is refused, and inspectdb says so in its output for the table;
* ``refused``: a statement that could single a person out (rows, whether someone exists, an extreme): refused,
  with a message naming ``refusal``.

Used by tests/test_orm_django.py.
"""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # catalog, counts, exact or refused
    what: str  # the ORM call, as its user writes it
    run: Callable[[str], Rows]
    keys: tuple[str, ...] = ()  # counts: the grouping fields (the count is field "n")
    people: Callable[[str], Rows] | None = None  # counts: each group's people (a row per group and "person")
    per_person: bool = True  # over public.adult (one row per person), not the linked visits
    refusal: str = ""  # refused: what the message must name


def configure(databases: dict[str, dict[str, Any]]) -> None:
    """Django set up once, with ``databases`` (alias to its settings) as its connections."""
    import django
    from django.conf import settings

    settings.configure(DATABASES=databases, USE_TZ=True, TIME_ZONE="Europe/Paris", INSTALLED_APPS=["orm_django"],
                       DEFAULT_AUTO_FIELD="django.db.models.AutoField")
    django.setup()


def database(host: str, port: int, dbname: str, user: str, password: str, options: str | None = None,
             server_side_binding: bool = False) -> dict[str, Any]:
    """One alias's settings: Django's PostgreSQL backend (psycopg 3), a connection per query set; values inlined
    by psycopg on the client (Django's default) or sent as $n parameters (``server_side_binding``)."""
    settings: dict[str, Any] = {"ENGINE": "django.db.backends.postgresql", "HOST": host, "PORT": port,
                                "NAME": dbname, "USER": user, "PASSWORD": password, "CONN_MAX_AGE": 0,
                                "OPTIONS": {"server_side_binding": server_side_binding}}
    if options is not None:
        settings["OPTIONS"]["options"] = options
    return settings


@cache
def models() -> tuple[Any, Any]:
    """The unmanaged models ``Adult`` (public.adult) and ``Visit`` (public.visits, ``person`` a foreign key)."""
    from django.db import models as m

    class Adult(m.Model):
        id = m.IntegerField(primary_key=True)
        age = m.IntegerField()
        workclass = m.TextField()
        education = m.TextField()
        occupation = m.TextField()
        race = m.TextField()
        sex = m.TextField()
        capital_gain = m.IntegerField()
        hours_per_week = m.IntegerField()
        native_country = m.TextField()
        income = m.TextField()

        class Meta:
            app_label = "orm_django"
            db_table = "adult"
            managed = False

    class Visit(m.Model):
        visit_id = m.BigIntegerField(primary_key=True)
        person = m.ForeignKey(Adult, m.DO_NOTHING, db_column="person_id", related_name="visits")
        visited_at = m.DateTimeField()
        channel = m.TextField()
        amount = m.DecimalField(max_digits=10, decimal_places=2)

        class Meta:
            app_label = "orm_django"
            db_table = "visits"
            managed = False

    return Adult, Visit


def _plain(value: Any) -> Any:
    """A value comparable across connections: floats to 9 significant digits (a rewritten statement may add up in
    another order), Decimals as they are."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    return value


def _rows(result: Any) -> Rows:
    """A query set of dicts, one dict (aggregate()), or a scalar, as rows of plain values."""
    if isinstance(result, dict):
        result = [result]
    elif not isinstance(result, list):
        result = list(result)
    return [{name: _plain(value) for name, value in row.items()} for row in result]


def _value(name: str, value: Any) -> Rows:
    return [{name: _plain(value)}]


def _adult() -> Any:
    return models()[0].objects


def _visits() -> Any:
    return models()[1].objects


def _table_list(alias: str) -> Rows:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        tables = connections[alias].introspection.get_table_list(cursor)
    return sorted(({"name": table.name, "type": table.type} for table in tables), key=lambda row: row["name"])


def _inspectdb(alias: str) -> Rows:
    from django.core.management import call_command

    out = io.StringIO()
    call_command("inspectdb", "adult", "visits", database=alias, stdout=out)
    return [{"models": out.getvalue()}]


def _count(**filters: Any) -> Callable[[str], Rows]:
    return lambda alias: _value("count", _adult().using(alias).filter(**filters).count())


def _by(*keys: str, **filters: Any) -> Callable[[str], Rows]:
    from django.db.models import Count

    return lambda alias: _rows(_adult().using(alias).filter(**filters).values(*keys).annotate(n=Count("id"))
                               .order_by(*keys))


def _several(alias: str) -> Rows:
    from django.db.models import Avg, Count, StdDev, Sum, Variance

    return _rows(_adult().using(alias).filter(age__gte=18).aggregate(
        n=Count("id"), total_gain=Sum("capital_gain"), mean_age=Avg("age"), sd_hours=StdDev("hours_per_week"),
        var_hours=Variance("hours_per_week")))


def _extremes(alias: str) -> Rows:
    from django.db.models import Max, Min

    return _rows(_adult().using(alias).aggregate(youngest=Min("age"), oldest=Max("age")))


def _countries(alias: str) -> Rows:
    from django.db.models import Count

    return _rows(_adult().using(alias).aggregate(countries=Count("native_country", distinct=True)))


def _conditional(alias: str) -> Rows:
    from django.db.models import Count, Q

    return _rows(_adult().using(alias).aggregate(women=Count("id", filter=Q(sex="Female")),
                                                 rich=Count("id", filter=Q(income=">50K"))))


def _case_when(alias: str) -> Rows:
    from django.db.models import Case, Count, IntegerField, Sum, When

    return _rows(_adult().using(alias).values("race").annotate(
        n=Count("id"),
        high=Sum(Case(When(income=">50K", then=1), default=0, output_field=IntegerField()))).order_by("race"))


def _top_occupations(alias: str) -> Rows:
    from django.db.models import Count

    return _rows(_adult().using(alias).values("occupation").annotate(n=Count("id")).order_by("-n")[:5])


def _hours_by_education(alias: str) -> Rows:
    from django.db.models import Avg, Count

    return _rows(_adult().using(alias).filter(age__gt=40).values("education")
                 .annotate(hours=Avg("hours_per_week"), n=Count("id")).filter(n__gte=500).order_by("education"))


def _spenders_by_sex(alias: str) -> Rows:
    """People with a web visit, by sex: the subquery selects people, the count is what leaves."""
    from django.db.models import Count

    web = _visits().using(alias).filter(channel="web").values("person_id")
    return _rows(_adult().using(alias).filter(id__in=web).values("sex").annotate(n=Count("id")).order_by("sex"))


def _mean_visits(alias: str) -> Rows:
    """Each person's visits counted in a correlated Subquery(OuterRef), averaged over people."""
    from django.db.models import Avg, Count, OuterRef, Subquery

    per_person = (_visits().using(alias).filter(person=OuterRef("pk")).values("person")
                  .annotate(c=Count("*")).values("c"))
    return _rows(_adult().using(alias).annotate(visit_count=Subquery(per_person)).aggregate(mean=Avg("visit_count")))


def _mean_visits_joined(alias: str) -> Rows:
    """The same average with a join: each person's visits counted in an aggregate query grouped by adult.id."""
    from django.db.models import Avg, Count

    return _rows(_adult().using(alias).annotate(n=Count("visits")).aggregate(mean=Avg("n")))


def _educations(alias: str) -> Rows:
    values = _adult().using(alias).order_by("education").distinct().values_list("education", flat=True)
    return [{"education": value} for value in values]


def _monthly(alias: str) -> Rows:
    from django.db.models import Count, Sum
    from django.db.models.functions import TruncMonth

    return _rows(_visits().using(alias).filter(visited_at__year=2025).annotate(month=TruncMonth("visited_at"))
                 .values("month").annotate(n=Count("visit_id"), amount=Sum("amount")).order_by("month"))


def _yearly(alias: str) -> Rows:
    """Visits by year in Europe/Paris: the last hour of 2026 (UTC) is 2027 there, a handful of people."""
    from django.db.models import Count
    from django.db.models.functions import ExtractYear

    return _rows(_visits().using(alias).annotate(year=ExtractYear("visited_at")).values("year")
                 .annotate(n=Count("visit_id")).order_by("year"))


def _people_by_year(alias: str) -> Rows:
    from django.db.models.functions import ExtractYear

    return _rows(_visits().using(alias).annotate(year=ExtractYear("visited_at")).values("year", "person_id")
                 .distinct())


def _people_by_education(alias: str) -> Rows:
    from django.db.models import F

    return _rows(_adult().using(alias).annotate(person_id=F("id")).values("education", "person_id"))


def _march(alias: str) -> Rows:
    start = dt.datetime(2025, 3, 1, tzinfo=dt.timezone.utc)
    return _value("count", _visits().using(alias).filter(visited_at__gte=start,
                                                         visited_at__lt=start + dt.timedelta(days=31)).count())


def _amount_by_sex(alias: str) -> Rows:
    from django.db.models import Sum

    return _rows(_visits().using(alias).values("person__sex").annotate(amount=Sum("amount")).order_by("person__sex"))


def _visits_by_sex(alias: str) -> Rows:
    from django.db.models import Count

    return _rows(_adult().using(alias).values("sex").annotate(visits=Count("visits")).order_by("sex"))


def _exists(alias: str) -> Rows:
    return _value("exists", _adult().using(alias).filter(age__gt=90).exists())


def _first(alias: str) -> Rows:
    return _value("id", _adult().using(alias).order_by("id").first().id)


def _oldest_ids(alias: str) -> Rows:
    return _rows(_adult().using(alias).filter(age__gt=85).values("id", "age")[:10])


STEPS: tuple[Step, ...] = (
    Step("dj-table-list", "catalog", "connection.introspection.get_table_list(cursor)", _table_list),
    Step("dj-inspectdb", "row-sample", "manage.py inspectdb adult visits", _inspectdb),
    Step("dj-count-by-sex", "counts", "Adult.objects.values('sex').annotate(n=Count('id'))", _by("sex"),
         ("sex",)),
    Step("dj-count-by-education", "counts", "Adult.objects.values('education').annotate(n=Count('id'))",
         _by("education"), ("education",)),
    Step("dj-count-by-two", "counts", "Adult.objects.values('sex', 'race').annotate(n=Count('id'))",
         _by("sex", "race"), ("sex", "race")),
    Step("dj-exact-filter", "counts", "Adult.objects.filter(sex='Female').values('race').annotate(n=Count('id'))",
         _by("race", sex="Female"), ("race",)),
    Step("dj-range-filter", "counts",
         "Adult.objects.filter(age__gte=30, age__lt=40).values('education').annotate(n=Count('id'))",
         _by("education", age__gte=30, age__lt=40), ("education",)),
    Step("dj-in-filter", "counts",
         "Adult.objects.filter(race__in=['White', 'Black']).values('workclass').annotate(n=Count('id'))",
         _by("workclass", race__in=["White", "Black"]), ("workclass",)),
    Step("dj-icontains", "exact", "Adult.objects.filter(occupation__icontains='sales').count()",
         _count(occupation__icontains="sales")),
    Step("dj-istartswith", "exact", "Adult.objects.filter(native_country__istartswith='united').count()",
         _count(native_country__istartswith="united")),
    Step("dj-isnull", "exact", "Adult.objects.filter(workclass__isnull=False).count()",
         _count(workclass__isnull=False)),
    Step("dj-number-range", "exact", "Adult.objects.filter(hours_per_week__range=(35, 45)).count()",
         _count(hours_per_week__range=(35, 45))),
    Step("dj-filtered-count", "exact", "Adult.objects.filter(education='Bachelors', sex='Female').count()",
         _count(education="Bachelors", sex="Female")),
    Step("dj-aggregate-several", "exact",
         "Adult.objects.filter(age__gte=18).aggregate(Count, Sum, Avg, StdDev, Variance)", _several),
    Step("dj-min-max", "refused", "Adult.objects.aggregate(youngest=Min('age'), oldest=Max('age'))", _extremes,
         refusal="min()"),
    Step("dj-count-distinct", "exact", "Adult.objects.aggregate(countries=Count('native_country', distinct=True))",
         _countries),
    Step("dj-count-filter-q", "exact", "Adult.objects.aggregate(women=Count('id', filter=Q(sex='Female')), ...)",
         _conditional),
    Step("dj-case-when-sum", "exact",
         "Adult.objects.values('race').annotate(n=Count('id'), high=Sum(Case(When(income='>50K', then=1), "
         "default=0)))", _case_when),
    Step("dj-top-n", "exact", "Adult.objects.values('occupation').annotate(n=Count('id')).order_by('-n')[:5]",
         _top_occupations),
    Step("dj-values-annotate-having", "exact",
         "Adult.objects.filter(age__gt=40).values('education').annotate(hours=Avg(...), n=Count('id'))"
         ".filter(n__gte=500)", _hours_by_education),
    Step("dj-subquery-in", "exact",
         "Adult.objects.filter(id__in=Visit.objects.filter(channel='web').values('person_id')).values('sex')"
         ".annotate(n=Count('id'))", _spenders_by_sex),
    Step("dj-subquery-outerref", "refused",
         "Adult.objects.annotate(visit_count=Subquery(Visit...filter(person=OuterRef('pk'))...Count('*')))"
         ".aggregate(Avg('visit_count'))", _mean_visits, per_person=False, refusal="subqueries"),
    Step("dj-annotate-then-aggregate", "refused", "Adult.objects.annotate(n=Count('visits')).aggregate(Avg('n'))",
         _mean_visits_joined, per_person=False, refusal="grouped by the privacy unit adult.id"),
    Step("dj-distinct-values-list", "counts",
         "Adult.objects.order_by('education').distinct().values_list('education', flat=True)", _educations,
         ("education",), _people_by_education),
    Step("dj-trunc-month", "exact",
         "Visit.objects.filter(visited_at__year=2025).annotate(month=TruncMonth('visited_at')).values('month')"
         ".annotate(n=Count('visit_id'), amount=Sum('amount'))", _monthly, per_person=False),
    Step("dj-extract-year", "counts",
         "Visit.objects.annotate(year=ExtractYear('visited_at')).values('year').annotate(n=Count('visit_id'))",
         _yearly, ("year",), _people_by_year, per_person=False),
    Step("dj-date-range", "exact", "Visit.objects.filter(visited_at__gte=start, visited_at__lt=end).count()",
         _march, per_person=False),
    Step("dj-join-sum", "exact", "Visit.objects.values('person__sex').annotate(amount=Sum('amount'))",
         _amount_by_sex, per_person=False),
    Step("dj-reverse-join-count", "exact", "Adult.objects.values('sex').annotate(visits=Count('visits'))",
         _visits_by_sex, per_person=False),
    Step("dj-exists", "refused", "Adult.objects.filter(age__gt=90).exists()", _exists),
    Step("dj-first", "refused", "Adult.objects.order_by('id').first()", _first),
    Step("dj-rows", "refused", "Adult.objects.filter(age__gt=85).values('id', 'age')[:10]", _oldest_ids),
)
