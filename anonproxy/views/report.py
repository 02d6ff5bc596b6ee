"""`anonproxy report TARGET --html FILE --dsn DSN`: a self-contained HTML page about one release.

The page shows what the release protects and what it costs: the sizes of its
equivalence classes, each class's entropy ℓ and earth mover's distance against
the thresholds asked, the information loss (NCP) per quasi-identifier, a
risk-utility curve over k computed on demand (the release's method re-run at
several k in a transaction that is rolled back), the release's parameters and
the composition risk with the other releases of its source (Ganta et al. 2008). Plots
are inline SVG drawn by matplotlib: the file needs nothing else to display.
docs/composition.md describes it.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .audit import CONFIDENCES, release_groups

DEFAULT_CURVE = (2, 5, 10, 25, 50, 100)


def register(subparsers: Any) -> None:
    """Add the ``report`` command to an ``argparse`` subparsers object."""
    report = subparsers.add_parser("report", help="write an HTML page of a release's protection and cost")
    report.add_argument("target", help="release table, as recorded in anonproxy.releases")
    report.add_argument("--html", required=True, type=Path, help="file to write")
    report.add_argument("--dsn", required=True, help="libpq connection string of a role that may create tables "
                                                     "(the curve re-runs the method, then rolls back)")
    report.add_argument("--curve-k", default=",".join(map(str, DEFAULT_CURVE)),
                        help=f"values of k for the risk-utility curve (default {','.join(map(str, DEFAULT_CURVE))}; "
                             "empty: no curve)")
    report.set_defaults(run=_report)


@dataclass(frozen=True)
class ClassStat:
    size: int
    l_entropy: float
    l_distinct: int
    emd: float


@dataclass(frozen=True)
class CurvePoint:
    k: int
    ncp: float
    avg_risk: float  # prosecutor risk averaged over records: classes / released rows
    classes: int


def _report(args: argparse.Namespace) -> int:
    try:
        curve_k = [int(k) for k in args.curve_k.split(",") if k.strip()]
    except ValueError:
        print(f"anonproxy report: --curve-k must be integers separated by commas, not {args.curve_k!r}",
              file=sys.stderr)
        return 2
    try:
        with psycopg.connect(args.dsn) as conn:
            page = build_report(conn, args.target, curve_k)
    except (psycopg.Error, LookupError) as exc:
        print(f"anonproxy report: {exc}".rstrip(), file=sys.stderr)
        return 1
    args.html.write_text(page, encoding="utf-8")
    print(f"wrote {args.html}")
    return 0


def build_report(conn: psycopg.Connection, target: str, curve_k: list[int]) -> str:
    """The HTML page for release ``target``."""
    release = _release(conn, target)
    classes = class_stats(conn, release)
    curve, failed = risk_utility_curve(conn, release, curve_k)
    composition = composition_of(conn, release)
    return _page(release, classes, curve, failed, composition)


def _release(conn: psycopg.Connection, target: str) -> dict[str, Any]:
    # relation: the table's name as the database quotes it; schema: its schema, quoted.
    row = conn.execute(
        """select r.*, c.oid::regclass::text as relation, quote_ident(n.nspname) as schema
           from anonproxy.releases r
           join pg_class c on c.oid = to_regclass(r.target) join pg_namespace n on n.oid = c.relnamespace
           where c.oid = to_regclass(%s)""", (target,))
    found = row.fetchone()
    if found is None:
        raise LookupError(f"{target} is not a release recorded in anonproxy.releases")
    assert row.description is not None
    return dict(zip([c.name for c in row.description], found))


def class_stats(conn: psycopg.Connection, release: dict[str, Any]) -> list[ClassStat]:
    """Size, entropy ℓ, distinct ℓ and EMD to the whole table of every equivalence class."""
    qi = sql.SQL(", ").join(map(sql.Identifier, release["quasi_identifiers"]))
    target = sql.SQL(release["relation"])
    sensitive = release["sensitive"]
    if sensitive is None:
        rows = conn.execute(sql.SQL("select count(*) from {} group by {}").format(target, qi))
        return [ClassStat(n, math.nan, 0, math.nan) for (n,) in rows]
    query = sql.SQL("select row({qi})::text, {s}::text, count(*) from {t} group by {qi}, {s}").format(
        qi=qi, s=sql.Identifier(sensitive), t=target)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for ec, value, n in conn.execute(query):
        counts[ec][value] += n
    whole: Counter[str] = Counter()
    for c in counts.values():
        whole.update(c)
    total = sum(whole.values())
    ordered = _ordered_values(release, list(whole))
    stats = []
    for c in counts.values():
        size = sum(c.values())
        entropy = -sum(n / size * math.log(n / size) for n in c.values())
        if ordered is None:  # equal distance: half the L1 distance
            emd = sum(abs(c[v] / size - whole[v] / total) for v in whole) / 2
        else:  # ordered distance: mean absolute cumulative difference
            cumulative, emd = 0.0, 0.0
            for v in ordered:
                cumulative += c[v] / size - whole[v] / total
                emd += abs(cumulative)
            emd /= max(len(ordered) - 1, 1)
        stats.append(ClassStat(size, math.exp(entropy), len(c), emd))
    return stats


def _ordered_values(release: dict[str, Any], values: list[str]) -> list[str] | None:
    """The sensitive values in order when the release measured an ordered distance on a numeric column."""
    if release["parameters"].get("t_distance") != "ordered":
        return None
    try:
        return sorted(values, key=float)
    except ValueError:
        return None


def risk_utility_curve(conn: psycopg.Connection, release: dict[str, Any],
                       ks: list[int]) -> tuple[list[CurvePoint], dict[int, str]]:
    """Re-run the release's method at each k in a transaction that is rolled back; k values that fail are
    returned with the database's message."""
    p = release["parameters"]
    points: list[CurvePoint] = []
    failed: dict[int, str] = {}
    with conn.transaction(force_rollback=True):
        # The curve's tables are throwaway: no composition check for them.
        conn.execute("set local anonproxy.composition_check = off")
        for k in ks:
            target = f"{release['schema']}.anonproxy_report_curve_{k}"
            try:
                with conn.transaction():
                    summary = conn.execute(
                        """select ncp, equivalence_classes
                           from anonproxy.create_anonymized_view(
                               source => %s, target => %s, quasi_identifiers => %s, sensitive => %s, k => %s,
                               l => %s, l_kind => %s, c => %s, t => %s, t_distance => %s, method => %s,
                               suppression_limit => %s, unit => %s, hierarchies => %s)""",
                        (release["source"], target, release["quasi_identifiers"], release["sensitive"], k,
                         p.get("l"), p.get("l_kind") or "entropy", p.get("c"), p.get("t"), p.get("t_distance"),
                         release["method"], p.get("suppression_limit") or 0, release["unit"],
                         json.dumps(p.get("hierarchies")))).fetchone()
                    assert summary is not None
                    ncp, classes = summary
                    rows = _scalar(conn, sql.SQL("select count(*) from {}").format(sql.SQL(target)))
            except psycopg.Error as exc:
                failed[k] = (exc.diag.message_primary or str(exc)).strip()
                continue
            points.append(CurvePoint(k, float(ncp), classes / rows if rows else math.nan, classes))
    return points, failed


