"""The liveness thread: `alive` records at a set rate, with the step seen at the previous one."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eplb_fsm.liveness import DEFAULT_INTERVAL_S, Liveness, check_interval
from eplb_fsm.trace import EventTrace, read_trace, trace_path


def test_tick_carries_step_state_and_steps_seen():
    """Each record has the trace's current step/state and steps_seen = the step at the previous record."""
    trace = EventTrace(rank=1, world=2, keep=True)
    live = Liveness(trace, interval_s=0.5)
    trace.set_context(state="collecting", step=3)
    first = live.tick()
    trace.set_context(step=9)
    second = live.tick()
    third = live.tick()
    assert (first["step"], first["steps_seen"], first["state"]) == (3, None, "collecting")
    assert (second["step"], second["steps_seen"]) == (9, 3)
    # a rank whose step no longer advances: step == steps_seen
    assert (third["step"], third["steps_seen"]) == (9, 9)
    assert all(r["interval_s"] == 0.5 for r in (first, second, third))


def test_no_alive_after_end():
    """Once the trace has ended, tick writes nothing."""
    trace = EventTrace(keep=True)
    live = Liveness(trace, interval_s=1.0)
    trace.end("closed")
    assert live.tick() is None
    assert [r["event"] for r in trace.records] == ["end"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1", True])
def test_bad_interval_is_refused(bad):
    """The interval must be a finite number > 0; the error names the field."""
    with pytest.raises(ValueError, match="liveness_interval_s"):
        check_interval(bad)


def test_thread_writes_records_until_stopped(tmp_path):
    """The thread writes alive records to the file while running and stops when asked."""
    from eplb_fsm.fsm.reporting import SharedTrace

    trace = SharedTrace(0, 1, tmp_path)
    live = Liveness(trace, interval_s=0.05).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(1 for r in read_trace(trace_path(tmp_path, 0))[0] if r["event"] == "alive") >= 2:
            break
        time.sleep(0.02)
    assert live.stop(timeout=5.0) and not live.running
    trace.close()
    alive = [r for r in read_trace(trace_path(tmp_path, 0))[0] if r["event"] == "alive"]
    assert len(alive) >= 2 and [r["seq"] for r in alive] == sorted(r["seq"] for r in alive)


def test_controller_writes_alive_and_ends_closed(tmp_path):
    """A controller with a trace file writes alive records and its close writes `end how=closed` last."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    ctl = EplbController(EplbConfig(), trace_dir=str(tmp_path), liveness_interval_s=0.05)
    assert ctl.liveness is not None and ctl.liveness.interval_s == 0.05
    done = threading.Event()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not done.is_set():
        if any(r["event"] == "alive" for r in read_trace(trace_path(tmp_path, 0))[0]):
            done.set()
        time.sleep(0.02)
    ctl.close()
    records = read_trace(trace_path(tmp_path, 0))[0]
    assert done.is_set()
    assert records[-1]["event"] == "end" and records[-1]["how"] == "closed"
    assert not ctl.liveness.running


def test_controller_without_a_trace_file_has_no_liveness_thread():
    """No trace_dir: no thread (nothing to write to); the default rate is documented as 1 s."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    with EplbController(EplbConfig(), keep_trace=True) as ctl:
        assert not ctl.liveness.running
    assert DEFAULT_INTERVAL_S == 1.0
    assert ctl.trace.records[-1]["event"] == "end"


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1"])
def test_a_bad_interval_error_names_every_accepted_value(bad):
    """The error names the field and what it accepts: None or 0 (liveness off), or a finite number > 0."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    with pytest.raises(ValueError) as info:
        EplbController(EplbConfig(), liveness_interval_s=bad)
    assert str(info.value) == ("liveness_interval_s must be None, 0 (off) or a finite number > 0 (seconds), "
                               f"got {bad!r}")
    for off in (None, 0):
        assert Liveness(None, interval_s=off).interval_s is None  # the values the message calls off are taken


def test_controller_refuses_a_bad_liveness_interval():
    """A negative interval fails at construction, naming the field."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    with pytest.raises(ValueError, match="liveness_interval_s"):
        EplbController(EplbConfig(), liveness_interval_s=-1.0)


class _Clock:
    """A settable monotonic clock (seconds) for driving the heartbeat without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _moving_rank(beats: int, steps_per_beat: int, heartbeat_s: float = 30.0, times: list | None = None):
    """A trace counting quiet steps, beaten once per ``steps_per_beat`` steps; returns (trace, liveness, written).
    ``times`` gets the clock at each beat."""
    trace = EventTrace(rank=0, world=2, keep=True)
    trace.set_context(state="collecting", step=0)
    clock = _Clock()
    live = Liveness(trace, interval_s=1.0, heartbeat_s=heartbeat_s, clock=clock)
    written = []
    for _ in range(beats):
        for _ in range(steps_per_beat):
            trace.count_step()
            trace.step += 1
        clock.now += live.period()
        written.append(live.beat())
        if times is not None:
            times.append(clock.now)
    return trace, live, written


def test_beat_writes_runs_while_moving_and_alive_only_at_first_and_heartbeat():
    """A moving rank: first beat alive, then a look (nothing) and a run in turn, 1 and 0.5 s apart; heartbeat alive."""
    times: list[float] = []
    trace, live, written = _moving_rank(beats=61, steps_per_beat=15, heartbeat_s=30.0, times=times)
    kinds = [r["event"] if r else None for r in written]
    assert kinds[0] == "alive" and live.moving
    assert [b - a for a, b in zip(times, times[1:])] == [1.0, 0.5] * 30   # never more than one interval apart
    writes = [t for t, k in zip(times, kinds) if k is not None]
    assert [b - a for a, b in zip(writes, writes[1:])] == [1.5] * 30      # a record every 1.5 intervals, as before
    assert all(k is None for k in kinds[1::2]) and all(k is not None for k in kinds[::2])
    alive = [t for t, k in zip(times, kinds) if k == "alive"]
    assert alive == [1.0, 31.0]   # the first, then the first write beat 30 s or more after the last alive
    assert all(k == "steps" for t, k in zip(times, kinds) if k is not None and t not in alive)
    assert sum(len(range(r["step"], r["step"] + r.get("count", 1))) for r in trace.records
               if r["event"] in ("step", "steps")) == 61 * 15   # the last beat wrote: every step is on record


def test_beat_writes_alive_every_interval_while_the_step_stays_put():
    """A rank that stops stepping (waits in the engine's collective): every beat is alive with step == steps_seen."""
    trace, live, _ = _moving_rank(beats=3, steps_per_beat=10)
    waits = [live.beat() for _ in range(4)]
    assert all(r["event"] == "alive" for r in waits)
    assert all(r["step"] == r["steps_seen"] == 30 for r in waits)
    assert not live.moving and live.period() == 1.0
    # the first beat after the stop flushed the last run before its alive record
    assert trace.records[-5]["event"] == "steps" and trace.records[-5]["step"] + trace.records[-5]["count"] == 30


def test_beat_writes_alive_while_a_collective_is_open_even_if_steps_advance():
    """An open traced collective (waiting_on) makes every beat alive, naming it, though the step advances."""
    trace = EventTrace(rank=0, world=2, keep=True)
    live = Liveness(trace, interval_s=1.0, clock=_Clock())
    live.beat()
    with trace.collective("all_reduce", "engine"):
        trace.step += 1
        record = live.beat()
    assert record["event"] == "alive" and record["waiting_on"] == {"op": "all_reduce", "group": "engine", "cseq": 0}
    assert not live.moving


def test_a_moving_beat_with_nothing_pending_writes_alive_so_no_beat_is_silent():
    """Steps advanced but their own records flushed the run (a transition): the beat writes alive, not nothing."""
    trace, live, written = _moving_rank(beats=2, steps_per_beat=10)
    assert written[1] is None and live.period() == 0.5   # a look: the next beat writes
    trace.step += 1
    trace.emit("transition", source="collecting", dest="scaling", trigger="scale")  # takes the run out
    record = live.beat()
    assert record is not None and record["event"] == "alive"
    assert record["steps_seen"] == 10 and record["step"] == 21   # the step at the previous record: a look is none
    # the rank then waits in scaling: the next beat is alive again, one interval later
    assert live.beat()["event"] == "alive" and live.period() == 1.0


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), "30", True])
def test_bad_heartbeat_is_refused(bad):
    """heartbeat_s must be a finite number > 0; the error names it."""
    with pytest.raises(ValueError, match="heartbeat_s"):
        Liveness(EventTrace(), heartbeat_s=bad)


