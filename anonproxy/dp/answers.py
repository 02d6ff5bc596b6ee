"""The dp back-end's decisions around one question, without I/O.

The question's steps are :mod:`anonproxy.dp.question`; the proxy
(:mod:`anonproxy.proxy.noisy`) does their I/O. What they ask this module:

* :func:`priced_checked`: the plan of a measured statement at a per-query
  cost (:func:`anonproxy.dp.plan.price`) and PostgreSQL's parser's reading of
  its SQL (the final SQL check), run in the worker's analysis process
  (:func:`measured_text` measures a text the proxy wrote itself there;
  :func:`plan_checked` does both for a text, for tests and benchmarks);
* :func:`decided_and_priced`: the router's decision on a new text and, for a dp measurement, its plan, in one call
  of the analysis process;
* :func:`fingerprint`: the key of the answer cache, taken from the plan's measurement only;
* :func:`encoded` / :func:`decoded`: the cached value, a noisy measurement (anonproxy.dp.finish);
* :func:`explained`: what EXPLAIN (ANONPROXY) says about a question, and :func:`cost`: what its notice says
  it costs, in the currency of the budget it is charged to;
* :func:`series_question`: the second question of Superset's series limit,
  once the first one's released keys are known;
* the accuracy ε and per-query δ when a budget does not set them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from decimal import Decimal
from typing import TypeVar

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer
from pglast.parser import ParseError, Token, scan

from anonproxy.dp import amounts, ledger
from anonproxy.dp.finish import (
    Group,
    Measurement,
    canonical_names,
    canonical_statistics,
    plan_quantiles,
)
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import DP_HINT, Packed, measure, plan_dp, price
from anonproxy.plan import render
from anonproxy.plan.final_sql import verify
from anonproxy.plan.outer import Series
from anonproxy.plan.refusals import Refusal, Reject, unsupported
from anonproxy.plan.statements import parse_statement, split
from anonproxy.plan.tables import fold
from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.policy.zcdp import Accounting
from anonproxy.wire.results import text_value

# Used when a budget does not say what one query costs.
DEFAULT_EPSILON = Decimal("0.5")
DEFAULT_DELTA = Decimal("1e-7")
DEFAULT_COSTS = (DEFAULT_EPSILON, DEFAULT_DELTA)
T = TypeVar("T")


def plan_checked(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan | Reject:
    """``plan_dp`` of a text, then the final SQL check (:func:`checked`)."""
    return checked(plan_dp(sql, role, policy, params), role, policy)


def measured_text(sql: str, role: RolePolicy, policy: Policy) -> Packed:
    """The measurement of a text the proxy wrote itself (a series limit's second question): parsed here, once."""
    try:
        statements = split(sql)
        if len(statements) != 1:
            raise unsupported("a dp query must be sent on its own, as one statement", DP_HINT)
        return Packed.of(measure(statements[0], parse_statement(statements[0]), role, policy))
    except Refusal as refusal:
        return Packed.of(refusal.reject)


def priced_checked(measured: Packed, role: RolePolicy, policy: Policy, params: DPParams,
                   checked_before: frozenset[str] = frozenset()) -> DPPlan | Reject:
    """``price``, then the final SQL check (:func:`checked`) of what it wrote, but for the texts in
    ``checked_before`` (the same question priced before at another cost wrote the same SQL: it passed for this role
    and policy): what the analysis process runs for a question."""
    plan = checked(price(measured.open(), params), role, policy, checked_before)
    return replace(plan, measured_tokens=folded(plan.measured)) if isinstance(plan, DPPlan) else plan


def decided_and_priced(decide: Callable[[str, RolePolicy, Policy], T], sql: str, role: RolePolicy, policy: Policy,
                       costs: Mapping[str, DPParams], default: DPParams) -> tuple[T, DPParams | None,
                                                                                   DPPlan | Reject | None]:
    """``decide(sql, role, policy)`` and, when the decision carries a dp measurement, that measurement priced at
    ``costs`` of its table (``default`` for a table not in it) with :func:`priced_checked`: both in one call of the
    analysis process, so that a new text of a dp role crosses to it once, not twice. Returns the decision, and the
    parameters and plan it was priced at (None, None without a measurement)."""
    decision = decide(sql, role, policy)
    measured = getattr(decision, "plan", None)
    if not isinstance(measured, Packed) or measured.table is None:
        return decision, None, None
    params = costs.get(measured.table, default)
    return decision, params, priced_checked(measured, role, policy, params)


def checked_sql(sql: str, policy: Policy, role: RolePolicy) -> Reject | None:
    """The final SQL check of a statement the proxy wrote (an outer query over released rows): None, or why not."""
    try:
        verify(sql, policy, role.role)
    except Refusal as refusal:
        return refusal.reject
    return None


def checked(plan: DPPlan | Reject, role: RolePolicy, policy: Policy,
            checked_before: frozenset[str] = frozenset()) -> DPPlan | Reject:
    """PostgreSQL's own parser reads the plan's SQL (and its post statement) again: the final SQL check, defence in
    depth; run in the analysis process, so a long statement's check does not hold up the event loop either. A text
    in ``checked_before`` passed it already."""
    if isinstance(plan, DPPlan):
        try:
            for sql in (plan.sql, plan.post.sql if plan.post is not None else None):
                if sql is not None and sql not in checked_before:
                    verify(sql, policy, role.role)
        except Refusal as refusal:
            return refusal.reject
    return plan


# Result types the dp connection reads as text (anonproxy.proxy.noisy): a key of these may be 'infinity', which
# psycopg's own loaders refuse. A cached answer's keys of these types are read back as text too: the same values.
TEXT_LOADED = ("date", "timestamp", "timestamptz")
_TEXT_OIDS = frozenset(info.oid for info in (psycopg.adapters.types.get(name) for name in TEXT_LOADED) if info)

# The cached value's format, also part of every fingerprint: an answer cached in another format (the whole wire
# answer, before answers were cached by meaning) is never found, and one that is found but unreadable is a miss.
MEASUREMENT_FORMAT = b"anonproxy-measurement/2\n"  # 2: keys in the canonical order (DPPlan.key_order)


def fingerprint(plan: DPPlan, policy_version: int, parameters: object, session: object = ()) -> str:
    """The answer cache's key: the plan's **measurement** — its bounded SQL (without HAVING's never-run type
    checks), statistics and their noise, quantiles, domains, partition selection and cost — the policy it obeys
    and the bound values (``parameters``: without those only LIMIT and OFFSET use). Not what is done with the
    noisy values next (output columns and their names and order, post-aggregate expressions, HAVING, ORDER BY,
    LIMIT, OFFSET, the nested step), which is free post-processing: statements that differ only there are one
    question. Statistics are named, and keys measured, in a canonical
    order by the planner, so neither the select list's nor GROUP BY's order changes the measurement either.
    ``session``, the client's settings the measurement runs under (its TimeZone, DateStyle's field order), is part
    of it whatever the plan reads: a day bucket, a cast of a timestamptz to date or text, a literal without an
    offset or with an ambiguous date all read them, so a question asked in another zone is another question
    (charged, then cached, as one)."""
    text = f"{MEASUREMENT_FORMAT!r}\0{policy_version}\0{_measurement(plan)}\0{parameters!r}\0{session!r}"
    return hashlib.sha256(text.encode()).hexdigest()


class _Measurements:
    """The measurement's text of the plans fingerprinted last, by object: a plan is immutable and the worker's plan
    cache hands out one object per question, so a question asked again (a cached answer, or a first answer of a
    text seen before) does not write it again (60-170 µs of repr per question). Each plan is held, so no other
    object has its id while it is kept. Bounded by bytes, as the proxy's caches are (a plan weighs about three
    times its SQL)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._texts: OrderedDict[int, tuple[DPPlan, str, int]] = OrderedDict()

    def get(self, plan: DPPlan) -> str | None:
        kept = self._texts.get(id(plan))
        if kept is None or kept[0] is not plan:
            return None
        self._texts.move_to_end(id(plan))
        return kept[1]

    def put(self, plan: DPPlan, text: str) -> None:
        weight = len(text) + 3 * len(plan.sql)
        if weight > self.max_bytes:
            return
        while self._texts and self.held + weight > self.max_bytes:
            self.held -= self._texts.popitem(last=False)[1][2]
        self._texts[id(plan)] = (plan, text, weight)
        self.held += weight


_MEASUREMENTS = _Measurements(4 * 1024 * 1024)


def _measurement(plan: DPPlan) -> str:
    """The part of :func:`fingerprint`'s text that depends on the plan alone: its measurement and quantiles."""
    text = _MEASUREMENTS.get(plan)
    if text is not None:
        return text
    names = canonical_names(plan.statistics)
    domains = None if plan.domains is None else tuple(plan.domains[i] for i in plan.key_order or range(plan.keys))
    measurement = replace(plan, sql=plan.measured_tokens or folded(plan.measured), measured="",
                          statistics=tuple(canonical_statistics(plan.statistics)),
                          selection=names.get(plan.selection or ""), columns=(), order=(), limit=None, offset=0,
                          hidden=(), having=None, post=None, nested=None, domains=domains, key_order=(),
                          limit_parameter=None, offset_parameter=None, unmeasured_parameters=())
    text = f"{measurement!r}\0{plan_quantiles(plan)!r}"
    _MEASUREMENTS.put(plan, text)
    return text


# PostgreSQL's scanner's tokens that are not read: white space never is a token.
_COMMENTS = frozenset({"C_COMMENT", "SQL_COMMENT"})


@functools.lru_cache(maxsize=512)
def folded(sql: str) -> str:
    """``sql`` as PostgreSQL reads it, for the cache's key only (it never runs): a digest of PostgreSQL's own
    scanner's tokens (libpg_query, through pglast), keywords in lower case and bare identifiers folded as
    PostgreSQL folds them (``GROUP BY Education`` is ``education``), strings and quoted identifiers as they are,
    white space and comments gone. Texts that differ otherwise have different digests."""
    if "\0" not in sql:  # a NUL would end the scanner's C string early: such a text is its own key
        try:
            tokens = scan(sql)
        except ParseError:
            pass
        else:
            # A token's name has no space and no text has a NUL: the joined string names one token list.
            return _digest("tokens", "\0".join(f"{token.name} {_read(sql[token.start:token.end + 1], token)}"
                                                for token in tokens if token.name not in _COMMENTS))
    return _digest("text", sql)


def _read(text: str, token: Token) -> str:
    """A token's text as it means: a keyword in lower case, a bare identifier folded, anything else as written."""
    if token.kind != "NO_KEYWORD":
        return text.lower()  # keywords are ASCII
    if token.name == "IDENT" and not text.startswith('"'):
        return fold(text, quoted=False)
    return text


def _digest(form: str, text: str) -> str:
    return hashlib.sha256(f"{form}\0{text}".encode()).hexdigest()


def encoded(measurement: Measurement) -> bytes:
    """A measurement as the answer cache keeps it: keys in PostgreSQL's text of their SQL types, noisy values as
    exact text (int, Decimal, float)."""
    types = measurement.key_types
    groups = [{"k": [_text(key, types[i] if i < len(types) else 0) for i, key in enumerate(group.keys)],
               "v": {name: _number(value) for name, value in group.values.items()}}
              for group in measurement.groups]
    document = {"key_types": list(types), "statistic_types": measurement.statistic_types, "groups": groups}
    return MEASUREMENT_FORMAT + json.dumps(document, sort_keys=True).encode()


def decoded(data: bytes | None) -> Measurement | None:
    """The measurement of a cached value; None (a miss, never an error) for anything else, e.g. an answer cached
    in an older format."""
    if data is None or not bytes(data).startswith(MEASUREMENT_FORMAT):
        return None
    try:
        document = json.loads(bytes(data)[len(MEASUREMENT_FORMAT):])
        types = tuple(int(oid) for oid in document["key_types"])
        statistic_types = {str(name): int(oid) for name, oid in document["statistic_types"].items()}
        loader = Transformer()
        groups = tuple(Group(tuple(None if text is None else text if types[i] in _TEXT_OIDS else loader.get_loader(
                                   types[i], pq.Format.TEXT).load(text.encode()) for i, text in enumerate(group["k"])),
                             {name: _load_number(value) for name, value in group["v"].items()})
                       for group in document["groups"])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError, psycopg.Error):
        return None
    return Measurement(types, statistic_types, groups)


