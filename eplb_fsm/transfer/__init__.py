"""Transfer engine: move expert weights so every slot holds the expert its new map names.

Pure per-layer planning (:mod:`.plan`), the same for all layers at once
(:mod:`.plan_all`), the order of in-rank copies (:mod:`.local_copies`), the cached
schedule of a rearrangement (:mod:`.schedule`), migration waves (:mod:`.batching`), how
messages travel (:mod:`.communicator`), the executor (:mod:`.execute`, with its input
checks in :mod:`.inputs` and its message waves in :mod:`.messages`) and elastic-EP
rank mappings (:mod:`.rank_mapping`). See docs/transfer.md.
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
from eplb_fsm.transfer.local_copies import LocalCopyOrder, order_local_copies
from eplb_fsm.transfer.plan_all import all_layer_transfers, plans_for_rank
from eplb_fsm.transfer.rank_mapping import RankMappingInfo, expand_maps, expand_phy2log, validate_rank_mapping

__all__ = [
    "Communicator",
    "InProcessCommunicator",
    "LayerPlan",
    "LayerTransfers",
    "LocalCopyOrder",
    "MessageMismatchError",
    "PendingLayer",
    "RankMappingInfo",
    "TorchDistCommunicator",
    "TransferBuffer",
    "TransferError",
    "Wave",
    "all_layer_transfers",
    "check_layer_maps",
    "coalesce",
    "commit_layer_from_buffer",
    "default_buffer",
    "expand_maps",
    "expand_phy2log",
    "layer_transfers",
    "moved_slots",
    "order_local_copies",
    "plan_from_transfers",
    "plan_layer",
    "plan_layer_all_ranks",
    "plan_waves",
    "plans_for_rank",
    "rearrange_expert_weights_inplace",
    "single_wave",
    "transfer_layer_to_buffer",
    "validate_rank_mapping",
]
