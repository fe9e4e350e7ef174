"""held: a rank whose trace stops while a peer's gloo wait on it stayed unbroken froze for good; it did not die.

Hand-written traces pin the rule's edges; two real torchrun jobs give it the traces it was made for: a worker
SIGSTOPped while its peer waits on it in the controller's all-reduce, then the job stopped by SIGTERM, and a
worker stuck in a C call that holds the GIL while its peer's wait on it times out. torchrun SIGKILLs each
after its grace (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 2 s here), so neither writes an ``end``; the tree before
this rule said of both that the worker died (SIGKILL?).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import timeline, torchrun_job

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose, replay_dir
from eplb_fsm.trace import read_trace

T0 = 1_796_607_000.0
ALLREDUCE = {"op": "all_reduce", "group": "ep", "cseq": 1, "shape": [4], "dtype": "torch.float64"}
WAITING = {"interval_s": 1.0, "steps_seen": 4, "waiting_on": {"op": "all_reduce", "group": "ep", "cseq": 1}}


def rank(r: int, world: int, tail: list[tuple[float, str, dict]], device: str = "cpu") -> list[dict]:
    """Header (on ``device``), 3 quiet steps, a first alive record, then ``tail``, all at step 4 in collecting."""
    header = {"schema": 1, "run_id": "a1b2c3d4e5f6a7b8", "mode": "sync", "group": "ep", "transfer_group": "ep_transfer",
              "config": {"num_layers": 2}, "step": 0, "device": device}
    return timeline(r, world, T0, [(0.0, "header", header), (0.5, "steps", {"count": 3, "dummy": 0, "step": 1}),
                                   (0.9, "alive", {"interval_s": 1.0, "steps_seen": 1, "waiting_on": None}), *tail],
                    state="collecting", step=4)


def waiter(until: float, end: dict, start: tuple = (1.0, "collective_start", ALLREDUCE)) -> list[tuple]:
    """A rank inside the all-reduce from t=1, ticking every second up to ``until``, then ``end``."""
    ticks = [(t + 0.0, "alive", WAITING) for t in range(2, int(until) + 1)]
    return [start, *ticks, (until, "end", end)]


SIGNAL = {"how": "signal", "signal": "SIGTERM"}
SILENT = [(1.0, "collective_start", ALLREDUCE)]   # rank 1 joins the all-reduce, then writes nothing more


def test_a_peer_waiting_unbroken_past_the_limit_shows_a_frozen_rank_not_a_dead_one():
    """Rank 0 sat in the all-reduce with rank 1 for 3.5 s after rank 1's last record, then was signalled: frozen for
    good, rank 1, naming the wait (was: rank_died, 'a process frozen for good looks the same')."""
    report = diagnose({0: rank(0, 2, waiter(4.5, SIGNAL)), 1: rank(1, 2, SILENT)})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), text
    assert report.summary.startswith("rank 1 froze for good at step 4 in collecting"), text
    assert "while rank 0 waited on rank 1 in all_reduce (group ep, cseq 1, shape [4]) until t+4.5 s, 3.5 s later" \
        in text
    assert any(c.startswith("rank 0 was stopped by SIGTERM") for c in report.consequences), text


def test_a_wait_that_timed_out_shows_it_too():
    """Rank 0's wait ran out after 4 s (a timeout keeps the connection) and it ended with the exception: frozen."""
    timeout = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 4000ms for recv operation"
    error = (5.0, "collective_error", {**ALLREDUCE, "error": timeout})
    report = diagnose({0: rank(0, 2, [(1.0, "collective_start", ALLREDUCE), (2.0, "alive", WAITING), error,
                                      (5.01, "end", {"how": "exception", "error": timeout})]),
                       1: rank(1, 2, SILENT)})
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), format_report(report)


