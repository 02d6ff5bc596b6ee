"""The policy as a YAML file: parse and check it, apply it to a database, dump it back.

    service_role: anonproxy_service
    tables:
      public.adult:
        unit: id
        shared_budget: {epsilon: 20, delta: 0.0001, refresh_period: 30 days}
        columns:
          age: {kind: quasi_identifier, lower: 17, upper: 90}
          sex: {kind: quasi_identifier, domain: [Female, Male]}
    links:
      public.visits:
        column: person_id
        references: public.people
        columns:
          visited_at: {kind: quasi_identifier, earliest: 2025-01-01 00:00:00+00, latest: 2026-12-31 23:59:59+00}
    roles:
      reporter: {mode: suppress, k: 10, dominance: {n: 2, percent: 85}, suppressed_rest: true}
      analyst:
        mode: dp
        budgets:
          public.adult: {epsilon: 10, delta: 0.00001, accuracy_epsilon: 0.5, delta_per_query: 0.0000001,
                         max_groups_per_person: 5}
    published:
      public.adult_k10: {roles: [reporter, analyst]}
    reference_tables: [public.regions, public.calendar]
    max_statement_time: {suppress: 30s, dp: 1min}

Parsing checks shape and ranges and names the offending path
(``roles.reporter.k: must be an integer ≥ 2, got 1``). ``apply_policy`` then
replaces the whole policy through the SQL functions of sql/0002_policy.sql,
0003_ledger.sql (budgets), 0011_published_relations.sql, 0013_statement_time.sql and
0017_reference_tables.sql in one transaction, so the database has the last word on tables, columns and
roles, and a refusal leaves the previous policy in force.

Durations (``max_statement_time``) are written like PostgreSQL's time
settings: a number and a unit, ``500ms``, ``30s``, ``2min``, ``1h``.

Time bounds (``earliest``, ``latest``: a date, timestamp or timestamptz column's
range, inclusive) are a date (``2025-01-01``) or a date and time, with an offset
(``2025-01-01 00:00:00+00``) or without; for a timestamptz column a time without
offset is UTC (sql/0033_time_bounds.sql checks them against the column's type).

Contribution bounds (``max_groups_per_person``, ``max_rows_per_person_and_group``: what one person may add to a dp
answer, sql/0034_contribution_bounds.sql) are integers from 1 to 1000, 1 when not given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, date, datetime
from decimal import Decimal
from importlib.resources import files
from pathlib import Path
from typing import Any, TypeVar, cast

import psycopg
import yaml

from anonproxy.policy.zcdp import ACCOUNTINGS, Accounting

from .model import (
    COLUMN_KINDS,
    DEFAULT_MAX_STATEMENT_MS,
    DEFAULT_SERVICE_ROLE,
    MAX_CONTRIBUTION_BOUND,
    MODES,
    TIMED_MODES,
    Budget,
    ColumnKind,
    ColumnPolicy,
    LinkedTable,
    Mode,
    Policy,
    ProtectedTable,
    PublishedRelation,
    ReferenceTable,
    RolePolicy,
    SharedBudget,
    SuppressionParams,
)

T = TypeVar("T")

_TOP_KEYS = ("service_role", "tables", "links", "roles", "published", "reference_tables", "max_statement_time")
_TABLE_KEYS = ("unit", "shared_budget", "columns")
_LINK_KEYS = ("column", "references", "columns")
_COLUMN_KEYS = ("kind", "lower", "upper", "domain", "earliest", "latest")
_ROLE_KEYS = ("mode", "k", "dominance", "p_percent", "suppressed_rest", "allow_min_max", "budgets")
_DOMINANCE_KEYS = ("n", "percent")
_BUDGET_KEYS = ("epsilon", "delta", "refresh_period", "accuracy_epsilon", "delta_per_query", "accounting",
                "epsilon_per_query", "max_groups_per_person", "max_rows_per_person_and_group")
_BOUND_KEYS = ("max_groups_per_person", "max_rows_per_person_and_group")  # contribution bounds (sql/0034)
# accuracy_epsilon (the ε that sets each answer's noise) was called epsilon_per_query: still read, deprecated.
_ACCURACY_KEYS = ("accuracy_epsilon", "epsilon_per_query")
_SHARED_BUDGET_KEYS = ("epsilon", "delta", "refresh_period", "accounting")
_PUBLISHED_KEYS = ("roles",)
# Units of a duration, as PostgreSQL's time settings take them, in milliseconds.
_TIME_UNITS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|min|h|d)\s*")
_MAX_STATEMENT_MS = 24 * 86_400_000  # what anonproxy.set_max_statement_time accepts
# Roles that may read published relations: the others are direct (PostgreSQL's grants) or denied.
_PUBLISHED_MODES = ("suppress", "dp")


class PolicyError(ValueError):
    """The policy file is not valid; one line per problem, each starting with its path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class PolicyApplyError(PolicyError):
    """The database refused part of the policy; the previous policy is still in force."""

    def __init__(self, path: str, error: psycopg.Error) -> None:
        diag = error.diag
        message = diag.message_primary or str(error).strip()
        problems = [f"{path}: {message} (SQLSTATE {error.sqlstate})"]
        if diag.message_hint:
            problems.append(f"{path}: hint: {diag.message_hint}")
        super().__init__(problems)
        self.path = path
        self.sqlstate = error.sqlstate


