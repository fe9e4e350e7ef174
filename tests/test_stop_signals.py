"""stop_signals: a rank that asked for it ends its traces with ``how: signal`` on SIGTERM, then dies by it.

The real cases run real processes: a process blocked in its main thread gets a real SIGTERM, and two
gloo ranks run an engine loop under torchrun (``python -m torch.distributed.run``), where one rank is
SIGKILLed (torchrun then SIGTERMs the other) or torchrun itself is SIGTERMed (it stops both). Replay
must name the killed rank in the first case and read a stop from outside in the second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import torchrun_job

from eplb_fsm import stop_signals
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

WAIT_S = 90.0   # the bound on every wait here; only a hang reaches it


@pytest.mark.parametrize("signals, match", [
    ([], "signals must name at least one signal"),
    (3, "signals must be a list of signals"),
    (["SIGTERM"], r"signals must hold signal numbers \(signal.SIGTERM, ...\), got 'SIGTERM'"),
    ([True], "signals must hold signal numbers"),
    ([signal.SIGKILL], "signals: SIGKILL cannot be taken"),
    ([signal.SIGSEGV], "signals: SIGSEGV cannot be taken"),
    ([99999], "signals: 99999 is no signal of this platform"),
])
def test_bad_signals_are_refused_naming_the_rule(signals, match):
    """An empty list, a non-list, a name, a bool, SIGKILL, SIGSEGV or an unknown number: ValueError, nothing set."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match=match):
        stop_signals.end_traces_on_signal(signals)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_process_with_threads_is_refused_before_anything_changes():
    """Called once another thread exists (one started here): ValueError naming the count, nothing changed."""
    import threading

    release = threading.Event()
    other = threading.Thread(target=release.wait, args=(WAIT_S,), daemon=True)
    other.start()
    try:
        assert stop_signals.thread_count() > 1
        before = (signal.getsignal(signal.SIGTERM), signal.pthread_sigmask(signal.SIG_BLOCK, []))
        with pytest.raises(ValueError, match=r"before any other thread starts \(this process has \d+ threads\)"):
            stop_signals.end_traces_on_signal()
        assert (signal.getsignal(signal.SIGTERM), signal.pthread_sigmask(signal.SIG_BLOCK, [])) == before
        with pytest.raises(ValueError, match="stacks must be a bool"):
            stop_signals.end_traces_on_signal(stacks=1)
    finally:
        release.set()
        other.join(WAIT_S)


SECOND_CALL = """
import signal
from eplb_fsm.stop_signals import end_traces_on_signal
end_traces_on_signal()
end_traces_on_signal()   # the same arguments: nothing to do
for args in [((signal.SIGTERM, signal.SIGHUP),), ((signal.SIGTERM,), False)]:
    try:
        end_traces_on_signal(*args)
        print("accepted")
    except ValueError as exc:
        print(exc)
"""


def test_a_second_call_with_other_arguments_is_refused():
    """Once installed, the same call does nothing; another signal set (SIGHUP added, whose number is True's) or
    stacks=False is a ValueError, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", SECOND_CALL], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["end_traces_on_signal was already called with other signals or stacks "
                                        "(once per process)"] * 2, done.stdout


BLOCKED = """
import sys, time
from eplb_fsm.stop_signals import end_traces_on_signal
end_traces_on_signal()
import torch   # after the call: the thread torch starts inherits the blocked mask
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1])
trace.set_context(state="collecting", step=7)
trace.header({"num_layers": 1}, run_id="stopsignals00001", mode="sync", group="ep", transfer_group="ep_transfer")
print("ready", flush=True)
time.sleep(3600)   # the main thread blocked in a C call: a Python signal handler would not run here
"""


@pytest.mark.multiprocess
def test_sigterm_to_a_blocked_process_ends_its_trace_and_kills_it_by_sigterm(tmp_path):
    """The main thread sleeps in C; SIGTERM: the trace ends how=signal SIGTERM, stacks go to stderr, exit -15."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    end = read_trace(tmp_path / "rank00000.jsonl")[0][-1]
    assert (end["event"], end["how"], end["signal"], end["step"]) == ("end", "signal", "SIGTERM", 7)
    sleep_line = next(i for i, line in enumerate(BLOCKED.split("\n"), 1) if line.startswith("time.sleep"))
    assert "eplb-signals: SIGTERM received" in err, err
    # where the main thread stood: in its sleep, or, on a loaded machine, still on the line that said "ready"
    assert any(f'File "<string>", line {n} in <module>' in err for n in (sleep_line, sleep_line - 1)), err