@pytest.mark.parametrize("wait", ["controller", "engine"])
@pytest.mark.parametrize("after", [2.3, 1.8])
def test_a_wait_that_ran_out_counts_from_two_seconds(wait, after):
    """A wait that timed out ``after`` s past rank 1's last record (the engine's, or the controller's all-reduce):
    at 2.3 s, under the 2.5 s limit, frozen (a red team's engine timeout of 2 s ran out 2.48 s after a SIGSTOPped
    rank's last record and read died, with no caveat); at 1.8 s, within a live rank's silence, died."""
    timeout = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 2000ms for recv operation"
    at, one = 1.0 + after, SILENT
    if wait == "engine":   # no controller collective: rank 1's last record is a run of steps
        one = [(1.0, "steps", {"count": 1, "step": 4})]
        zero = [(1.2, "alive", ENGINE_WAIT), (2.2, "alive", ENGINE_WAIT), (at, "end", {"how": "exception",
                                                                                     "error": timeout})]
    else:
        zero = [(1.0, "collective_start", ALLREDUCE), (1.9, "alive", WAITING),
                (at, "collective_error", {**ALLREDUCE, "error": timeout}),
                (at + 0.01, "end", {"how": "exception", "error": timeout})]
    report = diagnose({0: rank(0, 2, zero), 1: rank(1, 2, one)})
    text = format_report(report)
    assert report.culprit_ranks == [1], text
    assert ("froze for good" in report.summary) == (after > 2.0), text


def test_a_rank_that_stopped_with_a_frozen_one_is_named_in_its_finding():
    """Ranks 1 and 2 stop writing 2 ms apart; rank 0 waited on rank 1 (rank 2 joined the all-reduce), while nobody
    waited on rank 2 alone: one frozen finding, ranks 1-2, saying what rank 2's trace cannot tell (a red team's
    real run, two ranks SIGSTOPped together, read rank_died on the one no peer waited on)."""
    report = diagnose({0: rank(0, 3, waiter(4.5, SIGNAL)), 1: rank(1, 3, [(0.95, "steps", {"count": 1, "step": 4})]),
                       2: rank(2, 3, [(0.952, "collective_start", ALLREDUCE)])})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1, 2]), text
    assert "rank 2 stopped writing 0.00 s from rank 1" in text and "cannot tell a freeze with it from a kill" in text
    assert "forcefully exiting via 9" in text, text   # how to tell a rank whose forked child held its sockets
    assert not [f for f in report.findings if f.kind == "rank_died"], text   # neither is also called dead


@pytest.mark.parametrize("status", ["error", "open"])
def test_a_posted_all_reduce_counts_only_once_its_read_back_ran_out(status):
    """Async ready flags: rank 0's read-back of the posted all-reduce timed out 3 s after rank 1's last record:
    frozen; still open (rank 0 may not have been waiting in it): rank 1 died, as before."""
    posted = {**ALLREDUCE, "posted": True}
    timeout = "RuntimeError: Timed out waiting 3000ms for recv operation to complete"
    tail = [(4.0, "collective_error", {**posted, "error": timeout})] if status == "error" else []
    zero = [(1.0, "collective_start", posted), (2.0, "alive", WAITING), (3.0, "alive", WAITING), *tail,
            (4.5, "end", SIGNAL)]
    report = diagnose({0: rank(0, 2, zero), 1: rank(1, 2, [(1.0, "collective_start", posted)])})
    text = format_report(report)
    assert ("froze for good" in report.summary) == (status == "error"), text
    assert report.culprit_ranks == [1], text


@pytest.mark.parametrize("case", ["lost connection", "other error", "within the limit", "nccl", "a member outside",
                                  "other partner", "a partner outside"])
