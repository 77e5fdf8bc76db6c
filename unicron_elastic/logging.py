"""structlog configuration, done once by the command-line entry points.

Library modules only call ``structlog.get_logger(__name__)``; the CLIs call
:func:`configure_logging`. Output is JSON lines when stderr is not a TTY (or
``--log-format json``), a readable console format otherwise. stdlib logging
(torch's own loggers) goes through the same renderer; in JSON, an exception's
traceback is the ``exception`` field of its line.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import Processor

from unicron_elastic.env import log_level

_CONFIGURED = False


def configure_logging(fmt: str = "auto", level: str | int | None = None) -> None:
    """Configure structlog and stdlib logging for a CLI process.

    Args:
        fmt: ``auto`` (JSON unless stderr is a TTY), ``json`` or ``console``.
        level: Log level; default ``$UNICRON_LOG_LEVEL`` or INFO.

    Raises:
        ValueError: ``fmt`` is not one of the three formats.
    """
    global _CONFIGURED
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format {fmt!r} must be auto, json or console")
    level = level or log_level()
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    # JSON: the traceback goes into the line (``"exception": "Traceback ..."``); the
    # console renderer formats exceptions itself.
    renderers: list[Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] if as_json
        else [structlog.dev.ConsoleRenderer()]
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    _CONFIGURED = True
