"""What an application or dashboard asks of the demo tables with SQLAlchemy 2, Core and ORM, SQLModel and PyPika.

Each :class:`Step` is one call as its user writes it. Statement steps build a SQLAlchemy statement (a ``select()``
over the ORM models, over SQLModel's, or over Core tables; PyPika's query as its text, ``text(str(query))``, its
``Parameter(':name')`` bound by SQLAlchemy) that tests/test_orm_sqlalchemy.py runs in a ``Session`` or
``AsyncSession``; inspection steps run the engine's ``Inspector``. The same step thus runs over both PostgreSQL
dialects SQLAlchemy ships for our drivers: ``postgresql+psycopg`` (psycopg 3, values sent as ``$n`` parameters)
and ``postgresql+asyncpg`` (asyncpg, named prepared statements, string values cast: ``$1::VARCHAR``). The kind says
what a gated role must get:

* ``catalog``: PostgreSQL's own answer for that role (its privileges on the catalogs);
* ``counts``: counts of people by groups, some of them small: a suppress role's rows are those the suppression
  oracle releases (``people`` lists each group's people when "n" does not count them); a dp role's groups come from
  the column's public domain;
* ``exact``: an aggregate whose every group holds thousands of people: a suppress role gets PostgreSQL's answer;
* ``empty``: an aggregate without GROUP BY over fewer than k people: a suppress role gets no row (query-set-size
  control, docs/suppression.md), where PostgreSQL answers one;
* ``refused``: a statement that could single a person out (rows, a row by its key, whether someone exists, an
  extreme): refused, with a message naming ``refusal``.

Used by tests/test_orm_sqlalchemy.py.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Optional

import pypika
from pypika import functions as pk
from sqlalchemy import (Column, DateTime, Executable, ForeignKey, Inspector, Integer, MetaData, Numeric, Table,
                        Text, case, distinct, exists, extract, func, select, text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlmodel import Field, SQLModel
from sqlmodel import select as sqlmodel_select

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # catalog, counts, exact, empty or refused
    what: str  # the call, as its user writes it
    statement: Callable[[], Executable] | None = None  # a statement step
    inspect: Callable[[Inspector], Rows] | None = None  # an inspection step
    keys: tuple[str, ...] = ()  # counts: the grouping fields (the count of people is field "n")
    people: Callable[[], Executable] | None = None  # counts: each group's people (a row per group and person_id)
    per_person: bool = True  # over public.adult (one row per person), not the linked visits
    refusal: str = ""  # refused: what the message must name
    sqlmodel: bool = False  # run with SQLModel's session.exec, not SQLAlchemy's session.execute


class Base(DeclarativeBase):
    pass


class Adult(Base):
    __tablename__ = "adult"
    id: Mapped[int] = mapped_column(primary_key=True)
    age: Mapped[int]
    workclass: Mapped[Optional[str]]
    education: Mapped[str]
    occupation: Mapped[Optional[str]]
    race: Mapped[str]
    sex: Mapped[str]
    capital_gain: Mapped[int]
    hours_per_week: Mapped[int]
    native_country: Mapped[Optional[str]]
    income: Mapped[str]
    visits: Mapped[list[Visit]] = relationship(back_populates="person")


class Visit(Base):
    __tablename__ = "visits"
    visit_id: Mapped[int] = mapped_column(primary_key=True)
    person_id: Mapped[int] = mapped_column(ForeignKey("adult.id"))
    visited_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    channel: Mapped[str]
    amount: Mapped[Decimal] = mapped_column(Numeric(10, 2))
    person: Mapped[Adult] = relationship(back_populates="visits")


class Person(SQLModel, table=True):
    """SQLModel's model of public.adult (a pydantic model and a SQLAlchemy table at once)."""
    __tablename__ = "adult"
    id: int = Field(primary_key=True)
    age: int
    sex: str
    race: str
    education: str
    hours_per_week: int


# Core: the tables as a Core application declares them (no ORM classes); MetaData of its own.
CORE = MetaData()
ADULT = Table("adult", CORE, Column("id", Integer, primary_key=True), Column("age", Integer),
              Column("education", Text), Column("workclass", Text), Column("sex", Text), Column("race", Text),
              Column("hours_per_week", Integer), Column("capital_gain", Integer))
