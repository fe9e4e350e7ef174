"""Transfer engine: move expert weights so every slot holds the expert its new map names.

Pure per-layer planning (:mod:`.plan`), migration waves (:mod:`.batching`), how messages
travel (:mod:`.communicator`), the executor (:mod:`.execute`) and elastic-EP rank
mappings (:mod:`.rank_mapping`). See docs/transfer.md.
"""

from eplb_fsm.transfer.batching import Wave, coalesce, plan_waves, single_wave
from eplb_fsm.transfer.communicator import (
    Communicator,
    InProcessCommunicator,
    MessageMismatchError,
    TorchDistCommunicator,
    TransferError,
)
from eplb_fsm.transfer.execute import (
    PendingLayer,
    TransferBuffer,
    commit_layer_from_buffer,
    default_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)
from eplb_fsm.transfer.plan import (
    LayerPlan,
    LayerTransfers,
    check_layer_maps,
    layer_transfers,
    moved_slots,
    plan_from_transfers,
    plan_layer,
    plan_layer_all_ranks,
)
from eplb_fsm.transfer.rank_mapping import RankMappingInfo, expand_maps, expand_phy2log, validate_rank_mapping

__all__ = [
    "Communicator",
    "InProcessCommunicator",
    "LayerPlan",
    "LayerTransfers",
    "MessageMismatchError",
    "PendingLayer",
    "RankMappingInfo",
    "TorchDistCommunicator",
    "TransferBuffer",
    "TransferError",
    "Wave",
    "check_layer_maps",
    "coalesce",
    "commit_layer_from_buffer",
    "default_buffer",
    "expand_maps",
    "expand_phy2log",
    "layer_transfers",
    "moved_slots",
    "plan_from_transfers",
    "plan_layer",
    "plan_layer_all_ranks",
    "plan_waves",
    "rearrange_expert_weights_inplace",
    "single_wave",
    "transfer_layer_to_buffer",
    "validate_rank_mapping",
]