def test_without_that_evidence_the_rank_still_reads_died(case):
    """A lost connection, an error that is no wait running out, a wait no longer than a live rank's silence, a CUDA
    device (NCCL waits on the dead too), a member that never joined (it is the one waited on), a batch with other
    partners, a batch with it and a partner that never joined (a red team's real run: rank 1 SIGKILLed after its
    part of the batch, rank 2 asleep in its hook, rank 0's send to rank 2 timed out): rank 1 died."""
    world, device, others = 2, "cpu", {}
    zero = waiter(4.5, SIGNAL)
    if case == "lost connection":
        lost = "RuntimeError: Connection closed by peer [127.0.0.1]:58797"
        zero = [(1.0, "collective_start", ALLREDUCE), (1.2, "collective_error", {**ALLREDUCE, "error": lost}),
                (1.3, "end", {"how": "exception", "error": lost})]
    elif case == "other error":
        other = "RuntimeError: [enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes"
        zero = [(1.0, "collective_start", ALLREDUCE), (2.0, "alive", WAITING), (3.0, "alive", WAITING),
                (4.0, "collective_error", {**ALLREDUCE, "error": other}), (4.5, "end", SIGNAL)]
    elif case == "within the limit":
        zero = waiter(3.0, SIGNAL)
    elif case == "nccl":
        device = "cuda:0"
    elif case == "a member outside":
        busy = [(t, "alive", {**WAITING, "waiting_on": None}) for t in (2.0, 3.0, 4.0)]   # in its engine's step
        world, others = 3, {2: rank(2, 3, [*busy, (4.5, "end", SIGNAL)])}
    elif case == "a partner outside":
        batch = {"op": "batch_isend_irecv", "group": "ep_transfer", "cseq": 1, "shape": None, "dtype": None,
                 "peers": [1, 2]}
        timeout = "RuntimeError: Timed out waiting 3000ms for send operation to complete"
        busy = [(t, "alive", {**WAITING, "waiting_on": None}) for t in (2.0, 3.0, 4.0)]
        world, others = 3, {2: rank(2, 3, [*busy, (4.5, "end", SIGNAL)])}
        zero = [(1.0, "collective_start", batch), (2.0, "alive", WAITING),
                (4.0, "collective_error", {**batch, "error": timeout}), (4.5, "end", SIGNAL)]
    else:
        batch = {"op": "batch_isend_irecv", "group": "ep_transfer", "cseq": 1, "shape": None, "dtype": None,
                 "peers": [2]}
        world, others = 3, {2: rank(2, 3, [(1.0, "collective_start", batch), (4.5, "end", SIGNAL)])}
        zero = waiter(4.5, SIGNAL, (1.0, "collective_start", batch))
    report = diagnose({0: rank(0, world, zero, device), 1: rank(1, world, SILENT, device), **others})
    text = format_report(report)
    assert "rank 1 died (SIGKILL?)" in text, text   # the verdict may be a hang that carries the death
    assert "froze for good" not in text


LOST = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41895: Connection reset by peer"


@pytest.mark.parametrize("posted", [False, True])
def test_a_wait_that_failed_on_the_kill_shows_the_freeze_its_alive_records_held(posted):
    """Rank 0 sat in the all-reduce 4 s past rank 1's last record (alive records naming it), then failed on a lost
    connection (the watchdog's SIGKILL): frozen, 'until at least' its last such record before the loss (was: died,
    in a red team's async runs); a posted all-reduce may be open with nobody in it: died, as before."""
    coll = {**ALLREDUCE, "posted": True} if posted else ALLREDUCE
    ticks = [(t, "alive", WAITING) for t in (2.0, 3.0, 4.0, 5.0)]
    zero = [(1.0, "collective_start", coll), *ticks, (5.6, "collective_error", {**coll, "error": LOST}),
            (5.61, "end", {"how": "exception", "error": LOST})]
    report = diagnose({0: rank(0, 2, zero), 1: rank(1, 2, [(1.0, "collective_start", coll)])})
    text = format_report(report)
    assert report.culprit_ranks == [1], text
    if posted:
        assert "froze for good" not in text and "rank 1 died (SIGKILL?)" in text, text
    else:
        assert (report.verdict, report.summary.startswith("rank 1 froze for good")) == ("frozen", True), text
        assert "waited on rank 1 in all_reduce (group ep, cseq 1, shape [4]) until at least t+5.0 s, 4.0 s later" \
            in text, text


