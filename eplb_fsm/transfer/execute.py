"""Execute a rearrangement: move expert weights so every slot holds its new expert.

Per layer (docs/design.md §6.3) each rank:

1. plans the layer from the replicated old/new rows: every layer's transfers and this
   process's plans come from one vectorised pass before the first layer
   (:mod:`eplb_fsm.transfer.plan_all`), each layer's messages and copy runs are built
   while the previous layer is in flight (with new maps, layer 0's messages go out from
   the transfers alone and its own plan is built while they fly). All of it is kept
   per (maps, group size, local ranks, batching) in a small LRU cache, so a repeated
   rearrangement neither re-validates nor re-plans: the CPU left on the critical path
   between layers is posting the messages and the copies;
2. runs the waves of point-to-point messages: sends read the old weight rows, receives
   land in the buffer's primary rows (one wave, or several with migration batching);
3. while the first wave is in flight, copies into the buffer the source of one *local*
   row (new expert already on this rank) per in-rank cycle (:mod:`.local_copies`);
4. commits: the other local rows straight from their source rows, in an order that
   reads every row before overwriting it, then the staged local, primary and duplicate
   rows from the buffer (a duplicate from its primary's buffer row). Locally moved rows
   are thus copied once, not twice.

Steps 1–3 never write the weights, so the old weights stay valid until step 4; the
one-layer entry points split the two halves for the asynchronous controller
(:func:`transfer_layer_to_buffer`, :func:`commit_layer_from_buffer`).

Messages carry raw bytes (each row viewed as uint8), so any dtype travels the same way.
Every check on the input runs before the first copy or message; a failure while
messages are in flight raises :class:`TransferError` with the layer: layers before it
are committed (new), it and the ones after are untouched (old). An error raised by a
layer's commit itself propagates as it is, with ``committed_layers`` the layers before
that one (the layer may be partly written) and a note naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Mapping, Sequence

import torch

from eplb_fsm.maps import as_count
from eplb_fsm.transfer.buffers import PendingLayer, TransferBuffer
from eplb_fsm.transfer.chunks import chunk_layer, row_bytes
from eplb_fsm.transfer.communicator import Communicator
from eplb_fsm.transfer.inputs import (check_all_weights, check_flag, check_layer_weights, placement,
                                      resolve_communicator, tell_device, traces_for)
from eplb_fsm.transfer.messages import HeldReceives, copy_runs, row_views, run_layer
from eplb_fsm.transfer.schedule import Commit, Schedule, prepare_maps

__all__ = [
    "default_buffer",
    "rearrange_expert_weights_inplace",
    "transfer_layer_to_buffer",
    "commit_layer_from_buffer",
]

_DEFAULT_BUFFER = TransferBuffer()
_DEFAULT_LOCK = threading.Lock()


def default_buffer() -> TransferBuffer:
    """The buffer :func:`rearrange_expert_weights_inplace` uses when none is given."""
    return _DEFAULT_BUFFER


def _commit_failed(exc: BaseException, layer: int, committed: int | None) -> None:
    """Label an error raised by layer ``layer``'s commit: ``committed`` layers are new, it may be partly written."""
    if committed is not None:
        with contextlib.suppress(AttributeError):  # an exception type without attributes of its own
            exc.committed_layers = committed
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(f"raised by the commit of layer {layer}: its rows may be partly written"
                 + (f"; the {committed} layers before it hold their new weights, the later ones their old"
                    if committed is not None else ""))


