"""`anonproxy console` on real traffic: a database under the demo policy, the real proxy, the console as the demo
`auditor`, each page loaded by headless chromium; and who may read the trail (sql/0026_auditor.sql)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from html import unescape
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    free_port,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
    wait_for_current_policy,
)
from PIL import Image

from anonproxy.embedded import EmbeddedPostgres

CHROMIUM = shutil.which("chromium") or "chromium"
DATABASE = "anonproxy_console"
QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]
PROBE = "select id, count(*) from adult group by id"
WHOLE = "select count(*) from adult"
DIFFERENCE = "select count(*) from adult where id <> 17"
REFUSED = "select * from adult limit 1"  # suppress mode answers aggregates only
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "console"  # screenshots, ignored by git


@dataclass
class Console:
    url: str
    owner: psycopg.Connection  # the database's superuser, autocommit
    direct: Endpoint
    shots: Path


def chromium_dom(url: str) -> str:
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--dump-dom", url], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # A script error or a blocked fetch would be logged as a CONSOLE line.
    assert not [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line], done.stderr
    return done.stdout


def screenshot(url: str, path: Path) -> None:
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000",
                    f"--screenshot={path}", url], capture_output=True, timeout=120, check=True)
    with Image.open(path) as image:
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 20  # a page, not a blank


def rows_of(dom: str) -> list[str]:
    return re.findall(r"<tr>(.*?)</tr>", dom, flags=re.DOTALL)


@dataclass
class Traffic:
    owner: psycopg.Connection  # the database's superuser, autocommit
    direct: Endpoint


@pytest.fixture(scope="module")
def traffic(pg_server: EmbeddedPostgres, pg_template: object,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    """A database under the demo policy with two releases, and real traffic through the proxy."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")  # type: ignore[attr-defined]
    owner = psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True)
    with owner.transaction():
        govern_by_demo_policy(owner, DATABASE)
    owner.execute("create table adult_small as select * from adult where id % 10 = 0")
    owner.execute("alter table adult_small add primary key (id)")
    for target, k in (("public.small_k5", 5), ("public.small_k10", 10)):
        owner.execute("""select anonproxy.create_anonymized_view(source => 'public.adult_small', target => %s,
                             quasi_identifiers => %s, sensitive => 'occupation', k => %s)""", (target, QI, k))
    logs = tmp_path_factory.mktemp("console")
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", logs / "anonproxy.log", workers="1",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={DATABASE}")
    try:
        wait_for_current_policy(owner, proxy.endpoint, DATABASE)
        send_traffic(proxy.endpoint)
        yield Traffic(owner, Endpoint(pg_server.host, pg_server.port))
    finally:
        stop_proxy(proxy)
        owner.close()


