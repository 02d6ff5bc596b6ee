"""`anonproxy report` and `anonproxy audit` on real releases; the page rendered by headless chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from PIL import Image

from anonproxy.embedded import EmbeddedPostgres

QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]
CHROMIUM = shutil.which("chromium") or "chromium"


@pytest.fixture
def releases(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str) -> str:
    """Two Mondrian releases (k = 5 and 10) of a tenth of adult; the DSN of their database."""
    conn = postgresql
    conn.execute("create table adult_small as select * from adult where id % 10 = 0")
    conn.execute("alter table adult_small add primary key (id)")
    for target, k in (("public.small_k5", 5), ("public.small_k10", 10)):
        conn.execute("""select anonproxy.create_anonymized_view(source => 'public.adult_small', target => %s,
                            quasi_identifiers => %s, sensitive => 'occupation', k => %s)""", (target, QI, k))
    conn.commit()
    return pg_server.conninfo(dbname=dbname)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", *args], check=False, capture_output=True,
                          text=True, timeout=300)


def test_report_renders_in_chromium(releases: str, postgresql: psycopg.Connection, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = cli("report", "public.small_k10", "--html", str(page), "--dsn", releases, "--curve-k", "5,10,20")
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    # Self-contained: no script, no external resource (SVG's own xlink:href="#…" references stay inside).
    assert "<script" not in text and " src=" not in text
    assert all(link.startswith("#") for link in re.findall(r'href="([^"]*)"', text))

    rendered = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--dump-dom", page.as_uri()], check=False, capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    # Page errors and console messages would be logged as CONSOLE lines.
    assert not [line for line in rendered.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    dom = rendered.stdout
    # class sizes, entropy l, EMD, NCP per QI, the curve over k, PVP of the composition
    assert dom.count("<svg") == 6
    titles = ["Equivalence class sizes", "Entropy ℓ-diversity of each class", "t-closeness of each class",
              "Information loss per quasi-identifier", "Risk and information loss over k",
              "Intersection attack with the other releases (PVP)"]
    for title in titles:
        assert title in dom
    for k in (5, 10, 20):  # every k of the curve was computed
        assert f"k={k}</text>" in dom.replace("\n", "")
    classes = postgresql.execute(f"select count(*) from (select distinct {', '.join(QI)} from small_k10) s").fetchone()
    assert re.search(rf"<th>classes</th><td>{classes[0]}</td>", dom)
    uniform = postgresql.execute(f"select count(*) from (select 1 from small_k10 group by {', '.join(QI)} "
                                 "having count(distinct occupation) = 1) s").fetchone()
    assert f"(distinct ℓ = 1)</th><td>{uniform[0]}</td>" in dom
    assert "public.small_k5, public.small_k10" in dom  # the composition names both releases

    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,5000",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    with Image.open(shot) as image:
        assert image.size == (1200, 5000)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50  # plots, not a blank page


def test_report_curve_leaves_nothing_behind(releases: str, postgresql: psycopg.Connection, tmp_path: Path) -> None:
    postgresql.execute("update anonproxy.composition_settings set action = 'refuse', max_pvp_100 = 100")
    postgresql.commit()
    done = cli("report", "small_k5", "--html", str(tmp_path / "r.html"), "--dsn", releases, "--curve-k", "4,30")
    assert done.returncode == 0, done.stderr
    assert postgresql.execute("select count(*) from pg_class where relname like 'anonproxy_report_curve%'"
                              ).fetchone() == (0,)
    assert postgresql.execute("select array_agg(target order by id) from anonproxy.releases").fetchone() == (
        ["public.small_k5", "public.small_k10"],)
    assert postgresql.execute("select action, max_pvp_100 from anonproxy.composition_settings").fetchone() == (
        "refuse", 100)


def test_report_of_an_unknown_table(releases: str, tmp_path: Path) -> None:
    done = cli("report", "public.adult", "--html", str(tmp_path / "r.html"), "--dsn", releases)
    assert done.returncode == 1
    assert "public.adult is not a release recorded in anonproxy.releases" in done.stderr
    assert not (tmp_path / "r.html").exists()


def test_audit_prints_the_composition_risk(releases: str, postgresql: psycopg.Connection) -> None:
    risk = postgresql.execute(
        "select anonproxy.composition_risk(array['small_k5', 'small_k10']::regclass[])").fetchone()[0]
    done = cli("audit", "--dsn", releases, "--source", "public.adult_small")
    assert done.returncode == 0, done.stderr
    assert "overlap 3016 persons, located in every release 3016" in done.stdout  # ids 10, 20, …, 30160
    pvp = risk["pvp"]
    assert (f"PVP: 100 % confidence {pvp['100']:.2f} %, 50 % confidence {pvp['50']:.2f} %, "
            f"33 % confidence {pvp['33']:.2f} %, 25 % confidence {pvp['25']:.2f} %") in done.stdout
    nothing = cli("audit", "--dsn", releases, "--source", "public.adult")
    assert nothing.returncode == 0 and "nothing to compose" in nothing.stdout
    one = cli("audit", "--dsn", releases, "--release", "small_k5")
    assert one.returncode == 2 and "at least two" in one.stderr


def test_the_default_report_skips_the_curve_and_says_how_to_draw_it(releases: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = cli("report", "public.small_k10", "--html", str(page), "--dsn", releases)
    assert done.returncode == 0, done.stderr
    steps = [line.split()[2] for line in done.stderr.splitlines() if line.startswith("anonproxy report: ")]
    assert steps == [f"{i}/4" for i in range(5)], done.stderr  # no step re-runs the method
    assert ("risk-utility curve skipped (it re-runs public.small_k10's method once per k); add --curve to draw it"
            in done.stdout.splitlines())
    text = page.read_text()
    assert "<code>anonproxy report public.small_k10 --curve</code> draws it" in text
    assert "Risk and information loss over k" not in text

    curved = cli("report", "public.small_k10", "--html", str(page), "--dsn", releases, "--curve")
    assert curved.returncode == 0, curved.stderr
    assert "anonproxy report: 3/10 risk-utility curve: mondrian at k = 2" in curved.stderr.splitlines()
    assert "skipped" not in curved.stdout
    assert all(f"k={k}</text>" in page.read_text().replace("\n", "") for k in (2, 5, 10, 25, 50, 100))
