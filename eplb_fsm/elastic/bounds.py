"""Elastic EP: one deadline for a whole scale, so a stalled rank is detected in bounded time.

A scale runs several waits in sequence (the joiners' answers, the ``scale_check``
agreement, the new group forming, the ``scale_ready`` agreement, the joiners'
``scale_go`` and handover, the scale's planning all-reduce, each layer's transfer and
agreement, then a salvage, partial-switch or rollback agreement after a fault).
Each has its own timeout, and a stalled rank used to make every one of them run out in
turn (T_f + 2T + 4T + 5 s, then the caller's own deadline). Here every wait of one scale
gets the time left before one deadline instead (pure arithmetic; the clock is injected):

- ``forward_s = T_f + 2 T + 5``: the prepare phase (the joiners' answers within T_f,
  T_f the request's ``timeout_s``, default T = ``collective_timeout_s``; the ``scale_check``
  agreement and forming the new group by ``forward_s - (T + 5)``, so that the
  ``scale_ready`` agreement, which decides between an abort on the intact old group and a
  failure, always has :attr:`ScaleDeadline.ready_room_s` = T + 5 s left for a peer whose
  build ran to its own cap), then every agreement, handover and transfer of the scale's
  rearrangement; a wait that starts later than that fails at once (after
  :data:`MIN_WAIT_S`). A message already in flight at the deadline still has its own
  T (the transfer communicator's per-message timeout).
- ``bound_s = forward_s + 2 T + 5 = T_f + 4 T + 10``: the salvage (scale-down) or
  rollback (scale-up) agreement after a fault, which needs the peers still waiting out
  their in-flight transfer (T) to arrive.

So a rank whose peer stalls anywhere in a scale returns from ``request_scale`` (outcome
``aborted`` or ``failed``, ``phase`` naming where) within ``bound_s`` seconds of the
request. docs/debugging-hangs.md ("Bounds") states the bound per phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from eplb_fsm.maps import check_seconds

__all__ = ["GRACE_S", "MIN_WAIT_S", "ScaleDeadline", "scale_bounds"]

GRACE_S = 5.0      # seconds each stage adds for the peers' own bookkeeping between waits
MIN_WAIT_S = 0.05  # what a wait past the deadline still gets (a zero timeout is no timeout to gloo)


def scale_bounds(form_timeout_s: float, timeout_s: float) -> tuple[float, float]:
    """``(forward_s, bound_s)`` of a scale: seconds from its request to the end of the forward
    part (forming .. last layer) and to the end of any recovery agreement (see the module doc)."""
    form = check_seconds(form_timeout_s, "form_timeout_s")
    timeout = check_seconds(timeout_s, "timeout_s")
    forward = form + 2.0 * timeout + GRACE_S
    return forward, forward + 2.0 * timeout + GRACE_S


@dataclass
class ScaleDeadline:
    """The deadlines of one scale on one rank, from ``started`` (``clock()`` when it began).

    ``clock``: monotonic seconds (``time.monotonic``; tests pass a fake one).
    """

    form_timeout_s: float
    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=-1.0)

    def __post_init__(self) -> None:
        self.forward_s, self.bound_s = scale_bounds(self.form_timeout_s, self.timeout_s)
        if self.started < 0:
            self.started = self.clock()

    @property
    def forward_end(self) -> float:
        return self.started + self.forward_s

    @property
    def end(self) -> float:
        return self.started + self.bound_s

    @property
    def ready_room_s(self) -> float:
        """What the prepare phase keeps of the forward deadline for its ``scale_ready`` agreement:
        T + :data:`GRACE_S`, so that ranks that reached ``scale_check`` together all reach ``scale_ready``
        however long a peer's build ran. Requests must come within T of each other, as for any collective:
        ``scale_check`` waits at least that long for a late peer."""
        return self.timeout_s + GRACE_S

    def left(self, own_timeout_s: float, recovery: bool = False) -> float:
        """What a wait with its own ``own_timeout_s`` gets now: never past the deadline
        (the recovery one with ``recovery``), never less than :data:`MIN_WAIT_S`."""
        end = self.end if recovery else self.forward_end
        return max(min(float(own_timeout_s), end - self.clock()), MIN_WAIT_S)

    def before_ready(self, own_timeout_s: float) -> float:
        """:meth:`left` for the prepare phase's waits before ``scale_ready`` (the ``scale_check``
        agreement, the builds): they end :attr:`ready_room_s` before the forward deadline."""
        end = self.forward_end - self.ready_room_s
        return max(min(float(own_timeout_s), end - self.clock()), MIN_WAIT_S)

    def describe(self) -> dict:
        """The trace fields of the request (``deadline_s``: forward part, ``bound_s``: all of it)."""
        return {"deadline_s": round(self.forward_s, 6), "bound_s": round(self.bound_s, 6)}
