"""Project conventions that must stay true."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from conftest import REPO

ROOT = Path(REPO)


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README must start with a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_them() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    steps = re.findall(r"^timed [\w-]+ (.+?)(?:  #.*)?$", (ROOT / ".ci/run").read_text(), re.M)
    assert steps[0] == "bash .ci/system-packages"  # Debian's SLURM, when missing (the README says so) ...
    assert steps[1:3] == commands  # ... the README's commands: the default tier ...
    assert steps[3:] == ["bash .ci/compat", 'python -m pytest -m "e2e and not matrix"']  # ... compat, e2e, each timed


def test_the_readme_names_each_test_tier_with_its_command() -> None:
    text = (ROOT / "README.md").read_text()
    for command in ("`python -m pytest`", '`bash .ci/system-packages && python -m pytest -m "e2e and not matrix"`',
                    "`python -m pytest -m matrix`"):
        assert command in text
    assert not re.search(r"\b[A-Z0-9]+_TIME\b", text), "a placeholder left in the README"
    markers = (ROOT / "pyproject.toml").read_text()
    assert "'not e2e and not matrix'" in markers and "--durations=20" in markers  # the default tier, timed


def test_no_numbered_work_sessions_in_the_project() -> None:
    pattern = re.compile(r"session [0-9]", re.I)
    paths = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "benchmarks").rglob("*"), *(ROOT / "unicron_elastic").rglob("*.py")]
    offenders = [str(p) for p in paths if p.is_file() and pattern.search(p.read_text(errors="replace"))]
    assert offenders == []


def test_every_module_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"unicron_elastic/[A-Za-z0-9_/]+\.py", text))
    assert named, "docs/architecture.md names no module"
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_the_compat_environment_installs_each_dependency_at_the_lower_bound_pyproject_states() -> None:
    import tomllib  # (the test tools' Python: 3.11+)

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(line.split("==") for line in (ROOT / "constraints-oldest.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    for dependency in map(Requirement, project["dependencies"]):
        lower = next(Version(s.version) for s in dependency.specifier if s.operator == ">=")
        pinned = Version(pins[dependency.name])
        assert pinned.release[:len(lower.release)] == lower.release, (dependency, pinned)  # the bound itself
        assert dependency.specifier.contains(pinned), (dependency, pinned)
    oldest_python = Version(project["requires-python"].removeprefix(">="))
    assert f"python{oldest_python}" in (ROOT / ".ci/compat").read_text()


def test_constraints_pin_cpu_torch() -> None:
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_modules_only_get_loggers_configuration_lives_in_logging_py() -> None:
    offenders = []
    for path in (ROOT / "unicron_elastic").rglob("*.py"):
        text = path.read_text()
        if path.name == "logging.py":
            continue
        if "structlog.configure(" in text or "logging.basicConfig(" in text:
            offenders.append(str(path))
        for match in re.finditer(r"structlog\.get_logger\(([^)]*)\)", text):
            if match.group(1) != "__name__":
                offenders.append(f"{path}: get_logger({match.group(1)})")
    assert offenders == []


def test_the_readmes_feature_table_rows_are_short() -> None:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## What is there today"):].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) > 5
    assert [row[:60] for row in rows if len(row) > 400] == []


def split_comments(source: str) -> list[int]:
    """The lines whose trailing comment opens a "(" it does not close and goes on in the next line's trailing comment.

    That is one sentence broken over two lines of code (``if x:  # (once, not per`` and ``f()  # micro-batch)``);
    it is written as a plain sentence on its own lines above the code instead.
    """
    trailing = {token.start[0]: token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT and token.line[:token.start[1]].strip()}
    return [line for line, text in sorted(trailing.items())
            if text.count("(") > text.count(")") and line + 1 in trailing]


def test_no_comment_of_the_package_is_one_sentence_split_over_two_lines_of_code() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "unicron_elastic").rglob("*.py"))
             for line in split_comments(path.read_text())]
    assert found == [], "a comment split over two lines of code: write it as a sentence above the code"


def test_the_split_comment_check_finds_one_and_spares_a_closed_one_and_a_comment_block() -> None:
    source = ("if x:  # (a stage that scales no loss: once, not per\n"
              "    f()  # micro-batch)\n"
              "g()  # (closed)\n"
              "h()  # next\n"
              "# (a comment of its own\n"
              "# line goes on)\n"
              "i()  # (open, but the next line has no comment\n"
              "j()\n")
    assert split_comments(source) == [1]
