"""Knex, Kysely, Sequelize, Drizzle and TypeORM over node-postgres, run by the scripts of
tests/clients/node_builders.

:func:`run` installs the pinned packages (npm, from the directory's package.json and package-lock.json) if one is
missing or at another version, runs a script (builders.js: Knex and Kysely; orms.js: Knex, Sequelize, Drizzle and
TypeORM) with the PG* variables of one login and returns its steps: for each, the tool, id, kind, the library call,
the statements it sent and the rows it got, or the error (code, message, hint). Used by tests/test_bi_builders.py,
tests/test_orm_node.py and tests/bi_corpus/capture_libraries.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

BUILDERS_DIR = Path(__file__).parent / "clients" / "node_builders"


class NodeError(RuntimeError):
    """npm or node is missing, or failed."""


def ensure_node_modules() -> None:
    """``npm ci`` unless every package pinned in package.json is installed at its version."""
    pinned = json.loads((BUILDERS_DIR / "package.json").read_text())["dependencies"]
    if all(_installed(name) == version for name, version in pinned.items()):
        return
    npm = shutil.which("npm")
    if npm is None:
        raise NodeError("npm is required for the Knex, Kysely, Sequelize, Drizzle and TypeORM tests")
    done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=BUILDERS_DIR, check=False,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise NodeError(f"npm ci in {BUILDERS_DIR} failed:\n{done.stdout}\n{done.stderr}")


def _installed(name: str) -> str | None:
    """The version of package ``name`` in node_modules, or None."""
    manifest = BUILDERS_DIR / "node_modules" / name / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.is_file() else None


def run(host: str, port: int, dbname: str, user: str, password: str, script: str = "builders.js",
        options: str = "") -> list[dict[str, Any]]:
    """The steps of ``script`` as ``user``, with ``options`` as the connection's (PGOPTIONS)."""
    ensure_node_modules()
    node = shutil.which("node")
    if node is None:
        raise NodeError("node is required for the Knex, Kysely, Sequelize, Drizzle and TypeORM tests")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST=host, PGPORT=str(port), PGDATABASE=dbname, PGUSER=user, PGPASSWORD=password, TZ="UTC")
    if options:
        env["PGOPTIONS"] = options
    done = subprocess.run([node, script], cwd=BUILDERS_DIR, env=env, check=False, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise NodeError(f"{script} failed:\n{done.stdout}\n{done.stderr}")
    return [json.loads(line) for line in done.stdout.splitlines()]
