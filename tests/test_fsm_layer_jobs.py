"""Tests for eplb_fsm.fsm.layer_jobs: async transfers, one job at a time or with the next layer ahead.

The unit tests drive :class:`LayerJobs` with a recording worker; the controller tests run
async mode with ``async_prefetch`` on 2 ranks played by threads (``run_threads``), with
the same engine loop as test_fsm_controller.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.layer_jobs import LayerJobs, TransferSkipped
from eplb_fsm.fsm.worker import Job
from eplb_fsm.sim.loads import zipf_load
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.testing.threads import run_threads


class RecordingWorker:
    """Keeps submitted jobs unrun; ``run_next()`` runs the oldest, as the worker's FIFO would."""

    def __init__(self, clock=lambda: 0.0) -> None:
        self.queue: list[Job] = []
        self.clock = clock
        self.ids = 0

    def submit(self, fn, *args, kind="job", layer=None, **kwargs):
        job = Job(self.ids, kind, fn, args, kwargs, layer=layer, clock=self.clock)
        self.ids += 1
        self.queue.append(job)
        return job

    def run_next(self) -> Job:
        job = self.queue.pop(0)
        try:
            job.future.set_result(job.fn(*job.args, **job.kwargs))
        except Exception as exc:
            job.future.set_exception(exc)
        return job


class RecordingMover:
    def __init__(self, fail_layers=()) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.fail_layers = set(fail_layers)

    def transfer(self, new_phy2log, layer, spare=False):
        self.calls.append((layer, spare))
        if layer in self.fail_layers:
            raise RuntimeError(f"injected failure of layer {layer}")
        return ("pending", layer, spare)


def _plan(changed):
    return SimpleNamespace(changed=list(changed), new_phy2log=[np.zeros((len(changed), 4), dtype=np.int64)])


def test_without_prefetch_each_changed_layer_is_one_job_into_the_main_buffer():
    """prefetch off: start() submits only the layer asked for, always into the main buffer, never one ahead."""
    worker, mover = RecordingWorker(), RecordingMover()
    jobs = LayerJobs(worker, mover, prefetch=False)
    plan = _plan([True, True, True])
    for step, layer in ((5, 0), (9, 1), (12, 2)):
        job, ahead = jobs.start(plan, layer, step)
        assert not ahead and len(worker.queue) == 1 and jobs.ahead is None
        worker.run_next()
        assert job.result(0) == ("pending", layer, False)
    assert mover.calls == [(0, False), (1, False), (2, False)] and jobs.handed_over == 0


def test_prefetch_submits_the_next_changed_layer_ahead_and_hands_it_over():
    """prefetch on: layer 0 and the next changed layer (2) are queued; reaching 2 hands its job over (ahead: True)."""
    worker, mover = RecordingWorker(), RecordingMover()
    jobs = LayerJobs(worker, mover, prefetch=True)
    plan = _plan([True, False, True, True])
    first, ahead0 = jobs.start(plan, 0, step=7)
    assert not ahead0 and [j.layer for j in worker.queue] == [0, 2] and jobs.ahead_layer == 2
    worker.run_next()
    worker.run_next()                       # layer 2 moved while layer 0 awaits its commit
    ahead = jobs.ahead
    job2, ahead2 = jobs.start(plan, 2, step=10)
    assert job2 is ahead and ahead2 and jobs.handed_over == 1
    assert [j.layer for j in worker.queue] == [3] and jobs.ahead_layer == 3   # only the next one is new
    worker.run_next()
    job3, _ = jobs.start(plan, 3, step=12)
    assert jobs.ahead is None and not worker.queue                             # nothing after layer 3
    # two uncommitted layers never share a buffer: buffers alternate job by job
    assert mover.calls == [(0, False), (2, True), (3, False)]
    assert job3.result(0) == ("pending", 3, False)


def test_a_job_ahead_of_a_failed_one_is_skipped_without_moving_anything():
    """The layer queued behind a transfer that failed on this rank raises TransferSkipped and never reaches the
    mover."""
    worker, mover = RecordingWorker(), RecordingMover(fail_layers={0})
    jobs = LayerJobs(worker, mover, prefetch=True)
    jobs.start(_plan([True, True]), 0, step=1)
    failed, skipped = worker.run_next(), worker.run_next()
    assert isinstance(failed.error(), RuntimeError)
    assert isinstance(skipped.error(), TransferSkipped) and "layer 0" in str(skipped.error())
    assert mover.calls == [(0, False)]


def test_drop_forgets_the_job_ahead_so_a_later_start_submits_afresh():
    """After drop() (an abort), reaching the layer that was ahead submits a new job, not one handed over."""
    worker, mover = RecordingWorker(), RecordingMover()
    jobs = LayerJobs(worker, mover, prefetch=True)
    plan = _plan([True, True])
    jobs.start(plan, 0, step=3)
    stale = jobs.drop()
    assert stale is not None and stale.layer == 1 and jobs.ahead is None and jobs.drop() is None
    fresh, ahead = jobs.start(plan, 1, step=20)
    assert fresh is not stale and not ahead


