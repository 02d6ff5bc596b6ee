"""The ``anonproxy`` command: the proxy (up, serve), the schema and policy, anonymized releases."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import psycopg

from .config import ConfigError, ProxyConfig, load_config
from .embedded import EmbeddedPostgres, EmbeddedPostgresError
from .logs import setup_logging
from .policy import commands as policy_commands
from . import trail
from .proxy.server import ProxyStartError, run_proxy
from .views import audit, report
from .views import commands as view_commands
from .views import verify as verify_command

log = logging.getLogger("anonproxy")

DEMO_DATABASE = "postgres"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"anonproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    except (ProxyStartError, EmbeddedPostgresError) as exc:
        print(f"anonproxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anonproxy", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="start a throwaway PostgreSQL with sample data and the proxy in front of it")
    up.add_argument("--port", type=int, default=6432, help="proxy port on 127.0.0.1 (default 6432)")
    up.add_argument("--data-dir", type=Path, help="keep the database here and reuse it on the next run")
    up.add_argument("--workers", type=int, default=1, help="proxy worker processes (default 1)")
    up.add_argument("--log-level", default="info")
    up.set_defaults(run=_up)

    serve = commands.add_parser("serve", help="run the proxy in front of an existing PostgreSQL server")
    serve.add_argument("--config", type=Path, help="YAML file of settings (each also from ANONPROXY_<NAME>)")
    serve.set_defaults(run=_serve)

    install = commands.add_parser("install", help="install or upgrade the anonproxy SQL schema in a database")
    install.add_argument("--dsn", required=True, help="libpq connection string of a role that may create schemas")
    install.set_defaults(run=_install)

    policy_commands.register(commands)
    view_commands.register(commands)
    audit.register(commands)
    report.register(commands)
    verify_command.register(commands)
    trail.register(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    setup_logging(config.log_level, config.log_format)
    run_proxy(config, ready=lambda port: log.info("listening on %s:%d, upstream %s", config.listen_host, port,
                                                  config.upstream_address))
    return 0


def _install(args: argparse.Namespace) -> int:
    from . import schema

    setup_logging()
    try:
        with psycopg.connect(args.dsn) as conn:
            applied = schema.install(conn)
    except psycopg.Error as exc:
        print(f"anonproxy install: {exc}".rstrip(), file=sys.stderr)
        return 1
    print(f"applied migrations {applied}" if applied else "schema already up to date")
    return 0


def _up(args: argparse.Namespace) -> int:
    from . import demo, sample_data, schema
    from .policy.yaml_policy import apply_policy, demo_policy
    from .views.hierarchies import load_adult_hierarchies

    setup_logging(args.log_level)
    # SIGTERM before the proxy takes over signals must still stop the server we start.
    signal.signal(signal.SIGTERM, _interrupt)
    with EmbeddedPostgres(data_dir=args.data_dir) as server:
        with psycopg.connect(server.conninfo(dbname=DEMO_DATABASE)) as conn:
            schema.install(conn)
            rows = sample_data.load_adult(conn)
            load_adult_hierarchies(conn)
            demo.create_demo_roles(conn, DEMO_DATABASE)
            policy = demo_policy()
            service_password = demo.reset_service_role(conn, policy.service_role)
            version = apply_policy(conn, policy)
            conn.commit()
        log.info("privacy policy version %d applied: %s", version,
                 ", ".join(f"{role.role} {role.mode}" for role in policy.roles.values()))
        log.info("PostgreSQL on 127.0.0.1:%d, data in %s; table public.adult has %d rows",
                 server.port, server.data_dir, rows)
        config = ProxyConfig(listen_port=args.port, workers=args.workers, log_level=args.log_level,
                             upstream=f"host={server.host} port={server.port}",
                             service_dsn=psycopg.conninfo.make_conninfo(
                                 user=policy.service_role, password=service_password, dbname=DEMO_DATABASE))

        def print_connection_strings(port: int) -> None:
            print("anonproxy is ready. Connect with:", flush=True)
            for role in demo.DEMO_ROLES:
                mode = policy.role(role).mode
                print(f"  {role:<9} postgresql://{role}:{role}@127.0.0.1:{port}/{DEMO_DATABASE}   ({mode})",
                      flush=True)
            print("Press Ctrl-C to stop.", flush=True)

        run_proxy(config, ready=print_connection_strings)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
