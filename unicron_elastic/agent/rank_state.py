"""The agent's record of one rank: its ladder history and what is pending for its worker (no I/O).

The agent keeps one :class:`RankState` per global rank (under its lock): what
the worker said in its ``hello``, what the ladder has seen of the rank, and
what the agent must do when the worker's process exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unicron_elastic.agent.ladder import RankHistory, Rung
from unicron_elastic.events import Classification


@dataclass
class RankState:
    """What the agent knows of one rank.

    Attributes:
        history: The ladder's state of the rank.
        reply: The worker's reply address (its ``hello``; empty until then and
            after a respawn).
        leavable: The worker can leave at a step boundary (its ``hello``).
        fatal: The classification of a fatal exception the worker reported,
            acted on when its process exits.
        expected_exit: The rung of a worker the agent killed (hung, or told to
            stop), executed when its process exits.
        rejoining: The reason the worker asked to rejoin (None: it did not);
            cleared when it is restarted, finishes, or a new round starts.
    """

    history: RankHistory = field(default_factory=RankHistory)
    reply: str = ""
    leavable: bool = False
    fatal: Classification | None = None
    expected_exit: Rung | None = None
    rejoining: str | None = None