VISITS = Table("visits", CORE, Column("visit_id", Integer, primary_key=True),
               Column("person_id", Integer, ForeignKey("adult.id")), Column("visited_at", DateTime(timezone=True)),
               Column("channel", Text), Column("amount", Numeric(10, 2)))


def _plain(value: Any) -> Any:
    """A value comparable across connections and drivers: floats to 9 significant digits (a rewritten statement may
    add up in another order), numbers of a fractional type to float, datetimes to UTC."""
    if isinstance(value, (float, Decimal)) and not (isinstance(value, Decimal) and value == value.to_integral()):
        return float(f"{float(value):.9g}")
    if isinstance(value, Decimal):
        return int(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.timezone.utc)
    if hasattr(value, "__table__"):  # an ORM or SQLModel object: its columns' values
        return tuple((column.key, _plain(getattr(value, column.key))) for column in value.__table__.columns)
    return value


def rows(result: Any) -> Rows:
    """A SQLAlchemy result as rows of plain values: its mappings, or (SQLModel's ``exec`` of one entity) its
    objects."""
    if not hasattr(result, "mappings"):
        return [{"row": _plain(value)} for value in result]
    return [{name: _plain(value) for name, value in row.items()} for row in result.mappings()]


def _table_names(inspector: Inspector) -> Rows:
    return [{"name": name} for name in sorted(inspector.get_table_names())]


def _columns(inspector: Inspector) -> Rows:
    return [{"name": column["name"], "type": str(column["type"]), "nullable": column["nullable"]}
            for column in inspector.get_columns("adult")]


def _foreign_keys(inspector: Inspector) -> Rows:
    return [{"columns": key["constrained_columns"], "table": key["referred_table"]}
            for key in inspector.get_foreign_keys("visits")]


def _by(*keys: str, where: Any = None) -> Callable[[], Executable]:
    """``select(Adult.k..., func.count(Adult.id).label('n')).where(...).group_by(...).order_by(...)``."""
    def statement() -> Executable:
        columns = [getattr(Adult, key) for key in keys]
        query = select(*columns, func.count(Adult.id).label("n")).group_by(*columns).order_by(*columns)
        return query if where is None else query.where(where())
    return statement


def _count(where: Callable[[], Any]) -> Callable[[], Executable]:
    return lambda: select(func.count()).select_from(Adult).where(where())


def _several() -> Executable:
    return select(func.count(Adult.id).label("n"), func.sum(Adult.capital_gain).label("total_gain"),
                  func.avg(Adult.age).label("mean_age"), func.stddev(Adult.hours_per_week).label("sd_hours"),
                  func.variance(Adult.hours_per_week).label("var_hours")).where(Adult.age >= 18)


def _conditional() -> Executable:
    """FILTER (WHERE ...) and SUM(CASE WHEN ... THEN 1 ELSE 0 END), by race."""
    return (select(Adult.race, func.count(Adult.id).filter(Adult.sex == "Female").label("women"),
                   func.sum(case((Adult.income == ">50K", 1), else_=0)).label("high"))
            .group_by(Adult.race).order_by(Adult.race))


def _top_occupations() -> Executable:
    n = func.count(Adult.id).label("n")
    return select(Adult.occupation, n).group_by(Adult.occupation).order_by(n.desc()).limit(5)


def _having() -> Executable:
    return (select(Adult.education, func.avg(Adult.hours_per_week).label("hours"))
            .where(Adult.age > 40).group_by(Adult.education).having(func.count(Adult.id) >= 500)
            .order_by(Adult.education))


def _monthly() -> Executable:
    month = func.date_trunc("month", Visit.visited_at).label("month")
    start = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    return (select(month, func.count(Visit.visit_id).label("visits"), func.sum(Visit.amount).label("amount"))
            .where(Visit.visited_at >= start, Visit.visited_at < start.replace(year=2026))
            .group_by(month).order_by(month))


def _yearly() -> Executable:
    year = extract("year", Visit.visited_at).label("year")
    return select(year, func.count(Visit.visit_id).label("visits")).group_by(year).order_by(year)


def _people_by_year() -> Executable:
    return select(extract("year", Visit.visited_at).label("year"), Visit.person_id).distinct()


