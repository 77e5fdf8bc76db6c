"""What the README and benchmarks/RESULTS.md claim is what the benchmark scripts print and check.

* Every figure the README's tables quote (the benchmarks' row figures and the
  paper's evaluation) is in the section of benchmarks/RESULTS.md of the command
  the row names: one source for figures.
* ``transition.py --only-hang`` counts restarted survivors and lost steps from
  a run's own files (its judgement, in process, on files laid out as a run
  writes them).
* ``etcd_failover.py`` fails, saying why, when the store's failover is
  disabled (a client pinned to one endpoint; e2e: a real cluster and job).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

BENCHMARKS = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCHMARKS)

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?![\d])")


def _plain(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u00d7", "x")


def _numbers(text: str) -> list[str]:
    return NUMBER.findall(_plain(text))


def _results_sections() -> dict[str, str]:
    """benchmarks/RESULTS.md's sections by the command in their heading (``transition.py --only-hang``)."""
    text = Path(BENCHMARKS, "RESULTS.md").read_text()
    sections = {}
    for heading, body in re.findall(r"^## `([^`]+)`[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M):
        sections[heading.strip()] = _plain(body)
    return sections


def _readme_tables() -> list[tuple[str, list[str]]]:
    """The README's rows that quote figures: ``(figure text, the RESULTS sections it cites)``."""
    text = Path(REPO, "README.md").read_text()
    rows = []
    today = text[text.index("## What is there today"):text.index("### The paper's evaluation")]
    for line in today.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[2] in ("—", "latest figure (command)") or set(cells[2]) <= {"-", " "}:
            continue
        commands = re.findall(r"`((?:python benchmarks/|unicron )[^`]+)`", cells[2])
        figure = re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)", "", cells[2])  # the commands and links are not figures
        rows.append((figure, [_section_of(command) for command in commands]))
    evaluation = text[text.index("### The paper's evaluation"):text.index("The Oobleck/Bamboo/Varuna")]
    for line in evaluation.splitlines():
        if re.match(r"\| trace-[ab], ours", line):
            rows.append((line, ["unicron simulate all"]))
    return rows


def _section_of(command: str) -> str:
    """The RESULTS.md heading of a command the README names: ``transition.py --skip-torch`` for
    ``python benchmarks/transition.py --skip-torch``, ``unicron simulate all`` as it is."""
    if command.startswith("unicron "):
        return command
    words = command.removeprefix("python benchmarks/").split()
    flags = [w for w in words[1:] if w.startswith("--") and w not in ("--runs",)]
    return " ".join([words[0], *flags[:1]])


def unheld(figure: str, cited: list[str], sections: dict[str, str]) -> list[str]:
    """The numbers of ``figure`` that none of the ``cited`` RESULTS.md sections holds (as a whole number)."""
    held = " ".join(sections[name] for name in cited)
    return [number for number in _numbers(figure)
            if not re.search(rf"(?<![\w.]){re.escape(number)}(?![\d])", held)]


def test_every_figure_the_readme_quotes_is_in_the_results_section_of_its_command() -> None:
    sections = _results_sections()
    rows = _readme_tables()
    assert len(rows) >= 10, "the README's tables were not found"
    for figure, cited in rows:
        assert cited, f"a README figure without the command that measured it: {figure!r}"
        missing = [name for name in cited if name not in sections]
        assert not missing, f"README cites {missing}: no such section in benchmarks/RESULTS.md"
        assert unheld(figure, cited, sections) == [], \
            f"README quotes {unheld(figure, cited, sections)} ({figure.strip()!r}), not in RESULTS.md's {cited}"


def test_a_figure_results_does_not_hold_is_found() -> None:
    """The check above can fail: the hang row as the README once quoted it (an earlier run, rounded)."""
    sections = _results_sections()
    assert unheld("hung rank → step 0.62 s, frozen node 2.2 s", ["transition.py --only-hang"], sections) == \
        ["0.62", "2.2"]


# -- transition.py --only-hang: the survivors' restarts and lost steps, from the run's own files ------------
def _run_files(out: Path, pids: dict[int, list[int]], steps: dict[int, list[int]], restarted: list[int]) -> None:
    out.mkdir()
    for rank, done in steps.items():
        reports = [{"step": s, "pid": pids[rank][min(i, len(pids[rank]) - 1)], "finished_at": 1.0 + s}
                   for i, s in enumerate(done)]
        (out / f"rank{rank}.json").write_text(json.dumps(reports))
    events = [{"event": "worker_restarted", "rank": rank, "pid": 99} for rank in restarted]
    (out / "node0.log").write_text("not json\n" + "\n".join(json.dumps(e) for e in events) + "\n")
    (out / "node1.log").write_text(json.dumps({"event": "error_event", "rank": 2}) + "\n")


def test_the_hang_rows_count_survivor_restarts_and_lost_steps_from_the_runs_files(tmp_path: Path) -> None:
    from transition import hang_survivors, survivor_checks

    assert hang_survivors(node_fault=False) == [0, 1, 3] and hang_survivors(node_fault=True) == [0, 1]
    clean = tmp_path / "clean"
    _run_files(clean, {0: [10], 1: [11], 3: [13]}, {0: list(range(6)), 1: list(range(6)), 3: list(range(6))}, [2])
    assert survivor_checks(clean, [0, 1, 3], 6) == (0, 0, [])  # rank 2's restart is expected: not a survivor's
    bad = tmp_path / "bad"
    _run_files(bad, {0: [10, 20], 1: [11], 3: [13]}, {0: list(range(6)), 1: [0, 1, 2, 4, 5], 3: [0, 1, 2, 2, 3, 4, 5]},
               [3])
    restarts, lost, problems = survivor_checks(bad, [0, 1, 3], 6)
    assert (restarts, lost) == (2, 2)  # rank 3 restarted by its agent, rank 0 ran as two processes; 3 and 2 again
    assert any("rank 0 ran as 2 processes" in p for p in problems) and any("rank 1 completed" in p for p in problems)
    missing = tmp_path / "missing"
    _run_files(missing, {0: [10]}, {0: list(range(6))}, [])
    assert survivor_checks(missing, [0, 1], 6)[1] == 6  # no report from rank 1: every step of it lost


# -- etcd_failover.py: fails when the store cannot fail over ---------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_etcd_failover_benchmark_fails_saying_why_when_the_store_is_pinned_to_one_endpoint() -> None:
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "etcd_failover.py"), "--runs", "1",
                           "--victim", "in use", "--pin-endpoint"], capture_output=True, text=True, timeout=380,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "checks: FAILED" in done.stdout and "the job did not ride out the loss: in use:" in done.stdout
    assert "lease lapsed" in done.stdout or "the launcher exited" in done.stdout, done.stdout[-3000:]
