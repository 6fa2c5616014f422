"""structlog setup shared by all services: one line per event on stderr, request ids bound by callers."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    level_name = (level or os.environ.get("SPECDEC_LOG_LEVEL", "info")).upper()
    json = os.environ.get("SPECDEC_LOG_FORMAT", "console") == "json"
    # JSON lines carry an exception's traceback as structured data (not `"exc_info": true`).
    renderer = ([structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()] if json
                else [structlog.dev.ConsoleRenderer(colors=False)])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service=service)
