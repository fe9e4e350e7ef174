"""The C schedule (transfer/native_schedule.py): the same layers, messages, commits and splits as the Python planner."""

from __future__ import annotations

import numpy as np
import pytest

import eplb_fsm.transfer.schedule as schedule
from eplb_fsm.transfer import native_schedule, plan_all

pytestmark = pytest.mark.skipif(not native_schedule.built(), reason="the C schedule extension is not built")


def _commit(c) -> tuple:
    return (c.direct, c.direct_reads.tolist(), c.dst.tolist(), c.src.tolist(), c.runs)


def _plan(p) -> list:
    return [v.tolist() if isinstance(v, np.ndarray) else v for v in (getattr(p, f) for f in p.__dataclass_fields__)]


def _dump(sched: schedule.Schedule) -> list:
    """Everything a schedule gives the executor (and its plans), as plain values."""
    out = []
    for k in range(sched.old.shape[0]):
        prep = sched.layer(k)
        out.append((
            prep.layer,
            [(w.pairs, [t.tolist() for t in w.transfers]) for w in prep.waves],
            [(o.sends, o.recvs) for o in prep.ops],
            prep.local_runs,
            {r: _commit(c) for r, c in prep.commit.items()},
            {r: v.tolist() for r, v in prep.staged.items()},
            {r: _plan(p) for r, p in prep.plans.items()},
        ))
        if k + 1 < sched.old.shape[0]:
            early, late = sched.split(k)
            out.append(({r: _commit(c) for r, c in early.items()}, {r: _commit(c) for r, c in late.items()}))
    return out


def _both(monkeypatch, old, new, g, ranks) -> tuple[list, list, schedule.Schedule]:
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    schedule.clear_schedule_cache()
    python = _dump(schedule.prepare_maps(old, new, g, None, 2, ranks, False)[2])
    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    schedule.clear_schedule_cache()
    sched = schedule.prepare_maps(old, new, g, None, 2, ranks, False)[2]
    return python, _dump(sched), sched


def _random_maps(rng, g: int, s: int, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Valid (L, P) maps with replicas, empty slots and in-rank cycles (few experts, so rows repeat)."""
    p = g * s
    experts = int(rng.integers(1, p + 1))
    old = rng.integers(0, experts, size=(layers, p))
    old[rng.random((layers, p)) < 0.15] = -1
    new = rng.integers(0, experts, size=(layers, p))
    new[rng.random((layers, p)) < 0.15] = -1
    for k in range(layers):  # every needed expert held somewhere in the old map
        held = np.unique(old[k][old[k] >= 0])
        missing = (new[k] >= 0) & ~np.isin(new[k], held)
        new[k][missing] = rng.choice(held, size=int(missing.sum())) if held.size else -1
    return old, new


@pytest.mark.parametrize("seed", range(6))
def test_random_maps_plan_the_same_in_c_and_python(monkeypatch, seed):
    """On random small maps (any local ranks) the C planner's layers, splits and plans equal the Python planner's."""
    rng = np.random.default_rng(seed)
    for _ in range(120):
        g, s, layers = int(rng.integers(1, 7)), int(rng.integers(1, 7)), int(rng.integers(1, 5))
        old, new = _random_maps(rng, g, s, layers)
        ranks = tuple(sorted(rng.choice(g, size=int(rng.integers(1, g + 1)), replace=False).tolist()))
        python, native, sched = _both(monkeypatch, old, new, g, ranks)
        assert sched._native
        assert native == python


def test_deepseek_v3_sized_maps_plan_the_same(monkeypatch):
    """58 layers of 288 slots on 32 ranks (full maps, permuted replicas): rank 5's schedule is the same in C and
    Python."""
    rng = np.random.default_rng(7)
    layers, g, experts, p = 58, 32, 256, 288

    def one() -> np.ndarray:
        return np.stack([rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, p - experts)]))
                         for _ in range(layers)])

    python, native, _ = _both(monkeypatch, one(), one(), g, (5,))
    assert native == python


def test_unchanged_and_empty_layers(monkeypatch):
    """A layer that moves nothing has no waves and empty commits in both planners; an all-empty new layer too."""
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0]])
    new = np.array([[0, 1, 2, 3], [-1, -1, -1, -1], [2, 3, 0, 1]])
    python, native, sched = _both(monkeypatch, old, new, 2, (0, 1))
    assert native == python
    assert sched.layer(0).waves == [] and sched.layer(1).waves == []


def test_maps_valid_agrees_with_numpy(monkeypatch):
    """The C check accepts and rejects the same maps as the numpy one: ids out of range, a needed expert held by no
    rank."""
    rng = np.random.default_rng(3)
    cases = [_random_maps(rng, 3, 4, 3) for _ in range(50)]
    cases += [(np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 4]])),  # id >= P
              (np.array([[0, 1, 2, -2]]), np.array([[0, 1, 2, 3]])),  # id < -1
              (np.array([[0, 1, 1, -1]]), np.array([[0, 1, 2, 1]])),  # expert 2 not held
              (np.array([[0, 1], [2, 3]]), np.array([[0, 1], [0, 3]]))]  # held, but in another layer
    verdicts = []
    for old, new in cases:
        old, new = np.ascontiguousarray(old, dtype=np.int64), np.ascontiguousarray(new, dtype=np.int64)
        monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
        want = plan_all.maps_valid(old, new)
        assert native_schedule.maps_valid(old, new) == want
        verdicts.append(want)
    assert verdicts[-4:] == [False] * 4 and any(verdicts)


def test_bad_maps_still_name_the_layer_and_rule(monkeypatch):
    """With the C check, invalid maps still raise the per-layer ValueError before anything is planned."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    schedule.clear_schedule_cache()
    with pytest.raises(ValueError, match=r"new_phy2log\[1\]: expert 5 is needed but held by no rank"):
        schedule.prepare_maps(np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 4]]),
                              np.array([[0, 1, 2, 3, 4, 5], [5, 1, 2, 3, 4, 4]]), 2, None, 2, (0,), False)