def test_moving_rank_writes_under_100_bytes_a_second_at_10_steps_a_second(tmp_path):
    """Default interval and heartbeat, 10 steps/s for 120 s of beats: under 100 bytes/s on disk (10 MB per 1M steps)."""
    trace = EventTrace(rank=3, world=64, trace_dir=tmp_path)
    trace.set_context(state="collecting", step=1_234_567)
    trace.seq = 123_456
    clock = _Clock()
    live = Liveness(trace, clock=clock)
    live.beat()
    trace.flush()
    size0 = trace.path.stat().st_size
    while clock.now < 120.0:
        period = live.period()
        for _ in range(round(period * 10)):
            trace.count_step()
            trace.step += 1
        clock.now += period
        live.beat()
    trace.flush()
    per_second = (trace.path.stat().st_size - size0) / clock.now
    trace.close()
    assert 40 < per_second < 100, per_second


class FlakyTrace:
    """A trace whose first ``failures`` beats raise (a passing error), then behave; counts alive records."""

    def __init__(self, failures: int = 2) -> None:
        self.step, self.rank, self.ended, self.closed, self.calls, self.alive_count = 0, 0, False, False, 0, 0
        self.failures = failures

    def waiting_on(self):
        return None

    def flush(self):
        return None

    def alive(self, interval_s, steps_seen):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("disk hiccup")
        self.alive_count += 1
        return {"event": "alive"}


