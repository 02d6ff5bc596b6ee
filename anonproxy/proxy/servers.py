"""Which PostgreSQL server each of a worker's connections goes to: the primary, or a standby in rotation.

Used when the proxy works with more than one server (docs/replicas.md): ``upstream`` lists several hosts
(libpq's ``host=a,b port=5432,5433``), or ``standbys`` names hot standbys. One instance per worker.

- The primary: the first of upstream's hosts that is not in recovery, found with the service login and cached.
  Client sessions (direct and gated), the ledger, the audit trail and the policy watcher connect to it. It is
  probed again every ``standby_check_interval`` seconds, and at once when a connection to it fails
  (:meth:`Servers.failed`, :meth:`Servers.find_primary`).
- The standbys: suppress rewrites (the service pool) and dp measurements run on the one with the least lag
  (:meth:`Servers.reader`; ties: the first listed). Lag is bytes of WAL: the primary's ``pg_current_wal_lsn()``
  less the standby's ``pg_last_wal_replay_lsn()``, both read by each probe. A standby more than
  ``max_standby_lag`` bytes behind, unreachable, or no longer in recovery is out of rotation until a probe finds it
  caught up; a connection to it that fails takes it out at once. With no standby in rotation, reads go to the
  primary. A standby whose tz database lists other zone names than the primary's (pg_timezone_names: the proof
  admits the zones the policy read on the primary, and a zone a standby lacks would fail there row by row) is kept
  out too; each server's list is read once per probe connection.
- The ledger's durability: each probe of the primary reads ``synchronous_standby_names``. ``anonproxy.charge()``
  commits with ``synchronous_commit`` at least ``on`` whatever the server's default (sql/0003), so with a name
  there every charge is on a standby before it returns. Without one (asynchronous replication), :meth:`Servers.dp_refusal` refuses dp logins unless
  ``accept_async_ledger`` is on: a promoted standby could have lost the last charges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.conninfo
from psycopg.rows import dict_row

from ..config import ProxyConfig, UpstreamAddress

log = logging.getLogger("anonproxy.servers")

PROBE_TIMEOUT = 3.0  # seconds a probe may take to connect to one server and answer

_PRIMARY_SQL = ("select pg_catalog.pg_is_in_recovery() as recovery, case when not pg_catalog.pg_is_in_recovery() "
                "then pg_catalog.pg_current_wal_lsn() - '0/0' end as lsn, "
                "pg_catalog.current_setting('synchronous_standby_names') <> '' as synchronous")
# A digest of the server's time zone names (they are files of its host's tz database, not replicated).
_ZONES_SQL = ("select pg_catalog.md5(coalesce(pg_catalog.string_agg(z.name, ',' order by z.name collate \"C\"), ''))"
              " as zones from pg_catalog.pg_timezone_names z")
_STANDBY_SQL = ("select pg_catalog.pg_is_in_recovery() as recovery, "
                "pg_catalog.pg_last_wal_replay_lsn() - '0/0' as lsn")


@dataclass
class Standby:
    address: UpstreamAddress
    lag: int | None = None  # bytes of WAL behind the primary at the last probe; None: unreachable, or promoted
    in_rotation: bool = False
    other_zones: bool = False  # its tz database differs from the primary's (said once, not at every probe)


class Servers:
    def __init__(self, config: ProxyConfig) -> None:
        self._upstream = config.upstream_addresses
        self._standbys = [Standby(address) for address in config.standby_addresses]
        self._dsn = config.service_dsn
        self._max_lag = config.max_standby_lag
        self._interval = config.standby_check_interval
        self._accept_async = config.accept_async_ledger
        self.primary: UpstreamAddress = self._upstream[0]
        self.synchronous: bool | None = None  # the primary's synchronous_standby_names is set (None: not known yet)
        self._without_primary = False  # the last probe found no primary (said once, not at every probe)
        self._conns: dict[UpstreamAddress, psycopg.AsyncConnection[Any]] = {}
        self._zones: dict[UpstreamAddress, str | None] = {}  # _ZONES_SQL's digest, per probe connection
        self._probing: asyncio.Task[None] | None = None
        self._loop: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- what connections ask ------------------------------------------------------------

    def reader(self) -> UpstreamAddress:
        """Where a read-only statement goes: the standby in rotation with the least lag, else the primary."""
        standby = self.standby()
        return standby if standby is not None else self.primary

    def standby(self) -> UpstreamAddress | None:
        """The standby in rotation with the least lag (None: none is)."""
        serving = [s for s in self._standbys if s.in_rotation and s.address != self.primary]
        if not serving:
            return None
        return min(serving, key=lambda s: s.lag or 0).address

    def serves(self, address: UpstreamAddress) -> bool:
        """Whether a connection to ``address`` may still be used for reads: the primary or a standby in rotation."""
        return address == self.primary or any(s.address == address and s.in_rotation for s in self._standbys)

    def failed(self, address: UpstreamAddress) -> None:
        """A connection to ``address`` failed: a standby leaves the rotation (a probe brings it back); for the
        primary, a probe runs now."""
        for standby in self._standbys:
            if standby.address == address and standby.in_rotation:
                log.warning("standby %s is out of rotation: a connection to it failed", address)
                standby.in_rotation = False
        if address == self.primary:
            self._wake.set()

    async def find_primary(self) -> UpstreamAddress:
        """Probe now (one probe at a time per worker) and return the primary found."""
        await self._probe_once()
        return self.primary

    def dp_refusal(self) -> tuple[str, str, str] | None:
        """Why dp roles may not log in now (SQLSTATE, message, hint), or None."""
        if self._accept_async or self.synchronous:
            return None
        if self.synchronous is None:
            return ("57P03", "anonproxy has not yet learned whether the privacy ledger's commits wait for a standby",
                    "Try again shortly; the proxy cannot reach the primary server now.")
        message = (f"the privacy ledger's primary {self.primary} replicates asynchronously: a fail-over could lose "
                   "acknowledged charges, so roles in dp mode may not log in")
        hint = ("Set synchronous_standby_names on the primary (docs/replicas.md), or accept the risk with the "
                "proxy's accept_async_ledger setting.")
        return ("55000", message, hint)

    # -- probing ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._probe_once()
        self._loop = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        for conn in self._conns.values():
            with contextlib.suppress(psycopg.Error):
                await conn.close()
        self._conns.clear()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            try:
                await self._probe_once()
            except Exception:  # a probe must never end the loop
                log.exception("probing the servers failed")

    async def _probe_once(self) -> None:
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe())
        await asyncio.shield(self._probing)

    async def _probe(self) -> None:
        lsn = await self._probe_primary()
        for standby in self._standbys:
            await self._probe_standby(standby, lsn)

    async def _probe_primary(self) -> int | None:
        """Find the primary (the cached one first); its WAL position, or None when no server is primary now."""
        candidates = [self.primary, *(a for a in self._upstream if a != self.primary)]
        for address in candidates:
            row = await self._ask(address, _PRIMARY_SQL)
            if row is None or row["recovery"]:
                continue
            if address != self.primary:
                log.warning("the primary is now %s (was %s)", address, self.primary)
                self.primary = address
            if row["synchronous"] != self.synchronous:
                log.log(logging.INFO if row["synchronous"] else logging.WARNING,
                        "the primary %s replicates %s", address,
                        "synchronously" if row["synchronous"] else "asynchronously (synchronous_standby_names is "
                        "empty)")
                self.synchronous = row["synchronous"]
            self._without_primary = False
            return int(row["lsn"])
        if not self._without_primary:
            log.warning("no upstream server accepts writes now (tried %s)", ", ".join(map(str, candidates)))
        self._without_primary = True
        return None

    async def _probe_standby(self, standby: Standby, primary_lsn: int | None) -> None:
        row = await self._ask(standby.address, _STANDBY_SQL)
        if row is None or not row["recovery"] or row["lsn"] is None:
            standby.lag = None
        elif primary_lsn is not None:
            standby.lag = max(0, primary_lsn - int(row["lsn"]))
        serving = standby.lag is not None and standby.lag <= self._max_lag and await self._same_zones(standby)
        if serving != standby.in_rotation:
            log.warning("standby %s is %s rotation (lag %s, max_standby_lag %d bytes)", standby.address,
                        "in" if serving else "out of", "unknown" if standby.lag is None else f"{standby.lag} bytes",
                        self._max_lag)
            standby.in_rotation = serving

    async def _same_zones(self, standby: Standby) -> bool:
        """Whether ``standby`` knows the same time zone names as the primary (unknown: no)."""
        for address in (standby.address, self.primary):
            if address not in self._zones:
                row = await self._ask(address, _ZONES_SQL)
                if address in self._conns:  # read again when the probe connects anew; the last digest kept meanwhile
                    self._zones[address] = None if row is None else row["zones"]
        digest = self._zones.get(standby.address)
        same = digest is not None and digest == self._zones.get(self.primary)
        if not same and not standby.other_zones:
            log.warning("standby %s is kept out of rotation: its time zone names (pg_timezone_names) are not the "
                        "primary's, and a zone it lacks would fail only for the rows that reach it", standby.address)
        standby.other_zones = not same
        return same

    async def _ask(self, address: UpstreamAddress, sql: str) -> dict[str, Any] | None:
        """One row of ``sql`` on ``address`` over the probe's own connection; None if it cannot be reached."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                conn = self._conns.get(address)
                if conn is None or conn.closed or conn.broken:
                    conn = await psycopg.AsyncConnection.connect(
                        self._conninfo(address), autocommit=True, row_factory=dict_row)
                    self._conns[address] = conn
                    self._zones.pop(address, None)  # read again on the new connection
                return await (await conn.execute(sql)).fetchone()
        except (psycopg.Error, OSError, TimeoutError) as exc:
            log.debug("probe of %s failed: %s", address, str(exc).strip())
            stale = self._conns.pop(address, None)
            if stale is not None:
                with contextlib.suppress(psycopg.Error):
                    await stale.close()
            return None

    def _conninfo(self, address: UpstreamAddress) -> str:
        return conninfo_at(self._dsn, address, application_name="anonproxy probe")


def conninfo_at(dsn: str, address: UpstreamAddress, **more: Any) -> str:
    """``dsn`` pointed at the one server ``address``, whatever its hosts said, with the address's TLS settings."""
    return psycopg.conninfo.make_conninfo(dsn, host=address.host, port=address.port, target_session_attrs="any",
                                          connect_timeout=int(PROBE_TIMEOUT), **address.tls.libpq_parameters(), **more)
