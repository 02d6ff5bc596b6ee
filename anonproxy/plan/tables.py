"""Table names as PostgreSQL resolves them, matched against the policy.

Unquoted identifiers fold to lower case (ASCII letters only, like PostgreSQL
in a multi-byte encoding), quoted ones keep their case, and both are cut to
63 bytes. Policy names are ``schema.table``.

Names the policy does not know are resolved only to name them in refusals, as
the default search path would: ``pg_catalog`` first (it holds every ``pg_*``
system relation and is searched before the path), then ``public``.

An unqualified name is treated as protected when *any* schema holds a
protected or linked table of that name: the classifier does not know the
client's ``search_path``, so ``SET search_path`` cannot hide a protected table
from it. In rewritten SQL every table is schema-qualified: an unqualified name
becomes ``public.<name>``, or the one other schema where a protected table of
that name lives. Declared reference tables (public dimension tables) resolve
the same way, after protected and linked names; they never make a statement
gated by themselves (``is_protected_name``, ``touches_protected``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from sqlglot import exp

from anonproxy.plan.refusals import unsupported
from anonproxy.policy.model import (
    DEFAULT_SCHEMA,
    LinkedTable,
    Policy,
    ProtectedTable,
    ReferenceTable,
    split_policy_name,
)

NAMEDATALEN = 64
CATALOG_SCHEMA = "pg_catalog"

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def fold(name: str, quoted: bool) -> str:
    """An identifier as PostgreSQL stores it."""
    folded = name if quoted else name.translate(_ASCII_LOWER)
    encoded = folded.encode("utf-8")
    if len(encoded) >= NAMEDATALEN:
        folded = encoded[: NAMEDATALEN - 1].decode("utf-8", errors="ignore")
    return folded


def identifier(node: exp.Identifier | None) -> str | None:
    if node is None:
        return None
    return fold(node.this, bool(node.args.get("quoted")))


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


Kind = Literal["protected", "linked", "reference", "plain"]


@dataclass(frozen=True)
class ResolvedTable:
    schema: str
    name: str
    kind: Kind
    protected: ProtectedTable | None = None
    linked: LinkedTable | None = None
    reference: ReferenceTable | None = None
    columns: frozenset[str] | None = None  # a relation the proxy builds (the released rows): its columns

    @property
    def qualified(self) -> str:
        return f"{quote(self.schema)}.{quote(self.name)}"

    @property
    def policy_name(self) -> str:
        return f"{self.schema}.{self.name}"


class PolicyIndex:
    """The protected, linked and reference tables of a policy, by (schema, table) and by bare table name."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.protected = {split_policy_name(name): table for name, table in policy.tables.items()}
        self.linked = {split_policy_name(name): link for name, link in policy.links.items()}
        self.references = {split_policy_name(name): table for name, table in policy.references.items()}
        self.bare: dict[str, list[tuple[str, str]]] = {}
        for key in [*self.protected, *self.linked]:
            self.bare.setdefault(key[1], []).append(key)
        self.bare_references: dict[str, list[tuple[str, str]]] = {}
        for key in self.references:
            self.bare_references.setdefault(key[1], []).append(key)

    def is_protected_name(self, bare: str) -> bool:
        return bare in self.bare

    def resolve(self, table: exp.Table) -> ResolvedTable:
        name = identifier(table.this if isinstance(table.this, exp.Identifier) else None)
        if name is None:
            raise unsupported("a table expression that is not a plain table name")
        schema = identifier(table.args.get("db"))
        if schema is None:
            candidates = self.bare.get(name) or self.bare_references.get(name, [])
            if not candidates:
                schema = CATALOG_SCHEMA if name.startswith("pg_") else DEFAULT_SCHEMA
            elif (DEFAULT_SCHEMA, name) in candidates:
                schema = DEFAULT_SCHEMA
            elif len(candidates) == 1:
                schema = candidates[0][0]
            else:
                raise unsupported(
                    f"table name {name!r} is ambiguous: tables of that name in several schemas are part of the "
                    "privacy policy",
                    "Qualify the table name with its schema.",
                )
        resolved = self._entry(schema, name)
        if resolved.linked is not None:
            _check_key(resolved.linked, self.lookup(resolved.linked.references).protected)
        return resolved

    def _entry(self, schema: str, name: str) -> ResolvedTable:
        key = (schema, name)
        if key in self.protected:
            return ResolvedTable(schema, name, "protected", protected=self.protected[key])
        if key in self.linked:
            return ResolvedTable(schema, name, "linked", linked=self.linked[key])
        if key in self.references:
            return ResolvedTable(schema, name, "reference", reference=self.references[key])
        return ResolvedTable(schema, name, "plain")

    def lookup(self, policy_name: str) -> ResolvedTable:
        return self._entry(*split_policy_name(policy_name))

    def touches_protected(self, table: exp.Table) -> bool:
        """Whether a table reference may reach a protected or linked table, whatever the search_path."""
        name = identifier(table.this if isinstance(table.this, exp.Identifier) else None)
        if name is None:
            return False
        schema = identifier(table.args.get("db"))
        if schema is None:
            return name in self.bare
        return (schema, name) in self.protected or (schema, name) in self.linked


