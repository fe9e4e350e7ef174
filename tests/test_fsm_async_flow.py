"""fsm/async_flow.py: async mode's ready flags and what their sum does, on a stand-in Rearranger.

The functions take the Rearranger as ``r`` and only call its methods and read its fields, so a
``SimpleNamespace`` with recording methods drives each branch; the end-to-end async runs over
``ThreadWorld`` groups are in test_fsm_controller.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm import async_flow
from eplb_fsm.fsm.machine import COLLECTING, COMMITTING, PLANNING, TRANSFERRING
from eplb_fsm.fsm.reporting import Rearrangement
from eplb_fsm.sim.model import ToyMoE


def _rearranger(state, changed=(False, False), world=2, steps=5, ahead=False, chunks=3):
    """A stand-in Rearranger in ``state`` whose rearrangement plans ``changed`` layers of ``chunks`` chunks each;
    ``ahead``: its layer jobs were submitted ahead (async_prefetch). Calls land in ``r.calls``."""
    calls = []
    machine = SimpleNamespace(state=state, layer=0)

    def commit_layer(layer, result):
        calls.append(("commit_layer", layer, result))
        machine.layer = layer + 1
        machine.state = COMMITTING if machine.layer == len(changed) else TRANSFERRING
        return SimpleNamespace(dest=machine.state)

    current = Rearrangement(index=1, step=0, forced=False, started=0.0,
                            plan=SimpleNamespace(changed=list(changed), chunks=[chunks] * len(changed)))
    r = SimpleNamespace(
        machine=machine, current=current, timeout_s=1.0, calls=calls, counters=SimpleNamespace(steps=steps),
        collectives=SimpleNamespace(world_size=world), commit_layer=commit_layer, worker=object(),
        layer_jobs=SimpleNamespace(start=lambda plan, layer, step: (calls.append(("start", layer)) or "job", ahead)),
        commit_fault=lambda broken: calls.append(("commit_fault", broken)),
        committed=lambda: calls.append(("committed",)), settle=lambda: calls.append(("settle",)),
        post_poll=lambda: calls.append(("post",)),
        mover=SimpleNamespace(closing=threading.Event(), step_advanced=threading.Event()))
    r.ready_flags = lambda: async_flow.ready_flags(r)
    return r


def test_ready_flags_in_committing_say_ready_and_whether_a_write_broke():
    """committing: (4,) flags [1, 0, 0, broken] without a job, broken when a write raised part-way on this rank."""
    r = _rearranger(COMMITTING)
    assert async_flow.ready_flags(r).tolist() == [1.0, 0.0, 0.0, 0.0]
    r.current.broken.append("the commit of layer 1 raised part-way")
    assert async_flow.ready_flags(r).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_ready_flags_without_a_job_in_transferring_say_failed():
    """transferring with no job in flight: failed, never ready."""
    assert async_flow.ready_flags(_rearranger(TRANSFERRING)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_advance_commits_unchanged_layers_then_waits_in_committing_with_no_job():
    """Only unchanged layers left: each is committed at once, and committing holds no job (ready_step -1)."""
    r = _rearranger(TRANSFERRING, changed=(False, False))
    r.current.job, r.current.job_step, r.current.chunks, r.current.ready_step = "old", 3, 4, 7
    async_flow.advance(r, TRANSFERRING)
    assert r.calls == [("commit_layer", 0, None), ("commit_layer", 1, None)]
    assert (r.machine.state, r.current.job, r.current.job_step, r.current.chunks, r.current.ready_step) == \
        (COMMITTING, None, -1, 1, -1)


def test_advance_hands_the_next_changed_layer_to_the_worker_with_its_ready_step():
    """A changed layer after an unchanged one: the worker gets it; its flags can say ready after its chunks."""
    r = _rearranger(TRANSFERRING, changed=(False, True), steps=5)
    async_flow.advance(r, TRANSFERRING)
    assert r.calls == [("commit_layer", 0, None), ("start", 1)]
    assert (r.current.job, r.current.job_step, r.current.chunks, r.current.ready_step) == ("job", 5, 3, 8)


def test_a_layer_submitted_ahead_counts_its_chunks_from_its_hand_over():
    """async_prefetch: a handed-over job's job_step is the hand-over step, ready_step that plus its chunks;
    one of a single chunk, maybe done already, has ready_step = its hand-over step."""
    r = _rearranger(TRANSFERRING, changed=(True, True), steps=9, ahead=True, chunks=4)
    async_flow.advance(r, TRANSFERRING)
    assert (r.current.job_step, r.current.chunks, r.current.ready_step) == (9, 4, 13)
    r = _rearranger(TRANSFERRING, changed=(True, True), steps=9, ahead=True, chunks=1)
    async_flow.advance(r, TRANSFERRING)
    assert (r.current.job_step, r.current.chunks, r.current.ready_step) == (9, 1, 9)


def test_a_one_chunk_job_submitted_ahead_posts_its_flags_on_its_hand_over_step_a_fresh_one_does_not():
    """Posted polls: a prefetched one-chunk layer is asked about on its hand-over step; a fresh job waits a step."""
    for ahead, expected in ((True, [("settle",), ("post",)]), (False, [("settle",)])):
        r = _rearranger(TRANSFERRING, changed=(True, True), steps=9, ahead=ahead, chunks=1)
        async_flow.advance(r, TRANSFERRING)
        r.calls.clear()
        async_flow.poll(r, {}, overlap=True)
        assert r.calls == expected, ahead


def test_the_due_step_joins_no_ready_flags_to_its_planning_all_reduce():
    """planning with no plan job handed over yet (the due step): no ready part; once handed over, the flags join."""
    r = _rearranger(PLANNING)
    parts = {"loads": torch.zeros(3)}
    assert not async_flow.in_flight(r)
    async_flow.poll(r, parts, overlap=True)
    assert set(parts) == {"loads"}
    r.current.job = SimpleNamespace(done=lambda: False, age=lambda: 0.0)   # the policy, still running
    r.current.job_step = 3   # handed over on an earlier step
    assert async_flow.in_flight(r)
    async_flow.poll(r, parts, overlap=True)
    assert set(parts) == {"loads", "ready"}


def test_an_async_controllers_due_step_all_reduces_loads_and_maps_only():
    """World 1, async: the due step's all-reduce carries loads and maps, no ready flags; the next step's has them."""
    model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, top_k=2)
    ctl = EplbController(EplbConfig(window_size=4, step_interval=4, num_redundant_experts=4, use_async=True,
                                    async_overlap_poll=False), keep_trace=True)
    try:
        ctl.add_model(model, "main")
        for s in range(6):
            model.forward(model.make_batch(s, 16), None)
            ctl.step()
        due = next(r["step"] for r in ctl.trace.records if r["event"] == "transition" and r.get("due"))
        parts = [(r["step"], r["parts"]) for r in ctl.trace.records if r["event"] == "collective_start"]
    finally:
        ctl.close()
    assert (due, ["loads", "maps"]) in parts and (due + 1, ["ready"]) in parts
    assert not [p for step, p in parts if step == due and "ready" in p]


def test_committing_is_in_flight_without_a_job():
    """committing (the last agreement) asks the ranks although no job and no job_step are held."""
    r = _rearranger(COMMITTING)
    assert r.current.job_step == -1 and async_flow.in_flight(r)


def test_the_drain_runs_the_worker_unpaced_while_it_waits_and_paced_again_after():
    """async drain: the pacer's stop event is set (and the pacer woken) during the drain, cleared after it."""
    r = _rearranger(COLLECTING)
    seen = []
    r.settle = lambda: seen.append((r.mover.closing.is_set(), r.mover.step_advanced.is_set()))
    r.current = None
    async_flow.drain(r)
    assert seen == [(True, True)] and not r.mover.closing.is_set()


def test_progress_with_a_broken_flag_is_a_commit_fault_on_every_state_and_step():
    """A summed broken count aborts as a commit fault, even in committing and before the ready step."""
    r = _rearranger(COMMITTING)
    async_flow.progress(r, torch.tensor([2.0, 0.0, 0.0, 1.0]), early=True)
    assert r.calls == [("commit_fault", 1)]


def test_progress_in_committing_with_every_rank_ready_closes_the_rearrangement():
    """committing, all ranks ready and none broken: committed; fewer ready: wait."""
    r = _rearranger(COMMITTING)
    async_flow.progress(r, torch.tensor([1.0, 0.0, 0.0, 0.0]), early=False)
    assert r.calls == []
    async_flow.progress(r, torch.tensor([2.0, 0.0, 0.0, 0.0]), early=False)
    assert r.calls == [("committed",)]


def test_progress_after_the_rearrangement_ended_does_nothing():
    """Flags read once the machine is back in collecting (an interrupt ended it) change nothing."""
    r = _rearranger(COLLECTING)
    async_flow.progress(r, torch.tensor([0.0, 0.0, 0.0, 2.0]), early=False)
    assert r.calls == []
