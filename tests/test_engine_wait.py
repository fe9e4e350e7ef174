"""engine_wait: the engine's own collective a thread is blocked in, named from the threads' frames."""

from __future__ import annotations

import os
import threading
import time

import pytest

import eplb_fsm
from eplb_fsm import engine_wait
from eplb_fsm.engine_wait import engine_collective
from eplb_fsm.liveness import Liveness
from eplb_fsm.sim.launcher import run_ranks
from eplb_fsm.trace import EventTrace
from eplb_fsm.trace_fields import alive_fields

PACKAGE = os.path.dirname(os.path.abspath(eplb_fsm.__file__))
C10D = os.path.join(os.sep, "site", "torch", "distributed", "distributed_c10d.py")


def _blocked_in(op: str, caller_path: str, c10d_path: str = C10D, group: object = None):
    """A daemon thread blocked inside a function ``op(..., group)`` compiled as if from ``c10d_path``, called by
    code compiled as if from ``caller_path``; returns (the thread, the lock whose release frees it). It blocks in
    a C call (a lock's acquire), with no Python frame above the function: as a thread in a gloo wait does."""
    release, inside = threading.Lock(), threading.Event()
    release.acquire()
    c10d: dict = {}
    body = f"def {op}(inside, release, group):\n    inside.set()\n    release.acquire(timeout=30)\n"
    exec(compile(body, c10d_path, "exec"), c10d)
    caller: dict = {"collective": c10d[op], "group": group}
    exec(compile("def forward(inside, release):\n    collective(inside, release, group)\n", caller_path, "exec"),
         caller)
    thread = threading.Thread(target=caller["forward"], args=(inside, release), daemon=True)
    thread.start()
    assert inside.wait(10)
    return thread, release


@pytest.fixture
def blocked():
    """Start blocked threads; every one is released and joined at the end."""
    started = []

    def start(*args, **kwargs):
        thread, release = _blocked_in(*args, **kwargs)
        started.append((thread, release))
        return thread

    yield start
    for thread, release in started:
        release.release()
        thread.join(10)


def test_a_thread_in_a_collective_called_by_the_engine_is_named(blocked):
    """A thread inside c10d's all_reduce, called from the engine's own code (outside eplb_fsm): ('all_reduce',
    None), whether its group is the controller's unknown without torch.distributed set up."""
    assert engine_collective() is None
    blocked("all_reduce", "/srv/engine/model_runner.py")
    assert engine_collective()[:2] == ("all_reduce", None)


def test_the_controllers_own_collectives_are_not_the_engines(blocked):
    """A collective called from the controller's code (eplb_fsm outside sim/bench/testing) is not an engine wait."""
    blocked("all_reduce", os.path.join(PACKAGE, "fsm", "collectives.py"))
    blocked("barrier", os.path.join(PACKAGE, "transfer", "executor.py"))
    assert engine_collective() is None


def test_the_simulators_engine_counts_as_an_engine(blocked):
    """The simulator's toy model plays the engine: its all-reduce is named."""
    blocked("barrier", os.path.join(PACKAGE, "sim", "model.py"))
    assert engine_collective()[:2] == ("barrier", None)


def test_group_set_up_is_not_a_collective(blocked):
    """A thread in new_group or init_process_group waits in the store, which a dead peer does not break: nothing
    is named (a red team's survivors sat in new_group on a SIGKILLed rank and read 'froze for good')."""
    blocked("new_group", "/srv/engine/run.py")
    blocked("init_process_group", "/srv/engine/run.py")
    assert engine_collective() is None


def test_point_to_point_is_not_a_collective(blocked):
    """send and recv wait on one peer, or on none (recv from any source), not on the group: nothing is named (a red
    team's parameter server sat in recv(src=None) on a SIGKILLed worker and read 'froze for good')."""
    blocked("recv", "/srv/engine/run.py")
    blocked("send", "/srv/engine/run.py")
    assert engine_collective() is None


