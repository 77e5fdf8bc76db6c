"""A third-party plugin found through the entry point, end to end under unicron-run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import EXAMPLES
from test_agent import actions, run
from unicron_elastic.agent.ladder import EXIT_GIVE_UP
from unicron_elastic.testing import fail_at

pytestmark = pytest.mark.e2e


@pytest.fixture()
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the example plugin discoverable like an installed distribution."""
    site = tmp_path / "site"
    info = site / "unicron_plugin_example-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unicron-plugin-example\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[unicron_elastic]\nexample = unicron_example_plugin\n")
    paths = [str(site), os.path.join(EXAMPLES, "unicron-plugin-example"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    return site


@pytest.mark.timeout(120)
def test_plugin_detector_reports_sev1_and_the_node_gives_up(tmp_path: Path, plugin_path, monkeypatch) -> None:
    monkeypatch.setenv("UNICRON_MEMORY_MIN_MB", str(10**9))  # always "short of memory"
    r = run(tmp_path, [], "--detectors=process,memory", steps=200)
    assert r.proc.returncode == EXIT_GIVE_UP, r.proc.stderr[-3000:]
    kinds = [(e["severity"], e["kind"], e["detector"]) for e in r.of("error_event")]
    assert kinds == [("SEV1", "memory_pressure", "memory")]
    assert actions(r) == [("give_up", -1)]


@pytest.mark.timeout(120)
def test_plugin_classification_rule_is_used(tmp_path: Path, plugin_path) -> None:
    r = run(tmp_path, [fail_at(rank=1, step=3, kind="raise", message="[Errno 28] No space left on device")])
    assert r.proc.returncode == EXIT_GIVE_UP
    assert [(e["severity"], e["kind"]) for e in r.of("error_event")] == [("SEV1", "disk_full")]


@pytest.mark.timeout(120)
def test_crashing_plugin_is_isolated_and_the_agent_recovers(tmp_path: Path, plugin_path, monkeypatch) -> None:
    monkeypatch.setenv("UNICRON_EXAMPLE_CRASH", "1")
    r = run(tmp_path, [fail_at(rank=1, step=5, kind="kill")])
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    assert r.of("plugin_hook_failed")
    assert actions(r) == [("restart_worker", 1)]
