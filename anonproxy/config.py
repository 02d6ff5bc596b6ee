"""Proxy settings: defaults, then a YAML file, then ANONPROXY_* environment variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg.conninfo
import yaml

ENV_PREFIX = "ANONPROXY_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# The most a gated session holds of any one client message (statements, bound values, COPY data).
MAX_STATEMENT_SIZE = 16 * 1024 * 1024
MAX_MEMORY_SIZE = 1 << 30  # the largest byte limit a setting may give (max_cursor_size…)
MAX_WORKERS = 64


def cores() -> int:
    """The CPUs this process may run on (its affinity, which containers and taskset narrow), at most MAX_WORKERS:
    the default number of workers, one per core."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class UpstreamAddress:
    """Where the proxy connects for each client: a TCP host or a Unix socket directory."""

    host: str
    port: int

    @property
    def is_unix(self) -> bool:
        return self.host.startswith("/")

    @property
    def unix_path(self) -> str:
        return f"{self.host}/.s.PGSQL.{self.port}"

    def __str__(self) -> str:
        return self.unix_path if self.is_unix else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ProxyConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 6432
    upstream: str = "host=127.0.0.1 port=5432"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_level: str = "info"
    log_format: str = "text"
    workers: int = dataclasses.field(default_factory=cores)  # one per core
    startup_timeout: float = 60.0
    service_dsn: str = ""
    audit_trail: bool = True  # record gated roles' statements in anonproxy.audit_trail (docs/audit-trail.md)
    # Gated sessions: the longest Query or Parse message body accepted, and the time one statement's analysis
    # may take (off the event loop) before it is refused.
    max_statement_size: int = 256 * 1024
    analysis_timeout: float = 5.0
    analysis_processes: int = 2  # per worker, each with a spare: a session's analysis need not wait for another's
    service_pool_size: int = 10  # service connections per worker, shared by its gated sessions
    # Seconds a gated session may keep a borrowed service connection waiting in an open batch (no Sync): at all,
    # and while another statement waits for a connection; seconds a statement may wait for a free service
    # connection. Past each, the batch or the statement is ended with an error.
    service_hold_timeout: float = 10.0
    service_yield_timeout: float = 0.05
    service_wait_timeout: float = 30.0
    # What one gated session may keep in the proxy's memory (docs/proxy.md, "Memory"): the rows of the cursors the
    # proxy holds for it, one cursor's and all of them, and how many; its named prepared statements and their bytes.
    max_cursor_size: int = 8 * 1024 * 1024
    max_session_cursor_size: int = 32 * 1024 * 1024
    max_session_cursors: int = 64
    max_prepared_statements: int = 1000
    max_prepared_size: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be between 0 and 65535, got {self.listen_port}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be between 1 and {MAX_WORKERS}, got {self.workers}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.startup_timeout <= 0:
            raise ConfigError(f"startup_timeout must be positive, got {self.startup_timeout}")
        if not 1024 <= self.max_statement_size <= MAX_STATEMENT_SIZE:
            raise ConfigError(f"max_statement_size must be between 1024 and {MAX_STATEMENT_SIZE} bytes, "
                              f"got {self.max_statement_size}")
        if self.analysis_timeout <= 0:
            raise ConfigError(f"analysis_timeout must be positive, got {self.analysis_timeout}")
        if not 1 <= self.analysis_processes <= 32:
            raise ConfigError(f"analysis_processes must be between 1 and 32, got {self.analysis_processes}")
        if not 1 <= self.service_pool_size <= 1000:
            raise ConfigError(f"service_pool_size must be between 1 and 1000, got {self.service_pool_size}")
        for setting in ("service_hold_timeout", "service_yield_timeout", "service_wait_timeout"):
            if not 0 < getattr(self, setting) <= 3600:
                raise ConfigError(f"{setting} must be more than 0 and at most 3600 seconds, "
                                  f"got {getattr(self, setting)}")
        for name in ("max_cursor_size", "max_session_cursor_size", "max_prepared_size"):
            if not 1024 <= getattr(self, name) <= MAX_MEMORY_SIZE:
                raise ConfigError(f"{name} must be between 1024 and {MAX_MEMORY_SIZE} bytes, got {getattr(self, name)}")
        for name in ("max_session_cursors", "max_prepared_statements"):
            if not 1 <= getattr(self, name) <= 1_000_000:
                raise ConfigError(f"{name} must be between 1 and 1000000, got {getattr(self, name)}")
        # Parse the connection strings now, so that a bad one fails at load time.
        _ = self.upstream_address
        if self.service_dsn:
            _ = self.service_login

    @property
    def upstream_address(self) -> UpstreamAddress:
        params = _parse_dsn("upstream", self.upstream)
        host = str(params.get("host") or "127.0.0.1")
        if "," in host:
            raise ConfigError("upstream must name a single host")
        try:
            port = int(params.get("port") or 5432)
        except ValueError as exc:
            raise ConfigError(f"upstream port is not a number: {params.get('port')!r}") from exc
        return UpstreamAddress(host, port)

    @property
    def service_login(self) -> ServiceLogin:
        """The service role's login, always to the upstream server (a host or port in the DSN is ignored)."""
        params = _parse_dsn("service_dsn", self.service_dsn)
        missing = [key for key in ("user", "password", "dbname") if not params.get(key)]
        if missing:
            raise ConfigError(f"service_dsn must give {', '.join(missing)}")
        return ServiceLogin(self.upstream_address, str(params["user"]), str(params["password"]),
                            str(params["dbname"]))

    @property
    def service_conninfo(self) -> str:
        """The service DSN for libpq, pointed at the upstream server."""
        address = self.upstream_address
        return psycopg.conninfo.make_conninfo(self.service_dsn, host=address.host, port=address.port)


@dataclass(frozen=True)
class ServiceLogin:
    """How the proxy logs in on its own account (rewritten queries, the policy)."""

    address: UpstreamAddress
    user: str
    password: str
    database: str


def _parse_dsn(setting: str, dsn: str) -> dict[str, Any]:
    try:
        return psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"{setting} is not a valid PostgreSQL connection string: {exc}") from exc


def load_config(path: Path | None = None, environ: Mapping[str, str] = os.environ, **overrides: Any) -> ProxyConfig:
    """Defaults, overridden by the YAML file, by environment variables, then by ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(path))
    for field in dataclasses.fields(ProxyConfig):
        env_value = environ.get(ENV_PREFIX + field.name.upper())
        if env_value is not None:
            values[field.name] = env_value
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ProxyConfig(**{name: _coerce(name, value) for name, value in values.items()})


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return data


def _coerce(name: str, value: Any) -> Any:
    fields = {f.name: f for f in dataclasses.fields(ProxyConfig)}
    if name not in fields:
        raise ConfigError(f"unknown setting {name!r}; known settings: {', '.join(fields)}")
    field = fields[name]
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]
    try:
        if name in ("tls_cert", "tls_key"):
            return Path(value) if value not in (None, "") else None
        if isinstance(default, bool):
            return _boolean(value)
        return type(default)(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name} has an invalid value {value!r}: expected {type(default).__name__}") from exc


def _boolean(value: Any) -> bool:
    """YAML gives a bool; the environment gives text: on/off, true/false, yes/no, 1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise ValueError(value)