def test_a_thread_running_its_own_code_inside_a_collective_is_not_waiting():
    """all_gather_object pickles its object first: a thread asleep in that object's __reduce__ (the engine's code,
    inside the collective's frame) is not blocked on the peers: nothing is named (a red team's survivors, asleep
    in a slow pickle, read a rank SIGKILLed meanwhile frozen)."""
    release, inside = threading.Event(), threading.Event()
    c10d: dict = {}
    exec(compile("def all_gather_object(hook, group=None):\n    hook()\n", C10D, "exec"), c10d)
    engine: dict = {"collective": c10d["all_gather_object"], "inside": inside, "release": release}
    exec(compile("def reduce_hook():\n    inside.set()\n    release.wait(30)\n"
                 "def forward():\n    collective(reduce_hook)\n", "/srv/engine/run.py", "exec"), engine)
    thread = threading.Thread(target=engine["forward"], daemon=True)
    thread.start()
    try:
        assert inside.wait(10)
        assert engine_collective() is None
    finally:
        release.set()
        thread.join(10)


def test_rooted_collectives_are_not_counted(blocked):
    """broadcast, gather, reduce, scatter: a member may wait on the root alone, not on every member: nothing is
    named (red teams' survivors, deadlocked in mismatched broadcasts, read a rank SIGKILLed beside them frozen)."""
    for op in ("broadcast", "gather", "reduce", "scatter", "monitored_barrier"):
        blocked(op, "/srv/engine/run.py")
    assert engine_collective() is None


def test_private_helpers_and_other_files_are_not_collectives(blocked):
    """A private c10d function, or a public one of another file, names nothing; a skipped thread is not looked at."""
    blocked("_store_based_barrier", "/srv/engine/run.py")
    blocked("all_reduce", "/srv/engine/run.py", c10d_path="/site/torch/distributed/c10d_logger.py")
    assert engine_collective() is None
    thread = blocked("all_gather", "/srv/engine/run.py")
    assert engine_collective()[:2] == ("all_gather", None)
    assert engine_collective(skip={thread.ident}) is None


def test_liveness_names_the_engine_wait_only_while_the_step_stays_put(blocked):
    """An alive record carries engine_wait while the step stays put, not while it advances; beside an open
    collective of the controller's (a posted all-reduce) too."""
    trace = EventTrace(rank=0, world=2, keep=True)
    live = Liveness(trace, interval_s=1.0)
    trace.set_context(state="collecting", step=3)
    blocked("all_reduce", "/srv/engine/model_runner.py")
    live.beat()                        # the first beat: the step moved from nothing
    trace.set_context(step=4)
    moving = live.beat()
    waiting = live.beat()              # no step since the last record
    opened = trace.open_collective("all_reduce", group="ep", shape=[4], dtype="torch.float64")
    in_controller = live.beat()
    trace.close_collective(opened)
    assert moving is None or "engine_wait" not in moving
    assert (waiting["event"], waiting["engine_wait"], waiting["waiting_on"]) == ("alive", "all_reduce", None)
    assert "engine_wait_group" not in waiting   # no controller group to compare with
    assert in_controller["engine_wait"] == "all_reduce" and in_controller["waiting_on"]["cseq"] == opened.info["cseq"]


def test_a_wait_on_the_controllers_ranks_answers_before_one_elsewhere(blocked, monkeypatch):
    """Two threads, one in a collective on another group, one on the controller's ranks: the look names the latter
    whatever the threads' order (a dead member would have broken that one)."""
    ours, theirs = object(), object()
    ranks = {id(ours): (0, 1, 2), id(theirs): (1, 2, 3)}
    monkeypatch.setattr(engine_wait, "_ranks", lambda group, none_is_world: ranks.get(id(group)))
    blocked("all_gather", "/srv/engine/run.py", group=theirs)
    blocked("barrier", "/srv/engine/run.py", group=ours)
    blocked("all_to_all", "/srv/engine/run.py", group=theirs)
    assert engine_collective(ours)[:2] == ("barrier", True)
    assert engine_collective(theirs)[:2] in (("all_gather", True), ("all_to_all", True))


