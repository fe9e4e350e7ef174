"""The controller's collectives: one all-reduce of named parts, blocking or posted and read later."""

from __future__ import annotations

import time

import pytest
import torch

from eplb_fsm.fsm.collectives import Collectives, GroupBroken, flags, resolve_device, resolve_group
from eplb_fsm.sim.launcher import run_ranks
from eplb_fsm.trace import EventTrace


class _SummingGroup:
    """A collective-group object whose all-reduce adds a fixed peer contribution (or raises)."""

    def __init__(self, peer: torch.Tensor | None, fail: bool = False) -> None:
        self.rank, self.world_size = 0, 2
        self.peer, self.fail, self.calls = peer, fail, 0

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        self.calls += 1
        if self.fail:
            raise TimeoutError("peer 1 silent")
        tensor.add_(self.peer)

    def transfer_communicator(self, timeout_s: float):  # pragma: no cover - not used here
        raise NotImplementedError


def _collectives(group, trace: EventTrace) -> Collectives:
    return Collectives(group, 0, 2 if group is not None else 1, trace, torch.device("cpu"), 5.0, "ep")


def test_parts_come_back_summed_in_their_own_shapes():
    """all_reduce concatenates the parts into one sum and splits it back, each part in its shape."""
    trace = EventTrace(keep=True)
    coll = _collectives(_SummingGroup(torch.arange(7, dtype=torch.float64)), trace)
    out = coll.all_reduce({"a": torch.ones(2, 2), "b": flags(1.0, 2.0, 3.0)}, 5.0)
    assert out["a"].shape == (2, 2) and out["a"].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert out["b"].tolist() == [5.0, 7.0, 9.0]
    start = trace.records[0]
    assert start["parts"] == ["a", "b"] and start["sizes"] == [4, 3] and "posted" not in start


def test_a_group_without_a_posted_all_reduce_sums_at_post_and_hands_it_over():
    """A collective-group object has no non-blocking all-reduce: post sums at once, wait returns it."""
    trace = EventTrace(keep=True)
    group = _SummingGroup(flags(1.0, 0.0, 0.0))
    posted = _collectives(group, trace).post({"ready": flags(1.0, 0.0, 0.0)}, 5.0)
    assert group.calls == 1 and [r["event"] for r in trace.records] == ["collective_start", "collective_end"]
    assert posted.wait()["ready"].tolist() == [2.0, 0.0, 0.0]


def test_a_failed_all_reduce_raises_group_broken_when_read():
    """A collective that raises writes collective_error at once; the read raises GroupBroken naming the parts."""
    trace = EventTrace(keep=True)
    posted = _collectives(_SummingGroup(None, fail=True), trace).post({"ready": flags(1.0, 0.0, 0.0)}, 5.0)
    assert [r["event"] for r in trace.records] == ["collective_start", "collective_error"]
    with pytest.raises(GroupBroken, match=r"\['ready'\].*peer 1 silent"):
        posted.wait()
    with pytest.raises(GroupBroken):
        _collectives(_SummingGroup(None, fail=True), EventTrace()).all_reduce({"x": flags(1.0)}, 5.0)


def test_resolve_device_and_group_name_what_they_refuse():
    """A device torch cannot parse, or a group that is neither a process group nor a collective group, is a
    ValueError."""
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: 'gpu0' is not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="group must be a torch.distributed process group .* got object"):
        resolve_group(object())


def test_no_group_returns_the_parts_themselves():
    """World 1 (no group): the sum is this rank's own parts, traced on the local group name."""
    trace = EventTrace(keep=True)
    out = _collectives(None, trace).post({"ready": flags(1.0, 0.0, 0.0)}, 5.0).wait()
    assert out["ready"].tolist() == [1.0, 0.0, 0.0]


def _posted_on_gloo(rank: int, world: int, silent_rank: int) -> dict:
    """Post one ready all-reduce, write a record while it runs, read it; ``silent_rank`` never posts."""
    import torch.distributed as dist

    trace = EventTrace(rank=rank, world=world, keep=True)
    coll = Collectives(dist.group.WORLD, rank, world, trace, torch.device("cpu"), 2.0, "ep")
    out: dict = {}
    if rank == silent_rank:
        time.sleep(4.0)   # alive, never posts: the others' read must time out, not hang
    else:
        trace.set_context(step=1)
        posted = coll.post({"ready": flags(1.0, 0.0, float(rank))}, 1.5)
        trace.set_context(step=2)
        trace.emit("steps")
        try:
            out["sum"] = posted.wait()["ready"].tolist()
        except GroupBroken as exc:
            out["error"] = str(exc)
    out["events"] = [(r["event"], r["step"], r.get("posted")) for r in trace.records]
    return out


