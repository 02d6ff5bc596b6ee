"""The risk of combining releases is shown where a DPO reads: `release list`, `verify`, `report`.

The figure is the composition audit's (anonproxy.composition_risk, the reference here): the share of the people
located whose sensitive value the releases of one source, combined, reveal exactly. It follows the registry: a new
release of the source updates it on every release of the group, a dropped one too. Real CLI runs (subprocess)
against a real PostgreSQL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres


@pytest.fixture
def dsn(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str) -> str:
    """A tenth of adult and two Mondrian releases of it over different quasi-identifiers; the DSN of the database."""
    postgresql.execute("create table adult_small as select * from adult where id % 10 = 0")
    postgresql.execute("alter table adult_small add primary key (id)")
    release(postgresql, "public.small_a", ["age", "education", "sex", "race"], 5)
    release(postgresql, "public.small_b", ["age", "marital_status", "workclass"], 5)
    postgresql.commit()
    return pg_server.conninfo(dbname=dbname)


def release(conn: psycopg.Connection, target: str, qi: list[str], k: int) -> None:
    conn.execute("""select anonproxy.create_anonymized_view(source => 'public.adult_small', target => %s,
                        quasi_identifiers => %s, sensitive => 'occupation', k => %s)""", (target, qi, k))


def audit(conn: psycopg.Connection, *targets: str) -> dict[str, Any]:
    """The composition audit of these releases, measured here (and rolled back: it leaves work tables)."""
    risk = conn.execute("select anonproxy.composition_risk(%s::regclass[])", (list(targets),)).fetchone()[0]
    conn.rollback()
    return risk


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy", *args], capture_output=True, text=True, timeout=300,
                          check=False)


def share(risk: dict[str, Any]) -> str:
    return f"{float(risk['pvp']['100']):.4g}"


def test_a_revealing_combination_is_in_the_list_verify_and_report(
        dsn: str, postgresql: psycopg.Connection, tmp_path: Path) -> None:
    risk = audit(postgresql, "public.small_a", "public.small_b")
    assert risk["pvp"]["100"] > 0, "the two releases must reveal someone for this test to mean anything"
    revealed = (f"combined with public.small_b it reveals occupation exactly for {share(risk)} % of the "
                f"{risk['located']} people located (limit 0 %)")

    listing = cli("release", "list", "--dsn", dsn)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split()[-2:] == ["revealed", "combined"]
    assert lines[1].split()[0:2] == ["1", "public.small_a"] and lines[1].endswith(f"{share(risk)} % with 2")
    assert lines[2].split()[0:2] == ["2", "public.small_b"] and lines[2].endswith(f"{share(risk)} % with 1")

    verify = cli("verify", "public.small_a", "--dsn", dsn)
    assert verify.returncode == 3, verify.stdout + verify.stderr  # meets k alone, not combined
    assert verify.stdout.rstrip().splitlines()[-1] == f"meets its parameters alone; {revealed}"

    page = tmp_path / "a.html"
    report = cli("report", "public.small_a", "--html", str(page), "--dsn", dsn)
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[0] == f"public.small_a: meets its parameters alone; {revealed}"
    assert f"meets its parameters alone; {revealed}" in page.read_text()


def test_the_figure_follows_the_releases_of_the_source(dsn: str, postgresql: psycopg.Connection) -> None:
    dropped = cli("release", "drop", "public.small_b", "--dsn", dsn)
    assert dropped.returncode == 0, dropped.stderr
    verify = cli("verify", "public.small_a", "--dsn", dsn)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.rstrip().splitlines()[-1] == "meets its parameters"  # alone again
    assert cli("release", "list", "--dsn", dsn).stdout.splitlines()[1].endswith("alone")

    release(postgresql, "public.small_c", ["age", "native_country", "sex"], 5)
    postgresql.commit()
    risk = audit(postgresql, "public.small_a", "public.small_c")
    verify = cli("verify", "public.small_a", "--dsn", dsn)
    assert verify.stdout.rstrip().splitlines()[-1].startswith(
        "meets its parameters" + (" alone" if risk["pvp"]["100"] > 0 else "") + "; combined with public.small_c ")
    listing = cli("release", "list", "--dsn", dsn).stdout.splitlines()
    assert [line.split()[1] for line in listing[1:3]] == ["public.small_a", "public.small_c"]
    assert listing[1].endswith(f"{share(risk)} % with 3") and listing[2].endswith(f"{share(risk)} % with 1")