def test_the_record_says_whether_the_wait_is_on_the_controllers_ranks():
    """alive_fields: engine_wait_group 'same' or 'other', and none when that is unknown."""
    fields = [alive_fields(1.0, 4, None, ("barrier", same)) for same in (True, False, None)]
    assert [f.get("engine_wait_group") for f in fields] == ["same", "other", None]
    assert all(f["engine_wait"] == "barrier" for f in fields) and "engine_wait" not in alive_fields(1.0, 4, None)
    full = alive_fields(1.0, 4, None, ("all_reduce", True, "WORLD:[48, 8]", True))
    assert (full["engine_wait_call"], full["engine_wait_main"]) == ("WORLD:[48, 8]", True)
    assert "engine_wait_call" not in alive_fields(1.0, 4, None, ("all_reduce", True, None, False))


def _rank_looks_while_blocked(rank: int, world: int) -> list:
    """Rank 0 looks from its main thread, compared with three controller groups (the world, a group of rank 0
    alone, none), while another of its threads sits in a real gloo all-reduce that rank 1 joins 2 s late."""
    import torch
    import torch.distributed as dist

    alone = dist.new_group([0])   # collective: every rank builds it
    if rank == 1:
        time.sleep(2.0)
        dist.all_reduce(torch.ones(4))
        return []
    thread = threading.Thread(target=dist.all_reduce, args=(torch.ones(4),), daemon=True)
    thread.start()
    time.sleep(0.5)
    seen = [engine_collective(group) for group in (dist.group.WORLD, alone, None)]
    thread.join(30)
    return seen


@pytest.mark.multiprocess
def test_a_real_gloo_all_reduce_is_seen_while_it_waits():
    """Two gloo ranks: while rank 0's thread waits in dist.all_reduce (the default group) for rank 1, the look
    names it, on the controller's ranks for a controller on the world, on others for one on rank 0 alone."""
    looks = run_ranks(_rank_looks_while_blocked, 2, timeout=60)
    assert [look[:2] for look in looks[0]] == [("all_reduce", True), ("all_reduce", False), ("all_reduce", None)]
    # which call (the default group, a tensor of 4) and that a side thread, not the main one, waits in it
    assert {look[2:] for look in looks[0]} == {("WORLD:[4]", False)} and looks[1] == []


def _look_while_main_waits(group: object = None, op: str = "all_reduce", look_with=engine_collective) -> tuple:
    """What another thread's look (``look_with``, as the liveness thread's) sees while this thread, the main one,
    sits in the engine's ``op`` (a function compiled as c10d's, called from the engine's code, blocked in a C call)."""
    c10d: dict = {}
    exec(compile(f"def {op}(inside, release, group=None):\n    inside.set()\n    release.acquire(timeout=30)\n",
                 C10D, "exec"), c10d)
    caller: dict = {"collective": c10d[op]}
    exec(compile("def forward(inside, release):\n    collective(inside, release)\n", "/srv/engine/run.py", "exec"),
         caller)
    inside, release, seen = threading.Event(), threading.Lock(), []
    release.acquire()

    def look() -> None:
        inside.wait(10)
        seen.append(look_with(group))
        release.release()

    looker = threading.Thread(target=look)
    looker.start()
    caller["forward"](inside, release)   # blocks in the main thread until the look is taken
    looker.join(10)
    return seen[0]


def test_the_look_says_whether_the_main_thread_is_the_one_waiting():
    """The main thread inside the engine's all_reduce, looked at from another thread (as the liveness thread
    looks): main True; a side thread's wait looked at from the main thread: main False (a rank whose main thread
    computes while a side thread waits is not waiting in its step)."""
    seen = _look_while_main_waits()
    assert seen[0] == "all_reduce" and seen[3] is True
    thread, side = _blocked_in("all_reduce", "/srv/engine/run.py")
    try:
        assert engine_collective()[3] is False
    finally:
        side.release()
        thread.join(10)


def test_the_main_threads_wait_answers_before_a_side_threads(monkeypatch):
    """Both on the controller's ranks, a side thread in a barrier and the main thread in an all_reduce: the look
    names the main thread's (the step's own wait; a red team's engine kept a side thread in a shutdown collective)."""
    monkeypatch.setattr(engine_wait, "_ranks", lambda group, none_is_world: (0, 1))
    side, free = _blocked_in("barrier", "/srv/engine/run.py")
    try:
        seen = _look_while_main_waits(object())
    finally:
        free.release()
        side.join(10)
    assert (seen[0], seen[1], seen[3]) == ("all_reduce", True, True)


