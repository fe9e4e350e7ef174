"""eplb_fsm: an expert-parallelism load balancer run as an explicit, traced state machine.

This module only re-exports; see the submodules for the code. The re-exports resolve
on first use, so ``eplb-fsm --help`` (and any import of a torch-free submodule) does
not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: the package version (pyproject.toml reads it from here)
__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "EplbConfig": "eplb_fsm.config",
    "EplbController": "eplb_fsm.fsm.controller",
    "EventTrace": "eplb_fsm.trace",
    "ExpertMaps": "eplb_fsm.maps",
    "LoadWindow": "eplb_fsm.stats",
    "aggregate_logical": "eplb_fsm.stats",
    "end_traces_on_signal": "eplb_fsm.stop_signals",
    "initial_phy2log": "eplb_fsm.maps",
    "read_trace": "eplb_fsm.trace",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.maps import ExpertMaps, initial_phy2log
    from eplb_fsm.stats import LoadWindow, aggregate_logical
    from eplb_fsm.stop_signals import end_traces_on_signal
    from eplb_fsm.trace import EventTrace, read_trace


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eplb_fsm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