def test_batching_and_the_switch_keep_the_python_planner(monkeypatch):
    """Migration batching, and EPLB_FSM_NATIVE=0, plan in Python; the C path is taken otherwise."""
    old, new = np.array([[0, 1, 2, 3]]), np.array([[2, 3, 0, 1]])
    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    schedule.clear_schedule_cache()
    sched = schedule.prepare_maps(old, new, 2, None, 2, (0,), True)[2]
    sched.layer(0)
    assert sched._native is False
    sched = schedule.prepare_maps(old, new, 2, None, 2, (0,), False)[2]
    sched.layer(0)
    assert sched._native is True
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    schedule.clear_schedule_cache()
    sched = schedule.prepare_maps(old, new, 2, None, 2, (0,), False)[2]
    sched.layer(0)
    assert sched._native is False


def test_plans_on_demand_are_the_python_plans(monkeypatch):
    """A C-planned layer's plans are planned in Python on first access, for local ranks only."""
    old, new = np.array([[0, 1, 2, 3]]), np.array([[2, 3, 0, 1]])
    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    schedule.clear_schedule_cache()
    sched = schedule.prepare_maps(old, new, 2, None, 2, (1,), False)[2]
    plans = sched.layer(0).plans
    assert list(plans) == [1] and len(plans) == 1 and not sched._plans  # nothing planned yet
    assert plans[1].recv_rows.tolist() == [0, 1] and plans[1].recv_peers.tolist() == [0, 0]
    with pytest.raises(KeyError):
        plans[0]


def test_rank_layers_rejects_mismatched_buffers():
    """The C entry point refuses buffers that do not match the shape it is told, and ranks outside the group."""
    from eplb_fsm.transfer.cschedule import rank_layers

    old = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="buffer sizes"):
        rank_layers(old, old, 3, 4, 2, (0,))
    with pytest.raises(ValueError, match="outside the group"):
        rank_layers(old, old, 2, 4, 2, (2,))


def test_maps_without_slots_plan_in_python_and_move_nothing(monkeypatch):
    """(L, 0) maps: the C planner is not asked (it needs slots); the transfer is a no-op, not an internal error."""
    import torch

    from eplb_fsm.transfer import InProcessCommunicator, rearrange_expert_weights_inplace

    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    schedule.clear_schedule_cache()
    empty = np.zeros((2, 0), np.int64)
    comm = InProcessCommunicator(2)
    rearrange_expert_weights_inplace(empty, empty, [[[torch.zeros(0, 3)], [torch.zeros(0, 3)]] for _ in range(2)],
                                     communicator=comm)
    assert comm.total_messages == 0
