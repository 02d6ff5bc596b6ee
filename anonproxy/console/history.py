"""What changed between two versions of the policy (snapshots of anonproxy.policy_history, sql/0026)."""

from __future__ import annotations

from typing import Any

# Each list of the snapshot, and the fields that name one of its items.
KEYS = {
    "protected_tables": ("table_name",),
    "linked_tables": ("table_name",),
    "column_policies": ("table_name", "column_name"),
    "role_policies": ("role_name",),
    "budgets": ("role_name", "domain"),
    "shared_budgets": ("domain",),
}


def policy_changes(before: dict[str, Any] | None, after: dict[str, Any]) -> list[str]:
    """One line per item added, removed or changed (with its changed fields), in the snapshot's order."""
    if before is None:
        return ["(the first version recorded)"]
    lines = []
    for section, key in KEYS.items():
        old = {_name(item, key): item for item in before.get(section, [])}
        new = {_name(item, key): item for item in after.get(section, [])}
        for name in sorted(new.keys() - old.keys()):
            lines.append(f"{section}: added {name}")
        for name in sorted(old.keys() - new.keys()):
            lines.append(f"{section}: removed {name}")
        for name in sorted(old.keys() & new.keys()):
            fields = [f"{field} {_text(old[name].get(field))} → {_text(new[name].get(field))}"
                      for field in sorted(old[name].keys() | new[name].keys())
                      if old[name].get(field) != new[name].get(field)]
            if fields:
                lines.append(f"{section}: {name}: {', '.join(fields)}")
    if before.get("service_role") != after.get("service_role"):
        lines.append(f"service_role {before.get('service_role')} → {after.get('service_role')}")
    return lines or ["no change"]


def _name(item: dict[str, Any], key: tuple[str, ...]) -> str:
    return ".".join(str(item.get(field)) for field in key)


def _text(value: Any) -> str:
    return "null" if value is None else str(value)
