"""Who ``aborted_rearrangements`` names as late: a rank that was gone, never one that started a few ms after the first.

Three ranks of a sync job start a rearrangement's all-reduce at step 21 within 1 ms of each other (as real ranks
do); rank 2's trace stops inside it (killed); ranks 0-1 lose their connection, roll back (``fault`` into
collecting) and serve on until the launcher's SIGTERM. A red team's real runs read rank 1 as the late one there
("started ... 0.0 s after the first rank"), because it started last by a millisecond.
"""

from __future__ import annotations

from conftest import timeline

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose

T0 = 1_796_606_000.0
RESET = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37292: Connection reset by peer"
COLL = {"op": "all_reduce", "group": "ep", "cseq": 0, "shape": [4], "dtype": "torch.float64", "parts": ["ready"]}
PLAN = {"trigger": "plan_ready", "source": "planning", "dest": "transferring", "layer": 0, "num_layers": 2,
        "layer_after": 0, "moves": 1, "worth": True, "balancedness_before": 0.71, "balancedness_after": 0.93,
        "gain": 0.22, "moved_bytes": 8192, "changed_layers": 2, "policy_s": 0.0004, "forced": False}


def opening(mode: str = "sync") -> list[tuple[float, str, dict]]:
    """Header, 20 steps, planning into transferring at step 21 (t+0.995 s)."""
    return [(0.0, "header", {"schema": 1, "run_id": "a1b2c3d4e5f60718", "mode": mode, "group": "ep",
                             "transfer_group": "ep_transfer", "config": {"num_layers": 2}, "step": 0,
                             "state": "collecting"}),
            (0.5, "steps", {"count": 20, "dummy": 0, "step": 1, "state": "collecting"}),
            (0.99, "transition", {"trigger": "step", "source": "collecting", "dest": "planning", "layer": 0,
                                  "num_layers": 2, "layer_after": 0, "due": True, "state": "planning"}),
            (0.995, "transition", PLAN)]


def records(rank: int, start: float, tail: list[tuple[float, str, dict]]) -> list[dict]:
    """``opening()``, the all-reduce's start at ``start``, then ``tail``."""
    return timeline(rank, 3, T0, opening() + [(start, "collective_start", COLL)] + tail, state="transferring",
                    step=21)


def rolled_back() -> list[tuple[float, str, dict]]:
    return [(1.01, "collective_error", dict(COLL, error=RESET)),
            (1.011, "transition", {"trigger": "fault", "source": "transferring", "dest": "collecting", "layer": 0,
                                   "num_layers": 2, "layer_after": 0, "recoverable": True, "state": "collecting",
                                   "reason": "all_reduce of ['ready'] failed", "layers_committed": 0}),
            (1.8, "steps", {"count": 60, "dummy": 0, "step": 22, "state": "collecting"}),
            (2.5, "end", {"how": "signal", "signal": "SIGTERM", "step": 82, "state": "collecting"})]


def test_a_start_a_millisecond_after_the_first_is_not_lateness():
    """Rank 1 started the all-reduce 1 ms after rank 0: the aborted rearrangement names rank 2 (gone), not rank 1."""
    report = diagnose({0: records(0, 1.0, rolled_back()), 1: records(1, 1.001, rolled_back()),
                       2: records(2, 1.0, [])})
    (aborted,) = report.aborted
    assert aborted["step"] == 21 and aborted["late_ranks"] == [2], format_report(report)
    assert aborted["late_by_s"] is None and "after the first rank" not in aborted["text"], aborted
    assert "rank 2 died" in aborted["text"], aborted


