"""Read the policy from its tables: migrations 0002 (tables, roles), 0003 (budgets), 0011 (published relations),
0013 (statement time limits), 0017 (reference tables and their unique keys, read from the catalog each time),
0019 (the accounting of budgets), 0033 (the time bounds of date and timestamp columns), 0034 (contribution bounds);
with it, the server's time zone names (pg_timezone_names: the zones a gated statement may name).

The whole policy is read by one statement, so the version and the contents come
from the same snapshot; the policy also keeps the name of the database it was
read from (a three-part table name may be qualified with it). A database without those tables has the empty policy:
every role is direct, and PostgreSQL's own privileges decide.

Proxies LISTEN on ``POLICY_CHANNEL``; the payload of each notification is the
new policy version, sent when the transaction that changed the policy commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg

from .model import (
    DEFAULT_MAX_STATEMENT_MS,
    DEFAULT_SERVICE_ROLE,
    Budget,
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    PublishedRelation,
    ReferenceTable,
    RolePolicy,
    SharedBudget,
    SuppressionParams,
)

POLICY_CHANNEL = "anonproxy_policy"

# Looked up in pg_class rather than with to_regclass, which fails for a role
# without USAGE on the schema.
_INSTALLED_SQL = """
select exists (
    select from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where n.nspname = 'anonproxy' and c.relname = 'policy_version'
)
"""

# Rows are ordered so that dumps are stable: tables and roles by name, columns
# in the table's own order (columns since dropped last).
_POLICY_SQL = """
-- Every live column of the protected, linked and reference tables, read once for the facts below.
with governed_columns as (
    select g.table_name, g.reference, a.attnum, a.attname, b.base_type, b.base_typmod, a.attcollation, a.attnotnull
      from (select t.table_name, pg_catalog.bool_and(t.reference) as reference  -- reference: of no unit
              from (select p.table_name, false as reference from anonproxy.protected_tables p
                    union all select l.table_name, false from anonproxy.linked_tables l
                    union all select x.table_name, true from anonproxy.reference_tables x) t
             group by t.table_name) g
      join pg_catalog.pg_class r on true
      join pg_catalog.pg_namespace n on n.oid = r.relnamespace
           and pg_catalog.format('%I.%I', n.nspname, r.relname) = g.table_name
      join pg_catalog.pg_attribute a on a.attrelid = r.oid and a.attnum > 0 and not a.attisdropped
      -- The type under every domain (a domain may be over a domain), with the type modifier the last one gives.
      cross join lateral (
          with recursive chain(type, typmod, depth) as (
              select a.atttypid, a.atttypmod, 0
              union all
              select t.typbasetype, t.typtypmod, chain.depth + 1
                from chain join pg_catalog.pg_type t on t.oid = chain.type and t.typtype = 'd')
          select chain.type as base_type, chain.typmod as base_typmod
            from chain order by chain.depth desc limit 1) b
)
select pg_catalog.json_build_object(
    'version', (select v.version from anonproxy.policy_version v),
    'service_role', (select s.service_role from anonproxy.settings s),
    'tables', (select pg_catalog.json_agg(t order by t.table_name) from anonproxy.protected_tables t),
    'links', (select pg_catalog.json_agg(pg_catalog.json_build_object(
                  'table_name', l.table_name, 'link_column', l.link_column,
                  'references_table', l.references_table, 'references_column', t.unit_column)
                  order by l.table_name)
                from anonproxy.linked_tables l join anonproxy.protected_tables t on t.table_name = l.references_table),
    'columns', (select pg_catalog.json_agg(c order by c.table_name, a.attnum, c.column_name)
                  from anonproxy.column_policies c
                  left join lateral (
                      select a.attnum
                        from pg_catalog.pg_attribute a
                        join pg_catalog.pg_class r on r.oid = a.attrelid
                        join pg_catalog.pg_namespace n on n.oid = r.relnamespace
                       where pg_catalog.format('%I.%I', n.nspname, r.relname) = c.table_name
                         and a.attname = c.column_name
                  ) a on true),
    -- The SQL type of every column of the protected, linked and reference tables (under its domains), for the
    -- proof that a derived expression cannot fail (anonproxy/plan/bounds.py).
    'types', (select pg_catalog.json_agg(pg_catalog.json_build_array(c.table_name, c.attname,
                  pg_catalog.format_type(c.base_type, c.base_typmod))
                  order by c.table_name, c.attnum)
                from governed_columns c),
    -- The columns of a nondeterministic collation ('r1' = 'R1'), with its name: a reference key of another
    -- collation equated with one is compared under it, and may then meet several reference rows
    -- (anonproxy/plan/joins.py).
    'nondeterministic', (select pg_catalog.json_agg(pg_catalog.json_build_array(c.table_name, c.attname,
                             pg_catalog.format('%I.%I', cn.nspname, o.collname))
                             order by c.table_name, c.attnum)
                           from governed_columns c
                           join pg_catalog.pg_collation o on o.oid = c.attcollation and not o.collisdeterministic
                           join pg_catalog.pg_namespace cn on cn.oid = o.collnamespace),
    -- The NOT NULL columns of the protected and linked tables: dp mode counts them with the count of rows.
    'not_null', (select pg_catalog.json_agg(pg_catalog.json_build_array(c.table_name, c.attname)
                     order by c.table_name, c.attnum)
                   from governed_columns c
                  where c.attnotnull and not c.reference),
    -- The protected tables whose unit column alone is a primary key, or NOT NULL with a unique index of its own
    -- (not partial, not on an expression, under the column's collation and its type's default operator class: unique
    -- under the unit's own equality), and no child table: each row is one person, and the suppression SQL counts
    -- rows (checked again when it runs: sql/0023, 0046).
    'unique_units', (select pg_catalog.json_agg(p.table_name order by p.table_name)
                       from anonproxy.protected_tables p
                       join pg_catalog.pg_class r on not r.relhassubclass
                       join pg_catalog.pg_namespace n on n.oid = r.relnamespace
                            and pg_catalog.format('%I.%I', n.nspname, r.relname) = p.table_name
                       join pg_catalog.pg_attribute a on a.attrelid = r.oid and a.attname = p.unit_column
                            and a.attnum > 0 and not a.attisdropped and a.attnotnull
                      where exists (select from pg_catalog.pg_index i
                                     join pg_catalog.pg_opclass o on o.oid = i.indclass[0] and o.opcdefault
                                     where i.indrelid = r.oid and i.indisunique and i.indisvalid and i.indislive
                                       and i.indnkeyatts = 1 and i.indkey[0] = a.attnum
                                       and i.indpred is null and i.indexprs is null
                                       and i.indcollation[0] = a.attcollation)),
    -- The protected and linked tables whose unit (link) column leads a B-tree index of every row (not partial): the
    -- suppression SQL counts each person's rows in that order, which the index gives without hashing every person.
    'indexed_units', (select pg_catalog.json_agg(g.table_name order by g.table_name)
                        from (select p.table_name, p.unit_column as unit from anonproxy.protected_tables p
                              union select l.table_name, l.link_column from anonproxy.linked_tables l) g
                        join pg_catalog.pg_class r on true
                        join pg_catalog.pg_namespace n on n.oid = r.relnamespace
                             and pg_catalog.format('%I.%I', n.nspname, r.relname) = g.table_name
                        join pg_catalog.pg_attribute a on a.attrelid = r.oid and a.attname = g.unit
                             and a.attnum > 0 and not a.attisdropped
                       where exists (select from pg_catalog.pg_index i
                                      join pg_catalog.pg_class x on x.oid = i.indexrelid
                                      join pg_catalog.pg_am m on m.oid = x.relam and m.amname = 'btree'
                                     where i.indrelid = r.oid and i.indisvalid and i.indislive
                                       and i.indkey[0] = a.attnum and i.indpred is null)),
    'roles', (select pg_catalog.json_agg(r order by r.role_name) from anonproxy.role_policies r),
    -- Amounts as text: JSON numbers would come back as floats, and budgets are exact.
    'budgets', (select pg_catalog.json_agg(pg_catalog.json_build_object(
                    'role_name', b.role_name, 'domain', b.domain, 'epsilon', b.epsilon::text, 'delta', b.delta::text,
                    'refresh_period', b.refresh_period::text, 'epsilon_per_query', b.epsilon_per_query::text,
                    'delta_per_query', b.delta_per_query::text, 'accounting', b.accounting,
                    'max_groups_per_person', b.max_groups_per_person,
                    'max_rows_per_person_and_group', b.max_rows_per_person_and_group)
                    order by b.role_name, b.domain)
                  from anonproxy.budgets b),
    'shared_budgets', (select pg_catalog.json_agg(pg_catalog.json_build_object(
                           'domain', s.domain, 'epsilon', s.epsilon::text, 'delta', s.delta::text,
                           'refresh_period', s.refresh_period::text, 'accounting', s.accounting))
                         from anonproxy.shared_budgets s),
    -- Reference tables with their usable unique keys, as the catalog says now (no key: an empty list).
    'references', (select pg_catalog.json_agg(pg_catalog.json_build_object(
                       'table_name', x.table_name,
                       'keys', (select pg_catalog.json_agg(k.columns order by k.columns)
                                  from anonproxy.reference_keys k where k.table_name = x.table_name))
                       order by x.table_name)
                     from anonproxy.reference_tables x),
    'published', (select pg_catalog.json_agg(p order by p.relation_name) from anonproxy.published_relations p),
    -- In whole milliseconds, as statement_timeout takes them (rounded up: never shorter than declared).
    'statement_limits', (select pg_catalog.json_object_agg(l.mode, pg_catalog.ceil(
                             pg_catalog.date_part('epoch', l.max_statement_time) * 1000)::bigint)
                           from anonproxy.statement_limits l)
)
"""

_SERVICE_ROLE_SQL = "select s.service_role from anonproxy.settings s"

# The zones PostgreSQL finds by name, from its own tz database (not the proxy host's: they may differ).
_ZONES_SQL = "select z.name from pg_catalog.pg_timezone_names z"


def load_policy(conn: psycopg.Connection[Any]) -> Policy:
    """The policy in force; ``Policy()`` if the policy tables are not installed."""
    with conn.transaction(), conn.cursor() as cur:
        if not _scalar(cur.execute(_INSTALLED_SQL).fetchone()):
            return Policy()
        policy = policy_from_json(_scalar(cur.execute(_POLICY_SQL).fetchone()))
        zones = _zones(row[0] for row in cur.execute(_ZONES_SQL).fetchall())
        return replace(policy, database=conn.info.dbname, zones=zones)


async def load_policy_async(conn: psycopg.AsyncConnection[Any]) -> Policy:
    """``load_policy`` for an asyncio connection."""
    async with conn.transaction(), conn.cursor() as cur:
        if not _scalar(await (await cur.execute(_INSTALLED_SQL)).fetchone()):
            return Policy()
        policy = policy_from_json(_scalar(await (await cur.execute(_POLICY_SQL)).fetchone()))
        zones = _zones(row[0] for row in await (await cur.execute(_ZONES_SQL)).fetchall())
        return replace(policy, database=conn.info.dbname, zones=zones)


def service_role(conn: psycopg.Connection[Any]) -> str:
    """The role the proxy's service connection should log in as."""
    with conn.transaction(), conn.cursor() as cur:
        if not _scalar(cur.execute(_INSTALLED_SQL).fetchone()):
            return DEFAULT_SERVICE_ROLE
        return str(_scalar(cur.execute(_SERVICE_ROLE_SQL).fetchone()))


def policy_from_json(doc: dict[str, Any]) -> Policy:
    """Build the model from the document ``_POLICY_SQL`` returns (rows as JSON objects)."""
    types: dict[str, dict[str, str]] = {}
    for table_name, column_name, type_name in doc.get("types") or ():
        types.setdefault(table_name, {})[column_name] = type_name
    nondeterministic: dict[str, dict[str, str]] = {}
    for table_name, column_name, collation in doc.get("nondeterministic") or ():
        nondeterministic.setdefault(table_name, {})[column_name] = collation
    columns: dict[str, dict[str, ColumnPolicy]] = {}
    for row in doc["columns"] or ():
        aware = types.get(row["table_name"], {}).get(row["column_name"]) == "timestamp with time zone"
        columns.setdefault(row["table_name"], {})[row["column_name"]] = ColumnPolicy(
            name=row["column_name"],
            kind=row["kind"],
            lower=_float(row["lower_bound"]),
            upper=_float(row["upper_bound"]),
            domain=None if row["domain"] is None else tuple(row["domain"]),
            earliest=_time(row.get("earliest"), aware),
            latest=_time(row.get("latest"), aware),
        )
    not_null: dict[str, set[str]] = {}
    for table_name, column_name in doc.get("not_null") or ():
        not_null.setdefault(table_name, set()).add(column_name)
    unique_units = set(doc.get("unique_units") or ())
    indexed_units = set(doc.get("indexed_units") or ())
    shared = {
        row["domain"]: SharedBudget(Decimal(row["epsilon"]), Decimal(row["delta"]), row["refresh_period"],
                                    row["accounting"])
        for row in doc["shared_budgets"] or ()
    }
    tables = {
        row["table_name"]: ProtectedTable(row["table_name"], row["unit_column"], columns.get(row["table_name"], {}),
                                          shared.get(row["table_name"]), types.get(row["table_name"], {}),
                                          frozenset(not_null.get(row["table_name"], ())),
                                          row["table_name"] in unique_units, row["table_name"] in indexed_units,
                                          nondeterministic.get(row["table_name"], {}))
        for row in doc["tables"] or ()
    }
    budgets: dict[str, dict[str, Budget]] = {}
    for row in doc["budgets"] or ():
        budgets.setdefault(row["role_name"], {})[row["domain"]] = Budget(
            epsilon=Decimal(row["epsilon"]),
            delta=Decimal(row["delta"]),
            refresh_period=row["refresh_period"],
            epsilon_per_query=_decimal(row["epsilon_per_query"]),
            delta_per_query=_decimal(row["delta_per_query"]),
            accounting=row["accounting"],
            max_groups_per_person=row["max_groups_per_person"],
            max_rows_per_person_and_group=row["max_rows_per_person_and_group"],
        )
    links = {
        row["table_name"]: LinkedTable(
            name=row["table_name"],
            column=row["link_column"],
            references=row["references_table"],
            references_column=row["references_column"],
            columns=columns.get(row["table_name"], {}),
            types=types.get(row["table_name"], {}),
            not_null=frozenset(not_null.get(row["table_name"], ())),
            indexed_unit=row["table_name"] in indexed_units,
            nondeterministic=nondeterministic.get(row["table_name"], {}),
        )
        for row in doc["links"] or ()
    }
    roles = {
        row["role_name"]: RolePolicy(
            role=row["role_name"],
            mode=row["mode"],
            suppression=SuppressionParams(
                k=row["k"],
                dominance_n=row["dominance_n"],
                dominance_percent=_float(row["dominance_percent"]),
                p_percent=_float(row["p_percent"]),
                suppressed_rest=row["suppressed_rest"],
                allow_min_max=row["allow_min_max"],
            ),
            budgets=budgets.get(row["role_name"], {}),
        )
        for row in doc["roles"] or ()
    }
    published = {
        row["relation_name"]: PublishedRelation(row["relation_name"], tuple(row["roles"]))
        for row in doc["published"] or ()
    }
    references = {
        row["table_name"]: ReferenceTable(row["table_name"], tuple(tuple(key) for key in row["keys"] or ()),
                                          types.get(row["table_name"], {}),
                                          nondeterministic.get(row["table_name"], {}))
        for row in doc.get("references") or ()
    }
    return Policy(version=doc["version"], tables=tables, links=links, roles=roles, service_role=doc["service_role"],
                  published=published, references=references, max_statement_ms=_statement_limits(doc.get("statement_limits") or {}))


def _statement_limits(limits: dict[str, int]) -> dict[str, int]:
    """The modes whose maximum statement time is not the default (the model keeps only those)."""
    return {mode: int(ms) for mode, ms in limits.items() if ms != DEFAULT_MAX_STATEMENT_MS}


def _zones(names: Iterable[str]) -> frozenset[str]:
    """The server's zone names as PostgreSQL matches them, ASCII letters lowered (anonproxy.plan.time_values.folded);
    a name with other letters (none in the tz database) is left out: refused, never matched by a Python folding."""
    return frozenset(name.lower() for name in names if name.isascii())


def _scalar(row: tuple[Any, ...] | None) -> Any:
    assert row is not None
    return row[0]


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _time(value: str | None, aware: bool) -> datetime | None:
    """A stored time bound (a timestamp's JSON text); aware, in UTC, for a timestamptz column."""
    if value is None:
        return None
    moment = datetime.fromisoformat(value)
    return moment.replace(tzinfo=UTC) if aware else moment


def _decimal(value: str | None) -> Decimal | None:
    return None if value is None else Decimal(value)
