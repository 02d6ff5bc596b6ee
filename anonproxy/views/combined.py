"""What combining a release with the other releases of its source reveals, in words.

The figure is the registry's ``anonproxy.releases.combined`` (sql/0027_combined_risk.sql): the composition audit
(``anonproxy.composition_risk``, the intersection attack of docs/composition.md) of every existing release of the
same source and sensitive column, which the database measures again whenever one of them is created, refreshed or
dropped. Nothing here measures anything: `release list`, `verify` and `report` read it and say it the same way.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from .words import number


def others(combined: dict[str, Any] | None, target: str) -> list[str]:
    """The other releases the figure combines ``target`` with; empty when it is alone (or nothing was measured)."""
    return [name for name in (combined or {}).get("releases") or [] if name != target]


def revealed(combined: dict[str, Any] | None) -> Decimal | None:
    """The % of the people located whose sensitive value the combination reveals exactly (PVP at 100 %)."""
    risk = (combined or {}).get("risk")
    return None if risk is None else Decimal(str(risk["pvp"]["100"]))


def breaks(combined: dict[str, Any] | None) -> bool:
    """True when the combination reveals more than the guard allows, or its risk is not fully known (fail closed)."""
    if combined is None:
        return False
    return bool(combined.get("exceeded") or combined.get("problem"))


def clause(combined: dict[str, Any] | None, target: str, sensitive: str | None) -> str | None:
    """'combined with X it reveals …' for a release that is not alone; None when it is (or was not measured)."""
    with_ = others(combined, target)
    if not with_ or combined is None:
        return None
    named = f"combined with {', '.join(with_)}"
    risk, problem = combined.get("risk"), combined.get("problem")
    if risk is None:
        return f"{named} the risk could not be measured: {problem}" if problem else f"{named}: not measured"
    share = revealed(combined)
    if share:
        said = (f"{named} it reveals {sensitive} exactly for {number(share)} % of the {risk['located']} people "
                f"located")
        if combined.get("exceeded"):
            said += f" (limit {number(combined.get('max_pvp_100'))} %)"
    else:
        said = f"{named} it reveals no one's {sensitive} exactly"
    if combined.get("unmeasured"):
        said += (f"; the risk could not be measured for {combined['unmeasured']} of the {risk['overlap']} people "
                 f"they share")
    return said


def cell(combined: dict[str, Any] | None, target: str, ids: dict[str, int]) -> str:
    """The `release list` cell: '0.27 % with 2', 'alone', '-' when not measured."""
    if combined is None:
        return "-"
    with_ = others(combined, target)
    if not with_:
        return "alone"
    share = revealed(combined)
    figure = "unknown" if share is None else f"{number(share)} %"
    if share is not None and combined.get("unmeasured"):
        figure += f" + {combined['unmeasured']} unknown"
    return f"{figure} with {','.join(str(ids.get(name, name)) for name in with_)}"
