"""Shared test settings: hypothesis profile sized for a 2-core CI machine; temporary files under pytest's own
root; a 1-rank gloo group; a TCP store; hand-written trace records; a real torchrun job."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from eplb_fsm.sim.launcher import find_free_port

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytest(tmp_path_factory):
    """Folders made with tempfile (``simulate`` keeps its traces in one when no --trace-dir is given) go under
    pytest's temporary root, which pytest prunes, instead of staying in /tmp; subprocesses inherit TMPDIR."""
    root = str(tmp_path_factory.mktemp("tmp"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = root, root
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group in this process, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def store():
    """A TCP store on a free port with a namespace of its own (its StoreInfo); waits up to 30 s."""
    from eplb_fsm.transfer.groups import host_store

    master, info = host_store(timeout_s=30.0, namespace=f"t{uuid.uuid4().hex[:8]}")
    yield info
    del master


def timeline(rank: int, world: int, t0: float, events: list[tuple[float, str, dict]], **defaults) -> list[dict]:
    """One rank's hand-written records from (t, event, fields): ts ``t0 + t``, seq in order, ``defaults`` (e.g.
    state, step) under each record's own fields. For replay rules on a few records; whole jobs use SyntheticJob."""
    out = []
    for seq, (t, event, fields) in enumerate(events):
        out.append({"ts": round(t0 + t, 6), "rank": rank, "world": world, "event": event, **defaults, "seq": seq,
                    **fields})
    return out


TORCHRUN_WAIT_S = 90.0   # the bound on every wait of a torchrun job; only a hang reaches it


def torchrun_job(tmp_path: Path, engine: str, stop, args: tuple = (), env: dict | None = None,
                 ranks: int = 2) -> tuple[Path, int, str]:
    """``ranks`` gloo ranks of the script ``engine`` under torchrun (``python -m torch.distributed.run``, 0.1 s monitor
    interval), run as ``engine TRACES PIDS *args``; each rank writes its pid as PIDS/<rank> when it wants the test
    to act. Once all did, ``stop(pids, launcher, traces)``; then wait for torchrun to end (if it did not,
    its process group and each worker are SIGKILLed). Returns (traces folder, torchrun's exit code, its output)."""
    script, traces, pids = tmp_path / "engine.py", tmp_path / "traces", tmp_path / "pids"
    script.write_text(textwrap.dedent(engine))
    traces.mkdir()
    pids.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "--monitor-interval", "0.1", str(script), str(traces), str(pids), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **(env or {})})
    def written() -> dict[int, int]:   # a rank writes <rank>.tmp, then renames it: only whole files count
        return {int(p.name): int(p.read_text()) for p in pids.iterdir() if not p.name.endswith(".tmp")}

    try:
        deadline = time.monotonic() + TORCHRUN_WAIT_S
        while len(written()) < ranks and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher.poll() is None and len(written()) == ranks, "the ranks did not reach the test's step"
        stop(written(), launcher, traces)
        out, _ = launcher.communicate(timeout=TORCHRUN_WAIT_S)
    finally:
        if launcher.poll() is None:   # torchrun's workers lead sessions of their own: each is killed by its pid
            workers = list(written().values())
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(TORCHRUN_WAIT_S)
            for pid in workers:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
    return traces, launcher.returncode, out
