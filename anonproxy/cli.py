"""The ``anonproxy`` command: the proxy (up, serve), the schema and policy, anonymized releases."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

from . import login, trail
from .config import ConfigError, ProxyConfig, cores, load_config
from .console import command as console_command
from .embedded import EmbeddedPostgres, EmbeddedPostgresError
from .logs import setup_logging
from .policy import commands as policy_commands
from .proxy.server import ProxyStartError, bind_socket, run_proxy
from .views import audit, report
from .views import commands as view_commands
from .views import verify as verify_command
from .views.progress import ProgressBar

log = logging.getLogger("anonproxy")

DEMO_DATABASE = "postgres"
DSN_VARIABLE = "ANONPROXY_DSN"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"anonproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    except login.GatedLogin as exc:
        print(f"anonproxy {exc.command}: {exc}", file=sys.stderr)
        return 2
    except (ProxyStartError, EmbeddedPostgresError) as exc:
        print(f"anonproxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


class _Parser(argparse.ArgumentParser):
    """Every ``--dsn`` option, whichever module adds it, defaults to $ANONPROXY_DSN.

    Subcommand parsers are made with the parent's class, so this reaches them all.
    """

    def add_argument(self, *names: Any, **options: Any) -> argparse.Action:
        if "--dsn" in names:
            environment = os.environ.get(DSN_VARIABLE) or None
            options["default"] = environment
            options["required"] = options.get("required", False) and environment is None
            options["help"] = f"{options.get('help', 'libpq connection string')} (default: ${DSN_VARIABLE})"
        return super().add_argument(*names, **options)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anonproxy", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="start a throwaway PostgreSQL with sample data and the proxy in front of it")
    up.add_argument("--port", type=int, default=6432, help="proxy port on 127.0.0.1 (default 6432)")
    up.add_argument("--pg-port", type=_port, default=0,
                    help="PostgreSQL's port on 127.0.0.1 (default: a free port, chosen at each start)")
    up.add_argument("--data-dir", type=Path, help="keep the database here and reuse it on the next run")
    up.add_argument("--workers", type=int, default=cores(),
                    help=f"proxy worker processes (default: one per core, {cores()} here)")
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
    console_command.register(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    setup_logging(config.log_level, config.log_format)
    run_proxy(config, ready=lambda port: log.info("listening on %s:%d, upstream %s, %d worker%s", config.listen_host,
                                                  port, config.upstream_address, config.workers,
                                                  "s" if config.workers > 1 else ""))
    return 0


def _install(args: argparse.Namespace) -> int:
    from . import schema

    setup_logging()
    bar = ProgressBar(sys.stderr, "anonproxy install")
    try:
        with login.connect(args.dsn, "install") as conn:
            applied = schema.install(conn, bar.update)
    except psycopg.Error as exc:
        bar.close()
        print(f"anonproxy install: {exc}".rstrip(), file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(f"applied migrations {applied}" if applied else "schema already up to date")
    return 0


def _up(args: argparse.Namespace) -> int:
    from . import demo, sample_data, schema
    from .policy.store import load_policy
    from .policy.yaml_policy import apply_policy, demo_policy
    from .views.hierarchies import load_adult_hierarchies

    setup_logging(args.log_level)
    # Arguments first: a bad or taken port must not cost a PostgreSQL build.
    config = ProxyConfig(listen_port=args.port, workers=args.workers, log_level=args.log_level)
    _check_port_free(config.listen_host, config.listen_port, "the proxy")
    if args.pg_port:
        if args.pg_port == args.port:
            raise ConfigError(f"--pg-port and --port are both {args.port}: PostgreSQL and the proxy need a port each")
        _check_port_free(EmbeddedPostgres.host, args.pg_port, "PostgreSQL (--pg-port)")
    # SIGTERM before the proxy takes over signals must still stop the server we start.
    signal.signal(signal.SIGTERM, _interrupt)
    progress = ProgressBar(sys.stderr, "anonproxy up")
    progress.say("starting PostgreSQL and loading the sample data (a few seconds)")
    with _announced(progress, EmbeddedPostgres(data_dir=args.data_dir, port=args.pg_port)) as server:
        try:
            with psycopg.connect(server.conninfo(dbname=DEMO_DATABASE)) as conn:
                schema.install(conn)
                if server.created:
                    # Only a new data directory gets the demo; a reused one keeps what its owner changed.
                    sample_data.load_demo(conn)
                    load_adult_hierarchies(conn)
                    demo.create_demo_roles(conn, DEMO_DATABASE)
                    policy = demo_policy()
                    service_password = demo.reset_service_role(conn, policy.service_role)
                    policy = dataclasses.replace(policy, version=apply_policy(conn, policy))
                else:
                    policy = load_policy(conn)
                    demo.ensure_auditor(conn, DEMO_DATABASE)  # a directory made before the auditor existed
                    service_password = demo.reset_service_role(conn, policy.service_role)
                    print(_kept_line(conn, server), file=sys.stderr, flush=True)
                conn.commit()
        except BaseException:
            server.discard()  # a half-built new data directory is of no use to the next `up`
            raise
        log.info("privacy policy version %d: %s", policy.version,
                 ", ".join(f"{role.role} {role.mode}" for role in policy.roles.values()))
        log.info("PostgreSQL on 127.0.0.1:%d, data in %s; %s", server.port, server.data_dir,
                 "a new data directory with the demo" if server.created else "a reused data directory")
        config = dataclasses.replace(config, upstream=f"host={server.host} port={server.port}",
                                     service_dsn=psycopg.conninfo.make_conninfo(
                                         user=policy.service_role, password=service_password, dbname=DEMO_DATABASE))

        def print_connection_strings(port: int) -> None:
            print("anonproxy is ready. Connect with:", flush=True)
            for role in demo.DEMO_ROLES:
                mode = "reads the trail: anonproxy console" if role == demo.AUDITOR_LOGIN else policy.role(role).mode
                print(f"  {role:<9} postgresql://{role}:{role}@127.0.0.1:{port}/{DEMO_DATABASE}   ({mode})",
                      flush=True)
            owner = f"postgresql://{server.superuser}:{server.password}@127.0.0.1:{port}/{DEMO_DATABASE}"
            print(f"  {'owner':<9} {owner}   (applies policies, sets budgets)", flush=True)
            print("Press Ctrl-C to stop.", flush=True)

        run_proxy(config, ready=print_connection_strings)
    return 0


@contextlib.contextmanager
def _announced(progress: ProgressBar, server: EmbeddedPostgres) -> Iterator[EmbeddedPostgres]:
    """The embedded server, started; `up` says when it begins to stop it and when it is done."""
    stopping = False
    try:
        with server as started:
            try:
                yield started
            finally:
                stopping = True
                progress.say("stopping the proxy and PostgreSQL")
    finally:
        if stopping:
            progress.say("stopped")


def _port(text: str) -> int:
    """A TCP port number for argparse: 1 to 65535, or 0 for a free one."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, not {text!r}")
    return port


def _check_port_free(host: str, port: int, user: str) -> None:
    """Fail now if a port `up` needs is taken (the proxy and PostgreSQL check again when they bind it)."""
    try:
        bind_socket(host, port, reuse_port=False).close()
    except OSError as exc:
        raise ProxyStartError(f"cannot listen on {host}:{port} for {user}: {exc}") from exc


def _kept_line(conn: psycopg.Connection, server: EmbeddedPostgres) -> str:
    """One line saying what a reused data directory kept."""
    row = conn.execute(
        "select (select version from anonproxy.policy_version), (select count(*) from anonproxy.releases), "
        "(select count(*) from anonproxy.hierarchies), (select count(*) from anonproxy.budget_ledger)"
    ).fetchone()
    assert row is not None
    version, releases, hierarchies, charges = row
    # Charges, not an ε: what they add up to depends on each budget's accounting (SHOW anonproxy.budget says it).
    return (f"anonproxy: reusing {server.data_dir}: its policy (version {version}), {releases} release(s), "
            f"{hierarchies} hierarchies and the {charges} privacy-budget charge(s) so far are kept; "
            "the demo policy is applied only to a new data directory")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
