"""What analysts' and application developers' libraries do over the demo tables, run with the real libraries.

Each workload is a list of steps of one library: a step calls the library as
its user would (pandas.read_sql over SQLAlchemy or a psycopg connection,
Polars read_database, Ibis expressions (grouping, time buckets, windows over groups, top-k, joins), Peewee and SQLAlchemy ORM queries,
their catalog introspection) and returns what the library returned, made
comparable (a sorted list of rows). The kind says what a gated role must get:
``catalog`` and ``aggregate`` answered, ``row-level`` refused.

Used by tests/test_bi_libraries.py (each step through the proxy as dba,
reporter and analyst) and tests/bi_corpus/capture_libraries.py (the SQL each
step sends, recorded into the corpus files tests/bi_corpus/<library>.yaml).
"""

from __future__ import annotations

import datetime as dt
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

Rows = list[tuple[object, ...]]


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # catalog, aggregate or row-level
    what: str  # the library call, as its user writes it
    run: Callable[[Any], object]
    time_series: bool = False


@dataclass(frozen=True)
class Library:
    tool: str  # the corpus's tool name
    file: str  # tests/bi_corpus/<file>.yaml
    version: str
    connect: Callable[[str], Any]  # a libpq URL to the library's handle
    close: Callable[[Any], None]
    steps: tuple[Step, ...]


def _frame_rows(frame: Any) -> Rows:
    """A pandas or Polars data frame as sorted rows of plain values (None sorts first)."""
    rows = frame.rows() if hasattr(frame, "rows") else list(frame.itertuples(index=False, name=None))
    return sorted((tuple(None if _missing(v) else v for v in row) for row in rows), key=repr)


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


# --- pandas -------------------------------------------------------------------------------------------------------

def _sqlalchemy_engine(url: str) -> Any:
    import sqlalchemy

    return sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"), poolclass=_null_pool())


def _null_pool() -> Any:
    from sqlalchemy.pool import NullPool

    return NullPool


def _pandas(sql: str, params: object = None) -> Callable[[Any], object]:
    def run(engine: Any) -> object:
        import pandas as pd
        import sqlalchemy

        return _frame_rows(pd.read_sql(sqlalchemy.text(sql), engine, params=params))
    return run


def _pandas_dbapi(sql: str, params: object = None) -> Callable[[Any], object]:
    """pandas.read_sql over a plain psycopg connection (pandas warns that it tests only SQLAlchemy and sqlite3)."""
    def run(engine: Any) -> object:
        import pandas as pd

        with engine.raw_connection() as raw, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return _frame_rows(pd.read_sql(sql, raw.driver_connection, params=params))
    return run


def _pandas_table_names(engine: Any) -> object:
    import sqlalchemy

    return sorted(sqlalchemy.inspect(engine).get_table_names())


def _pandas_read_table(engine: Any) -> object:
    import pandas as pd

    return len(pd.read_sql_table("adult", engine))


PANDAS = Library("pandas", "pandas", "pandas 3.1 over SQLAlchemy 2.1 (postgresql+psycopg) and psycopg 3.3",
                 _sqlalchemy_engine, lambda engine: engine.dispose(), (
    Step("pd-count-by-sex", "aggregate", "pd.read_sql(text('select sex, count(*) as n from adult group by sex'), "
         "engine)", _pandas("select sex, count(*) as n from adult group by sex")),
    Step("pd-avg-by-education", "aggregate", "pd.read_sql(text(...), engine, params={'age': 40}): bound :age",
         _pandas("select education, avg(hours_per_week) as hours, count(*) as n from adult where age > :age "
                 "group by education order by education", {"age": 40})),
    Step("pd-monthly-visits", "aggregate", "pd.read_sql(text(...date_trunc('month', visited_at)...), engine)",
         _pandas("select date_trunc('month', visited_at) as month, count(*) as visits, sum(amount) as amount "
                 "from visits group by 1 order by 1"), time_series=True),
    Step("pd-dbapi-count-by-race", "aggregate", "pd.read_sql('select race, count(*) ...', psycopg connection)",
         _pandas_dbapi("select race, count(*) as n from adult group by race order by race")),
    Step("pd-dbapi-daily-range", "aggregate", "pd.read_sql(sql, psycopg connection, params=(start, end)): "
         "a daily series over a bound range",
         _pandas_dbapi("select date_trunc('day', visited_at) as day, count(*) as visits from visits "
                       "where visited_at >= %s and visited_at < %s group by 1 order by 1",
                       (dt.datetime(2025, 3, 1, tzinfo=dt.UTC), dt.datetime(2025, 4, 1, tzinfo=dt.UTC))),
         time_series=True),
    Step("pd-table-names", "catalog", "sqlalchemy.inspect(engine).get_table_names(), as pandas' "
         "SQLDatabase does", _pandas_table_names),
    Step("pd-read-sql-table", "row-level", "pd.read_sql_table('adult', engine): every row", _pandas_read_table),
))