def test_a_failing_beat_does_not_end_the_thread():
    """A beat that raises is counted and logged once; the thread keeps beating (a silent live rank replays
    as frozen)."""
    trace = FlakyTrace()
    live = Liveness(trace, interval_s=0.02).start()
    deadline = time.monotonic() + 10
    while trace.alive_count < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.running and trace.alive_count >= 3 and live.errors == 2
    assert live.stop(timeout=5.0)


def test_a_closed_trace_ends_the_thread_on_a_failing_beat():
    """Once the trace is closed, a beat that raises ends the thread instead of retrying forever."""
    trace = FlakyTrace()
    trace.closed = True
    live = Liveness(trace, interval_s=0.02).start()
    deadline = time.monotonic() + 10
    while live.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not live.running and trace.calls == 1


FULL_STDOUT_BEATS = r'''
import json, sys, time
from eplb_fsm.liveness import Liveness

{flaky_trace}
trace = FlakyTrace(failures=4)
live = Liveness(trace, interval_s=0.01).start()
deadline = time.monotonic() + 30
while trace.alive_count < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
result = {"running": live.running, "alive": trace.alive_count, "errors": live.errors}
live.stop()
with open(sys.argv[1], "w") as fh:   # not stdout: it is /dev/full
    json.dump(result, fh)
'''


def test_a_failing_beat_whose_log_fails_too_does_not_end_the_thread(tmp_path):
    """stdout on /dev/full, so the beat-failure log raises as well: the thread still beats on and counts the errors."""
    root = str(Path(__file__).resolve().parents[1])
    script = FULL_STDOUT_BEATS.replace("{flaky_trace}", inspect.getsource(FlakyTrace))
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.json")], stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=120,
                             env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert out.returncode in (0, 120), out.stderr[-2000:]   # 120: the interpreter's own stdout flush at exit
    result = json.loads((tmp_path / "out.json").read_text())
    assert result == {"running": True, "alive": result["alive"], "errors": 4} and result["alive"] >= 3


def _steps_and_beats(step_at, until: float, interval_s: float = 1.0) -> list[dict]:
    """The records a rank's beats write (timed as the thread times them, ``period``) on a simulated clock of 10 ms
    ticks up to ``until`` s, the rank counting one step at each tick ``step_at(tick)`` says (first beat's alive
    at ``interval_s``, heartbeats 30 s apart)."""
    clock = _Clock()
    trace = EventTrace(rank=0, world=2, clock=clock, keep=True)
    trace.set_context(state="collecting", step=0)
    live = Liveness(trace, interval_s=interval_s, clock=clock)
    next_beat = round(live.period() * 100)
    written = []
    for tick in range(1, round(until * 100)):
        clock.now = tick / 100
        if step_at(tick):
            trace.count_step()
            trace.step += 1
        if tick >= next_beat:
            record = live.beat()
            next_beat = tick + round(live.period() * 100)
            written += [record] if record else []
    return written


def _first_alive_after(wait_at: float, interval_s: float = 1.0) -> tuple[float, float]:
    """Seconds from a rank's last step (at ``wait_at`` s; 10 steps/s before it) to its first alive record, and to
    its first alive record with ``step == steps_seen``."""
    stop = round(wait_at * 100)
    written = _steps_and_beats(lambda tick: tick % 10 == 0 and tick <= stop, wait_at + 10.0, interval_s)
    waits = [r for r in written if r["event"] == "alive" and r["ts"] > wait_at]
    still = [r for r in waits if r["step"] == r["steps_seen"]]
    assert waits and still, "no alive record"
    return round(waits[0]["ts"] - wait_at, 2), round(still[0]["ts"] - wait_at, 2)


