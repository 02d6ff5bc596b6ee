"""Suppress mode says what it withheld (docs/suppression.md, "What suppression says"), through the real proxy.

The `reporter` of the demo policy (k = 10, dominance (2, 85 %), p 10 %, suppressed rest) asks; psycopg's notice
handler and psql show the NOTICE. The answers themselves must be exactly those of the plain rewrite (rows, order,
column names and types), and the notice must not single anybody out: a filter that matches one person or nobody
gives the same words.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy

from anonproxy.embedded import find_pg_bindir
from anonproxy.policy.store import load_policy
from anonproxy.rewrite.classify import decide
from anonproxy.rewrite.decision import Rewrite

K = 10


@dataclass(frozen=True)
class Notice:
    severity: str | None
    message_primary: str | None
    message_detail: str | None
    message_hint: str | None


def keep(notices: list[Notice]) -> Callable[[psycopg.errors.Diagnostic], None]:
    """A notice handler: psycopg's Diagnostic is valid only inside the handler, so its fields are copied."""
    return lambda d: notices.append(Notice(d.severity, d.message_primary, d.message_detail, d.message_hint))


def ask(proxy: Endpoint, dbname: str, sql: str, params: list[object] | None = None,
        ) -> tuple[list[tuple], list[tuple[str, int]], list[Notice]]:
    """Rows, (name, type oid) per column and the notices of one statement of the reporter through the proxy."""
    notices: list[Notice] = []
    with psycopg.connect(proxy.dsn(dbname, user="reporter"), autocommit=True) as conn:
        conn.add_notice_handler(keep(notices))
        cur = conn.execute(sql, params)
        rows = cur.fetchall()
        columns = [(c.name, c.type_code) for c in cur.description or ()]
    return rows, columns, notices


def plain(truth: psycopg.Connection, sql: str, params: list[object] | None = None,
          ) -> tuple[list[tuple], list[tuple[str, int]]]:
    """The same statement's answer as the rewrite without its report computes it, run on the database directly."""
    policy = load_policy(truth)
    decision = decide(sql, policy.role("reporter"), policy)
    assert isinstance(decision, Rewrite) and decision.reported is not None, decision
    with psycopg.RawCursor(truth) as cur:  # $n placeholders, as the proxy sends them
        cur.execute(decision.sql, params)
        return cur.fetchall(), [(c.name, c.type_code) for c in cur.description or ()]


def texts(notices: list[Notice]) -> list[tuple[str | None, str | None, str | None]]:
    return [(n.message_primary, n.message_detail, n.message_hint) for n in notices]


# -- the notices -------------------------------------------------------------------------------------------------


def test_a_whole_table_total_says_query_set_size_control_withheld_it(gated_proxy: Endpoint,
                                                                       gated_database: str) -> None:
    rows, columns, notices = ask(gated_proxy, gated_database, "SELECT count(*) FROM adult")
    assert rows == [] and columns == [("count", 20)]
    assert [n.severity for n in notices] == ["NOTICE"]
    (message, detail, hint), = texts(notices)
    assert message == "anonproxy: the total was withheld by query-set-size control"
    assert f"at least k = {K} people" in detail and "whole table" in detail
    assert "WHERE" in hint and "GROUP BY" in hint


def test_a_total_withheld_by_the_contributor_rule_says_so(gated_proxy: Endpoint, gated_database: str,
                                                          truth: psycopg.Connection) -> None:
    # Hundreds of people, but fewer than k of them with a capital loss: the sum is withheld, not by its size.
    age = truth.execute("SELECT age FROM adult GROUP BY age HAVING count(*) >= 100 AND count(*) FILTER "
                        f"(WHERE capital_loss <> 0) BETWEEN 1 AND {K - 1} ORDER BY age LIMIT 1").fetchone()[0]
    sql = f"SELECT sum(capital_loss) FROM adult WHERE age = {age}"
    rows, _, notices = ask(gated_proxy, gated_database, sql)
    assert rows == []
    assert [m for m, _, _ in texts(notices)] == [
        "anonproxy: the total was withheld: fewer than k people contribute to one of its aggregates, or a few "
        "people dominate a sum"]