def _check_key(link: LinkedTable, unit: ProtectedTable | None) -> None:
    """Refuse a linked table whose key may tell apart two values its unit takes as one person: people are counted
    by their keys, so such a key counts one person several times."""
    types = _finer_key_types(link, unit)
    if types is not None:
        raise unsupported(
            f"linked table {link.name} cannot be queried: its key {link.column} is of type {types[0]}, the unit "
            f"{link.references}.{link.references_column} of type {types[1]}, so two keys it tells apart may be one "
            "person",
            f"Ask the DBA to give {link.name}.{link.column} the type of {link.references}.{link.references_column}.",
        )
    if _key_finer_than_unit(link, unit):
        raise unsupported(
            f"linked table {link.name} cannot be queried: its key {link.column} has another collation than the "
            f"unit {link.references}.{link.references_column}, whose collation is nondeterministic, so two keys "
            "it tells apart may be one person",
            f"Ask the DBA to give {link.name}.{link.column} the collation of "
            f"{link.references}.{link.references_column}.",
        )


# Types whose equality is another's: varchar has no operators of its own, PostgreSQL compares it as text.
_SAME_EQUALITY = {"character varying": "text"}
_INTEGERS = frozenset({"smallint", "integer", "bigint"})
# Key types of an integer unit that PostgreSQL compares with it by converting both to the key's type, numeric or
# double precision (a real key too): a unit value converts to one value, which two distinct keys cannot both equal,
# so no key is finer. A bigint above 2^53 is rounded to double precision (9007199254740993 =
# 9007199254740992::float8), so a double key may equal two units: coarser, which counts two people as one by key.
_INTEGER_UNIT_KEYS = _INTEGERS | {"numeric", "real", "double precision"}


def _equality_type(type_name: str) -> str:
    """A type as its equality goes: format_type's name less a modifier ("numeric(10,2)", "timestamp(3) with time
    zone"), which changes what values a column holds but not how two of them compare."""
    bare = re.sub(r"\(.*?\)", "", type_name)
    return _SAME_EQUALITY.get(bare, bare)


def _finer_key_types(link: LinkedTable, unit: ProtectedTable | None) -> tuple[str, str] | None:
    """The key's and the unit's types where the key's may compare finer: another type than the unit's (a domain
    counts as its base type), unless the unit is an integer and the key a number. A text key of a citext unit tells
    'm1' from 'M1', one of a timestamptz unit two spellings of one instant, one of a numeric unit '7' from '7.0'.
    Not checked where the policy did not read the types (a policy built in memory); a key or unit missing from them
    (a dropped column) is refused."""
    if unit is None or unit.types is None or link.types is None:
        return None
    key_type = link.types.get(link.column, "unknown")
    unit_type = unit.types.get(unit.unit_column, "unknown")
    key, person = _equality_type(key_type), _equality_type(unit_type)
    if "unknown" in (key_type, unit_type) or (key != person and not (person in _INTEGERS and key in
                                                                      _INTEGER_UNIT_KEYS)):
        return key_type, unit_type
    return None


def _key_finer_than_unit(link: LinkedTable, unit: ProtectedTable | None) -> bool:
    """Whether the linked table's key may tell apart two values its unit takes as one person: the unit's collation
    is nondeterministic ('r1' = 'R1') and the key's another (every deterministic collation compares by bytes, so
    only such a unit can be coarser than its key). Collations as read with the policy."""
    unit_collation = (unit.nondeterministic or {}).get(unit.unit_column) if unit is not None else None
    return unit_collation is not None and (link.nondeterministic or {}).get(link.column) != unit_collation
