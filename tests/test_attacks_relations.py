"""Issue 10: a gated statement reads only what the policy declares, joins only on declared keys, and the
suppressed-rest row obeys query-set-size control.

Through the real gated proxy, as `reporter` (suppress, k = 10, rest row on) and as a fresh dp role (the
`analyst` fixture of test_dp_proxy: ε 2 in all, 0.5 per query). A statement that reads protected data together
with any relation outside the policy (catalog tables and views, information_schema, the anonproxy schema, user
tables, views) is refused with 42501 naming the relation, whatever the join type and wherever its condition
stands; join conditions may not name identifying columns; legitimate statements keep working, and statements
without protected data still pass under the client's own login.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy
from suppression_oracle import suppress
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures

from anonproxy.plan.expressions import ROW_FUNCTIONS

LOOKUP = "public.relations_lookup"  # an ordinary table, readable by the gated roles
VIEW = "public.relations_view"  # a view over it, readable too
VISITS = "public.relations_visits"  # linked to public.adult through person

# (statement, the relation the refusal must name)
OUTSIDE = [
    # the attack of the issue: the identifying condition in a LEFT JOIN's ON clause
    ("select a.sex, sum(case when d.oid is not null then a.capital_gain else 10 end) from adult a "
     "left join pg_catalog.pg_database d on a.id = 1146 and d.oid = 1 group by a.sex", "pg_catalog.pg_database"),
    ("select a.sex, count(d.oid) from adult a left join pg_database d on a.id = 1146 group by a.sex",
     "pg_catalog.pg_database"),
    ('select a.sex, count(*) from "adult" a left outer join "pg_catalog"."pg_database" d on a.id = 1146 '
     "group by 1", "pg_catalog.pg_database"),
    ("select count(*) from adult a right join pg_database d on a.id = 1146", "pg_catalog.pg_database"),
    ("select count(*) from adult a full join pg_catalog.pg_database d on a.id = d.oid::int", "pg_catalog.pg_database"),
    ("select count(*) from adult a cross join pg_database d", "pg_catalog.pg_database"),
    ("select count(*) from adult a, pg_database d where a.id = 1146 and d.oid = 1", "pg_catalog.pg_database"),
    ("select count(*) from adult a inner join pg_database d on d.oid = a.id", "pg_catalog.pg_database"),
    ("select count(*) from pg_database d join adult a on true", "pg_catalog.pg_database"),
    ("select a.sex, count(*) from adult a left join pg_database d on true where a.id = 1146 group by 1",
     "pg_catalog.pg_database"),
    # statistics and other sessions' statements, which the service role would see
    ("select s.attname, count(*) from adult a join pg_stats s on s.tablename = 'adult' group by 1",
     "pg_catalog.pg_stats"),
    ("select a.sex, count(*) from adult a left join pg_catalog.pg_stats s on s.most_common_vals::text = a.sex "
     "group by 1", "pg_catalog.pg_stats"),
    ("select count(*) from adult a join pg_stat_activity s on s.query like '%1146%'", "pg_catalog.pg_stat_activity"),
    ("select a.sex, count(*) from adult a right join pg_catalog.pg_stat_activity s on true group by 1",
     "pg_catalog.pg_stat_activity"),
    ("select count(*) from adult a left join pg_class c on c.relname = 'adult' and a.id = 1146",
     "pg_catalog.pg_class"),
    ('select count(*) from adult a join "pg_class" c on c.oid = a.id', "pg_catalog.pg_class"),
    ("select count(*) from adult a full outer join PG_CATALOG.PG_CLASS c on c.oid = a.id", "pg_catalog.pg_class"),
    ("select count(*) from adult a join information_schema.tables t on t.table_name = a.sex",
     "information_schema.tables"),
    ("select count(*) from adult a left join INFORMATION_SCHEMA.COLUMNS c on a.id = 1146",
     "information_schema.columns"),
    ("select count(*) from adult a join anonproxy.column_policies p on p.column_name = a.sex",
     "anonproxy.column_policies"),
    # an ordinary user table and a view, however they are spelled
    (f"select l.region, count(*) from adult a join {LOOKUP} l on l.country = a.native_country group by 1", LOOKUP),
    ("select count(*) from adult a left join relations_lookup l on a.id = 1146", LOOKUP),
    ('select count(*) from adult a left join "relations_lookup" l on l.country = a.native_country', LOOKUP),
    ("select count(*) from adult a right join PUBLIC.RELATIONS_LOOKUP l on l.country = a.native_country", LOOKUP),
    ("select count(*) from adult a, relations_lookup l where l.country = a.native_country", LOOKUP),
    (f"select v.region, count(*) from adult a join {VIEW} v on v.country = a.native_country group by 1", VIEW),
    ("select count(*) from adult a left join relations_view v on a.id = 1146", VIEW),
    ("select count(*) from adult a full join relations_view v on true", VIEW),
    # hidden in a subquery, a CTE, a set operation or a LATERAL
    ("select count(*) from adult where id in (select oid::int from pg_database)", "pg_catalog.pg_database"),
    ("with d as (select oid from pg_database) select count(*) from adult a join d on true", "pg_catalog.pg_database"),
    ("select count(*) from adult union all select count(*) from pg_class", "pg_catalog.pg_class"),
    ("select count(*) from adult a left join lateral (select * from pg_stats) s on true", "pg_catalog.pg_stats"),
    ("select count(*) from adult where exists (select 1 from relations_lookup where country = 'x')", LOOKUP),
]

# Functions outside the allowlist, in every clause of a statement over protected data.
FUNCTIONS = [
    "select sex, current_setting('is_superuser'), count(*) from adult group by 1, 2",
    "select count(*) from adult where pg_read_file('/etc/passwd') is not null",
    "select sex, count(*) from adult group by sex having pg_stat_get_numscans(1) > 0",
    "select sex, count(*) from adult group by sex order by txid_current()",
    "select sex, clock_timestamp(), count(*) from adult group by 1, 2",  # now() is the statement's, allowed
    "select sex, count(*) from adult group by sex order by random()",
    "select generate_series(1, 2), count(*) from adult",
    "select count(*) from adult where sex = current_user",
    "select version(), count(*) from adult",
    "select sex, count(*) from adult where 'pg_class'::regclass is not null group by 1",
    "select sex, ifnull(workclass, 'x'), count(*) from adult group by 1, 2",  # not PostgreSQL's spelling
    "select sex, count(pg_sleep(0)) from adult group by 1",
    # functional notation: a.f is f(a) when adult has no column f, a function of the whole row
    "select a.sex, a.json_agg from adult a group by a.sex",
    "select a.sex, count(*) from adult a where a.to_json::text like '{\"id\":1146,%' group by 1",
    "select a.sex, sum(case when a.row_to_json::text like '{\"id\":1146,%' then a.capital_gain else 10 end) "
    "from adult a group by 1",
    "select adult.sex, count(*) from adult group by adult.sex order by adult.count",
    "select public.adult.sex, count(*) from public.adult group by 1, public.adult.to_jsonb",
]


def _grant_tables(owner: psycopg.Connection[Any]) -> None:
    owner.execute(f"create table {LOOKUP} (country text primary key, region text)")
    owner.execute(f"insert into {LOOKUP} select distinct native_country, left(native_country, 1) from public.adult")
    owner.execute(f"create view {VIEW} as select country, region from {LOOKUP}")
    owner.execute(f"grant select on {LOOKUP}, {VIEW} to reporter, analyst")


@pytest.fixture(scope="module")
def tables(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str  # noqa: F811
           ) -> Iterator[None]:
    """A lookup table and a view outside the policy, and a table linked to adult (person = adult.id)."""
    _grant_tables(truth)
    truth.execute(f"create table {VISITS} (person int not null, cost int not null)")
    truth.execute(f"insert into {VISITS} select id, id % 7 from public.adult where id % 2 = 0")
    truth.execute(f"insert into {VISITS} select id, 3 from public.adult where id % 4 = 0")
    truth.execute(f"select anonproxy.link_table('{VISITS}', 'person', 'public.adult')")
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    wait_for_policy(gated_proxy, gated_database, version)
    yield
    truth.execute(f"select anonproxy.unlink_table('{VISITS}')")
    truth.execute(f"drop table {VISITS}")
    truth.execute(f"drop view {VIEW}")
    truth.execute(f"drop table {LOOKUP}")


@pytest.fixture
def reporter(tables: None, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def refusal(conn: psycopg.Connection[Any], sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    assert conn.execute("select 1").fetchone() == (1,)  # the session survives
    return caught.value


def assert_names_relation(error: psycopg.Error, relation: str, mode_words: str) -> None:
    assert error.sqlstate == "42501", (error.sqlstate, str(error))
    message = error.diag.message_primary or ""
    assert f"relation {relation} is not part of the privacy policy" in message, message
    assert "only the protected table and its linked tables" in message, message
    hint = error.diag.message_hint or ""
    assert f"Query {relation} in a statement of its own" in hint and mode_words in hint, hint


# --- relations outside the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(("sql", "relation"), OUTSIDE)
def test_suppress_refuses_relations_outside_the_policy(reporter: psycopg.Connection[Any], sql: str,
                                                       relation: str) -> None:
    assert_names_relation(refusal(reporter, sql), relation, "join a protected table only to its linked tables")


def test_dp_refuses_relations_outside_the_policy(tables: None, gated_proxy: Endpoint, gated_database: str,
                                                 analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for sql, relation in OUTSIDE:
            assert_names_relation(refusal(conn, sql), relation, "In dp mode")
        assert "epsilon 2 of 2 left" in budget_left(conn), "refusals cost nothing"


def test_statements_without_protected_data_pass_under_the_clients_login(reporter: psycopg.Connection[Any],
                                                                        gated_database: str) -> None:
    assert reporter.execute("select current_user").fetchone() == ("reporter",)
    assert reporter.execute("select datname from pg_database where datname = current_database()").fetchone() == (
        gated_database,)
    assert reporter.execute("select count(*) from pg_stats where tablename = 'adult'").fetchone() == (0,)
    assert reporter.execute("select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace "
                            "where n.nspname = 'public' and c.relname = 'adult'").fetchall() == [("adult",)]
    assert reporter.execute("select count(*) from information_schema.columns where table_name = 'adult' "
                            "and column_name = 'capital_gain'").fetchone() == (1,)
    assert reporter.execute("select query from pg_stat_activity where pid = pg_backend_pid()").fetchone() is not None
    regions = reporter.execute(f"select v.region, count(*) from {VIEW} v join {LOOKUP} l on l.country = v.country "
                               "group by 1").fetchall()
    assert regions and sum(n for _, n in regions) == reporter.execute(f"select count(*) from {LOOKUP}").fetchone()[0]


# --- join conditions ------------------------------------------------------------------------------------------

JOIN_REFUSALS = [
    # identifying columns in ON, next to the declared key or instead of it: 42501
    (f"select a.sex, count(v.cost) from adult a left join {VISITS} v on v.person = a.id and a.id = 1146 "
     "group by a.sex", "42501", "identifying column id"),
    (f"select a.sex, sum(v.cost) from adult a left join {VISITS} v on v.person = a.id and v.person = 1146 "
     "group by a.sex", "42501", "identifying column person"),
    (f"select count(*) from adult a join {VISITS} v on v.person = a.id and (a.id in (1146, 17) or a.age > 99)",
     "42501", "identifying column id"),
    (f"select count(*) from adult a join {VISITS} v on a.id = 1146", "42501", "identifying column id"),
    (f"select count(*) from adult a left join {VISITS} v on v.person = a.age", "42501", "identifying column person"),
    # other shapes: 0A000
    (f"select count(*) from adult a join {VISITS} v on v.cost = a.age", "0A000", "declared key"),
    (f"select count(*) from adult a right join {VISITS} v on v.person = a.id", "0A000", "RIGHT JOIN"),
    (f"select count(*) from adult a full join {VISITS} v on v.person = a.id", "0A000", "FULL JOIN"),
    (f"select count(*) from {VISITS} v left join adult a on v.cost = a.age", "0A000", "declared key"),
    (f"select count(*) from {VISITS} v left join adult a on v.person = a.id and a.id = 1146", "42501",
     "identifying column id"),
    (f"select count(*) from adult a cross join {VISITS} v", "0A000", "CROSS JOIN"),
    (f"select count(*) from adult a, {VISITS} v where v.person = a.id", "0A000", "comma"),
    (f"select count(*) from adult a join {VISITS} v using (id)", "0A000", "USING"),
    (f"select count(*) from adult a natural join {VISITS} v", "0A000", "NATURAL"),
    (f"select count(*) from adult a left join {VISITS} v on v.person = a.id and v.cost / 0 = 1", "0A000",
     "division"),
]


@pytest.mark.parametrize(("sql", "sqlstate", "words"), JOIN_REFUSALS)
def test_suppress_join_conditions_are_analysed(reporter: psycopg.Connection[Any], sql: str, sqlstate: str,
                                               words: str) -> None:
    error = refusal(reporter, sql)
    assert error.sqlstate == sqlstate, (error.sqlstate, str(error))
    assert words.lower() in (error.diag.message_primary or "").lower(), str(error)
    assert error.diag.message_hint


def test_dp_join_conditions_are_analysed(tables: None, gated_proxy: Endpoint, gated_database: str,
                                         analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for sql, sqlstate, words in JOIN_REFUSALS:
            error = refusal(conn, sql)
            assert error.sqlstate == sqlstate and words.lower() in str(error).lower(), (sql, str(error))
            assert error.diag.message_hint
        assert "epsilon 2 of 2 left" in budget_left(conn)


def test_identifying_condition_in_where_is_a_group_of_one(reporter: psycopg.Connection[Any]) -> None:
    """In WHERE the same condition filters, and the group-size rules then withhold the single person."""
    assert reporter.execute(f"select a.sex, count(*), sum(v.cost) from adult a join {VISITS} v on v.person = a.id "
                            "where a.id = 1146 group by a.sex").fetchall() == []
    assert reporter.execute("select a.sex, sum(a.capital_gain) from adult a where a.id = 1146 "
                            "group by a.sex").fetchall() == []


def test_linked_joins_on_the_declared_key_still_work(reporter: psycopg.Connection[Any],
                                                     truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    for sql in (f"select a.sex, count(*), sum(v.cost) from adult a join {VISITS} v on v.person = a.id "
                "group by a.sex order by 1",
                f"select a.sex, count(*), count(v.cost) from adult a left join {VISITS} v on v.person = a.id "
                "and v.cost > 3 group by a.sex order by 1",
                f"select a.sex, count(*) from {VISITS} v join adult a on a.id = v.person where v.cost > 2 "
                "group by a.sex order by 1"):
        expected = truth.execute(sql).fetchall()
        assert len(expected) == 2 and reporter.execute(sql).fetchall() == expected, sql
    assert reporter.execute("select sex, count(*) from adult group by sex order by 1").fetchall() == \
        truth.execute("select sex, count(*) from adult group by sex order by 1").fetchall()


def test_dp_left_join_on_the_declared_key(tables: None, gated_proxy: Endpoint, gated_database: str,
                                          analyst: str, truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    sql = f"select a.sex, count(*) from adult a left join {VISITS} v on v.person = a.id group by a.sex"
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        rows = dict(conn.execute(sql).fetchall())
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
    # one row per person (max_rows_per_unit 1 by default): the count of people, with noise of scale 2 (ε 0.5)
    people = dict(truth.execute("select sex, count(*) from adult group by sex").fetchall())
    assert set(rows) == {"Female", "Male"} and all(abs(rows[s] - people[s]) <= 28 for s in rows)


# --- functions --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", FUNCTIONS)
def test_suppress_refuses_functions_outside_the_allowlist(reporter: psycopg.Connection[Any], sql: str) -> None:
    error = refusal(reporter, sql)
    assert error.sqlstate in ("0A000", "42501"), (error.sqlstate, str(error))
    assert "not allowed" in (error.diag.message_primary or "") and error.diag.message_hint, str(error)


def test_dp_refuses_functions_outside_the_allowlist(gated_proxy: Endpoint, gated_database: str,
                                                    analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for sql in FUNCTIONS:
            error = refusal(conn, sql)
            assert error.sqlstate in ("0A000", "42501") and error.diag.message_hint, (sql, str(error))
        assert "epsilon 2 of 2 left" in budget_left(conn)


def test_every_function_reachable_with_a_columns_syntax_is_known(pg_server: Any, gated_database: str) -> None:
    """ROW_FUNCTIONS lists every pg_catalog name that PostgreSQL resolves in ``t.name`` as ``name(t)``."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        conn.execute("create table public.relations_probe (zzz int)")
        try:
            conn.execute("set search_path = pg_catalog")  # as on the service connection
            names = [row[0] for row in conn.execute("select distinct proname from pg_proc "
                                                    "where pronamespace = 'pg_catalog'::regnamespace")]
            found = set()
            for name in names:
                try:
                    conn.execute(psycopg.sql.SQL("select t.{} from public.relations_probe t limit 0").format(
                        psycopg.sql.Identifier(name)))
                    found.add(name)
                except psycopg.Error:
                    pass
        finally:
            conn.execute("drop table public.relations_probe")
    assert {"json_agg", "to_json", "count"} <= found, found
    assert found <= ROW_FUNCTIONS, sorted(found - ROW_FUNCTIONS)


