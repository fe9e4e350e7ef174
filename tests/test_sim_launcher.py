"""The multi-process launcher: results by rank, failures and timeouts raised, no process left behind."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

from eplb_fsm.sim.launcher import RankFailedError, RanksTimeoutError, find_free_port, run_ranks

pytestmark = pytest.mark.multiprocess


def _sum_ranks(rank: int, world: int, offset: int) -> tuple:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, world, int(t), dist.get_backend(), os.getpid()


def _fail_on_rank_1(rank: int, world: int, pid_dir: str) -> int:
    import torch.distributed as dist

    _write_pid(pid_dir, rank)
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 waits here until rank 1's exit breaks the barrier or the launcher stops it
    return rank


def _sleep_on_rank_1(rank: int, world: int, pid_dir: str) -> int:
    _write_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def _exit_early_while_rank_0_sleeps(rank: int, world: int, pid_dir: str) -> int:
    _write_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # gone without a report, as after an OOM kill or a segfault
    time.sleep(60)  # busy, in no collective with rank 1: only the launcher can end it early
    return rank


def _write_pid(pid_dir: str, rank: int) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))


def _assert_gone(pid_dir: str, within: float = 5.0) -> None:
    pids = [int(open(os.path.join(pid_dir, f)).read()) for f in os.listdir(pid_dir) if f.endswith(".pid")]
    assert pids
    deadline = time.monotonic() + within
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process {pid} still alive"
            time.sleep(0.05)


def test_returns_values_by_rank_after_a_collective():
    """Each rank joins one gloo group; values come back in rank order with the args applied."""
    out = run_ranks(_sum_ranks, 3, args=(10,), timeout=60)
    assert [o[:4] for o in out] == [(r, 3, 33, "gloo") for r in range(3)]
    assert len({o[4] for o in out}) == 3 and os.getpid() not in {o[4] for o in out}


def test_a_failing_rank_raises_and_stops_the_others(tmp_path):
    """A rank that raises surfaces as RankFailedError with its traceback; the blocked rank is killed."""
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="boom on rank 1") as info:
        run_ranks(_fail_on_rank_1, 2, args=(str(tmp_path),), timeout=60)
    assert 1 in info.value.failures and "KeyError" in info.value.failures[1]
    assert time.monotonic() - t0 < 30
    _assert_gone(str(tmp_path))


def test_timeout_kills_stragglers(tmp_path):
    """A rank still running at the deadline is killed and RanksTimeoutError names it."""
    _forkserver_up()
    t0 = time.monotonic()
    with pytest.raises(RanksTimeoutError) as info:
        # the deadline also covers the ranks' start (seconds on a loaded machine): both must have written a pid
        run_ranks(_sleep_on_rank_1, 2, args=(str(tmp_path),), timeout=5.0)
    assert 1 in info.value.pending
    assert time.monotonic() - t0 < 20
    _assert_gone(str(tmp_path))


def _slow_exit(rank: int, world: int, flag_dir: str) -> int:
    from multiprocessing import util

    from eplb_fsm.sim import signals

    def noted(name: str) -> None:  # the launcher's stop reached this rank
        open(os.path.join(flag_dir, f"signalled-{rank}"), "w").close()

    signals.on_signal(noted)
    util.Finalize(None, time.sleep, args=(0.5,), exitpriority=100)  # still exiting after it reported
    return rank


def test_ranks_that_reported_exit_on_their_own(tmp_path):
    """After every rank reported, a rank still in its exit path is let finish, not sent SIGTERM."""
    assert run_ranks(_slow_exit, 2, args=(str(tmp_path),), timeout=30) == [0, 1]
    assert os.listdir(tmp_path) == []


def test_a_rank_that_dies_is_reported():
    """A rank that exits without reporting (os._exit) is a failure with its exit code."""
    with pytest.raises(RankFailedError, match="exited with code 3"):
        run_ranks(_exit_on_rank_0, 2, timeout=30)


def test_a_rank_that_dies_silently_stops_the_others(tmp_path):
    """A rank gone without a report fails the call at once and the busy rank is stopped, not awaited for 60 s."""
    # the deadline (30 s) is before the sleeper's end: waiting on the sleeper would be a RanksTimeoutError
    with pytest.raises(RankFailedError, match="exited with code 3") as info:
        run_ranks(_exit_early_while_rank_0_sleeps, 2, args=(str(tmp_path),), timeout=30)
    assert list(info.value.failures) == [1] and info.value.values == {}
    _assert_gone(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fn=None, world_size=2), "fn: must be callable"),
        (dict(fn=_sum_ranks, world_size=0), "world_size: must be a positive int"),
        (dict(fn=_sum_ranks, world_size=2, timeout=0), "timeout: must be a finite number of seconds > 0"),
        # NaN passed `> 0` checks written the other way round, inf failed only once the ranks were up
        (dict(fn=_sum_ranks, world_size=2, timeout=float("nan")), "timeout: must be a finite number .* got nan"),
        (dict(fn=_sum_ranks, world_size=2, timeout=float("inf")), "timeout: must be a finite number .* got inf"),
    ],
)
def test_bad_arguments(kwargs, match):
    """Bad launcher arguments raise ValueError before anything starts."""
    with pytest.raises(ValueError, match=match):
        run_ranks(**kwargs)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0])
def test_elastic_launcher_refuses_a_timeout_before_any_process(timeout):
    """run_elastic checks its deadline like run_ranks: a ValueError naming timeout, before the store or a process."""
    from types import SimpleNamespace

    from eplb_fsm.sim.elastic_launcher import run_elastic

    opts = SimpleNamespace(extra={}, ranks=2, steps=10, experts=4, redundant=4)  # no store could be built from it
    with pytest.raises(ValueError, match="^timeout: must be a finite number of seconds > 0"):
        run_elastic(opts, timeout=timeout)


def test_free_port_is_bindable():
    """find_free_port returns a port that can be bound right away."""
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- issue 12: process groups, signal endings, real freezes -----------------------------------------


def _blocked_rank_notes_its_signal(rank: int, world: int, note_dir: str) -> int:
    """Rank 1 raises; rank 0 blocks in a C++ wait that only the signal thread can interrupt.

    The wait is one on the group's store, hosted by rank 0 itself: a gloo collective would not do, since rank 1's
    exit ends it at once ("Connection closed by peer") and rank 0 would then exit on its own, racing the signal.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from eplb_fsm.sim import signals

    def note(name: str) -> None:
        with open(os.path.join(note_dir, f"{rank}.signal"), "w") as fh:
            fh.write(name)

    signals.on_signal(note)
    if rank == 1:
        time.sleep(0.5)
        raise KeyError("boom on rank 1")
    dist.distributed_c10d._get_default_store().wait(["never set"], timedelta(seconds=50))
    return rank


