"""Transfer engine: move expert weights so every slot holds the expert its new map names.

Pure per-layer planning (:mod:`.plan`), the same for all layers at once
(:mod:`.plan_all`), the order of in-rank copies (:mod:`.local_copies`), the cached
schedule of a rearrangement (:mod:`.schedule`), migration waves (:mod:`.batching`), how
messages travel (:mod:`.communicator`), the executor (:mod:`.execute`, with its input
checks in :mod:`.inputs`, its message waves in :mod:`.messages` and its buffers in
:mod:`.buffers`) and elastic-EP
rank mappings (:mod:`.rank_mapping`). See docs/transfer.md.

The package exports the public API only: the executor and its buffer, the communicators
and their errors, ``moved_slots`` and the rank-mapping helpers. The planning steps
(``layer_transfers``, ``plan_layer``, ``plan_waves``, ``order_local_copies``, ...) are
imported from their own modules.
"""

from eplb_fsm.transfer.communicator import (
    Communicator,
    InProcessCommunicator,
    MessageMismatchError,
    TorchDistCommunicator,
    TransferError,
)
from eplb_fsm.transfer.buffers import PendingLayer, TransferBuffer
from eplb_fsm.transfer.execute import (
    commit_layer_from_buffer,
    default_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)
from eplb_fsm.transfer.inputs import UnmovableWeightsError
from eplb_fsm.transfer.plan import moved_slots
from eplb_fsm.transfer.rank_mapping import RankMappingInfo, expand_maps, expand_phy2log, validate_rank_mapping

__all__ = [
    "Communicator",
    "InProcessCommunicator",
    "MessageMismatchError",
    "PendingLayer",
    "RankMappingInfo",
    "TorchDistCommunicator",
    "TransferBuffer",
    "TransferError",
    "UnmovableWeightsError",
    "commit_layer_from_buffer",
    "default_buffer",
    "expand_maps",
    "expand_phy2log",
    "moved_slots",
    "rearrange_expert_weights_inplace",
    "transfer_layer_to_buffer",
    "validate_rank_mapping",
]
