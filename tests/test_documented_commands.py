"""Every command with a planned fault in the README, the docs and the examples' docstrings does what its text says.

Each such command is found in its file (a ``bash`` block of a Markdown file, a
``::`` block of an example's docstring) and must be listed in :data:`CLAIMS`
with the words its text says about the fault. The default tier checks, in
process, that those words are there and that the fault can fire where they say:
the example's own parser reads the command's flags, and the rank's share of
that step's micro-batches (dealt round-robin over the data-parallel members)
holds the micro-batch at the position the words name. The e2e tier runs each
command under ``unicron-run`` until its fault fires, checks where it fired,
and stops the run there (no example is run to its end).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES, REPO
from unicron_elastic.faults import FAULT_LOG_ENV, FAULTS_ENV, planned_faults
from unicron_elastic.strategy.microbatch import deal
from unicron_elastic.testing import kill_node

sys.path.insert(0, EXAMPLES)  # the examples' parsers (lightning_demo_transformer imports lightning_gpt)

DOCUMENTS = ["README.md", *sorted(f"docs/{p.name}" for p in Path(REPO, "docs").glob("*.md")),
             *sorted(f"examples/{p.name}" for p in Path(EXAMPLES).glob("*.py"))]

#: (file, script, (rank, step, micro-batch)) -> (what the text says, next to the command; the micro-batch's position
#: among the rank's micro-batches of that step: 0 its first, 1 its second, -1 its last; None: a step-level fault)
CLAIMS: dict[tuple[str, str, tuple[int, int, int | None]], tuple[str, int | None]] = {
    ("README.md", "resilient_worker.py", (1, 8, None)):
        ("rank 1 started twice (new PID, resumes at step 8)", None),
    ("README.md", "lightning_gpt.py", (2, 1, 5)):
        ("Rank 2 is SIGKILLed before its last micro-batch of step 1", -1),
    ("README.md", "lightning_gpt.py", (5, 3, 3)):
        ("Rank 5 is SIGKILLed in step 3, before its replica's second micro-batch", 1),
    ("docs/strategy.md", "lightning_gpt.py", (2, 1, 5)):
        ("Rank 2 is SIGKILLed before its last micro-batch of step 1", -1),
    ("docs/strategy.md", "lightning_gpt.py", (5, 3, 3)):
        ("before replica 1's second micro-batch", 1),
    ("examples/lightning_gpt.py", "lightning_gpt.py", (2, 3, 5)):
        ("killing rank 2 in the middle of step 3, before its second micro-batch", 1),
    ("examples/lightning_gpt.py", "lightning_gpt.py", (5, 3, 3)):
        ("killing rank 5 (replica 1, stage 0, tensor rank 1) before its replica's second micro-batch of step 3", 1),
    ("docs/strategy.md", "megatron_gpt.py", (5, 3, 1)):
        ("Rank 5 is SIGKILLed before its replica's first micro-batch of step 3", 0),
    ("examples/megatron_gpt.py", "megatron_gpt.py", (5, 3, 1)):
        ("killing rank 5 (replica 1, stage 0, tensor rank 1) before its replica's first micro-batch of step 3", 0),
    ("examples/lightning_demo_transformer.py", "lightning_demo_transformer.py", (0, 1, 3)):
        ("killing rank 0 in step 1 before its second micro-batch", 1),
}


@dataclass(frozen=True)
class Command:
    """One documented command that plans a fault."""

    document: str
    env: dict[str, str]
    launcher: list[str]  # the launcher and its flags
    script: str
    args: list[str]  # the script's

    @property
    def nproc(self) -> int:
        flags = " ".join(self.launcher)
        match = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", flags)
        return int(match.group(1)) if match else 1

    def fault(self) -> tuple[int, int, int | None]:
        """(rank, step, micro-batch) of the fault it plans."""
        if FAULTS_ENV in self.env:
            (spec, fault), = planned_faults(self.env[FAULTS_ENV])
            return fault.rank, fault.step, fault.micro_batch
        args = parsed(self)
        return args.kill_rank, args.kill_step, args.kill_micro_batch


def _blocks(document: str) -> list[str]:
    """The shell lines of a file's examples, continuation lines joined."""
    text = Path(REPO, document).read_text()
    if document.endswith(".md"):
        chunks = [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)
                  if lang in ("bash", "sh", "console", "")]
    else:
        doc = ast.get_docstring(ast.parse(text)) or ""
        chunks = re.findall(r"::\n\n((?:    .*\n?|\n)+)", doc)
    lines = []
    for chunk in chunks:
        lines += [line.strip() for line in chunk.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def documented_commands() -> list[Command]:
    found = []
    for document in DOCUMENTS:
        for line in _blocks(document):
            if "--kill-rank" not in line and f"{FAULTS_ENV}=" not in line:
                continue
            tokens = shlex.split(line, comments=True)
            env = {}
            while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
                name, _, value = tokens.pop(0).partition("=")
                env[name] = value
            at = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
            found.append(Command(document, env, tokens[:at], tokens[at], tokens[at + 1:]))
    return found


def parsed(command: Command):
    """The command's script arguments as the script's own parser reads them (scripts that have one)."""
    module = __import__(Path(command.script).stem)
    return module.build_parser().parse_args(command.args)


def _words(document: str) -> str:
    return " ".join(Path(REPO, document).read_text().split())


COMMANDS = documented_commands()


def test_every_documented_fault_command_is_checked() -> None:
    found = {(c.document, Path(c.script).name, c.fault()) for c in COMMANDS}
    assert found == set(CLAIMS), ("a documented command with a fault whose claim is not checked here, or a claim "
                                  f"whose command is gone: {found ^ set(CLAIMS)}")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.document}:{Path(c.script).name}:{c.fault()}")