# Parsing -----------------------------------------------------------------------


def parse_policy(text: str, source: str = "policy") -> Policy:
    """Parse and check a YAML policy; raise ``PolicyError`` naming every problem found."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise PolicyError([f"{source}: not valid YAML: {exc}"]) from None
    checker = _Checker()
    policy = checker.policy(document)
    if checker.problems:
        raise PolicyError(checker.problems)
    return policy


def read_policy_file(path: str | Path) -> Policy:
    path = Path(path)
    return parse_policy(path.read_text(encoding="utf-8"), source=str(path))


def demo_policy() -> Policy:
    """The policy `anonproxy up` applies to the demo table ``public.adult``."""
    return parse_policy(files("anonproxy.data").joinpath("demo_policy.yaml").read_text(encoding="utf-8"),
                        source="demo_policy.yaml")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            if isinstance(key, str):
                seen.add(key)
        return super().construct_mapping(node, deep)


class _Checker:
    """Turns the parsed YAML into the model, collecting a problem per bad path."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def policy(self, document: object) -> Policy:
        top = self.mapping(document, "policy", _TOP_KEYS)
        service = self.optional(top, "service_role", self.string, DEFAULT_SERVICE_ROLE, "service_role")
        tables = {
            name: self.table(name, spec, f"tables.{name}")
            for name, spec in self.named(top.get("tables"), "tables").items()
        }
        links = {
            name: self.link(name, spec, f"links.{name}", tables)
            for name, spec in self.named(top.get("links"), "links").items()
        }
        roles = {
            name: self.role(name, spec, f"roles.{name}", tables, links)
            for name, spec in self.named(top.get("roles"), "roles").items()
        }
        published = {
            name: self.published(name, spec, f"published.{name}", tables, links, roles)
            for name, spec in self.named(top.get("published"), "published").items()
        }
        references = self.references(top.get("reference_tables"), tables, links, published)
        limits = self.mapping(top.get("max_statement_time", {}), "max_statement_time", TIMED_MODES)
        max_statement_ms = {mode: self.duration(limits[mode], f"max_statement_time.{mode}")
                            for mode in TIMED_MODES if mode in limits}
        return Policy(tables=tables, links=links, roles=roles, service_role=service, published=published,
                      references=references, max_statement_ms={mode: ms for mode, ms in max_statement_ms.items()
                                        if ms is not None and ms != DEFAULT_MAX_STATEMENT_MS})

    def table(self, name: str, spec: object, path: str) -> ProtectedTable:
        self.table_name(name, path)
        fields = self.mapping(spec, path, _TABLE_KEYS)
        unit = self.required(fields, "unit", self.string, path)
        shared = None
        if "shared_budget" in fields:
            shared = self.shared_budget(fields["shared_budget"], f"{path}.shared_budget")
        return ProtectedTable(name, unit or "", self.columns(fields.get("columns"), f"{path}.columns"), shared)

    def link(self, name: str, spec: object, path: str, tables: Mapping[str, ProtectedTable]) -> LinkedTable:
        self.table_name(name, path)
        fields = self.mapping(spec, path, _LINK_KEYS)
        column = self.required(fields, "column", self.string, path) or ""
        references = self.required(fields, "references", self.string, path) or ""
        # in the words of anonproxy.link_table (sql/0002_policy.sql), which refuses the same
        if name in tables:
            self.fail(path, f"table {name} is protected (under tables), so it cannot also be a linked table")
        referenced = tables.get(references)
        if references and referenced is None:
            self.fail(f"{path}.references", f"table {references}, referenced by linked table {name}, is not "
                                            "protected (under tables of this file)")
        return LinkedTable(name, column, references, referenced.unit_column if referenced else "",
                           self.columns(fields.get("columns"), f"{path}.columns"))

    def columns(self, spec: object, path: str) -> dict[str, ColumnPolicy]:
        return {name: self.column(name, column, f"{path}.{name}") for name, column in self.named(spec, path).items()}

    def column(self, name: str, spec: object, path: str) -> ColumnPolicy:
        fields = self.mapping(spec, path, _COLUMN_KEYS)
        kind = self.required(fields, "kind", self.string, path)
        if kind is not None and kind not in COLUMN_KINDS:
            self.fail(f"{path}.kind", f"must be one of {', '.join(COLUMN_KINDS)}, got {kind!r}")
        lower = self.optional(fields, "lower", self.number, None, f"{path}.lower")
        upper = self.optional(fields, "upper", self.number, None, f"{path}.upper")
        if ("lower" in fields) != ("upper" in fields):
            self.fail(path, "give both lower and upper bounds, or neither")
        elif lower is not None and upper is not None and lower > upper:
            self.fail(path, f"lower bound {_number_text(lower)} is greater than upper bound {_number_text(upper)}")
        domain = self.optional(fields, "domain", self.domain, None, f"{path}.domain")
        earliest = self.optional(fields, "earliest", self.moment, None, f"{path}.earliest")
        latest = self.optional(fields, "latest", self.moment, None, f"{path}.latest")
        if ("earliest" in fields) != ("latest" in fields):
            self.fail(path, "give both earliest and latest bounds, or neither")
        elif earliest is not None and latest is not None:
            if (earliest.tzinfo is None) != (latest.tzinfo is None):
                self.fail(path, "give earliest and latest both with an offset (+00) or both without")
            elif earliest > latest:
                self.fail(path, f"earliest bound {earliest.isoformat(' ')} is later than latest bound "
                                f"{latest.isoformat(' ')}")
        return ColumnPolicy(name, cast(ColumnKind, kind), lower, upper, domain, earliest, latest)  # checked above

    def role(self, name: str, spec: object, path: str, tables: Mapping[str, ProtectedTable],
             links: Mapping[str, LinkedTable]) -> RolePolicy:
        fields = self.mapping(spec, path, _ROLE_KEYS)
        mode = self.required(fields, "mode", self.string, path)
        if mode is not None and mode not in MODES:
            self.fail(f"{path}.mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
        k = self.optional(fields, "k", lambda value, at: self.integer(value, at, minimum=2), 10, f"{path}.k")
        n = percent = None
        if "dominance" in fields:
            dominance = self.mapping(fields["dominance"], f"{path}.dominance", _DOMINANCE_KEYS)
            n = self.required(dominance, "n", lambda value, at: self.integer(value, at, minimum=1), f"{path}.dominance")
            percent = self.required(dominance, "percent", self.number, f"{path}.dominance")
            if percent is not None and not 0 < percent <= 100:
                self.fail(f"{path}.dominance.percent", f"must be a number in (0, 100], got {_number_text(percent)}")
        p_percent = self.optional(fields, "p_percent", self.number, None, f"{path}.p_percent")
        if p_percent is not None and p_percent <= 0:
            self.fail(f"{path}.p_percent", f"must be a number > 0, got {_number_text(p_percent)}")
        params = SuppressionParams(
            k=k,
            dominance_n=n,
            dominance_percent=percent,
            p_percent=p_percent,
            suppressed_rest=self.optional(fields, "suppressed_rest", self.boolean, False, f"{path}.suppressed_rest"),
            allow_min_max=self.optional(fields, "allow_min_max", self.boolean, False, f"{path}.allow_min_max"),
        )
        budgets = {
            domain: self.budget(domain, budget, f"{path}.budgets.{domain}", tables, links)
            for domain, budget in self.named(fields.get("budgets"), f"{path}.budgets").items()
        }
        return RolePolicy(name, cast(Mode, mode), params, budgets)  # checked above

    def budget(self, domain: str, spec: object, path: str, tables: Mapping[str, ProtectedTable],
               links: Mapping[str, LinkedTable]) -> Budget:
        if domain in links:
            self.fail(path, f"{domain} is a linked table; budgets belong to the protected table it links to, "
                            f"{links[domain].references}")
        elif domain not in tables:
            self.fail(path, f"{domain} is not a protected table of this file (under tables)")
        fields = self.mapping(spec, path, _BUDGET_KEYS)
        total = self.limits(fields, path)
        given = [key for key in _ACCURACY_KEYS if key in fields]
        if len(given) > 1:
            self.fail(f"{path}.epsilon_per_query", "is the old name of accuracy_epsilon: give accuracy_epsilon only")
        key = given[0] if given else "accuracy_epsilon"
        epsilon_per_query = self.optional(fields, key, self.amount, None, f"{path}.{key}")
        if epsilon_per_query is not None and total.epsilon > 0 and not 0 < epsilon_per_query <= total.epsilon:
            self.fail(f"{path}.{key}", f"must be a number in (0, {_amount_text(total.epsilon)}], the "
                                       f"budget's epsilon; got {_amount_text(epsilon_per_query)}")
        delta_per_query = self.optional(fields, "delta_per_query", self.amount, None, f"{path}.delta_per_query")
        if delta_per_query is not None and not 0 <= delta_per_query <= total.delta:
            self.fail(f"{path}.delta_per_query", f"must be a number in [0, {_amount_text(total.delta)}], the "
                                                  f"budget's delta; got {_amount_text(delta_per_query)}")
        groups, rows = (self.optional(fields, key, self.bound, 1, f"{path}.{key}") for key in _BOUND_KEYS)
        return Budget(total.epsilon, total.delta, total.refresh_period, epsilon_per_query, delta_per_query,
                      self.accounting(fields, total.delta, path), groups, rows)

    def bound(self, value: object, path: str) -> int | None:
        """A contribution bound: an integer in [1, MAX_CONTRIBUTION_BOUND]."""
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CONTRIBUTION_BOUND:
            return value
        self.fail(path, f"must be an integer in [1, {MAX_CONTRIBUTION_BOUND}], got {value!r}")
        return None

    def shared_budget(self, spec: object, path: str) -> SharedBudget:
        fields = self.mapping(spec, path, _SHARED_BUDGET_KEYS)
        total = self.limits(fields, path)
        return replace(total, accounting=self.accounting(fields, total.delta, path))

    def accounting(self, fields: dict[str, Any], delta: Decimal, path: str) -> Accounting | None:
        """The accounting given (None: the default rule, see docs/ledger.md)."""
        given = self.optional(fields, "accounting", self.string, None, f"{path}.accounting")
        if given is None:
            return None
        if given not in ACCOUNTINGS:
            self.fail(f"{path}.accounting", f"must be one of {', '.join(ACCOUNTINGS)}, got {given!r}")
            return None
        if given == "zcdp" and delta == 0:
            self.fail(f"{path}.accounting", "cannot be zcdp with delta 0: zCDP converts to (epsilon, delta)-DP only "
                                            "at a delta above 0")
            return None
        return cast(Accounting, given)

    def limits(self, fields: dict[str, Any], path: str) -> SharedBudget:
        """The epsilon, delta and refresh period of a budget or a shared cap."""
        epsilon = self.required(fields, "epsilon", self.amount, path)
        if epsilon is not None and epsilon <= 0:
            self.fail(f"{path}.epsilon", f"must be a number > 0, got {_amount_text(epsilon)}")
        delta = self.optional(fields, "delta", self.amount, Decimal(0), f"{path}.delta")
        if not 0 <= delta < 1:
            self.fail(f"{path}.delta", f"must be a number in [0, 1), got {_amount_text(delta)}")
        refresh = self.optional(fields, "refresh_period", self.string, None, f"{path}.refresh_period")
        # A missing or wrong epsilon was reported above; 0 stands in for it (the result is then discarded).
        return SharedBudget(epsilon if epsilon is not None and epsilon > 0 else Decimal(0), delta, refresh)

    def published(self, name: str, spec: object, path: str, tables: Mapping[str, ProtectedTable],
                  links: Mapping[str, LinkedTable], roles: Mapping[str, RolePolicy]) -> PublishedRelation:
        self.table_name(name, path)
        if name in tables or name in links:
            self.fail(path, "a protected or linked table cannot be published: publish an anonymized release of it")
        fields = self.mapping(spec, path, _PUBLISHED_KEYS)
        listed = self.required(fields, "roles", self.names, path) or ()
        for index, role in enumerate(listed):
            mode = roles[role].mode if role in roles else "direct"
            if mode not in _PUBLISHED_MODES:
                self.fail(f"{path}.roles[{index}]", f"role {role} is in mode {mode} in this file; published "
                                                    f"relations are for roles in mode {' or '.join(_PUBLISHED_MODES)}")
        return PublishedRelation(name, listed)

    def references(self, value: object, tables: Mapping[str, ProtectedTable], links: Mapping[str, LinkedTable],
                   published: Mapping[str, PublishedRelation]) -> dict[str, ReferenceTable]:
        """``reference_tables``: a list of table names; their keys are read from the database when it is loaded."""
        if value is None:
            return {}
        names = self.names(value, "reference_tables") or ()
        for index, name in enumerate(names):
            path = f"reference_tables[{index}]"
            self.table_name(name, path)
            if name in tables or name in links:
                self.fail(path, f"{name} is a protected or linked table; a reference table holds public data only")
            if name in published:
                self.fail(path, f"{name} is published; a published relation cannot also be a reference table")
        return {name: ReferenceTable(name) for name in names}

    # Shapes and scalars; each returns None (after recording a problem) when the value is wrong.

    def mapping(self, value: object, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"must be a mapping with keys {', '.join(allowed)}, got {_type_name(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.fail(path, f"unknown key {key!r} (expected {', '.join(allowed)})")
        return value

    def named(self, value: object, path: str) -> dict[str, Any]:
        """A mapping from names (tables, columns, roles) to specs; absent means empty."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"must be a mapping of names, got {_type_name(value)}")
            return {}
        named: dict[str, Any] = {}
        for key, spec in value.items():
            if isinstance(key, str) and key:
                named[key] = spec
            else:
                self.fail(path, f"names must be non-empty strings, got {key!r}")
        return named

    def table_name(self, name: str, path: str) -> None:
        if "." not in name.strip('"'):
            self.fail(path, "table names must be schema-qualified, like public.adult")

    def required(self, fields: dict[str, Any], key: str, convert: Callable[[object, str], T | None],
                 path: str) -> T | None:
        if key not in fields:
            self.fail(f"{path}.{key}", "is required")
            return None
        return convert(fields[key], f"{path}.{key}")

    def optional(self, fields: dict[str, Any], key: str, convert: Callable[[object, str], T | None], default: Any,
                 path: str) -> Any:
        if key not in fields:
            return default
        value = convert(fields[key], path)
        return default if value is None else value

    def string(self, value: object, path: str) -> str | None:
        if isinstance(value, str) and value:
            return value
        self.fail(path, f"must be a non-empty string, got {value!r}")
        return None

    def integer(self, value: object, path: str, minimum: int) -> int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
        self.fail(path, f"must be an integer ≥ {minimum}, got {value!r}")
        return None

    def number(self, value: object, path: str) -> float | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        self.fail(path, f"must be a finite number, got {value!r}")
        return None

    def amount(self, value: object, path: str) -> Decimal | None:
        """A finite number, kept exactly as written (budgets add up in exact arithmetic)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return Decimal(repr(value))
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = " (YAML reads 1e-5 as text: write 1.0e-5 or 0.00001)"
            except ValueError:
                pass
        self.fail(path, f"must be a finite number, got {value!r}{hint}")
        return None

    def names(self, value: object, path: str) -> tuple[str, ...] | None:
        if not isinstance(value, list) or not value:
            self.fail(path, f"must be a non-empty list of names, got {value!r}")
            return None
        names = [self.string(item, f"{path}[{index}]") for index, item in enumerate(value)]
        if len(set(names)) != len(names):
            self.fail(path, "lists a name more than once")
        return tuple(name for name in names if name is not None)

    def boolean(self, value: object, path: str) -> bool | None:
        if isinstance(value, bool):
            return value
        self.fail(path, f"must be true or false, got {value!r}")
        return None

    def duration(self, value: object, path: str) -> int | None:
        """A duration with a unit (``30s``, ``500ms``), in whole milliseconds (rounded up)."""
        match = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if match is not None:
            ms = math.ceil(float(match[1]) * _TIME_UNITS[match[2]])
            if 1 <= ms <= _MAX_STATEMENT_MS:
                return ms
        self.fail(path, f"must be a duration from 1ms to 24d with a unit ({', '.join(_TIME_UNITS)}), like 30s; "
                        f"got {value!r}")
        return None

    def moment(self, value: object, path: str) -> datetime | None:
        """A time bound: a date (its midnight), or a date and time (with an offset: in UTC)."""
        if isinstance(value, datetime):
            moment = value
        elif isinstance(value, date):
            moment = datetime(value.year, value.month, value.day)
        else:
            try:
                moment = datetime.fromisoformat(value) if isinstance(value, str) else None
            except ValueError:
                moment = None
            if moment is None:
                self.fail(path, f"must be a date or a date and time, like 2025-01-01 or 2025-01-01 00:00:00+00; "
                                f"got {value!r}")
                return None
        return moment.astimezone(UTC) if moment.tzinfo is not None else moment

    def domain(self, value: object, path: str) -> tuple[str, ...] | None:
        if not isinstance(value, list) or not value:
            self.fail(path, f"must be a non-empty list of values, got {value!r}")
            return None
        values: list[str] = []
        for index, item in enumerate(value):
            if isinstance(item, str) or (isinstance(item, (int, float)) and not isinstance(item, bool)):
                values.append(str(item))
            else:
                hint = " (quote it: YAML reads yes/no/on/off as booleans)" if isinstance(item, bool) else ""
                self.fail(f"{path}[{index}]", f"must be a string or a number, got {item!r}{hint}")
        if len(set(values)) != len(values):
            self.fail(path, "lists a value more than once")
        return tuple(values)


def _type_name(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _number_text(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)


def _amount_text(value: Decimal) -> str:
    return format(value.normalize(), "f")


# Applying ----------------------------------------------------------------------


def apply_policy(conn: psycopg.Connection[Any], policy: Policy) -> int:
    """Replace the database's policy with ``policy`` in one transaction; return the new version.

    Runs in a transaction of its own (a savepoint if ``conn`` is already in one,
    in which case the caller commits). Raises ``PolicyApplyError`` naming the
    path of the first item the database refused; nothing is changed then.
    """
    with conn.transaction():
        if not _installed(conn):
            missing = "policy: the anonproxy policy tables are not installed (run `anonproxy install --dsn ...`)"
            raise PolicyError([missing])
        _call(conn, "policy", "select anonproxy.clear_policy()")
        _call(conn, "policy", "select anonproxy.clear_budgets()")  # the ledger keeps what was spent
        _call(conn, "service_role", "select anonproxy.set_service_role(%s::name)", (policy.service_role,))
        for table in policy.tables.values():
            path = f"tables.{table.name}"
            _call(conn, f"{path}.unit", "select anonproxy.protect_table(%s::regclass, %s::name)",
                  (table.name, table.unit_column))
            if table.shared_budget is not None:
                cap = table.shared_budget
                _call(conn, f"{path}.shared_budget",
                      "select anonproxy.set_shared_budget(%s::regclass, %s::numeric, %s::numeric, %s::interval, "
                      "%s::text)",
                      (table.name, cap.epsilon, cap.delta, cap.refresh_period, cap.accounting))
            _set_columns(conn, table.name, table.columns, f"{path}.columns")
        for link in policy.links.values():
            path = f"links.{link.name}"
            _call(conn, path, "select anonproxy.link_table(%s::regclass, %s::name, %s::regclass)",
                  (link.name, link.column, link.references))
            _set_columns(conn, link.name, link.columns, f"{path}.columns")
        for role in policy.roles.values():
            s = role.suppression
            _call(conn, f"roles.{role.role}",
                  "select anonproxy.set_role_policy(%s::name, %s::text, %s::integer, %s::integer, %s::numeric, "
                  "%s::numeric, %s::boolean, %s::boolean)",
                  (role.role, role.mode, s.k, s.dominance_n, s.dominance_percent, s.p_percent, s.suppressed_rest,
                   s.allow_min_max))
            for domain, budget in role.budgets.items():
                _call(conn, f"roles.{role.role}.budgets.{domain}",
                      "select anonproxy.set_budget(%s::name, %s::regclass, %s::numeric, %s::numeric, %s::interval, "
                      "%s::numeric, %s::numeric, %s::text)",
                      (role.role, domain, budget.epsilon, budget.delta, budget.refresh_period,
                       budget.epsilon_per_query, budget.delta_per_query, budget.accounting))
                _call(conn, f"roles.{role.role}.budgets.{domain}",
                      "select anonproxy.set_contribution_bounds(%s::name, %s::regclass, %s::integer, %s::integer)",
                      (role.role, domain, budget.max_groups_per_person, budget.max_rows_per_person_and_group))
        for published in policy.published.values():
            _call(conn, f"published.{published.name}",
                  "select anonproxy.publish_relation(%s::regclass, %s::name[])", (published.name, list(published.roles)))
        for index, reference in enumerate(policy.references.values()):
            _call(conn, f"reference_tables[{index}]", "select anonproxy.declare_reference_table(%s::regclass)",
                  (reference.name,))
        for mode in TIMED_MODES:
            _call(conn, f"max_statement_time.{mode}", "select anonproxy.set_max_statement_time(%s, %s::interval)",
                  (mode, f"{policy.statement_limit(mode)} milliseconds"))
        row = conn.execute("select version from anonproxy.policy_version").fetchone()
    assert row is not None
    return int(row[0])


def _set_columns(conn: psycopg.Connection[Any], table: str, columns: Mapping[str, ColumnPolicy], path: str) -> None:
    for column in columns.values():
        _call(conn, f"{path}.{column.name}",
              "select anonproxy.set_column(%s::regclass, %s::name, %s::text, %s::numeric, %s::numeric, %s::text[])",
              (table, column.name, column.kind, column.lower, column.upper,
               None if column.domain is None else list(column.domain)))
        if column.earliest is not None and column.latest is not None:
            _call(conn, f"{path}.{column.name}", "select anonproxy.set_time_bounds(%s::regclass, %s::name, %s, %s)",
                  (table, column.name, _moment_text(column.earliest), _moment_text(column.latest)))


def _call(conn: psycopg.Connection[Any], path: str, query: str, params: tuple[Any, ...] = ()) -> None:
    try:
        conn.execute(query, params)
    except psycopg.Error as exc:
        raise PolicyApplyError(path, exc) from exc


def _installed(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("select to_regprocedure('anonproxy.clear_policy()') is not null").fetchone()
    return bool(row and row[0])


# Dumping -----------------------------------------------------------------------


class _Flow(dict[str, Any]):
    """A mapping written on one line: {kind: public, lower: 1, upper: 99}."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Flow, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)
)
# Amounts exactly as stored, in a form YAML 1.1 reads back as a number: 10, 0.5, 0.0000001 (not 1E-7).
_Dumper.add_representer(
    Decimal, lambda dumper, data: dumper.represent_int(int(data)) if data == data.to_integral_value()
    else dumper.represent_scalar("tag:yaml.org,2002:float", _amount_text(data))
)


def dump_policy(policy: Policy) -> str:
    """The policy as YAML that ``parse_policy`` + ``apply_policy`` turn back into the same policy."""
    document = {
        "service_role": policy.service_role,
        "tables": {table.name: _dump_table(table) for table in policy.tables.values()},
        "links": {link.name: _dump_link(link) for link in policy.links.values()},
        "roles": {role.role: _dump_role(role) for role in policy.roles.values()},
        "published": {relation.name: _Flow(roles=list(relation.roles)) for relation in policy.published.values()},
    }
    if policy.references:
        document["reference_tables"] = list(policy.references)
    limits = {mode: _duration_text(policy.statement_limit(mode)) for mode in TIMED_MODES
              if policy.statement_limit(mode) != DEFAULT_MAX_STATEMENT_MS}
    if limits:
        document["max_statement_time"] = _Flow(limits)
    header = f"# anonproxy policy, version {policy.version}\n" if policy.version else ""
    return header + yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)


def _dump_table(table: ProtectedTable) -> dict[str, Any]:
    fields: dict[str, Any] = {"unit": table.unit_column}
    if table.shared_budget is not None:
        fields["shared_budget"] = _dump_limits(table.shared_budget)
    fields["columns"] = _dump_columns(table.columns)
    return fields


def _dump_limits(limits: SharedBudget | Budget) -> _Flow:
    fields = _Flow(epsilon=limits.epsilon, delta=limits.delta)
    if limits.refresh_period is not None:
        fields["refresh_period"] = limits.refresh_period
    fields["accounting"] = limits.accounting  # always: the default rule depends on the other numbers
    return fields


def _dump_budget(budget: Budget) -> _Flow:
    fields = _dump_limits(budget)
    accounting = fields.pop("accounting")
    if budget.epsilon_per_query is not None:
        fields["accuracy_epsilon"] = budget.epsilon_per_query
    if budget.delta_per_query is not None:
        fields["delta_per_query"] = budget.delta_per_query
    fields["accounting"] = accounting
    for key in _BOUND_KEYS:  # only when declared: 1 is the default
        if getattr(budget, key) != 1:
            fields[key] = getattr(budget, key)
    return fields


def _dump_columns(columns: Mapping[str, ColumnPolicy]) -> dict[str, _Flow]:
    dumped: dict[str, _Flow] = {}
    for column in columns.values():
        fields = _Flow(kind=column.kind)
        if column.lower is not None:
            fields["lower"] = _plain_number(column.lower)
        if column.upper is not None:
            fields["upper"] = _plain_number(column.upper)
        if column.domain is not None:
            fields["domain"] = list(column.domain)
        if column.earliest is not None and column.latest is not None:
            fields["earliest"], fields["latest"] = _moment_text(column.earliest), _moment_text(column.latest)
        dumped[column.name] = fields
    return dumped


def _dump_link(link: LinkedTable) -> dict[str, Any]:
    fields = _Flow(column=link.column, references=link.references)
    if not link.columns:
        return fields
    return {**fields, "columns": _dump_columns(link.columns)}


def _dump_role(role: RolePolicy) -> dict[str, Any]:
    s, default = role.suppression, SuppressionParams()
    fields = _Flow(mode=role.mode)
    if s.k != default.k:
        fields["k"] = s.k
    if s.dominance_n is not None and s.dominance_percent is not None:
        fields["dominance"] = {"n": s.dominance_n, "percent": _plain_number(s.dominance_percent)}
    if s.p_percent is not None:
        fields["p_percent"] = _plain_number(s.p_percent)
    if s.suppressed_rest:
        fields["suppressed_rest"] = True
    if s.allow_min_max:
        fields["allow_min_max"] = True
    if not role.budgets:
        return fields
    return {**fields, "budgets": {domain: _dump_budget(budget) for domain, budget in role.budgets.items()}}


def _duration_text(ms: int) -> str:
    """``30000`` -> ``30s``: the largest unit that writes it whole."""
    unit = next(name for name, size in sorted(_TIME_UNITS.items(), key=lambda item: -item[1]) if ms % size == 0)
    return f"{ms // _TIME_UNITS[unit]}{unit}"


def _moment_text(moment: datetime) -> str:
    """A time bound as set_time_bounds and YAML read it: 2025-01-01 00:00:00, +00 when it is aware (UTC)."""
    text = moment.replace(tzinfo=None).isoformat(" ")
    return f"{text}+00" if moment.tzinfo is not None else text


def _plain_number(value: float) -> int | float:
    return int(value) if value.is_integer() else value
