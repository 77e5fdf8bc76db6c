"""Warm workers: the pure decisions in-process; the pool's forks against plain subprocesses; unicron-run's fallback."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import BIN, EXAMPLES, wait_for
from unicron_elastic.agent.warm import pool as pool_module
from unicron_elastic.agent.warm.api import WarmConfig
from unicron_elastic.agent.warm.command import (
    PER_WORKER_NAMES,
    PythonCommand,
    auto_preload,
    env_mismatch,
    module_imports,
    parse_command,
    proc_image,
)
from unicron_elastic.agent.warm.pool import PoolState, WarmPool
from unicron_elastic.api import ConfigError
from unicron_elastic.processes import process_tree

WORKERS = Path(__file__).parent / "workers"
PROBE = str(WORKERS / "warm_probe.py")
PY = sys.executable

# -- pure decisions ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "expected"), [
    ([PY, "-u", "train.py", "--lr", "1"], PythonCommand("train.py", None, ("--lr", "1"), True)),
    ([PY, "train.py"], PythonCommand("train.py", None, (), False)),
    ([PY, "-u", "-m", "pkg.train", "-x"], PythonCommand(None, "pkg.train", ("-x",), True)),
    ([PY, "-mpkg", "a"], PythonCommand(None, "pkg", ("a",), False)),
    ([PY, "-u", "train.py", "-m", "x"], PythonCommand("train.py", None, ("-m", "x"), True)),  # (the script's -m)
])
def test_a_python_command_is_parsed_as_the_interpreter_reads_it(args: list[str], expected: PythonCommand) -> None:
    assert parse_command(args, PY) == expected


@pytest.mark.parametrize(("args", "said"), [
    (["/usr/bin/env", "python", "train.py"], "is not this Python"),
    (["/bin/true"], "is not this Python"),
    ([PY, "-X", "dev", "train.py"], "interpreter option '-X'"),
    ([PY, "-c", "print(1)"], "interpreter option '-c'"),
    ([PY, "-u"], "no script or module"),
    ([], "is not this Python"),
])
def test_a_command_a_fork_cannot_run_gets_the_reason(args: list[str], said: str) -> None:
    reason = parse_command(args, PY)
    assert isinstance(reason, str) and said in reason, reason


def test_argv_and_path0_are_the_interpreters() -> None:
    script = PythonCommand("sub/train.py", None, ("--x",), True)
    assert script.sys_argv() == ["sub/train.py", "--x"]
    assert script.sys_path0("/work") == os.path.realpath("/work/sub")
    assert PythonCommand(None, "m", (), False).sys_path0("/work") == "/work"


_NAMES = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12)


@given(base=st.dictionaries(_NAMES, st.text(max_size=5), max_size=8),
       per_worker=st.dictionaries(st.sampled_from(sorted(PER_WORKER_NAMES) + ["TORCHELASTIC_RUN_ID", "UNICRON_ROUND",
                                                                             "NCCL_DEBUG", "TORCH_NCCL_BLOCKING"]),
                                  st.text(max_size=5)),
       other=st.dictionaries(_NAMES.map(lambda n: "X" + n), st.text(max_size=5), max_size=3))
def test_only_variables_read_after_start_up_may_differ(base, per_worker, other) -> None:
    assert env_mismatch(base, {**base, **per_worker}) == []
    changed = {name: value for name, value in other.items() if base.get(name) != value}
    assert env_mismatch(base, {**base, **per_worker, **other}) == sorted(changed)
    if base:  # a variable the worker lacks counts too
        name = next(iter(base))
        if name not in PER_WORKER_NAMES and not name.startswith(("TORCHELASTIC_", "UNICRON_", "NCCL_", "TORCH_NCCL_")):
            assert name in env_mismatch(base, {k: v for k, v in base.items() if k != name})


def test_auto_preloads_the_installed_packages_the_script_imports(tmp_path: Path) -> None:
    (tmp_path / "mylocal.py").write_text("")
    (tmp_path / "train.py").write_text(
        "from __future__ import annotations\nimport json, os.path\nimport mylocal\nfrom . import sibling\n"
        "from hypothesis import given\nimport structlog.testing as st\nimport torch\n"
        "try:\n    import yaml\nexcept ImportError:\n    pass\nif True:\n    import pytest\n"
        "def f():\n    import rich\n")
    assert module_imports((tmp_path / "train.py").read_text()) == [
        "__future__", "json", "os.path", "mylocal", "hypothesis", "structlog.testing", "torch", "yaml", "pytest"]
    chosen = auto_preload(PythonCommand("train.py", None, (), True), str(tmp_path))
    yaml = ("yaml",) if importlib.util.find_spec("yaml") else ()
    assert chosen == ("hypothesis", "structlog.testing", "torch", "torch._dynamo", *yaml, "pytest")
    assert auto_preload(PythonCommand("missing.py", None, (), True), str(tmp_path)) == ()


def test_a_proc_image_fills_the_room_with_the_padding_variable_or_nuls() -> None:
    assert proc_image(b"A=1\0", 12, b"P=") == b"A=1\0P=     \0"
    assert proc_image(b"A=1\0", 6, b"P=") == b"A=1\0\0\0"  # (no room for the variable)
    assert proc_image(b"a\0b\0", 6) == b"a\0b\0\0\0"
    with pytest.raises(ValueError):
        proc_image(b"toolong", 3)


@pytest.mark.parametrize(("flag", "preload"), [(None, ("auto",)), ("auto", ("auto",)), ("none", ()), ("off", ()),
                                               ("torch, lightning", ("torch", "lightning"))])
def test_preload_flag(flag: str | None, preload: tuple[str, ...]) -> None:
    config = WarmConfig.from_flag(flag, spares=2)
    assert config.preload == preload and config.enabled == bool(preload) and config.spares == 2


@pytest.mark.parametrize(("flag", "spares"), [("torch;rm", 1), ("1torch", 1), ("torch", -1)])
def test_a_bad_preload_or_spares_is_refused(flag: str, spares: int) -> None:
    with pytest.raises(ConfigError):
        WarmConfig.from_flag(flag, spares=spares)


# -- the pool, against plain subprocesses -----------------------------------------------------


@pytest.fixture()
def pool():
    started = WarmPool(WarmConfig(preload=("json",), spares=1), [PY, "-u", PROBE, "0"])
    started.start()
    yield started
    started.close()


def _run(side: str, pool: WarmPool, ending: str, out: Path) -> tuple[int, dict, list[str], str]:
    args, env = [PY, "-u", PROBE, ending], dict(pool.environment, RANK="1", TORCHELASTIC_RESTART_COUNT="0")
    with open(out / f"{side}.out", "w") as stdout, open(out / f"{side}.err", "w") as stderr:
        if side == "warm":
            proc = pool.spawn(args, env, stdout.fileno(), stderr.fileno())
            assert proc is not None, pool.reason
        else:
            proc = subprocess.Popen(args, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        code = proc.wait(30)
    lines = (out / f"{side}.out").read_text().splitlines()
    return code, json.loads(lines[0]), lines[1:], (out / f"{side}.err").read_text()


@pytest.mark.parametrize("ending", ["0", "3", "raise", "kill", "intr", "thread"])
def test_a_forked_worker_is_the_process_a_plain_subprocess_would_be(pool: WarmPool, tmp_path: Path,
                                                                    ending: str) -> None:
    warm, cold = _run("warm", pool, ending, tmp_path), _run("cold", pool, ending, tmp_path)
    assert warm[0] == cold[0] == {"0": 0, "3": 3, "raise": 1, "kill": -signal.SIGKILL, "intr": -signal.SIGINT,
                                  "thread": 0}[ending]
    assert warm[1] == cold[1]  # argv, sys.path[0], __main__, its file, cwd, session, env, signals, mask, stdio
    assert warm[2] == cold[2]  # what it printed after: the thread's line, then atexit's (none after a SIGKILL)
    assert warm[3] == cold[3]  # stderr: the same traceback
    assert pool.state is PoolState.READY


def test_each_spare_used_is_replaced_and_closing_ends_the_zygote_and_spares(tmp_path: Path) -> None:
    warm = WarmPool(WarmConfig(preload=("json",), spares=2), [PY, PROBE, "0"])
    warm.start()
    try:
        _run("warm", warm, "0", tmp_path)
        spares = [s.pid for s in warm._spares]
        assert len(spares) == 2 and all(_alive(pid) for pid in spares)
        zygote = warm._zygote.pid
    finally:
        warm.close()
    assert not any(_alive(pid) for pid in [*spares, zygote])
    assert warm.state is PoolState.CLOSED


def test_a_preload_that_starts_a_thread_turns_the_pool_off_and_says_why(tmp_path: Path, monkeypatch,
                                                                          capture_log) -> None:
    logs = capture_log(pool_module)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]))
    unsafe = WarmPool(WarmConfig(preload=("json", "fork_unsafe")), [PY, PROBE, "0"])
    unsafe.start()
    try:
        assert unsafe.spawn([PY, "-u", PROBE, "0"], unsafe.environment, 1, 2) is None
    finally:
        unsafe.close()
    off = [e for e in logs.entries if e["event"] == "warm_workers_off"]
    assert len(off) == 1 and "importing fork_unsafe started a thread (fork-unsafe-watchdog)" in off[0]["reason"]


def test_a_worker_whose_start_up_environment_differs_is_a_plain_subprocess(pool: WarmPool, capture_log) -> None:
    logs = capture_log(pool_module)
    env = dict(pool.environment, PYTHONHASHSEED="7", RANK="3")
    assert pool.spawn([PY, "-u", PROBE, "0"], env, 1, 2) is None
    assert pool.spawn([PY, "-X", "dev", PROBE, "0"], pool.environment, 1, 2) is None
    said = [e["reason"] for e in logs.entries if e["event"] == "warm_worker_plain_subprocess"]
    assert len(said) == 2 and "PYTHONHASHSEED" in said[0] and "RANK" not in said[0] and "'-X'" in said[1]
    assert pool.state is PoolState.READY  # (the next worker may still be forked)


def test_a_zygote_that_died_turns_the_pool_off(pool: WarmPool, tmp_path: Path, capture_log) -> None:
    logs = capture_log(pool_module)
    _run("warm", pool, "0", tmp_path)  # (ready, a spare forked)
    os.kill(pool._zygote.pid, signal.SIGKILL)
    pool._zygote.wait(10)
    # The spare forked before still becomes the next worker (then no spare can be forked: the pool is off) ...
    proc = pool.spawn([PY, "-u", PROBE, "0"], pool.environment, 1, 2)
    assert proc is not None and proc.wait(30) == 0
    assert pool.state is PoolState.OFF and "stopped answering" in pool.reason
    assert pool.spawn([PY, "-u", PROBE, "0"], pool.environment, 1, 2) is None  # ... and the next is a plain one
    assert [e["event"] for e in logs.entries].count("warm_workers_off") == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # (a zombie of ours is not alive)
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return not Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


# -- through unicron-run ------------------------------------------------------------------------


def _launch(tmp_path: Path, *flags: str, script: str = os.path.join(EXAMPLES, "allreduce.py"),
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path), **(extra_env or {}))
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--log-format=json", *flags,
           script, "--out", str(tmp_path / "out")]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _events(stderr: str, name: str) -> list[dict]:
    events = (json.loads(line) for line in stderr.splitlines() if line.startswith("{"))
    return [e for e in events if e.get("event") == name]


def test_unicron_run_with_a_fork_unsafe_preload_starts_plain_workers_and_says_why(tmp_path: Path) -> None:
    pythonpath = os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")])
    result = _launch(tmp_path, "--preload", "torch,fork_unsafe", extra_env={"PYTHONPATH": pythonpath})
    assert result.returncode == 0, result.stderr[-3000:]
    off = _events(result.stderr, "warm_workers_off")
    assert len(off) == 1 and "importing fork_unsafe started a thread" in off[0]["reason"], result.stderr[-3000:]
    assert _events(result.stderr, "warm_workers_ready") == []
    assert result.stdout.count("all-reduce over 2 ranks = 3.0") == 1  # (rank 0 prints)


@pytest.mark.e2e
def test_an_agent_killed_alone_takes_its_zygote_and_spares_with_it(tmp_path: Path) -> None:
    # The node's launcher SIGKILLed (not its tree): its zygote and spares see their sockets close and end; the
    # workers, in sessions of their own, run on as torchrun's do (kill_node takes the whole tree).
    env = dict(os.environ, TMPDIR=str(tmp_path))
    hold = tmp_path / "hold"
    cmd = [os.path.join(BIN, "unicron-run"), "--standalone", "--nproc-per-node=2", "--preload=auto", "--spares=2",
           "--log-format=json",
           PY_SLEEPER, str(hold)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        tree = wait_for(lambda: _warm_tree(launcher.pid), 120, why="no zygote, spares and workers")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        wait_for(lambda: not any(_alive_anywhere(pid) for pid in tree["zygote"] + tree["spares"]), 30,
                 why=lambda: f"still running: {tree}")
        assert all(_alive_anywhere(pid) for pid in tree["workers"])
    finally:
        hold.write_text("")
        for pid in process_tree(launcher.pid)[1:]:
            os.kill(pid, signal.SIGKILL)


PY_SLEEPER = str(WORKERS / "warm_sleeper.py")


def _warm_tree(launcher: int) -> dict[str, list[int]] | None:
    """The launcher's zygote, spares and workers once all are there (workers show their own command line; the
    zygote and its spares the zygote's, the zygote started first)."""
    found: dict[str, list[int]] = {"zygote": [], "spares": [], "workers": []}
    forks = []
    for pid in process_tree(launcher)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            started = int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[19])
        except OSError:
            continue
        if b"unicron_elastic.agent.warm.zygote" in cmdline:
            forks.append((started, pid))
        elif b"warm_sleeper.py" in cmdline:
            found["workers"].append(pid)
    forks.sort()
    found["zygote"], found["spares"] = [pid for _, pid in forks[:1]], [pid for _, pid in forks[1:]]
    return found if len(found["zygote"]) == 1 and len(found["spares"]) == 2 and len(found["workers"]) == 2 else None