def test_a_handed_over_job_times_out_from_its_hand_over_not_its_submission():
    """age() of a job submitted ahead counts from when the machine reached it, so queueing behind layer k is not
    lateness."""
    now = [100.0]
    worker = RecordingWorker(clock=lambda: now[0])
    jobs = LayerJobs(worker, RecordingMover(), prefetch=True)
    plan = _plan([True, True])
    jobs.start(plan, 0, step=0)
    now[0] = 160.0                           # layer 0 took a minute
    job1, _ = jobs.start(plan, 1, step=9)
    now[0] = 161.0
    assert job1.age() == pytest.approx(1.0) and job1.submitted_at == 100.0


# --------------------------------------------------------------------------- the controller, 2 ranks


def _skewed(layers: int, experts: int) -> np.ndarray:
    p = zipf_load(layers, experts, exponent=1.2, tokens_per_layer=100_000, rng=3).astype(float) + 1
    return p / p.sum(axis=1, keepdims=True)


def _drive(ctl, model, group, steps, target, on_step=None):
    model.set_load_target(target)
    for s in range(steps):
        x = model.make_batch(s, 64)
        assert torch.equal(model.forward(x, group), model.reference_forward(x)), f"output changed at step {s}"
        ctl.step()
        if on_step is not None:
            on_step(s)


def _controller(rank, group, prefetch=True, **kw):
    base = dict(window_size=8, step_interval=16, num_redundant_experts=4, collective_timeout_s=5.0,
                use_async=True, async_prefetch=prefetch)
    base.update(kw)
    model = ToyMoE(num_layers=3, num_experts=8, num_redundant=4, hidden=8, top_k=2, rank=rank, world_size=2)
    ctl = EplbController(EplbConfig(**base), group=group, keep_trace=True)
    ctl.add_model(model, "main")
    return ctl, model


def test_prefetch_commits_every_layer_exactly_with_the_plain_async_placement():
    """2 ranks: with async_prefetch the rearrangement commits the same placement as without, weights and outputs
    exact."""
    target = _skewed(3, 8)

    def body(rank, group):
        out = {}
        for prefetch in (False, True):
            ctl, model = _controller(rank, group, prefetch=prefetch)
            seen = []
            _drive(ctl, model, group, 30, target,
                   on_step=lambda s: seen.append((ctl.state, ctl.layer, ctl.rearranger.layer_jobs.ahead_layer)))
            ctl.close()
            entry = ctl.model("main")
            out[prefetch] = dict(history=ctl.history, phy2log=ctl.maps("main").phy2log.copy(), seen=seen,
                                 bad=model.check_weights(ctl.maps("main").phy2log),
                                 handed_over=ctl.rearranger.layer_jobs.handed_over,
                                 spare=entry.spare_buffer is not None)
        return out

    r0, r1 = run_threads(2, body)
    for res in (r0, r1):
        plain, ahead = res[False], res[True]
        for run in (plain, ahead):
            assert run["history"][0]["outcome"] == "committed" and run["bad"] == []
        assert np.array_equal(plain["phy2log"], ahead["phy2log"])
        assert ahead["handed_over"] >= 1 and plain["handed_over"] == 0
        assert ahead["spare"] and not plain["spare"]
        # while layer k was in flight the next changed layer was already queued
        assert any(state == "transferring" and nxt is not None and nxt > layer for state, layer, nxt in ahead["seen"])
    assert r0[True]["seen"] == r1[True]["seen"]      # every shared decision on the same step


