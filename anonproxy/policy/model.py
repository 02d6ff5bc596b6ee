"""The privacy policy as the proxy sees it: immutable values, loaded from the database.

The tables of the ``anonproxy`` schema are the source of truth (see
sql/0002_policy.sql); this module only describes what was read from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Literal

from anonproxy.policy.zcdp import Accounting, default_accounting

Mode = Literal["direct", "suppress", "dp", "deny"]
ColumnKind = Literal["identifier", "quasi_identifier", "sensitive", "public"]

MODES: tuple[Mode, ...] = ("direct", "suppress", "dp", "deny")
COLUMN_KINDS: tuple[ColumnKind, ...] = ("identifier", "quasi_identifier", "sensitive", "public")
DEFAULT_SERVICE_ROLE = "anonproxy_service"
# Modes whose statements the proxy runs (rewritten, or for a noisy answer), and so bounds in time.
TIMED_MODES: tuple[Mode, ...] = ("suppress", "dp")
DEFAULT_MAX_STATEMENT_MS = 30_000


DEFAULT_SCHEMA = "public"  # where a policy name without a schema lives


def split_policy_name(name: str) -> tuple[str, str]:
    """(schema, table) of a policy name, ``schema.table`` or a bare table in the default schema."""
    schema, dot, table = name.partition(".")
    return (schema, table) if dot else (DEFAULT_SCHEMA, schema)


@dataclass(frozen=True)
class ColumnPolicy:
    name: str
    kind: ColumnKind = "public"
    lower: float | None = None  # declared bounds of a numeric column
    upper: float | None = None
    domain: tuple[str, ...] | None = None  # public values of a grouping column, as text
    # declared bounds of a date, timestamp or timestamptz column, inclusive: aware (UTC) for timestamptz, naive
    # otherwise (a date column's bounds are midnights)
    earliest: datetime | None = None
    latest: datetime | None = None


@dataclass(frozen=True)
class SharedBudget:
    """A cap on what all roles together may spend on a protected table (sql/0003_ledger.sql)."""

    epsilon: Decimal
    delta: Decimal = Decimal(0)
    refresh_period: str | None = None  # a PostgreSQL interval ("7 days"); None: spending never comes back
    accounting: Accounting | None = None  # basic or zcdp (sql/0019); None given: the default rule, as the database's

    def __post_init__(self) -> None:
        if self.accounting is None:
            object.__setattr__(self, "accounting", default_accounting(self.epsilon, self.delta))


@dataclass(frozen=True)
class ProtectedTable:
    """A table whose rows belong to people; ``unit_column`` identifies the person."""

    name: str  # schema-qualified, lower case: "public.adult"
    unit_column: str
    columns: dict[str, ColumnPolicy] = field(default_factory=dict)
    shared_budget: SharedBudget | None = None
    # Every column's SQL type as PostgreSQL's format_type() writes it ("integer", "numeric(10,2)"), read with
    # the policy; None when not read (a policy built in memory). The no-error proof of derived expressions needs it.
    types: dict[str, str] | None = field(default=None, compare=False)
    # The columns declared NOT NULL in the catalog (pg_attribute.attnotnull), read with the policy like ``types``;
    # None when not read. dp mode counts such a column with the statistic that counts rows (docs/dp.md).
    not_null: frozenset[str] | None = field(default=None, compare=False)
    # Whether the catalog makes ``unit_column`` unique and not null (a primary key, or NOT NULL and a unique index
    # of that column alone), read with the policy: then each row is one person. False when not read.
    unique_unit: bool = field(default=False, compare=False)
    # Whether a B-tree index of the whole table (not partial) leads with ``unit_column``, read with the policy: the
    # suppression SQL then counts each person's rows in that column's order. False when not read.
    indexed_unit: bool = field(default=False, compare=False)
    # The columns of a nondeterministic collation, each with that collation's name, read with the policy (None when
    # not read): a reference key equated with such a column is compared under it (anonproxy.plan.joins).
    nondeterministic: dict[str, str] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LinkedTable:
    """A table that reaches a protected table's unit through a declared key."""

    name: str  # "public.visits"
    column: str  # "person_id"
    references: str  # "public.people" (a protected table)
    references_column: str  # its unit column, "id"
    columns: dict[str, ColumnPolicy] = field(default_factory=dict)
    types: dict[str, str] | None = field(default=None, compare=False)  # as ProtectedTable.types
    not_null: frozenset[str] | None = field(default=None, compare=False)  # as ProtectedTable.not_null
    indexed_unit: bool = field(default=False, compare=False)  # as ProtectedTable.indexed_unit, of ``column``
    nondeterministic: dict[str, str] | None = field(default=None, compare=False)  # as ProtectedTable's