@pytest.fixture(scope="module")
def console(traffic: Traffic) -> Iterator[Console]:
    """`anonproxy console` as the demo auditor, on the traffic's database."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "console", "--port", str(port), "--dsn",
                                traffic.direct.dsn(DATABASE, user="auditor")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stderr is not None
        ready = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in ready, ready + process.stderr.read()
        shots = ARTIFACTS
        shots.mkdir(parents=True, exist_ok=True)
        print(f"\nconsole screenshots in {shots}")
        yield Console(f"http://127.0.0.1:{port}", traffic.owner, traffic.direct, shots)
    finally:
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=30)
        assert "Traceback" not in errors, errors


def send_traffic(proxy: Endpoint) -> None:
    with psycopg.connect(proxy.dsn(DATABASE, user="reporter"), autocommit=True) as reporter:
        reporter.execute("select sex, count(*) from adult group by sex").fetchall()
        reporter.execute(PROBE).fetchall()
        reporter.execute(WHOLE).fetchall()
        reporter.execute(DIFFERENCE).fetchall()
        for _ in range(5):
            with pytest.raises(psycopg.Error):
                reporter.execute(REFUSED)
    with psycopg.connect(proxy.dsn(DATABASE, user="analyst"), autocommit=True) as analyst:
        analyst.execute("select count(*) from adult").fetchall()
        analyst.execute("select education, count(*) from adult group by 1").fetchall()


def trail_ids(owner: psycopg.Connection, statement: str, login: str) -> list[int]:
    return [i for (i,) in owner.execute("select id from anonproxy.audit_trail where statement = %s and login = %s "
                                        "order by id", (statement, login))]


def test_budgets_page_shows_what_the_ledger_counts(console: Console) -> None:
    dom = chromium_dom(console.url + "/budgets")
    screenshot(console.url + "/budgets", console.shots / "budgets.png")
    expected = console.owner.execute("select epsilon_spent, epsilon_budget from anonproxy.remaining_budgets('analyst') "
                                     "where domain = 'public.adult'").fetchone()
    assert expected is not None and expected[0] > 0
    shown = re.search(r'<span class="spent" data-role="analyst" data-domain="public.adult">([^<]*)</span>', dom)
    assert shown is not None, dom
    assert Decimal(shown.group(1)) == expected[0]
    # Under the demo's zCDP accounting, what is spent is not the sum of each answer's stand-alone ε.
    summed = console.owner.execute("select sum(epsilon) from anonproxy.audit_trail where login = 'analyst'").fetchone()
    assert summed is not None and summed[0] > 0 and summed[0] != expected[0]
    # The chart: a line over time, ending at what is spent now, under the budget.
    assert dom.count("<svg") >= 1 and "<polyline" in dom
    assert f"spent {shown.group(1)}</text>" in dom and f"budget ε {expected[1].normalize():f}" in dom


def test_trail_search_by_login_finds_only_that_login(console: Console) -> None:
    dom = chromium_dom(console.url + "/trail?login=analyst")
    screenshot(console.url + "/trail?login=reporter", console.shots / "trail.png")
    logins = re.findall(r'<span class="login">([^<]*)</span>', dom)
    count = console.owner.execute("select count(*) from anonproxy.audit_trail where login = 'analyst'").fetchone()
    assert count is not None and len(logins) == count[0] > 0
    assert set(logins) == {"analyst"}
    assert "ρ charged" in dom and "ε charged" in dom  # each answer with its cost

    refused = chromium_dom(console.url + "/trail?decision=refused&text=" + quote("limit 1"))
    statements = [unescape(s) for s in re.findall(r"<code>(.*?)</code>", refused, flags=re.DOTALL)]
    assert statements and set(statements) == {REFUSED}


def test_flags_point_at_the_probe_the_difference_and_the_refusals(console: Console) -> None:
    dom = chromium_dom(console.url + "/flags")
    screenshot(console.url + "/flags", console.shots / "flags.png")
    identifier = re.search(r'<section class="flag-identifier">(.*?)</section>', dom, flags=re.DOTALL)
    assert identifier is not None and "identifying column id in GROUP BY" in identifier.group(1)
    probe = trail_ids(console.owner, PROBE, "reporter")
    assert probe and f"ids={probe[0]}" in identifier.group(1)

    differencing = re.search(r'<section class="flag-differencing">(.*?)</section>', dom, flags=re.DOTALL)
    pair = (trail_ids(console.owner, WHOLE, "reporter")[0], trail_ids(console.owner, DIFFERENCE, "reporter")[0])
    assert differencing is not None and "id &lt;&gt; 17" in differencing.group(1)
    assert f"ids={pair[0]}%2C{pair[1]}" in differencing.group(1)

    refusals = re.search(r'<section class="flag-refusals">(.*?)</section>', dom, flags=re.DOTALL)
    assert refusals is not None and "5 statements refused" in refusals.group(1)

    # The link behind the probe's flag shows the probe.
    link = re.search(r'href="(/trail\?ids=[^"]*)"', identifier.group(1))
    assert link is not None
    behind = chromium_dom(console.url + unescape(link.group(1)))
    assert PROBE in unescape(behind)


def test_releases_page_verifies_and_composes(console: Console) -> None:
    dom = chromium_dom(console.url + "/releases")
    screenshot(console.url + "/releases", console.shots / "releases.png")
    for target in ("public.small_k5", "public.small_k10"):
        assert target in dom
    k10 = console.owner.execute("select anonproxy.k_anonymity('public.small_k10', %s)", (QI,)).fetchone()
    assert k10 is not None and f"k now {k10[0]}: meets k" in dom
    risk = console.owner.execute("select anonproxy.composition_risk(array['public.small_k5', 'public.small_k10']::"
                                 "regclass[], 'public.adult_small')").fetchone()
    assert risk is not None
    assert f"PVP {risk[0]['pvp']['100']} % certain" in unescape(dom)


def test_policy_history_records_a_change(console: Console) -> None:
    console.owner.execute("update anonproxy.role_policies set k = 20 where role_name = 'reporter'")
    dom = unescape(chromium_dom(console.url + "/policy"))
    assert "role_policies: reporter: k 10 → 20" in dom


def test_a_login_that_may_not_read_the_trail_is_told_so(console: Console, tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "console", "--port", str(port), "--dsn",
                                console.direct.dsn(DATABASE, user="reporter")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert "http://" in process.stdout.readline()
        dom = chromium_dom(f"http://127.0.0.1:{port}/trail")
        assert "this login may not read the audit trail" in dom
        assert "Traceback" not in dom
    finally:
        process.send_signal(signal.SIGTERM)
        _, errors = process.communicate(timeout=30)
    assert "Traceback" not in errors


def test_console_without_a_database_says_so() -> None:
    done = subprocess.run([sys.executable, "-m", "anonproxy.cli", "console", "--port", "0", "--dsn",
                           f"host=127.0.0.1 port={free_port()} dbname=x user=x password=x connect_timeout=2"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.startswith("anonproxy console: cannot log in:") and "Traceback" not in done.stderr


# -- who may read the trail ------------------------------------------------------------------------------


def test_the_dba_may_not_read_the_trail(traffic: Traffic) -> None:
    with psycopg.connect(traffic.direct.dsn(DATABASE, user="dba"), autocommit=True) as dba:
        assert dba.execute("select count(*) from adult").fetchone() == (30162,)  # it reads the raw data
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            dba.execute("select * from anonproxy.audit_trail")
        assert refused.value.sqlstate == "42501"


def test_the_auditor_reads_the_trail_and_nothing_else(traffic: Traffic) -> None:
    with psycopg.connect(traffic.direct.dsn(DATABASE, user="auditor"), autocommit=True) as auditor:
        count = auditor.execute("select count(*) from anonproxy.audit_trail").fetchone()
        assert count is not None and count[0] > 0
        assert auditor.execute("select count(*) from anonproxy.budget_ledger").fetchone() != (0,)
        for statement in ("select count(*) from public.adult", "select count(*) from public.adult_small",
                          "select anonproxy.set_role_policy('auditor', 'direct')",
                          "select anonproxy.clear_policy()",
                          "select anonproxy.charge('analyst', 'public.adult', 0.1, 0, 'x')",
                          "insert into anonproxy.role_policies (role_name, mode) values ('auditor', 'direct')",
                          "select anonproxy.audit_write('[]')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                auditor.execute(statement)
