"""Which of the engine's own collectives a thread of this process is blocked in, read from the threads' frames.

Why: a rank whose step stays put may be waiting on a peer in a collective of the engine's (its forward's
all-reduce, which the controller never sees), or simply have nothing to do (an idle server). Its trace cannot
tell them apart, and replay needs to: on gloo a peer that ends closes its sockets and a wait on it fails at
once, so a wait that stays unbroken past a silent rank's last record shows that rank was a process still,
frozen, not dead (``eplb_fsm.inspect.held``). The liveness thread asks :func:`engine_collective` only when
the step did not advance, and writes the answer into its ``alive`` record as ``engine_wait``.

What it sees: a thread whose innermost public function of ``distributed_c10d``, with only torch's frames
above it, is one of :data:`COLLECTIVES` (``all_reduce``, ``barrier``, ``all_gather``, ...: on gloo, waits
on every member's sockets; not a point-to-point ``send``/``recv``, nor a rooted ``broadcast`` or
``gather``), called from code outside the controller (anything outside ``eplb_fsm``, or the simulator's
and benchmarks' engines inside it). Not a group's creation or set-up (``new_group``, ``init_process_group``):
they wait in the store, which a peer's death does not break (a red team's survivors sat in ``new_group`` on
a SIGKILLed rank). Not seen: a wait on a handle (``work.wait()`` after ``async_op=True``) called from the
engine's own code, which leaves no Python frame of torch's, and waits in other libraries.

:func:`main_wait` names the collective the main thread itself is blocked in, a rooted one too (``broadcast``,
``gather``: :data:`ROOTED`), or a blocking ``send``/``recv`` with the peer it waits on (:data:`P2P`), for the
``main_wait`` field: not always a wait on every member, but not the rank's own work either.

Whether the collective's group holds the controller's ranks goes with its name: replay counts a wait only
on those ranks, since another group may wait on a rank the controller does not trace, or leave out the
silent one (red teams' controllers on 2 of 3 and 3 of 4 ranks, whose engines waited on the untraced rank,
read a SIGKILLed one frozen). Cost: one ``sys._current_frames()`` and a walk of at most :data:`MAX_DEPTH`
frames per thread, tens of microseconds, on the liveness thread only.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["COLLECTIVES", "MAX_DEPTH", "P2P", "ROOTED", "engine_collective", "look", "main_wait"]

# the c10d collectives in which every member waits on every other's data (on gloo, directly or through a
# neighbour that fails at once when a member's sockets close). Not point-to-point send/recv: one waits on a
# single peer, or on none (recv from any source: a red team's parameter server in recv(src=None) on a SIGKILLed
# rank). Not the rooted ones (broadcast, reduce, gather, scatter, monitored_barrier): a member may wait on the
# root alone (a red team's survivors, deadlocked in mismatched broadcasts, read a rank SIGKILLed beside them
# frozen)
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier"})

# the rooted collectives, each waited in by a member on the root (or the root on its members): not a wait on every
# member, but a collective all the same (a red team's rank in broadcast against its peers' all_reduce read as a rank
# in its own work)
ROOTED = frozenset({"broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
                    "scatter_object_list", "monitored_barrier"})

# the blocking point-to-point calls (``send_object_list`` and ``recv_object_list`` block inside these): a wait on
# one peer, which ``main_wait`` names (a red team's rank in recv from a peer that was in its own work read as in its
# own work itself)
P2P = frozenset({"send", "recv"})

MAX_DEPTH = 64   # frames walked per thread, innermost first: a collective sits near the top of a blocked stack

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH = os.sep + "torch" + os.sep
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# the parts of this package that play the engine (the simulator's, the benchmarks' and the test helpers' models)
_ENGINES = tuple(_PACKAGE + name + os.sep for name in ("sim", "bench", "testing"))


def _ranks(group: Any, none_is_world: bool) -> tuple[int, ...] | None:
    """The global ranks of a torch process group, in order (``None`` with ``none_is_world``: the default group, as
    a c10d function takes it); None when it is no torch group (a controller's own communication layer, a single
    local rank) or cannot be read."""
    import torch.distributed as dist

    if not dist.is_initialized() or (group is None and not none_is_world):
        return None
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if not isinstance(group, dist.ProcessGroup):
        return None
    return tuple(dist.get_process_group_ranks(group))


def _call(frame: FrameType) -> str | None:
    """Which call of the collective this is, alike on every member of one call: its group's name (``WORLD`` for
    the default group) and the shape of its tensor argument, and a send's or recv's tag when not 0 (``WORLD:[4]
    tag 1``: a send and a recv whose tags differ never meet: a red team's pair hung so); None when neither group
    nor tensor can be read."""
    import torch.distributed as dist

    try:
        group, args = frame.f_locals.get("group"), frame.f_locals
        # send() has replaced a group of None by the default group by the time it waits: that is WORLD too
        name = "WORLD" if group is None or group is dist.GroupMember.WORLD else getattr(group, "group_name", None)
        tensor = next((args[k] for k in ("tensor", "input", "input_tensor") if hasattr(args.get(k), "shape")), None)
        if name is None and tensor is None:
            return None
        tag = args.get("tag") if frame.f_code.co_name in P2P else None
        return f"{name}:{list(tensor.shape) if tensor is not None else '-'}" + (f" tag {tag}" if tag else "")
    except Exception:
        return None


def _peer(frame: FrameType, ours: tuple[int, ...] | None, theirs: tuple[int, ...] | None) -> int | None:
    """The peer a blocked ``send`` or ``recv`` waits on, as a rank of the controller's group (``ours``: its global
    ranks), or None: a recv from any source, a peer outside the controller's ranks, or locals that cannot be read.
    ``dst``/``src`` are global ranks, ``group_dst``/``group_src`` ranks of the call's group (``theirs``)."""
    args = frame.f_locals
    peer = args.get("dst") if frame.f_code.co_name == "send" else args.get("src")
    if type(peer) is not int:
        local = args.get("group_dst") if frame.f_code.co_name == "send" else args.get("group_src")
        peer = theirs[local] if type(local) is int and theirs and 0 <= local < len(theirs) else None
    return ours.index(peer) if peer is not None and ours and peer in ours else None