def test_a_rank_blocked_in_a_torch_distributed_wait_runs_its_signal_callbacks_when_stopped(tmp_path):
    """The launcher's SIGTERM reaches a rank blocked in a C++ wait: its callback runs, then it exits."""
    with pytest.raises(RankFailedError, match="boom on rank 1") as failed:
        run_ranks(_blocked_rank_notes_its_signal, 2, args=(str(tmp_path),), timeout=60)
    assert sorted(failed.value.failures) == [1]   # rank 0 did not fail on its own: it was still waiting
    assert (tmp_path / "0.signal").read_text() == "SIGTERM"


def _rank_with_a_child(rank: int, world: int, pid_dir: str) -> int:
    """Each rank starts a long `sleep` child (like a freeze helper), then rank 1 hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(pid_dir, f"child{rank}.pid"), "w") as fh:
        fh.write(str(child.pid))
    if rank == 1:
        time.sleep(120)
    return rank


def test_stopping_a_rank_stops_what_it_started(tmp_path):
    """Ranks run in process groups of their own: the launcher's stop also ends their children."""
    _forkserver_up()
    with pytest.raises(RanksTimeoutError):
        run_ranks(_rank_with_a_child, 2, args=(str(tmp_path),), timeout=5.0)   # both ranks start their child first
    deadline = time.monotonic() + 10
    for name in ("child0.pid", "child1.pid"):
        pid = int((tmp_path / name).read_text())
        while True:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().split(")")[-1].split()[0] in ("Z", "X"):
                        break
            except FileNotFoundError:
                break
            assert time.monotonic() < deadline, f"child {pid} of a stopped rank is still running"
            time.sleep(0.05)


def _forkserver_up() -> None:
    """Start the launcher's forkserver before a run with a short deadline: it imports torch once (seconds on a loaded
    2-core machine), and a rank then starts in a fork and a rendezvous (~0.25 s)."""
    assert [v[:3] for v in run_ranks(_sum_ranks, 2, args=(0,), timeout=60)] == [(0, 2, 1), (1, 2, 1)]


