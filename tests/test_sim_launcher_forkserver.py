"""The forkserver dies under the launcher: the ranks still get their grace, and the report says what happened.

``timeout`` and batch schedulers signal a job's process group, not one process. That group holds the
launcher and its forkserver (each rank leads a group of its own). The forkserver dies at once, and
from then on multiprocessing reports every rank as ended (exit code 255) while the ranks still run
their signal thread: a stop that believed it went straight to SIGKILL, and a rank slower than a few
milliseconds (a joiner that had just started) lost its ``end`` record and replayed as dead. A forkserver
killed on its own (the OOM killer, a stray ``kill``) read as every rank having died.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_sim_launcher_zombie import _running, _wait_for, launch

import eplb_fsm
from eplb_fsm.commands.simulate_report import format_report

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")]

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the launcher and its ranks

# the ranks' body: on SIGTERM take half a second (a busy rank's signal thread), then say so in a file
RANKS_MODULE = '''
import os, time
from pathlib import Path
from eplb_fsm.sim import signals

def serve(rank, world_size, out):
    def slow_end(name):
        time.sleep(0.5)
        Path(out, f"rank{rank}.ended").write_text(name)
    signals.on_signal(slow_end)
    Path(out, f"rank{rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)
'''

# a launcher that turns SIGTERM into an exception, as `eplb-fsm simulate` does, so run_ranks stops the ranks
LAUNCHER = '''
import signal, sys
from eplb_fsm.sim.launcher import run_ranks
import group_ranks

def stop(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, stop)
run_ranks(group_ranks.serve, 2, (sys.argv[1],), timeout=300.0)
'''

SIMULATE = ["-m", "eplb_fsm.cli", "simulate", "--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "4",
            "--hidden", "8", "--tokens", "32", "--steps", "100000", "--interval", "20", "--no-progress", "--no-png"]


def _last_step(path: Path) -> int:
    """The step of the last whole line of a rank's trace (-1: none yet)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = path.read_text().splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                return int(json.loads(line).get("step", -1))
    return -1


def _simulate_until_step_30(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, list[Path], list[int]]:
    """`eplb-fsm simulate` in a session of its own, once both ranks wrote step 30: (process, trace folder, trace
    files, rank pids); stdout piped (``--json``: the report) or dropped."""
    traces = tmp_path / "traces"
    sim = subprocess.Popen([sys.executable, *SIMULATE, "--trace-dir", str(traces), *extra],
                           env=dict(os.environ, PYTHONPATH=ROOT), cwd=tmp_path, start_new_session=True,
                           stdout=subprocess.PIPE if extra else subprocess.DEVNULL, stderr=subprocess.PIPE)
    files = [traces / f"rank{r:05d}.jsonl" for r in (0, 1)]
    if not _wait_for(lambda: all(_last_step(f) >= 30 for f in files), 240.0):
        _stop_session(sim, [])
        pytest.fail("the ranks never reached step 30")
    return sim, traces, files, [json.loads(f.read_text().splitlines()[0])["pid"] for f in files]


def _stop_session(proc: subprocess.Popen, pids: list[int]) -> None:
    """No orphans: the ranks' groups and the launcher's session are killed, the launcher reaped."""
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    for pid in pids:
        _wait_for(lambda: not _running(pid), 30.0)


def test_a_group_sigterm_leaves_each_rank_its_grace(tmp_path):
    """SIGTERM to the launcher's process group (forkserver included): each rank's slow signal callback completes."""
    launcher, ranks = launch(tmp_path, "group_ranks", RANKS_MODULE, LAUNCHER)
    try:
        os.killpg(launcher.pid, signal.SIGTERM)   # the launcher and its forkserver, not the ranks' own groups
        launcher.wait(60)
        ended = {r: (tmp_path / f"rank{r}.ended").read_text() if (tmp_path / f"rank{r}.ended").exists() else None
                 for r in (0, 1)}
        assert ended == {0: "SIGTERM", 1: "SIGTERM"}, f"a rank was killed inside its grace: {ended}"
        assert not any(_running(pid) for pid in ranks)
    finally:
        _stop_session(launcher, ranks)


def test_simulate_stopped_through_its_process_group_replays_as_signalled(tmp_path):
    """`eplb-fsm simulate` sent SIGTERM as a group: every trace ends `how=signal`, replay reads `signalled`."""
    sim, traces, files, ranks = _simulate_until_step_30(tmp_path)
    try:
        os.killpg(sim.pid, signal.SIGTERM)
        _, err = sim.communicate(timeout=120)
        assert sim.returncode == 143, err.decode(errors="replace")[-2000:]
        for f in files:
            last = json.loads(f.read_text().splitlines()[-1])
            assert (last["event"], last.get("how"), last.get("signal")) == ("end", "signal", "SIGTERM"), (f, last)
        replay = subprocess.run([sys.executable, "-m", "eplb_fsm.cli", "replay", str(traces)],
                                env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
        assert replay.stdout.startswith("signalled:"), replay.stdout
        assert "died" not in replay.stdout, replay.stdout
    finally:
        _stop_session(sim, ranks)


def _forkserver_of(pid: int) -> int | None:
    """The pid of the multiprocessing forkserver that process ``pid`` started, if any."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid \
                    and b"multiprocessing.forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes():
                return int(entry)
    return None


def test_a_forkserver_killed_alone_is_told_as_such_not_as_dead_ranks(tmp_path):
    """SIGKILL to simulate's forkserver alone: the ranks are stopped with their ends, reported `lost`, not `died`."""
    sim, traces, files, ranks = _simulate_until_step_30(tmp_path, "--json")
    try:
        server = _forkserver_of(sim.pid)
        assert server is not None, "no forkserver found under simulate"
        os.kill(server, signal.SIGKILL)
        out, err = sim.communicate(timeout=120)
        assert sim.returncode == 1, err.decode(errors="replace")[-2000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report["error"] == "forkserver_died", report
        assert [e["status"] for e in report["ranks"]] == ["lost", "lost"] and report["failed_ranks"] == [], report
        text = format_report(report)
        assert "the forkserver the rank processes came from died" in text and "caused by" not in text, text
        for f in files:   # stopped by the launcher, each with its end
            last = json.loads(f.read_text().splitlines()[-1])
            assert (last["event"], last.get("how")) == ("end", "signal"), (f, last)
        assert not any(_running(pid) for pid in ranks)
    finally:
        _stop_session(sim, ranks)
