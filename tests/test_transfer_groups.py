"""Store-built EP groups: real gloo groups without init_process_group, bounded when a member is missing.

Members run as threads of this process (gloo does not mind), so no process is spawned.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from eplb_fsm.transfer.groups import (
    GroupBuildError,
    StoreGroup,
    StoreInfo,
    check_namespace,
    connect_store,
    host_store,
)


def _in_threads(fns, timeout=30.0):
    """Run each fn in a thread; return their results (re-raise the first error)."""
    out: list = [None] * len(fns)
    errors: list = []

    def body(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a member hung"
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def store():
    master, info = host_store(timeout_s=20.0)
    yield master, info
    del master


def test_store_info_validates_its_fields():
    """A bad host, port or namespace is a ValueError naming the field."""
    with pytest.raises(ValueError, match="port"):
        StoreInfo("127.0.0.1", 0)
    with pytest.raises(ValueError, match="host"):
        StoreInfo("", 1234)


@pytest.mark.parametrize("namespace", ["", None, 3])
def test_store_info_refuses_an_empty_or_non_string_namespace(namespace):
    """An empty, None or non-string namespace is a ValueError naming the store namespace and the rule."""
    with pytest.raises(ValueError, match=r"^store namespace must be a non-empty string"):
        StoreInfo("127.0.0.1", 1234, namespace=namespace)


def test_store_info_takes_a_namespace_with_slashes_like_store_group():
    """StoreInfo accepts "job/eplb" as StoreGroup and the joiner do (one rule, check_namespace)."""
    info = StoreInfo("127.0.0.1", 1234, "job/eplb")
    assert info.namespace == "job/eplb" and check_namespace(info.namespace) == "job/eplb"


def test_two_members_all_reduce_exchange_messages_and_build_a_successor(store):
    """Two members sum, swap point-to-point messages in queue order, then form generation 1."""
    _, info = store

    def member(rank):
        group = StoreGroup.connect(info, 0, rank, 2, timeout_s=10.0)
        t = torch.tensor([rank + 1.0, 10.0 * rank], dtype=torch.float64)
        group.all_reduce(t, 5.0)
        comm = group.transfer_communicator(5.0)
        mine = [torch.full((3,), float(rank * 10 + k)) for k in range(2)]
        got = [torch.zeros(3) for _ in range(2)]
        peer = 1 - rank
        for k in range(2):
            comm.add_send(mine[k], rank, peer)
            comm.add_recv(got[k], peer, rank)
        comm.execute()
        nxt = group.successor(1, 1 - rank, 2, 10.0)
        u = torch.tensor([float(nxt.rank)], dtype=torch.float64)
        nxt.all_reduce(u, 5.0)
        return t.tolist(), [g[0].item() for g in got], nxt.trace_name, u.item(), group.trace_name

    a, b = _in_threads([lambda: member(0), lambda: member(1)])
    assert a[0] == b[0] == [3.0, 10.0]
    assert a[1] == [10.0, 11.0] and b[1] == [0.0, 1.0]
    assert (a[2], a[3], a[4]) == ("ep@1", 1.0, "ep")


def test_a_missing_member_fails_the_build_within_the_timeout(store):
    """A group whose second member never comes raises GroupBuildError after ~timeout_s, not a hang."""
    _, info = store
    t0 = time.monotonic()
    with pytest.raises(GroupBuildError, match="not complete within"):
        StoreGroup(connect_store(info, 5.0), 7, 0, 2, timeout_s=0.5, namespace=info.namespace)
    assert time.monotonic() - t0 < 5.0


def test_a_transfer_group_one_member_failed_to_build_alone_pairs_on_the_retry(store):
    """A lone failed transfer build neither advances its number nor leaves its address: the retry pairs."""
    _, info = store
    groups = _in_threads([lambda r=r: StoreGroup.connect(info, 11, r, 2, timeout_s=10.0) for r in range(2)])
    with pytest.raises(GroupBuildError, match="transfer0"):
        groups[0].transfer_communicator(0.5)   # rank 1 is busy elsewhere: rank 0 builds alone

    def build(rank):
        if rank == 0:
            time.sleep(0.3)   # rank 1 reads the rendezvous first: a stale address of rank 0 would be there
        comm = groups[rank].transfer_communicator(5.0)
        t = torch.full((2,), float(rank))
        if rank == 0:
            comm.add_send(t, 0, 1)
        else:
            comm.add_recv(t, 0, 1)
        comm.execute()
        return comm.name, t.tolist()

    assert _in_threads([lambda r=r: build(r) for r in range(2)]) == [("ep@11/transfer0", [0.0, 0.0])] * 2


def test_successor_generation_must_grow(store):
    """A successor may not reuse or go back to an earlier generation's store prefix."""
    _, info = store
    group = StoreGroup.connect(info, 3, 0, 1, timeout_s=5.0)
    with pytest.raises(ValueError, match="generation"):
        group.successor(3, 0, 1)
    assert group.key("handover", 4) == "eplb/g4/handover"


