"""``eplb-fsm bench`` stopped by SIGTERM or Ctrl-C unwinds: its temporary folder is removed, exit 143 / 130.

Before, SIGTERM ended the process where it stood and ``bench replay`` left its traces (hundreds
of MB at the default size) in the temporary folder. Each test runs a real benchmark process at a
tiny shape with ``TMPDIR`` pointed at a folder of its own, signals it once the benchmark's
temporary folder has something in it, and checks that folder is empty afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eplb_fsm

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test

# long enough to be caught mid-run (tens of seconds), small enough to stay a few MB
REPLAY = ["replay", "--ranks", "2", "--steps", "200000", "--interval", "100", "--long-steps", "0", "--repeats", "1"]
STEP = ["step", "--layers", "2", "--slots", "8", "--experts", "8", "--window", "10", "--steps", "200000",
        "--rounds", "50"]


def _default_sigint() -> None:
    # a test run in the background inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _started(tmp: Path, prefix: str) -> bool:
    """True once a folder named ``prefix*`` in ``tmp`` holds a file: the benchmark is writing."""
    return any(p.is_file() for d in tmp.glob(prefix + "*") for p in d.rglob("*"))


def _stop_mid_run(tmp_path: Path, argv: list[str], prefix: str, sig: int) -> tuple[int, str, list[str]]:
    """Run ``eplb-fsm bench ARGV`` with TMPDIR in ``tmp_path``, send ``sig`` once it writes there;
    returns (exit status, stderr, what is left in its TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "eplb_fsm", "bench", *argv], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        end = time.monotonic() + 120.0
        while not _started(tmp, prefix) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert proc.poll() is None, "the benchmark ended before it could be stopped"
        assert _started(tmp, prefix), f"no {prefix}* folder with a file appeared in {tmp}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return proc.returncode, err, sorted(p.name for p in tmp.iterdir())


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_bench_replay_stopped_mid_run_removes_its_traces(tmp_path, sig, code):
    """bench replay signalled while it writes its traces removes its temporary folder and exits 128 + signal."""
    rc, err, left = _stop_mid_run(tmp_path, REPLAY, "eplb-bench-replay-", sig)
    assert rc == code, err
    assert f"eplb-fsm bench replay: interrupted by {signal.Signals(sig).name}" in err, err
    assert left == [], f"left behind in TMPDIR: {left}"


def test_bench_step_stopped_by_sigterm_removes_its_trace_folder(tmp_path):
    """bench step (no --trace-dir) SIGTERMed mid-run removes its temporary trace folder and exits 143."""
    rc, err, left = _stop_mid_run(tmp_path, STEP, "eplb-bench-step-", signal.SIGTERM)
    assert rc == 143, err
    assert "eplb-fsm bench step: interrupted by SIGTERM" in err, err
    assert left == [], f"left behind in TMPDIR: {left}"