def _frozen_rank_reports_the_wall_time(rank: int, world: int) -> tuple:
    """freeze_self(1): a real SIGSTOP/SIGCONT from a helper; the rank sees its wall clock jump."""
    import signal as sig

    from eplb_fsm.sim import signals

    t0 = time.monotonic()
    signals.freeze_self(1)
    return time.monotonic() - t0, os.getpgid(0) == os.getpid(), sig.SIGTERM in sig.pthread_sigmask(sig.SIG_BLOCK, [])


def test_freeze_self_stops_the_process_for_the_given_time():
    """A frozen rank is away for >= the freeze; it leads its own process group; SIGTERM is left to the signal thread."""
    (away, leads, blocked), = run_ranks(_frozen_rank_reports_the_wall_time, 1, timeout=60)
    assert away >= 0.9 and leads and blocked


def test_rank_failed_error_names_every_failed_rank():
    """The message carries the first rank's traceback and one line for each other failed rank."""
    err = RankFailedError({1: "Traceback ...\nRuntimeError: Connection reset", 0: "process exited with code 3"})
    assert err.first == 1 and "Connection reset" in str(err)
    assert "rank 0: process exited with code 3" in str(err)


def test_interpreter_watch_dumps_stacks_when_no_python_thread_runs(tmp_path):
    """A C call that holds the GIL for longer than the watch's timeout: faulthandler's thread writes the stacks."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from eplb_fsm.sim import signals\n"
        "signals.watch_interpreter(0.5, period_s=0.1)\n"
        "time.sleep(0.3)\n"
        "def hold_the_gil():\n"
        "    import re\n"
        "    re.match(r'(a+)+$', 'a' * 26 + 'b')  # catastrophic backtracking in C, GIL held\n"
        "hold_the_gil()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Timeout" in out.stdout and "hold_the_gil" in out.stdout


@pytest.mark.parametrize("timeout_s, period_s", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.0)])
def test_interpreter_watch_refuses_a_timeout_not_above_its_period(timeout_s, period_s):
    """timeout_s must exceed period_s > 0 (else it would fire between re-arms); the error names both."""
    from eplb_fsm.sim import signals

    with pytest.raises(ValueError, match="timeout_s > period_s > 0"):
        signals.watch_interpreter(timeout_s, period_s)


def test_log_to_sends_stdout_to_the_file_and_starts_the_watch(tmp_path):
    """log_to: the process's stdout (fd 1, what structlog prints to) lands in the file; the watch thread runs."""
    import subprocess
    import sys

    path = tmp_path / "logs" / "rank00003.log"
    script = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from eplb_fsm.sim import signals\n"
        f"signals.log_to(Path({str(path)!r}))\n"
        "print('hello from the rank', flush=True)\n"
        "sys.stderr.write(str([t.name for t in threading.enumerate()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "", out.stderr
    first, rest = path.read_text().split("\n", 1)
    assert first.startswith("===== eplb-fsm rank process ") and rest == "hello from the rank\n"
    assert "eplb-interpreter-watch" in out.stderr


def test_log_to_appends_so_a_reused_folder_keeps_the_earlier_runs_log(tmp_path):
    """Two processes log to one rank<r>.log: both outputs stay, in order, each under a line naming its pid."""
    import subprocess
    import sys

    path = tmp_path / "rank00003.log"
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from eplb_fsm.sim import signals\n"
        f"signals.log_to(Path({str(path)!r}))\n"
        "print('output of run', sys.argv[1], flush=True)\n"
        "sys.stderr.write(str(os.getpid()))\n"
    )
    pids = []
    for run in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", script, run], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        pids.append(out.stderr.strip())
    lines = path.read_text().splitlines()
    heads = [line for line in lines if line.startswith("===== eplb-fsm rank process ")]
    assert [h.split()[4] for h in heads] == pids
    assert lines.index(heads[0]) < lines.index("output of run first") < lines.index(heads[1])
    assert lines.index(heads[1]) < lines.index("output of run second")


