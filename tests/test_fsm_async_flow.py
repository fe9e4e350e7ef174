"""fsm/async_flow.py: async mode's ready flags and what their sum does, on a stand-in Rearranger.

The functions take the Rearranger as ``r`` and only call its methods and read its fields, so a
``SimpleNamespace`` with recording methods drives each branch; the end-to-end async runs over
``ThreadWorld`` groups are in test_fsm_controller.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eplb_fsm.fsm import async_flow
from eplb_fsm.fsm.machine import COLLECTING, COMMITTING, TRANSFERRING
from eplb_fsm.fsm.reporting import Rearrangement


def _rearranger(state, changed=(False, False), world=2, steps=5):
    """A stand-in Rearranger in ``state`` whose rearrangement plans ``changed`` layers; calls land in ``r.calls``."""
    calls = []
    machine = SimpleNamespace(state=state, layer=0)

    def commit_layer(layer, result):
        calls.append(("commit_layer", layer, result))
        machine.layer = layer + 1
        machine.state = COMMITTING if machine.layer == len(changed) else TRANSFERRING
        return SimpleNamespace(dest=machine.state)

    current = Rearrangement(index=1, step=0, forced=False, started=0.0,
                            plan=SimpleNamespace(changed=list(changed), chunks=[3] * len(changed)))
    return SimpleNamespace(
        machine=machine, current=current, timeout_s=1.0, calls=calls, counters=SimpleNamespace(steps=steps),
        collectives=SimpleNamespace(world_size=world), commit_layer=commit_layer,
        layer_jobs=SimpleNamespace(start=lambda plan, layer, step: (calls.append(("start", layer)) or "job", step)),
        commit_fault=lambda broken: calls.append(("commit_fault", broken)),
        committed=lambda: calls.append(("committed",)))


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
