"""Seed 002's composition experiment on adult, the same people under differential privacy, and audit timings.

    python3 benchmarks/composition/run.py [--seed 2008] [--rows-1m 1000000 | --rows-1m 0]

Starts its own PostgreSQL (anonproxy.embedded), installs the schema and adult.
See README.md next to this file for the method and the figures measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import psycopg

from anonproxy import sample_data, schema
from anonproxy.dp.mechanisms import discrete_laplace, laplace_scale
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.views.hierarchies import load_adult_hierarchies

QI = ["age", "workclass", "education", "marital_status", "race", "sex", "native_country"]
HIERARCHIES = json.dumps({q: f"adult.{q}" for q in QI + ["occupation"]})
OVERLAP = 5000
# What Ganta et al. 2008 reports in its text for Adult (Figures 1-6 are not in the text we have).
PAPER = {"k=5": "PVP100 ≈ 12 %, PVP25 > 60 %"}


def make_subsets(conn: psycopg.Connection, n: int, rng: random.Random, tag: str) -> list[str]:
    """n subsets of adult sharing the same OVERLAP people; the others are split evenly among them."""
    ids = [row[0] for row in conn.execute("select id from adult order by id")]
    rng.shuffle(ids)
    shared, rest = ids[:OVERLAP], ids[OVERLAP:]
    names = []
    for i in range(n):
        name = f"adult_{tag}_{i + 1}"
        members = shared + rest[i::n]
        conn.execute(f"create table {name} as select * from adult where id = any(%s)", (members,))
        conn.execute(f"alter table {name} add primary key (id)")
        names.append(name)
    conn.commit()
    return names


def anonymize(conn: psycopg.Connection, source: str, target: str, **criteria: object) -> float:
    started = time.perf_counter()
    conn.execute("""select anonproxy.create_anonymized_view(source => %(source)s, target => %(target)s,
                        quasi_identifiers => %(qi)s, sensitive => 'occupation', k => %(k)s::integer,
                        l => %(l)s::numeric, l_kind => 'entropy', t => %(t)s::numeric, t_distance => %(t_distance)s,
                        method => 'mondrian', hierarchies => %(h)s::jsonb)""",
                 {"source": f"public.{source}", "target": f"public.{target}", "qi": QI, "k": criteria["k"],
                  "l": criteria.get("l"), "t": criteria.get("t"), "t_distance": "equal" if criteria.get("t") else None,
                  "h": HIERARCHIES})
    conn.commit()
    return time.perf_counter() - started


def backend_cpu(conn: psycopg.Connection) -> float:
    """CPU seconds the server process of conn has used (the server runs on this machine)."""
    fields = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def audit(conn: psycopg.Connection, releases: list[str], persons: str = "public.adult") -> tuple[dict, float, float]:
    """The composition risk, the wall time and the server's CPU time of the call."""
    cpu, started = backend_cpu(conn), time.perf_counter()
    risk = conn.execute("select anonproxy.composition_risk(%s::regclass[], %s)", (releases, persons)).fetchone()[0]
    seconds, cpu = time.perf_counter() - started, backend_cpu(conn) - cpu
    conn.rollback()
    return risk, seconds, cpu


def row(label: str, risk: dict, paper: str = "") -> str:
    sizes = "/".join(f"{r['avg_partition_size']:.0f}" for r in risk["releases"])
    prior = "/".join(f"{r['avg_prior_ea']:.2f}" for r in risk["releases"])
    p = risk["pvp"]
    return (f"{label:<16} {risk['located']:>6} {sizes:>15} {prior:>17} {risk['avg_posterior_ea']:>6.2f} "
            f"{risk['avg_drop']:>5.2f} {p['100']:>6.2f} {p['50']:>6.2f} {p['33']:>6.2f} {p['25']:>6.2f}  {paper}")


HEADER = (f"{'setting':<16} {'people':>6} {'avg class size':>15} {'avg EA before':>17} {'EA^':>6} "
          f"{'drop':>5} {'PVP100':>6} {'PVP50':>6} {'PVP33':>6} {'PVP25':>6}  paper (text)")


def experiment(conn: psycopg.Connection, rng: random.Random) -> None:
    print("Seed 002 experiment: adult, two random subsets sharing 5,000 people, Mondrian on each")
    print("(class sizes and EA are averaged over the shared people, per release; PVP in % of them)\n")
    print(HEADER)
    pair = make_subsets(conn, 2, rng, "pair")
    settings = [(f"k={k}", {"k": k}) for k in (5, 10, 25, 50)]
    settings += [("k=10, l=5", {"k": 10, "l": 5}), ("k=10, t=0.4", {"k": 10, "t": 0.4})]
    for label, criteria in settings:
        tag = label.replace("=", "").replace(", ", "_").replace(".", "")
        spent = [anonymize(conn, s, f"{s}_{tag}", **criteria) for s in pair]
        risk, seconds, _ = audit(conn, [f"{s}_{tag}" for s in pair])
        print(row(label, risk, PAPER.get(label, "")), f"  [mondrian {max(spent):.1f} s, audit {seconds:.2f} s]",
              flush=True)
    for n in (3, 4):
        subsets = make_subsets(conn, n, rng, f"n{n}")
        for s in subsets:
            anonymize(conn, s, f"{s}_k5", k=5)
        risk, seconds, _ = audit(conn, [f"{s}_k5" for s in subsets])
        print(row(f"n={n}, k=5", risk), f"  [audit {seconds:.2f} s]", flush=True)
    print()
    dp_comparison(conn, pair)


