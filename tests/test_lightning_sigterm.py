"""SIGTERM under ``unicron_megatron``: every rank stops after the same step, with no collective of its own.

Lightning broadcasts a SIGTERM flag over the default group before every batch
(a barrier of every rank each step). The strategy replaces it: the signal marks
the rank, the step's last exchange (the commit over every rank with TP/PP, the
last gradient bucket otherwise) carries the mark, and every rank ends ``fit``
after that step. Each run holds every rank before step ``HOLD`` (the example's
``--hold-until``) until the test has seen each signalled rank log
``sigterm_received``, so the step they stop after is known: ``HOLD``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES, wait_for_launcher
from unicron_elastic.testing import process_tree

GPT = os.path.join(EXAMPLES, "lightning_gpt.py")
STEPS, HOLD = 40, 3
DEADLINE_S = 240  # each wait below, on a loaded machine too


def _start(out: Path, nproc: int, *args: str) -> tuple[subprocess.Popen, Path]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "launcher.log"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.05",
           "--hang-factor=10", GPT, "--steps", str(STEPS), "--record-times", "--hold-step", str(HOLD),
           "--hold-until", str(out / "go"), "--out", str(out), *args]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=f, stderr=subprocess.STDOUT)
    return proc, log


# A number in a worker's console line. structlog prints a line and its newline in two
# writes, so another rank's whole line can come between them: ``step=32026-11-25 16:43:24
# [info ] ...`` is step 3 followed by a line of another rank, not step 32026.
_NUM = r"\d+?(?=\d{4}-\d\d-\d\d |\D|$)"


def _log_events(log: Path, event: str) -> list[dict[str, int]]:
    """``{"rank", "step"?}`` of each ``event`` in the log (the workers' lines may interleave on one line)."""
    return [{key: int(value) for key, value in re.findall(r"(rank|step)=(" + _NUM + ")", found)}
            for found in re.findall(event + r"\s+rank=" + _NUM + r"(?: step=" + _NUM + ")?", log.read_text())]


def _worker_pid(launcher: int, rank: int) -> int:
    """The PID of the worker of ``rank`` below ``launcher`` (its ``RANK`` in its environment)."""
    for pid in process_tree(launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lightning_gpt.py" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} below {launcher}")


def _stop_and_check(out: Path, nproc: int, proc: subprocess.Popen, log: Path, signalled: int) -> str:
    """Release the hold once ``signalled`` ranks got SIGTERM; every rank stops after step HOLD.

    Returns:
        The launcher's output.
    """
    wait_for_launcher(lambda: len(_log_events(log, "sigterm_received")) >= signalled, DEADLINE_S, "sigterm_received",
                      log, proc)
    (out / "go").touch()
    proc.wait(timeout=DEADLINE_S)
    text = log.read_text()
    stopping = _log_events(log, "stopping_on_sigterm")
    assert sorted(e["rank"] for e in stopping) == list(range(nproc)), text[-3000:]
    assert all(e["step"] == HOLD for e in stopping), text[-3000:]
    for rank in range(nproc):  # every rank finished step HOLD, none began another
        steps = [json.loads(line)["step"] for line in (out / f"times{rank}.jsonl").read_text().splitlines()]
        assert steps == list(range(HOLD + 1)), (rank, steps)
    assert "forcefully" not in text, text[-3000:]  # the workers ended fit themselves, none was SIGKILLed
    assert "Traceback" not in text and "worker_restarted" not in text and "error_event" not in text, text[-3000:]
    return text


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step_tp2_dp2(tmp_path: Path) -> None:
    """unicron-run's stop (SIGTERM to every worker) with TP=2 x DP=2: the commit over every rank carries it."""
    out = tmp_path / "run"
    proc, log = _start(out, 4, "--tensor-parallel", "2")
    try:
        wait_for_launcher(lambda: all((out / f"go.waiting{r}").exists() for r in range(4)), DEADLINE_S, "the hold",
                          log, proc)
        proc.send_signal(signal.SIGTERM)
        _stop_and_check(out, 4, proc, log, signalled=4)
        assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step_dp2(tmp_path: Path) -> None:
    """One worker's SIGTERM with DP=2: the last gradient bucket carries it to the other rank, which stops too.

    Lightning's meaning of SIGTERM (stop training, exit 0) is kept, for every
    rank at once: the launcher then ends as after training (exit 0), without
    taking the ranks' teardown for a hang.
    """
    out = tmp_path / "run"
    proc, log = _start(out, 2)
    try:
        wait_for_launcher(lambda: all((out / f"go.waiting{r}").exists() for r in range(2)), DEADLINE_S, "the hold",
                          log, proc)
        os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)
        _stop_and_check(out, 2, proc, log, signalled=1)
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_events_reads_lines_another_rank_split(tmp_path: Path) -> None:
    """The interleaving CI saw: rank 0's whole line between rank 1's ``step=3`` and its newline."""
    log = tmp_path / "launcher.log"
    log.write_text("2026-11-25 16:43:24 [info     ] stopping_on_sigterm            rank=1 step=3"
                   "2026-11-25 16:43:24 [info     ] stopping_on_sigterm            rank=0 step=3\n\n"
                   "unicron_megatron: sigterm_received rank=12 signal=15: every rank stops\n"
                   "[info     ] stopping_on_sigterm            rank=12 step=40\n")
    assert _log_events(log, "stopping_on_sigterm") == [{"rank": 1, "step": 3}, {"rank": 0, "step": 3},
                                                   {"rank": 12, "step": 40}]
    assert _log_events(log, "sigterm_received") == [{"rank": 12}]
