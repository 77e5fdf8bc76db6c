"""Project conventions that must stay true."""

from __future__ import annotations

import re
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
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == commands


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