def test_the_text_says_where_the_fault_fires_and_it_can_fire_there(command: Command) -> None:
    words, position = CLAIMS[(command.document, Path(command.script).name, command.fault())]
    assert " ".join(words.split()) in _words(command.document), f"{command.document} no longer says {words!r}"
    rank, step, micro_batch = command.fault()
    assert 0 <= rank < command.nproc
    if position is None:  # a step-level fault: the worker reaches the step
        steps = int(command.args[command.args.index("--steps") + 1])
        assert step < steps
        return
    args = parsed(command)
    assert step < args.steps
    size = getattr(args, "tensor_parallel", 1) * getattr(args, "pipeline_parallel", 1)
    members = [int(r) for r in args.members.split(",")] if getattr(args, "members", None) else \
        list(range(command.nproc // size))
    own = deal(args.global_batch // args.micro_batch, members)[rank // size]
    assert micro_batch in own, f"rank {rank} computes {own} at step {step}: the fault would never fire"
    assert own.index(micro_batch) == position % len(own), f"micro-batch {micro_batch} of {own}: not position {position}"


def test_a_kill_the_rank_never_reaches_is_refused_with_the_reason() -> None:
    import lightning_gpt

    parser = lightning_gpt.build_parser()
    with pytest.raises(SystemExit):
        lightning_gpt.kill_fault(parser, 2, 3, 1, steps=6, world=3, micro_batches=6)
    fault = lightning_gpt.kill_fault(parser, 2, 3, 5, steps=6, world=3, micro_batches=6)
    assert (fault.rank, fault.step, fault.micro_batch) == (2, 3, 5)
    with pytest.raises(SystemExit):  # replica 1 (ranks 4-7) computes 1, 3, 5
        lightning_gpt.kill_fault(parser, 5, 3, 2, steps=8, world=8, micro_batches=6, replica_size=4)
    with pytest.raises(SystemExit):  # the run ends before
        lightning_gpt.kill_fault(parser, 2, 6, 5, steps=6, world=3, micro_batches=6)


# -- each command, run until its fault fires ----------------------------------------------------------
def _unique() -> list[Command]:
    seen, unique = set(), []
    for command in COMMANDS:
        key = (tuple(sorted(command.env.items())), tuple(command.launcher), command.script, tuple(command.args))
        if key not in seen:
            seen.add(key)
            unique.append(command)
    return unique


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", _unique(), ids=lambda c: f"{Path(c.script).name}:{c.fault()}")
def test_the_documented_command_fires_its_fault_where_it_says(command: Command, tmp_path: Path) -> None:
    args = list(command.args)
    if "--out" in args:
        args[args.index("--out") + 1] = str(tmp_path / "out")
    log = tmp_path / "out" / "faults.log"  # (where the examples' --kill-* flags log it)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": BIN + os.pathsep + os.environ["PATH"], **command.env}
    if FAULTS_ENV in command.env:
        env[FAULT_LOG_ENV] = str(log)
    launcher = [os.path.join(BIN, command.launcher[0]), *command.launcher[1:]]
    with open(tmp_path / "run.log", "w") as out:
        proc = subprocess.Popen([*launcher, os.path.join(REPO, command.script), *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 480
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None, f"the run ended (code {proc.returncode}) before its fault fired: " + \
                (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the fault did not fire in 480 s"
            time.sleep(0.1)
    finally:
        kill_node(proc.pid)
        proc.wait()
    fired = json.loads(log.read_text().splitlines()[0])
    assert (fired["rank"], fired["step"], fired.get("micro_batch")) == command.fault()