# --- Polars -------------------------------------------------------------------------------------------------------

def _polars(sql: str, *, dbapi: bool = False) -> Callable[[Any], object]:
    def run(engine: Any) -> object:
        import polars as pl

        if dbapi:
            with engine.raw_connection() as raw:
                return _frame_rows(pl.read_database(sql, raw.driver_connection))
        with engine.connect() as conn:
            return _frame_rows(pl.read_database(sql, conn))
    return run


POLARS = Library("Polars", "polars", "Polars 2.1 read_database over SQLAlchemy 2.1 and psycopg 3.3",
                 _sqlalchemy_engine, lambda engine: engine.dispose(), (
    Step("pl-count-by-workclass", "aggregate", "pl.read_database(sql, sqlalchemy connection)",
         _polars("select workclass, count(*) as n, avg(age) as avg_age from adult group by workclass")),
    Step("pl-dbapi-sum-by-channel", "aggregate", "pl.read_database(sql, psycopg connection)",
         _polars("select channel, sum(amount) as amount, count(*) as visits from visits group by channel",
                 dbapi=True)),
    Step("pl-weekly", "aggregate", "pl.read_database(sql, psycopg connection): a weekly series",
         _polars("select date_trunc('week', visited_at) as week, count(*) as visits from visits "
                 "where visited_at >= '2025-01-06' and visited_at < '2025-04-07' group by 1 order by 1",
                 dbapi=True), time_series=True),
    Step("pl-rows", "row-level", "pl.read_database('select * from adult', connection)",
         _polars("select * from adult")),
))


# --- Ibis ---------------------------------------------------------------------------------------------------------

def _ibis_connect(url: str) -> Any:
    import ibis

    return ibis.postgres.from_connection(psycopg.connect(url, autocommit=True))


def _ibis(build: Callable[[Any, Any], Any]) -> Callable[[Any], object]:
    """Build an expression over ``adult`` and ``visits`` and execute it to a pandas frame."""
    def run(con: Any) -> object:
        return _frame_rows(build(con.table("adult"), con.table("visits")).execute())
    return run


def _ibis_top_occupations(adult: Any, _visits: Any) -> Any:
    return adult.occupation.topk(5)


def _ibis_monthly(_adult: Any, visits: Any) -> Any:
    month = visits.visited_at.truncate("M").name("month")
    return visits.group_by(month).aggregate(visits=visits.count(), amount=visits.amount.sum()).order_by("month")


def _ibis_share_of_total(adult: Any, _visits: Any) -> Any:
    """A window over the groups: each education's share of all people."""
    import ibis

    grouped = adult.group_by("education").aggregate(n=adult.count())
    return grouped.mutate(share=grouped.n / grouped.n.sum().over(ibis.window()))


def _ibis_rank(adult: Any, _visits: Any) -> Any:
    import ibis

    grouped = adult.group_by("occupation").aggregate(n=adult.count())
    return grouped.mutate(r=ibis.rank().over(order_by=ibis.desc("n")))


