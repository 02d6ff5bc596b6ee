"""N fail-overs back and forth under dp charges: is any answer delivered without its charge? (docs/replicas.md)

A primary and a synchronous standby (durable settings: fsync, synchronous_commit on, synchronous_standby_names
'*'), the proxy (``serve``, two workers) with both in its multi-host ``upstream`` and as ``standbys``, and
``--clients`` threads asking dp questions, a role each, every question a new one. Each round: wait until every thread
has received ``--before`` more answers, kill -9 the primary's postmaster, promote the standby (pg_ctl promote),
re-create the old primary as a standby of the new one (pg_basebackup, on the old port), wait until every thread has
``--after`` more answers. At the end the answers each role received are compared with the distinct questions it
was charged for on the last primary (the ledger went through every fail-over):

- answers without a charge (lost charges: an overspent budget), the target being 0;
- charges without an answer (questions cut short by a crash: over-counted, never released);
- per round, the seconds from the kill to every thread having an answer again.

    python benchmarks/failover/run.py --failovers 20 --json benchmarks/failover/results/latest.json

Run as root (PostgreSQL runs as the ``postgres`` OS user); everything listens on 127.0.0.1, free ports, removed
at exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import start_proxy, stop_proxy
from replication import (
    Askers,
    charges_by_role,
    create_dp_roles,
    fail_over,
    new_server,
    prepare_database,
    service_dsn,
    set_synchronous,
    start_standby,
    wait_replayed,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failovers", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--before", type=int, default=3, help="answers per thread before each kill")
    parser.add_argument("--after", type=int, default=2, help="answers per thread after each promotion")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    roles = [f"asker_{i}" for i in range(args.clients)]
    primary = new_server()
    primary.start()
    servers = [primary]
    proxy = None
    try:
        prepare_database(primary)
        create_dp_roles(primary, roles)
        servers.append(start_standby(primary))
        set_synchronous(primary, True)
        wait_replayed(primary, servers[1])
        ports = [server.port for server in servers]
        proxy = start_proxy(f"host=127.0.0.1,127.0.0.1 port={ports[0]},{ports[1]}", Path(tempfile.mkdtemp(prefix="failover-")) / "anonproxy.log",
                            workers="2", service_dsn=service_dsn(), standbys=f"127.0.0.1:{ports[0]}, "
                            f"127.0.0.1:{ports[1]}", standby_check_interval="0.2")
        rounds = []
        with Askers(proxy.endpoint.host, proxy.endpoint.port, roles) as askers:
            for number in range(1, args.failovers + 1):
                askers.wait_for_more(args.before, timeout=600)
                killed = time.monotonic()
                servers[:] = fail_over(servers[0], servers[1])
                rebuilt = time.monotonic()
                askers.wait_for_more(1, timeout=600)
                answering = time.monotonic()
                askers.wait_for_more(args.after - 1, timeout=600)
                rounds.append({"round": number, "primary_port": servers[0].port,
                               "kill_to_standby_rebuilt_s": round(rebuilt - killed, 2),
                               "kill_to_every_client_answered_s": round(answering - killed, 2)})
                print(f"fail-over {number}: primary now on port {servers[0].port}, every client answered again "
                      f"{answering - killed:.1f} s after the kill", flush=True)
        delivered, errors = dict(askers.delivered), dict(askers.errors)
        charged = charges_by_role(servers[0], roles)
    finally:
        if proxy is not None:
            stop_proxy(proxy)
        for server in servers:
            server.stop()
    if proxy is not None:
        print(f"proxy log: {proxy.log_path}")
    lost = sum(max(0, delivered[role] - charged[role]) for role in roles)
    over = sum(max(0, charged[role] - delivered[role]) for role in roles)
    result = {"failovers": args.failovers, "clients": args.clients, "answers_delivered": sum(delivered.values()),
              "questions_charged": sum(charged.values()), "answers_without_charge": lost,
              "charges_without_answer": over, "client_errors": sum(errors.values()), "rounds": rounds,
              "per_role": {role: {"delivered": delivered[role], "charged": charged[role], "errors": errors[role]}
                           for role in roles}}
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "per_role")}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    main()
