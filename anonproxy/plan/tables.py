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

from dataclasses import dataclass
from typing import Literal

from sqlglot import exp

from anonproxy.plan.refusals import unsupported
from anonproxy.policy.links import key_problem
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
    """Refuse a linked table whose key may count one person several times (anonproxy.policy.links)."""
    problem = key_problem(link, unit)
    if problem is not None:
        raise unsupported(problem.message, problem.hint)
