"""Proxy settings: defaults, then a YAML file, then ANONPROXY_* environment variables."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg.conninfo
import yaml

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

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


# libpq's sslmode values but "allow" (plaintext first, TLS only if the server insists: prefer covers it, encrypting
# whenever the server can), weakest first. Ours defaults to "disable", not libpq's "prefer": a relayed client in TLS
# to the proxy could not log in with SCRAM to a server in TLS (docs/proxy.md, "TLS to PostgreSQL").
SSL_MODES = ("disable", "prefer", "require", "verify-ca", "verify-full")
TLS_FILE_PARAMETERS = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


@dataclass(frozen=True)
class UpstreamTLS:
    """The upstream connection string's libpq TLS parameters, for every connection the proxy opens to the server.

    ``rootcert`` may also be "system" (the operating system's CAs), as in libpq.
    """

    mode: str = "disable"
    rootcert: str | None = None
    cert: Path | None = None
    key: Path | None = None
    crl: Path | None = None

    @property
    def required(self) -> bool:
        """No connection without TLS."""
        return self.mode in ("require", "verify-ca", "verify-full")

    @property
    def verified(self) -> bool:
        """The server's certificate is checked against ``rootcert`` (libpq: require with a root certificate
        file behaves as verify-ca)."""
        return self.mode in ("verify-ca", "verify-full") or (self.mode == "require" and self.rootcert is not None)

    def libpq_parameters(self) -> dict[str, str]:
        """The same settings for libpq (psycopg connections); sslmode always, so that PGSSLMODE in the environment
        cannot make those connections differ from the proxy's own."""
        given = {"sslrootcert": self.rootcert, "sslcert": self.cert, "sslkey": self.key, "sslcrl": self.crl}
        return {"sslmode": self.mode, **{name: str(value) for name, value in given.items() if value is not None}}


def parse_upstream_tls(params: Mapping[str, Any]) -> UpstreamTLS:
    """The TLS settings of the ``upstream`` connection string; ConfigError names a bad or unreadable one."""
    unsupported = sorted(name for name in params
                         if name.startswith(("ssl", "gss", "requiressl")) and name not in ("sslmode",
                                                                                           *TLS_FILE_PARAMETERS))
    if unsupported:
        raise ConfigError(f"upstream parameter {unsupported[0]} is not supported by anonproxy; "
                          f"the TLS parameters it honours are sslmode, {', '.join(TLS_FILE_PARAMETERS)}")
    mode = str(params.get("sslmode") or "disable")
    if mode == "allow":
        raise ConfigError("upstream sslmode=allow is not supported by anonproxy: use prefer (TLS whenever the server "
                          "offers it, else plaintext) or disable")
    if mode not in SSL_MODES:
        raise ConfigError(f"upstream sslmode must be one of {', '.join(SSL_MODES)}, got {mode!r}")
    rootcert = params.get("sslrootcert") or None
    if mode in ("verify-ca", "verify-full") and rootcert is None:
        raise ConfigError(f"upstream sslmode={mode} needs sslrootcert: the file of the CA certificates that sign "
                          "the server's certificate (or sslrootcert=system for the system's CAs)")
    if rootcert == "system" and mode != "verify-full":  # as libpq: the system's CAs vouch for any name they signed
        raise ConfigError(f"upstream sslrootcert=system needs sslmode=verify-full, got sslmode={mode}")
    if bool(params.get("sslcert")) != bool(params.get("sslkey")):
        raise ConfigError("upstream sslcert and sslkey must be given together")
    files = {name: _readable_file(name, params.get(name)) for name in TLS_FILE_PARAMETERS}
    if files["sslkey"] is not None:
        _check_key_permissions(files["sslkey"])
    return UpstreamTLS(mode, None if rootcert is None else str(files["sslrootcert"] or rootcert),
                       files["sslcert"], files["sslkey"], files["sslcrl"])


def _readable_file(name: str, value: Any) -> Path | None:
    if not value or (name == "sslrootcert" and value == "system"):
        return None
    path = Path(str(value))
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"upstream {name} {path} cannot be read: {exc.strerror}") from exc
    return path


