"""The executor's per-maps schedule cache: a repeated rearrangement skips validation and
planning, and gives the same bit-exact result as a cold one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eplb_fsm.transfer.schedule as schedule
from eplb_fsm.transfer import (
    InProcessCommunicator,
    TransferBuffer,
    commit_layer_from_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)

G = 3
OLD = np.array([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
NEW = np.array([[2, 4, 0, 5, 1, 3], [0, 3, 5, 4, 1, 2]])


def _world(m: np.ndarray):
    """Per rank, per layer: a float32 (S, 4) and an int8 (S, 3) tensor; row bytes encode (layer, expert)."""
    s = m.shape[1] // G
    return [
        [
            [
                torch.tensor([[k * 100 + e + 0.25 * j for j in range(4)] for e in m[k, r * s : (r + 1) * s]],
                             dtype=torch.float32),
                torch.tensor([[(k * 7 + e * 3 + j) % 127 for j in range(3)] for e in m[k, r * s : (r + 1) * s]],
                             dtype=torch.int8),
            ]
            for k in range(m.shape[0])
        ]
        for r in range(G)
    ]


def _same(a, b) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for ra, rb in zip(a, b)
        for la, lb in zip(ra, rb)
        for x, y in zip(la, lb)
    )


def _count_planning(monkeypatch) -> list[int]:
    """Counts the schedules planned, in Python (all_layer_transfers) or in C (prepared_layers)."""
    calls = [0]

    def counting(real):
        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        return counted

    monkeypatch.setattr(schedule, "all_layer_transfers", counting(schedule.all_layer_transfers))
    monkeypatch.setattr(schedule.native_schedule, "prepared_layers", counting(schedule.native_schedule.prepared_layers))
    return calls


@pytest.mark.parametrize("batching", [False, True])
def test_repeated_maps_reuse_the_plan_and_stay_bit_exact(monkeypatch, batching):
    schedule._SCHEDULES.clear()
    calls = _count_planning(monkeypatch)
    buf = TransferBuffer()
    for _ in range(3):  # old -> new -> old, three times: the second and third rounds are cache hits
        weights = _world(OLD)
        comm = InProcessCommunicator(G)
        rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=comm, migration_batching=batching, buffer=buf)
        assert _same(weights, _world(NEW))
        rearrange_expert_weights_inplace(NEW, OLD, weights, communicator=comm, migration_batching=batching, buffer=buf)
        assert _same(weights, _world(OLD))
    assert calls[0] == 2  # each direction planned once, all its layers in one pass


def test_batching_and_group_size_have_their_own_plans():
    schedule._SCHEDULES.clear()
    execs = []
    for batching in (False, True, False):
        weights = _world(OLD)
        comm = InProcessCommunicator(G)
        rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=comm, migration_batching=batching,
                                         buffer=TransferBuffer())
        assert _same(weights, _world(NEW))
        execs.append(comm.executes)
    assert execs[0] == execs[2] == OLD.shape[0] and execs[1] > execs[0]  # waves with batching
    # the same maps in a group whose size does not divide P are still rejected
    with pytest.raises(ValueError, match="P % G"):
        rearrange_expert_weights_inplace(OLD, NEW, [[]] * 4, communicator=InProcessCommunicator(4),
                                         buffer=TransferBuffer())


def test_cache_does_not_alias_the_callers_maps():
    schedule._SCHEDULES.clear()
    old, new = OLD.copy(), NEW.copy()
    weights = _world(OLD)
    rearrange_expert_weights_inplace(old, new, weights, communicator=InProcessCommunicator(G), buffer=TransferBuffer())
    old[:], new[:] = NEW, OLD  # the caller reuses its arrays for the way back
    rearrange_expert_weights_inplace(old, new, weights, communicator=InProcessCommunicator(G), buffer=TransferBuffer())
    assert _same(weights, _world(OLD))
    # a bad map that was never validated is still rejected, even for known shapes
    bad = NEW.copy()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="expert ids"):
        rearrange_expert_weights_inplace(OLD, bad, _world(OLD), communicator=InProcessCommunicator(G),
                                         buffer=TransferBuffer())


def test_one_layer_entry_points_share_the_cache_and_keep_their_label():
    schedule._SCHEDULES.clear()
    for label in (0, 5):
        weights = _world(OLD)
        layer_w = [weights[r][1] for r in range(G)]
        pending = transfer_layer_to_buffer(OLD[1], NEW[1], layer_w, TransferBuffer(), layer=label,
                                           communicator=InProcessCommunicator(G))
        assert pending.layer == label
        commit_layer_from_buffer(pending, layer_w)
        want = _world(NEW)
        assert _same([[weights[r][1]] for r in range(G)], [[want[r][1]] for r in range(G)])
    assert len(schedule._SCHEDULES) == 1


def test_cache_is_bounded():
    schedule._SCHEDULES.clear()
    rng = np.random.default_rng(0)
    for _ in range(schedule._SCHEDULE_CACHE_SIZE + 5):
        new = rng.integers(-1, 6, size=(2, 6))  # replicas and empty slots
        want = _world(np.where(new >= 0, new, OLD))  # an empty new slot keeps its old weights
        for _ in range(2):  # cold, then a cache hit
            weights = _world(OLD)
            rearrange_expert_weights_inplace(OLD, new, weights, communicator=InProcessCommunicator(G),
                                             buffer=TransferBuffer())
            assert _same(weights, want)
    assert len(schedule._SCHEDULES) <= schedule._SCHEDULE_CACHE_SIZE


def test_messages_alone_equal_the_full_layers_and_are_reused(monkeypatch):
    """With the Python planner, a messages-only layer has the full layer's waves and ops, no plans or commit, and the
    full layer reuses them."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    for batching in (False, True):
        schedule.clear_schedule_cache()
        _, _, sched = schedule.prepare_maps(OLD, NEW, G, None, 2, tuple(range(G)), batching)
        assert not sched.prepared
        heads = [sched.messages(k) for k in range(OLD.shape[0])]
        assert not sched.prepared  # posting needs no per-rank plan
        for k, head in enumerate(heads):
            full = sched.layer(k)
            assert head.layer == k and set(head.plans) == set(full.plans) and set(head.plans.values()) == {None}
            assert head.waves == full.waves and head.ops == full.ops
            assert head.commit == {} and head.local_runs == {}
            assert full.ops is head.ops  # built once
            assert sched.messages(k) is full  # once the layer is prepared it is what posting gets
            for r, plan in full.plans.items():  # the ops are the plan's sends and receives, in order
                if not batching:
                    assert full.ops[0].sends[r] == tuple(zip(plan.send_peers.tolist(), plan.send_rows.tolist()))
                    assert full.ops[0].recvs[r] == tuple(zip(plan.recv_peers.tolist(), plan.recv_rows.tolist()))
        assert sched.prepared


