"""The seam through which the coordinator's plan decides who joins a rendezvous.

The default gate admits every node (plain torchrun behaviour). The coordinator
issue supplies a gate that blocks a node until the global plan assigns it to
the task and world size of this run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class JoinRequest:
    """What a node asks to join.

    Attributes:
        run_id: The rendezvous run id.
        task: Task the node trains.
        node: The node's address as the rendezvous sees it.
        round: The round the node is about to join (-1 if unknown).
    """

    run_id: str
    task: str
    node: str
    round: int


class JoinGate(ABC):
    """Decides whether a node may join the next rendezvous round."""

    @abstractmethod
    def admit(self, request: JoinRequest) -> None:
        """Return when the node may join.

        Raises:
            RendezvousClosedError: The plan gives this node no place in the run.
        """


class OpenGate(JoinGate):
    """Admits everyone: the behaviour of torchrun without a coordinator."""

    def admit(self, request: JoinRequest) -> None:
        """See base class."""
        return None
