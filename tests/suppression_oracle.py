"""An independent oracle of suppression mode's verdicts on a GROUP BY (docs/suppression.md, "The rules").

Pure Python over facts the tests compute themselves (the owner's raw GROUP BY, or the shipped rows): which
groups a suppress role releases, which it withholds, and whether the suppressed-rest row is released. It follows
the rules as documented, not the SQL anonproxy/suppress/rewrite.py generates:

* **primary suppression**: a group is released alone when it holds ``n >= k`` people and ``n = N`` or
  ``n <= N - k`` (N: the people of the FROM clause, WHERE not applied), each aggregate that needs contributors
  has ``k`` of them, and its sums pass dominance and the p % rule (when the role has them);
* **complementary suppression**: the withheld groups together must hold nobody, or pass the same rules (``k``
  people and ``N`` or at most ``N - k``, ``k`` contributors per aggregate, the magnitude rules on their summed
  contributions, checked at the first ``MAGNITUDE_STEPS`` steps whose counts pass); and the people in no released
  group (those of the withheld groups and those the WHERE leaves out) must be nobody or at least ``k``, unless a
  released rest row covers the withheld groups. Otherwise the smallest released groups (fewest people, ties by the
  grouping values ascending, NULL last) are withheld too, one at a time, until it holds; if it never holds,
  every group is withheld;
* **margins** of a GROUP BY of several columns (the groups sharing the values of one or two of its columns): a
  margin whose withheld groups hold 1 to ``k - 1`` people, or fewer than ``k`` contributors to an aggregate, loses
  its smallest released group too (one pass);
* **suppressed rest**: one row over the withheld groups, released when they pass the rules together and the
  people the WHERE covers are ``N`` or at most ``N - k``.

People are given as sets (any hashable ids), so a person may be in several groups (a linked table with several
rows per person); a count ``n`` stands for ``n`` people found in that group only (one row per person). Keys are
the grouping values, a tuple for several columns (a plain value for one); they must compare as the database sorts them (text under the
C collation the test server uses compares as Python's ``str``; ``None`` sorts last, as NULL does in ascending
order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Any, Union

MAGNITUDE_STEPS = 8  # docs: "checked on the withheld groups together for the first 8 steps whose counts pass"
MARGIN_COLUMNS = 2  # docs: "the groups sharing the values of one or two grouping columns"

People = Union[int, Iterable[Hashable]]


@dataclass(frozen=True)
class Magnitudes:
    """The role's magnitude rules: (n, k %) dominance and the p % rule, either may be absent."""

    dominance: tuple[int, float] | None = None
    p_percent: float | None = None


@dataclass(frozen=True)
class Verdict:
    released: frozenset[Any]  # the groups the answer shows
    withheld: frozenset[Any]  # primary and complementary
    primary: frozenset[Any]  # withheld because they fail the rules alone
    rest: bool  # whether the suppressed-rest row is released (False when the role has none)
    rest_people: frozenset[Hashable]  # the people of the withheld groups together


def _people(key: Any, value: People) -> frozenset[Hashable]:
    if isinstance(value, int):
        return frozenset(("anonymous", repr(key), i) for i in range(value))
    return frozenset(value)


def _ascending(key: Any) -> tuple[Any, ...]:
    """ORDER BY g1, g2, ... ascending: NULLs last."""
    values = key if isinstance(key, tuple) else (key,)
    return tuple((value is None, value) if value is not None else (True, 0) for value in values)


def _sized(n: int, k: int, everyone: int) -> bool:
    """Threshold and query-set-size control: ``n >= k``, and ``n = N`` or ``n <= N - k``."""
    return n >= k and _left_out(everyone - n, k)


def _left_out(n: int, k: int) -> bool:
    """A set of people a subtraction could single out holds nobody or at least k."""
    return n == 0 or n >= k


def _magnitudes_pass(contributions: Mapping[Hashable, float], rules: Magnitudes) -> bool:
    """Dominance and p % on one sum, from each person's contribution (their rows added up, in absolute value)."""
    values = sorted((abs(Fraction(v)) for v in contributions.values()), reverse=True)  # exact, as numeric is
    total = sum(values, Fraction(0))
    if rules.dominance is not None:
        n, percent = rules.dominance
        if 100 * sum(values[:n], Fraction(0)) > Fraction(percent) * total:
            return False
    if rules.p_percent is not None:
        x1, x2 = (values + [Fraction(0), Fraction(0)])[:2]
        if 100 * (total - x1 - x2) < Fraction(rules.p_percent) * x1:
            return False
    return True