def dp_comparison(conn: psycopg.Connection, pair: list[str], epsilon: float = 1.0) -> None:
    """The same two subsets published as ε-DP histograms: noisy occupation counts per public cell.

    Cells are fixed in advance from the hierarchies (not from the data): age, workclass, education,
    marital status and native country at level 1, race and sex as they are. Every person adds 1 to one
    count, so each histogram is ε-DP with discrete Laplace noise of scale 1/ε (the DP mode's sampler).
    The attacker locates a shared person's cell in both histograms and keeps the occupations whose
    noisy count is at least 1 in both: the analogue of intersecting the sensitive sets.
    """
    levels = {"age": 1, "workclass": 1, "education": 1, "marital_status": 1, "native_country": 1}
    cell = ", ".join(f"coalesce(h_{q}.node, a.{q}::text)" if q in levels else f"a.{q}::text" for q in QI)
    joins = " ".join(f"left join anonproxy.hierarchy_nodes h_{q} on h_{q}.hierarchy = 'adult.{q}' "
                     f"and h_{q}.leaf = a.{q}::text and h_{q}.level = {lvl}" for q, lvl in levels.items())
    occupations = [r[0] for r in conn.execute("select distinct occupation from adult order by 1")]
    scale = laplace_scale(1, epsilon)
    true_counts = [Counter(conn.execute(f"select row({cell})::text, a.occupation from {subset} a {joins}"))
                   for subset in pair]
    shared = conn.execute(f"select row({cell})::text, a.occupation from {pair[0]} a {joins} "
                          f"where a.id in (select id from {pair[1]})").fetchall()
    # Each published count gets its noise once; only the cells of shared people matter to the attack.
    noisy: list[dict[tuple[str, str], int]] = [{}, {}]

    def published(j: int, key: tuple[str, str]) -> int:
        if key not in noisy[j]:
            noisy[j][key] = true_counts[j][key] + discrete_laplace(scale)
        return noisy[j][key]

    sizes, singletons, correct_singletons, dropped = [], 0, 0, 0
    for key, occupation in shared:
        kept = {o for o in occupations if all(published(j, (key, o)) >= 1 for j in (0, 1))}
        sizes.append(len(kept))
        dropped += occupation not in kept
        if len(kept) == 1:
            singletons += 1
            correct_singletons += occupation in kept
    n = len(shared)
    print(f"Same subsets as ε-DP histograms (ε = {epsilon} each, discrete Laplace scale {float(scale):.2f}):")
    print(f"  shared people {n}; occupations left after intersecting the noisy supports: mean "
          f"{statistics.mean(sizes):.2f}")
    print(f"  one occupation left for {100 * singletons / n:.2f} % of them, the true one for "
          f"{100 * correct_singletons / max(singletons, 1):.1f} % of those; the true occupation was dropped for "
          f"{100 * dropped / n:.2f} %")
    print("  (against the k-anonymous releases every narrowed set holds the true value: one value left is certain)")


def time_audit(conn: psycopg.Connection, table: str, runs: int = 3) -> None:
    for target, k in ((f"{table}_k5", 5), (f"{table}_k10", 10)):
        spent = time.perf_counter()
        conn.execute("""select anonproxy.create_anonymized_view(source => %s, target => %s, quasi_identifiers => %s,
                            sensitive => 'occupation', k => %s::integer, method => 'mondrian',
                            hierarchies => %s::jsonb)""",
                     (f"public.{table}", f"public.{target}", QI, k, HIERARCHIES))
        conn.commit()
        print(f"  mondrian k={k} on {table}: {time.perf_counter() - spent:.1f} s", flush=True)
    runs_seen = [audit(conn, [f"{table}_k5", f"{table}_k10"], f"public.{table}") for _ in range(runs)]
    risk = runs_seen[-1][0]
    print(f"  audit of {table}_k5 + {table}_k10 ({risk['located']} people): wall "
          f"{', '.join(f'{w:.2f}' for _, w, _ in runs_seen)} s, server CPU "
          f"{', '.join(f'{c:.2f}' for _, _, c in runs_seen)} s; PVP100 {risk['pvp']['100']} %, "
          f"join keys {[r['key_qis'] for r in risk['releases']]}", flush=True)


def make_million(conn: psycopg.Connection, rows: int, seed: int) -> None:
    """rows people sampled from adult with replacement, age moved by up to ±2 years (seeded)."""
    conn.execute("select setseed(%s)", (seed / 2**31,))
    conn.execute(f"""create table adult_1m as
        select g as id, greatest(17, least(90, a.age + floor(random() * 5)::integer - 2)) as age, a.workclass,
               a.education, a.marital_status, a.race, a.sex, a.native_country, a.occupation
        from (select g, 1 + floor(random() * 30162)::integer as pick from generate_series(1, {rows}) g) s
        join (select row_number() over (order by id) as n, * from adult) a on a.n = s.pick""")
    conn.execute("alter table adult_1m add primary key (id)")
    conn.commit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2008)
    parser.add_argument("--rows-1m", type=int, default=1_000_000, help="rows of the large table (0: skip)")
    parser.add_argument("--only-timing", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with EmbeddedPostgres() as server, psycopg.connect(server.conninfo()) as conn:
        schema.install(conn)
        sample_data.load_adult(conn)
        load_adult_hierarchies(conn)
        conn.execute("update anonproxy.composition_settings set action = 'off'")  # the audit is timed on its own
        conn.commit()
        if not args.only_timing:
            experiment(conn, rng)
        print("\nAudit timing (two Mondrian releases of the same table, k = 5 and k = 10):")
        time_audit(conn, "adult")
        if args.rows_1m:
            make_million(conn, args.rows_1m, args.seed)
            time_audit(conn, "adult_1m", runs=2)


if __name__ == "__main__":
    main()