class _FirstStartSpy(InProcessCommunicator):
    """Records, at every start(), whether the schedule of the maps in flight had layer 0 prepared."""

    def __init__(self, g, maps):
        super().__init__(g)
        self.maps = maps
        self.prepared_at_start: list[bool] = []

    def start(self):
        sched = schedule.prepare_maps(*self.maps, G, None, 2, self.local_ranks, False)[2]
        self.prepared_at_start.append(sched.prepared)
        super().start()


def test_new_maps_post_layer_0_before_planning_it_and_stay_bit_exact(monkeypatch):
    """With the Python planner and new maps, layer 0's messages go out before its plans and commit order exist;
    cached maps start fully planned; both bit-exact."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    schedule.clear_schedule_cache()
    spy = _FirstStartSpy(G, (OLD, NEW))
    weights = _world(OLD)
    rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=spy, buffer=TransferBuffer())
    assert _same(weights, _world(NEW))
    assert spy.prepared_at_start[0] is False and all(spy.prepared_at_start[1:])
    spy.prepared_at_start.clear()
    weights = _world(OLD)
    rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=spy, buffer=TransferBuffer())
    assert _same(weights, _world(NEW))
    assert spy.prepared_at_start and all(spy.prepared_at_start)


@pytest.mark.skipif(not schedule.native_schedule.built(), reason="the C schedule extension is not built")
def test_c_planner_prepares_every_layer_before_the_first_message():
    """With the C planner, new maps are planned whole at first use: every start() finds layer 0 prepared, bit-exact."""
    schedule.clear_schedule_cache()
    spy = _FirstStartSpy(G, (OLD, NEW))
    weights = _world(OLD)
    rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=spy, buffer=TransferBuffer())
    assert _same(weights, _world(NEW))
    assert spy.prepared_at_start and all(spy.prepared_at_start)
