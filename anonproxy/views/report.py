"""`anonproxy report TARGET --html FILE --dsn DSN`: a self-contained HTML page about one release.

The page shows what the release protects and what it costs: the sizes of its
equivalence classes, each class's entropy ℓ and earth mover's distance against
the thresholds asked, the information loss (NCP) per quasi-identifier, the
release's parameters, a verdict line as `anonproxy verify` prints it, and the
composition risk with the other releases of its source (the intersection attack
of Ganta et al., KDD 2008), as the registry keeps it (:mod:`.combined`). With
``--curve`` (or ``--curve-k``) it adds a risk-utility curve over k: the
release's method re-run at several k on the source, without creating or
registering anything, in a transaction that is rolled back; it is the slow part
(seconds per k), so it is drawn only when asked. Plots are inline SVG drawn by
matplotlib: the file needs nothing else to display. docs/composition.md
describes it; docs/glossary.md explains its terms.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from .. import login
from . import combined, verify
from .audit import CONFIDENCES, release_groups
from .progress import ProgressBar
from .words import achieved_text, hierarchies_text, number, parameters_text, percent

DEFAULT_CURVE = (2, 5, 10, 25, 50, 100)


def register(subparsers: Any) -> None:
    """Add the ``report`` command to an ``argparse`` subparsers object."""
    report = subparsers.add_parser("report", help="write an HTML page of a release's protection and cost")
    report.add_argument("target", help="release table, as recorded in anonproxy.releases")
    report.add_argument("--html", required=True, type=Path, help="file to write")
    report.add_argument("--dsn", required=True, help="libpq connection string of a role that may read the source "
                                                     "(the curve re-runs the method in temporary tables, then rolls "
                                                     "back)")
    report.add_argument("--curve", action="store_true",
                        help=f"add the risk-utility curve: the method re-run at k = {_CURVE_TEXT} (seconds per k)")
    report.add_argument("--curve-k", help="add the risk-utility curve at these values of k, comma-separated")
    report.set_defaults(run=_report)


_CURVE_TEXT = ",".join(map(str, DEFAULT_CURVE))


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
    curve_k: list[int] = list(DEFAULT_CURVE) if args.curve else []
    if args.curve_k is not None:
        try:
            curve_k = [int(k) for k in args.curve_k.split(",") if k.strip()]
        except ValueError:
            print(f"anonproxy report: --curve-k must be integers separated by commas, not {args.curve_k!r}",
                  file=sys.stderr)
            return 2
    bar = ProgressBar(sys.stderr, "anonproxy report")
    try:
        with login.connect(args.dsn, "report") as conn:
            page, verdict = build_report(conn, args.target, curve_k, bar)
    except (psycopg.Error, LookupError) as exc:
        bar.close()
        print(f"anonproxy report: {exc}".rstrip(), file=sys.stderr)
        return 1
    finally:
        bar.close()
    args.html.write_text(page, encoding="utf-8")
    print(f"{args.target}: {verdict}")
    if not curve_k:
        print(f"risk-utility curve skipped (it re-runs {args.target}'s method once per k); add --curve to draw it")
    print(f"wrote {args.html}")
    return 0


def build_report(conn: psycopg.Connection, target: str, curve_k: list[int],
                 bar: ProgressBar | None = None) -> tuple[str, str]:
    """The HTML page for release ``target`` and its verdict line; ``bar`` shows each step."""
    steps = 4 + len(curve_k)

    def step(done: int, what: str) -> None:
        if bar is not None:
            bar.update(done, steps, what)

    step(0, "reading the release")
    release = _release(conn, target)
    step(1, "measuring its equivalence classes")
    classes = class_stats(conn, release)
    step(2, "checking its parameters, as anonproxy verify does")
    verdict = verdict_of(conn, release)
    curve, failed = risk_utility_curve(conn, release, curve_k,
                                       lambda i, k: step(3 + i, f"risk-utility curve: {release['method']} at k = {k}"))
    step(3 + len(curve_k), "combining it with the other releases of its source")
    composition = composition_of(conn, release)
    step(steps, "done")
    return _page(release, classes, curve, failed, composition, verdict), verdict


def verdict_of(conn: psycopg.Connection, release: dict[str, Any]) -> str:
    """verify's verdict on the release: its levels measured now against the parameters it was built with."""
    parameters = release["parameters"]
    subject = verify.Subject(target=release["target"], qi=list(release["quasi_identifiers"]),
                             sensitive=release["sensitive"], source=release["source"], release_id=release["id"],
                             method=release["method"], unit=release["unit"], parameters=parameters,
                             registry=release["achieved"], combined=release["combined"])
    distance = parameters.get("t_distance") if parameters.get("t") is not None else None
    now = verify.measure_levels(conn, subject, distance, parameters.get("hierarchies") or {})
    unjudged = verify.why_not_judged(subject, now)
    shortfalls = [] if unjudged else verify.shortfalls_of(parameters, now)
    line = verify.verdict(subject, shortfalls, unjudged)
    assert line is not None  # a registered release always gets one
    return line


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


