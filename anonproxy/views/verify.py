"""`anonproxy verify TARGET --dsn DSN`: a release's privacy levels and utility, recomputed now.

A registered release (``anonproxy.releases``) brings its source, quasi-identifiers,
sensitive column and parameters; any other table needs ``--qi`` (and
``--sensitive`` for ℓ and t, ``--source`` for the metrics). The levels come from
``anonproxy.k_anonymity``, ``l_diversity`` and ``t_closeness``, the metrics from
``anonproxy.utility`` (sql/0009_verify.sql), all computed on the table as it is
now. The verdict of a registered release also says what combining it with the
other releases of its source reveals (``anonproxy.releases.combined``, read by
:mod:`.combined`). Exit codes: 0, 1 when the database or the arguments refuse,
3 when a registered release no longer meets the parameters it was built with,
or when combined with the other releases of its source it reveals more than the
composition guard allows (or its risk could not be measured). A release made
with a privacy unit is not judged (its levels count units, the table has no
unit column), nor is a table without rows (it has no levels).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .. import login
from . import combined
from .commands import fail, hierarchy_choice, name_list
from .words import parameters_text

EXIT_SHORT = 3


@dataclass
class Subject:
    """What to verify: the release's registry row, or what the command line says."""

    target: str
    qi: list[str]
    sensitive: str | None = None
    source: str | None = None
    release_id: int | None = None
    method: str | None = None
    unit: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    registry: dict[str, Any] = field(default_factory=dict)  # the levels measured when it was built
    combined: dict[str, Any] | None = None  # the composition risk with the other releases of its source


def register(subparsers: Any) -> None:
    """Add the ``verify`` command to an ``argparse`` subparsers object."""
    verify = subparsers.add_parser(
        "verify", help="recompute the k, ℓ, t and utility metrics of a release (or of any table)")
    verify.add_argument("target", help="the release table, e.g. public.adult_k10")
    verify.add_argument("--dsn", required=True, help="libpq connection string")
    verify.add_argument("--qi", type=name_list, help="comma-separated quasi-identifiers (a table not in the registry)")
    verify.add_argument("--sensitive", help="sensitive column, for ℓ and t (a table not in the registry)")
    verify.add_argument("--source", help="the table it was made from, for the metrics (a table not in the registry)")
    verify.add_argument("--t-distance", choices=("ordered", "equal", "hierarchical"),
                        help="EMD ground distance (default: the release's, else ordered for a numeric sensitive "
                             "column and equal otherwise)")
    verify.add_argument("--hierarchy", action="append", default=[], metavar="COLUMN=NAME", type=hierarchy_choice,
                        help="hierarchy of a column (repeatable; COLUMN= for none); default: the release's, "
                             "else <source table>.<column>")
    verify.add_argument("--risk-threshold", type=float, default=0.1,
                        help="count records whose re-identification risk 1/|EC| exceeds this (default 0.1)")
    verify.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    verify.set_defaults(run=_verify)


def _verify(args: argparse.Namespace) -> int:
    try:
        hierarchies = dict(args.hierarchy)
        with login.connect(args.dsn, "verify") as conn:
            subject = _subject(conn, args)
            hierarchies = {**(subject.parameters.get("hierarchies") or {}), **hierarchies}
            asked_t = subject.parameters.get("t") is not None
            distance = args.t_distance or (subject.parameters.get("t_distance") if asked_t else None)
            now = measure_levels(conn, subject, distance, hierarchies)
            metrics = None
            if subject.source is not None:
                metrics = _scalar(conn, "select anonproxy.utility(%s, %s, %s, %s, %s, %s)",
                                  (subject.source, subject.target, subject.qi,
                                   Jsonb({c: h for c, h in hierarchies.items() if c in subject.qi}),
                                   subject.parameters.get("k"), args.risk_threshold))
    except (psycopg.Error, ValueError) as exc:
        return fail("verify", exc)
    unjudged = why_not_judged(subject, now)
    shortfalls = [] if unjudged else shortfalls_of(subject.parameters, now)
    if args.json:
        print(json.dumps({"target": subject.target, "release_id": subject.release_id, "method": subject.method,
                          "source": subject.source, "quasi_identifiers": subject.qi, "sensitive": subject.sensitive,
                          "unit": subject.unit, "parameters": subject.parameters, "registry": subject.registry,
                          "now": now, "metrics": metrics, "shortfalls": shortfalls, "not_judged": unjudged,
                          "combined": subject.combined}, default=_json_number, indent=2))
    else:
        print_report(subject, now, metrics, shortfalls, unjudged)
    return EXIT_SHORT if shortfalls or combined.breaks(subject.combined) else 0