# --- the suppressed-rest row -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("condition", "released"), [
    ("true", True),  # N people: the public total over everyone
    ("id <> 17", False),  # N - 1
    ("id = 17", False),  # 1
    ("id between 1 and 5", False),  # 5
    ("id > 9", False),  # N - 9
    ("age between 30 and 60", True),  # k or more, leaving k or more out
])
def test_rest_row_by_id_gives_what_the_scalar_query_gives(reporter: psycopg.Connection[Any],
                                                          truth: psycopg.Connection[Any],  # noqa: F811
                                                          condition: str, released: bool) -> None:
    """GROUP BY id withholds every group; the rest row then covers the whole query set, like a scalar query: both
    are released for a set of k people or more that leaves out of N nobody or k people, both withheld otherwise."""
    exact = truth.execute(f"select count(*), sum(capital_gain) from adult where {condition}").fetchall()
    everyone = truth.execute("select count(distinct id) from adult").fetchone()[0]
    people = exact[0][0]
    assert released is (people >= 10 and (people == everyone or people <= everyone - 10)), people
    scalar = reporter.execute(f"select count(*), sum(capital_gain) from adult where {condition}").fetchall()
    grouped = reporter.execute(f"select id, count(*), sum(capital_gain) from adult where {condition} "
                               "group by id").fetchall()
    assert [row for row in grouped if row[0] is not None] == []
    assert [row[1:] for row in grouped] == scalar
    assert scalar == (exact if released else [])


