"""`anonproxy audit --dsn DSN [--source TABLE | --release TABLE ...]`: the composition risk of releases.

Runs ``anonproxy.composition_risk`` (sql/0010_composition.sql, the
intersection attack of Ganta, Kasiviswanathan and Smith, KDD 2008) in the
database and prints it, with the terms of that paper explained in plain words. Without ``--release``, the
releases of each source recorded in ``anonproxy.releases`` that still exist and
publish the same sensitive attribute are audited together. docs/composition.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import psycopg

from .. import login
from .progress import ProgressBar

# The attacker's confidence levels of the paper's PVP_C, as keys of the summary's "pvp" object.
CONFIDENCES = ("100", "50", "33", "25")


def register(subparsers: Any) -> None:
    """Add the ``audit`` command to an ``argparse`` subparsers object."""
    audit = subparsers.add_parser("audit", help="risk of combining the registered releases (intersection attack)")
    audit.add_argument("--dsn", required=True, help="libpq connection string")
    which = audit.add_mutually_exclusive_group()
    which.add_argument("--source", help="audit only the releases of this source table (schema-qualified)")
    which.add_argument("--release", action="append", metavar="TABLE",
                       help="audit these release tables together (repeat; at least two), whatever their sources")
    audit.add_argument("--persons", metavar="TABLE",
                       help="table of the persons' true QI values (default: the source of the first release)")
    audit.add_argument("--json", action="store_true", help="print the summaries as JSON")
    audit.set_defaults(run=_audit)


def release_groups(conn: psycopg.Connection, source: str | None) -> list[list[str]]:
    """Existing releases grouped by source and sensitive attribute, groups of two or more, oldest first."""
    rows = conn.execute(
        """select array_agg(target order by id)
           from anonproxy.releases
           where to_regclass(target) is not null and sensitive is not null
             and (%(source)s::text is null or to_regclass(source) = %(source)s::regclass)
           group by source, sensitive having count(*) >= 2 order by min(id)""",
        {"source": source}).fetchall()
    return [row[0] for row in rows]


def composition_risk(conn: psycopg.Connection, releases: list[str], persons: str | None = None) -> dict[str, Any]:
    """The summary ``anonproxy.composition_risk`` returns, as a dict."""
    row = conn.execute("select anonproxy.composition_risk(%s::regclass[], %s::regclass)",
                       (releases, persons)).fetchone()
    assert row is not None
    return row[0]


def format_risk(risk: dict[str, Any]) -> list[str]:
    """Lines of text describing one summary: a table of the releases, then the attack's outcome."""
    lines = [f"{'release':<32} {'method':<16} {'k':>4} {'classes':>8} {'avg size':>9} {'avg EA':>7}  join key"]
    for r in risk["releases"]:
        lines.append(f"{r['release']:<32} {r['method']:<16} {r['k'] if r['k'] is not None else '-':>4} "
                     f"{r['classes']:>8} {_num(r['avg_partition_size']):>9} {_num(r['avg_prior_ea']):>7}  "
                     f"{', '.join(r['key_qis'] or []) or '-'}")
    pvp = risk["pvp"]
    lines += [
        f"overlap {risk['overlap']} persons, located in every release {risk['located']}",
        (f"effective anonymity: min prior {_num(risk['avg_min_prior_ea'])}, posterior "
         f"{_num(risk['avg_posterior_ea'])}, average drop {_num(risk['avg_drop'])}; "
         f"vulnerable (drop > 0) {_num(risk['vulnerable_pct'])} %"),
        "PVP: " + ", ".join(f"{c} % confidence {_num(pvp[c])} %" for c in CONFIDENCES),
    ]
    return lines


# The paper's terms in plain words, printed under the audit (docs/glossary.md has them too).
LEGEND = (
    "what the terms mean (docs/glossary.md):",
    "  EA, effective anonymity: how many sensitive values remain possible for a person "
    "(avg EA: its average in that release)",
    "  min prior: EA in the most revealing single release; posterior: EA once the releases are combined",
    "  PVP, share of vulnerable people: of the people located, those an attacker narrows down to one value "
    "(100 % confidence), two (50 %), three (33 %) or four (25 %)",
)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{float(value):.2f}"


def _audit(args: argparse.Namespace) -> int:
    if args.release is not None and len(args.release) < 2:
        print("anonproxy audit: --release needs at least two tables", file=sys.stderr)
        return 2
    bar = ProgressBar(sys.stderr, "anonproxy audit")
    try:
        with login.connect(args.dsn, "audit") as conn:
            groups = [args.release] if args.release else release_groups(conn, args.source)
            if not groups:
                print("no source has two or more releases with a sensitive attribute: nothing to compose")
                return 0
            results = []
            for done, group in enumerate(groups):
                bar.update(done, len(groups), f"combining {', '.join(group)}")
                started = time.perf_counter()
                risk = composition_risk(conn, group, args.persons)
                results.append((risk, time.perf_counter() - started))
                conn.rollback()  # drops the attack's temporary tables
            bar.update(len(groups), len(groups), "done")
    except psycopg.Error as exc:
        bar.close()
        print(f"anonproxy audit: {exc}".rstrip(), file=sys.stderr)
        return 1
    finally:
        bar.close()
    if args.json:
        print(json.dumps([risk for risk, _ in results], indent=2))
        return 0
    for i, (risk, seconds) in enumerate(results):
        if i:
            print()
        print("\n".join(format_risk(risk)))
        print(f"audit took {seconds:.2f} s")
    print()
    print("\n".join(LEGEND))
    return 0