IBIS = Library("Ibis", "ibis", "ibis-framework 12.0 (postgres backend, psycopg 3.3)", _ibis_connect,
               lambda con: con.disconnect(), (
    Step("ib-list-tables", "catalog", "con.list_tables()", lambda con: sorted(con.list_tables())),
    Step("ib-get-schema", "catalog", "con.table('adult').schema() (con.get_schema)",
         lambda con: list(con.get_schema("adult").names)),
    Step("ib-group-aggregate", "aggregate", "t.group_by('sex').aggregate(n=t.count(), avg_age=t.age.mean())",
         _ibis(lambda t, _v: t.group_by("sex").aggregate(n=t.count(), avg_age=t.age.mean()))),
    Step("ib-filter-aggregate", "aggregate", "t.filter(t.age > 40).group_by(['race', 'income'])"
         ".aggregate(hours=t.hours_per_week.mean())",
         _ibis(lambda t, _v: t.filter(t.age > 40).group_by(["race", "income"])
               .aggregate(hours=t.hours_per_week.mean()))),
    Step("ib-topk", "aggregate", "t.occupation.topk(5)", _ibis(_ibis_top_occupations)),
    Step("ib-monthly", "aggregate", "v.group_by(v.visited_at.truncate('M')).aggregate(...)",
         _ibis(_ibis_monthly), time_series=True),
    Step("ib-window-share", "aggregate", "g = t.group_by('education').aggregate(n=t.count()); "
         "g.mutate(share=g.n / g.n.sum().over(ibis.window()))", _ibis(_ibis_share_of_total)),
    Step("ib-year", "aggregate", "v.group_by(year=v.visited_at.year()).aggregate(n=v.count())",
         _ibis(lambda _t, v: v.group_by(year=v.visited_at.year()).aggregate(n=v.count())), time_series=True),
    Step("ib-weekly", "aggregate", "v.group_by(week=v.visited_at.truncate('W')).aggregate(n=v.count())",
         _ibis(lambda _t, v: v.group_by(week=v.visited_at.truncate("W")).aggregate(n=v.count())), time_series=True),
    Step("ib-weekday", "aggregate", "v.group_by(day=v.visited_at.day_of_week.index()).aggregate(n=v.count())",
         _ibis(lambda _t, v: v.group_by(day=v.visited_at.day_of_week.index()).aggregate(n=v.count())),
         time_series=True),
    Step("ib-nunique-std", "aggregate", "t.group_by('sex').aggregate(k=t.education.nunique(), s=t.age.std())",
         _ibis(lambda t, _v: t.group_by("sex").aggregate(k=t.education.nunique(), s=t.age.std()))),
    Step("ib-case-bucket", "aggregate", "t.group_by(older=t.age > 50, band=t.age.bucket([0, 30, 50, 100]))"
         ".aggregate(n=t.count())",
         _ibis(lambda t, _v: t.group_by(older=t.age > 50, band=t.age.bucket([0, 30, 50, 100])).aggregate(n=t.count()))),
    Step("ib-value-counts", "aggregate", "t.race.value_counts()", _ibis(lambda t, _v: t.race.value_counts())),
    Step("ib-join", "aggregate", "v.join(t, v.person_id == t.id).group_by('sex').aggregate(a=v.amount.mean())",
         _ibis(lambda t, v: v.join(t, v.person_id == t.id).group_by("sex").aggregate(a=v.amount.mean()))),
    Step("ib-rank", "aggregate", "g = t.group_by('occupation').aggregate(n=t.count()); "
         "g.mutate(r=ibis.rank().over(order_by=ibis.desc('n')))", _ibis(_ibis_rank)),
    Step("ib-count", "aggregate", "t.count().execute()",
         lambda con: int(con.table("adult").count().execute())),
    Step("ib-head", "row-level", "t.head(10).execute()",
         lambda con: len(con.table("adult").head(10).execute())),
))


# --- Peewee -------------------------------------------------------------------------------------------------------

@dataclass
class PeeweeHandle:
    db: Any
    adult: Any
    visit: Any


def _peewee_connect(url: str) -> PeeweeHandle:
    import peewee as pw
    from playhouse.db_url import parse

    options = parse(url)
    db = pw.PostgresqlDatabase(options.pop("database"), prefer_psycopg3=True, autoconnect=True, **options)

    class Adult(pw.Model):
        age = pw.IntegerField()
        sex = pw.TextField()
        education = pw.TextField()
        hours_per_week = pw.IntegerField()
        income = pw.TextField()

        class Meta:
            database, table_name = db, "adult"

    class Visit(pw.Model):
        visit_id = pw.BigIntegerField(primary_key=True)
        person = pw.ForeignKeyField(Adult, column_name="person_id")
        visited_at = pw.DateTimeField()
        channel = pw.TextField()
        amount = pw.DecimalField()

        class Meta:
            database, table_name = db, "visits"

    return PeeweeHandle(db, Adult, Visit)


