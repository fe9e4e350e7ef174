"""A launcher SIGKILLed and left a zombie (its parent does not reap it) still takes its ranks down.

``kill(pid, 0)`` succeeds on a zombie, so a rank that only asked that kept serving until the
launcher's parent waited on it. The test is that parent: it SIGKILLs the launcher and does not
wait on it until every rank has ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import eplb_fsm

pytestmark = pytest.mark.multiprocess

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the launcher and its ranks

# the ranks' body: note the pid, then serve (sleep) until stopped
RANKS_MODULE = '''
import os, time
from pathlib import Path

def serve(rank, world_size, out):
    Path(out, f"rank{rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)
'''

LAUNCHER = '''
import sys
from eplb_fsm.sim.launcher import run_ranks
import zombie_ranks
run_ranks(zombie_ranks.serve, 2, (sys.argv[1],), timeout=300.0)
'''


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a rank that ended, not yet reaped by its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def _wait_for(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def launch(tmp_path: Path, module: str, ranks_code: str, launcher_code: str) -> tuple[subprocess.Popen, list[int]]:
    """Write the ranks' ``module``, start ``launcher_code`` in a session of its own, and return it with the pids of
    its two ranks once both wrote them (the session is killed if they never do)."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(ranks_code))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, str(tmp_path)], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    if not _wait_for(lambda: all(f.exists() and f.read_text() for f in pid_files), 180.0):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        pytest.fail("the ranks never started")
    return launcher, [int(f.read_text()) for f in pid_files]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_ranks_end_when_launcher_is_an_unreaped_zombie(tmp_path):
    """Ranks of a SIGKILLed launcher that its parent has not reaped (a zombie) end on their own."""
    launcher, ranks = launch(tmp_path, "zombie_ranks", RANKS_MODULE, LAUNCHER)
    try:
        assert all(_running(pid) for pid in ranks)
        os.kill(launcher.pid, signal.SIGKILL)
        # not waited on: the launcher stays a zombie for as long as the ranks are watched
        assert _wait_for(lambda: not _running(launcher.pid), 30.0)
        ended = _wait_for(lambda: not any(_running(pid) for pid in ranks), 60.0)
        assert Path(f"/proc/{launcher.pid}/stat").exists(), "the launcher was reaped before the ranks were checked"
        assert ended, f"ranks {[p for p in ranks if _running(p)]} still serve after their launcher died"
    finally:
        for pid in ranks:   # each rank leads its own process group (signals.install)
            if _running(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signal.SIGKILL)   # its session: forkserver, resource tracker
        launcher.wait(30)
        for pid in ranks:
            _wait_for(lambda: not _running(pid), 30.0)
        assert not any(_running(pid) for pid in ranks)