@dataclass(frozen=True)
class ReferenceTable:
    """A public table (no personal data: regions, calendars) that queries over protected tables may join many-to-one.

    ``keys`` are its usable unique keys, read from the catalog with the policy (sql/0017_reference_tables.sql): a
    join must equate every column of one of them. A declared table whose keys were dropped has none, and every join
    to it is refused."""

    name: str  # "public.regions"
    keys: tuple[tuple[str, ...], ...] = ()
    types: dict[str, str] | None = field(default=None, compare=False)  # as ProtectedTable.types
    nondeterministic: dict[str, str] | None = field(default=None, compare=False)  # as ProtectedTable's


@dataclass(frozen=True)
class SuppressionParams:
    k: int = 10  # minimum distinct privacy units per released group
    dominance_n: int | None = None  # (n, k%) dominance rule on SUMs, off when None
    dominance_percent: float | None = None
    p_percent: float | None = None  # p % rule on SUMs, off when None
    suppressed_rest: bool = False  # add one row reporting what was withheld
    allow_min_max: bool = False


MAX_CONTRIBUTION_BOUND = 1000  # the largest declared contribution bound (sql/0034)


@dataclass(frozen=True)
class Budget:
    """What a role in mode dp may spend on one protected table (its privacy-unit domain)."""

    epsilon: Decimal  # in all (per refresh period, if there is one)
    delta: Decimal = Decimal(0)
    refresh_period: str | None = None  # a PostgreSQL interval ("1 day"); None: spending never comes back
    epsilon_per_query: Decimal | None = None  # the default cost of one query; None: the proxy's default
    delta_per_query: Decimal | None = None
    accounting: Accounting | None = None  # basic or zcdp (sql/0019); None given: the default rule, as the database's
    # What one person may contribute to a dp answer (sql/0034): at most this many groups, this many rows in each.
    max_groups_per_person: int = 1
    max_rows_per_person_and_group: int = 1

    def __post_init__(self) -> None:
        if self.accounting is None:
            object.__setattr__(self, "accounting",
                               default_accounting(self.epsilon, self.delta, self.epsilon_per_query))


@dataclass(frozen=True)
class RolePolicy:
    role: str
    mode: Mode = "direct"
    suppression: SuppressionParams = field(default_factory=SuppressionParams)
    budgets: dict[str, Budget] = field(default_factory=dict)  # by protected table


@dataclass(frozen=True)
class PublishedRelation:
    """An already anonymized relation (a release) that the listed suppress and dp roles read row by row."""

    name: str  # "public.adult_k10"
    roles: tuple[str, ...]


@dataclass(frozen=True)
class Policy:
    version: int = 0
    tables: dict[str, ProtectedTable] = field(default_factory=dict)
    links: dict[str, LinkedTable] = field(default_factory=dict)
    roles: dict[str, RolePolicy] = field(default_factory=dict)
    service_role: str = DEFAULT_SERVICE_ROLE  # the role of the proxy's service connection
    published: dict[str, PublishedRelation] = field(default_factory=dict)
    references: dict[str, ReferenceTable] = field(default_factory=dict)  # declared reference tables
    # The longest a statement of a role in this mode may run, in ms (a client's statement_timeout may be shorter).
    max_statement_ms: dict[str, int] = field(default_factory=dict)  # by mode in TIMED_MODES, only if not the default
    # The database the policy was read from, which gated roles are connected to (None: not read from a database):
    # a table name qualified with it ("postgres"."public"."adult") names a table of this database. Where the policy
    # was read from, not what it says: left out of comparisons.
    database: str | None = field(default=None, compare=False)
    # The time zone names the server's tz database holds (pg_timezone_names), folded to lower case, read with the
    # policy: the only zones the no-error proof accepts (anonproxy.plan.time_values.known_zone). None when not read
    # (a policy built in memory): then UTC and GMT only. A fact about the server, not the policy: not compared.
    zones: frozenset[str] | None = field(default=None, compare=False)

    def role(self, name: str) -> RolePolicy:
        """A role's policy; roles the policy does not name are direct (PostgreSQL's grants decide)."""
        return self.roles.get(name) or RolePolicy(name)

    def statement_limit(self, mode: str) -> int:
        """The maximum statement time, in ms, of a role in ``mode``."""
        return self.max_statement_ms.get(mode, DEFAULT_MAX_STATEMENT_MS)

    def is_protected(self, table: str) -> bool:
        return table in self.tables or table in self.links
