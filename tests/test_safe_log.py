"""safe_log: a log call on a failure path returns False instead of raising, and warnings are retried sparsely."""

from __future__ import annotations

import pytest

from eplb_fsm.safe_log import log_safely, retry_due


class Logger:
    """A logger whose every call raises ``error`` (None: records the call)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.calls = error, []

    def warning(self, event, **fields):
        if self.error is not None:
            raise self.error
        self.calls.append((event, fields))


def test_a_log_that_gets_out_is_passed_on_whole():
    """The event and its fields reach the logger, and the call says it got out."""
    logger = Logger()
    assert log_safely(logger, "warning", "eplb trace write failed", path="x", errors=3) is True
    assert logger.calls == [("eplb trace write failed", {"path": "x", "errors": 3})]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), BrokenPipeError(), ValueError("closed")])
def test_a_log_whose_stream_fails_returns_false(error):
    """A full disk, a gone reader or a closed stream under the log: False, no exception."""
    assert log_safely(Logger(error), "warning", "eplb stuck") is False


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(1)])
def test_an_interrupt_inside_a_log_still_reaches_its_handler(error):
    """Ctrl-C or a handler's exit during the log is not swallowed."""
    with pytest.raises(type(error)):
        log_safely(Logger(error), "warning", "eplb stuck")


def test_warnings_are_retried_at_powers_of_two():
    """retry_due holds at the 1st, 2nd, 4th, 8th... failure and nowhere else."""
    assert [n for n in range(0, 70) if retry_due(n)] == [1, 2, 4, 8, 16, 32, 64]
