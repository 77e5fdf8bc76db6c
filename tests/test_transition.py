"""The transition's pure steps: plan diff -> commands, and each launcher's handover (``coordinator/transition.py``)."""

from __future__ import annotations

from unicron_elastic.coordinator.api import ClusterPlan, Command, TaskPlan
from unicron_elastic.coordinator.transition import commands, keeps_running, leaves_first


def _plan(generation: int, **tasks: tuple[str, ...]) -> ClusterPlan:
    shares = {task: TaskPlan(nodes, workers=2 * len(nodes), waf=1.0) for task, nodes in tasks.items()}
    return ClusterPlan(generation, shares, nodes={node: 2 for share in shares.values() for node in share.nodes})


def test_only_nodes_whose_task_changes_get_a_command_and_a_first_plan_commands_every_node() -> None:
    old, new = _plan(1, a=("n1", "n2")), _plan(2, a=("n1",), b=("n2", "n3"))
    assert commands(old, new, ["n1", "n2", "n3", "n4"]) == (Command("n2", 2, "b", 2, 4), Command("n3", 2, "b", 2, 4))
    assert commands(new, _plan(3, b=("n2",)), ["n1", "n2", "n3"]) == (Command("n1", 3, None), Command("n3", 3, None))
    assert [c.node for c in commands(None, new, ["n1", "n2"])] == ["n1", "n2"]


def test_a_launcher_of_the_commanded_task_keeps_running_only_while_alive() -> None:
    command = Command("n1", 3, "a", 1, 2)
    assert keeps_running("a", True, command)
    assert not keeps_running("a", False, command)  # it ended: start it again
    assert not keeps_running("b", True, command) and not keeps_running(None, False, command)


def test_a_launcher_leaves_first_only_when_its_task_goes_on_on_other_nodes() -> None:
    plan = _plan(4, a=("n1", "n2"), b=("n3",))
    assert leaves_first(plan, "a", "n1")  # a goes on on n2: retire at a step boundary, the others keep training
    assert not leaves_first(plan, "b", "n3")  # b runs nowhere else: stop it
    assert not leaves_first(plan, "c", "n1") and not leaves_first(None, "a", "n1")
