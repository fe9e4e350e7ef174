"""Steps 2-3 of a layer's rearrangement: local copies into the buffer and the waves of messages.

Messages carry raw bytes: each row of a weight tensor ``(S, ...)`` is viewed as a flat
uint8 tensor, so any dtype travels the same way. :func:`run_layer` posts every wave of a
prepared layer (sends read the old weight rows, receives land in buffer rows) and runs
the local copies while the first wave is in flight; :func:`copy_runs` copies runs of
rows between tensor lists (the commit uses it too). A failed wave raises
:class:`~eplb_fsm.transfer.communicator.TransferError` naming the layer and the wave,
after discarding what the communicator still holds.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from eplb_fsm.transfer.batching import Wave
from eplb_fsm.transfer.chunks import row_bytes
from eplb_fsm.transfer.communicator import Communicator, TransferError
from eplb_fsm.transfer.schedule import PreparedLayer, Run

__all__ = ["copy_runs", "row_views", "run_layer"]


def copy_runs(dst: list[torch.Tensor], src: list[torch.Tensor], runs: Sequence[Run]) -> None:
    """For each run (a, b, n): rows a..a+n-1 of every ``dst[t]`` (S, ...) from rows b..b+n-1 of ``src[t]``."""
    if not runs:
        return
    for d_t, s_t in zip(dst, src):
        nb = d_t.is_cuda
        for a, b, n in runs:
            if n == 1:
                d_t[a].copy_(s_t[b], non_blocking=nb)
            else:
                d_t[a : a + n].copy_(s_t[b : b + n], non_blocking=nb)


def _as_bytes(row: torch.Tensor, for_recv: bool) -> torch.Tensor:
    if not row.is_contiguous():
        if for_recv:  # buffers are allocated contiguous; this guards against misuse
            raise RuntimeError("receive target must be contiguous")
        row = row.contiguous()
    return row.reshape(-1).view(torch.uint8)


class _RowBytes:
    """``rows[i]``: row i of a tensor as a flat uint8 tensor (a view when the tensor is contiguous)."""

    __slots__ = ("_t", "_for_recv")

    def __init__(self, t: torch.Tensor, for_recv: bool) -> None:
        self._t = t
        self._for_recv = for_recv

    def __getitem__(self, row: int) -> torch.Tensor:
        return _as_bytes(self._t[row], self._for_recv)


def _row_bytes(t: torch.Tensor, for_recv: bool) -> "tuple[torch.Tensor, ...] | _RowBytes":
    """Row i of ``t`` (S, ...) as a flat uint8 tensor at index i: for a contiguous tensor a
    tuple of views made in one call (indexing it costs no tensor op per message). A tensor
    with no elements (S, 0, ...) has an empty uint8 tensor per row, whatever its strides."""
    if t.is_contiguous() and t.ndim >= 1 and t.shape[0] > 0 and t[0].numel() > 0:
        rows = t.view(t.shape[0], -1)
        # torch calls a (1,) tensor of any stride contiguous (column 0 of a (1, n) matrix:
        # a 1-D weight with S = 1), but only a unit last stride can be viewed as bytes
        if rows.stride(-1) == 1:
            return rows.view(torch.uint8).unbind(0)
        return _RowBytes(t, for_recv)
    if t.ndim >= 1 and t.numel() == 0:  # a stride other than 1 (a transposed (0, S)) cannot be viewed as bytes
        return (torch.empty(0, dtype=torch.uint8, device=t.device),) * t.shape[0]
    return _RowBytes(t, for_recv)


def row_views(tensors: dict[int, list[torch.Tensor]], for_recv: bool) -> dict[int, list[Any]]:
    """Per local rank and tensor (S, ...), its rows as flat uint8 tensors (``views[r][t][row]``).

    What :func:`run_layer` posts; built ahead (while the previous layer's messages fly,
    or once per call for the buffer, which every layer reuses) it keeps the gap between
    two layers short.
    """
    return {r: [_row_bytes(t, for_recv) for t in ts] for r, ts in tensors.items()}


def run_layer(
    prep: PreparedLayer,
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    meanwhile: Callable[[], None] | None = None,
    hold: "HeldReceives | None" = None,
    views: "tuple[dict[int, list[Any]], dict[int, list[Any]]] | None" = None,
) -> None:
    """Steps 2-3 for one layer: local copies into the buffer and every wave of messages.

    The local copies (and ``meanwhile``, e.g. planning the next layer) run while the first
    wave is in flight: they read the weights and write buffer rows no message touches.
    ``hold``: the first wave goes out in two phases (see :class:`HeldReceives`).
    ``views``: ``(row_views(weights, False), row_views(buffers, True))`` if already built.
    """

    def local_copies() -> None:
        for r, runs in prep.local_runs.items():
            copy_runs(buffers[r], weights[r], runs)
        if meanwhile is not None:
            meanwhile()

    if not prep.waves:
        if hold is not None:
            hold.release()  # before the local copies overwrite staged rows it reads
        local_copies()
        return
    if views is not None:
        send_bytes, recv_bytes = views
    else:
        send_bytes = row_views({r: weights[r] for r in prep.plans}, False)
        recv_bytes = row_views({r: buffers[r] for r in prep.plans}, True)
    row_nbytes = {r: row_bytes(weights[r]) for r in prep.plans} if traces else {}
    for w, wave in enumerate(prep.waves):
        _run_wave(
            prep, w, wave, send_bytes, recv_bytes, row_nbytes, comm, traces,
            local_copies if w == 0 else None, hold if w == 0 else None,
        )


class HeldReceives:
    """Receives of a wave that must wait for a commit, and that commit.

    ``rows[r]``: buffer rows of local rank r that the previous layer's pending commit
    still reads. The wave then goes out in two phases: every send and every receive into
    another row first; ``release()`` (the commit of those rows) runs while they fly;
    then the held receives. Each message carries its ordinal within its (src, dst) pair
    as tag, so both sides pair them whatever the phase a receive was posted in.
    ``release()`` runs the commit once: if it raises, it is not run again (the layer may be
    partly written) and the held receives are never posted; the error propagates as is,
    not as a :class:`TransferError` of the wave (see ``_run_wave``).
    """

    __slots__ = ("rows", "commit", "done")

    def __init__(self, rows: dict[int, set[int]], commit: Callable[[], None]) -> None:
        self.rows = rows
        self.commit = commit
        self.done = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.commit()


def _run_wave(
    prep: PreparedLayer,
    w: int,
    wave: Wave,
    send_bytes: dict[int, list[Any]],
    recv_bytes: dict[int, list[Any]],
    row_nbytes: dict[int, int],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    meanwhile: Callable[[], None] | None,
    hold: HeldReceives | None = None,
) -> None:
    layer, num_waves = prep.layer, len(prep.waves)
    ops = prep.ops[w]
    # messages as (is_send, row bytes, peer, tag), queued per local rank in one call
    held: list[tuple[int, tuple[bool, Any, int, int]]] = []  # (rank, receive) after the commit
    if hold is None:
        for r in prep.plans:
            sb, rb = send_bytes[r], recv_bytes[r]
            items = [(True, tb[row], peer, 0) for peer, row in ops.sends[r] for tb in sb]
            items += [(False, tb[row], peer, 0) for peer, row in ops.recvs[r] for tb in rb]
            _queue(comm, r, items, False)
    else:
        for r in prep.plans:
            items = []
            ordinal: dict[int, int] = {}
            for peer, row in ops.sends[r]:
                for tb in send_bytes[r]:
                    tag = ordinal.get(peer, 0)
                    ordinal[peer] = tag + 1
                    items.append((True, tb[row], peer, tag))
            ordinal = {}
            rows_held = hold.rows.get(r, ())
            for peer, row in ops.recvs[r]:
                for tb in recv_bytes[r]:
                    tag = ordinal.get(peer, 0)
                    ordinal[peer] = tag + 1
                    if row in rows_held:
                        held.append((r, (False, tb[row], peer, tag)))
                    else:
                        items.append((False, tb[row], peer, tag))
            _queue(comm, r, items, True)
    stats: dict[int, list[int]] = {}
    if traces:
        for r in prep.plans:
            n_s, n_r = len(ops.sends[r]), len(ops.recvs[r])
            stats[r] = [n_s, n_r, (n_s + n_r) * row_nbytes[r]]
    start = getattr(comm, "start", None)
    wait = getattr(comm, "wait", None)
    with contextlib.ExitStack() as stack:
        for trace, r in traces:
            if r is None:  # one record for every rank this process plays
                fields = {"pairs": [list(p) for p in wave.pairs]}
                s = [sum(v[i] for v in stats.values()) for i in range(3)]
            else:
                fields = {"peers": wave.peers_of(r)}
                s = stats[r]
            stack.enter_context(
                trace.collective(
                    "batch_isend_irecv",
                    group=getattr(comm, "name", "world"),
                    layer=layer,
                    wave=w,
                    waves=num_waves,
                    sends=s[0],
                    recvs=s[1],
                    nbytes=s[2],
                    **fields,
                )
            )
        # local work (the previous layer's commit, copies, planning) that fails raises as
        # itself, not as a failure of this wave
        local_error: BaseException | None = None
        if start is None or wait is None:
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    _discard(comm)  # the queued messages never go out
                    raise
                meanwhile = None
        try:
            if start is not None and wait is not None:
                start()
                if hold is not None:
                    # the pending commit reads the held rows while phase one flies, then
                    # their receives go out
                    try:
                        hold.release()
                    except BaseException as exc:  # re-raised below, after the wait for phase one
                        local_error, meanwhile, held = exc, None, []
                    for r, item in held:
                        _queue(comm, r, (item,), True)
                    if held:
                        start()
            else:
                comm.execute()
        except Exception as exc:
            raise _failed(comm, layer, w, num_waves, exc) from exc
        # start() returned: overlap local work with the messages in flight, then wait
        # for them even if that work failed (no request is left dangling)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as exc:  # re-raised below, after the wait
                local_error = exc
        if wait is not None and start is not None:
            try:
                wait()
            except Exception as exc:
                if local_error is None:
                    raise _failed(comm, layer, w, num_waves, exc) from exc
                _discard(comm)
        if local_error is not None:
            raise local_error


def _queue(comm: Communicator, rank: int, items: Sequence[tuple[bool, Any, int, int]], tagged: bool) -> None:
    """Queue local rank ``rank``'s messages ``(is_send, tensor, peer, tag)``, in order.

    One ``add_ops`` call where the communicator has it (one Python call per rank and
    wave, not per message); otherwise ``add_send``/``add_recv`` per message, with the
    tag only when ``tagged`` (the protocol's plain form takes none).
    """
    add_ops = getattr(comm, "add_ops", None)
    if add_ops is not None:
        add_ops(rank, items)
        return
    add_send, add_recv = comm.add_send, comm.add_recv
    for is_send, tensor, peer, tag in items:
        kw = {"tag": tag} if tagged else {}
        if is_send:
            add_send(tensor, rank, peer, **kw)
        else:
            add_recv(tensor, peer, rank, **kw)


def _discard(comm: Communicator) -> None:
    discard = getattr(comm, "discard", None)
    if discard is not None:
        discard()


def _failed(comm: Communicator, layer: int, w: int, num_waves: int, exc: BaseException) -> TransferError:
    _discard(comm)
    return TransferError(f"layer {layer}, wave {w}/{num_waves}: {type(exc).__name__}: {exc}", layer=layer, wave=w)