def test_a_released_total_says_nothing(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    sql = "SELECT count(*), avg(hours_per_week) FROM adult WHERE age > 40"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    assert len(rows) == 1 and notices == []


def withheld_groups(truth: psycopg.Connection, key: str, released: list[tuple], where: str = "true") -> int:
    """Groups of ``key`` the answer left out: every group in the data but those released (the rest row aside)."""
    groups = truth.execute(f"SELECT count(*) FROM (SELECT {key} FROM adult WHERE {where} GROUP BY 1) g").fetchone()[0]
    return groups - len(released)


def test_grouped_answer_counts_its_suppressed_groups_and_labels_the_rest_row(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    sql = ("SELECT native_country, count(*) AS people FROM adult WHERE age > 50 GROUP BY native_country "
           "ORDER BY 2 DESC")
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    rest = [row for row in rows if row[0] is None]
    assert len(rest) == 1  # the data has no NULL country: the one NULL row is the suppressed rest
    released = [row for row in rows if row[0] is not None]
    suppressed = withheld_groups(truth, "native_country", released, "age > 50")
    assert suppressed > 1
    assert rest[0][1] == truth.execute(
        "SELECT count(*) FROM adult WHERE age > 50 AND native_country <> ALL (%s::text[])",
        [[row[0] for row in released]]).fetchone()[0]
    (message, detail, hint), = texts(notices)
    assert message == (f"anonproxy: {suppressed} groups were suppressed; the row with NULL in native_country holds "
                       "them together")
    assert f"fewer than k = {K} people" in detail and hint is None


def test_a_grouping_of_the_whole_table_says_why_it_has_no_rest_row(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    sql = "SELECT age, count(*) AS people FROM adult GROUP BY age"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    assert all(row[0] is not None for row in rows)  # with the released rows it would be a total over everyone
    (message, detail, _), = texts(notices)
    assert message == (f"anonproxy: {withheld_groups(truth, 'age', rows)} groups were suppressed; no rest row holds "
                       "them together: it did not pass the same rules")
    assert f"leave at least {K} people out" in detail


def test_a_released_group_with_null_keys_is_told_apart_from_the_rest_row(
        gated_proxy: Endpoint, gated_database: str) -> None:
    # The people born in the United States are a released group whose key is NULL, next to the rest row.
    sql = ("SELECT nullif(native_country, 'United-States') AS born, count(*) FROM adult WHERE age > 50 "
           "GROUP BY 1")
    rows, _, notices = ask(gated_proxy, gated_database, sql)
    nulls = [row for row in rows if row[0] is None]
    assert len(nulls) == 2 and rows[-1] in nulls  # the released NULL group, and the rest row, last
    (message, detail, _), = texts(notices)
    assert message.endswith("; the row with NULL in born holds them together")
    assert "A released group has NULL in born too: the rest row is the second such row" in detail


def test_no_notice_when_nothing_was_suppressed(gated_proxy: Endpoint, gated_database: str,
                                               truth: psycopg.Connection) -> None:
    sql = "SELECT sex, count(*) FROM adult WHERE age > 30 GROUP BY sex"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql) and len(rows) == 2
    assert notices == []


def test_fewer_than_k_people_withheld_are_not_counted(gated_proxy: Endpoint, gated_database: str,
                                                      truth: psycopg.Connection) -> None:
    """Over the whole table only the one person from the Netherlands is withheld: "1 group" would say that
    somebody matches; no notice, as when nothing is withheld (and that person's rest row is withheld too)."""
    sql = "SELECT native_country, count(*) FROM adult GROUP BY native_country"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    assert withheld_groups(truth, "native_country", rows) == 1 and notices == []


def test_extended_protocol_prepared_statements_and_limits_get_the_notice_each_time(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    sql = ("SELECT education, count(*), sum(capital_gain) FROM adult WHERE age > %s GROUP BY education "
           "ORDER BY 2 DESC LIMIT %s")
    notices: list[Notice] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        conn.add_notice_handler(keep(notices))
        answers = [conn.execute(sql, [50, 5], prepare=True).fetchall() for _ in range(3)]
    expected, _ = plain(truth, sql.replace("%s", "$1", 1).replace("%s", "$2"), [50, 5])
    assert len(expected) == 5
    assert answers == [expected] * 3
    assert len(notices) == 3 and len({n.message_primary for n in notices}) == 1
    assert notices[0].message_primary.startswith("anonproxy: ") and "groups were suppressed" in \
        notices[0].message_primary


def test_the_report_itself_never_reaches_the_client(gated_proxy: Endpoint, gated_database: str) -> None:
    notices = [n for sql in ("SELECT age, count(*) FROM adult GROUP BY 1", "SELECT count(*) FROM adult",
                             "SELECT native_country, count(*) FROM adult GROUP BY 1")
               for n in ask(gated_proxy, gated_database, sql)[2]]
    assert len(notices) == 2 and all(n.severity == "NOTICE" and "suppression_report" not in (n.message_primary or "")
                           and "{" not in (n.message_detail or "") for n in notices)


def test_psql_shows_the_notice(gated_proxy: Endpoint, gated_database: str) -> None:
    psql = shutil.which("psql") or str(find_pg_bindir() / "psql")
    done = subprocess.run([psql, gated_proxy.url(gated_database, user="reporter"), "-X", "-c",
                           "SELECT count(*) FROM adult"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "NOTICE:  anonproxy: the total was withheld by query-set-size control" in done.stderr
    assert "(0 rows)" in done.stdout


# -- attacks: the notice must not single anybody out ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [
    "SELECT count(*) FROM adult WHERE {}",
    "SELECT sum(capital_gain) FROM adult WHERE {}",
    "SELECT sex, count(*) FROM adult WHERE {} GROUP BY sex",
    "SELECT income, count(*) FROM adult WHERE {} GROUP BY income",
    "SELECT id, count(*) FROM adult WHERE {} GROUP BY id",
])
def test_one_person_or_nobody_gets_the_same_words(gated_proxy: Endpoint, gated_database: str,
                                                  truth: psycopg.Connection, shape: str) -> None:
    """A filter on one person's attributes and a sensitive value: matching them or nobody must read alike."""
    age, country, income = truth.execute(
        "SELECT age, native_country, income FROM adult WHERE id = 17").fetchone()
    other = ">50K" if income == "<=50K" else "<=50K"
    who = f"age = {age} AND native_country = '{country}' AND id = 17"
    answers = []
    for condition in (f"{who} AND income = '{income}'", f"{who} AND income = '{other}'", "id = -1"):
        rows, _, notices = ask(gated_proxy, gated_database, shape.format(condition))
        assert rows == []
        answers.append(texts(notices))
    assert answers[0] == answers[1] == answers[2]


def test_a_few_people_in_small_groups_are_not_counted(gated_proxy: Endpoint, gated_database: str) -> None:
    """Fewer than k people in the withheld groups: their number of groups would tell who is there; not said."""
    few = ask(gated_proxy, gated_database,
              "SELECT age, count(*) FROM adult WHERE id IN (1, 2, 3, 40, 500) GROUP BY age")[2]
    none = ask(gated_proxy, gated_database, "SELECT age, count(*) FROM adult WHERE id IN (-1, -2) GROUP BY age")[2]
    assert texts(few) == texts(none) and len(few) == 1 and "is not said" in few[0].message_detail


def test_everyone_but_one_is_not_counted_either(gated_proxy: Endpoint, gated_database: str,
                                                truth: psycopg.Connection) -> None:
    """Groups of one person over all but one person (N - 1 > N - k): the count would be N - 1, a differencing
    of person 17 against N; over a set that leaves k out it is a plain count of people, and said."""
    _, _, everyone_but = ask(gated_proxy, gated_database, "SELECT id, count(*) FROM adult WHERE id <> 17 GROUP BY id")
    _, _, everyone_but_two = ask(gated_proxy, gated_database,
                                 "SELECT id, count(*) FROM adult WHERE id NOT IN (17, 18) GROUP BY id")
    assert texts(everyone_but) == texts(everyone_but_two)
    assert everyone_but[0].message_primary == "anonproxy: no group was released"
    some = truth.execute("SELECT count(*) FROM adult WHERE id < 200").fetchone()[0]
    _, _, counted = ask(gated_proxy, gated_database, "SELECT id, count(*) FROM adult WHERE id < 200 GROUP BY id")
    assert counted[0].message_primary.startswith(f"anonproxy: {some} groups were suppressed")


def test_a_rest_row_without_grouping_columns_in_the_answer(gated_proxy: Endpoint, gated_database: str,
                                                           truth: psycopg.Connection) -> None:
    sql = "SELECT count(*) FROM adult WHERE age > 50 GROUP BY native_country"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    (message, _, _), = texts(notices)
    assert message.endswith("groups were suppressed; one more row, the last one unless the query orders the rows, "
                            "holds them together")


@pytest.fixture(scope="module")
def plain_reporter(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A role in suppress mode with k = 10 only: no magnitude rules, no rest row (the simple shape)."""
    role = "notice_reporter"
    truth.execute(f"drop role if exists {role}")
    truth.execute(f"create role {role} login password '{role}'")
    truth.execute("select anonproxy.set_role_policy(%s, 'suppress', 10)", [role])
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    wait_for_policy(gated_proxy, gated_database, version)
    yield role
    truth.execute("select anonproxy.drop_role_policy(%s)", [role])
    truth.execute(f"drop owned by {role}")
    truth.execute(f"drop role {role}")


def test_the_simple_shape_counts_its_suppressed_groups(gated_proxy: Endpoint, gated_database: str,
                                                       truth: psycopg.Connection, plain_reporter: str) -> None:
    sql = "SELECT native_country AS country, count(*), avg(hours_per_week) FROM adult WHERE age > 50 GROUP BY 1"
    notices: list[Notice] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=plain_reporter), autocommit=True) as conn:
        conn.add_notice_handler(keep(notices))
        rows = conn.execute(sql).fetchall()
        assert conn.execute("SELECT count(*) FROM adult").fetchall() == []
    expected = truth.execute("SELECT count(*) FROM (SELECT native_country FROM adult WHERE age > 50 GROUP BY 1 "
                             f"HAVING count(*) < {K}) small").fetchone()[0]
    assert withheld_groups(truth, "native_country", rows, "age > 50") == expected > 1
    assert [n.message_primary for n in notices] == [
        f"anonproxy: {expected} groups were suppressed", "anonproxy: the total was withheld by query-set-size control"]


@pytest.mark.parametrize("role", ["reporter", "notice_reporter"])
def test_a_string_constant_spanning_lines_reads_the_same_in_every_copy(
        truth: psycopg.Connection, plain_reporter: str, role: str) -> None:
    """The WHERE is copied into the CTEs that decide the groups: a copy that differed (indented, say) would decide
    on other rows than the answer's, so every copy must hold the constant exactly as the client wrote it."""
    constant = "'Holand-Netherlands\n  x\n'"
    sql = f"SELECT education, count(*), sum(capital_gain) FROM adult WHERE native_country <> {constant} GROUP BY 1"
    policy = load_policy(truth)
    decision = decide(sql, policy.role(role), policy)
    assert isinstance(decision, Rewrite) and decision.reported is not None
    assert decision.reported.count(constant) == decision.reported.count("native_country <>") >= 3
    assert decision.sql.count(constant) == decision.sql.count("native_country <>")


def described(conn: psycopg.Connection, sql: str, name: str) -> tuple[list[tuple], list[int]]:
    """What a client's Describe shows of a statement: per column name, type, typmod, table, attribute, size;
    and the parameter types."""
    pgconn = conn.pgconn
    prepared = pgconn.prepare(name.encode(), sql.encode())
    assert not prepared.error_message, prepared.error_message
    d = pgconn.describe_prepared(name.encode())
    return ([(d.fname(i), d.ftype(i), d.fmod(i), d.ftable(i), d.ftablecol(i), d.fsize(i)) for i in range(d.nfields)],
            [d.param_type(i) for i in range(d.nparams)])


@pytest.mark.parametrize("role", ["reporter", "notice_reporter"])
def test_the_reported_statement_describes_exactly_as_the_answer(truth: psycopg.Connection, plain_reporter: str,
                                                                 role: str) -> None:
    """Wrapping the answer keeps its RowDescription byte for byte (names, types, typmods, table and column of
    origin) and its parameter types: a Describe answered from it is the answer's."""
    policy = load_policy(truth)
    for n, sql in enumerate([
            "SELECT education, count(*), sum(capital_gain)::bigint AS s, avg(age) FROM adult WHERE age > $1 GROUP BY 1",
            "SELECT count(*) FROM adult",
            "SELECT sex, native_country, count(*) FROM adult GROUP BY 1, 2 ORDER BY 3 DESC LIMIT $1"]):
        decision = decide(sql, policy.role(role), policy)
        assert isinstance(decision, Rewrite) and decision.reported is not None
        assert described(truth, decision.sql, f"{role}_answer_{n}") == \
            described(truth, decision.reported, f"{role}_reported_{n}")