def _amount_by_sex() -> Executable:
    return (select(Adult.sex, func.sum(Visit.amount).label("amount")).join(Visit.person)
            .group_by(Adult.sex).order_by(Adult.sex))


def _visits_by_sex() -> Executable:
    return (select(Adult.sex, func.count(Visit.visit_id).label("visits")).outerjoin(Adult.visits)
            .group_by(Adult.sex).order_by(Adult.sex))


def _people_with_web_visits() -> Executable:
    web = select(Visit.person_id).where(Visit.channel == "web")
    return select(Adult.sex, func.count(Adult.id).label("n")).where(Adult.id.in_(web)).group_by(Adult.sex) \
        .order_by(Adult.sex)


def _count_of_subquery() -> Executable:
    """SQLAlchemy 2's documented count of a query's rows: ``select(func.count()).select_from(query.subquery())``."""
    women = select(Adult).where(Adult.sex == "Female").subquery()
    return select(func.count()).select_from(women)


def _core_by_education() -> Executable:
    return (select(ADULT.c.education, func.count().label("n")).where(ADULT.c.age.between(30, 39))
            .group_by(ADULT.c.education).order_by(ADULT.c.education))


def _core_channels() -> Executable:
    return (select(VISITS.c.channel, func.count(distinct(VISITS.c.person_id)).label("n"),
                   func.avg(VISITS.c.amount).label("mean_amount"))
            .group_by(VISITS.c.channel).order_by(VISITS.c.channel))


def _sqlmodel_by_sex() -> Executable:
    return sqlmodel_select(Person.sex, func.count(Person.id).label("n")).group_by(Person.sex).order_by(Person.sex)


def _sqlmodel_hours() -> Executable:
    return (sqlmodel_select(Person.race, func.avg(Person.hours_per_week).label("hours"))
            .where(Person.age >= 25, Person.age < 65).group_by(Person.race).order_by(Person.race))


# PyPika: the tables by name, queries built for PostgreSQL and run as their text.
PK_ADULT, PK_VISITS = pypika.Table("adult"), pypika.Table("visits")


def _pypika(query: pypika.queries.QueryBuilder, **values: Any) -> Callable[[], Executable]:
    return lambda: text(str(query)).bindparams(**values) if values else text(str(query))


def _pk_count(where: Any) -> Callable[[], Executable]:
    return _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(pk.Count("*").as_("count")).where(where))


_PK_MONTH = pypika.terms.Function("date_trunc", "month", PK_VISITS.visited_at)
_PK_YEAR = pk.Extract(pypika.DatePart.year, PK_VISITS.visited_at)
_PK_N = pk.Count("*")


