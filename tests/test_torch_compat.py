"""``agent/_torch_compat.py`` against the installed torch: every seam it relies on, checked by behaviour.

These run on each supported release (``.ci/run`` runs them with the oldest;
``-m compat`` is the whole selection). A torch that moved one of these is
named here first, not in a launcher that fails half-way.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std, SubprocessContext

from conftest import wait_for
from unicron_elastic.agent import _torch_compat
from unicron_elastic.api import ConfigError
from unicron_elastic.launcher import get_parser

pytestmark = pytest.mark.compat

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # what PContext.start() registers


@pytest.fixture(autouse=True)
def _signal_handlers_put_back():
    """Starting workers registers torch's handlers in this process: put the previous ones back (a later test
    of this process, e.g. Lightning's SIGTERM handling, must not find torch's)."""
    before = {sig: signal.getsignal(sig) for sig in _HANDLED}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _context(tmp_path, code: str, nproc: int = 1) -> SubprocessContext:
    """A context of ``nproc`` Python workers running ``code`` (its output in files), as torch's agent makes."""
    return SubprocessContext(name="compat", entrypoint=sys.executable,
                             args={lr: ("-c", code) for lr in range(nproc)},
                             envs={lr: {**os.environ, "TORCHELASTIC_RUN_ID": "compat"} for lr in range(nproc)},
                             logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))


@pytest.mark.timeout(60)
def test_one_worker_of_a_subprocess_context_is_respawned_and_the_others_are_untouched(tmp_path) -> None:
    context = _context(tmp_path, "import time; time.sleep(600)", nproc=2)
    context.start()
    try:
        before = _torch_compat.worker_processes(context)
        assert _torch_compat.supports_per_rank_restart(context) and sorted(before) == [0, 1]
        before[1].kill()
        before[1].wait()
        pid = _torch_compat.respawn(context, 1, {"UNICRON_JOIN": "1"})
        after = _torch_compat.worker_processes(context)
        assert after[0] is before[0] and after[0].poll() is None  # the other worker: the same process
        assert after[1].pid == pid != before[1].pid and after[1].poll() is None
        assert context.envs[1]["UNICRON_JOIN"] == "1"
        assert context.wait(0) is None  # torch counts the respawned worker as running, not as failed
    finally:
        started = time.monotonic()
        _torch_compat.stop_workers(context, signal.SIGTERM, 5)
    assert all(p.poll() is not None for p in _torch_compat.worker_processes(context).values())
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_a_worker_ignoring_the_stop_signal_is_killed_after_the_timeout(tmp_path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    context = _context(tmp_path, code)
    context.start()
    out = context.stdouts[0]
    wait_for(lambda: os.path.exists(out) and "up" in open(out).read(), deadline_s=30, why="the worker never started")
    started = time.monotonic()
    _torch_compat.stop_workers(context, signal.SIGTERM, 1)
    assert _torch_compat.worker_processes(context)[0].poll() is not None
    assert 1 <= time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_torch_starts_workers_with_the_signal_handler_the_agent_replaces(tmp_path, monkeypatch) -> None:
    """By behaviour: once replaced, starting workers (``PContext.start``) registers ours for the signals
    torch handles, not torch's ``_terminate_process_handler``."""
    monkeypatch.setattr(mp_api, "_terminate_process_handler", mp_api._terminate_process_handler)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)

    def ours(signum, frame) -> None:
        pass

    assert _torch_compat.use_signal_handler(ours)
    context = _context(tmp_path, "pass")
    context.start()  # (the fixture puts the handlers back)
    try:
        assert {sig: signal.getsignal(sig) for sig in _HANDLED} == {sig: ours for sig in _HANDLED}
    finally:
        context.close()


def test_every_launch_setting_passed_on_is_one_the_worker_spec_takes() -> None:
    from torch.distributed.run import config_from_args

    args = get_parser().parse_args(["--standalone", "--nproc-per-node=2", "train.py"])
    config, _, _ = config_from_args(args)
    options = _torch_compat.worker_spec_options(config)
    assert "event_log_handler" in options  # (every supported release has it)
    WorkerSpec(role="default", local_world_size=2, rdzv_handler=None, entrypoint="train.py", args=(),
               **options)


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {}, 30), (["--shutdown-timeout=2"], {}, 2), (["--shutdown_timeout", "0"], {}, 0),
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, 7), ([], {"PET_SHUTDOWN_TIMEOUT": "4"}, 4),
])
def test_the_shutdown_timeout_reads_the_same_on_every_release(argv, environ, expected, monkeypatch) -> None:
    from torch.distributed.run import config_from_args

    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = get_parser().parse_args([*argv, "--standalone", "train.py"])
    config, _, _ = config_from_args(args)
    assert _torch_compat.shutdown_timeout(config, args) == expected


def test_a_bad_shutdown_timeout_is_a_config_error(monkeypatch) -> None:
    import argparse

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        _torch_compat.shutdown_timeout(argparse.Namespace(), argparse.Namespace())
    with pytest.raises(ConfigError, match="--shutdown-timeout -1"):
        _torch_compat.shutdown_timeout(argparse.Namespace(), argparse.Namespace(shutdown_timeout=-1))
