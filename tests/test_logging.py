"""Log configuration of the CLIs: JSON lines carry exceptions with their traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, structlog
    from unicron_elastic.logging import configure_logging
    configure_logging({fmt!r})
    try:
        1 / 0
    except ZeroDivisionError:
        structlog.get_logger("unicron_elastic.x").exception("structlog_failure", rank=3)
    try:
        {{}}["missing_key"]
    except KeyError:
        logging.getLogger("torch.distributed").exception("foreign_failure")
    structlog.get_logger("unicron_elastic.x").warning("no_exception")
""")


def _run(fmt: str) -> str:
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(fmt=fmt)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_json_logs_carry_the_traceback_of_structlog_and_stdlib_exceptions() -> None:
    lines = [json.loads(line) for line in _run("json").splitlines()]
    by_event = {line["event"]: line for line in lines}
    assert len(lines) == 3, lines  # one JSON line each: the traceback is inside, not after
    structlog_line, foreign = by_event["structlog_failure"], by_event["foreign_failure"]
    assert structlog_line["rank"] == 3 and structlog_line["level"] == "error"
    for line, text in ((structlog_line, "ZeroDivisionError: division by zero"), (foreign, "KeyError: 'missing_key'")):
        assert line.get("exc_info") is not True
        assert "Traceback (most recent call last)" in line["exception"] and text in line["exception"]
    assert "exception" not in by_event["no_exception"]


def test_console_logs_still_show_the_traceback() -> None:
    err = _run("console")
    assert "ZeroDivisionError" in err and "missing_key" in err