def _stream(comm: Communicator) -> contextlib.AbstractContextManager:
    ctx = getattr(comm, "stream_context", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


def _finish(comm: Communicator) -> None:
    fin = getattr(comm, "finish", None)
    if fin is not None:
        fin()


# ---------------------------------------------------------------------------------------
# public entry points


@torch.no_grad()  # weights are often Parameters that require grad: copy_ into them in place
def rearrange_expert_weights_inplace(
    old_phy2log: Any,
    new_phy2log: Any,
    expert_weights: Sequence[Any],
    group: Any = None,
    communicator: Communicator | None = None,
    is_profile: bool = False,
    rank_mapping: Mapping[int, int] | None = None,
    trace: Any = None,
    migration_batching: bool = False,
    *,
    buffer: TransferBuffer | None = None,
    timeout: float | None = None,
) -> None:
    """Rearrange every layer's expert weights in place from ``old_phy2log`` to ``new_phy2log``.

    ``old_phy2log``/``new_phy2log``: (L, P) integer tensors or arrays, identical on every
    rank (with ``rank_mapping``: old over the old ranks, new over the new ranks).
    ``expert_weights``: a list over the L layers of lists of tensors shaped (S, ...), any
    dtype; with a multi-rank communicator (:class:`InProcessCommunicator`) a list over its
    ranks of such lists. ``group``: the process group (None: the default group), used
    when no ``communicator`` is given (then ``timeout`` bounds each wait).
    ``is_profile``: check the input and reserve the worst-case buffer, move nothing.
    ``rank_mapping``: ``{old_rank: new_rank or -1}`` for elastic EP (see rank_mapping).
    ``trace``: an EventTrace (or one per local rank) that brackets every wave.
    ``migration_batching``: coalesce per (src, dst) and run waves where each rank talks
    to at most one peer. ``buffer``: the reusable one-layer buffer (default: a shared one).

    Raises ``ValueError`` on bad input before anything moves; :class:`TransferError` if a
    layer's messages fail (``committed_layers`` layers are new, the rest old). Any other
    error carries ``committed_layers`` too: the layers whose commit fully ran.
    """
    is_profile = check_flag(is_profile, "is_profile")
    migration_batching = check_flag(migration_batching, "migration_batching")
    if buffer is not None and not isinstance(buffer, TransferBuffer):
        raise ValueError(f"buffer: must be a TransferBuffer or None, got {type(buffer).__name__}")
    comm = resolve_communicator(group, communicator, timeout)
    old, new, sched = prepare_maps(
        old_phy2log, new_phy2log, comm.world_size, rank_mapping, 2, tuple(comm.local_ranks), migration_batching
    )
    num_layers, p = old.shape
    rows = p // comm.world_size
    weights = check_all_weights(comm, expert_weights, num_layers, rows)
    traces = traces_for(trace, comm)
    tell_device(comm, next(iter(weights.values()))[0] if num_layers else ())
    if num_layers == 0:
        return
    buf = buffer if buffer is not None else _DEFAULT_BUFFER
    lock = _DEFAULT_LOCK if buffer is None else contextlib.nullcontext()
    with lock:
        buffers = [{r: buf.ensure(r, weights[r][0], i) for r in comm.local_ranks} for i in range(buf.layers)]
        if is_profile:
            return
        try:
            with _stream(comm):
                _rearrange_layers(sched, weights, buffers, comm, traces, buf)
        finally:
            _finish(comm)


def _rearrange_layers(
    sched: Schedule,
    weights: dict[int, list[list[torch.Tensor]]],
    buffers: list[dict[int, list[torch.Tensor]]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    buf: TransferBuffer,
) -> None:
    """All layers, pipelined over the buffer's one or two layers of rows.

    While layer k's first wave is in flight, this process also finishes layer k-1's
    commit and (first use of these maps only) plans layer k+1. With two buffer layers,
    layer k lands in ``buffers[k % 2]`` and the whole of layer k-1's commit runs then.
    With one, the part of layer k-1's commit that reads buffer rows layer k is about to
    overwrite must run before those receives are posted: with a communicator that pairs
    messages by tag it runs after layer k's sends and other receives went out (two
    phases, :class:`HeldReceives`), otherwise before layer k starts. If layer k fails,
    layer k-1's commit is completed first, so layers < k are new and layers >= k are old.
    If a commit itself raises, ``committed_layers`` counts only the layers before it.
    """
    num_layers = sched.old.shape[0]
    halves = len(buffers)
    two_phase = bool(getattr(comm, "supports_tags", False)) and hasattr(comm, "start") and hasattr(comm, "wait")
    prev_w: dict[int, list[torch.Tensor]] | None = None
    # new maps: layer 0's messages go out first, and the rest of its plan (this rank's
    # plans, staged copies, commit order) is built while they fly
    cold = not sched.prepared
    # rows as uint8 views: the buffer's once, each layer's weights while the layer
    # before it is in flight
    recv_views = [row_views(half, True) for half in buffers]
    send_views = {0: row_views({r: weights[r][0] for r in comm.local_ranks}, False)}
    for k in range(num_layers):
        prep = sched.messages(0) if k == 0 and cold else sched.layer(k)
        layer_w = {r: weights[r][k] for r in comm.local_ranks}
        into, prev_buffers = buffers[k % halves], buffers[(k - 1) % halves]
        late: dict[int, Commit] = {}
        early: dict[int, Commit] | None = None  # run before layer k's messages
        hold: HeldReceives | None = None
        # layer k-1's commit runs in up to two parts, each once: "torn" while one runs, so
        # still set after it raised (the layer may be partly written, not counted as committed)
        state = {"torn": False}

        def part(runs: dict[int, Commit], src: dict[int, list[torch.Tensor]], prev_w=prev_w, state=state) -> None:
            state["torn"] = True
            _apply_runs(runs, prev_w, src)
            state["torn"] = False

        if prev_w is not None and halves == 2:
            late = sched.layer(k - 1).commit  # reads the other half: nothing waits for it
        elif prev_w is not None:
            early, late = sched.split(k - 1)
            if two_phase and prep.waves:
                # layer k's receives into rows layer k-1's commit still reads wait for it;
                # the commit runs while the rest of layer k's messages fly
                rows = {r: set(c.src.tolist()) for r, c in early.items() if c.src.size}
                hold = HeldReceives(rows, lambda early=early, part=part, into=into: part(early, into))
                early = None
        state["late_done"] = not late

        def meanwhile(k: int = k, late=late, prev_w=prev_w, state=state, layer_w=layer_w, posted=prep,
                      into=into, prev_buffers=prev_buffers) -> None:
            full = sched.layer(k)
            if full is not posted:  # layer 0 was posted from its messages alone
                for r, runs in full.local_runs.items():
                    copy_runs(into[r], layer_w[r], runs)
            if not state["late_done"]:
                state["late_done"] = True  # first: a part that raised never runs again
                part(late, prev_buffers)
            if k + 1 < num_layers:
                # plans layer k+1 (a no-op once the schedule is complete), and with one
                # buffer layer the split of layer k's commit against it
                if halves == 2:
                    sched.layer(k + 1)
                else:
                    sched.split(k)
                send_views[k + 1] = row_views({r: weights[r][k + 1] for r in comm.local_ranks}, False)

        buf.generation += 1
        try:
            if early is not None:
                part(early, into)
            views = send_views.pop(k, None)
            if views is None:  # no wave before (meanwhile runs in the first wave)
                views = row_views(layer_w, False)
            run_layer(prep, layer_w, into, comm, traces, meanwhile=meanwhile, hold=hold,
                      views=(views, recv_views[k % halves]))
        except BaseException as exc:  # any error, not only a TransferError: no layer may end half new
            if prev_w is not None and not state["torn"]:
                try:  # layer k-1 ends fully new
                    if hold is not None:
                        hold.release()  # no held receive was posted before it ran
                    if not state["late_done"]:
                        state["late_done"] = True  # once: its direct copies chain rows and would not run twice alike
                        part(late, prev_buffers)
                except BaseException as commit_exc:
                    _commit_failed(commit_exc, k - 1, k - 1)
                    raise commit_exc from exc
            if state["torn"]:
                _commit_failed(exc, k - 1, k - 1)  # layer k-1's commit raised: layers before it are new
            else:
                with contextlib.suppress(AttributeError):  # an exception type without attributes of its own
                    exc.committed_layers = k  # layers before k are new, k and the rest old
            raise
        prev_w = layer_w
    if prev_w is not None:
        last = sched.layer(num_layers - 1).commit
        try:
            _apply_runs(last, prev_w, buffers[(num_layers - 1) % halves])
        except BaseException as exc:
            _commit_failed(exc, num_layers - 1, num_layers - 1)
            raise


def _apply_runs(
    commits: dict[int, Commit],
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
) -> None:
    """Run commits: each rank's direct copies (weights -> weights), then its buffer writes."""
    for r, commit in commits.items():
        copy_runs(weights[r], weights[r], commit.direct)
        copy_runs(weights[r], buffers[r], commit.runs)


@torch.no_grad()
def transfer_layer_to_buffer(
    old_phy2log_row: Any,
    new_phy2log_row: Any,
    layer_weights: Sequence[Any],
    buffer: TransferBuffer,
    *,
    layer: int = 0,
    group: Any = None,
    communicator: Communicator | None = None,
    rank_mapping: Mapping[int, int] | None = None,
    trace: Any = None,
    migration_batching: bool = False,
    timeout: float | None = None,
    max_chunk_bytes: int = 0,
    between_chunks: Any = None,
) -> PendingLayer:
    """Run one layer's local copies and messages into ``buffer``; the weights stay untouched.

    ``max_chunk_bytes`` > 0: the messages go in chunks of at most that many bytes of rows,
    cut alike on every rank (:mod:`eplb_fsm.transfer.chunks`), calling ``between_chunks()``
    between two (the async worker waits there for the next engine step).

    ``old_phy2log_row``/``new_phy2log_row``: the layer's (P,) rows. ``layer_weights``: this
    rank's list of tensors (S, ...) for the layer (a list over ranks with a multi-rank
    communicator). ``layer`` only labels trace records and errors. The old weights stay
    valid (and in use) until :func:`commit_layer_from_buffer` is called with the result.
    """
    if not isinstance(buffer, TransferBuffer):
        raise ValueError(f"buffer: must be a TransferBuffer, got {type(buffer).__name__}")
    max_chunk_bytes = as_count(max_chunk_bytes, "max_chunk_bytes", minimum=0)  # bools and floats refused
    migration_batching = check_flag(migration_batching, "migration_batching")
    if between_chunks is not None and not callable(between_chunks):  # not after the first chunk went out
        raise ValueError(f"between_chunks: must be a callable or None, got {type(between_chunks).__name__}")
    comm = resolve_communicator(group, communicator, timeout)
    old, new, sched = prepare_maps(
        old_phy2log_row, new_phy2log_row, comm.world_size, rank_mapping, 1, tuple(comm.local_ranks), migration_batching
    )
    rows = old.shape[1] // comm.world_size
    weights = check_layer_weights(comm, layer_weights, rows)
    traces = traces_for(trace, comm)
    tell_device(comm, next(iter(weights.values())))
    buffers = {r: buffer.ensure(r, weights[r]) for r in comm.local_ranks}
    buffer.generation += 1
    prep = sched.layer(0)
    if prep.layer != layer:
        prep = dataclasses.replace(prep, layer=layer)
    try:
        with _stream(comm):
            if max_chunk_bytes > 0:
                for i, part in enumerate(chunk_layer(prep, row_bytes(next(iter(weights.values()))), max_chunk_bytes)):
                    if i and between_chunks is not None:
                        between_chunks()
                    run_layer(part, weights, buffers, comm, traces)
            else:
                run_layer(prep, weights, buffers, comm, traces)
    finally:
        # the buffer was allocated on the caller's stream and written on the transfer stream: the
        # caller's waits for those writes, so a dropped layer's released buffer is not reused early
        _finish(comm)
    return PendingLayer(
        layer=layer,
        plans=prep.plans,
        buffer=buffer,
        generation=buffer.generation,
        layouts={r: placement(w) for r, w in weights.items()},  # which tensors, not only their layout
        communicator=comm,
        commits=prep.commit,
    )


@torch.no_grad()
def commit_layer_from_buffer(pending: PendingLayer, layer_weights: Sequence[Any]) -> None:
    """Write a transferred layer into its weights: local, primary and duplicate rows.

    ``layer_weights`` must be the tensors given to :func:`transfer_layer_to_buffer`: the
    same memory (address, strides, storage offset), not only the same shapes and dtypes (a
    list over ranks with a multi-rank communicator). Raises ``ValueError`` if they are not,
    if the buffer has since been reused or the pending layer was committed, or if its
    commit already raised part-way (``pending.failed``: it cannot be retried).
    """
    if not isinstance(pending, PendingLayer):
        raise ValueError(
            "pending: must be the PendingLayer returned by transfer_layer_to_buffer, "
            f"got {type(pending).__name__}"
        )
    if pending.committed:
        raise ValueError(f"pending: layer {pending.layer} is already committed")
    if pending.failed:
        raise ValueError(f"pending: the commit of layer {pending.layer} raised part-way (its rows may be partly "
                         "written); it cannot be committed again")
    if pending.buffer.generation != pending.generation:
        raise ValueError(
            f"pending: the buffer of layer {pending.layer} was reused by a later transfer, re-allocated or "
            "released; commit each layer before the buffer is used again"
        )
    comm = pending.communicator
    rows = next(iter(pending.plans.values())).slots_per_rank
    weights = check_layer_weights(comm, layer_weights, rows)
    for r, w in weights.items():
        if placement(w) != pending.layouts[r]:
            raise ValueError(f"layer_weights: rank {r}'s tensors differ from the ones transferred (another "
                             "tensor, address, strides or storage offset): commit into the tensors given to "
                             f"transfer_layer_to_buffer for layer {pending.layer}")
    buffers = {r: pending.buffer.tensors(r) for r in pending.plans}
    try:
        with _stream(comm):
            _apply_runs(pending.commits, weights, buffers)
    except BaseException as exc:
        pending.failed = True
        _commit_failed(exc, pending.layer, None)
        raise
    finally:
        _finish(comm)
    pending.committed = True
