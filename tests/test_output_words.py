"""Issue 13, Deliver 4-6: progress of the long commands, numbers and words a reader understands, hints that fit.

Refusals go through the real gated proxy (the demo policy: reporter in suppress
mode, analyst in dp mode); the commands run as `python3 -m anonproxy.cli` in a
child process against the test's database.
"""

from __future__ import annotations

import html
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint, Up, free_port, fresh_dp_role
from test_dp_plan import plan

from anonproxy.dp.finish import answer, supported_digits
from anonproxy.embedded import EmbeddedPostgres

QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]
SUPPRESS_AGGREGATES = ("Allowed aggregates: count(*), count(x), count(DISTINCT x), sum(x), avg(x), "
                       "variance/var_samp/var_pop/stddev/stddev_samp/stddev_pop(x).")
DP_AGGREGATES = "percentile_cont/percentile_disc(q) WITHIN GROUP (ORDER BY x)"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", *args], check=False, capture_output=True,
                          text=True, timeout=300)


# -- hints per mode and per clause ------------------------------------------------------------------------------

# (statement, role, SQLSTATE, words the hint must hold, words it must not hold)
REFUSALS = [
    # dp lists its own aggregates for min(), suppress lists its own.
    ("select min(age) from adult", "analyst", "42501", ["Aggregates in dp mode:", "median(x)", DP_AGGREGATES,
                                                        "percentile_cont(0.95)"], [SUPPRESS_AGGREGATES]),
    ("select min(age) from adult", "reporter", "42501", [SUPPRESS_AGGREGATES], ["median", "dp mode"]),
    # A refused function: the hint names the clause it is in, and what that clause may hold.
    ("select sqrt(age), count(*) from adult group by 1", "reporter", "0A000",
     ["Allowed in the select list:", "the GROUP BY expressions and aggregates (count(*)", "date_trunc"],
     ["WHERE", "median"]),
    ("select sqrt(age), count(*) from adult group by 1", "analyst", "0A000",
     ["Allowed in the select list:", DP_AGGREGATES], ["WHERE"]),
    ("select count(*) from adult where sqrt(age) > 30", "reporter", "0A000",
     ["Allowed in WHERE:", "column references", "width_bucket"], ["GROUP BY", "aggregates", "select list"]),
    ("select count(*) from adult where sqrt(age) > 30", "analyst", "0A000", ["Allowed in WHERE:"], ["GROUP BY"]),
    ("select count(*) from adult group by sqrt(age)", "reporter", "0A000", ["Allowed in GROUP BY:"],
     ["WHERE", "aggregates"]),
    ("select sex, count(*) from adult group by sex having exp(count(*)) > 10", "reporter", "0A000",
     ["Allowed in HAVING:", "aggregates (count(*)"], ["WHERE"]),
    ("select sex, count(*) from adult group by sex order by exp(count(*))", "reporter", "0A000",
     ["Allowed in ORDER BY:"], ["WHERE"]),
    # A JOIN with a relation outside the policy: refused for what it reads, and told to query it on its own.
    ("select count(*) from adult a join pg_catalog.pg_class c on abs(a.id) = c.oid", "reporter", "42501",
     ["Query pg_catalog.pg_class in a statement of its own"], ["WHERE", "aggregates"]),
    ("select sum(sqrt(age)) from adult", "reporter", "0A000", ["Allowed in the argument of sum():"],
     ["WHERE", "aggregates ("]),
    # An aggregate where it cannot be: the hint says where it goes.
    ("select sum(count(*)) from adult", "reporter", "0A000", ["cannot be nested"], ["WHERE"]),
    ("select count(*) from adult group by count(*)", "reporter", "0A000", ["put the aggregates in the select list"],
     ["WHERE"]),
]


@pytest.mark.parametrize(("statement", "role", "sqlstate", "present", "absent"), REFUSALS)
def test_refusal_hints_fit_mode_and_clause(gated_proxy: Endpoint, gated_database: str, statement: str, role: str,
                                           sqlstate: str, present: list[str], absent: list[str]) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(statement)
    diag = caught.value.diag
    assert diag.sqlstate == sqlstate, (diag.message_primary, diag.message_hint)
    hint = diag.message_hint or ""
    for words in present:
        assert words in hint, (diag.message_primary, hint)
    for words in absent:
        assert words not in hint, (diag.message_primary, hint)


