"""One synthetic rank: the real machine and the real trace writer, stepped by a test job.

:class:`SyntheticRank` pairs an ``EplbMachine`` with an ``EventTrace`` and records what
the controller records (a compact ``step`` record for every step that keeps the state, a
``transition`` record for every other fired event); :class:`SyntheticClock` gives it
deterministic timestamps. Every record goes through :mod:`eplb_fsm.trace`'s writer, which
owns the record schema. :mod:`eplb_fsm.testing.job` and :mod:`eplb_fsm.testing.elastic`
drive these ranks.
"""

from __future__ import annotations

import os
from typing import Any

from eplb_fsm.fsm.machine import EplbMachine, Fired
from eplb_fsm.trace import EventTrace

__all__ = ["GROUP", "MAPS_FLAGS", "READY_FLAGS", "SLOT_BYTES", "TRANSFER_GROUP", "SyntheticClock", "SyntheticRank"]

# group names the controller writes: its EP group and its own transfer group
GROUP = "ep"
TRANSFER_GROUP = "ep_transfer"
SLOT_BYTES = 4096
# the controller's agreement sizes: a model's maps digest in the planning all-reduce (8 digest pieces and
# their squares, fsm/recovery.digest_flags) and a sync agreement's [ready, failed, late, broken]
MAPS_FLAGS = 16
READY_FLAGS = 4


class SyntheticClock:
    """Deterministic timestamps: the job sets the step's base time, each record adds 100 us."""

    def __init__(self, t0: float) -> None:
        self.t = t0

    def at_least(self, t: float) -> None:
        self.t = max(self.t, t)

    def __call__(self) -> float:
        self.t += 1e-4
        return round(self.t, 6)


class SyntheticRank:
    """One rank: the real machine, its trace, and the counters the controller keeps."""

    def __init__(self, rank: int, world: int, num_layers: int, trace_dir: str | os.PathLike | None,
                 clock: SyntheticClock, keep: bool = True, machine: EplbMachine | None = None, step: int = 0) -> None:
        self.rank = rank
        self.file_rank = rank                  # the file it writes, whatever its rank becomes
        self.num_layers = num_layers
        self.clock = clock
        # exclusive=False: each SyntheticRank stands for a process of its own, and a joiner of an old-layout
        # scale takes the file a renumbered rank still writes, as two processes did
        self.trace = EventTrace(rank=rank, world=world, trace_dir=trace_dir, clock=clock, keep=keep,
                                exclusive=False)
        self.machine = machine or EplbMachine(num_layers)
        self.machine.listeners.append(self._record)
        self.trace.set_context(state=self.machine.state, step=step)
        self._extra: dict = {}
        self.group = GROUP                     # its EP group's trace name (ep@<g> after a scale)
        self.transfer_base = TRANSFER_GROUP
        self.transfer_group = TRANSFER_GROUP
        self.transfer_resets = 0
        self.count = 0
        self.rearrangements = 0
        self.stopped = False

    def _record(self, fired: Fired) -> None:
        if fired.trigger == "step" and fired.source == fired.dest:
            self.trace.emit("step")
            return
        data = dict(fired.data)
        # as the controller does: layer_done records the layer it finished (its event
        # datum), other transitions the machine's layer; layer_after is the counter after
        layer = data.pop("layer", fired.layer)
        data.update(self._extra)
        self.trace.transition(fired.trigger, fired.source, fired.dest, layer=layer,
                              num_layers=self.num_layers, layer_after=fired.layer, **data)

    def fire(self, trigger: str, extra: dict | None = None, **data: Any) -> Fired:
        """Fire through the machine; ``extra`` fields go into the transition record."""
        self._extra = extra or {}
        try:
            return self.machine.fire(trigger, **data)
        finally:
            self._extra = {}

    def collective(self, op: str, finish: bool = True, **fields: Any) -> bool:
        """Record one collective; ``finish=False`` writes only its start (the rank hangs inside)."""
        if finish:
            with self.trace.collective(op, **fields):
                pass
            return True
        self.trace.start_collective(op, **fields)
        return False

    def agreement(self, part: str, size: int, **fields: Any) -> None:
        """One all-reduce of ``part`` (``size`` float64 flags) on the rank's EP group, as the controller
        traces its agreements (``fields``: e.g. the ``layer`` a ``ready`` agreement is about)."""
        self.collective("all_reduce", group=self.group, shape=[size], dtype="torch.float64", parts=[part],
                        sizes=[size], **fields)

    def force_state(self, state: str, layer: int = 0) -> None:
        """Put the machine where a buggy controller's record claims it went."""
        self.machine.machine.set_state(state)
        self.machine.layer = layer
        self.trace.set_context(state=state)