@pytest.mark.multiprocess
def test_posted_all_reduce_on_gloo_sums_later_and_times_out_on_a_silent_peer():
    """gloo, world 2: a posted all-reduce ends on the later step with the right sum; a silent peer times it out."""
    ok = run_ranks(_posted_on_gloo, 2, args=(-1,), timeout=60)
    for res in ok:
        assert res["sum"] == [2.0, 0.0, 1.0]
        assert res["events"] == [("collective_start", 1, True), ("steps", 2, None), ("collective_end", 2, True)]
    silent = run_ranks(_posted_on_gloo, 2, args=(1,), timeout=60)
    assert "error" in silent[0] and "all_reduce of ['ready'] failed" in silent[0]["error"]
    assert silent[0]["events"][-1][0] == "collective_error"


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _frozen_past_the_timeout(rank: int, world: int) -> dict:
    """Rank 1 stops (SIGSTOP) before posting; rank 0's posted all-reduce times out, then it resumes rank 1."""
    import os
    import signal

    import torch.distributed as dist

    coll = Collectives(dist.group.WORLD, rank, world, EventTrace(keep=True), torch.device("cpu"), 5.0, "ep")
    peer = int(coll.all_reduce({"pid": flags(os.getpid() if rank == 1 else 0)}, 10.0)["pid"][0])
    out: dict = {}
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # rank 0 sends SIGCONT once its read has timed out
    else:
        deadline = time.monotonic() + 10.0
        while not _stopped(peer):
            assert time.monotonic() < deadline, "rank 1 never stopped"
            time.sleep(0.01)
    try:
        out["sum"] = coll.post({"ready": flags(1.0, 0.0, 0.0)}, 1.0).wait()["ready"].tolist()
    except GroupBroken as exc:
        out["error"] = str(exc)
    if rank == 0:
        os.kill(peer, signal.SIGCONT)
        time.sleep(3.0)   # alive while rank 1 reads: its result must not come from a closed connection
    return out


@pytest.mark.multiprocess
def test_a_rank_frozen_past_the_timeout_fails_the_all_reduce_its_peer_gave_up_on():
    """gloo: rank 0's read times out while rank 1 is stopped; resumed, rank 1 fails the same all-reduce too."""
    results = run_ranks(_frozen_past_the_timeout, 2, timeout=60)
    assert ["error" in r for r in results] == [True, True], results


def _late_peers_and_a_frozen_member(rank: int, world: int, store_info=None) -> dict:
    """Rank 0 posts the ready flags (timeout 5 s) at once, ranks 1 and 3 3 s later, rank 2 once a real SIGSTOP of
    7 s ends: past rank 0's 5 s, and past the 6 s its wait allowed, but within 5 s of the late ranks' data. On the
    torch group, or (``store_info``) on an elastic EP group built from a TCP store."""
    import torch.distributed as dist

    from eplb_fsm.sim import signals
    from eplb_fsm.transfer.groups import StoreGroup, connect_store

    group = dist.group.WORLD if store_info is None else StoreGroup(
        connect_store(store_info, 30.0), 0, rank, world, 30.0, namespace=store_info.namespace)
    coll = Collectives(group, rank, world, EventTrace(keep=True), torch.device("cpu"), 5.0, "ep")
    coll.all_reduce({"start": flags(1.0)}, 30.0)
    if rank == 2:
        signals.freeze_self(7.0)
    elif rank:
        time.sleep(3.0)
    try:
        out = {"sum": coll.post({"ready": flags(1.0, 0.0, 0.0, 1.0)}, 5.0).wait()["ready"].tolist()}
    except GroupBroken as exc:
        out = {"error": str(exc)}
    time.sleep(2.0)   # every rank alive while the others read: no result may come from a closed connection
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["torch", "store"])
def test_late_peers_and_a_member_frozen_past_the_timeout_end_the_all_reduce_alike(group):
    """gloo times out each wait of a ring all-reduce, not the operation: the late ranks' data kept rank 0's sum
    alive until the frozen rank came back, so every rank reads it (was: rank 0's own wait gave up at 5 + 1 s, or 5 s
    on a store group, and it went to `failed` while ranks 1-3 read the sum: a red team's 4-rank runs, 4 of 4)."""
    from eplb_fsm.transfer.groups import host_store

    master, info = host_store(timeout_s=60.0) if group == "store" else (None, None)
    results = run_ranks(_late_peers_and_a_frozen_member, 4, args=(info,), timeout=90)
    del master
    assert results == [{"sum": [4.0, 0.0, 0.0, 4.0]}] * 4, results


def test_new_transfer_group_returns_on_no_rank_before_every_rank_built_it():
    """Rank 1 is slow building its transfer group: rank 0's new_transfer_group still returns after rank 1's build."""
    import threading

    from eplb_fsm.testing.threads import ThreadGroup, run_threads

    rank0_back, rank1_built = threading.Event(), threading.Event()

    class SlowToBuild(ThreadGroup):
        def transfer_communicator(self, timeout_s):
            if self.rank == 1:
                rank0_back.wait(0.3)  # an unsynchronised rank 0 is back by now
                rank1_built.set()
            return super().transfer_communicator(timeout_s)

    def body(rank, group):
        group = SlowToBuild(group.w, rank)
        coll = Collectives(group, rank, 2, EventTrace(keep=True), torch.device("cpu"), 5.0, "ep")
        coll.new_transfer_group()
        if rank == 0:
            seen = rank1_built.is_set()
            rank0_back.set()
            return seen
        return coll.communicator is not None

    assert run_threads(2, body, timeout=30) == [True, True]