def test_alive_records_after_the_first_lost_connection_show_nothing():
    """The same wait, but a connection was lost 0.3 s after rank 1's last record (rank 2 failed on it: a kill then):
    the alive records after that loss cannot show rank 1 alive, whoever's they are: died."""
    ticks = [(t, "alive", WAITING) for t in (2.0, 3.0, 4.0, 5.0)]
    zero = [(1.0, "collective_start", ALLREDUCE), *ticks, (5.6, "collective_error", {**ALLREDUCE, "error": LOST}),
            (5.61, "end", {"how": "exception", "error": LOST})]
    two = [(1.0, "collective_start", ALLREDUCE), (1.3, "collective_error", {**ALLREDUCE, "error": LOST}),
           (1.31, "end", {"how": "exception", "error": LOST})]
    report = diagnose({0: rank(0, 3, zero), 1: rank(1, 3, [(1.0, "collective_start", ALLREDUCE)]),
                       2: rank(2, 3, two)})
    text = format_report(report)
    assert "froze for good" not in text and "rank 1 died (SIGKILL?)" in text, text


def test_an_engine_wait_recorded_between_the_kill_and_its_failure_does_not_undo_the_freeze():
    """Ranks 0 and 2 in the engine's all-reduce 6 s past rank 1's last record; rank 0 fails on the kill at 7.2 s,
    rank 2 ticks once more at 7.25 s before failing too: frozen (was: died, a red team's run where a peer's
    liveness thread beat between the kill and its own failure)."""
    silent = [(0.95, "steps", {"count": 1, "step": 4})]
    zero = [*[(t + 0.0, "alive", ENGINE_WAIT) for t in range(2, 8)], (7.2, "end", {"how": "exception", "error": LOST})]
    two = [*[(t + 0.0, "alive", ENGINE_WAIT) for t in range(2, 7)], (7.25, "alive", ENGINE_WAIT),
           (7.3, "end", {"how": "exception", "error": LOST})]
    report = diagnose({0: rank(0, 3, zero), 1: rank(1, 3, silent), 2: rank(2, 3, two)})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), text
    assert "the engine's own all_reduce" in report.summary, text


def test_a_wait_another_silent_member_explains_shows_no_freeze_of_the_rank_killed_beside_it():
    """Rank 2 stopped inside the all-reduce at t=1; rank 1, inside it too, writes until t=3 and is then killed; ranks
    0 and 3 wait, unbroken, to t=7.5 (on rank 2: gloo never read from rank 1): rank 2 froze, the first silent
    (while rank 1 still wrote, the wait could only end at rank 2), and rank 1 reads died, as its trace alone
    can tell (was: 'froze for good' for it as well, a red team's near miss)."""
    inside = (1.0, "collective_start", ALLREDUCE)
    one = [inside, (2.0, "alive", WAITING), (3.0, "alive", WAITING)]
    report = diagnose({0: rank(0, 4, waiter(7.5, SIGNAL)), 1: rank(1, 4, one), 2: rank(2, 4, [inside]),
                       3: rank(3, 4, waiter(7.5, SIGNAL))})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [2]), text
    assert not [f for f in report.findings if f.kind == "frozen" and 1 in f.culprits], text
    assert "rank 1 died (SIGKILL?)" in text, text


# blocked in the engine's all-reduce on the controller's ranks
ENGINE_WAIT = {**WAITING, "waiting_on": None, "engine_wait": "all_reduce", "engine_wait_group": "same"}


def engine_waiter(until: float, end: dict, wait: dict = ENGINE_WAIT) -> list[tuple]:
    """A rank whose alive records name the engine's all-reduce every second from t=2 to ``until``, then ``end``."""
    return [*[(t + 0.0, "alive", wait) for t in range(2, int(until) + 1)], (until, "end", end)]


def test_peers_in_the_engines_own_collective_show_a_frozen_rank_too():
    """No controller collective open: ranks 0 and 2 sat in the engine's all-reduce (their threads' frames said so)
    for 3.5 s after rank 1's last record, then were signalled: frozen for good, rank 1 (was: rank_died with 'a
    process frozen for good looks the same')."""
    silent = [(0.95, "steps", {"count": 1, "step": 4})]
    report = diagnose({0: rank(0, 3, engine_waiter(4.5, SIGNAL)), 1: rank(1, 3, silent),
                       2: rank(2, 3, engine_waiter(4.5, SIGNAL))})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), text
    assert "while rank 0 waited in the engine's own all_reduce, as every other rank did, until t+4.5 s" \
        in report.summary, text


