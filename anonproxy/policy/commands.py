"""`anonproxy policy apply FILE --dsn DSN`, `anonproxy policy show --dsn DSN`, `anonproxy policy lint --dsn DSN`.

Wire into the main parser with ``register(subparsers)``; each handler is set as
``run`` and returns the exit code: 0, or 1 (printed as ``anonproxy policy: …``
on stderr, no traceback) when the file, the connection or the database refuses.
``lint`` also returns 1 when it has warnings (printed on stdout, one a line). ``apply`` prints a warning for each
linked table every statement on which will be refused (its key's type or collation), and returns 0.
A login the proxy gates is refused before anything is sent (:mod:`anonproxy.login`, exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import psycopg

from .. import login
from .lint import link_warnings, lint, lint_k, reference_warnings, unit_warnings
from .store import load_policy
from .yaml_policy import (
    PolicyApplyError,
    PolicyError,
    apply_policy,
    dump_policy,
    read_policy_file,
)


def register(subparsers: Any) -> None:
    """Add the ``policy`` command to an ``argparse`` subparsers object."""
    policy = subparsers.add_parser("policy", help="apply or show the privacy policy stored in a database")
    actions = policy.add_subparsers(required=True, metavar="ACTION")

    apply = actions.add_parser("apply", help="replace the database's policy with a YAML file, in one transaction")
    apply.add_argument("file", type=Path, help="YAML policy file")
    apply.add_argument("--dsn", required=True, help="libpq connection string of the owner of the protected tables")
    apply.set_defaults(run=_apply)

    show = actions.add_parser("show", help="print the database's policy as YAML")
    show.add_argument("--dsn", required=True, help="libpq connection string")
    show.set_defaults(run=_show)

    check = actions.add_parser("lint", help="warn about declared bounds that are values fewer than k people hold")
    check.add_argument("--dsn", required=True, help="libpq connection string of a role that reads the protected "
                       "tables (their owner)")
    check.set_defaults(run=_lint)


def _apply(args: argparse.Namespace) -> int:
    try:
        policy = read_policy_file(args.file)
        with login.connect(args.dsn, "policy") as conn:
            try:
                version = apply_policy(conn, policy)
                refused = link_warnings(load_policy(conn))  # the types and collations the catalog has
            except PolicyApplyError as exc:
                if exc.sqlstate != "42501":
                    raise
                return _fail(exc, _who_may_apply(conn))
    except (PolicyError, psycopg.Error, OSError) as exc:
        return _fail(exc)
    for warning in refused:
        print(f"warning: {warning}")
    print(f"policy version {version} applied: {len(policy.tables)} protected table(s), "
          f"{len(policy.links)} linked table(s), {len(policy.roles)} role(s), "
          f"{len(policy.published)} published relation(s)")
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        with login.connect(args.dsn, "policy") as conn:
            policy = load_policy(conn)
    except psycopg.Error as exc:
        return _fail(exc)
    print(dump_policy(policy), end="")
    return 0


def _lint(args: argparse.Namespace) -> int:
    try:
        with login.connect(args.dsn, "policy") as conn:
            policy = load_policy(conn)
            checked, findings = lint(conn, policy)
            refused = unit_warnings(conn, policy) + link_warnings(policy)
    except psycopg.Error as exc:
        return _fail(exc)
    warnings = [str(finding) for finding in findings] + reference_warnings(policy) + refused
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"{checked} declared bound(s) checked against k = {lint_k(policy)}: {len(warnings)} warning(s)")
    return 1 if warnings else 0


def _who_may_apply(conn: psycopg.Connection) -> str:
    """Which login a refused policy change needs: the owner of the anonproxy schema (its installer)."""
    row = conn.execute("select nspowner::regrole::text from pg_catalog.pg_namespace where nspname = 'anonproxy'"
                       ).fetchone()
    owner = row[0] if row else "the owner of the anonproxy schema"
    return (f"changing the policy needs role {owner} (the owner of the anonproxy schema and of the protected tables),"
            f" not {conn.info.user}; `anonproxy up` prints that login as `owner`")


def _fail(exc: Exception, *advice: str) -> int:
    if isinstance(exc, OSError) and exc.filename is not None:
        lines = [f"{exc.filename}: {exc.strerror}"]
    else:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
    lines += advice
    for line in lines:
        print(f"anonproxy policy: {line}", file=sys.stderr)
    return 1