def _check_key_permissions(path: Path) -> None:
    """libpq refuses a private key others may read (psycopg connections would fail later): refuse it now."""
    info = path.stat()
    allowed = 0o640 if info.st_uid == 0 else 0o600  # a root-owned key may be group-readable, as in libpq
    if stat.S_IMODE(info.st_mode) & ~allowed:
        raise ConfigError(f"upstream sslkey {path} has group or world access; it must be at most "
                          f"{allowed:04o} (chmod {allowed:04o} {path})")


@dataclass(frozen=True)
class UpstreamAddress:
    """Where the proxy connects for each client: a TCP host or a Unix socket directory, and how (TLS)."""

    host: str
    port: int
    tls: UpstreamTLS = UpstreamTLS()

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
    # Addresses (or networks, CIDR) of load balancers allowed to send a PROXY protocol header (v1 or v2) first on a
    # connection, naming the client whose connection they relay; from any other address such a header is refused.
    trusted_proxies: tuple[str, ...] = ()
    # The other proxies behind the same balancer, as "address:port" they listen on (and connect from): a cancel
    # request whose key no worker here issued is passed to them, as the balancer may have sent it to another proxy
    # than its session's.
    peers: tuple[str, ...] = ()
    # Read replicas and fail-over (docs/replicas.md): hot standbys where suppress rewrites and dp measurements run;
    # how far (bytes of WAL) one may lag behind the primary and stay in rotation; how often (seconds) the primary and
    # the standbys are probed; whether dp roles may log in when the ledger's commits do not wait for a standby.
    standbys: str = ""
    max_standby_lag: int = 16 * 1024 * 1024
    standby_check_interval: float = 1.0
    accept_async_ledger: bool = False

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
        _ = self.trusted_proxy_networks
        _ = self.peer_endpoints
        _check_replica_settings(self)
        # Parse the connection strings now, so that a bad one fails at load time.
        _ = self.upstream_addresses, self.standby_addresses
        if self.service_dsn:
            _ = self.service_login

    @property
    def trusted_proxy_networks(self) -> tuple[IPNetwork, ...]:
        networks = []
        for entry in self.trusted_proxies:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ConfigError(f"trusted_proxies: {entry!r} is not an IP address or network (CIDR)") from None
        return tuple(networks)

    @property
    def peer_endpoints(self) -> tuple[tuple[str, int], ...]:
        endpoints = []
        for entry in self.peers:
            host, _, port = entry.strip().rpartition(":")
            try:
                address = ipaddress.ip_address(host.strip("[]"))
                number = int(port)
            except ValueError:
                raise ConfigError(f"peers: {entry!r} is not an IP address and a port (address:port)") from None
            if not 1 <= number <= 65535:
                raise ConfigError(f"peers: {entry!r} has no valid port")
            endpoints.append((str(address), number))
        return tuple(endpoints)

    @property
    def peer_networks(self) -> tuple[IPNetwork, ...]:
        """The peers' addresses, each a network of one address."""
        return tuple(ipaddress.ip_network(host) for host, _ in self.peer_endpoints)

    @property
    def upstream_addresses(self) -> tuple[UpstreamAddress, ...]:
        """The upstream servers, in the order given (libpq's multi-host ``host=a,b port=5432,5433``): one of them is
        the primary, which the proxy finds (proxy/servers.py)."""
        params = _parse_dsn("upstream", self.upstream)
        return _addresses("upstream", str(params.get("host") or "127.0.0.1"), str(params.get("port") or ""),
                          parse_upstream_tls(params))

    @property
    def upstream_address(self) -> UpstreamAddress:
        """The first upstream server (the only one, unless ``upstream`` lists several)."""
        return self.upstream_addresses[0]

    @property
    def standby_addresses(self) -> tuple[UpstreamAddress, ...]:
        """The hot standbys of ``standbys``: ``host:port, host:port`` or a libpq ``host=a,b port=5433,5434``; reached
        with the upstream's TLS settings (the same cluster)."""
        text = self.standbys.strip()
        if not text:
            return ()
        tls = self.upstream_addresses[0].tls
        if "=" in text:
            params = _parse_dsn("standbys", text)
            unsupported = sorted(name for name in params if name not in ("host", "port"))
            if unsupported:
                raise ConfigError(f"standbys may give only host and port, not {unsupported[0]}: TLS settings go in "
                                  "upstream, for every connection to the servers")
            return _addresses("standbys", str(params.get("host") or "127.0.0.1"), str(params.get("port") or ""), tls)
        hosts, ports = zip(*(_host_port(item.strip()) for item in text.split(",")), strict=True)
        return _addresses("standbys", ",".join(hosts), ",".join(ports), tls)

    @property
    def replicated(self) -> bool:
        """Whether the proxy works with more than one server (standbys, or several upstream hosts)."""
        return bool(self.standby_addresses) or len(self.upstream_addresses) > 1

    @property
    def service_login(self) -> ServiceLogin:
        """The service role's login, to the (first) upstream server (a host or port in the DSN is ignored)."""
        params = _parse_dsn("service_dsn", self.service_dsn)
        tls = sorted(name for name in params if name.startswith(("ssl", "gss")))
        if tls:
            raise ConfigError(f"service_dsn may not give {tls[0]}: TLS settings go in upstream, for every "
                              "connection to the server")
        missing = [key for key in ("user", "password", "dbname") if not params.get(key)]
        if missing:
            raise ConfigError(f"service_dsn must give {', '.join(missing)}")
        return ServiceLogin(self.upstream_address, str(params["user"]), str(params["password"]),
                            str(params["dbname"]))

    @property
    def service_conninfo(self) -> str:
        """The service DSN for libpq, pointed at the upstream server with the upstream's TLS settings; with several,
        libpq tries each in turn and keeps the one that accepts writes (``target_session_attrs=read-write``): the
        primary."""
        addresses = self.upstream_addresses
        hosts = {"host": ",".join(a.host for a in addresses), "port": ",".join(str(a.port) for a in addresses)}
        if len(addresses) > 1:
            hosts["target_session_attrs"] = "read-write"
        return psycopg.conninfo.make_conninfo(self.service_dsn, **hosts, **addresses[0].tls.libpq_parameters())


