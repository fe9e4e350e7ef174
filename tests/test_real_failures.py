"""Real failures of real rank processes: SIGKILL and SIGSTOP at chosen points, and what the traces show.

Each scenario runs ``eplb-fsm simulate`` (through ``eplb_fsm.cli.main``) on 2-3 gloo rank
processes with ``--inject kill:...`` or ``freeze:...``, which send REAL signals (SIGKILL to
itself; SIGSTOP/SIGCONT from a helper process). The assertions read the traces the ranks
left: a killed rank has no ``end`` record and its last record is ``fault_injected``; the
ranks stopped as a consequence end with ``end`` (closed, exception or signal); a frozen rank's
``alive`` records have a gap as long as the freeze while its peers' show what they wait on.

Replay's verdict is asserted through one small interface (:func:`verdict`): the culprit
rank and step must be the rank that was killed or frozen, never the ranks that waited.

Shape (small, so the file stays well under 90 s on 2 cores): 3 layers, 8 + 4 slots,
interval 8 (rearrangements due at steps 1, 9, 17), collective timeout 2 s.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eplb_fsm.cli import main
from eplb_fsm.inspect.endings import CONNECTION_LOST
from eplb_fsm.trace import read_trace, record_steps

pytestmark = pytest.mark.multiprocess

BASE = ["--layers", "3", "--experts", "8", "--redundant", "4", "--hidden", "8", "--tokens", "48",
        "--interval", "8", "--window", "8", "--collective-timeout", "2", "--no-png", "--no-progress", "--json"]


_RUNS: dict[tuple, tuple[int, dict, Path]] = {}


def simulate(factory, ranks: int, mode: str, steps: int, *extra: str) -> tuple[int, dict, Path]:
    """Run one scenario once per session (its traces and replay are asserted by several tests)."""
    key = (ranks, mode, steps, *extra)
    if key not in _RUNS:
        log_dir = factory.mktemp("sim")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["simulate", *BASE, "--ranks", str(ranks), "--steps", str(steps), "--mode", mode,
                         "--log-dir", str(log_dir), *extra])
        _RUNS[key] = (code, json.loads(out.getvalue().strip().splitlines()[-1]), log_dir)
    return _RUNS[key]


def traces(log_dir: Path) -> dict[str, list[dict]]:
    return {p.name: read_trace(p)[0] for p in sorted(Path(log_dir).glob("rank*.jsonl"))}


def verdict(log_dir: Path) -> tuple[str, list[int], int | None]:
    """Replay's (verdict, culprit ranks, step): the one interface these tests assert replay through."""
    from eplb_fsm.inspect.replay import replay_dir

    rep = replay_dir(str(log_dir))
    return rep.verdict, sorted(rep.culprit_ranks), rep.step


def ending(records: list[dict]) -> dict | None:
    return records[-1] if records and records[-1]["event"] == "end" else None


def assert_killed(recs: list[dict], spec: str) -> dict:
    """The victim's trace stops at its fault_injected record: no `end`, nothing after."""
    assert not any(r["event"] == "end" for r in recs)
    last = recs[-1]
    assert last["event"] == "fault_injected" and last["kind"] == "kill" and last["spec"] == spec
    return last


# -- SIGKILL ---------------------------------------------------------------------------------------

# (mode, ranks, spec, extra args, victim, states the victim may be in, step replay must name, replay marks)
# async step 6: the rearrangement due at step 1 may still be moving layers in the background
KILLS = [
    pytest.param("sync", 2, "kill:rank=1,step=5", [], 1, {"collecting"}, 5, (), id="kill-collecting-sync"),
    pytest.param("async", 3, "kill:rank=2,step=6", [], 2, {"collecting", "transferring"}, 6, (),
                 id="kill-step-async"),
    # async: the step after a due step starts in planning (states change only inside controller.step)
    pytest.param("async", 2, "kill:rank=1,step=2", [], 1, {"planning"}, 2, (), id="kill-planning-async"),
    pytest.param("sync", 2, "kill:rank=0,step=9,layer=1", [], 0, {"transferring"}, 9, (), id="kill-layer-sync"),
    # a leaving rank killed at layer 1 of the scale-down's transfer (the survivors' scale fails: experts lost)
    pytest.param("sync", 3, "kill:rank=2,step=12,layer=1", ["--scale", "12:2"], 2, {"transferring"}, 12, (),
                 id="kill-leaving-rank-in-scale"),
    # a joiner of the scale-up at step 8 killed at its first step in the new group
    # (a generous --join-timeout: a loaded machine may take seconds to start the joiner process;
    # and a generous collective timeout: with BASE's 2 s, a joiner slow to reach its first
    # steps on a loaded machine made the others time out while it still lived, and the
    # launcher rightly called it stopped, not died; its kill closes its sockets, which the
    # others see at once whatever the timeout)
    pytest.param("sync", 2, "kill:rank=2,step=9", ["--scale", "8:3", "--join-timeout", "30",
                                                   "--collective-timeout", "20"], 2, {"collecting"}, 9,
                 (), id="kill-joiner-after-switch"),
]