def composition_of(conn: psycopg.Connection, release: dict[str, Any]) -> dict[str, Any] | None:
    """The composition risk of the release with the other existing releases of its source."""
    group = next((g for g in release_groups(conn, release["source"]) if release["target"] in g), None)
    if group is None:
        return None
    with conn.transaction(force_rollback=True):
        return _scalar(conn, "select anonproxy.composition_risk(%s::regclass[])", (group,))


def _scalar(conn: psycopg.Connection, query: str | sql.Composed, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


# --- the page ----------------------------------------------------------------------------------------

def _figure(width: float, height: float) -> tuple[Any, Any]:
    """A matplotlib figure and axes; matplotlib loads on first use (with the Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: selectable, searchable
    return plt.subplots(figsize=(width, height))


def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _class_size_plot(classes: list[ClassStat], k: int | None) -> str:
    fig, ax = _figure(6, 3.2)
    sizes = [c.size for c in classes]
    ax.hist(sizes, bins=min(40, max(len(set(sizes)), 1)), color="#4c72b0")
    if k:
        ax.axvline(k, color="#c44e52", linestyle="--", label=f"k = {k}")
        ax.legend()
    ax.set_xlabel("equivalence class size (rows)")
    ax.set_ylabel("classes")
    ax.set_title("Equivalence class sizes")
    return _svg(fig)


def _threshold_plot(values: list[float], threshold: float | None, label: str, title: str, worse_below: bool) -> str:
    fig, ax = _figure(6, 3.2)
    ax.hist(values, bins=30, color="#55a868")
    if threshold is not None:
        bad = sum(1 for v in values if (v < threshold if worse_below else v > threshold))
        ax.axvline(threshold, color="#c44e52", linestyle="--", label=f"threshold {threshold:g} ({bad} classes beyond)")
        ax.legend()
    ax.set_xlabel(label)
    ax.set_ylabel("classes")
    ax.set_title(title)
    return _svg(fig)


def _ncp_plot(ncp_per_qi: dict[str, float]) -> str:
    fig, ax = _figure(6, 0.45 * len(ncp_per_qi) + 1)
    names = list(ncp_per_qi)
    ax.barh(names, [100 * ncp_per_qi[n] for n in names], color="#8172b2")
    ax.invert_yaxis()
    ax.set_xlabel("NCP (%)  — 0: published as is, 100: fully generalized")
    ax.set_title("Information loss per quasi-identifier")
    return _svg(fig)


def _curve_plot(points: list[CurvePoint], k: int | None) -> str:
    fig, ax = _figure(6, 3.6)
    ax.plot([100 * p.avg_risk for p in points], [100 * p.ncp for p in points], marker="o", color="#4c72b0")
    for p in points:
        ax.annotate(f"k={p.k}", (100 * p.avg_risk, 100 * p.ncp), textcoords="offset points", xytext=(5, 5),
                    color="#c44e52" if p.k == k else "black")
    ax.margins(0.15)  # room for the labels of the end points
    ax.set_xlabel("average re-identification risk (% = classes / rows)")
    ax.set_ylabel("NCP (%)")
    ax.set_title("Risk and information loss over k")
    return _svg(fig)


def _pvp_plot(risk: dict[str, Any]) -> str:
    if any(risk["pvp"][c] is None for c in CONFIDENCES):  # nobody located: nothing measured
        return "<p>No one could be located in every release, so the attack was not measured.</p>"
    fig, ax = _figure(6, 3)
    values = [float(risk["pvp"][c]) for c in CONFIDENCES]
    ax.bar([f"{c} %" for c in CONFIDENCES], values, color="#c44e52")
    ax.set_ylim(0, 100)
    ax.set_xlabel("attacker's confidence at least")
    ax.set_ylabel("% of shared people")
    ax.set_title("Intersection attack with the other releases (PVP)")
    return _svg(fig)


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_text(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "—" if value is None else str(value)


def _page(release: dict[str, Any], classes: list[ClassStat], curve: list[CurvePoint], failed: dict[int, str],
          risk: dict[str, Any] | None) -> str:
    p, metrics = release["parameters"], release["metrics"]
    k = p.get("k")
    sections = [
        "<h2>Release</h2>" + _table([
            ("target", release["target"]), ("source", release["source"]), ("method", release["method"]),
            ("quasi-identifiers", ", ".join(release["quasi_identifiers"])), ("sensitive", release["sensitive"]),
            ("privacy unit", release["unit"]), ("parameters", p), ("achieved", release["achieved"]),
            ("created", f"{release['created_at']:%Y-%m-%d %H:%M %Z} by {release['created_by']}"),
            ("forced past the composition guard", release["forced"])]),
        "<h2>Equivalence classes</h2>" + _table([
            ("classes", len(classes)), ("smallest", min((c.size for c in classes), default=None)),
            ("average size", f"{sum(c.size for c in classes) / max(len(classes), 1):.1f}"),
            ("suppressed rows", metrics.get("suppressed_rows")),
            ("classes with one sensitive value (distinct ℓ = 1)",
             sum(1 for c in classes if c.l_distinct == 1) if release["sensitive"] else None)])
        + _class_size_plot(classes, k),
    ]
    if release["sensitive"] is not None:
        distance = "ordered" if p.get("t_distance") == "ordered" else "equal-distance"
        sections.append(
            f"<h2>Protection of {html.escape(release['sensitive'])} per class</h2>"
            + _threshold_plot([c.l_entropy for c in classes], p.get("l"), "entropy ℓ = exp(entropy)",
                              "Entropy ℓ-diversity of each class", worse_below=True)
            + _threshold_plot([c.emd for c in classes], p.get("t"), f"EMD to the whole table ({distance})",
                              "t-closeness of each class", worse_below=False))
    if metrics.get("ncp_per_qi"):
        sections.append("<h2>Information loss</h2>" + _table([
            ("NCP", f"{100 * metrics['ncp']:.2f} %"), ("discernibility", metrics.get("discernibility")),
            ("KL divergence", metrics.get("kl_divergence")),
            ("prosecutor risk, largest", metrics.get("prosecutor_max_risk"))]) + _ncp_plot(metrics["ncp_per_qi"]))
    curve_html = _curve_plot(curve, k) if curve else "<p>No curve: no value of k could be computed.</p>"
    if failed:
        curve_html += "<ul>" + "".join(f"<li>k = {kk}: {html.escape(msg)}</li>" for kk, msg in failed.items()) + "</ul>"
    sections.append("<h2>Risk–utility over k</h2><p>The method re-run at each k on the source as it is now, "
                    "in a transaction that was rolled back.</p>" + curve_html)
    if risk is None:
        sections.append("<h2>Composition</h2><p>No other release of this source publishes the same sensitive "
                        "attribute: no intersection attack to measure.</p>")
    else:
        sections.append("<h2>Composition with the other releases of the source</h2>" + _table(
            [("releases", ", ".join(r["release"] for r in risk["releases"])), ("people shared", risk["overlap"]),
             ("located in every release", risk["located"]),
             ("could not be located (risk unknown)", risk.get("unlocated")),
             ("average effective anonymity before / after", f"{risk['avg_min_prior_ea']} / {risk['avg_posterior_ea']}"),
             ("average drop", risk["avg_drop"]), ("vulnerable (drop > 0)", f"{risk['vulnerable_pct']} %")]
            + [(f"PVP at {c} % confidence", f"{risk['pvp'][c]} %") for c in CONFIDENCES]) + _pvp_plot(risk))
    title = f"anonproxy release {release['target']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60rem; margin: 2rem auto; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1rem; }}
th, td {{ border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; font-weight: normal; }}
svg {{ display: block; max-width: 100%; height: auto; margin: 0.5rem 0 1.5rem; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
{"".join(f"<section>{s}</section>" for s in sections)}
</body></html>
"""
