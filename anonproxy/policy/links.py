"""The rule a linked table's key must meet: compare no finer than its unit (docs/policy.md).

People of a linked table are counted by its key, so a key that may tell apart two values its unit takes as one
person counts that person several times. Every statement that reads such a linked table is refused
(anonproxy.plan.tables), and ``anonproxy policy lint`` and ``policy apply`` warn about it, with the same words:
:func:`key_problem` is the one place the rule and its message live. The types and collations are those read with
the policy (anonproxy.policy.store).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .model import LinkedTable, ProtectedTable


@dataclass(frozen=True)
class KeyProblem:
    """Why a linked table cannot be queried, and what the DBA can do about it."""

    message: str
    hint: str


def key_problem(link: LinkedTable, unit: ProtectedTable | None) -> KeyProblem | None:
    """Why ``link``'s key may tell apart two values its unit ``unit`` takes as one person (None: it cannot)."""
    types = _finer_key_types(link, unit)
    if types is not None:
        return KeyProblem(
            f"linked table {link.name} cannot be queried: its key {link.column} is of type {types[0]}, the unit "
            f"{link.references}.{link.references_column} of type {types[1]}, so two keys it tells apart may be one "
            "person",
            f"Ask the DBA to give {link.name}.{link.column} the type of {link.references}.{link.references_column}.",
        )
    if _key_finer_than_unit(link, unit):
        return KeyProblem(
            f"linked table {link.name} cannot be queried: its key {link.column} has another collation than the "
            f"unit {link.references}.{link.references_column}, whose collation is nondeterministic, so two keys "
            "it tells apart may be one person",
            f"Ask the DBA to give {link.name}.{link.column} the collation of "
            f"{link.references}.{link.references_column}.",
        )
    return None


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