def test_a_transfer_group_a_rank_failed_to_build_counts_on_no_rank():
    """Rank 1's build raises, rank 0 learns it in the agreement (GroupBuildError): neither counts it; the retry has
    its name on both."""
    import threading

    from eplb_fsm.testing.threads import ThreadGroup, run_threads

    repaired = threading.Barrier(2)

    class FailsOnce(ThreadGroup):
        failed = False

        def transfer_communicator(self, timeout_s):
            if self.rank == 1 and not self.failed:
                self.failed = True
                raise TimeoutError("injected: rank 1 could not reach the rendezvous")
            return super().transfer_communicator(timeout_s)

    def body(rank, group):
        group = FailsOnce(group.w, rank)
        coll = Collectives(group, rank, 2, EventTrace(keep=True), torch.device("cpu"), 0.5, "ep")
        from eplb_fsm.transfer.groups import GroupBuildError

        with pytest.raises(TimeoutError if rank == 1 else GroupBuildError):
            coll.new_transfer_group()
        before = coll.transfer_generation
        repaired.wait(10)
        if rank == 0:
            group.w.barrier.reset()   # rank 0's wait broke the barrier: the engine repairs the group
        repaired.wait(10)
        coll.new_transfer_group()
        return before, coll.transfer_group_name

    assert run_threads(2, body, timeout=60) == [(-1, "ep_transfer")] * 2


def _transfer_group_threads(rank: int, world: int, nice: int) -> dict:
    """Build the transfer group with ``transfer_nice=nice``; report the nice of the threads it started."""
    import os
    import sys

    import torch.distributed as dist

    if not sys.platform.startswith("linux"):
        return {"skip": True}
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(os.listdir("/proc/self/task"))
    coll = Collectives(dist.group.WORLD, rank, world, EventTrace(rank=rank, world=world), torch.device("cpu"),
                       20.0, "ep", transfer_nice=nice)
    coll.new_transfer_group()
    started = sorted(set(os.listdir("/proc/self/task")) - before)
    total = torch.ones(4)
    dist.all_reduce(total, group=coll.transfer_group)
    nices = []
    for tid in started:
        try:
            nices.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:
            pass   # a short-lived thread (the niced build's own) that ended after the listing
    return {"base": base, "caller": os.getpriority(os.PRIO_PROCESS, 0), "sum": total.tolist(), "started": nices}


@pytest.mark.multiprocess
def test_transfer_nice_reaches_the_threads_gloo_starts_for_the_transfer_group():
    """gloo, world 2: with transfer_nice=4 every thread the transfer group started runs at base + 4; with 0, at base."""
    for nice in (4, 0):
        for res in run_ranks(_transfer_group_threads, 2, args=(nice,), timeout=60):
            if res.get("skip"):
                pytest.skip("per-thread nice values are Linux only")
            assert res["started"], "building a gloo group starts its own threads"
            assert res["started"] == [min(19, res["base"] + nice)] * len(res["started"])
            assert res["caller"] == res["base"] and res["sum"] == [2.0] * 4


def _registered(group) -> bool:
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _two_ep_groups(rank: int, world: int) -> dict:
    """A whole-world EP group and one over ranks 0-1 in one process: the whole one's transfer group re-created and
    released (a fault, then close()), then the subset's re-created (its own fault)."""
    import torch.distributed as dist

    sub = dist.new_group(ranks=[0, 1])   # every rank of the default group takes part in this one
    whole = Collectives(dist.group.WORLD, rank, world, EventTrace(rank=rank, world=world), torch.device("cpu"), 20.0,
                        "ep")
    whole.new_transfer_group()
    first = whole.transfer_group
    part = Collectives(sub, rank, 2, EventTrace(rank=rank, world=2), torch.device("cpu"), 20.0, "ep") \
        if rank < 2 else None
    if part is not None:
        part.new_transfer_group()
    whole.new_transfer_group()      # a transfer fault
    whole.release_transfers()       # close()
    out = {"first_registered": _registered(first), "after_release": (whole.transfer_group, whole.communicator)}
    if part is not None:
        part.new_transfer_group()   # the subset's own fault: a name no live group has
        total = torch.ones(2)
        dist.all_reduce(total, group=part.transfer_group)
        out["sum"] = total.tolist()
    return out


@pytest.mark.multiprocess
def test_replaced_transfer_groups_stay_registered_so_no_later_group_takes_a_live_name():
    """gloo world 3: a replaced and a released transfer group stay registered (never destroyed: torch names a
    locally synchronized group after how many exist), and a subset EP group's rebuild afterwards still pairs."""
    for rank, out in enumerate(run_ranks(_two_ep_groups, 3, timeout=90)):
        assert out["first_registered"] and out["after_release"] == (None, None), out
        assert out.get("sum") == ([2.0, 2.0] if rank < 2 else None), out

