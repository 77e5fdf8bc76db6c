"""Reading the coordinator's records from the store: the task specs and the plan.

The leader's loop (:mod:`~unicron_elastic.coordinator.service`) and the node daemon read them
both; this module keeps the daemon off the leader's loop.
"""

from __future__ import annotations

import json

import structlog

from unicron_elastic.api import MalformedValueError
from unicron_elastic.coordinator.api import ClusterPlan, SpecError, TaskSpec
from unicron_elastic.store.client import StatusStore

log = structlog.get_logger(__name__)

_reported: set[tuple[str, int]] = set()  # malformed specs already logged (key, revision)


def read_specs(store: StatusStore) -> dict[str, TaskSpec]:
    """Every stored task spec by name, oldest first; malformed ones are skipped (and logged once)."""
    out = {}
    kvs = [kv for kv in store.get_prefix(store.keys.tasks()) if kv.key.endswith("/spec")]
    for kv in sorted(kvs, key=lambda kv: kv.create_revision):
        try:
            spec = TaskSpec.from_dict(json.loads(kv.value), check_command=False)
        except (ValueError, SpecError, RecursionError, UnicodeDecodeError) as exc:
            if (kv.key, kv.mod_revision) not in _reported:
                _reported.add((kv.key, kv.mod_revision))
                log.warning("malformed_task_spec_skipped", key=kv.key, error=str(exc))
            continue
        out[spec.name] = spec
    return out


def read_plan(store: StatusStore) -> ClusterPlan | None:
    """The stored plan, or None if there is none (a malformed one is logged and read as none)."""
    kv = store.get(store.keys.plan())
    if kv is None:
        return None
    try:
        return ClusterPlan.from_json(kv.value)
    except MalformedValueError as exc:
        log.error("malformed_plan_ignored", error=str(exc))
        return None
