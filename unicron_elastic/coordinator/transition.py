"""The transition from one plan to the next (paper section 6): plan diff, per-node commands, each launcher's handover.

1. The leader diffs the old plan against the new one: a :class:`Command` for
   every node whose task changes (:func:`commands`), written with the plan in
   one fenced transaction (:mod:`~unicron_elastic.coordinator.service`).
2. Each node daemon applies its newest command
   (:class:`~unicron_elastic.node.daemon.NodeDaemon`): it keeps a launcher
   whose task the command names (:func:`keeps_running`); a launcher whose task
   goes on on other nodes leaves it at a step boundary first (SIGUSR2,
   :func:`leaves_first`), any other is stopped; then the command's task starts.
3. Inside the task, a launcher that arrives joins the running rendezvous round
   (:mod:`~unicron_elastic.rendezvous.handler`), and the workers admit or retire
   ranks at a step boundary with a resize record
   (:mod:`~unicron_elastic.strategy.engine.protocol`).

Pure: no I/O; the daemon reads the plan and signals processes.
"""

from __future__ import annotations

from unicron_elastic.coordinator.api import ClusterPlan, Command


def commands(old: ClusterPlan | None, new: ClusterPlan, nodes: list[str]) -> tuple[Command, ...]:
    """A command for every node whose task changes between ``old`` and ``new`` (and every node of a first plan)."""
    out = []
    new_of, old_of = _tasks_by_node(new), _tasks_by_node(old) if old is not None else {}
    for node in nodes:
        task = new_of.get(node)
        if old is not None and old_of.get(node) == task:
            continue
        share = new.tasks.get(task) if task else None
        out.append(Command(node, new.generation, task, len(share.nodes) if share else 0, share.workers if share else 0))
    return tuple(out)


def _tasks_by_node(plan: ClusterPlan) -> dict[str, str]:
    """Each node's task under ``plan`` (:meth:`ClusterPlan.task_of` for every node at once: the first task naming it)."""
    out: dict[str, str] = {}
    for name, share in plan.tasks.items():
        for node in share.nodes:
            out.setdefault(node, name)
    return out


def keeps_running(running: str | None, launcher_alive: bool, command: Command) -> bool:
    """Whether a node running ``running`` (its launcher alive or not) changes nothing for ``command``."""
    return command.task == running and launcher_alive


def leaves_first(plan: ClusterPlan | None, task: str, node: str) -> bool:
    """Whether ``node``'s launcher of ``task`` leaves it at a step boundary before stopping: ``plan`` (the newest
    stored) keeps ``task`` on other nodes, so its workers retire without stopping the others."""
    share = plan.tasks.get(task) if plan is not None else None
    return share is not None and bool(set(share.nodes) - {node})