def _subject(conn: psycopg.Connection, args: argparse.Namespace) -> Subject:
    row = conn.execute(
        "select r.id, r.target, r.source, r.method, r.quasi_identifiers, r.sensitive, r.unit, r.parameters, r.achieved,"
        "       r.combined from anonproxy.releases r where r.target = anonproxy.release_target_name(%s, current_schema())",
        (args.target,)).fetchone()
    if row is None:
        if _scalar(conn, "select to_regclass(%s)", (args.target,)) is None:
            raise ValueError(f"relation {args.target} does not exist: check the name and its schema "
                             "(`anonproxy release list` shows the releases)")
        if args.qi is None:
            raise ValueError(f"{args.target} is not a registered release: name its quasi-identifiers with --qi")
        return Subject(target=args.target, qi=args.qi, sensitive=args.sensitive, source=args.source)
    if args.qi or args.sensitive or args.source:
        raise ValueError(f"{args.target} is a registered release: its columns and source come from anonproxy.releases"
                         " (drop --qi, --sensitive and --source)")
    release_id, target, source, method, qi, sensitive, unit, parameters, achieved, combined_risk = row
    return Subject(target=target, qi=list(qi), sensitive=sensitive, source=source, release_id=release_id,
                   method=method, unit=unit, parameters=parameters, registry=achieved, combined=combined_risk)


def measure_levels(conn: psycopg.Connection, subject: Subject, distance: str | None,
                   hierarchies: dict[str, str | None]) -> dict[str, Any]:
    """k, and with a sensitive column distinct and entropy ℓ, recursive c (when asked for) and t, as they are now.

    The release table has no privacy-unit column, so k here counts rows.
    """
    def call(function: str, *arguments: Any) -> Any:
        placeholders = ", ".join(["%s"] * len(arguments))
        return _scalar(conn, f"select anonproxy.{function}({placeholders})", arguments)

    target, qi, sensitive = subject.target, subject.qi, subject.sensitive
    now: dict[str, Any] = {"k": call("k_anonymity", target, qi)}
    if sensitive is None:
        return now
    if distance is None:
        numeric = _scalar(conn, "select anonproxy._verify_is_number(%s::regclass, %s)", (target, sensitive))
        distance = "ordered" if numeric else "equal"
    now["l_distinct"] = call("l_diversity", target, qi, sensitive, "distinct")
    now["l_entropy"] = call("l_diversity", target, qi, sensitive, "entropy")
    l_asked = subject.parameters.get("l")
    if subject.parameters.get("l_kind") == "recursive" and l_asked is not None:
        now["l_recursive_c"] = call("l_diversity", target, qi, sensitive, "recursive", int(l_asked))
    now["t"] = call("t_closeness", target, qi, sensitive, distance,
                    hierarchies.get(sensitive) if distance == "hierarchical" else None)
    now["t_distance"] = distance
    return now


def why_not_judged(subject: Subject, now: dict[str, Any]) -> str | None:
    """Why the levels measured now cannot be held against the release's parameters, or None."""
    if subject.release_id is not None and subject.unit:
        return (f"the release counts privacy units ({subject.unit}), but its table has no unit column: the levels "
                "above count rows and cannot be rechecked per unit on the target")
    if now["k"] is None:
        return "the table has no rows, so it has no levels to check"
    return None


