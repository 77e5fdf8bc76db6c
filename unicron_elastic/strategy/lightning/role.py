"""A rank's role under ``unicron_megatron``: one value, set where it changes and read by each of Lightning's hooks.

A rank either trains from the start (:attr:`RankRole.MEMBER`) or joins a
running group (:attr:`RankRole.JOINER`: the agent restarted it, its node
joined a running round, or the member schedule adds it later). A joiner is
admitted (:attr:`RankRole.ADMITTED`), receives the state of a replica
(:attr:`RankRole.JOINED`) and becomes a member at its first step, unless
training finished first (:attr:`RankRole.FINISHED_BEFORE_JOIN`). A member
leaves when the member schedule removes it (:attr:`RankRole.RETIRED`) or
when ``fit`` ends normally (:attr:`RankRole.TRAINED`). Pure: no I/O besides
reading the process environment.
"""

from __future__ import annotations

from enum import Enum

from unicron_elastic.api import ConfigError
from unicron_elastic.env import round_, worker_restarts
from unicron_elastic.strategy.engine.replicas import ModelParallel

__all__ = ["RankRole", "initial_members", "launch_joins"]


class RankRole(Enum):
    """What this rank is to the data-parallel group, from the strategy's point of view.

    Attributes:
        MEMBER: Trains with the group: from the start, or since its first step after it joined.
        JOINER: Waits to be admitted (the engine's ``start_join`` has not returned); it has no world yet.
        ADMITTED: Admitted and its world built; the state comes once its model exists (``finish_join``).
        JOINED: Holds the state of a replica; catches up with Lightning's hooks until its first step.
        RETIRED: The member schedule removed it; Lightning may run batches until it honours ``should_stop``.
        FINISHED_BEFORE_JOIN: Training finished while it waited to join: it trains nothing and writes nothing.
        TRAINED: ``fit`` ended normally (Lightning's ``on_train_end``): ranks still waiting to join may stop.
    """

    MEMBER = "member"
    JOINER = "joiner"
    ADMITTED = "admitted"
    JOINED = "joined"
    RETIRED = "retired"
    FINISHED_BEFORE_JOIN = "finished_before_join"
    TRAINED = "trained"

    @property
    def local(self) -> bool:
        """Lightning's collectives stay on this rank: the world's other ranks are not at the same point.

        A joiner catching up must not run a collective (e.g. a ``sync_dist`` log) in a world whose
        members passed that point; a retired rank or one that never joined is in no world of the members.
        """
        return self not in (RankRole.MEMBER, RankRole.TRAINED)


def initial_members(layout: ModelParallel, launch_world_size: int, members: list[int] | None,
                    member_schedule: dict[int, list[int]]) -> list[int]:
    """The data-parallel members (replicas) that train from the start.

    Args:
        layout: The model's tensor x pipeline parallelism.
        launch_world_size: The launch world's size (``WORLD_SIZE``).
        members: The members given to the strategy (None: every replica of the launch world).
        member_schedule: ``{step: members}`` given to the strategy.

    Returns:
        The initial members.

    Raises:
        ConfigError: The members or the member schedule name replicas outside the launch world, or
            the world is not a multiple of TP x PP.
    """
    replicas = layout.replicas(launch_world_size)
    chosen = members if members is not None else list(range(replicas))
    unit = "ranks" if layout.size == 1 else "replicas"
    for ranks in [chosen, *member_schedule.values()]:
        if not ranks or not set(ranks) <= set(range(replicas)):
            raise ConfigError(f"members {ranks} must be a non-empty subset of {unit} 0..{replicas - 1}")
    return chosen


def launch_joins(replica: int, members: list[int]) -> bool:
    """Whether this process joins a running group rather than training from the start.

    It joins when the agent restarted it, when its node joined a running
    round (a returning node, or one that grew the run), or when the member
    schedule adds it later. After torch's restart-all (a rendezvous round
    after the run's first, ``$UNICRON_ROUND`` > 0: e.g. a run whose workers
    do not admit joiners past their world, grown by the coordinator's plan)
    every rank joins: with no replica left, the lowest one resumes from the
    in-memory snapshot or the disk checkpoint and the others take its state,
    instead of step 0.

    Args:
        replica: This rank's data-parallel replica.
        members: The initial members (:func:`initial_members`).

    Returns:
        True if this process joins.
    """
    restarted = worker_restarts() > 0
    restarted_all = round_() > 0
    return restarted or restarted_all or replica not in members
