"""fsm/recovery.py: recover() gives the transfers a fresh group, so nothing of an interrupted transfer leaks.

Ranks are threads (``run_threads``) over ``ThreadWorld`` groups, the controller's group seam;
every wait in them is bounded.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm import recovery
from eplb_fsm.sim.loads import zipf_load
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.testing.threads import ThreadGroup, ThreadWorld, run_threads
from eplb_fsm.transfer.groups import StoreGroup, connect_store, host_store

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
        exact, start = True, len(ctl.history)
        # two rearrangements after the repair; an async one commits once the worker is done, which a loaded host
        # may delay by many steps. Both ranks agree on each commit at the same step, so both stop at the same one
        for i in range(400):
            if len(ctl.history) - start >= 2:
                break
            exact = _step(ctl, model, group, s + i) and exact
        return ctl, model, exact

    for ctl, model, exact in run_threads(2, body, timeout=120):
        assert [h["outcome"] for h in ctl.history][-2:] == ["committed", "committed"]
        assert model.check_weights(ctl.maps("main").phy2log) == [] and exact
        assert any(r["event"] == "transfer_group_reset" for r in ctl.trace.records)


def test_a_paced_layer_aborted_as_late_drains_unpaced_and_the_machine_stays_collecting():
    """async_max_bytes_per_step: a layer whose transfer starts only once the ranks called it late is drained at once
    although no engine step paces it meanwhile: a recoverable fault, collecting, no worker_stuck, pacing back on."""
    experts = 64
    target = zipf_load(LAYERS, experts, exponent=1.2, tokens_per_layer=100_000, rng=3).astype(float) + 1

    def body(rank, group):
        model = ToyMoE(num_layers=LAYERS, num_experts=experts, num_redundant=experts // 2, hidden=8, top_k=2,
                       rank=rank, world_size=2)
        ctl = EplbController(EplbConfig(window_size=8, step_interval=16, num_redundant_experts=experts // 2,
                                        collective_timeout_s=1.0, use_async=True, async_max_bytes_per_step=1),
                             group=group, keep_trace=True)
        ctl.add_model(model, "main")
        model.set_load_target(target / target.sum(axis=1, keepdims=True))

        def faulted() -> bool:
            return any(r["event"] == "transition" and r["trigger"] == "fault" for r in list(ctl.trace.records))

        held: list[int] = []

        def hook(layer, name, local):
            if not held:   # the worker reaches the layer late (a loaded host): only once the ranks aborted it
                held.append(layer)
                deadline = time.monotonic() + 60.0
                while not faulted() and time.monotonic() < deadline:
                    time.sleep(0.01)

        ctl.transfer_hooks.append(hook)
        s = 0
        while not faulted():
            assert _step(ctl, model, group, s) and s < 400
            s += 1
        out = (ctl.state, [r["reason"] for r in ctl.trace.records if r["event"] == "transition"
                           and r["trigger"] == "fault"],
               [r for r in ctl.trace.records if r["event"] in ("worker_stuck", "transfer_group_reset")],
               ctl.mover.closing.is_set())
        ctl.close()
        return out

    for state, reasons, records, unpaced in run_threads(2, body, timeout=120):
        assert state == "collecting" and len(reasons) == 1 and "ran past collective_timeout_s" in reasons[0], reasons
        assert [r["event"] for r in records] == ["transfer_group_reset"]
        assert not unpaced   # the next transfer is paced again


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
        with pytest.raises(RuntimeError, match=r"has not finished its job on 2 rank\(s\); the machine stays failed"):
            ctl.recover()
        assert ctl.state == "failed" and any(r["event"] == "worker_stuck" for r in ctl.trace.records)
        ctl.worker.wait_idle = idle
        repaired.wait(30)
        ctl.recover()
        return ctl.state

    assert run_threads(2, body, timeout=120) == ["collecting", "collecting"]


def test_recover_refuses_maps_that_do_not_fit_the_group():
    """Maps of 16 slots on a 1-rank group of 8: RuntimeError naming them, still failed; fitting maps recover."""
    from eplb_fsm.elastic.scale_plan import remap_columns, resize_window, slot_columns

    ctl = EplbController(EplbConfig(window_size=4, step_interval=100, num_redundant_experts=4), keep_trace=True)
    entry = ctl.add_model(ToyMoE(num_layers=2, num_experts=4, num_redundant=4, hidden=4, top_k=2), "main")
    fitting = entry.maps.phy2log.copy()
    wider = slot_columns([0, -1], entry.num_local)   # the slot space of a 2-rank group, rank 1 empty
    entry.install_placement(remap_columns(fitting, wider), ctl.device, resize_window(entry.window, wider))
    ctl.fire("fault", extra={"reason": "a scale left maps of another group"}, recoverable=False)
    with pytest.raises(RuntimeError, match=r"'main' has 16 slots, the group 8 x 1 = 8\); the machine stays failed"):
        ctl.recover()
    assert ctl.state == "failed" and not any(r.get("trigger") == "recovered" for r in ctl.trace.records)
    back = np.arange(entry.num_local)
    entry.install_placement(remap_columns(entry.maps.phy2log, back), ctl.device, resize_window(entry.window, back))
    ctl.recover()
    assert ctl.state == "collecting" and (entry.maps.phy2log == fitting).all()
    ctl.close()


def test_recover_builds_no_transfer_group_until_every_rank_drained(monkeypatch):
    """Rank 0's worker is stuck: both ranks refuse and build nothing; once it drains, both pair and rearrange."""
    monkeypatch.setattr(recovery, "DRAIN_GRACE_S", 0.5)   # the stuck job outlives any grace: a short one proves as much
    master, info = host_store(timeout_s=30.0)
    release, together = threading.Event(), threading.Barrier(2)

    def body(rank, _):
        group = StoreGroup(connect_store(info, 10), 0, rank, 2, 10.0, namespace=info.namespace, info=info)
        config = EplbConfig(window_size=8, step_interval=8, num_redundant_experts=4, collective_timeout_s=0.5,
                            use_async=True)
        model = ToyMoE(num_layers=LAYERS, num_experts=8, num_redundant=4, hidden=8, top_k=2, rank=rank, world_size=2)
        ctl = EplbController(config, group=group, keep_trace=True, liveness_interval_s=None)
        ctl.add_model(model, "main")
        model.set_load_target(_target(3))
        stalled: list = []

        def hook(layer, name, local):
            if rank == 0 and not stalled:
                stalled.append(layer)
                release.wait(60)   # rank 0's first transfer job outlives the drain, here and in recover()

        ctl.transfer_hooks.append(hook)
        s = 0
        while ctl.state != "failed":
            model.forward(model.make_batch(s, 32), None)
            ctl.step()
            s += 1
            assert s < 2000
            time.sleep(0.005)
        together.wait(60)
        with pytest.raises(RuntimeError, match=r"has not finished its job on 1 rank\(s\)"):
            ctl.recover()
        together.wait(60)
        release.set()
        ctl.recover()
        model.set_load_target(_target(11))
        ctl.rearrange()
        for i in range(200):
            model.forward(model.make_batch(s + i, 32), None)
            ctl.step()
            if ctl.state == "collecting":
                break
        outcome = (ctl.state, ctl.transfer_group_name, [h["outcome"] for h in ctl.history][-1],
                   model.check_weights(ctl.maps("main").phy2log))
        ctl.close()
        return outcome

    try:
        assert run_threads(2, body, timeout=120) == [("collecting", "ep_transfer.1", "committed", [])] * 2
    finally:
        del master


