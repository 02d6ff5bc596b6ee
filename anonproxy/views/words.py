"""Numbers and terms as the commands and the report print them for a reader.

A measured level (ℓ, t, a risk) is printed with four significant digits: the
registry keeps them to 10 or 20 decimals, which say nothing more about the
release. The parameter objects of the registry are spelled out in words rather
than shown as JSON. docs/glossary.md explains the terms.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any


def number(value: Any) -> str:
    """A level or metric: whole numbers as they are, others with four significant digits; ∞; - for none."""
    if value is None:
        return "-"
    if isinstance(value, str):
        value = Decimal(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int) or (isinstance(value, Decimal) and value.is_finite() and value == value.to_integral()):
        return str(int(value))
    if (isinstance(value, Decimal) and value.is_infinite()) or (isinstance(value, float) and math.isinf(value)):
        return "∞" if value > 0 else "-∞"
    return f"{float(value):.4g}"


def percent(value: Any) -> str:
    """A share in [0, 1] as a percentage with two decimals."""
    return "-" if value is None else f"{100 * float(value):.2f} %"


def parameters_text(parameters: dict[str, Any]) -> str:
    """What a release was asked for, in words: "k = 10; entropy ℓ ≥ 2; no row left out"."""
    parts = [f"k = {parameters.get('k')}"]
    l, kind = parameters.get("l"), parameters.get("l_kind") or "entropy"
    if l is not None and kind == "recursive":
        parts.append(f"recursive (c = {number(parameters.get('c'))}, ℓ = {number(l)})-diversity")
    elif l is not None:
        parts.append(f"{kind} ℓ ≥ {number(l)}")
    if parameters.get("t") is not None:
        parts.append(f"t ≤ {number(parameters['t'])} ({parameters.get('t_distance') or 'default'} distance)")
    limit = parameters.get("suppression_limit")
    parts.append(f"at most {percent(limit)} of the rows left out" if limit else "no row left out")
    return "; ".join(parts)


def hierarchies_text(hierarchies: dict[str, str | None] | None) -> str:
    """Which hierarchy generalized each column: "age: adult.age, sex: none"."""
    if not hierarchies:
        return "none"
    return ", ".join(f"{column}: {name or 'none'}" for column, name in hierarchies.items())


def achieved_text(achieved: dict[str, Any]) -> str:
    """The levels a release reached when it was built: "k = 10, distinct ℓ = 3, entropy ℓ = 2.154, t = 0.1234"."""
    labels = (("k", "k"), ("l_distinct", "distinct ℓ"), ("l_entropy", "entropy ℓ"),
              ("l_recursive_c", "recursive c"), ("t", "t"))
    parts = [f"{label} = {number(achieved[key])}" for key, label in labels if achieved.get(key) is not None]
    if achieved.get("t") is not None and achieved.get("t_distance"):
        parts[-1] += f" ({achieved['t_distance']} distance)"
    return ", ".join(parts) or "-"