def test_refusal_messages_name_the_clause(gated_proxy: Endpoint, gated_database: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        for statement, clause in [("select sqrt(age), count(*) from adult group by 1", "the select list"),
                                  ("select count(*) from adult where sqrt(age) > 30", "WHERE")]:
            with pytest.raises(psycopg.Error) as caught:
                conn.execute(statement)
            assert f"not allowed in {clause} of a query over protected table public.adult" in str(caught.value)


def test_verify_of_a_missing_table_says_it_does_not_exist(dbname: str, direct: Endpoint) -> None:
    done = cli("verify", "public.nosuch", "--dsn", direct.dsn(dbname))
    assert done.returncode == 1
    assert "anonproxy verify: relation public.nosuch does not exist" in done.stderr
    assert "--qi" not in done.stderr and "Traceback" not in done.stderr
    # A table that exists but is not a release still asks for its quasi-identifiers.
    plain = cli("verify", "public.adult", "--dsn", direct.dsn(dbname))
    assert plain.returncode == 1 and "name its quasi-identifiers with --qi" in plain.stderr


# -- dp answers rounded to what their interval supports -----------------------------------------------------------

@pytest.fixture
def dp_role(pg_server: EmbeddedPostgres, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A dp role of its own (ε 2, 0.5 per query on public.adult), so no other test's budget is spent."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as truth, \
            fresh_dp_role(truth, gated_proxy, gated_database, "dp_words") as role:
        yield role


def decimals(text: str) -> int:
    return len(text.partition(".")[2])


def test_dp_average_has_the_digits_its_interval_supports(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                         gated_database: str, dp_role: str) -> None:
    query = "select sex, avg(age) from adult group by sex"
    details: list[str] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=dp_role), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: details.append(d.message_detail or ""))
        cursor = conn.cursor()
        cursor.execute(query)
        assert cursor.description is not None and cursor.description[1].type_code == 1700  # still numeric
        # The text as the client receives it, so the test sees the digits sent.
        rows = {sex: str(value) for sex, value in cursor.fetchall()}
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as truth:
        counts = dict(truth.execute("select sex, count(age) from adult group by sex").fetchall())
    # Each row's interval is ±q/n with q between the notice's two figures (average at the middle of the bounds,
    # and at a bound).
    found = re.search(r"95% interval per row ±q/n .*?q from ([0-9.e+]+) .*? to ([0-9.e+]+) ", "\n".join(details))
    assert found is not None, details
    narrowest, widest = float(found[1]), float(found[2])
    for sex, text in rows.items():
        assert Decimal(text).is_finite() and 17 <= Decimal(text) <= 90
        # One digit below the interval's leading digit: the noisy count is close to the true one (±≈40 here,
        # in groups of 10000 and 20000), so the half-width's power of ten is within those of q/n's range or one off.
        most = 1 - math.floor(math.log10(narrowest / counts[sex]))
        least = 1 - math.floor(math.log10(widest / counts[sex]))
        assert least - 1 <= decimals(text) <= most + 1, (text, narrowest, widest)
        assert decimals(text) < 6, text


# -- anonymized releases: words, numbers, progress ----------------------------------------------------------------

@pytest.fixture
def releases(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str) -> str:
    """Two Mondrian releases (k = 5 and 10, entropy ℓ 2, t 0.5) of a tenth of adult; the DSN of their database."""
    conn = postgresql
    conn.execute("create table adult_small as select * from adult where id % 10 = 0")
    conn.execute("alter table adult_small add primary key (id)")
    for target, k in (("public.small_k5", 5), ("public.small_k10", 10)):
        conn.execute("""select anonproxy.create_anonymized_view(source => 'public.adult_small', target => %s,
                            quasi_identifiers => %s, sensitive => 'occupation', k => %s, l => 2, t => 0.5)""",
                     (target, QI, k))
    conn.commit()
    return pg_server.conninfo(dbname=dbname)