class _QueuedGroup(ThreadGroup):
    """A ThreadGroup whose all-reduce that times out leaves its contribution queued, as NCCL's does (and
    gloo's without a backend timeout): a peer that comes late completes it alone and acts on the sum."""

    def __init__(self, group: ThreadGroup, mailbox: SimpleNamespace) -> None:
        super().__init__(group.w, group.rank)
        self.mailbox, self.calls = mailbox, 0

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        box = self.mailbox
        with box.cond:
            call, self.calls = self.calls, self.calls + 1
            box.slots.setdefault(call, {})[self.rank] = tensor.detach().clone()
            box.cond.notify_all()
            if not box.cond.wait_for(lambda: len(box.slots[call]) == self.world_size, timeout_s):
                raise TimeoutError(f"all-reduce {call} timed out; its contribution stays queued")
            total = torch.zeros_like(tensor)
            for part in box.slots[call].values():
                total += part
        tensor.copy_(total)


def test_recover_refuses_on_every_rank_when_a_late_rank_committed_a_layer_its_peer_did_not():
    """Rank 1 frozen past the timeout completes the ready all-reduce rank 0 gave up on: both refuse to recover."""
    mailbox = SimpleNamespace(cond=threading.Condition(), slots={})
    repaired = threading.Barrier(2)

    def body(rank, group):
        group = _QueuedGroup(group, mailbox)
        ctl, model = _controller(rank, group)
        r, s, frozen = ctl.rearranger, 0, False
        while ctl.state != "failed":
            model.forward(model.make_batch(s, 64), None)   # an engine with no collectives of its own
            ctl.step()
            s += 1
            assert s < 400
            if not frozen and ctl.state == "transferring" and r.current.job_step == ctl.steps:
                r.current.job.future.exception(timeout=10)   # the layer is here: the next flags say ready
                frozen = True
                if rank == 1:
                    time.sleep(2.5)   # frozen past collective_timeout_s before it posts them
        repaired.wait(30)
        with mailbox.cond:   # the engine repairs the group: nothing of the old one is queued any more
            mailbox.slots.clear()
            group.calls = 0
        repaired.wait(30)
        maps = ctl.maps("main").phy2log.copy()
        with pytest.raises(RuntimeError, match="the ranks disagree on the committed maps of model 'main'"):
            ctl.recover()
        return ctl.state, maps

    (state0, maps0), (state1, maps1) = run_threads(2, body, timeout=120)
    assert not np.array_equal(maps0, maps1)   # the late rank did commit one more layer
    assert state0 == state1 == "failed"



