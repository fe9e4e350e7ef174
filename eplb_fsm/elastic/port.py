"""The controller's port for elastic EP: everything this package may use of a controller.

Elastic flows take the controller as ``ctl`` and touch nothing but what
:class:`ControllerPort` lists; ``EplbController`` provides it (a test checks that every
name here exists on it). The port's verbs: fire an event, run a rearrangement (through
``rearranger``), switch the group, export / restore the shared counters; a model
entry installs a placement in another slot space itself.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ControllerPort", "PORT_NAMES"]


class ControllerPort(Protocol):
    """What elastic EP reads and calls on a controller."""

    # what it reads
    config: Any                   # EplbConfig (replaced on a resize: num_redundant_experts follows G')
    policy: Any
    models: list                  # fsm.model_entry.ModelEntry: maps, window, install_placement
    trace: Any
    collectives: Any              # fsm.collectives.Collectives: all_reduce, on(group), save(), communicator
    rearranger: Any               # fsm.rearrange.Rearranger: run_forced, drain, abort, group_fault
    scalings: list
    last_generation: int
    timeout_s: float
    device: Any

    @property
    def state(self) -> str: ...
    @property
    def steps(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def group(self) -> Any: ...
    @property
    def group_name(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def transfer_group_name(self) -> str: ...
    @property
    def history(self) -> list: ...

    # what it does
    def fire(self, trigger: str, extra: dict | None = None, **data: Any) -> Any: ...
    def restart_interval(self) -> None: ...
    def switch_group(self, group: Any, communicator: Any, rank: int, world_size: int) -> None: ...
    def restore_group(self, saved: tuple) -> None: ...
    def export_counters(self) -> dict: ...
    def restore_counters(self, counters: dict) -> None: ...
    def add_model(self, model: Any, name: str, phy2log: Any = None) -> Any: ...
    def close(self) -> None: ...


PORT_NAMES = tuple(sorted(
    {n for n in vars(ControllerPort) if not n.startswith("_")} | set(ControllerPort.__annotations__)
))