def _collective_of(frame: FrameType | None, group: Any, ops: frozenset = COLLECTIVES
                   ) -> tuple[str, bool | None, str | None, int | None] | None:
    """(the collective this stack is inside: its innermost public c10d function, one of ``ops``, with only
    torch's frames above it; whether its group holds the same ranks as ``group``, None when unknown; which call,
    ``_call``; the peer of a point-to-point call, ``_peer``, else None) when its caller is the engine's code; else
    None. A frame outside torch above the collective's is a thread running its own code inside it (a red team's
    object whose pickling slept inside all_gather_object), not waiting."""
    op = same = call = peer = None
    for _ in range(MAX_DEPTH):
        if frame is None:
            return None
        path = frame.f_code.co_filename
        if op is None:
            if _TORCH not in path:   # the thread runs code of its own above any collective (a pickler's hook)
                return None
            if path.endswith(_C10D) and not frame.f_code.co_name.startswith("_"):
                op = frame.f_code.co_name
                if op not in ops:   # a group's creation, the store: waits a dead peer does not break
                    return None
                ours, theirs = _ranks(group, False), _ranks(frame.f_locals.get("group"), True)
                same = None if ours is None or theirs is None else sorted(ours) == sorted(theirs)
                call = _call(frame)
                peer = _peer(frame, ours, theirs) if op in P2P else None
        elif _TORCH not in path:   # the first frame outside torch called the collective
            controller = path.startswith(_PACKAGE) and not path.startswith(_ENGINES)
            return None if controller else (op, same, call, peer)
        frame = frame.f_back
    return None


def engine_collective(group: Any = None, skip: set[int] | frozenset[int] = frozenset(), frames: dict | None = None
                      ) -> tuple[str, bool | None, str | None, bool] | None:
    """(name, same group, call, main thread) of the engine collective some thread of this process is blocked in,
    or None: ``("all_reduce", True, "WORLD:[48, 8]", True)`` for one on the same ranks as ``group`` (the
    controller's torch group; False for one on other ranks, None when either group's ranks cannot be read, as with
    ``group`` None: no torch group), with its group's name and tensor shape (``_call``: two members in calls that
    differ there wait in different collectives), from the process's main thread (False: another thread's; a rank
    whose main thread computes while a side thread waits is not waiting in its step).

    ``skip``: thread idents not to look at (the caller's own thread is never looked at). With several such
    threads, one on the controller's ranks answers first (the wait replay reads; the main thread's before
    another's), then the lowest ident, so that repeated looks name the same wait. ``frames``: the threads' frames
    already read (``sys._current_frames()``: :func:`look`). Never raises: the liveness thread must write its record
    whatever a look meets (an error reads as no wait seen).
    """
    me = threading.get_ident()
    try:
        frames = sys._current_frames() if frames is None else frames
        main = threading.main_thread().ident
        seen = [(*found[:3], ident == main) for ident in sorted(frames) if ident != me and ident not in skip
                and (found := _collective_of(frames[ident], group)) is not None]
    except Exception:
        return None
    ours = [s for s in seen if s[1] is True]
    return next((s for s in ours if s[3]), ours[0] if ours else seen[0] if seen else None)


def main_wait(group: Any = None, frames: dict | None = None
              ) -> tuple[str, bool | None, str | None, int | None] | None:
    """(name, same group, call, peer) of the collective the process's main thread is blocked in, called from the
    engine's code, or None: one of :data:`COLLECTIVES` on any ranks, a rooted one (:data:`ROOTED`), or a blocking
    point-to-point call (:data:`P2P`, whose peer is named as a rank of ``group``, the controller's, when it is one;
    else, and for any other call, None); as :func:`engine_collective`, never raises. For the record's
    ``main_wait``, written when ``engine_wait`` names no wait of the main thread's: a side thread's wait on the
    controller's ranks answers there first (a red team's metrics thread), and a rooted collective is no wait on
    every member; but a main thread inside either is not in its own work, and ranks whose main threads sit in
    different collectives are deadlocked. ``frames``: as for :func:`engine_collective`."""
    try:
        frame = (sys._current_frames() if frames is None else frames).get(threading.main_thread().ident)
        if threading.get_ident() == threading.main_thread().ident:
            return None
        return _collective_of(frame, group, COLLECTIVES | ROOTED | P2P)
    except Exception:
        return None


def look(group: Any = None) -> tuple[tuple | None, tuple | None]:
    """(:func:`engine_collective`, :func:`main_wait` when the first names no wait of the main thread's, else None)
    from one read of the threads' frames: the liveness thread's look on a beat where the step stayed put. Never
    raises."""
    try:
        frames = sys._current_frames()
    except Exception:
        return None, None
    engine = engine_collective(group, frames=frames)
    return engine, None if engine and engine[3] else main_wait(group, frames)
