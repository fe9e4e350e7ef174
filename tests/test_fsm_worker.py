"""BackgroundWorker: jobs run in order on one thread with its own asyncio loop; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from eplb_fsm.fsm.worker import BackgroundWorker, run_niced


def test_jobs_run_in_submission_order_on_the_worker_thread():
    """Jobs run one at a time, in order, on a thread other than the caller's."""
    order, threads = [], set()
    with BackgroundWorker() as worker:
        jobs = [worker.submit(lambda i=i: (order.append(i), threads.add(threading.get_ident()), i)[2], kind="t")
                for i in range(5)]
        assert worker.wait_idle(5.0)
        assert [job.result(timeout=1.0) for job in jobs] == list(range(5))
    assert order == list(range(5))
    assert threads and threading.get_ident() not in threads


def test_error_is_reported_not_raised():
    """A job that raises is done, not ok, and keeps its exception for the controller to report."""
    with BackgroundWorker() as worker:
        job = worker.submit(lambda: 1 / 0)
        assert worker.wait_idle(5.0)
        assert job.done() and not job.ok()
        assert isinstance(job.error(), ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            job.result(timeout=0)
        # the worker survives a failed job
        assert worker.submit(lambda: 7).result(timeout=5.0) == 7


def test_done_is_false_while_running_and_age_grows():
    """While a job runs, done() is False and its age (local time, for timeout flags) increases."""
    gate = threading.Event()
    with BackgroundWorker() as worker:
        job = worker.submit(gate.wait, 5.0, kind="transfer", layer=3)
        time.sleep(0.05)
        assert not job.done() and job.error() is None and job.layer == 3
        assert job.age() >= 0.05
        assert worker.pending == 1 and not worker.idle()
        gate.set()
        assert worker.wait_idle(5.0) and job.ok()


def test_wait_idle_times_out_on_a_stuck_job():
    """wait_idle returns False when a job does not finish in time (a bounded wait, never a hang)."""
    gate = threading.Event()
    worker = BackgroundWorker()
    try:
        worker.submit(gate.wait, 5.0)
        assert worker.wait_idle(0.1) is False
    finally:
        gate.set()
        assert worker.close(timeout=5.0)


def test_close_runs_the_jobs_already_submitted_then_refuses_new_ones():
    """A job still queued at close() runs (its peers' copies run too, so their transfers pair up); no new ones."""
    gate = threading.Event()
    worker = BackgroundWorker()
    running = worker.submit(gate.wait, 5.0)
    queued = worker.submit(lambda: "ran")
    time.sleep(0.05)
    closer = threading.Thread(target=worker.close, kwargs={"timeout": 5.0})
    closer.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError):
        worker.submit(lambda: 1)
    gate.set()
    closer.join(5.0)
    assert not closer.is_alive() and running.ok() and queued.result(0) == "ran"
    assert not worker.alive


def test_on_a_gpu_a_job_waits_for_what_the_submitters_stream_enqueued_before(monkeypatch):
    """On a worker stream, submit records an event on the caller's stream and the job's stream waits on it first."""
    order: list = []

    class Event:
        def record(self, stream):
            order.append(("record", stream))

        def query(self):
            return True

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            order.append(("wait", self.name, event))

    engine = Stream("engine")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: engine)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    with BackgroundWorker() as worker:
        worker.stream = Stream("worker")
        job = worker.submit(lambda: order.append("job"))
        assert worker.wait_idle(5.0) and job.ok()
    assert order[0] == ("record", engine)
    assert order[1] == ("wait", "worker", job.after) and order[2] == "job"


async def test_coroutines_run_on_the_worker_loop():
    """An async caller can await work scheduled on the worker's own loop."""
    with BackgroundWorker() as worker:
        async def where():
            await asyncio.sleep(0)
            return threading.get_ident()

        ident = await asyncio.wrap_future(worker.run_coroutine(where()))
        assert ident != threading.get_ident()
        job = worker.submit(lambda: 42)
        assert await asyncio.wrap_future(job.future) == 42


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_jobs_run_on_the_worker_stream():
    """On GPU each job runs on the worker's own stream and done() waits for its recorded event."""
    with BackgroundWorker(device="cuda") as worker:
        assert worker.stream is not None
        src = torch.randn(1 << 20, device="cuda")
        dst = torch.empty_like(src)

        def copy():
            assert torch.cuda.current_stream() == worker.stream
            dst.copy_(src)
            return True

        job = worker.submit(copy)
        assert job.result(timeout=10.0)
        deadline = time.monotonic() + 10.0
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.done() and job.cuda_event is not None
        job.wait_stream()
        assert torch.equal(dst, src)