def test_a_wait_shows_as_alive_within_one_and_a_half_intervals_whatever_its_phase():
    """A moving rank that starts to wait at any moment of its beat cycle writes alive within 1.5 intervals
    (inside the silence of a peer frozen for more than replay's 2.5 intervals), step == steps_seen one interval on."""
    for interval_s, starts in ((1.0, [10.0 + k * 0.05 for k in range(60)]), (2.0, [20.0 + k * 0.1 for k in range(60)])):
        delays = [_first_alive_after(start, interval_s) for start in starts]   # two whole write cycles
        assert 0 < min(d[0] for d in delays) and max(d[0] for d in delays) <= 1.5 * interval_s, delays
        assert max(d[1] for d in delays) <= 2.5 * interval_s, delays


@pytest.mark.parametrize("low, high", [(0.55, 0.7), (0.7, 0.95), (0.55, 0.95)])
def test_a_rank_stepping_slower_than_half_an_interval_never_reads_as_waiting(low, high):
    """Steps low-high intervals apart (a beat after a look may see none since it, so alive is written): no record
    has step == steps_seen, which means no step for at least one interval."""
    import random

    rng, at = random.Random(7), set()
    tick = 0
    while tick < 6000:
        tick += rng.randint(round(low * 100), round(high * 100))
        at.add(tick)
    written = _steps_and_beats(at.__contains__, 60.0)
    alive = [r for r in written if r["event"] == "alive"][1:]   # the first beat's has steps_seen null
    assert len(alive) >= 5, len(alive)     # beats after a look did see no step since it: the path is taken
    assert all(r["step"] != r["steps_seen"] for r in alive), [(r["ts"], r["step"], r["steps_seen"]) for r in alive]


FREEZE_PEER = r'''
import json, multiprocessing as mp, os, signal, sys, time
from pathlib import Path
D, FREEZE = Path(sys.argv[1]), float(sys.argv[2])

def rank_main(rank, barrier, decided):
    from eplb_fsm.liveness import Liveness
    from eplb_fsm.trace import EventTrace
    trace = EventTrace(rank, 2, D)
    trace.set_context(state="collecting", step=0)
    trace.header({"a": 1}, run_id="feedfacefeedface", mode="sync", device="cpu", group="ep",
                 transfer_group="ep_transfer")
    live = Liveness(trace, 1.0).start()
    step = 0
    while True:
        barrier.wait(60)                 # the engine's all-reduce: a frozen peer blocks this rank
        if decided.value:
            break
        trace.set_context(step=step)
        trace.count_step()
        step += 1
        time.sleep(0.01)
    live.stop()
    trace.end("closed")
    trace.close()

def events(rank):
    with open(D / f"rank{rank:05d}.jsonl") as fh:
        return [json.loads(line)["event"] for line in fh if line.strip()]

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    stop, decided = ctx.Event(), ctx.Value("b", 0)
    def decide():                        # run once per barrier, before anyone leaves it: both ranks read alike
        decided.value = 1 if stop.is_set() else 0
    barrier = ctx.Barrier(2, action=decide)
    procs = [ctx.Process(target=rank_main, args=(r, barrier, decided)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(D / "rank00000.jsonl") or "alive" not in events(0):
            assert time.monotonic() < deadline, "rank 0 never beat"
            time.sleep(0.01)
        seen = len(events(0))
        while "steps" not in events(0)[seen:]:   # rank 0's next write of its run: it moves at its next beats
            assert time.monotonic() < deadline, "rank 0 never wrote its run"
            time.sleep(0.002)
        time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(FREEZE)
        written = len(events(1))         # nothing comes from a stopped rank
        os.kill(procs[1].pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while len(events(1)) == written:   # rank 1 runs on: its next record ends the silence, not its `end`
            assert time.monotonic() < deadline, "rank 1 wrote nothing after its SIGCONT"
            time.sleep(0.01)
        stop.set()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(10)
    print(json.dumps([p.exitcode for p in procs]))
'''


@pytest.mark.multiprocess
def test_a_rank_sigstopped_while_its_peer_waits_on_it_is_frozen(tmp_path):
    """Two real rank processes coupled step by step; rank 1 SIGSTOPped for 2.8 s right after rank 0 wrote its run
    (rank 0's beat cycle at its worst): replay names rank 1 frozen, from rank 0's alive records inside the gap."""
    from eplb_fsm.inspect import replay_dir

    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", FREEZE_PEER, str(tmp_path), "2.8"], capture_output=True,
                         text=True, timeout=180, env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1]) == [0, 0], out.stderr[-2000:]
    report = replay_dir(tmp_path)
    assert report.verdict == "frozen" and report.culprit_ranks == [1], report.summary
    assert float(report.summary.split("froze for ")[1].split(" s")[0]) >= 2.8