STEPS: tuple[Step, ...] = (
    Step("sa-table-names", "catalog", "inspect(engine).get_table_names()", inspect=_table_names),
    Step("sa-columns", "catalog", "inspect(engine).get_columns('adult')", inspect=_columns),
    Step("sa-foreign-keys", "catalog", "inspect(engine).get_foreign_keys('visits')", inspect=_foreign_keys),
    Step("sa-count-by-sex", "counts", "select(Adult.sex, func.count(Adult.id).label('n')).group_by(Adult.sex)",
         _by("sex"), keys=("sex",)),
    Step("sa-count-by-two", "counts", "select(Adult.sex, Adult.race, func.count(Adult.id)).group_by(...)",
         _by("sex", "race"), keys=("sex", "race")),
    Step("sa-equality", "counts", "... .where(Adult.sex == 'Female').group_by(Adult.race)",
         _by("race", where=lambda: Adult.sex == "Female"), keys=("race",)),
    Step("sa-range", "counts", "... .where(Adult.age >= 30, Adult.age < 40).group_by(Adult.education)",
         _by("education", where=lambda: (Adult.age >= 30) & (Adult.age < 40)), keys=("education",)),
    Step("sa-in", "counts", "... .where(Adult.race.in_(['White', 'Black'])).group_by(Adult.workclass)",
         _by("workclass", where=lambda: Adult.race.in_(["White", "Black"])), keys=("workclass",)),
    Step("sa-ilike", "exact", "select(func.count()).select_from(Adult).where(Adult.occupation.ilike('%sales%'))",
         _count(lambda: Adult.occupation.ilike("%sales%"))),
    Step("sa-like", "exact", "... .where(Adult.native_country.like('United%'))",
         _count(lambda: Adult.native_country.like("United%"))),
    Step("sa-is-not-null", "exact", "... .where(Adult.workclass.is_not(None))",
         _count(lambda: Adult.workclass.is_not(None))),
    Step("sa-is-null", "empty", "... .where(Adult.workclass.is_(None)): nobody",
         _count(lambda: Adult.workclass.is_(None))),
    Step("sa-between", "exact", "... .where(Adult.hours_per_week.between(35, 45))",
         _count(lambda: Adult.hours_per_week.between(35, 45))),
    Step("sa-several", "exact", "select(func.count, func.sum, func.avg, func.stddev, func.variance)", _several),
    Step("sa-count-distinct", "exact", "select(func.count(distinct(Adult.native_country)))",
         lambda: select(func.count(distinct(Adult.native_country)).label("countries"))),
    Step("sa-conditional", "exact", "func.count(Adult.id).filter(...), func.sum(case((...), else_=0))",
         _conditional, keys=("race",)),
    Step("sa-top-n", "exact", "select(Adult.occupation, n).group_by(...).order_by(n.desc()).limit(5)",
         _top_occupations, keys=("occupation",)),
    Step("sa-having", "exact", "... .group_by(Adult.education).having(func.count(Adult.id) >= 500)", _having,
         keys=("education",)),
    Step("sa-in-subquery", "exact", "... .where(Adult.id.in_(select(Visit.person_id).where(...)))",
         _people_with_web_visits, keys=("sex",)),
    Step("sa-count-subquery", "exact", "select(func.count()).select_from(select(Adult).where(...).subquery())",
         _count_of_subquery),
    Step("sa-date-trunc", "exact", "select(func.date_trunc('month', Visit.visited_at), ...).group_by(month)",
         _monthly, keys=("month",), per_person=False),
    Step("sa-extract-year", "counts", "select(extract('year', Visit.visited_at), func.count(...)).group_by(year)",
         _yearly, keys=("year",), people=_people_by_year, per_person=False),
    Step("sa-join", "exact", "select(Adult.sex, func.sum(Visit.amount)).join(Visit.person).group_by(Adult.sex)",
         _amount_by_sex, keys=("sex",), per_person=False),
    Step("sa-outer-join", "exact", "select(Adult.sex, func.count(Visit.visit_id)).outerjoin(Adult.visits)",
         _visits_by_sex, keys=("sex",), per_person=False),
    Step("core-range-between", "counts", "select(adult.c.education, func.count()).where(adult.c.age.between(30, 39))",
         _core_by_education, keys=("education",)),
    Step("core-distinct-people", "exact", "select(visits.c.channel, func.count(distinct(visits.c.person_id)), "
         "func.avg(visits.c.amount)).group_by(visits.c.channel)", _core_channels, keys=("channel",), per_person=False),
    Step("sqlmodel-by-sex", "counts", "session.exec(select(Person.sex, func.count(Person.id)).group_by(Person.sex))",
         _sqlmodel_by_sex, keys=("sex",), sqlmodel=True),
    Step("sqlmodel-avg", "exact", "session.exec(select(Person.race, func.avg(Person.hours_per_week)).where(...))",
         _sqlmodel_hours, keys=("race",), sqlmodel=True),
    Step("sa-min-max", "refused", "select(func.min(Adult.age), func.max(Adult.age))",
         lambda: select(func.min(Adult.age), func.max(Adult.age)), refusal="min()"),
    Step("sa-rows", "refused", "select(Adult).where(Adult.age > 85).limit(10)",
         lambda: select(Adult).where(Adult.age > 85).limit(10), refusal="row-level"),
    Step("sa-get", "refused", "select(Adult).where(Adult.id == 1): what session.get(Adult, 1) sends",
         lambda: select(Adult).where(Adult.id == 1), refusal="row-level"),
    Step("sa-exists", "refused", "select(exists().where(Adult.age > 90))",
         lambda: select(exists().where(Adult.age > 90)), refusal="subqueries"),
    Step("sqlmodel-first", "refused", "session.exec(select(Person).order_by(Person.id)).first()",
         lambda: sqlmodel_select(Person).order_by(Person.id).limit(1), refusal="row-level", sqlmodel=True),
    Step("pk-count-in", "counts", "Query.from_(adult).select(adult.sex, fn.Count(adult.id).as_('n'))"
         ".where(adult.race.isin([...])).groupby(adult.sex)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(PK_ADULT.sex, pk.Count(PK_ADULT.id).as_("n"))
                 .where(PK_ADULT.race.isin(["White", "Black"])).groupby(PK_ADULT.sex).orderby(PK_ADULT.sex)),
         keys=("sex",)),
    Step("pk-ilike", "exact", "... .select(fn.Count('*')).where(adult.occupation.ilike('%sales%'))",
         _pk_count(PK_ADULT.occupation.ilike("%sales%"))),
    Step("pk-not-null", "exact", "... .where(adult.workclass.notnull())", _pk_count(PK_ADULT.workclass.notnull())),
    Step("pk-aggregates", "exact", "fn.Sum, fn.Avg, fn.StdDev, fn.Count(...).distinct() .where(adult.age >= 18)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(
             pk.Sum(PK_ADULT.capital_gain).as_("total"), pk.Avg(PK_ADULT.age).as_("mean_age"),
             pk.StdDev(PK_ADULT.hours_per_week).as_("sd"), pk.Count(PK_ADULT.native_country).distinct()
             .as_("countries")).where(PK_ADULT.age >= 18))),
    Step("pk-case-sum", "exact", "fn.Sum(Case().when(adult.income == '>50K', 1).else_(0)) .groupby(adult.race)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(
             PK_ADULT.race, pk.Sum(pypika.Case().when(PK_ADULT.income == ">50K", 1).else_(0)).as_("high"))
             .groupby(PK_ADULT.race).orderby(PK_ADULT.race)), keys=("race",)),
    Step("pk-top-n", "exact", "... .groupby(adult.occupation).orderby(n, order=Order.desc).limit(5)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(PK_ADULT.occupation, _PK_N.as_("n"))
                 .groupby(PK_ADULT.occupation).orderby(_PK_N, order=pypika.Order.desc).limit(5)),
         keys=("occupation",)),
    Step("pk-having-parameter", "exact", "... .having(fn.Count('*') > Parameter(':least')), least=500",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(PK_ADULT.education,
                                                               pk.Avg(PK_ADULT.hours_per_week).as_("hours"))
                 .groupby(PK_ADULT.education).having(_PK_N > pypika.Parameter(":least"))
                 .orderby(PK_ADULT.education), least=500), keys=("education",)),
    Step("pk-date-trunc", "exact", "Function('date_trunc', 'month', visits.visited_at) ... .where(visits.visited_at"
         "['2025-03-01':'2025-06-01'])",
         _pypika(pypika.PostgreSQLQuery.from_(PK_VISITS).select(_PK_MONTH.as_("month"), _PK_N.as_("visits"))
                 .where(PK_VISITS.visited_at["2025-03-01":"2025-06-01"]).groupby(_PK_MONTH).orderby(_PK_MONTH)),
         keys=("month",), per_person=False),
    Step("pk-extract-year", "counts", "fn.Extract(DatePart.year, visits.visited_at) ... .groupby(year)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_VISITS).select(_PK_YEAR.as_("year"),
                                                                pk.Count(PK_VISITS.visit_id).as_("visits"))
                 .groupby(_PK_YEAR).orderby(_PK_YEAR)), keys=("year",), people=_people_by_year, per_person=False),
    Step("pk-join", "exact", "Query.from_(visits).join(adult).on(visits.person_id == adult.id) ... fn.Sum",
         _pypika(pypika.PostgreSQLQuery.from_(PK_VISITS).join(PK_ADULT).on(PK_VISITS.person_id == PK_ADULT.id)
                 .select(PK_ADULT.sex, pk.Sum(PK_VISITS.amount).as_("amount")).groupby(PK_ADULT.sex)
                 .orderby(PK_ADULT.sex)), keys=("sex",), per_person=False),
    Step("pk-star", "refused", "Query.from_(adult).select('*').where(adult.age > 85).limit(5)",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select("*").where(PK_ADULT.age > 85).limit(5)),
         refusal="SELECT *"),
    Step("pk-max", "refused", "Query.from_(adult).select(fn.Max(adult.age))",
         _pypika(pypika.PostgreSQLQuery.from_(PK_ADULT).select(pk.Max(PK_ADULT.age))), refusal="max()"),
)
