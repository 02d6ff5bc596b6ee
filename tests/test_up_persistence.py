"""`anonproxy up --data-dir`: the owner's changes survive restarts; bad arguments cost nothing; failures leave nothing.

Each test runs the real command in a child process against its own embedded
PostgreSQL, and talks to it with psql and the anonproxy commands.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path

import pytest
from conftest import Up, free_port


def psql(url: str, query: str) -> str:
    result = subprocess.run(["psql", url, "-X", "-A", "-t", "-c", query], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def anonproxy(*args: str, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command with ANONPROXY_DSN set to ``dsn`` (and no --dsn), as a user who exported it would run it."""
    env = {key: value for key, value in os.environ.items() if key != "ANONPROXY_DSN"}
    if dsn is not None:
        env["ANONPROXY_DSN"] = dsn
    return subprocess.run([sys.executable, "-m", "anonproxy", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="anonproxy-persist-"))
    path.chmod(0o755)  # the postgres OS user must reach the data directory inside
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def policy_with_k_20(tmp_path: Path) -> Path:
    """The demo policy with the reporter's k raised from 10 to 20."""
    demo = files("anonproxy.data").joinpath("demo_policy.yaml").read_text(encoding="utf-8")
    changed = demo.replace("reporter: {mode: suppress, k: 10,", "reporter: {mode: suppress, k: 20,")
    assert changed != demo
    path = tmp_path / "policy.yaml"
    path.write_text(changed)
    return path


def test_a_policy_change_survives_two_restarts(base: Path, policy_with_k_20: Path) -> None:
    data_dir = base / "data"
    port = str(free_port())
    first = Up("--port", port, "--data-dir", str(data_dir))
    try:
        assert "reusing" not in first.text
        owner = first.urls["owner"]
        assert psql(first.urls["reporter"], "show anonproxy.k") == "10"
        # The demo dba reads raw data but may not rewrite the rules; the refusal names the login that may.
        refused = anonproxy("policy", "apply", str(policy_with_k_20), dsn=first.urls["dba"])
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert "SQLSTATE 42501" in refused.stderr
        assert "changing the policy needs role postgres" in refused.stderr
        # The owner's login as `up` printed it, from ANONPROXY_DSN, with no file read.
        applied = anonproxy("policy", "apply", str(policy_with_k_20), dsn=owner)
        assert applied.returncode == 0, applied.stderr
        # Each worker reloads on the change's NOTIFY (docs/scale.md: within a few hundred ms): until ten fresh
        # sessions in a row, on whichever worker, see the new k.
        deadline = time.monotonic() + 60
        seen = 0
        while seen < 10:
            k = psql(first.urls["reporter"], "show anonproxy.k")
            assert k in ("10", "20") and time.monotonic() < deadline, k
            seen = seen + 1 if k == "20" else 0
        psql(first.urls["analyst"], "select sex, count(*) from adult group by 1")  # one charge
        # zCDP accounting (the demo budget's, by the default rule): what is left is the conversion of ρ spent
        budget_left = psql(first.urls["analyst"], "show anonproxy.budget")
        assert "zCDP accounting" in budget_left and "epsilon 10 of 10 left" not in budget_left
        hierarchies = psql(owner, "select count(*) from anonproxy.hierarchies")
    finally:
        first.stop()

    for _ in range(2):
        again = Up("--port", port, "--data-dir", str(data_dir))
        try:
            kept = [line for line in again.output if "reusing" in line]
            assert len(kept) == 1, again.text
            assert f"{hierarchies} hierarchies" in kept[0] and "1 privacy-budget charge(s)" in kept[0]
            assert again.urls["owner"] == owner  # the same owner password: it lives in the data directory
            assert psql(again.urls["reporter"], "show anonproxy.k") == "20"
            assert psql(again.urls["analyst"], "show anonproxy.budget") == budget_left
            shown = anonproxy("policy", "show", dsn=again.urls["owner"])
            assert "k: 20" in shown.stdout, shown.stderr
        finally:
            again.stop()


def test_a_bad_or_taken_port_fails_before_postgresql_is_built() -> None:
    out_of_range = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", "99999"],
                                  capture_output=True, text=True, timeout=60)
    assert out_of_range.returncode == 2
    assert "listen_port must be between 0 and 65535, got 99999" in out_of_range.stderr
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", str(busy.getsockname()[1])],
                               capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1
    assert "address already in use" in taken.stderr.lower()
    for result in (out_of_range, taken):
        assert "Traceback" not in result.stderr
        assert "PostgreSQL on" not in result.stderr  # the server was never started


def test_an_unreachable_data_dir_leaves_nothing_behind() -> None:
    private = Path(tempfile.mkdtemp(prefix="anonproxy-private-"))  # mode 0700: closed to other OS users
    try:
        if os.geteuid() != 0:
            private.chmod(0o500)  # not root: the server runs as us, so make the directory unwritable instead
        data_dir = private / "nested" / "data"
        result = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", str(free_port()),
                                 "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert str(private / "nested") in result.stderr  # the message names the directory
        assert list(private.iterdir()) == []
    finally:
        private.chmod(0o700)
        shutil.rmtree(private)


def test_anonymize_refuses_a_k_above_the_rows_before_copying(base: Path) -> None:
    up = Up("--port", str(free_port()), "--data-dir", str(base / "data"))
    try:
        result = anonproxy("anonymize", "--source", "public.adult", "--target", "public.adult_k50000",
                           "--qi", "age,sex", "--k", "50000", dsn=up.urls["dba"])
    finally:
        up.stop()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    # Nothing but the refusal: no progress line of a copy that was started.
    assert result.stderr.splitlines() == [
        "anonproxy anonymize: k = 50000 exceeds the 30162 rows of public.adult (SQLSTATE 22023)",
        "anonproxy anonymize: hint: no k-anonymous release of it exists: lower k",
    ]