def suppress(groups: Mapping[Any, People], *, k: int, everyone: int,
             contributors: Mapping[str, Mapping[Any, People]] | None = None,
             sums: Mapping[str, Mapping[Any, Mapping[Hashable, float]]] | None = None,
             magnitudes: Magnitudes | None = None, rest: bool = False) -> Verdict:
    """The verdict on every group of one GROUP BY.

    ``groups``: each group's people (a set, or a count for people in that group only); ``everyone``: N, the people
    of the FROM clause without the WHERE; ``contributors``: per aggregate that needs them (count(x), sum, avg ...),
    each group's contributors (a set, or a count when ``groups`` are counts); ``sums``: per sum or avg the
    magnitude rules look at, each group's contribution per person (rows added up); ``magnitudes``: the role's
    dominance and p % parameters; ``rest``: whether the role has the suppressed-rest row.
    """
    contributors = contributors or {}
    sums = sums if magnitudes is not None and (magnitudes.dominance or magnitudes.p_percent is not None) else {}
    rules = magnitudes or Magnitudes()
    people = {key: _people(key, value) for key, value in groups.items()}
    helpers = {name: {key: _people(("contributors", name, key), value) if isinstance(value, int)
                      else frozenset(value) for key, value in by_group.items()}
               for name, by_group in contributors.items()}
    covered = frozenset().union(*people.values()) if people else frozenset()

    def together(keys: Iterable[Any]) -> tuple[frozenset[Hashable], dict[str, frozenset[Hashable]],
                                               dict[str, dict[Hashable, float]]]:
        keys = list(keys)
        units = frozenset().union(*(people[key] for key in keys)) if keys else frozenset()
        helping = {name: frozenset().union(*(by_group.get(key, frozenset()) for key in keys)) if keys
                   else frozenset() for name, by_group in helpers.items()}
        added: dict[str, dict[Hashable, float]] = {}
        for name, by_group in sums.items():
            parts: dict[Hashable, float] = defaultdict(int)
            for key in keys:
                for person, value in by_group.get(key, {}).items():
                    parts[person] += value
            added[name] = parts
        return units, helping, added

    def counts_pass(units: frozenset[Hashable], helping: Mapping[str, frozenset[Hashable]]) -> bool:
        return _sized(len(units), k, everyone) and all(len(h) >= k for h in helping.values())

    def magnitudes_pass(added: Mapping[str, Mapping[Hashable, float]]) -> bool:
        return all(_magnitudes_pass(parts, rules) for parts in added.values())

    # Primary suppression: each group alone.
    primary = set()
    for key in people:
        units, helping, added = together([key])
        if not (counts_pass(units, helping) and magnitudes_pass(added)):
            primary.add(key)
    passing = sorted((key for key in people if key not in primary),
                     key=lambda key: (len(people[key]), _ascending(key)))

    # Complementary suppression: step j withholds the primary groups and the j smallest passing ones.
    chosen = len(passing)
    magnitude_tries = 0
    for step in range(len(passing) + 1):
        withheld = [*primary, *passing[:step]]
        released = passing[step:]
        units, helping, added = together(withheld)
        if not units:
            within = True
        elif counts_pass(units, helping):
            if sums:
                magnitude_tries += 1
                within = magnitude_tries <= MAGNITUDE_STEPS and magnitudes_pass(added)
            else:
                within = True
        else:
            within = False
        in_released = frozenset().union(*(people[key] for key in released)) if released else frozenset()
        outside = _left_out(everyone - len(in_released), k)
        if rest and units:
            # A released rest row covers the withheld groups: then the answer is a total over the WHERE's people.
            outside = outside or _left_out(everyone - len(covered), k)
        if within and outside:
            chosen = step
            break
    withheld_keys = {*primary, *passing[:chosen]}
    released_keys = set(passing[chosen:])

    # Margins of a GROUP BY of several columns (keys are tuples), one pass over the verdicts above.
    width = len(next(iter(people))) if people and isinstance(next(iter(people)), tuple) else 1
    extra = set()
    for size in range(1, min(width - 1, MARGIN_COLUMNS) + 1):
        for columns in combinations(range(width), size):
            margins: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
            for key in people:
                margins[tuple(key[c] for c in columns)].append(key)
            for members in margins.values():
                units, helping, _ = together(key for key in members if key in withheld_keys)
                short = 1 <= len(units) < k or (bool(units) and any(len(h) < k for h in helping.values()))
                candidates = [key for key in passing[chosen:] if key in members]  # smallest first
                if short and candidates:
                    extra.add(candidates[0])
    withheld_keys |= extra
    released_keys -= extra

    units, helping, added = together(withheld_keys)
    rest_released = (rest and bool(units) and counts_pass(units, helping) and magnitudes_pass(added)
                     and _left_out(everyone - len(covered), k))
    return Verdict(frozenset(released_keys), frozenset(withheld_keys), frozenset(primary), rest_released, units)
