"""Log calls on failure paths that can never raise: the log's own stream may be what failed.

structlog's default logger prints each message to stdout and flushes it. When stdout is a
full disk (often the same disk as the traces), a pipe whose reader is gone or /dev/full,
that print raises. On a path that is already handling a failure (a trace write that
failed, a liveness beat or a watchdog check that raised), such an exception would escape
into the engine's step or end a thread that must go on, so it is swallowed here: the
caller's own counter (``EventTrace.write_errors``, ``Liveness.errors``) stays readable.
"""

from __future__ import annotations

from typing import Any

__all__ = ["log_safely", "retry_due"]


def log_safely(logger: Any, level: str, event: str, **fields: Any) -> bool:
    """``logger.<level>(event, **fields)``; False instead of an exception when logging itself failed."""
    try:
        getattr(logger, level)(event, **fields)
        return True
    except Exception:   # not BaseException: a KeyboardInterrupt or SystemExit still reaches its handler
        return False


def retry_due(count: int) -> bool:
    """True at the 1st, 2nd, 4th, 8th... failure: when a warning that did not get out is tried again."""
    return count > 0 and count & (count - 1) == 0