def risk_utility_curve(conn: psycopg.Connection, release: dict[str, Any], ks: list[int],
                       progress: Callable[[int, int], None] | None = None) -> tuple[list[CurvePoint], dict[int, str]]:
    """Re-run the release's method at each k; k values that fail are returned with the database's message.

    The curve uses the steps of create_anonymized_view that make no table and register nothing
    (sql/0005_releases.sql: check the arguments, stage the source, run the method, then measure its output
    with anonproxy.utility), in a transaction that is rolled back: no release id is used up, no composition
    check runs, and nothing is left behind. ``progress(i, k)`` is called before the i-th k.
    """
    p = release["parameters"]
    points: list[CurvePoint] = []
    failed: dict[int, str] = {}
    with conn.transaction(force_rollback=True):
        conn.execute("set local work_mem = '128MB'")  # as create_anonymized_view runs the method
        for i, k in enumerate(ks):
            if progress is not None:
                progress(i, k)
            try:
                # A savepoint rolled back once read: each k starts without the staging tables of the last.
                with conn.transaction(force_rollback=True):
                    spec = _scalar(conn, "select anonproxy.release_spec(%s::regclass, %s::text[], %s::text, "
                                         "%s::integer, %s::numeric, %s::text, %s::numeric, %s::numeric, %s::text, "
                                         "%s::text, %s::numeric, %s::text, %s::jsonb)",
                                   (release["source"], release["quasi_identifiers"], release["sensitive"], k,
                                    p.get("l"), p.get("l_kind") or "entropy", p.get("c"), p.get("t"),
                                    p.get("t_distance"), release["method"], p.get("suppression_limit") or 0,
                                    release["unit"], json.dumps(p.get("hierarchies"))))
                    conn.execute("select anonproxy.release_stage(%s::regclass, %s, %s)",
                                 (release["source"], Jsonb(spec), release["unit"]))
                    conn.execute("select anonproxy.release_run(%s, %s)", (release["method"], Jsonb(spec)))
                    metrics = _scalar(
                        conn, """select anonproxy.utility('pg_temp.anonproxy_input', 'pg_temp.anonproxy_output', %(qi)s,
                                     (select jsonb_object_agg(q ->> 'name', q -> 'hierarchy')
                                        from jsonb_array_elements(%(spec)s -> 'qi') q
                                       where q ->> 'hierarchy' is not null), %(k)s)""",
                        {"qi": release["quasi_identifiers"], "spec": Jsonb(spec), "k": k})
            except psycopg.Error as exc:
                failed[k] = (exc.diag.message_primary or str(exc)).strip()
                continue
            classes, rows = metrics["equivalence_classes"], metrics["rows_released"]
            points.append(CurvePoint(k, float(metrics["ncp"]), classes / rows if rows else math.nan, classes))
    return points, failed


def composition_of(conn: psycopg.Connection, release: dict[str, Any]) -> dict[str, Any] | None:
    """The composition risk of the release with the other existing releases of its source.

    The registry's figure (kept up to date by the database), else, when it has none, measured now.
    """
    if release["combined"] is not None:
        return release["combined"]["risk"] if combined.others(release["combined"], release["target"]) else None
    group = next((g for g in release_groups(conn, release["source"]) if release["target"] in g), None)
    if group is None:
        return None
    with conn.transaction(force_rollback=True):
        return _scalar(conn, "select anonproxy.composition_risk(%s::regclass[])", (group,))


def _scalar(conn: psycopg.Connection, query: str | sql.Composed,
            params: tuple[Any, ...] | dict[str, Any] = ()) -> Any:
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