@pytest.mark.parametrize("mode,ranks,spec,extra,victim,state,step,replay_marks", KILLS)
def test_sigkill_leaves_a_trace_without_end(tmp_path_factory, mode, ranks, spec, extra, victim, state, step,
                                            replay_marks):
    """A SIGKILLed rank's trace has no `end`; every other rank ends with one; the run fails naming the victim."""
    code, report, tmp_path = simulate(tmp_path_factory, ranks, mode, 24, "--inject", spec, *extra)
    assert code == 1 and not report["ok"] and report.get("inject_unfired") == []
    # the launcher's report names the victim (a joiner too, with its process id) as died
    died = [e for e in report["ranks"] if e["rank"] == victim and e["status"] == "died"]
    # on failure: which status and reason the launcher gave each process instead
    assert len(died) == 1 and victim in report["failed_ranks"], \
        "; ".join(f"{e['process']} {e['status']}: {e['reason']} (last {e['last_event']} at {e['last_step']})"
                  for e in report["ranks"])
    assert died[0]["role"] == ("joiner" if victim >= ranks else "initial")
    recs = traces(tmp_path)
    victim_file = f"rank{victim:05d}.g1.jsonl" if victim >= ranks else f"rank{victim:05d}.jsonl"  # a joiner's own file
    fired = assert_killed(recs[victim_file], spec)
    assert fired["state_at"] in state and fired["at_step"] >= int(spec.split("step=")[1].split(",")[0])
    heads = [r for rs in recs.values() for r in rs if r["event"] == "header"]
    assert len({h["run_id"] for h in heads}) == 1  # one run, one id in every header
    for name, rs in recs.items():
        if name != victim_file:
            # an orderly ending of its own (closed after a failed scale, an exception, the launcher's SIGTERM)
            assert ending(rs) is not None, name


@pytest.mark.parametrize("mode,ranks,spec,extra,victim,state,step,replay_marks", [
    pytest.param(*p.values[:-1], (), marks=p.values[-1], id=p.id) for p in KILLS])
def test_replay_names_the_killed_rank(tmp_path_factory, mode, ranks, spec, extra, victim, state, step,
                                      replay_marks):
    """Replay's culprit is the killed rank, at the step it died, never a rank stopped because of it."""
    code, _, tmp_path = simulate(tmp_path_factory, ranks, mode, 24, "--inject", spec, *extra)
    assert code == 1
    kind, culprits, at = verdict(tmp_path)
    assert kind != "healthy" and culprits == [victim]
    assert at is not None and step - 2 <= at <= step


# -- SIGSTOP ---------------------------------------------------------------------------------------


def _alive(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "alive"]


def _silence_after(recs: list[dict], fired: dict) -> float:
    """The longest time without any record of this rank from ``fired`` on (its other threads may
    write a line or two while the helper process starts)."""
    ts = [r["ts"] for r in recs if r["seq"] >= fired["seq"]]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


FREEZE_COLLECTING = "freeze:rank=1,step=5,seconds=3"
FREEZE_TRANSFER = "freeze:rank=1,step=9,seconds=4,layer=1"


def test_sigstop_while_collecting_shows_an_alive_gap(tmp_path_factory):
    """Frozen 3 s at step 5: the victim writes nothing for >= 2.5 s; its peer's alive records show it waiting."""
    spec = FREEZE_COLLECTING
    code, report, tmp_path = simulate(tmp_path_factory, 2, "sync", 24, "--inject", spec)
    assert report.get("inject_unfired") == []
    recs = traces(tmp_path)
    victim, peer = recs["rank00001.jsonl"], recs["rank00000.jsonl"]
    fired = next(r for r in victim if r["event"] == "fault_injected")
    assert fired["kind"] == "freeze" and fired["at_step"] == 5
    # nothing at all from the victim while it was stopped (its threads stop too)
    assert _silence_after(victim, fired) >= 2.5
    # the peer, meanwhile, kept writing alive records that name the collective it waits in
    waiting = [r for r in _alive(peer) if fired["ts"] < r["ts"] < fired["ts"] + 3 and r["waiting_on"]]
    assert waiting and all(r["waiting_on"]["group"] == "engine" for r in waiting)
    # both ranks finished in order: the freeze ended, nothing died
    assert ending(victim)["how"] == ending(peer)["how"] == "closed"
    assert code in (0, 1)  # 1 once replay reports the freeze (see the replay test below)


