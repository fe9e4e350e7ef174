"""fsm/recovery.py: recover() gives the transfers a fresh group, so nothing of an interrupted transfer leaks.

Ranks are threads (``run_threads``) over ``ThreadWorld`` groups, the controller's group seam;
every wait in them is bounded.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.sim.loads import zipf_load
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.testing.threads import run_threads

LAYERS = 3


def _target(seed: int) -> np.ndarray:
    p = zipf_load(LAYERS, 8, exponent=1.2, tokens_per_layer=100_000, rng=seed).astype(float) + 1
    return p / p.sum(axis=1, keepdims=True)


def _controller(rank, group):
    config = EplbConfig(window_size=8, step_interval=16, num_redundant_experts=4, collective_timeout_s=1.0,
                        use_async=True)
    model = ToyMoE(num_layers=LAYERS, num_experts=8, num_redundant=4, hidden=8, top_k=2, rank=rank, world_size=2)
    ctl = EplbController(config, group=group, keep_trace=True)
    ctl.add_model(model, "main")
    model.set_load_target(_target(3))
    return ctl, model


def _step(ctl, model, group, s) -> bool:
    x = model.make_batch(s, 64)
    exact = bool(torch.equal(model.forward(x, group), model.reference_forward(x))) if group is not None else True
    ctl.step()
    return exact


def _fail_during_layer_1(rank, group, ctl, model) -> int:
    """Rank 1's layer-1 transfer fails before it receives while the EP group breaks: both ranks go to failed."""
    def hook(layer, name, local):
        if rank == 1 and layer == 1 and not ctl.history:
            raise RuntimeError("injected: rank 1's layer-1 transfer fails before receiving")
    ctl.transfer_hooks.append(hook)
    s = 0
    while not (ctl.state == "transferring" and ctl.layer >= 1):
        assert _step(ctl, model, group, s) and s < 200
        s += 1
    group.fail_all_reduce = True
    while ctl.state != "failed":
        _step(ctl, model, None, s)
        s += 1
        assert s < 400
    return s


def test_a_transfer_interrupted_by_a_broken_group_leaks_nothing_into_the_next_one():
    """After recover(), rank 0's undelivered layer-1 messages are not taken as the next rearrangement's rows."""
    repaired = threading.Barrier(2)

    def body(rank, group):
        ctl, model = _controller(rank, group)
        s = _fail_during_layer_1(rank, group, ctl, model)
        time.sleep(1.5)  # rank 0's job waits out its receive (1 s); its sends stay queued for rank 1
        repaired.wait(30)
        group.fail_all_reduce = False
        if rank == 0:
            group.w.barrier.reset()  # the engine repairs the group once every rank has failed
        repaired.wait(30)
        ctl.recover()
        model.set_load_target(_target(11))
        exact = all(_step(ctl, model, group, s + i) for i in range(40))
        return ctl, model, exact

    for ctl, model, exact in run_threads(2, body, timeout=120):
        assert [h["outcome"] for h in ctl.history][-2:] == ["committed", "committed"]
        assert model.check_weights(ctl.maps("main").phy2log) == [] and exact
        assert any(r["event"] == "transfer_group_reset" for r in ctl.trace.records)


def test_recover_refuses_while_the_worker_still_runs_a_job():
    """A worker that has not drained: RuntimeError, still failed, worker_stuck traced; once idle, recovered."""
    repaired = threading.Barrier(2)

    def body(rank, group):
        ctl, model = _controller(rank, group)
        _fail_during_layer_1(rank, group, ctl, model)
        repaired.wait(30)
        group.fail_all_reduce = False
        if rank == 0:
            group.w.barrier.reset()
        repaired.wait(30)
        assert ctl.worker.wait_idle(30)
        idle, ctl.worker.wait_idle = ctl.worker.wait_idle, lambda timeout: False   # a job that never ends
        with pytest.raises(RuntimeError, match="has not finished its job; the machine stays failed"):
            ctl.recover()
        assert ctl.state == "failed" and ctl.trace.records[-1]["event"] == "worker_stuck"
        ctl.worker.wait_idle = idle
        repaired.wait(30)
        ctl.recover()
        return ctl.state

    assert run_threads(2, body, timeout=120) == ["collecting", "collecting"]