def test_two_ranks_silent_together_while_the_others_waited_in_the_engines_collective():
    """Ranks 1 and 2 stop writing 0.5 s apart; ranks 0 and 3 sit in the engine's all-reduce, unbroken: one frozen
    finding, ranks 1-2, rank 1 first, rank 2 with the line that its own trace cannot tell (a red team's two
    workers SIGSTOPped together read 'ranks 1-2 died (SIGKILL?)': each was the other's missing engine wait)."""
    silent = lambda t: [(t, "steps", {"count": 1, "step": 4})]  # noqa: E731
    report = diagnose({0: rank(0, 4, engine_waiter(5.5, SIGNAL)), 1: rank(1, 4, silent(0.95)),
                       2: rank(2, 4, silent(1.45)), 3: rank(3, 4, engine_waiter(5.5, SIGNAL))})
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1, 2]), text
    assert report.summary.startswith("ranks 1-2 froze for good") and "the engine's own all_reduce" in text, text
    assert "rank 2 stopped writing 0.50 s from rank 1" in text and "cannot tell a freeze with it" in text, text
    assert not [f for f in report.findings if f.kind == "rank_died"], text


def test_an_engine_wait_begun_before_the_silent_rank_stopped_shows_no_freeze():
    """Ranks 0 and 2 sat in the engine's all-reduce from t=2, and so did rank 1 (its alive records say so) until
    its last record at t=2.5: a wait begun before it stopped, or shared with it, may be on another live member
    (a red team's engine deadlocked in mismatched collectives, then rank 1 SIGKILLed, read 'froze for good'):
    rank 1 died."""
    wait = ENGINE_WAIT
    one = [(1.5, "alive", wait), (2.5, "alive", wait)]
    report = diagnose({0: rank(0, 3, engine_waiter(7.5, SIGNAL, wait)), 1: rank(1, 3, one),
                       2: rank(2, 3, engine_waiter(7.5, SIGNAL, wait))})
    text = format_report(report)
    assert "froze for good" not in text and report.culprit_ranks == [1], text
    # the same when the others' first records of it come just after rank 1's last one (liveness threads beat in
    # phase: the red team's real traces, 10 ms apart): rank 1's own record shows it inside that wait at that step
    one = [(1.99, "alive", wait)]
    report = diagnose({0: rank(0, 3, engine_waiter(7.5, SIGNAL, wait)), 1: rank(1, 3, one),
                       2: rank(2, 3, engine_waiter(7.5, SIGNAL, wait))})
    assert "froze for good" not in format_report(report), format_report(report)


@pytest.mark.parametrize("case", ["a rank not waiting", "lost connection", "within the limit", "nccl",
                                  "after an earlier wait", "begun late", "a group's set-up", "point-to-point",
                                  "another group", "group unknown", "a rooted collective"])
