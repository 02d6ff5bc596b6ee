"""Suppress mode says what it withheld (docs/suppression.md, "What suppression says"), through the real proxy.

The `reporter` of the demo policy (k = 10, dominance (2, 85 %), p 10 %, suppressed rest) asks; psycopg's notice
handler and psql show the NOTICE. The answers themselves must be exactly those of the plain rewrite (rows, order,
column names and types), and the notice must not single anybody out: a filter that matches one person or nobody
gives the same words.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from conftest import Endpoint, wait_for_policy
from suppression_oracle import suppress

from anonproxy.embedded import find_pg_bindir
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

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


def test_a_whole_table_total_is_answered_without_a_notice(gated_proxy: Endpoint, gated_database: str,
                                                          truth: psycopg.Connection) -> None:
    """n = N: the total over everyone is public anyway (the sum of any GROUP BY's rows), so it is released."""
    rows, columns, notices = ask(gated_proxy, gated_database, "SELECT count(*) FROM adult")
    assert rows == truth.execute("SELECT count(*) FROM adult").fetchall() and columns == [("count", 20)]
    assert notices == []


def test_a_total_of_all_but_one_person_says_query_set_size_control_withheld_it(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    """N - k < n < N: subtracted from the public total it would give person 17's row; withheld, and the notice says
    which rule (docs/suppression.md, "The notice after an answer")."""
    everyone, n = truth.execute("SELECT count(DISTINCT id), count(DISTINCT id) FILTER (WHERE id <> 17) "
                                "FROM adult").fetchone()
    assert n == everyone - 1  # leaves out 1 person, between 1 and k - 1
    rows, columns, notices = ask(gated_proxy, gated_database, "SELECT count(*) FROM adult WHERE id <> 17")
    assert rows == [] and columns == [("count", 20)]
    assert [n.severity for n in notices] == ["NOTICE"]
    (message, detail, hint), = texts(notices)
    assert message == "anonproxy: the total was withheld by query-set-size control"
    assert f"at least k = {K} people" in detail and f"either nobody or at least {K} of the people in public.adult" \
        in detail and "n >= k, and n = N or n <= N - k" in detail
    assert "never" not in detail  # a total over everyone is released now
    assert hint.startswith(f"Change the WHERE so that it covers at least {K} people and leaves out nobody or at "
                           f"least {K}") and "GROUP BY a column" in hint


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


@dataclass(frozen=True)
class Expected:
    """What docs/suppression.md ("The rules") withholds, worked out from the owner's own GROUP BY."""

    sizes: dict[object, int]  # people per group
    primary: frozenset[object]  # groups that fail the rules alone
    complementary: frozenset[object]  # groups withheld with them
    rest: bool  # the suppressed-rest row over the withheld groups passes
    sayable: bool  # the withheld groups hold k people or more and leave out of N nobody or k or more

    @property
    def withheld(self) -> frozenset[object]:
        return self.primary | self.complementary

    @property
    def released(self) -> Counter[tuple[object, int]]:
        return Counter((key, n) for key, n in self.sizes.items() if key not in self.withheld)

    @property
    def withheld_people(self) -> int:
        return sum(self.sizes[key] for key in self.withheld)


def expected(truth: psycopg.Connection, key: str, where: str = "true", contributors: str = "count(*)",
             rest_row: bool = True) -> Expected:
    """What the rules of docs/suppression.md (tests/suppression_oracle.py) withhold of the owner's ``GROUP BY key``
    over adult (one row per person, so the groups are disjoint and given as counts), for answers without
    magnitude rules; ``contributors``: the people the weakest aggregate counts. The withheld groups are sayable
    when they hold k people or more and leave out of N nobody or k or more."""
    everyone = truth.execute("SELECT count(DISTINCT id) FROM adult").fetchone()[0]
    rows = truth.execute(f"SELECT {key}, count(DISTINCT id), {contributors} FROM adult WHERE {where} "
                         "GROUP BY 1").fetchall()
    sizes = {row[0]: row[1] for row in rows}
    verdict = suppress(sizes, k=K, everyone=everyone, contributors={contributors: {row[0]: row[2] for row in rows}},
                       rest=rest_row)
    added = verdict.withheld - verdict.primary
    if added and verdict.released:  # ties are broken by the grouping values in the database's collation: keep clear
        assert max(sizes[g] for g in added) < min(sizes[g] for g in verdict.released)
    people = len(verdict.rest_people)
    return Expected(sizes, verdict.primary, added, verdict.rest,
                    people >= K and (people == everyone or people <= everyone - K))


def counted(groups: int, complementary: int) -> str:
    """The first words of the notice for ``groups`` withheld groups, ``complementary`` of them by complementary
    suppression (docs/suppression.md, "The notice after an answer")."""
    words = f"anonproxy: {groups} group{'s were' if groups != 1 else ' was'} suppressed"
    if complementary and groups > complementary:
        words += f" ({groups - complementary} by the rules, {complementary} more by complementary suppression)"
    elif complementary:
        words += f" (none by the rules, {complementary} by complementary suppression)"
    return words


def test_grouped_answer_counts_its_suppressed_groups_and_labels_the_rest_row(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    sql = ("SELECT native_country, count(*) AS people FROM adult WHERE age > 50 GROUP BY native_country "
           "ORDER BY 2 DESC")
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    truly = expected(truth, "native_country", "age > 50")
    assert len(truly.primary) > 1 and truly.rest
    rest = [row for row in rows if row[0] is None]
    assert len(rest) == 1  # the data has no NULL country: the one NULL row is the suppressed rest
    assert Counter(row for row in rows if row[0] is not None) == truly.released
    assert rest == [(None, truly.withheld_people)]
    (message, detail, hint), = texts(notices)
    assert message == (f"{counted(len(truly.withheld), len(truly.complementary))}; the row with NULL in "
                       "native_country holds them together")
    assert f"fewer than k = {K} people" in detail and hint is None


def test_a_grouping_of_the_whole_table_has_a_rest_row(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    """The answer covers everyone (A = N): the released rows and the rest row add up to the total over everyone,
    which is released, so the rest row is released when it passes the rules over its own people."""
    sql = "SELECT age, count(*) AS people FROM adult GROUP BY age"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    truly = expected(truth, "age")
    assert truly.withheld_people >= K and not truly.complementary and truly.rest  # the small ages hold k together
    nulls = [row for row in rows if row[0] is None]
    assert nulls == [(None, truly.withheld_people)]  # no NULL age in the data: the one NULL row is the rest
    assert Counter(row for row in rows if row[0] is not None) == truly.released
    assert sum(row[1] for row in rows) == truth.execute("SELECT count(*) FROM adult").fetchone()[0]
    (message, _, _), = texts(notices)
    assert message == f"{counted(len(truly.primary), 0)}; the row with NULL in age holds them together"


def test_a_rest_row_that_would_complete_all_but_one_person_is_withheld(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    """Everyone but person 17, by sex: both groups are large, but released together they would add up to a total
    over N - 1 people. Complementary suppression withholds the smaller one, and the rest row over it is withheld,
    the answer leaving out one person (docs/suppression.md: "GROUP BY sex with WHERE id <> 17 releases only the
    larger group")."""
    sql = "SELECT sex, count(*) FROM adult WHERE id <> 17 GROUP BY sex"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    truly = expected(truth, "sex", "id <> 17")
    assert not truly.primary and len(truly.complementary) == 1 and not truly.rest
    assert Counter(rows) == truly.released and len(rows) == 1
    assert rows[0][1] == max(truly.sizes.values())
    (message, detail, hint), = texts(notices)
    assert message == f"{counted(1, 1)}; no rest row holds it together: it did not pass the same rules"
    assert "(complementary suppression)" in detail and f"leave out of N nobody or at least {K} people" in detail
    assert hint is None


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
    """Next to released rows the withheld groups now always hold k people or more (complementary suppression
    withholds more until they do); when every group is withheld and they hold fewer than k, "1 group" would say
    that somebody matches. The one person from the Netherlands then reads like nobody."""
    one = "SELECT native_country, count(*) FROM adult WHERE native_country IN ('Holand-Netherlands', 'Atlantis') " \
          "GROUP BY native_country"
    truly = expected(truth, "native_country", "native_country IN ('Holand-Netherlands', 'Atlantis')")
    assert truly.sizes == {"Holand-Netherlands": 1} and not truly.sayable
    rows, columns, notices = ask(gated_proxy, gated_database, one)
    assert (rows, columns) == plain(truth, one) and rows == []
    _, _, nobody = ask(gated_proxy, gated_database, one.replace("'Holand-Netherlands', ", ""))
    assert texts(notices) == texts(nobody) and len(notices) == 1
    assert notices[0].message_primary == "anonproxy: no group was released"
    assert "is not said" in notices[0].message_detail


def test_complementary_suppression_is_counted_in_the_notice(gated_proxy: Endpoint, gated_database: str,
                                                            truth: psycopg.Connection) -> None:
    """Over the whole table only the one person from the Netherlands fails the rules alone; the released rows
    would leave that one person out of N, so the smallest country released alone is withheld with them, and the
    notice says so (docs/suppression.md, "Complementary suppression")."""
    sql = "select native_country, count(*) from adult group by 1"
    rows, columns, notices = ask(gated_proxy, gated_database, sql)
    assert (rows, columns) == plain(truth, sql)
    sizes = dict(truth.execute("SELECT native_country, count(DISTINCT id) FROM adult GROUP BY 1").fetchall())
    assert [country for country, n in sizes.items() if n < K] == ["Holand-Netherlands"]
    assert sizes["Holand-Netherlands"] == 1
    smallest = min((n, country) for country, n in sizes.items() if n >= K)  # the smallest released alone
    assert smallest[0] < sorted(n for n in sizes.values() if n >= K)[1]  # and no tie for that place
    truly = expected(truth, "native_country")
    assert truly.primary == {"Holand-Netherlands"} and truly.complementary == {smallest[1]} and truly.rest
    assert Counter(row for row in rows if row[0] is not None) == truly.released
    assert [row for row in rows if row[0] is None] == [(None, 1 + smallest[0])]
    (message, detail, hint), = texts(notices)
    assert message == ("anonproxy: 2 groups were suppressed (1 by the rules, 1 more by complementary suppression); "
                       "the row with NULL in native_country holds them together")
    assert "(complementary suppression)" in detail and "smallest released groups" in detail and hint is None


def test_having_neither_chooses_the_rest_row_nor_changes_the_notice(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    """HAVING is evaluated on the released groups and the rest row only: the rest row holds every withheld group
    whatever the HAVING would say of it, and the HAVING then only removes rows (docs/suppression.md, "HAVING, and
    everything after the groups")."""
    sql = "SELECT native_country, count(*) AS people FROM adult WHERE age > 50 GROUP BY 1"
    rows, _, notices = ask(gated_proxy, gated_database, sql)
    truly = expected(truth, "native_country", "age > 50")
    # Withheld groups the HAVING below would drop, were it evaluated on them: they stay in the rest row.
    assert any(truly.sizes[g] < 5 for g in truly.withheld) and truly.withheld_people >= 5 and truly.rest
    kept, _, kept_notices = ask(gated_proxy, gated_database, sql + " HAVING count(*) >= 5")
    assert Counter(kept) == Counter(rows) and (None, truly.withheld_people) in kept
    assert texts(kept_notices) == texts(notices) and len(notices) == 1
    big, _, big_notices = ask(gated_proxy, gated_database, sql + " HAVING count(*) > 100")
    assert Counter(big) == Counter(row for row in rows if row[1] > 100) and len(big) < len(rows)
    assert texts(big_notices) == texts(notices)


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
                             "SELECT count(*) FROM adult WHERE id <> 17",
                             "SELECT native_country, count(*) FROM adult GROUP BY 1")
               for n in ask(gated_proxy, gated_database, sql)[2]]
    assert len(notices) == 3 and all(n.severity == "NOTICE" and "suppression_report" not in (n.message_primary or "")
                           and "{" not in (n.message_detail or "") for n in notices)


def test_psql_shows_the_notice(gated_proxy: Endpoint, gated_database: str) -> None:
    psql = shutil.which("psql") or str(find_pg_bindir() / "psql")
    done = subprocess.run([psql, gated_proxy.url(gated_database, user="reporter"), "-X", "-c",
                           "SELECT count(*) FROM adult WHERE id <> 17"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "NOTICE:  anonproxy: the total was withheld by query-set-size control" in done.stderr
    assert "HINT:  Change the WHERE" in done.stderr
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
    """A role in suppress mode with k = 10 only: no magnitude rules, no rest row (a total is the simple shape, one
    HAVING condition; a GROUP BY, the cells shape without a rest row)."""
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


def test_a_role_without_rest_row_counts_its_suppressed_groups(gated_proxy: Endpoint, gated_database: str,
                                                              truth: psycopg.Connection, plain_reporter: str) -> None:
    """k only: the counts follow the same rules, complementary suppression included, with no rest row to name;
    totals are released over everyone and withheld over all but one."""
    some = "SELECT native_country AS country, count(*), avg(hours_per_week) FROM adult WHERE age > 50 GROUP BY 1"
    every = "SELECT native_country AS country, count(*), avg(hours_per_week) FROM adult GROUP BY 1"
    notices: list[Notice] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=plain_reporter), autocommit=True) as conn:
        conn.add_notice_handler(keep(notices))
        some_rows = conn.execute(some).fetchall()
        every_rows = conn.execute(every).fetchall()
        assert conn.execute("SELECT count(*) FROM adult").fetchall() == \
            truth.execute("SELECT count(*) FROM adult").fetchall()
        assert conn.execute("SELECT count(*) FROM adult WHERE id <> 17").fetchall() == []
    nonzero = "count(DISTINCT id) FILTER (WHERE hours_per_week <> 0)"  # avg's contributors
    truly_some = expected(truth, "native_country", "age > 50", nonzero, rest_row=False)
    truly_every = expected(truth, "native_country", "true", nonzero, rest_row=False)
    assert len(truly_some.primary) > 1 and not truly_some.complementary
    assert len(truly_every.primary) == 1 and len(truly_every.complementary) == 1  # as for the reporter
    assert Counter(row[:2] for row in some_rows) == truly_some.released  # no rest row: only released groups
    assert Counter(row[:2] for row in every_rows) == truly_every.released
    assert [n.message_primary for n in notices] == [
        counted(len(truly_some.withheld), 0), counted(2, 1),
        "anonproxy: the total was withheld by query-set-size control"]


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
    assert decision.reported.count(constant) == decision.reported.count("native_country <>") >= 2
    assert decision.sql.count(constant) == decision.sql.count("native_country <>")
    # The copy that decides the groups (the one pass over the table, each row one person) is one of them.
    summary = decision.reported.split("anonproxy_summary AS (", 1)[1].split("\n),\n", 1)[0]
    assert f"WHERE native_country <> {constant}\nGROUP BY" in summary


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
