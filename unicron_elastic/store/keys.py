"""The one place that knows unicron's etcd key layout (see DESIGN.md).

::

    /unicron/<cluster>/nodes/<node>            node info, attached to the node's lease
    /unicron/<cluster>/events/<seq>            ErrorEvent JSON
    /unicron/<cluster>/tasks/<task>/spec       TaskSpec JSON
    /unicron/<cluster>/tasks/<task>/status     task status JSON
    /unicron/<cluster>/tasks/<task>/cancel     present once the task was cancelled
    /unicron/<cluster>/tasks/<task>/done/<node> the node's workers of the task completed
    /unicron/<cluster>/coordinator/state       the coordinator's state (written with the plan)
    /unicron/<cluster>/plan                    Plan JSON
    /unicron/<cluster>/commands/<node>/<seq>   actions for one agent
    /unicron/<cluster>/rdzv/<run_id>           DynamicRendezvous state bytes
    /unicron/<cluster>/rdzv-waiting/<run_id>/<node>  a node entering a running run's rendezvous (on its lease)
    /unicron/<cluster>/rdzv-joining/<run_id>/<node>  a node joining the run's next round (on its lease)
    /unicron/<cluster>/c10d/<run_id>/<key>     c10d store keys of one run
    /unicron/<cluster>/leader/<name>           leader election
"""

from __future__ import annotations

from dataclasses import dataclass

from unicron_elastic.api import ConfigError

ROOT = "/unicron"


def _check_part(kind: str, value: str) -> str:
    if not value or "/" in value:
        raise ConfigError(f"{kind} {value!r} must be non-empty and contain no '/'")
    return value


@dataclass(frozen=True)
class Keys:
    """Typed helpers that build the keys of one cluster.

    Args:
        cluster: Cluster name (no ``/``).
    """

    cluster: str

    def __post_init__(self) -> None:
        _check_part("cluster", self.cluster)

    @property
    def prefix(self) -> str:
        """Prefix of every key of this cluster, ending in ``/``."""
        return f"{ROOT}/{self.cluster}/"

    def nodes(self) -> str:
        """Prefix of the node records."""
        return f"{self.prefix}nodes/"

    def node(self, node: str) -> str:
        """Key of one node record."""
        return self.nodes() + _check_part("node", node)

    def node_lost(self, node: str, revision: int) -> str:
        """Key that deduplicates the report of one node's loss (the deleting revision)."""
        return f"{self.prefix}nodes-lost/{_check_part('node', node)}-{int(revision)}"

    def events(self) -> str:
        """Prefix of the error events."""
        return f"{self.prefix}events/"

    def event(self, seq: int) -> str:
        """Key of one event; zero-padded so keys sort by sequence number."""
        return f"{self.events()}{seq:020d}"

    def task(self, task: str) -> str:
        """Prefix of one task's keys."""
        return f"{self.prefix}tasks/{_check_part('task', task)}/"

    def tasks(self) -> str:
        """Prefix of every task's keys."""
        return f"{self.prefix}tasks/"

    def task_cancel(self, task: str) -> str:
        """Key present once ``task`` was cancelled."""
        return self.task(task) + "cancel"

    def task_done(self, task: str, node: str | None = None) -> str:
        """Key a node's daemon writes when its workers of ``task`` completed (the prefix without ``node``)."""
        prefix = self.task(task) + "done/"
        return prefix if node is None else prefix + _check_part("node", node)

    def coordinator_state(self) -> str:
        """Key of the coordinator's state (written in the plan's transaction)."""
        return f"{self.prefix}coordinator/state"

    def task_spec(self, task: str) -> str:
        """Key of a task's specification."""
        return self.task(task) + "spec"

    def task_status(self, task: str) -> str:
        """Key of a task's status."""
        return self.task(task) + "status"

    def plan(self) -> str:
        """Key of the global plan."""
        return f"{self.prefix}plan"

    def commands(self, node: str) -> str:
        """Prefix of the commands sent to one agent."""
        return f"{self.prefix}commands/{_check_part('node', node)}/"

    def command(self, node: str, seq: int) -> str:
        """Key of one command."""
        return f"{self.commands(node)}{seq:020d}"

    def rdzv(self, run_id: str) -> str:
        """Key holding the rendezvous state of a run."""
        return f"{self.prefix}rdzv/{_check_part('run_id', run_id)}"

    def rdzv_waiting(self, run_id: str, node: str | None = None) -> str:
        """Prefix of the announcements of nodes entering a running round's rendezvous (the key of ``node``'s)."""
        prefix = f"{self.prefix}rdzv-waiting/{_check_part('run_id', run_id)}/"
        return prefix if node is None else prefix + _check_part("node", node)

    def rdzv_joining(self, run_id: str, node: str | None = None) -> str:
        """Prefix of the announcements of nodes joining a run's next round (the key of ``node``'s)."""
        prefix = f"{self.prefix}rdzv-joining/{_check_part('run_id', run_id)}/"
        return prefix if node is None else prefix + _check_part("node", node)

    def c10d(self, run_id: str) -> str:
        """Prefix of the c10d store of a run."""
        return f"{self.prefix}c10d/{_check_part('run_id', run_id)}/"

    def leader(self, name: str = "coordinator") -> str:
        """Key of a leader election."""
        return f"{self.prefix}leader/{_check_part('election', name)}"

    def meeting(self, run_id: str) -> str:
        """Prefix of the workers' meeting store of a run (:class:`MeetingKeys` under it)."""
        return f"{self.prefix}meeting/{_check_part('run_id', run_id)}/"