def test_rest_row_never_completes_a_withheld_total(reporter: psycopg.Connection[Any],
                                                   truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """Released rows plus the rest row would add up to the total over N - 1 people: the rest row is withheld."""
    everyone_but = reporter.execute("select age, race, count(*) from adult where id <> 17 group by 1, 2").fetchall()
    assert everyone_but and all(row[0] is not None for row in everyone_but)
    total = truth.execute("select count(*) from adult").fetchone()[0]
    assert sum(n for *_, n in everyone_but) < total - 10
    # Leaving enough people out, the same question gets its rest row, and it adds up to the scalar answer.
    young = reporter.execute("select age, race, count(*) from adult where age < 60 group by 1, 2").fetchall()
    rest = [n for age, race, n in young if age is None and race is None]
    assert len(rest) == 1 and rest[0] >= 10
    assert sum(n for *_, n in young) == reporter.execute("select count(*) from adult where age < 60").fetchone()[0]


def test_rest_row_with_two_keys_and_having(reporter: psycopg.Connection[Any],
                                           truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """The rest row holds every withheld group, whatever the client's HAVING says of it (HAVING is never evaluated
    on a withheld group), and HAVING then filters the rest row like a released row. It decides no verdict: the
    answer with a HAVING is the answer without it, less the rows the HAVING drops."""
    grouped = "select native_country, sex, count(*) from adult where age < 60 group by 1, 2"
    groups = {(country, sex): frozenset(ids) for country, sex, ids in truth.execute(
        "select native_country, sex, array_agg(id) from adult where age < 60 group by 1, 2")}
    everyone = truth.execute("select count(distinct id) from adult").fetchone()[0]
    verdict = suppress(groups, k=10, everyone=everyone, rest=True)  # count(*): no contributors, no sums
    # The data make the case: a rest row worth releasing, withheld groups of fewer than 5 people in it (which
    # HAVING count(*) >= 5 kept out of it before), and groups of 10 or more withheld in a country's margin
    # (Cambodia's 15 men, with its 2 women).
    assert verdict.rest and len(verdict.rest_people) >= 200
    assert any(len(people) < 5 for people in groups.values())
    assert any(len(people) >= 10 for key, people in groups.items() if key not in verdict.released)
    expected = {key: len(groups[key]) for key in verdict.released} | {(None, None): len(verdict.rest_people)}

    def answer(sql: str) -> dict[tuple[Any, Any], int]:
        rows = reporter.execute(sql).fetchall()
        assert len({(country, sex) for country, sex, _ in rows}) == len(rows)
        return {(country, sex): n for country, sex, n in rows}

    assert answer(grouped) == expected
    assert answer(grouped + " having count(*) >= 5") == expected  # the rest row still holds the groups below 5
    assert answer(grouped + " having count(*) < 200") == {key: n for key, n in expected.items() if n < 200}
