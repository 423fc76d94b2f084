"""Read the conductor's ``/health`` to tell when every instance has registered.

The conductor reports its members; this module only counts live ones per role so the
supervisor can wait for "all prefill and decode instances are in". It accepts the shapes a
health body reasonably takes (a list of instances with a ``role``, or per-role lists/counts)
so it does not break when the conductor adds fields.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

INSTANCE_ROLES = ("prefill", "decode")
_DEAD_STATES = {"dead", "down", "unhealthy", "draining", "suspect"}


def _is_alive(entry: dict[str, Any]) -> bool:
    if entry.get("alive") is False or entry.get("healthy") is False:
        return False
    return str(entry.get("state", entry.get("status", "alive"))).lower() not in _DEAD_STATES


def _count_list(entries: Any) -> int:
    if isinstance(entries, int) and not isinstance(entries, bool):
        return entries
    if isinstance(entries, list):
        return sum(1 for e in entries if not isinstance(e, dict) or _is_alive(e))
    if isinstance(entries, dict):  # {instance_id: {...}}
        return sum(1 for e in entries.values() if not isinstance(e, dict) or _is_alive(e))
    return 0


def registered_counts(body: Any) -> dict[str, int]:
    """Live registered instances per role found in a conductor health body."""
    counts: Counter[str] = Counter()
    if not isinstance(body, dict):
        return {r: 0 for r in INSTANCE_ROLES}
    instances = body.get("instances")
    if isinstance(instances, dict) and any(r in instances for r in INSTANCE_ROLES):
        body = {**body, **instances}
        instances = None
    if isinstance(instances, dict):
        instances = [{"instance_id": k, **v} if isinstance(v, dict) else {"instance_id": k}
                     for k, v in instances.items()]
    if isinstance(instances, list):
        for entry in instances:
            if isinstance(entry, dict) and entry.get("role") in INSTANCE_ROLES and _is_alive(entry):
                counts[entry["role"]] += 1
    for role in INSTANCE_ROLES:
        for key in (role, f"{role}s", f"num_{role}", f"{role}_instances"):
            if key in body and not isinstance(body[key], bool):
                counts[role] = max(counts[role], _count_list(body[key]))
    return {r: counts[r] for r in INSTANCE_ROLES}


def missing_instances(body: Any, want: dict[str, int]) -> dict[str, int]:
    """How many more instances of each role must register (empty dict: all are in)."""
    have = registered_counts(body)
    return {role: n - have.get(role, 0) for role, n in want.items() if have.get(role, 0) < n}