ENGINE = """
import os, sys, time
from eplb_fsm.stop_signals import end_traces_on_signal
end_traces_on_signal()   # first thing: before torch starts any thread
import torch.distributed as dist
from eplb_fsm import EplbConfig, EplbController
from eplb_fsm.sim.model import ToyMoE

trace_dir, pid_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = ToyMoE(num_layers=2, num_experts=8, num_redundant=2, hidden=8, rank=rank, world_size=world)
config = EplbConfig(window_size=4, step_interval=6, num_redundant_experts=2, collective_timeout_s=30.0)
with EplbController(config, group=dist.group.WORLD, device="cpu", trace_dir=trace_dir) as ctl:
    ctl.add_model(model, "main")
    for step in range(100000):
        model.forward(model.make_batch(step, 16), dist.group.WORLD)   # the engine's own collective
        ctl.step()
        if step == 20:   # a rearrangement or two behind it: the test may stop the job now
            with open(os.path.join(pid_dir, f"{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.path.join(pid_dir, f"{rank}.tmp"), os.path.join(pid_dir, str(rank)))
        # from step 20 an engine idle between batches: a stop lands outside any collective
        time.sleep(0.02 if step < 20 else 2.0)
"""


def _torchrun_job(tmp_path: Path, stop) -> tuple[Path, int, str]:
    """Two gloo ranks of ENGINE under torchrun; once both passed step 20, ``stop(pids, launcher)``; then wait."""
    return torchrun_job(tmp_path, ENGINE, lambda pids, launcher, _: stop(pids, launcher))


@pytest.mark.multiprocess
def test_a_rank_sigkilled_under_torchrun_is_named_and_the_rank_torchrun_stopped_is_its_consequence(tmp_path):
    """Rank 1 SIGKILLed mid-run; torchrun SIGTERMs rank 0 within its 0.1 s monitor interval, which writes end
    how=signal: rank_died, rank 1 (without end_traces_on_signal every trace just stopped: 'healthy')."""
    traces, code, out = _torchrun_job(tmp_path, lambda pids, _: os.kill(pids[1], signal.SIGKILL))
    assert code != 0, out
    end = read_trace(traces / "rank00000.jsonl")[0][-1]
    assert (end["event"], end.get("how"), end.get("signal")) == ("end", "signal", "SIGTERM"), (end, out[-3000:])
    assert read_trace(traces / "rank00001.jsonl")[0][-1]["event"] != "end"
    report = replay_dir(traces)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [1]), format_report(report)
    assert any(c.startswith("rank 0 was stopped by SIGTERM") for c in report.consequences), format_report(report)


@pytest.mark.multiprocess
def test_torchrun_stopped_from_outside_reads_signalled_on_every_rank(tmp_path):
    """SIGTERM to torchrun: it stops both ranks, each writes end how=signal: signalled, ranks 0-1, no death."""
    traces, code, out = _torchrun_job(tmp_path, lambda _, launcher: launcher.send_signal(signal.SIGTERM))
    assert code != 0, out
    report = replay_dir(traces)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)
    assert not [f for f in report.findings if f.kind == "rank_died"], format_report(report)


@pytest.mark.multiprocess
def test_a_rank_sigtermed_from_outside_under_torchrun_is_the_one_named(tmp_path):
    """SIGTERM to rank 1 alone: its end records a sender that is not its parent, torchrun then stops rank 0 (sender:
    its parent): signalled, rank 1 only, rank 0 a consequence (was: signalled, ranks 0-1)."""
    traces, code, out = _torchrun_job(tmp_path, lambda pids, _: os.kill(pids[1], signal.SIGTERM))
    assert code != 0, out
    ends = {r: read_trace(traces / f"rank{r:05d}.jsonl")[0][-1] for r in (0, 1)}
    assert ends[1]["sender"] == {"pid": os.getpid(), "parent": False}, ends
    assert ends[0]["sender"]["parent"] is True, ends
    report = replay_dir(traces)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [1]), format_report(report)
    assert any(c.startswith("rank 0 was stopped by SIGTERM from its launcher") for c in report.consequences)
