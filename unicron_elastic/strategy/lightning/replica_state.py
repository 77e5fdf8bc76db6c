"""The state of a replica under Lightning: what a joiner receives, and the tiers that keep it when no replica is left.

The state is Lightning's whole checkpoint (weights, optimizer, loop progress,
callbacks) plus the random streams
(:class:`~unicron_elastic.strategy.lightning.random_streams.RandomStreams`).
The shards of the primary replica save it to the in-memory snapshot and to
disk checkpoints when they are due; a joiner with no replica left resumes
from the newer of the two.

With a sharded optimizer (:mod:`~unicron_elastic.strategy.engine.optimizer_shards`)
a replica hands a joiner its state without the optimizer's per-element state
(the joiner gets its share from the members when its group forms); the
tiers hold the whole optimizer state, gathered from every member on the
primary replica when a tier is due, and the rank that resumes from a tier
holds all of it until its group reshards it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from unicron_elastic.strategy.engine.optimizer_shards import SHARED_ELSEWHERE
from unicron_elastic.strategy.engine.shard_checkpoint import collect
from unicron_elastic.strategy.engine.shard_checkpoint import load as load_whole
from unicron_elastic.strategy.snapshots.tiers import DiskCheckpoints, MemorySnapshot

if TYPE_CHECKING:
    import torch.distributed as dist

    from unicron_elastic.strategy.engine.elastic_dp import ElasticDataParallel
    from unicron_elastic.strategy.engine.optimizer_shards import OptimizerShards
    from unicron_elastic.strategy.engine.replicas import ModelParallel
    from unicron_elastic.strategy.lightning.random_streams import RandomStreams
    from unicron_elastic.strategy.snapshots.places import PeerServers

__all__ = ["ReplicaState"]

log = structlog.get_logger(__name__)


class ReplicaState:
    """A rank's state as the engine hands it out, loads it and falls back to it.

    Args:
        module: Returns the LightningModule being trained.
        streams: This rank's random streams.
        memory: The in-memory snapshot.
        disk: The disk checkpoints (None: none).
    """

    def __init__(self, module: Callable[[], Any], streams: RandomStreams, memory: MemorySnapshot,
                 disk: DiskCheckpoints | None) -> None:
        self.module, self.streams, self.memory, self.disk = module, streams, memory, disk
        #: The engine's sharded optimizer (None: not sharded); set once the engine is built.
        self.shards: OptimizerShards | None = None
        #: Inside :meth:`get`: Lightning's checkpoint is dumped for a joiner or a tier, not for a user's checkpoint.
        self.dumping = False
        #: (A sharded optimizer) the newest step whose whole state was gathered for the tiers (every member
        #: takes part, so every member knows it); None: none yet.
        self.newest_saved: int | None = None

    def attach(self, shards: OptimizerShards | None) -> None:
        """The engine's sharded optimizer (None: not sharded), told where a lost share sends the run back."""
        self.shards = shards
        if shards is not None:
            shards.returns_to = self.returns_to

    def returns_to(self) -> str:
        """(One optimizer instance) where a lost rank's share sends the run back, for the warning and the error."""
        tiers = (f"in-memory snapshots every {self.memory.every} steps" if self.memory.every else "no in-memory "
                 "snapshots") + (f", disk checkpoints every {self.disk.every} steps" if self.disk else "")
        if self.newest_saved is None:
            return f"the newest snapshot or checkpoint ({tiers}; none saved in this run yet)"
        return f"step {self.newest_saved}, the newest snapshot or checkpoint saved ({tiers})"

    @classmethod
    def open(cls, module: Callable[[], Any], streams: RandomStreams, store: dist.Store | PeerServers | None,
             layout: ModelParallel, rank: int, snapshot_every: int, checkpoint_dir: str | os.PathLike[str] | None,
             checkpoint_every: int) -> ReplicaState:
        """The state of launch rank ``rank``, with its tiers (their writer process starts in :meth:`start`).

        Args:
            module: Returns the LightningModule being trained.
            streams: This rank's random streams.
            store: Where the in-memory snapshot lives
                (:func:`~unicron_elastic.strategy.lightning.stores.snapshot_store`).
            layout: The model's tensor x pipeline parallelism (with TP x PP > 1 each shard saves its own part).
            rank: This launch rank.
            snapshot_every: Steps between in-memory snapshots (0: none).
            checkpoint_dir: The disk checkpoints' directory (None: none).
            checkpoint_every: Steps between disk checkpoints.

        Returns:
            The state and its tiers.
        """
        shard = layout.label(rank) if layout.size > 1 else None
        memory = MemorySnapshot(store, snapshot_every, shard, layout.labels(), out_of_process=True)
        disk = None
        if checkpoint_dir is not None:
            disk = DiskCheckpoints(checkpoint_dir, checkpoint_every, shard=shard, shards=layout.labels())
        return cls(module, streams, memory, disk)

    def get(self) -> dict[str, Any]:
        """The state a replica hands to a joiner: Lightning's checkpoint and the random streams."""
        self.dumping = True
        try:
            checkpoint = self.module().trainer._checkpoint_connector.dump_checkpoint()
        finally:
            self.dumping = False
        return {"lightning": checkpoint, "rng": self.streams.capture()}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the whole Lightning state (Lightning's own resume path, fed from memory).

        Lightning's ``_run`` restores the optimizers and the loop progress
        right after ``setup()``; the random streams are restored at the
        joiner's first step.

        Args:
            state: What :meth:`get` returned on a replica (or a tier's copy of it).
        """
        connector = self.module().trainer._checkpoint_connector
        connector._loaded_checkpoint = state["lightning"]
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        self.streams.hold(state["rng"])
        optimizer = (state["lightning"].get("optimizer_states") or [None])[0]
        if self.shards is not None and optimizer is not None and not optimizer.get(SHARED_ELSEWHERE):
            load_whole(self.shards, optimizer, everything=True)  # a tier's (no replica left): its group reshards it

    def fallback(self, step: int | None = None) -> dict[str, Any] | None:
        """No replica left: the newer of the in-memory snapshot and the newest disk checkpoint.

        The in-memory snapshot is the newest one of every agent's server this
        rank reaches (an unreachable one is skipped with a warning). With
        TP x PP > 1, the newest step every shard has; given ``step`` (the
        resuming replica's first shard chose it), this shard's state of that step.

        Args:
            step: The step to load (None: the newest).

        Returns:
            The state with its ``"source"`` (``"memory"`` or ``"disk"``), or None if neither tier has one.
        """
        candidates = []
        memory = self.memory.load(step)
        if memory is not None:
            candidates.append((memory["step"], 1, {**memory, "source": "memory"}))
        disk = self.disk.load(step) if self.disk else None
        if disk is not None:
            candidates.append((disk["step"], 0, {**disk, "source": "disk"}))
        return max(candidates, key=lambda c: c[:2])[2] if candidates else None

    def optimizer_state(self, engine: ElasticDataParallel | None,
                        unsharded: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's state Lightning's checkpoint holds (``unsharded()``: Lightning's own).

        With a sharded optimizer, a checkpoint's (not a joiner's or a tier's: :attr:`dumping`) gathers every
        share, a collective of the members, on replica 0's rank, which writes it; after ``fit`` it is the one
        the teardown gathered.

        Raises:
            RuntimeError: This rank's parameters were not gathered (its gather failed; a later step regroups),
                for a checkpoint (a joiner's state may hold them: the joiner's refresh gathers them after).
        """
        shards = engine.optimizer_shards if engine is not None else None
        if shards is not None and engine.protocol.stale and not self.dumping:  # (a joiner refreshes after it)
            raise RuntimeError("unicron_megatron: no checkpoint now: this rank's parameters were not gathered")
        if shards is not None and not self.dumping and not engine.groups.held and shards.whole is None and \
                engine.in_primary_replica and 0 in engine.members:
            raise RuntimeError("unicron_megatron: no checkpoint: the optimizer's shares were not gathered when fit "
                               "ended (a member was lost then)")
        if shards is None or self.dumping or not engine.groups.held:
            return unsharded()
        with shards.collected():
            return unsharded()

    def keep_for_checkpoints(self, engine: ElasticDataParallel) -> None:
        """(A sharded optimizer, ``fit`` ended) gather the whole optimizer state on replica 0's rank and keep it,
        for a checkpoint written after ``fit`` (the groups are gone then); a member lost meanwhile: none kept."""
        shards = engine.optimizer_shards
        if shards is None:
            return
        try:
            shards.whole = shards.collector()
        except (RuntimeError, ValueError) as exc:
            log.warning("optimizer_state_not_kept", reason="a member was lost as fit ended", error=str(exc)[:200])

    def save_if_due(self, step: int, engine: ElasticDataParallel, worker: Any) -> None:
        """Save the state of ``step`` to the tiers that are due, on every shard of the primary replica.

        With a sharded optimizer every member calls it: the whole optimizer state is gathered on the primary.

        Args:
            step: The step about to run.
            engine: The elastic engine (its state and whether this rank is in the primary replica).
            worker: This worker's end of the agent channel (the save is declared to the agent).
        """
        memory_due = self.memory.due(step)
        disk_due = self.disk is not None and self.disk.due(step) and step > 0
        if not (memory_due or disk_due):
            return
        shards = engine.optimizer_shards
        with worker.checkpointing():
            if shards is not None:  # every member: the whole optimizer state, on the primary replica
                if engine.protocol.gathering:  # (overlap_param_gather) the parameters first (failed: stale, no group)
                    engine.refresh()
                try:
                    shards.whole = collect(shards, engine.groups.shard, 0)
                except (RuntimeError, AttributeError) as exc:  # a member lost (or this rank's group dropped)
                    log.warning("tiers_not_saved", step=step, reason="the optimizer's shares could not be "
                                "gathered (the step's reduction regroups)", error=str(exc)[:200])
                    return
                self.newest_saved = step
            if not engine.in_primary_replica:
                return
            try:
                state = engine.state()
            finally:
                if shards is not None:
                    shards.whole = None
            if memory_due:
                self.memory.save(state)
            if disk_due:
                self.disk.save(step, state)

    def start(self) -> None:
        """Start the snapshot's writer process, so that it is ready before the first step (~1 s, once)."""
        self.memory.start()

    def settle(self) -> None:
        """End a snapshot's copy from the GPU (made beside the step's compute) before the optimizer step."""
        self.memory.settle()

    def close(self) -> None:
        """Send the snapshot in flight and stop the writer process; wait for the disk checkpoint in flight."""
        self.memory.close()
        if self.disk is not None:
            self.disk.wait()
