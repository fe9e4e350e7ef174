"""The wrong-collective fault's wrapper: the armed all-reduce, blocking or posted, becomes a broadcast."""

from __future__ import annotations

import pytest
import torch

from eplb_fsm.fsm.collectives import Collectives, flags
from eplb_fsm.sim.wrong_collective import Done, WrongCollective
from eplb_fsm.trace import EventTrace


class _Injector:
    """Arms the fault for the first ``armed`` calls of take_wrong; records the notes."""

    def __init__(self, armed: int) -> None:
        self.armed, self.notes = armed, []

    def take_wrong(self):
        if self.armed:
            self.armed -= 1
            return "wrong-collective"
        return None

    def note(self, inj, what: str) -> None:
        self.notes.append(what)


def _wrapped(armed: int) -> WrongCollective:
    inner = Collectives(None, 0, 1, EventTrace(keep=True), torch.device("cpu"), 5.0, "local")
    wrapped = WrongCollective(inner, _Injector(armed))
    wrapped.broadcast = lambda parts, timeout_s: {name: -t for name, t in parts.items()}   # no group here
    return wrapped


def test_an_armed_post_is_sent_as_the_broadcast_and_read_later():
    """Once armed, post() sends the broadcast at once and wait() hands its result over; the note says so."""
    wrapped = _wrapped(armed=1)
    posted = wrapped.post({"ready": flags(1.0, 0.0, 0.0)}, 5.0)
    assert isinstance(posted, Done) and posted.wait()["ready"].tolist() == [-1.0, 0.0, 0.0]
    assert wrapped.injector.notes == ["broadcast instead of the posted all-reduce of ['ready']"]


def test_unarmed_calls_go_to_the_wrapped_collectives():
    """Without the fault armed, post and all_reduce are the wrapped object's (the sum, world 1)."""
    wrapped = _wrapped(armed=0)
    assert wrapped.post({"ready": flags(1.0, 0.0, 0.0)}, 5.0).wait()["ready"].tolist() == [1.0, 0.0, 0.0]
    assert wrapped.all_reduce({"x": flags(2.0)}, 5.0)["x"].tolist() == [2.0]
    assert wrapped.injector.notes == []


def test_done_raises_what_the_collective_raised_when_read():
    """A broadcast that failed inside post() raises from wait(), as a posted all-reduce would."""
    def fail(*_):
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        Done(fail).wait()
