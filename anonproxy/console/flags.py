"""Patterns in the audit trail that deserve a look: pure functions of trail rows and budgets.

Each function takes what the console read (``TrailRow``s, the policy's
identifying columns, the budgets) and returns ``Flag``s naming the trail rows
behind them. None of them proves an attack; each says where to read.
docs/console.md lists them with their thresholds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from itertools import combinations

import sqlglot
from sqlglot import exp

REFUSALS_THRESHOLD = 5  # refused statements of one login ...
REFUSALS_WINDOW = timedelta(minutes=10)  # ... within this long
BUDGET_SHARE = Decimal("0.9")  # a budget of which at least this share is spent
BUDGET_SQLSTATE = "53400"  # the ledger's refusal of a charge the budget cannot afford (sql/0003, charge())
MAX_VARIANTS = 200  # statements of one shape compared pairwise for differencing, per login (the latest ones)


@dataclass(frozen=True)
class TrailRow:
    id: int
    at: datetime
    login: str | None
    decision: str
    sqlstate: str | None
    statement: str
    relations: tuple[str, ...]


@dataclass(frozen=True)
class Budget:
    role_name: str
    domain: str
    epsilon_budget: Decimal
    epsilon_spent: Decimal


@dataclass(frozen=True)
class Flag:
    kind: str  # refusals, identifier, differencing, budget
    login: str
    summary: str
    ids: tuple[int, ...]  # the trail rows behind it


def refusal_bursts(rows: Iterable[TrailRow], threshold: int = REFUSALS_THRESHOLD,
                   window: timedelta = REFUSALS_WINDOW) -> list[Flag]:
    """Per login, each run of refusals in which at least ``threshold`` fall within ``window`` of each other."""
    refused: dict[str, list[TrailRow]] = defaultdict(list)
    for row in rows:
        if row.decision == "refused" and row.login:
            refused[row.login].append(row)
    flags = []
    for login, own in sorted(refused.items()):
        own.sort(key=lambda r: (r.at, r.id))
        in_burst = [False] * len(own)
        start = 0
        for end in range(len(own)):
            while own[end].at - own[start].at > window:
                start += 1
            if end - start + 1 >= threshold:
                in_burst[start:end + 1] = [True] * (end - start + 1)
        for burst in _runs(own, in_burst, window):
            minutes = int(window.total_seconds() // 60)
            flags.append(Flag("refusals", login, f"{len(burst)} statements refused between "
                                                 f"{burst[0].at:%Y-%m-%d %H:%M:%S} and {burst[-1].at:%H:%M:%S} "
                                                 f"({threshold} or more within {minutes} minutes)",
                              tuple(r.id for r in burst)))
    return flags


def _runs(rows: list[TrailRow], marked: list[bool], window: timedelta) -> list[list[TrailRow]]:
    """The marked rows, split where two marked rows are further apart than ``window``."""
    runs: list[list[TrailRow]] = []
    for row, mark in zip(rows, marked):
        if not mark:
            continue
        if runs and row.at - runs[-1][-1].at <= window:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def identifying_columns(rows: Iterable[TrailRow], identifiers: Mapping[str, frozenset[str]]) -> list[Flag]:
    """Answered statements with an identifying column (``identifiers``: per policy table name, its identifier and
    unit columns) in WHERE or GROUP BY: one flag per login, column and clause."""
    found: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for row in rows:
        if row.decision != "answered" or not row.login:
            continue
        names = _identifier_names(row.relations, identifiers)
        tree = _parse(row.statement)
        if tree is None or not names:
            continue
        for clause, node in _clauses(tree):
            for column in sorted({c.name.lower() for c in node.find_all(exp.Column)} & names):
                key = (row.login, column, clause)
                if row.id not in found[key]:
                    found[key].append(row.id)
    return [Flag("identifier", login, f"{len(ids)} answered statement{'' if len(ids) == 1 else 's'} with the "
                                      f"identifying column {column} in {clause}", tuple(ids))
            for (login, column, clause), ids in sorted(found.items())]


def _identifier_names(relations: Sequence[str], identifiers: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """The identifying columns of the tables a statement read (of every protected table when it names none)."""
    tables = [t for t in relations if t in identifiers] or list(identifiers)
    return frozenset().union(*(identifiers[t] for t in tables)) if tables else frozenset()


def _clauses(tree: exp.Expr) -> Iterable[tuple[str, exp.Expr]]:
    for where in tree.find_all(exp.Where):
        yield "WHERE", where
    for group in tree.find_all(exp.Group):
        yield "GROUP BY", group


def differencing_pairs(rows: Iterable[TrailRow], max_variants: int = MAX_VARIANTS) -> list[Flag]:
    """Pairs of answered statements of one login, alike but for one WHERE condition (one has a condition the other
    lacks, or each has one on the same columns in place of the other's): their answers' difference may single out
    the few rows in between."""
    shapes: dict[tuple[str, str], dict[frozenset[str], list[int]]] = defaultdict(dict)
    columns: dict[str, frozenset[str]] = {}  # the columns each condition reads
    for row in sorted(rows, key=lambda r: (r.at, r.id)):
        if row.decision != "answered" or not row.login:
            continue
        tree = _parse(row.statement)
        if not isinstance(tree, exp.Select):
            continue
        shape, conditions = _shape_and_conditions(tree, columns)
        shapes[(row.login, shape)].setdefault(conditions, []).append(row.id)
    flags = []
    for (login, _), variants in sorted(shapes.items()):
        latest = list(variants.items())[-max_variants:]
        for (first, first_ids), (second, second_ids) in combinations(latest, 2):
            if _one_condition_apart(first, second, columns):
                differing = sorted(first ^ second)
                flags.append(Flag("differencing", login, "two answered statements differ only in "
                                                         + " / ".join(differing),
                                  (first_ids[0], second_ids[0])))
    return flags


def _shape_and_conditions(tree: exp.Select, columns: dict[str, frozenset[str]]) -> tuple[str, frozenset[str]]:
    """The statement without its WHERE clause, and the WHERE clause's conjuncts, as normalized SQL (``columns``
    learns which columns each conjunct reads)."""
    where = tree.args.get("where")
    conjuncts = _conjuncts(where.this) if where else []
    for conjunct in conjuncts:
        columns[conjunct.sql(dialect="postgres")] = frozenset(c.name.lower() for c in conjunct.find_all(exp.Column))
    conditions = frozenset(c.sql(dialect="postgres") for c in conjuncts)
    bare = tree.copy()
    bare.set("where", None)
    return bare.sql(dialect="postgres"), conditions


def _conjuncts(condition: exp.Expr) -> list[exp.Expr]:
    condition = condition.unnest()
    return [c for part in condition.flatten() for c in _conjuncts(part)] if isinstance(condition, exp.And) \
        else [condition]


def _one_condition_apart(first: frozenset[str], second: frozenset[str], columns: Mapping[str, frozenset[str]]) -> bool:
    only_first, only_second = first - second, second - first
    if len(only_first) + len(only_second) == 1:
        return True
    if len(only_first) == 1 and len(only_second) == 1:
        (mine,), (theirs,) = only_first, only_second
        return columns[mine] == columns[theirs]
    return False


def budget_exhaustion(budgets: Iterable[Budget], rows: Iterable[TrailRow], share: Decimal = BUDGET_SHARE) -> list[Flag]:
    """Budgets of which at least ``share`` is spent (with the login's statements that read the domain), and the
    logins refused because their budget could not afford an answer."""
    rows = list(rows)
    flags = []
    for budget in budgets:
        if budget.epsilon_budget > 0 and budget.epsilon_spent >= share * budget.epsilon_budget:
            ids = tuple(r.id for r in rows if r.login == budget.role_name and r.decision == "answered"
                        and budget.domain in r.relations)
            flags.append(Flag("budget", budget.role_name,
                              f"{budget.epsilon_spent.normalize():f} of ε {budget.epsilon_budget.normalize():f} "
                              f"spent on {budget.domain} ({100 * budget.epsilon_spent / budget.epsilon_budget:.0f} %)",
                              ids))
    refused: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        if row.decision == "refused" and row.sqlstate == BUDGET_SQLSTATE and row.login:
            refused[row.login].append(row.id)
    flags.extend(Flag("budget", login, f"{len(ids)} statement{'' if len(ids) == 1 else 's'} refused for lack of "
                                       f"budget (SQLSTATE {BUDGET_SQLSTATE})", tuple(ids))
                 for login, ids in sorted(refused.items()))
    return flags


def _parse(statement: str) -> exp.Expr | None:
    """The statement's syntax tree (PostgreSQL dialect); None for text sqlglot cannot read or several statements."""
    try:
        trees = sqlglot.parse(statement, read="postgres")
    except sqlglot.errors.SqlglotError:
        return None
    trees = [tree for tree in trees if tree is not None]  # a trailing semicolon parses as None
    return trees[0] if len(trees) == 1 else None