@pytest.mark.parametrize("mode,spec", [("sync", FREEZE_COLLECTING), ("async", FREEZE_TRANSFER)],
                         ids=["collecting-sync", "transfer-async"])
def test_replay_names_the_frozen_rank(tmp_path_factory, mode, spec):
    """Replay names the rank that was frozen, not the one that waited on it."""
    _, _, log_dir = simulate(tmp_path_factory, 2, mode, 24, "--inject", spec)
    kind, culprits, _ = verdict(log_dir)
    assert kind != "healthy" and culprits == [1]


def test_sigstop_during_an_async_transfer_aborts_consistently(tmp_path_factory):
    """Frozen 4 s before layer 1's transfer (async, timeout 2 s): the peer gives up, nobody dies."""
    spec = FREEZE_TRANSFER
    code, report, tmp_path = simulate(tmp_path_factory, 2, "async", 24, "--inject", spec)
    assert report.get("inject_unfired") == []
    recs = traces(tmp_path)
    victim = recs["rank00001.jsonl"]
    fired = next(r for r in victim if r["event"] == "fault_injected")
    assert fired["state_at"] == "transferring" and fired["layer"] == 1
    # frozen until the peer gave up (2 s) and the launcher then stopped it (SIGCONT + SIGTERM), or to the end of its
    # 4 s: over the frozen limit either way
    assert _silence_after(victim, fired) >= 2.5, (_silence_after(victim, fired), fired)
    # no rank was killed: every trace ends with `end`
    assert all(ending(rs) is not None for rs in recs.values())
    # the peer gave up on the frozen rank: its controller's fault, or, when the engine's own all-reduce on the same
    # gloo group failed first (a posted collective's timeout closes the group's pairs), that failure as its end
    peer = recs["rank00000.jsonl"]
    faults = [r for r in peer if r["event"] == "transition" and r.get("trigger") == "fault"]
    assert faults or "timeout" in str(ending(peer).get("error")).lower(), ending(peer)


# -- signals from outside, without --inject (what an operator's world does) -------------------------


def _run_in_thread(argv: list[str]) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def body() -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            box["code"] = main(argv)
        box["out"] = out.getvalue()

    thread = threading.Thread(target=body, name="simulate", daemon=True)
    thread.start()
    return thread, box