def test_a_fault_in_collecting_is_no_aborted_rearrangement():
    """The balancedness all-reduce of a collecting step failing (fault from collecting) rolled nothing back."""
    fault = {"trigger": "fault", "source": "collecting", "dest": "failed", "layer": 0, "num_layers": 2,
             "layer_after": 0, "recoverable": False, "state": "failed", "reason": "all_reduce of ['balancedness']"}
    recs = {}
    for r in range(3):
        recs[r] = records(r, 1.0, [(1.01, "collective_end", dict(COLL, duration_s=0.01)),
                                   (1.02, "transition", {"trigger": "layer_done", "source": "transferring",
                                                         "dest": "transferring", "layer": 0, "num_layers": 2,
                                                         "layer_after": 1, "model": "main", "model_layer": 0,
                                                         "moved": 1, "changed": True}),
                                   (1.025, "transition", {"trigger": "layer_done", "source": "transferring",
                                                          "dest": "committing", "layer": 1, "num_layers": 2,
                                                          "layer_after": 1, "model": "main", "model_layer": 1,
                                                          "moved": 1, "changed": True, "state": "committing"}),
                                   (1.03, "transition", {"trigger": "committed", "source": "committing",
                                                         "dest": "collecting", "layer": 1, "num_layers": 2,
                                                         "layer_after": 1, "rearrangement": 0, "moves": 1,
                                                         "layers_committed": 2, "state": "collecting"}),
                                   (2.0, "transition", dict(fault, step=40)),
                                   (2.1, "end", {"how": "closed", "step": 40, "state": "failed"})])
    report = diagnose(recs)
    assert report.aborted == [], format_report(report)


TIMEOUT = "TransferError: layer 0, wave 0/1: RuntimeError: Timed out waiting 1000ms for send operation to complete"
STOPPED = "RankFault: rank {r} stopped at step 21: its controller fired fault at step 21"


def late_then_stopped(rank: int, start: float, alive: list[tuple[float, int, dict | None]]) -> list[dict]:
    """The rearrangement's all-reduce started at ``start``, ``alive`` records (t, step, waiting_on) before it
    fails (the waiters time out at t+2.0 s, the late rank's peers are gone by then), the fault into collecting,
    and the end: the engine raised on the fault at that step (simulate's engine does), serving nothing after."""
    t_err = max(start, 2.0) + 0.01
    events = opening("async")
    events += [(t, "alive", {"interval_s": 1.0, "waiting_on": on, "steps_seen": step, "step": step})
               for t, step, on in alive if t < start]
    events += [(start, "collective_start", COLL)]
    events += [(t, "alive", {"interval_s": 1.0, "waiting_on": on, "steps_seen": step, "step": step})
               for t, step, on in alive if t >= start]
    events += [(t_err, "collective_error", dict(COLL, error=TIMEOUT if start < 2 else RESET)),
               (t_err + 0.001, "transition", {"trigger": "fault", "source": "transferring", "dest": "collecting",
                                              "layer": 0, "num_layers": 2, "layer_after": 0, "recoverable": True,
                                              "state": "collecting", "reason": "transfer of layer 0 failed"}),
               (t_err + 0.002, "end", {"how": "exception", "error": STOPPED.format(r=rank), "step": 21,
                                       "state": "collecting"})]
    return timeline(rank, 3, T0, sorted(events, key=lambda e: e[0]), state="transferring", step=21)


def test_a_late_rank_is_the_cause_when_every_engine_stopped_on_the_rollback():
    """Rank 2 came 2.5 s late; ranks 0-1 timed out; every rank faulted into collecting and its engine then raised:
    nobody came back, so the late rank is the verdict (was: a handled note, and `crashed` naming rank 0). Rank 1,
    alive at step 20 a moment before rank 0 began to wait, started 1 ms after it: not late."""
    on = dict(COLL)
    report = diagnose({0: late_then_stopped(0, 1.0, [(1.5, 21, on)]),
                       1: late_then_stopped(1, 1.001, [(0.8, 20, None), (1.5, 21, on)]),
                       2: late_then_stopped(2, 3.5, [(1.5, 20, None), (2.5, 20, None)])})
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)
    assert report.handled == [], format_report(report)


def timed_out(error: str, **coll) -> list[tuple[float, str, dict]]:
    """The all-reduce's wait runs out after 2 s (``error``), then the rollback, 60 steps, and the SIGTERM."""
    return [(3.0, "collective_error", dict(COLL, error=error, **coll)), *rolled_back()[1:]]