def test_an_engine_wait_without_the_rest_of_the_evidence_shows_no_freeze(case):
    """One other rank not in an engine wait (the engine's group may be the two of them), a lost connection, waits
    no longer than a live rank's silence, a CUDA device, a wait that ended before the limit (the rank stepped
    after it), a wait begun 4.5 s after rank 1's last record (rank 2 went on without it first), waits in new_group
    (the store's: a red team's survivors of a SIGKILL sat there, unbroken), waits in recv (on one peer or any:
    a red team's parameter server sat in recv(src=None) on a SIGKILLed worker), waits on a group other than the
    controller's (red teams' engines waited on a busy rank no trace shows), waits on a group not known, waits in
    a broadcast (a member waits on the root alone: red teams' survivors deadlocked in mismatched broadcasts beside
    a rank then SIGKILLed): rank 1 died."""
    device, two, zero = "cpu", engine_waiter(4.5, SIGNAL), engine_waiter(4.5, SIGNAL)
    if case == "a rank not waiting":
        two = [(t + 0.0, "alive", {**WAITING, "waiting_on": None}) for t in (2, 3, 4)] + [(4.5, "end", SIGNAL)]
    elif case == "lost connection":
        lost = "RuntimeError: Connection closed by peer [127.0.0.1]:58797"
        two = [(2.0, "alive", ENGINE_WAIT), (2.2, "end", {"how": "exception", "error": lost})]
    elif case == "within the limit":
        two = engine_waiter(3.0, {"how": "closed"})
    elif case == "nccl":
        device = "cuda:0"
    elif case == "another group":
        zero = two = engine_waiter(4.5, SIGNAL, {**ENGINE_WAIT, "engine_wait_group": "other"})
    elif case == "group unknown":
        zero = two = engine_waiter(4.5, SIGNAL, {k: v for k, v in ENGINE_WAIT.items() if k != "engine_wait_group"})
    elif case in ("a group's set-up", "point-to-point", "a rooted collective"):
        op = {"a group's set-up": "new_group", "point-to-point": "recv"}.get(case, "broadcast")
        zero = two = engine_waiter(4.5, SIGNAL, {**ENGINE_WAIT, "engine_wait": op})
    elif case == "begun late":
        moved = {**ENGINE_WAIT, "step": 9, "steps_seen": 9}
        two = [(5.5, "alive", moved), (6.5, "alive", moved), (7.0, "end", {**SIGNAL, "step": 9})]
    else:   # in the engine's wait at t=2 and 3, then stepping (alive records without it) up to its signal
        two = [(2.0, "alive", ENGINE_WAIT), (3.0, "alive", ENGINE_WAIT),
               (4.0, "alive", {**WAITING, "waiting_on": None}), (4.5, "end", SIGNAL)]
    silent = [(0.95, "steps", {"count": 1, "step": 4})]
    report = diagnose({0: rank(0, 3, zero, device), 1: rank(1, 3, silent, device), 2: rank(2, 3, two, device)})
    text = format_report(report)
    assert "rank 1 died (SIGKILL?)" in text, text
    assert "froze for good" not in text


# the controller on a 2-rank gloo group; the engine has no collective of its own, so the ranks meet only in the
# controller's: at each rearrangement (every 6 steps) the all-reduce of the loads waits for both
ENGINE = """
import os, re, sys, time
from eplb_fsm.stop_signals import end_traces_on_signal
end_traces_on_signal()   # first thing: before torch starts any thread
import torch.distributed as dist
from eplb_fsm import EplbConfig, EplbController
from eplb_fsm.sim.model import ToyMoE

trace_dir, pid_dir, fault, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = ToyMoE(num_layers=2, num_experts=8, num_redundant=2, hidden=8, rank=rank, world_size=world)
config = EplbConfig(window_size=4, step_interval=6, num_redundant_experts=2, collective_timeout_s=timeout_s)
with EplbController(config, group=dist.group.WORLD, device="cpu", trace_dir=trace_dir) as ctl:
    ctl.add_model(model, "main")
    for step in range(100000):
        model.forward(model.make_batch(step, 16))
        ctl.step()
        if step == 20:   # a rearrangement or two behind it: the test may act now
            with open(os.path.join(pid_dir, f"{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.path.join(pid_dir, f"{rank}.tmp"), os.path.join(pid_dir, str(rank)))
        if step == 21 and rank == 1 and fault == "gil":
            re.match(r"(a+)+$", "a" * 64 + "b")   # catastrophic backtracking: a C call holding the GIL for good
        time.sleep(0.05 if step < 20 else 0.2)
"""
# the same job whose engine meets in an all-reduce of its own every step, and the controller never rearranges: the
# ranks meet only in the engine's collective
ENGINE_OWN = ENGINE.replace("step_interval=6", "step_interval=100000").replace(
    "        ctl.step()\n", "        dist.all_reduce(torch.ones(4))\n        ctl.step()\n").replace(
    "import torch.distributed as dist", "import torch, torch.distributed as dist")
GRACE = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}   # torchrun's wait between its SIGTERM and its SIGKILL