def _text(value: object, type_oid: int) -> str | None:
    data = text_value(value, type_oid)
    return None if data is None else data.decode()


_NUMBER_TYPES = {"i": int, "d": Decimal, "f": float}


def _number(value: object) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, Decimal, float)):
        raise TypeError(f"a noisy value must be a number, not {type(value).__name__}")
    tag = "i" if isinstance(value, int) else "d" if isinstance(value, Decimal) else "f"
    return [tag, repr(value) if tag == "f" else str(value)]


def _load_number(value: list[str]) -> object:
    tag, text = value
    return _NUMBER_TYPES[tag](text)


def explained(plan: DPPlan, found: ledger.Lookup) -> list[str]:
    """What EXPLAIN (ANONPROXY) says about one question: its cost and noise, and whether it is cached."""
    if plan.free:
        return [f"the declared public domain, from the policy: reads no row of {plan.table}, costs nothing"]
    lines = [f"differentially private answer on {plan.table}: {cost(plan, found.accounting)}",
             *(f"  {line}" for line in plan.notices())]
    if found.answer is not None:
        lines.append("cached: the same question was answered on the current data; asking it again costs nothing")
    elif found.data_version is None:
        lines.append(f"not cacheable: the data version of {', '.join(plan.tables)} is unknown; every run is charged")
    else:
        lines.append("not cached: running it charges the cost above")
    return lines