def _curve_section(curve: list[CurvePoint], failed: dict[int, str], k: int | None, target: str) -> str:
    if not curve and not failed:
        return ("<h2>Risk–utility over k</h2><p>Not drawn: it re-runs the method once per k, which takes seconds "
                f"each. <code>anonproxy report {html.escape(target)} --curve</code> draws it.</p>")
    drawn = _curve_plot(curve, k) if curve else "<p>No curve: no value of k could be computed.</p>"
    if failed:
        drawn += "<ul>" + "".join(f"<li>k = {kk}: {html.escape(msg)}</li>" for kk, msg in failed.items()) + "</ul>"
    return ("<h2>Risk–utility over k</h2><p>The method re-run at each k on the source as it is now, "
            "in a transaction that was rolled back: nothing was created or registered.</p>" + drawn)


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_text(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


# What PVP at each confidence counts: the people an attacker narrows down to so many sensitive values.
_NARROWED = {"100": "one value", "50": "two values or fewer", "33": "three values or fewer",
             "25": "four values or fewer"}


def _text(value: Any) -> str:
    return "—" if value is None else str(value)


def _page(release: dict[str, Any], classes: list[ClassStat], curve: list[CurvePoint], failed: dict[int, str],
          risk: dict[str, Any] | None, verdict: str) -> str:
    p, metrics = release["parameters"], release["metrics"]
    k = p.get("k")
    sections = [
        f"<p class=\"verdict\"><strong>Verdict:</strong> {html.escape(verdict)} "
        "(the levels measured now against the parameters the release was built with, and what combining it with "
        "the other releases of its source reveals, as <code>anonproxy verify</code> prints them). The terms are "
        "explained in <code>docs/glossary.md</code> of anonproxy.</p>",
        "<h2>Release</h2>" + _table([
            ("target", release["target"]), ("source", release["source"]), ("method", release["method"]),
            ("quasi-identifiers (columns generalized)", ", ".join(release["quasi_identifiers"])),
            ("sensitive column (published as is)", release["sensitive"] or "none"),
            ("privacy unit (column identifying a person)",
             release["unit"] or "none: each row counts as one person"),
            ("asked for", parameters_text(p)), ("hierarchies", hierarchies_text(p.get("hierarchies"))),
            ("achieved when built", achieved_text(release["achieved"])),
            ("created", f"{release['created_at']:%Y-%m-%d %H:%M %Z} by {release['created_by']}"),
            ("forced past the composition guard", "yes" if release["forced"] else "no")]),
        "<h2>Equivalence classes</h2><p>An equivalence class is a group of rows that share every "
        "quasi-identifier value after generalization: within it, no row can be told from another.</p>" + _table([
            ("classes", len(classes)), ("smallest", min((c.size for c in classes), default=None)),
            ("average size", f"{sum(c.size for c in classes) / max(len(classes), 1):.1f}"),
            ("suppressed rows", metrics.get("suppressed_rows")),
            ("classes whose rows all share one sensitive value, which they thus disclose (distinct ℓ = 1)",
             sum(1 for c in classes if c.l_distinct == 1) if release["sensitive"] else None)])
        + _class_size_plot(classes, k),
    ]
    if release["sensitive"] is not None:
        distance = "ordered" if p.get("t_distance") == "ordered" else "equal-distance"
        sections.append(
            f"<h2>Protection of {html.escape(release['sensitive'])} per class</h2>"
            "<p>Entropy ℓ: how many equally likely sensitive values a class amounts to (higher protects more). "
            "t: how far a class's distribution of the sensitive value is from the whole table's, as an earth "
            "mover's distance (EMD, 0 to 1; lower protects more).</p>"
            + _threshold_plot([c.l_entropy for c in classes], p.get("l"), "entropy ℓ = exp(entropy)",
                              "Entropy ℓ-diversity of each class", worse_below=True)
            + _threshold_plot([c.emd for c in classes], p.get("t"), f"EMD to the whole table ({distance})",
                              "t-closeness of each class", worse_below=False))
    if metrics.get("ncp_per_qi"):
        sections.append("<h2>Information loss</h2>" + _table([
            ("NCP (normalized certainty penalty: 0 % published as is, 100 % fully generalized)",
             percent(metrics["ncp"])),
            ("discernibility (sum of squared class sizes: lower keeps more detail)", metrics.get("discernibility")),
            ("KL divergence (how far the released distribution is from the source's; 0 is equal)",
             number(metrics.get("kl_divergence"))),
            ("re-identification (prosecutor) risk, largest: 1 / smallest class", number(
                metrics.get("prosecutor_max_risk")))]) + _ncp_plot(metrics["ncp_per_qi"]))
    sections.append(_curve_section(curve, failed, k, release["target"]))
    with_others = combined.clause(release["combined"], release["target"], release["sensitive"])
    if risk is None and with_others is not None:  # the registry knows the other releases, not their risk
        sections.append(f"<h2>Composition with the other releases of the source</h2><p>{html.escape(with_others)}"
                        "</p>")
    elif risk is None:
        sections.append("<h2>Composition</h2><p>No other release of this source publishes the same sensitive "
                        "attribute: no intersection attack to measure.</p>")
    else:
        sections.append(
            "<h2>Composition with the other releases of the source</h2><p>An attacker who finds a person in "
            "every release can intersect the sensitive values each release leaves possible (the intersection "
            "attack of Ganta, Kasiviswanathan and Smith, KDD 2008). Effective anonymity (EA) is how many "
            "values remain possible for a person; PVP, the share of vulnerable people, counts those narrowed "
            "down to one value (100 % confidence), two (50 %), three (33 %) or four (25 %).</p>" + _table(
                [("releases", ", ".join(r["release"] for r in sorted(risk["releases"], key=lambda r: r["id"]))), ("people shared", risk["overlap"]),
                 ("located in every release", risk["located"]),
                 ("could not be located (risk unknown)", risk.get("unlocated")),
                 ("average effective anonymity: most revealing single release / all combined",
                  f"{number(risk['avg_min_prior_ea'])} / {number(risk['avg_posterior_ea'])}"),
                 ("average drop in effective anonymity", number(risk["avg_drop"])),
                 ("vulnerable (drop > 0)", f"{number(risk['vulnerable_pct'])} %")]
                + [(f"PVP at {c} % confidence (people narrowed to {_NARROWED[c]})", f"{number(risk['pvp'][c])} %")
                   for c in CONFIDENCES]) + _pvp_plot(risk))
        if release["combined"] is not None:
            sections[-1] += (f"<p><strong>{html.escape(with_others or '')}</strong> (measured "
                             f"{html.escape(str(release['combined'].get('measured_at')))}, when the releases of "
                             "this source last changed).</p>")
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