@contextlib.contextmanager
def _reaped(thread: threading.Thread, pids: list[int]):
    """On the way out, SIGKILL what is left of each rank in ``pids`` (filled in inside the block; ranks run in
    process groups of their own), then give simulate's ``thread`` 30 s to end."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        thread.join(30)


def test_sigkill_from_outside_while_collecting(tmp_path):
    """An external SIGKILL to rank 1's pid (from its header) mid-run: no `end` for it, the run fails naming it."""
    argv = ["simulate", *BASE, "--ranks", "2", "--steps", "100000", "--interval", "100000", "--mode", "sync",
            "--log-dir", str(tmp_path), "--timeout", "120"]
    thread, box = _run_in_thread(argv)
    pids: list[int] = []
    with _reaped(thread, pids):
        deadline = time.monotonic() + 60
        while _steps_written(tmp_path, 2) < 30:
            assert thread.is_alive() and time.monotonic() < deadline, "the ranks did not get going within 60 s"
            time.sleep(0.05)
        pids += _rank_pids(tmp_path)
        os.kill(pids[1], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "simulate did not end within 60 s of the kill"
    report = json.loads(box["out"].strip().splitlines()[-1])
    assert box["code"] == 1 and 1 in report["failed_ranks"]
    assert next(e for e in report["ranks"] if e["rank"] == 1)["status"] == "died"
    recs = traces(tmp_path)
    assert ending(recs["rank00001.jsonl"]) is None and not any(
        r["event"] in ("end", "fault_injected") for r in recs["rank00001.jsonl"])
    assert ending(recs["rank00000.jsonl"])["how"] in ("exception", "signal")
    _RUNS["outside-kill"] = (box["code"], report, tmp_path)


def test_replay_names_a_rank_killed_from_outside():
    """Replay names rank 1 (killed from outside, no injector, untraced engine collectives), not healthy."""
    if "outside-kill" not in _RUNS:
        pytest.skip("the outside-kill run did not complete")
    kind, culprits, _ = verdict(_RUNS["outside-kill"][2])
    assert kind != "healthy" and culprits == [1]


def test_a_hung_job_stopped_at_its_deadline_is_replayed_as_the_hang(tmp_path_factory):
    """Rank 1 stalls its layer-2 transfer; the run's deadline SIGTERMs both ranks: replay names rank 1's hang."""
    from eplb_fsm.sim.launcher import run_ranks

    # the launcher's forkserver (it imports torch once: seconds on a loaded machine) is up before the timed run:
    # its ranks then start in a fork, and rank 1 stalls ~1 s in (the first rearrangement, due at step 1)
    assert run_ranks(_rank_and_world, 2, timeout=60) == [(0, 2), (1, 2)]
    # the deadline must come at least one liveness interval (1 s) after rank 0 began waiting, or replay rightly
    # reads a collective in flight (signalled): 10 s leaves room for a cold start of the ranks on a busy machine
    code, report, log_dir = simulate(tmp_path_factory, 2, "sync", 24, "--inject", "stall-layer:rank=1,layer=2",
                                     "--collective-timeout", "60", "--timeout", "10")
    assert code == 1 and report["error"] == "timeout"
    # the real signal reached the ranks before any collective timed out: each ended by it, or (the stalled rank
    # signalled first, as a launcher may) its wait failed on the connection that rank's exit closed, just before
    # its own signal came
    ends = [ending(rs) for rs in traces(log_dir).values()]
    assert any(e["how"] == "signal" for e in ends), ends
    assert all(e["how"] == "signal" or CONNECTION_LOST.search(str(e.get("error"))) for e in ends), ends
    assert (report["replay"]["verdict"], report["replay"]["culprit_ranks"]) == ("hang", [1])
    assert verdict(log_dir)[:2] == ("hang", [1])


def _open_wait(log_dir: Path, rank: int, op: str) -> dict | None:
    """``rank``'s collective_start of ``op`` that has no end record yet (None: none on disk)."""
    path = Path(log_dir) / f"rank{rank:05d}.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    starts = [r for r in recs if r["event"] == "collective_start" and r.get("op") == op]
    ended = {(r.get("group"), r.get("cseq")) for r in recs if r["event"] in ("collective_end", "collective_error")}
    return starts[-1] if starts and (starts[-1]["group"], starts[-1]["cseq"]) not in ended else None


def test_the_stalled_rank_stopped_first_is_the_hang_though_its_peers_wait_then_fails(tmp_path):
    """SIGTERM to the stalled rank 1, then to rank 0 once its wait failed on the closed socket: still rank 1's hang."""
    argv = ["simulate", *BASE, "--ranks", "2", "--steps", "24", "--mode", "sync", "--inject",
            "stall-layer:rank=1,layer=2", "--collective-timeout", "60", "--timeout", "120", "--log-dir", str(tmp_path)]
    thread, _ = _run_in_thread(argv)
    pids: list[int] = []
    with _reaped(thread, pids):
        deadline = time.monotonic() + 60
        # rank 0 has waited in the stalled transfer for over one liveness interval (1 s): a hang, not one in flight
        while (w := _open_wait(tmp_path, 0, "batch_isend_irecv")) is None or time.time() - w["ts"] < 1.5:
            assert thread.is_alive() and time.monotonic() < deadline, "rank 0 did not wait in the transfer in 60 s"
            time.sleep(0.05)
        pids += _rank_pids(tmp_path)
        os.kill(pids[1], signal.SIGTERM)   # the order a launcher may signal in: the stalled rank first
        while _open_wait(tmp_path, 0, "batch_isend_irecv") is not None:   # its exit closes rank 0's connection
            assert time.monotonic() < deadline + 30, "rank 0's wait did not fail once rank 1 was gone"
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGTERM)
        thread.join(60)
        assert not thread.is_alive(), "simulate did not end within 60 s of the signals"
    recs = traces(tmp_path)
    assert ending(recs["rank00001.jsonl"])["how"] == "signal"
    # rank 0 left the transfer with an error, then ended: by the signal or by giving up, whichever came first
    assert any(r["event"] == "collective_error" and r.get("op") == "batch_isend_irecv" for r in recs["rank00000.jsonl"])
    assert ending(recs["rank00000.jsonl"])["how"] in ("signal", "exception")
    assert verdict(tmp_path)[:2] == ("hang", [1])


# -- the launcher's own truth ----------------------------------------------------------------------


def test_an_injection_that_never_fires_fails_the_run(tmp_path_factory):
    """kill at layer 0 from step 20 on, with no rearrangement after step 17: reported unfired, exit 1."""
    spec = "kill:rank=1,step=20,layer=0"
    code, report, tmp_path = simulate(tmp_path_factory, 2, "sync", 24, "--inject", spec)
    assert code == 1 and not report["ok"]
    assert report["inject_unfired"] == [spec]
    assert all(ending(rs)["how"] == "closed" for rs in traces(tmp_path).values())