def _peewee_rows(query: Any) -> Rows:
    return sorted(query.tuples(), key=repr)


def _peewee_by_sex(h: PeeweeHandle) -> object:
    import peewee as pw

    return _peewee_rows(h.adult.select(h.adult.sex, pw.fn.COUNT(h.adult.id)).group_by(h.adult.sex))


def _peewee_avg_having(h: PeeweeHandle) -> object:
    import peewee as pw

    a = h.adult
    hours = pw.fn.AVG(a.hours_per_week)
    return _peewee_rows(a.select(a.education, hours.alias("hours")).where(a.age >= 30).group_by(a.education)
                        .having(pw.fn.COUNT(a.id) > 100).order_by(hours.desc()))


def _peewee_monthly(h: PeeweeHandle) -> object:
    import peewee as pw

    v = h.visit
    # by position: with psycopg 3 Peewee binds 'month' once per use ($1, $2), and PostgreSQL does not take
    # date_trunc($2, ...) in GROUP BY for the date_trunc($1, ...) of the select list
    month = pw.fn.date_trunc("month", v.visited_at)
    return _peewee_rows(v.select(month.alias("month"), pw.fn.SUM(v.amount)).group_by(pw.SQL("1")).order_by(pw.SQL("1")))


def _peewee_join(h: PeeweeHandle) -> object:
    import peewee as pw

    a, v = h.adult, h.visit
    return _peewee_rows(v.select(a.income, v.channel, pw.fn.AVG(v.amount)).join(a).group_by(a.income, v.channel))


def _peewee_year_part(h: PeeweeHandle) -> object:
    import peewee as pw

    v = h.visit
    year = v.visited_at.year  # Peewee's EXTRACT(YEAR FROM ...) for a DateTimeField
    return _peewee_rows(v.select(year.alias("year"), pw.fn.COUNT(v.visit_id)).group_by(year).order_by(year))


PEEWEE = Library("Peewee", "peewee", "Peewee 4.5 (PostgresqlDatabase over psycopg 3.3)", _peewee_connect,
                 lambda h: h.db.close(), (
    Step("pw-get-tables", "catalog", "db.get_tables()", lambda h: sorted(h.db.get_tables())),
    Step("pw-get-columns", "catalog", "db.get_columns('adult')",
         lambda h: sorted(c.name for c in h.db.get_columns("adult"))),
    Step("pw-get-indexes", "catalog", "db.get_indexes('visits')",
         lambda h: sorted(i.name for i in h.db.get_indexes("visits"))),
    Step("pw-count-by-sex", "aggregate", "Adult.select(Adult.sex, fn.COUNT(Adult.id)).group_by(Adult.sex)",
         _peewee_by_sex),
    Step("pw-avg-having", "aggregate", "Adult.select(...).where(Adult.age >= 30).group_by(Adult.education)"
         ".having(fn.COUNT(Adult.id) > 100)", _peewee_avg_having),
    Step("pw-count", "aggregate", "Adult.select().count()", lambda h: h.adult.select().count()),
    Step("pw-monthly", "aggregate", "Visit.select(fn.date_trunc('month', Visit.visited_at), fn.SUM(...))"
         ".group_by(SQL('1'))", _peewee_monthly, time_series=True),
    Step("pw-year-part", "aggregate", "Visit.select(Visit.visited_at.year, fn.COUNT(...)).group_by(...)",
         _peewee_year_part, time_series=True),
    Step("pw-join", "aggregate", "Visit.select(Adult.income, Visit.channel, fn.AVG(Visit.amount)).join(Adult)"
         ".group_by(...)", _peewee_join),
    Step("pw-rows", "row-level", "list(Adult.select().where(Adult.age > 80))",
         lambda h: len(list(h.adult.select().where(h.adult.age > 80)))),
))

LIBRARIES = (PANDAS, POLARS, IBIS, PEEWEE)


@contextmanager
def opened(library: Library, url: str) -> Iterator[Any]:
    handle = library.connect(url)
    try:
        yield handle
    finally:
        library.close(handle)


def psycopg_error(error: BaseException) -> psycopg.Error | None:
    """The psycopg error a library raised, wrapped (SQLAlchemy, pandas) or not."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, psycopg.Error):
            return seen
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return None