def shortfalls_of(parameters: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The parameters the levels measured now do not meet, in words."""
    found = []
    k, l, l_kind, c, t = (parameters.get(name) for name in ("k", "l", "l_kind", "c", "t"))
    if k is not None and now["k"] < k:
        found.append(f"k = {now['k']} < {k}")
    if l is not None and l_kind in ("distinct", "entropy") and now[f"l_{l_kind}"] < Decimal(str(l)):
        found.append(f"{l_kind} ℓ = {_number(now[f'l_{l_kind}'])} < {l}")
    if l is not None and l_kind == "recursive" and c is not None and now["l_recursive_c"] >= Decimal(str(c)):
        found.append(f"recursive (c, {l}): needs c > {_number(now['l_recursive_c'])}, the release asked c = {c}")
    if t is not None and now["t"] > Decimal(str(t)):
        found.append(f"t = {_number(now['t'])} > {t}")
    return found


def print_report(subject: Subject, now: dict[str, Any], metrics: dict[str, Any] | None,
                 shortfalls: list[str], unjudged: str | None) -> None:
    if subject.release_id is not None:
        print(f"release {subject.target} (id {subject.release_id}): {subject.method} on {subject.source}")
        print(f"  parameters: {parameters_text(subject.parameters)}")
    else:
        print(f"table {subject.target} (not a registered release)")
    print(f"  quasi-identifiers: {', '.join(subject.qi)}")
    print(f"  sensitive: {subject.sensitive or '-'}" + (f"; privacy unit: {subject.unit}" if subject.unit else ""))
    print()
    rows: list[tuple[str, ...]] = [("level", "at release", "now")]
    labels = {"k": "k", "l_distinct": "distinct ℓ", "l_entropy": "entropy ℓ",
              "l_recursive_c": f"recursive c (ℓ = {subject.parameters.get('l')})",
              "t": f"t ({now.get('t_distance')} EMD)"}
    for key, label in labels.items():
        if key in now:
            rows.append((label, _number(subject.registry.get(key)), _number(now[key])))
    _print_table(rows)
    if metrics is not None:
        print()
        _print_table([("metric", "value"), *metric_rows(metrics, subject.qi)])
    print()
    line = verdict(subject, shortfalls, unjudged)
    if line is not None:
        print(line)


def verdict(subject: Subject, shortfalls: list[str], unjudged: str | None) -> str | None:
    """The verdict line on the levels measured now and on the release combined with the other releases of its
    source: None for a table that is not a registered release."""
    if unjudged:
        alone = f"not judged: {unjudged}"
    elif shortfalls:
        alone = "DOES NOT MEET its parameters now: " + "; ".join(shortfalls)
    elif subject.release_id is not None:
        # "alone" when the combination breaks what the release meets by itself.
        alone = "meets its parameters alone" if combined.breaks(subject.combined) else "meets its parameters"
    else:
        return None
    with_others = combined.clause(subject.combined, subject.target, subject.sensitive)
    return alone if with_others is None else f"{alone}; {with_others}"


def metric_rows(metrics: dict[str, Any], qi: list[str]) -> list[tuple[str, str]]:
    rows = [
        ("rows: source / released", f"{metrics['rows_source']} / {metrics['rows_released']}"),
        ("suppressed rows", str(metrics["suppressed_rows"])),
        ("equivalence classes", str(metrics["equivalence_classes"])),
        ("discernibility", str(metrics["discernibility"])),
        ("average class size / C_avg (that size over k)",
         f"{_number(metrics['avg_ec_size'])} / {_number(metrics['c_avg'])}"),
        ("NCP, information lost to generalization", _percent(metrics["ncp"])),
        *((f"  NCP {column}", _percent(metrics["ncp_per_qi"][column])) for column in qi),
        ("KL divergence", _number(metrics["kl_divergence"])),
    ]
    if metrics["sse_sst_per_qi"]:
        rows.append(("SSE/SST", _number(metrics["sse_sst"])))
        rows.extend((f"  SSE/SST {column}", _number(metrics["sse_sst_per_qi"][column]))
                    for column in qi if column in metrics["sse_sst_per_qi"])
    rows += [
        ("re-identification (prosecutor) risk: highest", _number(metrics["prosecutor_max_risk"])),
        (f"  records above {metrics['risk_threshold']}", _percent(metrics["records_above_risk_threshold"])),
        ("classes per record", _number(metrics["ec_per_record"])),
    ]
    return rows


def _scalar(conn: psycopg.Connection, query: str, params: Sequence[Any]) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None  # a select of one function call returns one row
    return row[0]


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip())


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        value = Decimal(value)
    if isinstance(value, Decimal) and value.is_infinite():
        return "∞"
    if isinstance(value, int):
        return str(value)
    return f"{float(value):.4g}"


def _percent(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.2f} %"


def _json_number(value: Any) -> Any:
    if isinstance(value, Decimal):
        return "Infinity" if value.is_infinite() else float(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