def test_a_main_threads_own_wait_is_named_apart():
    """The main thread inside the engine's broadcast: no engine_wait (a member may wait on the root alone), but
    main_wait names it, and the record writes it as main_wait (a red team's rank in broadcast against its peers'
    all_reduce read as in its own work); the main thread's all_reduce too; a side thread's broadcast is not."""
    assert _look_while_main_waits(op="broadcast") is None
    seen = _look_while_main_waits(op="broadcast", look_with=engine_wait.main_wait)
    assert seen == ("broadcast", None, "WORLD:-", None)   # the default group; no tensor argument; no peer
    assert _look_while_main_waits(look_with=engine_wait.main_wait)[0] == "all_reduce"
    thread, side = _blocked_in("broadcast", "/srv/engine/run.py")
    try:
        assert engine_wait.main_wait() is None
    finally:
        side.release()
        thread.join(10)
    fields = alive_fields(1.0, 4, None, (None, None, None, None, ("broadcast", True, "WORLD:[4]")))
    assert (fields["main_wait"], fields["main_wait_group"], fields["main_wait_call"]) == ("broadcast", "same",
                                                                                        "WORLD:[4]")
    assert "engine_wait" not in fields


def _rank_looks_in_point_to_point(rank: int, world: int) -> list:
    """Each rank's main thread blocks in a real gloo point-to-point call while a thread of its own looks
    (``main_wait``) against the controller's group (the world, then none): rank 0 in ``recv(src=1)``, which rank 1
    sends 2 s late; then rank 1 in ``send(group_dst=0, tag=3)`` on a group of both, which rank 0 receives 2 s
    late."""
    import torch
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    seen: list = []

    def look() -> None:
        time.sleep(0.5)
        seen.extend(engine_wait.main_wait(group) for group in (dist.group.WORLD, None))

    looker = threading.Thread(target=look, daemon=True)
    if rank == 0:
        looker.start()
        dist.recv(torch.zeros(4), src=1)
        looker.join(30)
        time.sleep(2.0)
        dist.recv(torch.zeros(4096), group=pair, group_src=1, tag=3)
    else:
        time.sleep(2.0)
        dist.send(torch.ones(4), dst=0)
        looker.start()
        dist.send(torch.ones(4096), group=pair, group_dst=0, tag=3)
        looker.join(30)
    return seen


@pytest.mark.multiprocess
def test_a_real_gloo_send_and_recv_name_their_peer():
    """Two gloo ranks: a main thread blocked in recv from rank 1 is named with its peer (``main_wait``: op, group,
    call, peer 1); one blocked in send to rank 0 of a group, with peer 0 and its tag in the call; without a
    controller's torch group the peer is unknown (None)."""
    looks = run_ranks(_rank_looks_in_point_to_point, 2, timeout=60)
    assert looks[0] == [("recv", True, "WORLD:[4]", 1), ("recv", None, "WORLD:[4]", None)]
    assert [look[0] for look in looks[1]] == ["send", "send"] and [look[3] for look in looks[1]] == [0, None]
    assert looks[1][0][1] is True and looks[1][0][2].endswith(":[4096] tag 3")
    fields = alive_fields(1.0, 4, None, (None, None, None, None, looks[0][0]))
    assert (fields["main_wait"], fields["main_wait_peer"]) == ("recv", 1)
    assert "main_wait_peer" not in alive_fields(1.0, 4, None, (None, None, None, None, looks[0][1]))


def test_one_look_reads_both_waits_from_one_read_of_the_frames(monkeypatch):
    """``look``: the main thread in a broadcast gives no engine_wait and its main_wait; in an all_reduce, the
    engine_wait with main True and no main_wait (not asked for); the frames are read once a look."""
    reads = []
    current = engine_wait.sys._current_frames
    monkeypatch.setattr(engine_wait.sys, "_current_frames", lambda: reads.append(1) or current())
    assert _look_while_main_waits(op="broadcast", look_with=engine_wait.look) == \
        (None, ("broadcast", None, "WORLD:-", None))
    engine, main = _look_while_main_waits(look_with=engine_wait.look)
    assert (engine[0], engine[3], main) == ("all_reduce", True, None) and len(reads) == 2
