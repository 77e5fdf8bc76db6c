"""``UnicronAgent``: torchrun's local agent plus unicron's per-node duties.

This first version keeps ``LocalElasticAgent``'s supervision (restart-all on a
worker failure, up to ``--max-restarts``) and adds what later issues build on:
structlog context bound per rendezvous round and a restart *generation*
exported to workers as ``UNICRON_GENERATION``.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

log = structlog.get_logger(__name__)

GENERATION_ENV = "UNICRON_GENERATION"


class UnicronAgent(LocalElasticAgent):
    """The agent ``unicron-run`` builds (see ``LocalElasticAgent`` for arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generation = 0

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self.generation += 1
        structlog.contextvars.bind_contextvars(
            run_id=worker_group.spec.rdzv_handler.get_run_id(),
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            generation=self.generation,
        )
        world_size = worker_group.workers[0].world_size if worker_group.workers else None
        log.info("agent_rendezvous_complete", world_size=world_size)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        os.environ[GENERATION_ENV] = str(self.generation)
        return super()._start_workers(worker_group)