def sleep_writing_pid(rank: int, world: int, pid_dir: str) -> int:
    """Both ranks write their pid and sleep: only a signal ends them."""
    _write_pid(pid_dir, rank)
    time.sleep(120)
    return rank


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "one-stopped"])
def test_ranks_end_when_the_launcher_is_killed(tmp_path, stopped):
    """SIGKILL to the launcher (it stops no one): each rank notices within a second and ends itself with SIGTERM.
    With rank 1 SIGSTOPped first, rank 0 resumes it (SIGCONT) before it ends, and it ends too (was: left behind,
    stopped, an orphan of the forkserver that lived on for it)."""
    import signal
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import sys\n"
        f"sys.path.insert(0, {tests_dir!r})\n"
        "from test_sim_launcher import sleep_writing_pid\n"
        "from eplb_fsm.sim.launcher import run_ranks\n"
        "if __name__ == '__main__':\n"
        f"    run_ranks(sleep_writing_pid, 2, args=({str(tmp_path)!r},), timeout=300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.endswith(".pid")]) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # each rank wrote its pid after install(): the request to the kernel is in place
        pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
        if stopped:
            os.kill(pids[1], signal.SIGSTOP)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        _assert_gone(str(tmp_path), within=20)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


def _print_then_block(rank: int, world: int) -> int:
    """Prints a line; rank 1 then sleeps, so rank 0 blocks in a gloo barrier until the launcher stops both. The
    barrier's group waits 120 s: the default group's timeout is the run's deadline, and under load its barrier ran
    out just before the launcher's SIGTERM (a newcomer run: rank 0 was formatting the error, not in the barrier)."""
    from datetime import timedelta

    import torch.distributed as dist

    print(f"rank {rank} is running", flush=True)
    patient = dist.new_group(timeout=timedelta(seconds=120))   # collective: both ranks build it before rank 1 sleeps
    if rank == 1:
        time.sleep(120)
    dist.barrier(group=patient)
    return rank


def test_rank_logs_take_each_ranks_stdout_from_its_start_with_the_stack_of_every_thread(tmp_path, capfd):
    """run_ranks(rank_logs=DIR): a rank's stdout is DIR/rank<NNNNN>.log from before it joins the group (the header
    line first); the launcher's SIGTERM makes each rank write every thread's stack there (rank 0's main one in the
    barrier, the signal thread's own), and nothing reaches the launcher's stdout."""
    _forkserver_up()   # 8 s then leave rank 0 time to reach its barrier, also on a loaded machine
    with pytest.raises(RanksTimeoutError):
        run_ranks(_print_then_block, 2, timeout=8.0, rank_logs=tmp_path)
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank:05d}.log").read_text()
        lines = text.splitlines()
        assert lines[0].startswith("===== eplb-fsm rank process ") and f"rank {rank} is running" in lines
        assert any(line.startswith("eplb-signals: SIGTERM received") for line in lines)
        stacks = text.split("the stack of every thread follows", 1)[1]
        assert "_print_then_block" in stacks and "_wait_loop" in stacks   # rank 1: in its sleep
    rank0_stacks = (tmp_path / "rank00000.log").read_text().split("the stack of every thread follows", 1)[1]
    assert "barrier" in rank0_stacks
    out = capfd.readouterr().out
    assert "is running" not in out and "eplb-signals" not in out



def _children(pid: int) -> list[str]:
    """Command lines of ``pid``'s live children (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode())
    return found


def _in_session(sid: int) -> list[int]:
    """Pids of live processes of session ``sid`` (zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                if int(fields[4]) == sid and fields[0] != "Z":
                    pids.append(int(entry))
    return pids


def test_warm_forkserver_starts_the_server_with_torch_preloaded_without_waiting_for_it():
    """warm_forkserver() returns with a forkserver child that preloads torch, and the caller has not imported torch."""
    import subprocess
    import sys

    script = ("import os, sys\nfrom eplb_fsm.sim.launcher import warm_forkserver\nwarm_forkserver()\n"
              "print('torch' in sys.modules)\nsys.stdout.flush()\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "False"
        # the server is started, not waited for: a child forked a moment ago may not have exec'd its own command
        # line yet (a stress run read the resource tracker alone), so look again for up to 30 s
        deadline = time.monotonic() + 30
        while not (servers := [c for c in _children(proc.pid) if "multiprocessing.forkserver" in c]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(servers) == 1 and "'torch'" in servers[0], _children(proc.pid)
    finally:
        proc.communicate("", timeout=60)


def test_a_usage_error_after_the_warm_up_leaves_no_process_behind():
    """simulate refusing its arguments (exit 2) after starting the forkserver: the server ends with it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "eplb_fsm", "simulate", "--ranks", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--ranks must be >= 1" in err, err
    deadline = time.monotonic() + 60    # the server may finish importing torch before it reads its pipe's end
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_session(proc.pid) == []
