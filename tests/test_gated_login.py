"""The CLI refuses a login the proxy gates before sending it anything that could be gated: no charge, no traceback.

Every command runs as a real subprocess against the real gated proxy (the demo policy over a copy of the template:
reporter in suppress mode, dp roles with a budget of their own, dba direct).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

# Every command that reads raw data or the registry, with arguments that would work for a direct login.
COMMANDS = [
    ("anonymize", "--source", "public.adult", "--target", "public.adult_gated", "--qi", "age,sex",
     "--sensitive", "occupation", "--k", "10"),
    ("release", "list"),
    ("release", "refresh", "public.adult_gated"),
    ("release", "drop", "public.adult_gated"),
    ("verify", "public.adult"),
    ("report", "public.adult", "--html", "{tmp}/report.html"),
    ("audit",),
    ("hierarchy", "list"),
    ("hierarchy", "build-intervals", "adult.gated_age", "--source", "public.adult", "--column", "age",
     "--widths", "5,10"),
    ("hierarchy", "drop", "adult.age"),
    ("policy", "show"),
    ("policy", "lint"),
    ("install",),
]


def cli(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy", *args, "--dsn", dsn], capture_output=True, text=True,
                          timeout=120, check=False)


def charges(truth: psycopg.Connection, role: str) -> tuple[int, object]:
    row = truth.execute("select count(*), sum(epsilon) from anonproxy.budget_ledger where role_name = %s",
                        [role]).fetchone()
    assert row is not None
    return row[0], row[1]


def test_anonymize_with_a_dp_login_is_refused_and_charges_nothing(
        truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> None:
    with fresh_dp_role(truth, gated_proxy, gated_database, "cli_analyst") as role:
        before = charges(truth, role)
        done = cli(*COMMANDS[0], dsn=gated_proxy.dsn(gated_database, user=role))
        assert charges(truth, role) == before  # the ledger of the login is untouched
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()], "one line"
    assert done.stderr.startswith(f"anonproxy anonymize: login {role} is in dp mode at anonproxy"), done.stderr
    assert "run it as a login in direct mode (the demo's dba) or as the tables' owner" in done.stderr
    assert truth.execute("select to_regclass('public.adult_gated')").fetchone() == (None,)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_refuses_the_suppress_login(command: tuple[str, ...], gated_proxy: Endpoint,
                                                  gated_database: str, tmp_path: Path) -> None:
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in command]
    done = cli(*args, dsn=gated_proxy.dsn(gated_database, user="reporter", password="reporter"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"anonproxy {command[0]}: login reporter is in suppress mode at anonproxy (its statements get only "
        "k-anonymous aggregates), so this command cannot read raw data through it; run it as a login in direct mode "
        "(the demo's dba) or as the tables' owner")
    assert not (tmp_path / "report.html").exists()


def test_a_direct_login_through_the_proxy_still_works(gated_proxy: Endpoint, gated_database: str) -> None:
    done = cli("release", "list", dsn=gated_proxy.dsn(gated_database, user="dba", password="dba"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["id", "target"]