def test_release_list_rounds_l_and_t(releases: str, postgresql: psycopg.Connection) -> None:
    stored = postgresql.execute("select achieved ->> 'l_entropy', achieved ->> 't' from anonproxy.releases "
                                "order by id").fetchall()
    assert any(len(l) > 8 or len(t) > 8 for l, t in stored)  # what the registry holds: many decimals
    done = cli("release", "list", "--dsn", releases)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["id", "target", "method", "source", "k", "entropy", "ℓ", "t", "built", "revealed",
                                "combined"]
    for line, (l, t) in zip(lines[1:3], stored, strict=True):
        fields = line.split()
        assert fields[5] == f"{float(l):.4g}" and fields[6] == f"{float(t):.4g}", line


def test_report_has_progress_verdict_and_words_and_uses_no_release_id(
        releases: str, postgresql: psycopg.Connection, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = cli("report", "public.small_k10", "--html", str(page), "--dsn", releases, "--curve-k", "5,10,20")
    assert done.returncode == 0, done.stderr
    # Progress on stderr, a line per step when not on a terminal: 4 steps and one per k of the curve.
    steps = [line for line in done.stderr.splitlines() if line.startswith("anonproxy report: ")]
    assert [line.split()[2] for line in steps] == [f"{i}/7" for i in range(8)], done.stderr
    assert "anonproxy report: 3/7 risk-utility curve: mondrian at k = 5" in steps
    # The verdict, as verify prints it, on stdout and on the page.
    # The two releases combined reveal nobody's occupation exactly (PVP at 100 % is 0): they meet their parameters.
    risk = postgresql.execute("select anonproxy.composition_risk(array['small_k5', 'small_k10']::regclass[])"
                              ).fetchone()[0]
    postgresql.rollback()
    assert float(risk["pvp"]["100"]) == 0
    verdict = "meets its parameters; combined with public.small_k5 it reveals no one's occupation exactly"
    assert done.stdout.splitlines()[0] == f"public.small_k10: {verdict}"
    verify = cli("verify", "public.small_k10", "--dsn", releases)
    assert verify.stdout.rstrip().splitlines()[-1] == verdict
    text = page.read_text()
    assert f"<strong>Verdict:</strong> {html.escape(verdict)}" in text
    for k in (5, 10, 20):  # every k of the curve was computed
        assert f"k={k}</text>" in text.replace("\n", "")
    assert "<li>k = " not in text  # no k failed
    # Parameters in words, not JSON; the missing unit explained; the paper's terms explained.
    assert "{&quot;" not in text and '{"' not in text.split("<svg")[0]
    assert "<td>k = 10; entropy ℓ ≥ 2; t ≤ 0.5 (" in text
    assert "<td>none: each row counts as one person</td>" in text
    assert "Effective anonymity (EA) is how many values remain possible" in text
    assert "PVP at 100 % confidence (people narrowed to one value)" in text
    assert "seed " not in text  # no reference to a source document by its number
    # The curve registered nothing: the next release gets the next id.
    before = postgresql.execute("select max(id) from anonproxy.releases").fetchone()[0]
    postgresql.execute("""select anonproxy.create_anonymized_view(source => 'public.adult_small',
                          target => 'public.small_k20', quasi_identifiers => %s, k => 20)""", (QI,))
    after = postgresql.execute("select id from anonproxy.releases where target = 'public.small_k20'").fetchone()[0]
    assert after == before + 1
    postgresql.rollback()
    assert postgresql.execute("select count(*) from pg_class where relname like 'anonproxy_%'").fetchone() == (0,)


def test_audit_shows_progress_and_explains_its_terms(releases: str) -> None:
    done = cli("audit", "--dsn", releases, "--source", "public.adult_small")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "anonproxy audit: 0/1 combining public.small_k5, public.small_k10", "anonproxy audit: 1/1 done"]
    assert "  EA, effective anonymity: how many sensitive values remain possible for a person" in done.stdout
    assert "  PVP, share of vulnerable people:" in done.stdout


