"""The corpus's dated table, ``public.visits``: one to five visits per person of ``public.adult`` over 2025–2026.

The demo has no dated table yet (issue 19 item 1 adds one), so the corpus
defines its own for the time-series statements: ``visits (visit_id bigint
primary key, person_id integer not null references adult(id), visited_at
timestamptz not null, channel text not null, amount numeric(10,2) not null)``,
filled from a fixed seed (the same rows on every run) and declared a linked
table of ``adult`` on ``person_id``, with the column policies a real policy
would give it. Both the benchmark and the test create it as the database
owner on the gated database and drop it afterwards.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg

TABLE = "public.visits"
SEED = 19
FIRST = datetime(2025, 1, 1, tzinfo=UTC)
SECONDS = int((datetime(2027, 1, 1, tzinfo=UTC) - FIRST).total_seconds())  # up to 2026-12-31 23:59:59
CHANNELS = ("web", "app", "store", "phone")
AMOUNT_CENTS = (500, 50_000)  # 5.00 to 500.00
# kind, lower, upper, domain — visited_at has no bounds: bounds on a time column are issue 19 item 1.
COLUMNS: dict[str, tuple[str, int | None, int | None, list[str] | None]] = {
    "visit_id": ("identifier", None, None, None),
    "person_id": ("identifier", None, None, None),
    "visited_at": ("quasi_identifier", None, None, None),
    "channel": ("quasi_identifier", None, None, list(CHANNELS)),
    "amount": ("sensitive", 0, 500, None),
}


def rows(person_ids: list[int]) -> list[tuple[int, int, datetime, str, Decimal]]:
    """The visits of ``person_ids``, the same for the same ids: one to five each, uniform over the two years."""
    rng = random.Random(SEED)
    visits: list[tuple[int, int, datetime, str, Decimal]] = []
    for person in person_ids:
        for _ in range(rng.randint(1, 5)):
            visited_at = FIRST + timedelta(seconds=rng.randrange(SECONDS))
            amount = Decimal(rng.randint(*AMOUNT_CENTS)) / 100
            visits.append((len(visits) + 1, person, visited_at, rng.choice(CHANNELS), amount))
    return visits


def create(owner: psycopg.Connection[Any]) -> int:
    """Create, fill and link ``public.visits`` (``owner``: a superuser connection, autocommit); the policy version
    that declares it."""
    with owner.transaction():
        owner.execute("create table public.visits (visit_id bigint primary key, "
                      "person_id integer not null references public.adult (id), visited_at timestamptz not null, "
                      "channel text not null, amount numeric(10,2) not null)")
        people = [row[0] for row in owner.execute("select id from public.adult order by id")]
        with owner.cursor().copy("copy public.visits (visit_id, person_id, visited_at, channel, amount) "
                                 "from stdin") as copy:
            for row in rows(people):
                copy.write_row(row)
        owner.execute("analyze public.visits")
        owner.execute("select anonproxy.link_table(%s::regclass, 'person_id', 'public.adult'::regclass)", [TABLE])
        for column, (kind, lower, upper, domain) in COLUMNS.items():
            owner.execute("select anonproxy.set_column(%s::regclass, %s::name, %s::text, %s::numeric, %s::numeric, "
                          "%s::text[])", [TABLE, column, kind, lower, upper, domain])
    version = owner.execute("select version from anonproxy.policy_version").fetchone()
    assert version is not None, "anonproxy is installed in this database"
    return int(version[0])


def drop(owner: psycopg.Connection[Any]) -> None:
    """Undo ``create``."""
    with owner.transaction():
        owner.execute("select anonproxy.unlink_table(%s)", [TABLE])
        owner.execute("drop table public.visits")