def _failed_alone():
    """A world-1 controller sent to failed by a fault that is not recoverable."""
    ctl = EplbController(EplbConfig(window_size=2, step_interval=4, num_redundant_experts=2), keep_trace=True)
    ctl.add_model(ToyMoE(num_layers=2, num_experts=4, num_redundant=2, hidden=8, rank=0, world_size=1), "m")
    ctl.fire("fault", extra={"reason": "test"}, recoverable=False)
    return ctl


@pytest.mark.parametrize("reloaded, match", [
    (1, "reloaded must be True, False or \\(model name, layer\\) pairs, got 1"),
    ("m", "reloaded must be True, False or \\(model name, layer\\) pairs, got 'm'"),
    ([("x", 0)], "reloaded must hold \\(model name, layer\\) pairs of added models, got \\('x', 0\\)"),
    ([("m",)], "reloaded must hold \\(model name, layer\\) pairs of added models, got \\('m',\\)"),
    ([("m", 2)], "reloaded names layer 2 of model 'm', which has layers 0..1"),
    ([("m", True)], "reloaded names layer True of model 'm'"),
])
def test_recover_refuses_a_bad_reloaded_before_anything_changes(reloaded, match):
    """recover(reloaded=...) that is not a bool or (added model, layer in range) pairs: ValueError, still failed."""
    ctl = _failed_alone()
    records = len(ctl.trace.records)
    with pytest.raises(ValueError, match=f"recover\\(\\): {match}"):
        ctl.recover(reloaded=reloaded)
    assert ctl.state == "failed" and len(ctl.trace.records) == records
    ctl.close()


def test_recover_takes_a_numpy_bool_as_reloaded():
    """reloaded=np.True_ (as a flag computed with numpy) counts as True: the untrusted layer is confirmed."""
    ctl = _failed_alone()
    ctl.rearranger.untrusted[("m", 1)] = "RuntimeError: injected"
    ctl.rearranger.broken_ranks = 1
    ctl.recover(reloaded=np.True_)
    assert ctl.state == "collecting" and not ctl.rearranger.untrusted and not ctl.rearranger.broken_ranks
    ctl.close()


@pytest.mark.parametrize("group, match", [
    (object(), "recover\\(\\): group must be a torch.distributed process group"),
    (ThreadWorld(2).group(1), "recover\\(\\): group must give this rank number 0 of 1 .* got rank 1 of 2"),
])
def test_recover_refuses_a_group_of_another_rank_or_kind_before_anything_changes(group, match):
    """recover(group=...) that is no group, or gives another rank number or size: ValueError, the old group kept."""
    ctl = _failed_alone()
    name = ctl.group_name
    with pytest.raises(ValueError, match=match):
        ctl.recover(group=group)
    assert (ctl.state, ctl.group_name) == ("failed", name)
    ctl.close()
