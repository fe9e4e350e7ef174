"""The simulator's rank loop (eplb_fsm.sim.run) against real OS errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_progress_file_the_os_refuses_does_not_stop_the_ranks(tmp_path):
    """Rank 0's progress file cannot be written (its temp name is a directory: a real IsADirectoryError, as a full
    disk gives ENOSPC): the run still ends healthy and bit-exact, and rank 0's log says so once."""
    traces = tmp_path / "traces"
    (traces / "progress" / "rank00000.tmp").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-m", "eplb_fsm", "simulate", "--ranks", "2", "--layers", "2", "--experts", "8",
         "--redundant", "4", "--hidden", "8", "--tokens", "32", "--steps", "30", "--interval", "10", "--window", "5",
         "--no-png", "--no-progress", "--trace-dir", str(traces)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "weights bit-exact: yes" in out.stdout and "maps agree on every rank: yes" in out.stdout
    log = (traces / "rank00000.log").read_text()
    assert log.count("progress file") == 1 and "IsADirectoryError" in log and "runs on without it" in log
    assert (traces / "progress" / "rank00001.json").exists()   # the other rank's file is written as before
