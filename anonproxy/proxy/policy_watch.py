"""Each worker's copy of the policy: loaded at start, reloaded on NOTIFY.

The watcher keeps one connection (as the service role) listening on the
policy channel; every committed policy change notifies it and it reloads
(and it reloads every RELOAD_INTERVAL seconds anyway). If the connection
drops it reconnects and reloads, keeping the last policy it read meanwhile.
Before each load it checks that the service login has no powers beyond its
grants (anonproxy.proxy.service_role), and that the database has every
migration this version ships (anonproxy.schema); if either fails, the policy
is dropped and every login is refused until that is fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg

from .. import schema
from ..policy.lint import link_warnings
from ..policy.model import Policy
from ..policy.store import POLICY_CHANNEL, load_policy_async
from .service_role import HINT, excess_privileges_async

log = logging.getLogger("anonproxy.policy")

RETRY_DELAY = 2.0
# Reload at least this often, in case a notification slipped by during a reload.
RELOAD_INTERVAL = 10.0


class ServiceLoginRefused(Exception):
    """The service login is a superuser or a member of a role that widens what it reads, or the database lacks
    migrations this version ships; the message says which, and what to do."""


class PolicyWatcher:
    def __init__(self, dsn: str, on_change: Callable[[Policy], None] = lambda policy: None) -> None:
        self._dsn = dsn
        self._on_change = on_change
        self.policy = Policy()
        self._task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()
        self._refused: str | None = None  # the last reason the service login was refused, logged once

    async def start(self, timeout: float = 10.0) -> None:
        """Start watching; wait (up to ``timeout``) for the first load."""
        self._task = asyncio.create_task(self._watch())
        try:
            await asyncio.wait_for(self._loaded.wait(), timeout)
        except TimeoutError:
            log.error("the policy could not be loaded yet; anonymized roles are refused until it is")

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {POLICY_CHANNEL}")
                    while True:
                        await self._reload(conn)
                        # The connection cannot run a query while notifies() iterates: wait, then reload.
                        async for _ in conn.notifies(timeout=RELOAD_INTERVAL, stop_after=1):
                            pass
            except psycopg.Error as exc:
                log.warning("policy connection failed (%s); retrying in %.0f s", str(exc).strip(), RETRY_DELAY)
            except ServiceLoginRefused as exc:
                self._loaded.clear()  # fail closed: every login is refused until the service login is fixed
                if str(exc) != self._refused:
                    log.error("%s", exc)
                self._refused = str(exc)
            await asyncio.sleep(RETRY_DELAY)

    async def _reload(self, conn: psycopg.AsyncConnection) -> None:
        problem = await excess_privileges_async(conn)
        if problem is not None:
            raise ServiceLoginRefused(f"{problem}: anonproxy refuses every login until it is not. {HINT}")
        missing = await schema.missing_versions_async(conn)
        if missing:
            raise ServiceLoginRefused(f"{schema.outdated_message(missing, conn.info.dbname)}: anonproxy refuses every "
                                     "login until they are installed")
        self._refused = None
        policy = await load_policy_async(conn)
        if policy.version != self.policy.version or not self.loaded:
            log.info("policy version %d loaded (%d protected tables, %d roles)",
                     policy.version, len(policy.tables), len(policy.roles))
            for warning in link_warnings(policy):
                log.warning("%s", warning)
        changed = policy.version != self.policy.version
        self.policy = policy
        self._loaded.set()
        if changed:
            self._on_change(policy)