def test_nice_is_applied_to_the_worker_thread_only():
    """nice=5: the worker thread's own priority (read back by its native id) is the process's + 5; the caller's is
    unchanged."""
    import os

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with BackgroundWorker(nice=5) as worker:
        assert worker.native_id is not None and worker.native_id != threading.get_native_id()
        seen = worker.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(timeout=10)
        assert os.getpriority(os.PRIO_PROCESS, worker.native_id) == seen == min(19, mine + 5) == worker.niced_to
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_nice_zero_leaves_the_priority_alone():
    """nice=0 (the default): the worker keeps the process's priority."""
    import os

    with BackgroundWorker() as worker:
        assert worker.niced_to is None
        assert os.getpriority(os.PRIO_PROCESS, worker.native_id) == os.getpriority(os.PRIO_PROCESS, 0)


def test_a_job_waits_start_yield_before_its_code_runs_so_the_submitter_keeps_the_gil():
    """With start_yield_s, a submitted job's code has not run when submit returns; it runs after the pause."""
    ran = threading.Event()
    with BackgroundWorker(start_yield_s=0.3) as worker:
        job = worker.submit(ran.set, kind="t")
        assert not ran.is_set() and job.started_at is None   # the submitter's code after submit runs first
        assert job.result(timeout=5.0) is None and ran.is_set()
        assert job.started_at - job.submitted_at >= 0.3      # the pause came before the job's code


def test_start_yield_out_of_range_is_refused_naming_the_field():
    """start_yield_s must be 0..1 s; the worker does not start otherwise."""
    with pytest.raises(ValueError, match=r"start_yield_s must be in 0..1 s, got -0.1"):
        BackgroundWorker(start_yield_s=-0.1)


def test_run_niced_passes_its_nice_to_the_threads_the_call_starts():
    """run_niced(fn, 3): fn and a thread it starts run at the caller's nice + 3; the caller keeps its own; the value
    comes back."""
    import os

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict = {}

    def build():
        seen["fn"] = os.getpriority(os.PRIO_PROCESS, 0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join(10)
        return "group"

    assert run_niced(build, 3, timeout_s=10) == "group"
    assert seen == {"fn": min(19, mine + 3), "child": min(19, mine + 3)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine


def test_run_niced_zero_calls_here_and_errors_reach_the_caller():
    """run_niced(fn, 0) runs fn on the calling thread; an error raised in fn (niced or not) is raised to the caller."""
    assert run_niced(threading.get_ident, 0, timeout_s=1) == threading.get_ident()
    assert run_niced(threading.get_ident, 1, timeout_s=10) != threading.get_ident()
    for nice in (0, 2):
        with pytest.raises(ZeroDivisionError):
            run_niced(lambda: 1 / 0, nice, timeout_s=10)


def test_run_niced_gives_up_after_its_timeout():
    """A niced call that does not return within timeout_s raises TimeoutError instead of waiting on."""
    release = threading.Event()
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        run_niced(lambda: release.wait(10), 1, timeout_s=0.2)
    release.set()


def test_starting_a_worker_imports_numpy_ma_up_front():
    """A worker's start imports numpy.ma, so the planners' first np.unique does not import it mid-rearrangement."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from eplb_fsm.fsm.worker import BackgroundWorker\n"
            "before = 'numpy.ma' in sys.modules\n"
            "w = BackgroundWorker(); w.close()\n"
            "print(before, 'numpy.ma' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_a_worker_stops_once_its_owner_is_collected_after_the_jobs_already_queued():
    """owner=: collecting the owner stops the thread (no close() call), and a job queued before still runs."""
    import gc

    class Owner:
        pass

    owner, gate, ran = Owner(), threading.Event(), threading.Event()
    worker = BackgroundWorker(owner=owner)
    worker.submit(gate.wait, 10.0)
    queued = worker.submit(ran.set)
    del owner
    gc.collect()
    gate.set()
    worker._thread.join(10.0)
    assert not worker._thread.is_alive() and ran.is_set() and queued.ok()
    with pytest.raises(RuntimeError, match="is not running"):
        worker.submit(ran.set)


def test_stop_soon_returns_without_waiting_and_close_after_it_joins():
    """stop_soon() refuses new jobs at once and does not wait for a running job; close() then joins the thread."""
    gate = threading.Event()
    worker = BackgroundWorker()
    job = worker.submit(gate.wait, 10.0)
    worker.stop_soon()
    assert worker._thread.is_alive() and not job.done()        # still running: stop_soon did not wait
    with pytest.raises(RuntimeError, match="is not running"):
        worker.submit(gate.set)
    gate.set()
    assert worker.close(10.0) and job.ok()


def test_an_owner_that_cannot_be_weakly_referenced_is_refused_before_the_thread_starts():
    """owner=(1, 2): ValueError naming owner, and no worker thread is left running."""
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="owner must be weakly referenceable, got a tuple"):
        BackgroundWorker(name="w-refused", owner=(1, 2))
    assert not [t for t in threading.enumerate() if t not in before and t.name == "w-refused"]