def test_verify_names_its_metrics_in_words(releases: str) -> None:
    done = cli("verify", "public.small_k5", "--dsn", releases)
    assert done.returncode == 0, done.stderr
    assert "  parameters: k = 5; entropy ℓ ≥ 2; t ≤ 0.5 (equal distance); no row left out\n" in done.stdout
    assert "average class size / C_avg (that size over k)" in done.stdout
    assert "NCP, information lost to generalization" in done.stdout


# -- progress of install and up -----------------------------------------------------------------------------------

def test_install_shows_each_migration(pg_server: EmbeddedPostgres) -> None:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as admin:
        admin.execute("drop database if exists anonproxy_words_install")
        admin.execute("create database anonproxy_words_install")
        try:
            done = cli("install", "--dsn", pg_server.conninfo(dbname="anonproxy_words_install"))
            again = cli("install", "--dsn", pg_server.conninfo(dbname="anonproxy_words_install"))
        finally:
            admin.execute("drop database anonproxy_words_install")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("anonproxy install: ")]
    total = len(lines)
    assert total >= 12
    assert lines[0] == f"anonproxy install: 1/{total} migration 0001 anonproxy_schema"
    assert all(f" {i}/{total} migration " in line for i, line in enumerate(lines, 1))
    assert again.returncode == 0 and again.stdout.strip() == "schema already up to date"
    assert again.stderr == ""  # nothing applied, nothing to show


def test_up_says_when_it_starts_and_stops() -> None:
    up = Up("--port", str(free_port()))
    output = up.stop()
    assert up.process.returncode == 0, output
    lines = output.splitlines()
    start = lines.index("anonproxy up: starting PostgreSQL and loading the sample data (a few seconds)")
    ready = lines.index("anonproxy is ready. Connect with:")
    stopping = lines.index("anonproxy up: stopping the proxy and PostgreSQL")
    assert start < ready < stopping < lines.index("anonproxy up: stopped")
    assert "Traceback" not in output


def test_anonymize_and_refresh_show_progress_and_explain_ncp(dbname: str, direct: Endpoint) -> None:
    dsn = direct.dsn(dbname)
    made = cli("anonymize", "--dsn", dsn, "--source", "public.adult", "--target", "adult_words",
               "--qi", "age,sex,race", "--k", "10")
    assert made.returncode == 0, made.stderr
    assert re.search(r"^  NCP +\d+\.\d\d % \(information lost to generalization\)$", made.stdout, re.MULTILINE)
    refreshed = cli("release", "refresh", "adult_words", "--dsn", dsn)
    assert refreshed.returncode == 0, refreshed.stderr
    for done in (made, refreshed):
        steps = [line.split()[2] for line in done.stderr.splitlines() if re.match(r"anonproxy \w+: \d+/5 ", line)]
        assert steps == ["1/5", "2/5", "3/5", "4/5", "5/5"], done.stderr


@pytest.mark.parametrize(("value", "halfwidth", "text"), [
    (Fraction(386123, 10000), 51.0, "39"), (Fraction(386123, 10000), 0.3, "38.61"),
    (Fraction(-5, 3), 0.004, "-1.6667"), (Fraction(123456), 1500.0, "123500"), (Fraction(1, 2), 9.99, "0.5")])
def test_supported_digits(value: Fraction, halfwidth: float, text: str) -> None:
    rounded = supported_digits(value, halfwidth)
    assert format(rounded, "f") == text
    assert abs(Fraction(rounded) - value) <= Fraction(halfwidth) / 20  # moved by a twentieth of the interval at most


def test_a_sum_on_a_fixed_point_grid_is_rounded_to_its_interval() -> None:
    p = plan("select sum(hours_per_week) from adult")  # bounds 0.5 .. 99.5: a grid of 0.01
    noise = p.columns[0].noise
    assert noise.resolution == Fraction(1, 100) and "rounded to the digits" in p.notices()[0]
    expected = 1 - math.floor(math.log10(noise.ci95_halfwidth))
    for _ in range(20):
        ((total,),), _ = answer(p, [(Decimal("1234567.89"),)])
        assert isinstance(total, Decimal), total
        assert Fraction(total) % Fraction(10) ** -expected == 0, (total, noise)  # ±298: tens
        assert decimals(format(total, "f")) == max(expected, 0), (total, noise)
