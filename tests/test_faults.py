"""A planned fault that cannot fire where it was placed is reported when the process ends, never ignored.

Each case runs a process that reaches fault points as a rank (as a worker
does), then exits normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unicron_elastic.testing import Fault, fail_at, faults_env, throttle, unfired_faults

# rank 2 computes micro-batches 2 and 5 of step 3 (3 members, 6 micro-batches), as in the example's old docstring
WORKER = """
from unicron_elastic.faults import maybe_fail
for step in range(6):
    for micro_batch in (2, 5):
        maybe_fail(2, step, micro_batch=micro_batch)
    maybe_fail(2, step, bucket=0)
"""


def _run(tmp_path: Path, faults, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **faults_env(faults, str(tmp_path / "faults.log")), **env})


def test_a_fault_on_a_micro_batch_the_rank_never_computes_is_reported_as_not_fired(tmp_path: Path) -> None:
    never = fail_at(rank=2, step=3, micro_batch=1, kind="raise")  # rank 2 never computes micro-batch 1
    late = fail_at(rank=2, step=9, bucket=0, kind="raise")  # the run ends at step 5
    other = fail_at(rank=0, step=3, micro_batch=0, kind="raise")  # another rank's: not this process's to report
    done = _run(tmp_path, [never, late, other])
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "faults.log").exists()  # nothing fired
    reported = unfired_faults(tmp_path / "faults.log")
    assert [(f["rank"], f["step"], f["micro_batch"], f["bucket"], f["fired"]) for f in reported] == [
        (2, 3, 1, None, False), (2, 9, None, 0, False)]
    assert done.stderr.count("unicron_faults: fault_not_fired") == 2 and '"micro_batch": 1' in done.stderr


def test_a_fault_that_fired_is_not_reported(tmp_path: Path) -> None:
    code = WORKER.replace("maybe_fail(2, step, micro_batch=micro_batch)",
                          "try:\n            maybe_fail(2, step, micro_batch=micro_batch)\n"
                          "        except RuntimeError:\n            pass")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **faults_env([fail_at(rank=2, step=3, micro_batch=5, kind="raise")],
                                                          str(tmp_path / "faults.log"))})
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["micro_batch"] for line in (tmp_path / "faults.log").read_text().splitlines()] == [5]
    assert unfired_faults(tmp_path / "faults.log") == [] and "fault_not_fired" not in done.stderr


def test_a_restarted_worker_does_not_report_its_first_incarnations_fault(tmp_path: Path) -> None:
    done = _run(tmp_path, [fail_at(rank=2, step=3, micro_batch=1)], UNICRON_WORKER_RESTARTS="1")
    assert done.returncode == 0 and unfired_faults(tmp_path / "faults.log") == []


THROTTLED = """
import json, time
from unicron_elastic.faults import maybe_fail
took = {}
for step in range(8):
    began = time.monotonic()
    for micro_batch in (2, 5):
        maybe_fail(2, step, micro_batch=micro_batch)
        time.sleep(0.02)  # the micro-batch's computation
    maybe_fail(2, step, bucket=0)
    time.sleep(0.01)  # the reduce: not a micro-batch, not stretched
    maybe_fail(2, step, at="before_optimizer_step")
    took[step] = time.monotonic() - began
print(json.dumps(took))
"""


def test_a_throttle_fault_stretches_the_micro_batches_of_its_steps_only(tmp_path: Path) -> None:
    throttled = throttle(rank=2, step=3, factor=3.0, steps=2)
    done = subprocess.run([sys.executable, "-c", THROTTLED], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **faults_env([throttled], str(tmp_path / "faults.log"))})
    assert done.returncode == 0, done.stderr
    took = {int(k): v for k, v in json.loads(done.stdout).items()}
    assert all(0.05 <= took[s] < 0.09 for s in (0, 1, 2, 5, 6, 7)), took  # 2 x 0.02 + 0.01
    # steps 3 and 4: 3 x each micro-batch's 0.02 s (micro-batch 2's stretch lands at the next point of the step,
    # the last one's at the step's first point after its micro-batches)
    assert all(0.13 <= took[s] < 0.2 for s in (3, 4)), took
    fired = [json.loads(line) for line in (tmp_path / "faults.log").read_text().splitlines()]
    assert [(f["kind"], f["step"], f["factor"], f["steps"]) for f in fired] == [("throttle", 3, 3.0, 2)]
    assert unfired_faults(tmp_path / "faults.log") == []


def test_a_throttle_fault_names_no_point_of_the_step() -> None:
    with pytest.raises(ValueError, match="micro_batch, bucket and at must be None"):
        Fault(1, 3, micro_batch=0, kind="throttle")
    with pytest.raises(ValueError, match="factor >= 1"):
        throttle(1, 3, factor=0.5)