def _alive_anywhere(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.compat
def test_torchs_process_context_starts_its_workers_from_the_pool(tmp_path: Path) -> None:
    # The seam (_torch_compat.use_warm_pool): torch's SubprocessContext builds each handler through the module
    # attribute the pool replaces; its worker is then a WarmProcess, and torch reads its result as a Popen's.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    from unicron_elastic.agent import _torch_compat
    from unicron_elastic.agent.warm.process import WarmProcess

    pool = WarmPool(WarmConfig(preload=("json",)), [PY, "-u", PROBE, "0"])  # (here: its environment is the test's)
    pool.start()
    _torch_compat.use_warm_pool(pool)
    try:
        context = start_processes(
            name="warm", entrypoint=PY, args={0: ("-u", PROBE, "0"), 1: ("-u", PROBE, "3")},
            envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))
        assert all(isinstance(h.proc, WarmProcess) for h in context.subprocess_handlers.values())
        result = wait_for(lambda: context.wait(0), 60, why="the workers did not end")
        assert result.failures[1].exitcode == 3 and 0 not in result.failures
        context.close()
    finally:
        _torch_compat.use_warm_pool(None)
        pool.close()
    stdout = next(tmp_path.rglob("0/stdout.log")).read_text().splitlines()
    assert json.loads(stdout[0])["env"]["RANK"] == "0" and stdout[1] == "atexit ran"


def test_what_a_worker_imported_after_it_started_is_preloaded_next_time(tmp_path: Path, monkeypatch) -> None:
    # --preload auto: a forked worker that ends records the modules it imported beyond its zygote's (here
    # `decimal`, imported inside main); the next pool for the same script preloads them.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = tmp_path / "late.py"
    script.write_text("import json\nif __name__ == '__main__':\n    import decimal\n    print(decimal.Decimal(1))\n")
    for _ in range(2):
        warm = WarmPool(WarmConfig(), [PY, "-u", str(script)])
        warm.start()
        try:
            proc = warm.spawn([PY, "-u", str(script)], warm.environment, 1, 2)
            assert proc is not None and proc.wait(30) == 0
            preloaded = warm.preloaded
        finally:
            warm.close()
    assert "decimal" in preloaded and "__main__" not in preloaded
    assert [p.suffix for p in (tmp_path / "cache" / "unicron" / "warm").iterdir()] == [".json"]