def test_a_wait_that_ran_out_with_every_rank_in_it_names_the_failed_wait():
    """Every rank joined the all-reduce, none late or gone, and waits ran out: the note names them and the network."""
    wait = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"
    finished = [(1.01, "collective_end", dict(COLL, duration_s=0.01)), *rolled_back()[1:]]
    report = diagnose({0: records(0, 1.0, timed_out(wait)), 1: records(1, 1.0005, timed_out(wait)),
                       2: records(2, 1.0, finished)})
    (aborted,) = report.aborted
    assert aborted["late_ranks"] == [] and "no rank was late by the records" in aborted["text"], aborted
    assert "the wait in all_reduce (group ep, cseq 0, shape [4]) failed on ranks 0-1 (RuntimeError: Timed out " \
           "waiting 2000ms for recv operation)" in aborted["text"], aborted
    assert "though every rank had joined it: the messages between them stopped (the network?)" in aborted["text"]


def test_ranks_that_issued_different_collectives_get_no_network_hint():
    """Rank 2 issued a broadcast where the others all-reduced: the failed wait is the mismatch's, not named here."""
    wait = "RuntimeError: Operation timed out!"
    other = dict(COLL, op="broadcast")
    report = diagnose({0: records(0, 1.0, timed_out(wait)), 1: records(1, 1.0, timed_out(wait)),
                       2: timeline(2, 3, T0, opening() + [(1.0, "collective_start", other),
                                                          (3.0, "collective_error", dict(other, error=wait)),
                                                          *rolled_back()[1:]], state="transferring", step=21)})
    (aborted,) = report.aborted
    assert "failed on" not in aborted["text"] and "network" not in aborted["text"], aborted


def test_an_async_wait_that_failed_the_step_before_the_rollback_is_named():
    """Async: the transfer's wait fails at step 21, the rollback fires at step 22 (a red team's real runs, 3 of 3):
    the note still names the failed wait."""
    wait = "TransferError: layer 0, wave 0/1: RuntimeError: Timed out waiting 5000ms for recv operation to complete"
    batch = {"op": "batch_isend_irecv", "group": "ep_transfer", "cseq": 0, "shape": None, "dtype": None, "layer": 0,
             "wave": 0, "waves": 1}
    roll = {**rolled_back()[1][2], "step": 22}

    def rank(r: int, fails: bool) -> list[dict]:
        return timeline(r, 3, T0, opening("async") + [
            (1.0, "collective_start", batch),
            (3.0, "collective_error", dict(batch, error=wait)) if fails else (1.01, "collective_end", batch),
            (3.05, "transition", roll), (3.5, "steps", {"count": 40, "dummy": 0, "step": 23, "state": "collecting"}),
            (4.0, "end", {"how": "signal", "signal": "SIGTERM", "step": 63, "state": "collecting"})],
            state="transferring", step=21)

    report = diagnose({0: rank(0, False), 1: rank(1, True), 2: rank(2, True)})
    (aborted,) = report.aborted
    assert aborted["step"] == 22 and "the wait in batch_isend_irecv (group ep_transfer, cseq 0, layer 0) failed " \
        "on ranks 1-2" in aborted["text"], aborted


def test_a_rank_that_aborted_alone_in_another_collective_gets_no_network_hint():
    """Rank 2 alone aborted, its broadcast's wait run out where ranks 0-1 sat in the all-reduce (an injected
    wrong collective under load, async): the note compares every member's collective, not the aborting rank's alone,
    so no network hint (was: `though every rank had joined it ... (the network?)`)."""
    wait = "RuntimeError: Operation timed out!"
    other = dict(COLL, op="broadcast")
    closed = [(3.01, "end", {"how": "exception", "error": "RuntimeError: Application timeout caused pair closure",
                             "step": 21, "state": "transferring"})]   # their posted all-reduce, torn down
    report = diagnose({0: records(0, 1.0, closed), 1: records(1, 1.0, closed),
                       2: timeline(2, 3, T0, opening() + [(1.0, "collective_start", other),
                                                          (3.0, "collective_error", dict(other, error=wait)),
                                                          *rolled_back()[1:]], state="transferring", step=21)})
    (aborted,) = report.aborted
    assert aborted["ranks"] == [2] and "network" not in aborted["text"], aborted