def cost(plan: DPPlan, accounting: Accounting) -> str:
    """What an answer costs, in the currency of the budget it is charged to (what that budget adds up); its own
    (ε, δ) guarantee, under zCDP, only labelled as such."""
    if accounting == "zcdp":
        return (f"costs ρ={amounts.spent(plan.rho)}, δ={plan.delta_add:g} (zCDP accounting; on its own it is "
                f"(ε={amounts.spent(plan.epsilon)}, δ={plan.delta:g})-DP)")
    return f"costs ε={amounts.spent(plan.epsilon)}, δ={plan.delta:g} (basic composition)"


def series_question(series: Series, released: Iterable[tuple[bytes | None, ...]]) -> str:
    """The series limit's second question: its outer query restricted to the keys the first one released (rows
    in text format, as the answer holds them)."""
    keys = [series.key_values(row_texts(row)) for row in released]
    return render.sql(series.question(series.restriction(keys)))


def row_texts(row: tuple[bytes | None, ...]) -> tuple[str | None, ...]:
    return tuple(None if value is None else value.decode() for value in row)


def per_query(budget: ledger.Remaining, setting: str) -> Decimal:
    """What one query costs under ``budget``: ``setting`` is "epsilon" or "delta"."""
    return or_default(budget.epsilon_per_query if setting == "epsilon" else budget.delta_per_query, setting)


def or_default(value: Decimal | None, setting: str) -> Decimal:
    return value if value is not None else default_cost(setting)


def default_cost(setting: str) -> Decimal:
    return DEFAULT_EPSILON if setting == "epsilon" else DEFAULT_DELTA