def test_a_transfer_error_with_a_layer_ahead_aborts_alike_and_the_next_rearrangement_commits():
    """Rank 1 fails layer 1 with layer 2 ahead: one fault on both ranks, layer 0 new, 1.. old, exact; layer 2 never ran
    there."""
    target = _skewed(3, 8)

    def body(rank, group):
        ctl, model = _controller(rank, group, collective_timeout_s=0.5)
        initial = ctl.maps("main").phy2log.copy()
        hooked: list[int] = []
        armed = [True]

        def hook(layer, name, local):
            hooked.append(layer)
            if rank == 1 and layer == 1 and armed[0]:
                armed[0] = False
                raise RuntimeError("injected transfer error")

        ctl.transfer_hooks.append(hook)
        aheads, after_abort = [], []

        def on_step(s):
            aheads.append(ctl.rearranger.layer_jobs.ahead_layer)
            if len(ctl.history) == 1 and not after_abort:   # the step the fault was agreed on
                after_abort.append((ctl.maps("main").phy2log.copy(), model.check_weights(ctl.maps("main").phy2log)))

        _drive(ctl, model, group, 60, target, on_step=on_step)
        ctl.close()
        return ctl, model, initial, hooked, aheads, after_abort[0]

    results = run_threads(2, body, timeout=120)
    fault_steps = set()
    for rank, (ctl, model, initial, hooked, aheads, (aborted_maps, aborted_bad)) in enumerate(results):
        assert 2 in aheads                                                  # layer 2 was queued behind layer 1
        first = ctl.history[0]
        assert first["outcome"] == "aborted" and first["layers_committed"] == 1
        fault = [r for r in ctl.trace.records if r["event"] == "transition" and r["trigger"] == "fault"][0]
        fault_steps.add(fault["step"])
        assert fault["recoverable"] is True and fault["failed_layer"] == 1
        assert [r for r in ctl.trace.records if r["event"] == "transfer_group_reset"]
        assert model.check_weights(ctl.maps("main").phy2log) == []
        assert any(h["outcome"] == "committed" for h in ctl.history[1:])    # the next one goes through
        # layer 2 was skipped, not moved, on both ranks (rank 0's layer 1 ends by the timeout)
        first_try = hooked[:hooked.index(1) + 1]
        assert first_try == [0, 1] and hooked[len(first_try)] != 2
        assert not np.array_equal(aborted_maps[0], initial[0]) and np.array_equal(aborted_maps[1:], initial[1:])
        assert aborted_bad == []                                            # layer 2's prefetch left no trace
    assert len(fault_steps) == 1
    assert np.array_equal(results[0][0].maps("main").phy2log, results[1][0].maps("main").phy2log)


def test_prefetch_with_paced_transfers_commits_every_layer_counting_chunks_from_the_hand_over():
    """2 ranks, async_prefetch + async_max_bytes_per_step: nothing is aborted as late, and each changed layer's
    ready_step is its hand-over step count plus its chunks (one prefetched chunk: the hand-over itself)."""
    target = _skewed(3, 64)

    def body(rank, group):
        model = ToyMoE(num_layers=3, num_experts=64, num_redundant=32, hidden=8, top_k=2, rank=rank, world_size=2)
        ctl = EplbController(EplbConfig(window_size=8, step_interval=16, num_redundant_experts=32,
                                        collective_timeout_s=1.0, use_async=True, async_prefetch=True,
                                        async_max_bytes_per_step=1), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        model.set_load_target(target)
        for s in range(300):
            x = model.make_batch(s, 32)
            assert torch.equal(model.forward(x, group), model.reference_forward(x)), f"output changed at step {s}"
            ctl.step()
            if ctl.history:
                break
            time.sleep(0.12)   # a healthy engine step: the paced chunks go one a step, slower than the timeout
        ctl.close()
        return ctl.history, ctl.trace.records, ctl.rearranger.layer_jobs.handed_over

    results = run_threads(2, body, timeout=200)
    for history, records, handed_over in results:
        assert history[0]["outcome"] == "committed", history
        assert not [r for r in records if r["event"] == "transition" and r["trigger"] == "fault"]
        rows, handed, first = [], None, True
        for r in records:
            if r["event"] != "transition" or r["trigger"] not in ("plan_ready", "layer_done"):
                continue
            if r["trigger"] == "layer_done" and r.get("changed"):
                rows.append((r["chunks"], r["ready_step"], handed, first))
                first = False
            handed = r["step"] + 1   # the shared step count of the step this record is on: the next hand-over
        assert handed_over == len(rows) - 1 and any(chunks > 1 for chunks, _, _, first in rows if not first)
        for chunks, ready_step, handed, first in rows:
            assert ready_step == handed + (0 if chunks == 1 and not first else chunks), rows
    assert [h["moves"] for h in results[0][0]] == [h["moves"] for h in results[1][0]]


def test_profile_step_reserves_both_buffers_with_prefetch():
    """is_profile with async_prefetch reserves the spare buffer too: twice the bytes of plain async."""
    def reserved(prefetch):
        model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, top_k=2)
        ctl = EplbController(EplbConfig(window_size=4, num_redundant_experts=4, use_async=True,
                                        async_prefetch=prefetch), keep_trace=True)
        try:
            ctl.add_model(model, "main")
            ctl.step(is_profile=True)
            return [r["buffer_bytes"] for r in ctl.trace.records if r["event"] == "profile"][0]
        finally:
            ctl.close()

    plain, both = reserved(False), reserved(True)
    assert plain > 0 and both == 2 * plain


def test_async_prefetch_must_be_a_bool():
    """A non-bool async_prefetch is refused, naming the field."""
    with pytest.raises(ValueError, match="async_prefetch must be a bool"):
        EplbConfig(use_async=True, async_prefetch=1)
