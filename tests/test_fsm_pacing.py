"""StepPacer and unpaced: a paced transfer's chunks wait for engine steps, always within a bound."""

from __future__ import annotations

import threading
import time

from eplb_fsm.fsm.pacing import StepPacer, unpaced


def test_step_pacer_waits_for_the_next_step_and_gives_up_after_its_bound():
    """wait() returns at once when the step moved since begin(), waits for it otherwise, and stops waiting at
    max_wait_s."""
    box = {"step": 0}
    pacer = StepPacer(lambda: box["step"], max_wait_s=30.0, poll_s=0.001)
    pacer.begin()
    box["step"] = 1
    assert pacer.wait() is True and pacer.waits == 0          # moved already: no wait
    timer = threading.Timer(0.05, lambda: box.update(step=2))
    timer.start()
    assert pacer.wait() is True and box["step"] == 2 and pacer.waits == 1
    timer.join()
    short = StepPacer(lambda: box["step"], max_wait_s=0.01, poll_s=0.001)
    short.begin()
    assert short.wait() is False and short.timeouts == 1      # the engine stopped stepping: go on anyway



def test_step_pacer_with_an_event_sleeps_until_the_engine_sets_it():
    """With ``advanced``, wait() reads the step only when woken (no polling) and returns once the set step moved."""
    box = {"step": 0, "reads": 0}

    def step():
        box["reads"] += 1
        return box["step"]

    advanced = threading.Event()
    idle = StepPacer(step, max_wait_s=0.2, poll_s=0.0001, advanced=advanced)
    idle.begin()
    box["reads"] = 0
    assert idle.wait() is False and idle.timeouts == 1
    assert box["reads"] <= 5                                  # polling every 0.1 ms would read ~2000 times

    def engine_steps():
        box["step"] = 1
        advanced.set()

    pacer = StepPacer(step, max_wait_s=30.0, advanced=advanced)
    pacer.begin()
    advanced.set()                                            # a stale set (no new step) must not end the wait
    timer = threading.Timer(0.05, engine_steps)
    timer.start()
    assert pacer.wait() is True and box["step"] == 1 and pacer.waits == 1
    timer.join()



def test_unpaced_ends_a_pacer_wait_in_progress_and_restores_pacing_after():
    """unpaced(): a chunk waiting for a step that never comes goes at once (no timeout); stop is cleared on the way
    out, but stays set when it was set before (close)."""
    stop, advanced = threading.Event(), threading.Event()
    pacer = StepPacer(lambda: 0, max_wait_s=30.0, advanced=advanced, stop=stop)   # the engine never steps
    pacer.begin()
    waiting = threading.Thread(target=pacer.wait, daemon=True)
    waiting.start()
    deadline = time.monotonic() + 20.0
    while not pacer.waits and time.monotonic() < deadline:   # the chunk is waiting for the next step
        time.sleep(0.001)
    assert pacer.waits == 1
    with unpaced(stop, advanced):
        waiting.join(20.0)
        assert not waiting.is_alive() and pacer.timeouts == 0
        assert pacer.wait() is True and pacer.waits == 1      # later chunks don't wait either
    assert not stop.is_set()
    stop.set()
    with unpaced(stop, advanced):
        pass
    assert stop.is_set()