def _check_replica_settings(config: ProxyConfig) -> None:
    if not 0 <= config.max_standby_lag <= 1 << 40:
        raise ConfigError(f"max_standby_lag must be between 0 and {1 << 40} bytes, got {config.max_standby_lag}")
    if not 0 < config.standby_check_interval <= 3600:
        raise ConfigError(f"standby_check_interval must be more than 0 and at most 3600 seconds, "
                          f"got {config.standby_check_interval}")
    if not config.service_dsn and (config.standbys.strip() or len(config.upstream_addresses) > 1):
        raise ConfigError("standbys and an upstream of several hosts need service_dsn: the proxy finds the "
                              "primary and measures the standbys' lag with the service login")


def _host_port(item: str) -> tuple[str, str]:
    """``host:port`` (``[::1]:5433`` for IPv6), or a host alone (port 5432)."""
    host, colon, port = item.rpartition(":")
    if not colon or host.endswith(":") and not host.startswith("["):
        return item, ""
    return host.strip("[]"), port


def _addresses(setting: str, hosts: str, ports: str, tls: UpstreamTLS) -> tuple[UpstreamAddress, ...]:
    """libpq's rule: one port for every host, or one per host."""
    host_list = [host.strip() or "127.0.0.1" for host in hosts.split(",")]
    port_list = [port.strip() for port in ports.split(",")] if ports else [""]
    if len(port_list) == 1:
        port_list *= len(host_list)
    if len(port_list) != len(host_list):
        raise ConfigError(f"{setting} names {len(host_list)} hosts but {len(port_list)} ports")
    addresses = []
    for host, port in zip(host_list, port_list, strict=True):
        try:
            number = int(port or 5432)
        except ValueError as exc:
            raise ConfigError(f"{setting} port is not a number: {port!r}") from exc
        if not 1 <= number <= 65535:
            raise ConfigError(f"{setting} port must be between 1 and 65535, got {number}")
        addresses.append(UpstreamAddress(host, number, tls))
    return tuple(addresses)


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
        if name == "standbys" and isinstance(value, list):  # YAML: a list of host:port
            return ", ".join(str(item) for item in value)
        if name in ("tls_cert", "tls_key"):
            return Path(value) if value not in (None, "") else None
        if name in ("trusted_proxies", "peers"):  # a YAML list, or text separated by commas (the environment)
            items = value.split(",") if isinstance(value, str) else list(value or ())
            return tuple(str(item).strip() for item in items if str(item).strip())
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
