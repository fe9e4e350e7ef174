"""An interrupt or error between a step's transition and the pieces of a rearrangement that guard themselves.

A due step (or ``rearrange()``) fires ``step`` into ``planning`` and then opens the rearrangement's
record, all-reduces, logs the step's balancedness and only then plans; an async step in
``transferring`` may log the balancedness before it acts on the ready flags. A ``KeyboardInterrupt``
or an exception landing in those gaps must send the machine to ``failed`` (docs/guide.md, "Faults"),
never leave it in ``planning`` with nothing in flight, where no later step asks anything and
``rearrange()``, ``recover()`` and ``add_model()`` all refuse. Both ranks (threads of this process,
``run_threads``) are interrupted at the same point, as a Ctrl-C to the whole job would, so that
``recover()`` can run together afterwards and the next rearrangement must commit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.sim.loads import zipf_load
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.testing.threads import run_threads

LAYERS = 3


def _target() -> np.ndarray:
    p = zipf_load(LAYERS, 8, exponent=1.2, tokens_per_layer=100_000, rng=3).astype(float) + 1
    return p / p.sum(axis=1, keepdims=True)


def _controller(rank: int, group, mode: str):
    model = ToyMoE(num_layers=LAYERS, num_experts=8, num_redundant=4, hidden=8, top_k=2, rank=rank, world_size=2)
    model.set_load_target(_target())
    config = EplbConfig(window_size=8, step_interval=8, num_redundant_experts=4, collective_timeout_s=5.0,
                        use_async=mode == "async", log_balancedness=True, log_balancedness_interval=1)
    ctl = EplbController(config, group=group, keep_trace=True)
    ctl.add_model(model, "main")
    return ctl, model


def _step(ctl, model, s: int, log_stats: bool = False) -> str:
    """One engine step: a forward (all-reduced over the group; it must equal the reference), then the
    controller's step."""
    x = model.make_batch(s, 48)
    assert torch.equal(model.forward(x, ctl.group), model.reference_forward(x)), f"output changed at step {s}"
    return ctl.step(log_stats=log_stats)


def _arm(ctl, point: str, error: type, state: str) -> None:
    """Make the first call of ``point`` while the machine is in ``state`` raise ``error`` instead."""
    owner = {"transition": ctl.trace, "begin": ctl.reporter, "log_pass_balancedness": ctl.reporter,
             "planning_parts": ctl.rearranger}[point]
    real = getattr(owner, point)

    def once(*args, **kwargs):
        if ctl.machine.state != state:
            return real(*args, **kwargs)
        del owner.__dict__[point]   # only the first call there is cut short
        raise error(f"injected into {point}")

    setattr(owner, point, once)


def _interrupted_then_recovered(mode: str, point: str, error: type, state: str, via: str, expected: str):
    """Run both ranks into ``error`` at ``point`` (machine in ``state``), then recover (if failed) and
    serve on; return what each rank saw."""
    def body(rank, group):
        ctl, model = _controller(rank, group, mode)
        _arm(ctl, point, error, state)
        s, raised = 0, False
        try:
            if via == "rearrange":
                ctl.rearrange()
            for s in range(40):   # sync: the due step is the 2nd; async: transferring a few steps later
                _step(ctl, model, s, log_stats=True)
        except error:
            raised = True
        after = ctl.state
        faults = [r for r in ctl.trace.records if r["event"] == "transition" and r["trigger"] == "fault"]
        if after == "failed":
            for t in range(s + 1, s + 4):   # the engine steps on: nothing asked, nothing logged, still failed
                assert _step(ctl, model, t, log_stats=True) == after
            ctl.recover()
        committed = [h for h in ctl.history if h["outcome"] == "committed"]
        for t in range(s + 4, s + 80):
            _step(ctl, model, t)
            if len([h for h in ctl.history if h["outcome"] == "committed"]) > len(committed):
                break
        ok = model.check_weights(ctl.maps("main").phy2log) == []
        ctl.close()
        return raised, after, faults, ctl.history[-1]["outcome"], ok, ctl.maps("main").phy2log

    results = run_threads(2, body)
    for raised, after, faults, outcome, ok, _ in results:
        assert raised and after == expected
        if expected == "failed":
            fault = faults[-1]
            assert (fault["source"], fault["dest"], fault["recoverable"]) == (state, "failed", False)
            assert fault["interrupted"] == error.__name__ and f"injected into {point}" in fault["reason"]
        else:
            assert faults == []
        assert outcome == "committed" and ok
    assert np.array_equal(results[0][-1], results[1][-1])


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", ["transition", "begin", "log_pass_balancedness"])
def test_an_interrupt_after_the_due_steps_transition_fails_the_machine_and_recover_serves_on(mode, point, error):
    """Between the due step's step transition and the plan (the transition's record, the rearrangement's record,
    the step's balancedness): failed with a fault naming it, then recover() and the next rearrangement commits."""
    _interrupted_then_recovered(mode, point, error, "planning", "step", "failed")


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", ["transition", "begin"])
def test_an_interrupt_after_rearranges_transition_fails_the_machine_and_recover_serves_on(mode, point, error):
    """rearrange() cut short between its step transition and the planning all-reduce: failed, never planning."""
    _interrupted_then_recovered(mode, point, error, "planning", "rearrange", "failed")


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_while_an_async_step_logs_balancedness_in_transferring_fails_the_machine(error):
    """An async step in transferring that logs its balancedness before acting on the joined ready flags: an
    interrupt there fails the machine (its peers may commit the layer on those flags), and recover() serves on."""
    _interrupted_then_recovered("async", "log_pass_balancedness", error, "transferring", "step", "failed")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_interrupt_before_the_due_steps_transition_leaves_it_collecting_with_nothing_started(mode):
    """Cut short while the planning parts are gathered (before any transition): collecting, no fault, and the
    next step starts the rearrangement that commits."""
    _interrupted_then_recovered(mode, "planning_parts", KeyboardInterrupt, "collecting", "step", "collecting")