def _last(path) -> dict:
    records = read_trace(path)[0]
    return records[-1] if records else {}


def _stop_once_rank_0_waited(pids: dict, launcher, traces, freeze: bool = True, field: str = "waiting_on") -> None:
    """With ``freeze``, SIGSTOP rank 1 and wait (bounded) until rank 0 has ticked inside a collective (``field``
    says whose: the controller's, or ``engine_wait``) more than 3 s past rank 1's last record; else until rank 0's
    controller failed (its wait timed out). Then SIGTERM torchrun: an operator ending a job hung on a worker that
    runs no Python."""
    if freeze:
        os.kill(pids[1], signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        last, zero = _last(traces / "rank00001.jsonl"), _last(traces / "rank00000.jsonl")
        waited = zero.get(field) and "ts" in last and zero["ts"] - last["ts"] > 3.0
        if (waited if freeze else zero.get("state") == "failed"):
            break
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)


def _frozen_job(tmp_path, stop, args: tuple, engine: str = ENGINE) -> tuple:
    """Run ``engine`` under torchrun with ``stop``; rank 0 must end by torchrun's signal and rank 1 with no ``end``
    (SIGKILLed after the grace). Returns rank 1's report and its text."""
    traces, code, out = torchrun_job(tmp_path, engine, stop, args, GRACE)
    assert code != 0, out
    assert _last(traces / "rank00000.jsonl").get("how") == "signal", out[-3000:]
    assert _last(traces / "rank00001.jsonl").get("event") != "end", out[-3000:]
    report = replay_dir(traces)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), text
    assert "froze for good" in report.summary, text
    return report, text


@pytest.mark.multiprocess
def test_a_worker_sigstopped_under_torchrun_then_the_job_stopped_reads_frozen(tmp_path):
    """SIGSTOP rank 1; rank 0 waits in the loads' all-reduce; SIGTERM torchrun: rank 0 writes its signal end,
    rank 1 takes no signal and is SIGKILLed after the grace: frozen for good, rank 1 (was: a hang on rank 1 whose
    detail read 'rank 1 died (SIGKILL?)')."""
    report, text = _frozen_job(tmp_path, _stop_once_rank_0_waited, ("stop", "60"))
    assert "while rank 0 waited on rank 1 in all_reduce" in report.summary, text


@pytest.mark.multiprocess
def test_a_worker_stuck_holding_the_gil_while_its_peer_timed_out_reads_frozen(tmp_path):
    """Rank 1 enters a regex that backtracks for good (no thread of it runs Python); rank 0's wait in the loads'
    all-reduce runs out after 4 s (its controller fails the rearrangement, the engine serves on); SIGTERM torchrun:
    rank 1 cannot take it and is SIGKILLed after the grace: frozen for good, rank 1 (was: a hang on rank 1 whose
    detail read 'rank 1 died (SIGKILL?)')."""
    stop = lambda pids, launcher, traces: _stop_once_rank_0_waited(pids, launcher, traces, freeze=False)  # noqa: E731
    report, text = _frozen_job(tmp_path, stop, ("gil", "4"))
    assert "until its wait ran out at" in report.summary, text


@pytest.mark.multiprocess
def test_a_worker_sigstopped_while_its_peer_waits_in_the_engines_all_reduce_reads_frozen(tmp_path):
    """The engine's own all-reduce every step, no rearrangement: SIGSTOP rank 1; rank 0 waits in the engine's
    all-reduce (its liveness thread names it from the main thread's frames); SIGTERM torchrun: frozen for good,
    rank 1 (was: rank_died, 'a process frozen for good looks the same')."""
    stop = lambda pids, launcher, traces: _stop_once_rank_0_waited(pids, launcher, traces, field="engine_wait")  # noqa
    report, text = _frozen_job(tmp_path, stop, ("stop", "60"), ENGINE_OWN)
    assert "while rank 0 waited in the engine's own all_reduce until" in report.summary, text
    assert not [f for f in report.findings if f.kind == "rank_died"], text   # its trace stops early: not dead too