def test_communicator_rejects_messages_to_itself(store):
    """Sends and receives name a peer of the group, never the rank itself."""
    _, info = store
    comm = StoreGroup.connect(info, 9, 0, 1, timeout_s=5.0).transfer_communicator(5.0)
    with pytest.raises(ValueError, match="dst"):
        comm.add_send(torch.zeros(1), 0, 0)
    with pytest.raises(ValueError, match="src"):
        comm.add_send(torch.zeros(1), 1, 0)


def test_the_store_groups_communicator_refuses_weights_off_the_cpu(store):
    """PgCommunicator is gloo: meta weights are refused before posting (gloo aborted the process reading them)."""
    import numpy as np

    from eplb_fsm.transfer import rearrange_expert_weights_inplace
    from eplb_fsm.transfer.inputs import UnmovableWeightsError

    _, info = store
    comm = StoreGroup.connect(info, 11, 0, 1, timeout_s=5.0).transfer_communicator(5.0)
    assert comm.host_memory_only and comm.backend == "gloo"
    old = np.array([[0, 1]])
    with pytest.raises(UnmovableWeightsError, match=r"is on meta, and the transfer group \(gloo\)"):
        rearrange_expert_weights_inplace(old, old[:, ::-1].copy(), [[torch.zeros(2, 3, device="meta")]],
                                         communicator=comm)


def test_an_infinite_or_bool_timeout_is_refused_before_a_store_starts():
    """host_store(timeout_s=inf or True) is a ValueError naming timeout_s, not an overflow inside torch."""
    for bad in (float("inf"), True):
        with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
            host_store(timeout_s=bad)


def test_a_transfer_build_that_returned_on_some_ranks_only_is_retried_by_all_under_one_number(store, monkeypatch):
    """World 3: rank 2's build of the controller's second transfer group raises after the mesh formed (its
    peers' builds return). Every rank fails that build together (no one waits out a timeout, the EP group's
    all-reduces stay in step) and the retry pairs: the store numbering is not skewed."""
    from eplb_fsm.fsm import collectives as coll
    from eplb_fsm.transfer import groups as groups_mod
    from eplb_fsm.trace import EventTrace

    _, info = store
    real = groups_mod._gloo
    armed = {"on": True}

    def flaky(store_, prefix, rank, world, timeout):
        pg = real(store_, prefix, rank, world, timeout)
        if rank == 2 and prefix.endswith("/transfer1") and armed["on"]:
            armed["on"] = False
            raise GroupBuildError(f"group {prefix!r}: raised here after the mesh formed")
        return pg

    monkeypatch.setattr(groups_mod, "_gloo", flaky)
    groups = _in_threads([lambda r=r: StoreGroup.connect(info, 13, r, 3, timeout_s=10.0) for r in range(3)])
    cols = [coll.Collectives(g, g.rank, 3, EventTrace(g.rank, 3), torch.device("cpu"), 2.0, g.trace_name, 13)
            for g in groups]
    _in_threads([c.new_transfer_group for c in cols])   # the controller's first one: transfer0

    def second(c):
        t0 = time.monotonic()
        try:
            c.new_transfer_group()
            return "built", 0.0
        except Exception:
            return "failed", time.monotonic() - t0

    outcomes = _in_threads([lambda c=c: second(c) for c in cols])
    assert [o for o, _ in outcomes] == ["failed"] * 3
    assert max(s for _, s in outcomes) < 1.5    # told in the agreement, not after the 2 s collective timeout
    assert [g._transfers for g in groups] == [1, 1, 1]
    _in_threads([c.new_transfer_group for c in cols])   # the retry: transfer1 on every rank
    assert [c.transfer_group_name for c in cols] == ["ep_transfer@13.1"] * 3

    def exchange(c):
        t = torch.full((2,), float(c.rank))
        peer = (c.rank + 1) % 3
        src = (c.rank - 1) % 3
        got = torch.zeros(2)
        c.communicator.add_send(t, c.rank, peer)
        c.communicator.add_recv(got, src, c.rank)
        c.communicator.execute()
        return got.tolist()

    assert _in_threads([lambda c=c: exchange(c) for c in cols]) == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