def _rank_and_world(rank: int, world: int) -> tuple[int, int]:
    return rank, world


def _rank_pids(log_dir: Path) -> list[int]:
    return [r["pid"] for rs in traces(log_dir).values() for r in rs if r["event"] == "header"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _steps_written(log_dir: Path, ranks: int) -> int:
    counts = []
    for r in range(ranks):
        path = Path(log_dir) / f"rank{r:05d}.jsonl"
        # steps on disk: one per `step` record, `count` per `steps` run (issue 14's compact form)
        counts.append(sum(len(record_steps(r)) for r in read_trace(path)[0]) if path.is_file() else 0)
    return min(counts)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_to_simulate_stops_every_rank(tmp_path, sig, code):
    """SIGTERM / Ctrl-C to `eplb-fsm simulate`: every rank process stops, each trace ends how=signal, exit 143/130."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "eplb_fsm", "simulate", *BASE[:-1], "--ranks", "2", "--steps", "100000",
           "--log-dir", str(tmp_path), "--timeout", "120"]
    # as in an operator's terminal: Ctrl-C is not ignored, even when this test runs under a
    # shell's background job (which ignores SIGINT, and children inherit that)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while _steps_written(tmp_path, 2) < 3:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the ranks did not start within 60 s"
            time.sleep(0.1)
        pids = _rank_pids(tmp_path)
        assert len(pids) == 2
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err.decode()[-2000:]
        assert str(tmp_path) in err.decode()  # where the traces are
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids)
        # no orphan appends: the traces are final, and each says it ended by a signal
        sizes = {p: p.stat().st_size for p in Path(tmp_path).glob("rank*.jsonl")}
        time.sleep(0.5)
        assert sizes == {p: p.stat().st_size for p in Path(tmp_path).glob("rank*.jsonl")}
        for rs in traces(tmp_path).values():
            assert ending(rs) == {**ending(rs), "how": "signal", "signal": "SIGTERM"}
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:  # ranks run in process groups of their own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)


# -- a rank late past the collective timeout (its engine stalls, its process never stops) -------------------------

# the stall is 4 timeouts and twice replay's clock noise (2 s): the start ts spread is unambiguous
LATE_TIMEOUT_S, LATE_STALL_S = 1.0, 4.0


def _late_rank(rank: int, world: int, trace_dir: str, recover: bool) -> str:
    """Rank 1's engine sleeps before its step 2; rank 0 reaches the due all-reduce and times out waiting in it.
    ``recover``: both ranks then recover onto a new group and run on."""
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=world)
    config = EplbConfig(window_size=4, step_interval=8, num_redundant_experts=4, collective_timeout_s=LATE_TIMEOUT_S)
    ctl = EplbController(config, group=dist.group.WORLD, trace_dir=trace_dir)
    ctl.add_model(model, "main")
    for step in range(12):
        if rank == 1 and step == 2:
            time.sleep(LATE_STALL_S)
        model.forward(model.make_batch(step, 48))
        ctl.step()
    if recover and ctl.state == "failed":
        ctl.recover(group=dist.new_group(list(range(world))))
        for step in range(12, 14):
            model.forward(model.make_batch(step, 48))
            ctl.step()
    state = ctl.state
    ctl.close()
    return state


def _late_run(factory, recover: bool) -> tuple[list[str], dict[int, list[dict]], object]:
    """One real run per session and flag: (final states, the records by rank, replay_dir's report)."""
    from eplb_fsm.inspect.replay import diagnose, replay_dir
    from eplb_fsm.sim.launcher import run_ranks

    key = ("late", recover)
    if key not in _RUNS:
        log_dir = factory.mktemp("late")
        states = run_ranks(_late_rank, 2, args=(str(log_dir), recover), timeout=120)
        _RUNS[key] = (states, {r: read_trace(log_dir / f"rank{r:05d}.jsonl")[0] for r in range(2)},
                      replay_dir(log_dir))
    states, records, report = _RUNS[key]
    # the in-memory diagnosis of the same records says the same
    again = diagnose(copy.deepcopy(records))
    assert (again.verdict, again.culprit_ranks, again.aborted) == (report.verdict, report.culprit_ranks,
                                                                  report.aborted)
    return states, copy.deepcopy(records), report


def test_a_rank_late_past_the_collective_timeout_is_the_culprit(tmp_path_factory):
    """Rank 1 stalls 4 s, the timeout is 1 s, both ranks end failed: replay names rank 1 (lagging), rank 0 waited."""
    from eplb_fsm.inspect.render import format_report

    states, _, report = _late_run(tmp_path_factory, recover=False)
    assert states == ["failed", "failed"]
    assert (report.verdict, report.culprit_ranks) == ("lagging", [1]), format_report(report)
    assert report.collective["group"] == "ep" and "rank 1 came late to all_reduce" in report.summary
    assert any(c.startswith("rank 0 gave up waiting") for c in report.consequences)
    (aborted,) = report.aborted
    assert aborted["late_ranks"] == [1] and "no rank was late" not in aborted["text"]


def _shifted(records: dict[int, list[dict]], alive: bool) -> dict[int, list[dict]]:
    """Rank 1's start of the failed all-reduce moved to 1 s after rank 0's (within clock noise); ``alive``: keep
    the alive records (rank 1's show it at a lower step while rank 0 waited), else drop every rank's (a silence
    while a peer writes alive records would read as a freeze)."""
    def failed_start(r: int) -> dict:
        return next(x for x in records[r] if x["event"] == "collective_start" and any(
            e["event"] == "collective_error" and e["cseq"] == x["cseq"] and e["group"] == x["group"]
            for e in records[r]))

    failed_start(1)["ts"] = failed_start(0)["ts"] + 1.0
    if not alive:
        records = {r: [x for x in recs if x["event"] != "alive"] for r, recs in records.items()}
    return records


def test_a_start_spread_within_clock_noise_names_nobody_without_alive_evidence(tmp_path_factory):
    """The failed run with rank 1's start moved 1 s after rank 0's: by the alive records alone rank 1 is still
    late; with those dropped too, nothing shows lateness and the verdict stays `failed` on both ranks."""
    from eplb_fsm.inspect.replay import diagnose

    _, records, _ = _late_run(tmp_path_factory, recover=False)
    by_alive = diagnose(_shifted(records, alive=True))
    assert (by_alive.verdict, by_alive.culprit_ranks) == ("lagging", [1])
    assert "alive records show it at step" in by_alive.summary and "started it" not in by_alive.summary
    _, records, _ = _late_run(tmp_path_factory, recover=False)
    neither = diagnose(_shifted(records, alive=False))
    assert (neither.verdict, neither.culprit_ranks) == ("failed", [0, 1])


def test_a_late_rank_the_job_recovered_from_is_named_in_the_healthy_verdict(tmp_path_factory):
    """Rank 1 stalls 4 s (timeout 1 s), both recover onto a new group: healthy, the rollback names rank 1 as late."""
    from eplb_fsm.inspect.render import format_report

    states, _, report = _late_run(tmp_path_factory, recover=True)
    assert states == ["collecting", "collecting"]
    assert report.verdict == "healthy", format_report(report)
    assert [(f.kind, f.culprits) for f in report.handled] == [("lagging", [1])]
    (aborted,) = report.aborted
    assert aborted["late_ranks"] == [1] and aborted["text"].endswith("after the first rank")


def _strike(argv: list[str], log_dir: Path, victim, sig: int) -> dict:
    """Run simulate (``argv``), poll ``victim()`` every 2 ms until it gives a pid, send it ``sig``, and wait for the
    run to end; returns its exit code and output (``code``, ``out``)."""
    thread, box = _run_in_thread(argv)
    pids: list[int] = []
    with _reaped(thread, pids):
        deadline = time.monotonic() + 90
        while (pid := victim()) is None:
            assert thread.is_alive() and time.monotonic() < deadline, "the moment to strike did not come in 90 s"
            time.sleep(0.002)
        os.kill(pid, sig)
        pids += _rank_pids(log_dir)
        thread.join(60)
        assert not thread.is_alive(), "simulate did not end within 60 s of the signal"
    return box


def _joiner_transferring(log_dir: Path) -> int | None:
    """The joiner's pid once its trace shows it moving its scale's layers and not switched yet (None before)."""
    path = Path(log_dir) / "rank00002.g1.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    triggers = {r.get("trigger") for r in recs if r["event"] == "transition"}
    assert "switched" not in triggers, "the joiner's scale switched before it could be killed in its transfer"
    if "plan_ready" in triggers:
        return next(r["pid"] for r in recs if r["event"] == "header")
    return None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_joiner_killed_in_its_scale_is_named_not_the_ranks_the_launcher_stopped_after(tmp_path, sig):
    """A signal to the joiner moving its scale's layers: the old ranks roll the scale back and serve on until the
    launcher's SIGTERM; replay names the joiner, not them. SIGKILL: it died (its peers lost their connection to it;
    was: signalled, ranks 0-1). SIGTERM: it was signalled, the old ranks' later SIGTERMs are consequences (was:
    signalled, ranks 0-2)."""
    # 12 layers: the joiner's transfer lasts long enough for a 2 ms poll of its trace to catch it
    argv = ["simulate", *BASE, "--layers", "12", "--ranks", "2", "--steps", "100000", "--scale", "30:3",
            "--join-timeout", "30", "--collective-timeout", "20", "--mode", "sync", "--log-dir", str(tmp_path),
            "--timeout", "120"]
    box = _strike(argv, tmp_path, lambda: _joiner_transferring(tmp_path), sig)
    report = json.loads(box["out"].strip().splitlines()[-1])
    recs = traces(tmp_path)
    joiner_end = ending(recs["rank00002.g1.jsonl"])
    assert box["code"] == 1 and (joiner_end is None if sig == signal.SIGKILL else joiner_end["how"] == "signal")
    joiner_last = recs["rank00002.g1.jsonl"][-1]["ts"]
    # the scale never switched; the old ranks (rolled back and serving, or still waiting in the scale, or left
    # failed by a split agreement: docs/elastic.md) were stopped by the launcher well after the joiner went, or,
    # when the joiner went after a layer had moved to it (the rollback lost those experts: `failed`), closed
    for name in ("rank00000.jsonl", "rank00001.jsonl"):
        triggers = [r.get("trigger") for r in recs[name] if r["event"] == "transition"]
        assert "switched" not in triggers, triggers
        end, lost = ending(recs[name]), any(r["event"] == "scale_aborted" and "experts lost" in r.get("reason", "")
                                            for r in recs[name])
        assert (end["how"] == "signal" and end["ts"] - joiner_last > 1.0) or \
            (lost and end["how"] == "closed" and end["state"] == "failed"), end
    kind, culprits, _ = verdict(tmp_path)
    assert culprits == [2] and report["replay"]["culprit_ranks"] == [2], (kind, report["replay"])
    assert (kind == "signalled") == (sig == signal.SIGTERM), kind


def _joiner_started(log_dir: Path) -> int | None:
    """The joiner's pid once its trace's header is on disk (None before)."""
    path = Path(log_dir) / "rank00002.g1.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    return next((r["pid"] for r in recs if r["event"] == "header"), None)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_joiner_killed_before_its_first_collective_is_named_not_the_old_ranks(tmp_path, sig):
    """The joiner signalled as soon as its header is written: its generation holds no one else, so the ranks that
    waited for it are those of the generation before. SIGKILL: it died (was: signalled, ranks 0-1, in 1 of 2 runs,
    then in 3 of 6 a red team ran: the old ranks' tick fell after the launcher's SIGTERM). SIGTERM: it alone was
    signalled, the old ranks' SIGTERMs 1.5 s later are the launcher's reaction (was: signalled, ranks 0-2)."""
    argv = ["simulate", *BASE, "--ranks", "2", "--steps", "100000", "--scale", "30:3", "--join-timeout", "30",
            "--collective-timeout", "20", "--mode", "sync", "--log-dir", str(tmp_path), "--timeout", "120"]
    box = _strike(argv, tmp_path, lambda: _joiner_started(tmp_path), sig)
    report = json.loads(box["out"].strip().splitlines()[-1])
    joiner = traces(tmp_path)["rank00002.g1.jsonl"]
    # a SIGTERM's end comes from the joiner's signal thread, once it has the GIL: its main thread may have opened
    # its first collective by then (a CI run: 0.4 ms before its end), but never finished one
    assert box["code"] == 1 and not any(r["event"] in ("collective_end", "collective_error") for r in joiner), \
        "it got through a collective"
    kind, culprits, _ = verdict(tmp_path)
    if sig == signal.SIGKILL:
        # its death, or (the old ranks were in a collective of the scale it never joined) the hang it left, with its
        # death as the first detail
        assert ending(joiner) is None and kind in ("rank_died", "hang") and culprits == [2], (kind, culprits)
    else:
        assert ending(joiner)["how"] == "signal" and (kind, culprits) == ("signalled", [2]), (kind, culprits)
    assert report["replay"]["culprit_ranks"] == [2], report["replay"]


def _in_state(log_dir: Path, rank: int, state: str, after_step: int) -> int | None:
    """``rank``'s pid once its last record on disk is in ``state`` past ``after_step`` (None before)."""
    path = Path(log_dir) / f"rank{rank:05d}.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    if recs and recs[-1].get("state") == state and (recs[-1].get("step") or 0) > after_step:
        return next(r["pid"] for r in recs if r["event"] == "header")
    return None


def test_a_rank_sigtermed_in_a_transfer_is_the_one_the_aborted_rearrangement_names(tmp_path):
    """SIGTERM to rank 2 moving a layer: the others roll back; the aborted rearrangement names rank 2 alone, not a
    rank that started the collective a few ms after the first (was: rank 1, 'started ... 0.0 s after')."""
    argv = ["simulate", *BASE, "--layers", "12", "--ranks", "3", "--steps", "100000", "--collective-timeout", "20",
            "--mode", "sync", "--log-dir", str(tmp_path), "--timeout", "120"]
    _strike(argv, tmp_path, lambda: _in_state(tmp_path, 2, "transferring", 20), signal.SIGTERM)
    from eplb_fsm.inspect.replay import replay_dir

    report = replay_dir(str(tmp_path))
    assert (report.verdict, report.culprit_ranks) == ("signalled", [2]), report.summary
    # the layer it was moving when signalled (its machine's, as its trace left it; was: none in a signalled verdict)
    last = read_trace(Path(tmp_path) / "rank00002.jsonl")[0][-1]
    if last.get("state") == "transferring":
        assert report.state == "transferring" and type(report.layer) is int, (report.state, report.layer)
    assert report.aborted, report.summary
    for entry in report.aborted:
        assert entry["late_ranks"] == [2] and "rank 2 was stopped by SIGTERM" in entry["text"], entry
        assert entry["late_by_s"] is None or entry["late_by_s"] > 2.0, entry


def test_a_rank_killed_while_a_peer_is_frozen_is_named_too(tmp_path):
    """Rank 1 frozen (4 s), rank 2 SIGKILLed 1 s into it while waiting for rank 1: the freeze is the verdict and
    rank 2's death stays a finding of its own, naming rank 2 (was: folded into rank 1's hang as if gloo had aborted
    it)."""
    argv = ["simulate", *BASE, "--ranks", "4", "--steps", "100000", "--interval", "100000", "--collective-timeout",
            "20", "--inject", "freeze:rank=1,step=40,seconds=4", "--mode", "sync", "--log-dir", str(tmp_path),
            "--timeout", "120"]
    seen: list[float] = []

    def rank_2_once_rank_1_froze() -> int | None:
        recs = read_trace(Path(tmp_path) / "rank00001.jsonl")[0] if (Path(tmp_path) / "rank00001.jsonl").is_file() \
            else []
        if not any(r["event"] == "fault_injected" for r in recs):
            return None
        seen.append(time.monotonic())
        if seen[-1] - seen[0] < 1.0:
            return None
        return next(r["pid"] for r in read_trace(Path(tmp_path) / "rank00002.jsonl")[0] if r["event"] == "header")

    _strike(argv, tmp_path, rank_2_once_rank_1_froze, signal.SIGKILL)
    from eplb_fsm.inspect.replay import replay_dir

    report = replay_dir(str(tmp_path))
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), report.summary
    # its death alone, or told by the collective it died in, with the death as that finding's first detail: when
    # rank 1, continued, failed that all-reduce on the dead peer before the launcher's SIGTERM reached it, every
    # other rank left it with an error (1 CI run of many; replay reads the same from traces rewritten so)
    own = [f for f in report.findings if f.culprits == [2]]
    assert own and (own[0].kind == "rank_died" or (own[0].kind == "hang" and own[0].details[0].startswith(
        "rank 2 died"))), report.summary


def test_a_freeze_the_job_got_past_is_not_the_cause_of_a_later_kill(tmp_path_factory):
    """Rank 2 SIGSTOPped 4 s, the job goes on with it, then rank 0 is SIGKILLed: replay names rank 0, and the freeze
    stays a later finding (was: `frozen`, rank 2, with the peers' connection resets charged to it)."""
    code, report, log_dir = simulate(tmp_path_factory, 3, "sync", 30, "--collective-timeout", "10", "--inject",
                                     "freeze:rank=2,step=9,seconds=4", "--inject", "kill:rank=0,step=13")
    recs = traces(log_dir)
    frozen_at = next(r["ts"] for r in recs["rank00002.jsonl"] if r["event"] == "fault_injected")
    # the job got past the freeze: rank 2 finished a collective it started after the SIGCONT, before the kill
    killed_at = recs["rank00000.jsonl"][-1]["ts"]
    assert any(r["event"] == "collective_end" and frozen_at + 3.5 < r["ts"] - r["duration_s"] and r["ts"] < killed_at
               for r in recs["rank00002.jsonl"]), "rank 2 did not go on before rank 0 was killed"
    from eplb_fsm.inspect.replay import replay_dir

    rep = replay_dir(str(log_dir))
    assert code == 1 and rep.culprit_ranks == [0] and rep.verdict in ("hang", "rank_died"), rep.summary
    assert any(f.kind == "frozen" and f.culprits == [2] for f in rep.findings[1:]), [f.kind for f in rep.findings]
