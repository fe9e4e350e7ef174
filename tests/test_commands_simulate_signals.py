"""``eplb-fsm simulate`` stopped by a real SIGTERM / SIGINT: the documented exit code, wherever the signal lands.

Each test runs the command in its own Python process and sends the signal from outside
(``os.kill``), at a point the child announces: while it draws the PNG, while it replays its
traces, or while a rank process is being started. The child only blocks at that point (or,
for the start, sends the signal at the exact moment a real Ctrl-C can land); the signal, its
handlers and the processes are real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

RUN = ["simulate", "--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "4", "--hidden", "8",
       "--tokens", "32", "--steps", "10", "--interval", "4", "--window", "4", "--no-progress"]

# the child: `module.attr` replaced by a function that touches MARKER, then waits (the signal ends the wait)
_BLOCKING_CHILD = """
import os, signal, sys, time, importlib
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the test runner ignores it
module, attr, marker, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
target = importlib.import_module(module)

def blocked(*args, **kwargs):
    open(marker, "w").close()
    end = time.monotonic() + 120
    while time.monotonic() < end:  # the test's signal arrives here
        time.sleep(0.05)
    raise AssertionError("no signal came")

setattr(target, attr, blocked)
from eplb_fsm.cli import main
sys.exit(main(argv))
"""


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 240.0) -> None:
    """Until ``path`` exists (the child reached its point), the child exits, or ``limit`` s pass."""
    end = time.monotonic() + limit
    while not path.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)


# each stage once and each signal once (the signal -> exit code mapping is one function for every stage: the
# other two pairs of the cross product would run two more simulations to prove nothing more)
@pytest.mark.parametrize("stage, module, attr, extra, sig, code", [
    ("plot", "eplb_fsm.sim.plot", "plot_balancedness", [], signal.SIGTERM, 143),
    ("replay", "eplb_fsm.inspect.replay", "replay_dir", ["--no-png", "--inject", "die:rank=1,step=3"],
     signal.SIGINT, 130),
])
def test_a_signal_after_the_ranks_finished_still_stops_the_command(tmp_path, stage, module, attr, extra, sig, code):
    """SIGTERM while the PNG is drawn, SIGINT while the traces are replayed: 143 / 130, not swallowed as a note."""
    marker = tmp_path / "reached"
    argv = [*RUN, *extra, "--trace-dir", str(tmp_path / "traces")]
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKING_CHILD, module, attr, str(marker), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker, proc)
        assert marker.exists(), f"the run never reached the {stage}: {proc.communicate(timeout=60)}"
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == code, (out, err)
    assert f"interrupted by {signal.Signals(sig).name}" in err and "Traceback" not in err, err
    assert "eplb-fsm replay" in err  # every rank wrote its trace before the signal: replay is the next step


# the child: a real SIGINT sent to itself at the moment Process.start() has handed the new process
# to the forkserver but not yet read back its pid, where a Ctrl-C from the terminal can land too
_START_CHILD = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the test runner ignores it
import multiprocessing.forkserver as forkserver
import multiprocessing.popen_forkserver as popen_forkserver

argv = sys.argv[1:]
real_launch, real_read = popen_forkserver.Popen._launch, forkserver.read_signed
state = {"launches": 0, "armed": False}

def launch(self, process_obj):
    state["launches"] += 1
    state["armed"] = state["launches"] == int(os.environ.get("ARM_LAUNCH", "2"))  # by default the second start
    try:
        return real_launch(self, process_obj)
    finally:
        state["armed"] = False

def read_signed(fd):
    if state["armed"]:  # the child is being made: its data is written, its pid not read yet
        state["armed"] = False
        os.kill(os.getpid(), signal.SIGINT)
    return real_read(fd)

popen_forkserver.Popen._launch = launch
forkserver.read_signed = read_signed
from eplb_fsm.cli import main
sys.exit(main(argv))
"""


@pytest.mark.parametrize("launcher", ["fixed", "elastic"])
def test_ctrl_c_while_a_rank_starts_leaves_no_child_behind_and_no_traceback(tmp_path, launcher):
    """SIGINT inside a rank's start (the fixed-size and the elastic launcher): exit 130, no child traceback or stack
    dump on the terminal, no replay hint for a folder without traces."""
    traces = tmp_path / "traces"
    scale = ["--scale", "6:3"] if launcher == "elastic" else []
    env = {**os.environ, "ARM_LAUNCH": "1" if launcher == "elastic" else "2"}   # elastic: its first start
    proc = subprocess.Popen([sys.executable, "-c", _START_CHILD, *RUN, *scale, "--no-png", "--trace-dir", str(traces)],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # EOF on both pipes: every process that holds them (the ranks, the forkserver) has exited too
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "interrupted by SIGINT" in err
    assert "Traceback" not in err and "FileNotFoundError" not in err, err  # no child failing to start
    assert "eplb-signals" not in out and "eplb-signals" not in err, out  # no stopped rank's stacks either
    written = [p for p in traces.glob("*.jsonl") if p.stat().st_size]
    assert ("eplb-fsm replay" in err) == bool(written), (written, err)


@pytest.mark.parametrize("sig, name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_a_signal_whose_exception_was_swallowed_is_still_seen(sig, name):
    """interruptible(): a Ctrl-C or SIGTERM whose exception code below swallowed (a controller turns an interrupt
    inside a rearrangement into its fault) is still in the list it yields (a late SIGINT let bench replay run to
    the end, exit 0); the handlers are restored after."""
    from eplb_fsm.commands.simulate import interruptible

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interruptible() as fired:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(1.0)   # the handler runs here, at the latest
        except BaseException:   # what the code under the command might do
            pass
    assert [signal.Signals(s).name for s in fired] == [name]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
