"""Elastic EP: ranks leave and join an EP group while the engine serves.

``EplbController.request_scale`` (serving ranks) and ``EplbController.join`` (a new
process) run the flows of :mod:`~eplb_fsm.elastic.scaling` and
:mod:`~eplb_fsm.elastic.joiner`. This package drives the controller through its public
port only (:mod:`~eplb_fsm.elastic.port`); the lifecycle rows it fires are in
:mod:`eplb_fsm.fsm.machine`. See docs/elastic.md.
"""

from eplb_fsm.elastic.joiner import ScaleAborted
from eplb_fsm.elastic.scale_plan import (
    ScalePlan,
    default_rank_mapping,
    lost_experts,
    make_scale_plan,
    remap_columns,
    resize_window,
    slot_columns,
)

__all__ = [
    "ScaleAborted",
    "ScalePlan",
    "default_rank_mapping",
    "lost_experts",
    "make_scale_plan",
    "remap_columns",
    "resize_window",
    "slot_columns",
]
