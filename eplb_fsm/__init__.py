"""eplb_fsm: an expert-parallelism load balancer run as an explicit, traced state machine.

This module only re-exports; see the submodules for the code.
"""

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.maps import ExpertMaps, initial_phy2log
from eplb_fsm.stats import LoadWindow, aggregate_logical
from eplb_fsm.trace import EventTrace, read_trace

__all__ = [
    "EplbConfig",
    "EplbController",
    "EventTrace",
    "ExpertMaps",
    "LoadWindow",
    "aggregate_logical",
    "initial_phy2log",
    "read_trace",
]