class MeetingKeys:
    """Keys of the workers' meeting store (a c10d store: etcd under :meth:`Keys.meeting`, or a TCPStore).

    Survivors of a failure, joiners and the data-parallel engine meet here;
    ``live/<rank>`` keys are kept by whoever supervises the workers (the
    agent, attached to its node's lease) and ``LIVENESS`` says they are kept.
    """

    MEMBERS = "unicron-dp/members"  # {"generation", "members"} of the current group (the leader writes it)
    LATEST = "unicron-dp/latest"  # the newest admission or resize (joiners wait for it)
    JOIN_REQUESTS = "unicron-dp/join-requests"  # counter of ranks waiting to join or asked to leave
    FINISHED = "unicron-dp/finished"  # the step training ended at
    STOP = "unicron-dp/stop"  # the step after which members stop (a rank's SIGTERM, agreed in that step's exchange)
    LIVENESS = "unicron-dp/liveness"  # present when live/<rank> keys are kept
    SNAPSHOT = "unicron-snapshot/state"  # the in-memory snapshot's head (JSON naming its step and pieces; an agent's TCPStore)

    @staticmethod
    def snapshot(shard: str | None = None, slot: int = 0) -> str:
        """The in-memory snapshot of the whole model (``shard`` None), or of one model shard (``tp<t>-pp<p>``)
        in one of its two slots (the newest two saves are kept)."""
        return MeetingKeys.SNAPSHOT if shard is None else f"{MeetingKeys.SNAPSHOT}/{shard}/{int(slot)}"

    @staticmethod
    def snapshot_piece(key: str, tag: str, index: int) -> str:
        """Piece ``index`` of the snapshot upload ``tag`` whose head is ``key`` (one of :meth:`snapshot`)."""
        return f"{key}/pieces/{tag}/{int(index)}"

    @staticmethod
    def snapshot_pending(key: str) -> str:
        """The uploads announced under the head ``key`` (``tag:pieces;`` each), whose pieces a newer commit deletes."""
        return f"{key}/pending"

    @staticmethod
    def snapshot_host(group_rank: int) -> str:
        """``host:port`` of the snapshot server of node ``group_rank``'s agent (on its lease: gone with the node)."""
        return f"unicron-snapshot/hosts/{int(group_rank)}"

    @staticmethod
    def live(rank: int) -> str:
        """Present while worker ``rank`` runs."""
        return f"unicron-dp/live/{int(rank)}"

    PLACES = "unicron-agents/"  # prefix of the place keys (:meth:`agent`; other keys under it start with a letter)

    @staticmethod
    def agent(group_rank: int) -> str:
        """Present while the agent of node ``group_rank`` runs (on its lease); its value names its owner."""
        return f"{MeetingKeys.PLACES}{int(group_rank)}"

    AGENTS_WORLD = "unicron-agents/world"  # places (nodes) in the round; only grows (a node that grows the run adds one)
    AGENTS_INITIAL = "unicron-agents/initial"  # JSON {"nodes", "world", "started"}: the round as torch formed it
    GROWABLE = "unicron-agents/growable"  # present once a worker said it can join with a rank past the round's world

    @staticmethod
    def agent_seen(group_rank: int) -> str:
        """The agent of node ``group_rank`` started this round's workers (stays after the node is lost)."""
        return f"unicron-agents/seen/{int(group_rank)}"

    @staticmethod
    def agent_done(group_rank: int) -> str:
        """The agent of node ``group_rank`` saw its workers finish (exit barrier)."""
        return f"unicron-agents/done/{int(group_rank)}"

    @staticmethod
    def join(rank: int) -> str:
        """Present while ``rank`` waits to join."""
        return f"unicron-dp/join/{int(rank)}"

    @staticmethod
    def leave(rank: int) -> str:
        """Present while ``rank`` is asked to leave the group at the next step boundary (its node's agent sets it)."""
        return f"unicron-dp/leave/{int(rank)}"

    @staticmethod
    def group(generation: int) -> str:
        """Prefix of the gloo bootstrap of one generation's group."""
        return f"unicron-dp/gen{int(generation)}/pg"

    @staticmethod
    def shard_group(generation: int, shard: int) -> str:
        """Prefix of the bootstrap of one generation's data-parallel group of one model shard (TP x PP > 1)."""
        return f"unicron-dp/gen{int(generation)}/shard{int(shard)}"

    @staticmethod
    def commit_group(generation: int) -> str:
        """Prefix of the bootstrap of one generation's engine group over every rank (TP x PP > 1: the commit)."""
        return f"unicron-dp/gen{int(generation)}/commit"

    @staticmethod
    def ready(generation: int, rank: int) -> str:
        """A joiner admitted by ``generation`` built its model: send it the state."""
        return f"unicron-dp/gen{int(generation)}/ready/{int(rank)}"

    @staticmethod
    def buckets(shard: int) -> str:
        """Gradient buckets of one model shard's group (its ranks write it; TP x PP > 1)."""
        return f"unicron-dp/buckets/{int(shard)}"

    @staticmethod
    def non_finite(step: int, rank: int) -> str:
        """Rank ``rank`` found a NaN or Inf in its loss or gradients of ``step`` (value: what, as JSON)."""
        return f"unicron-dp/non-finite/{int(step)}/{int(rank)}"

    @staticmethod
    def world(generation: int) -> str:
        """Prefix of the bootstrap of one generation's default group and megatron-core's groups."""
        return f"unicron-world/gen{int(generation)}"

    @staticmethod
    def checkin(generation: int, rank: int) -> str:
        """A rank's check-in for ``generation`` (value: :class:`~unicron_elastic.strategy.engine.membership.CheckIn` JSON)."""
        return f"unicron-dp/gen{int(generation)}/alive/{int(rank)}"

    @staticmethod
    def record(generation: int) -> str:
        """The membership record of ``generation``, written once."""
        return f"unicron-dp/gen{int(generation)}/record"
