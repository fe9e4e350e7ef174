"""The wording of the collective findings, and how a tie (as many ranks on each side) is broken or left undecided."""

from __future__ import annotations

from test_inspect_liveness import WORLD, Rank, write

from eplb_fsm.inspect.replay import diagnose, replay_dir
from eplb_fsm.testing import Faults, SyntheticJob, hang_faults


def test_one_waiting_rank_waits_several_wait():
    """The hang sentence agrees with its subject: 'rank 0 waits inside it', 'ranks 0,2 wait inside it'."""
    for world, who in ((2, "rank 0 waits inside it"), (3, "ranks 0,2 wait inside it")):
        job = SyntheticJob(world=world)
        job.run(12, hang_faults(world, culprit=1, step=9))
        report = diagnose(job.records())
        assert report.verdict == "hang" and report.summary.endswith(who), report.summary



def test_a_far_cseq_is_reached_without_walking_every_number_up_to_it(monkeypatch):
    """An extra collective at cseq 10**9 gives the verdict it gives at the next cseq, checking only the cseqs held."""
    from eplb_fsm.inspect import collective_checks

    job = SyntheticJob(world=3)
    job.run(12)
    one = collective_checks._check_one_collective   # counted: a walk would call it once per number
    calls = []

    def counted(*args):
        calls.append(args[2])
        assert len(calls) < 1000, "walked the cseqs one by one"
        return one(*args)

    monkeypatch.setattr(collective_checks, "_check_one_collective", counted)
    verdicts = []
    for cseq in (None, 10**9):
        records = job.records()
        recs = records[1]
        start, end = [dict(r) for r in recs if r["event"].startswith("collective_") and r["group"] == "ep"][-2:]
        cseq = start["cseq"] + 1 if cseq is None else cseq
        for rec in (start, end):   # one more all-reduce on rank 1 alone, after its last step
            rec.update(cseq=cseq, seq=recs[-1]["seq"] + 1, step=recs[-1]["step"])
            recs.append(rec)
        report = diagnose(records)
        verdicts.append((report.verdict, report.culprit_ranks, report.summary.replace(str(10**9), "N")))
    assert verdicts[1][:2] == verdicts[0][:2] == ("collective_mismatch", [1]), verdicts
    assert "rank 1 issued an extra all_reduce (group ep, cseq N," in verdicts[1][2]


def test_a_tie_is_broken_past_a_list_as_op_elsewhere_in_the_group():
    """One rank against one at step 19's all-reduce, and a later op damaged into a list: the odd op is still named."""
    job = SyntheticJob(world=2)
    job.run(30, Faults(wrong_collective={1: (19, {"op": "all_gather"})}))
    records = job.records()
    late = [r for r in records[0] if r["event"] == "collective_start" and r["group"] == "ep" and r["step"] == 29]
    late[0]["op"] = ["all_reduce"]
    report = diagnose(records)
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [1], report.summary
    assert report.step == 19 and "all_gather appears nowhere else" in " ".join(report.findings[0].details)


def test_a_tie_on_shape_is_broken_by_the_whole_signature_the_group_runs_elsewhere():
    """One against one, same op, another shape: the rank whose collective the group runs elsewhere is right."""
    for culprit in (0, 1):
        job = SyntheticJob(world=2)
        job.run(25, Faults(wrong_collective={culprit: (9, {"shape": [9, 9]})}))
        report = diagnose(job.records())
        assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [culprit]), report.summary
        assert "shape [9, 9] appears nowhere else" in " ".join(report.findings[0].details)


def test_an_undecided_collective_tie_names_both_ranks():
    """One against one where the group runs neither collective elsewhere: both ranks named, a detail says undecided."""
    job = SyntheticJob(world=2)
    job.run(12, Faults(wrong_collective={0: (9, {"shape": [9, 9]})}))   # the only rearrangement: no other plan
    report = diagnose(job.records())
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [0, 1]), report.summary
    assert "undecided" in report.summary and any("is undecided" in d for d in report.findings[0].details)


def test_a_step_tie_is_broken_by_the_rearrangement_interval():
    """One against one, a due step one step late: the rank that came step_interval after its last one is right."""
    for culprit in (0, 1):
        job = SyntheticJob(world=2)
        job.run(25, Faults(skip_count={culprit: 12}))
        report = diagnose(job.records())
        assert (report.verdict, report.culprit_ranks) == ("step_divergence", [culprit]), report.summary
        assert "decided by the interval" in " ".join(report.findings[0].details)


def test_an_undecided_step_tie_names_both_ranks():
    """The first due step, one step late on one rank: no earlier one to count from, so both ranks are named."""
    job = SyntheticJob(world=2)
    job.run(15, Faults(skip_count={0: 3}))
    report = diagnose(job.records())
    assert (report.verdict, report.culprit_ranks) == ("step_divergence", [0, 1]), report.summary
    assert any("undecided" in d for d in report.findings[0].details)


def _skip_ep(records: list[dict], cseq: int, stop: bool) -> list[dict]:
    """``records`` with the ep collective ``cseq`` left out (the rank skipped it) and the later ones numbered one
    less, seqs renumbered; ``stop``: the trace ends inside the collective that took its place."""
    out: list[dict] = []
    for r in records:
        if r.get("group") == "ep" and r.get("cseq") == cseq:
            continue
        r = dict(r, seq=len(out))
        if r.get("group") == "ep" and isinstance(r.get("cseq"), int) and r["cseq"] > cseq:
            r["cseq"] -= 1
        out.append(r)
        if stop and r["event"] == "collective_start" and r.get("group") == "ep" and r["cseq"] == cseq:
            break
    return out


def test_a_rank_that_skipped_the_first_committing_agreement_is_not_cleared_by_its_next_collective():
    """Rank 1 skips the first commit agreement and waits in the next planning all-reduce: rank 0 is not blamed."""
    job = SyntheticJob(world=2)
    job.run(22)
    r0, r1 = job.records()[0], job.records()[1]
    commit = next(n for n, r in enumerate(r0) if r["event"] == "collective_start" and r.get("group") == "ep"
                  and r["cseq"] == 3)
    report = diagnose({0: r0[:commit + 1], 1: _skip_ep(r1, 3, stop=True)})
    mismatch = report.findings[0]
    assert mismatch.kind == "collective_mismatch" and 1 in mismatch.culprits, mismatch.summary
    assert "at step 19 in planning" in mismatch.summary and "at step 9 in committing" in mismatch.summary
    assert "step 9 in planning" not in mismatch.summary and "step 19 in committing" not in mismatch.summary


def test_collectives_after_a_skip_do_not_decide_the_tie_it_makes():
    """Rank 1 skips layer 0's ready: layer 1's, which rank 0 runs next, is no evidence against rank 0 (undecided)."""
    job = SyntheticJob(world=2)
    job.run(12)
    records = job.records()
    records[1] = _skip_ep(records[1], 1, stop=False)
    report = diagnose(records)
    mismatch = report.findings[0]
    assert mismatch.kind == "collective_mismatch" and mismatch.culprits == [0, 1], mismatch.summary
    assert "undecided" in mismatch.summary


def _worker_stalled(records: list[dict], cseq: int) -> list[dict]:
    """``records`` without the ep_transfer collectives from ``cseq`` on (the rank's transfer worker stalled there
    while its engine stepped on), seqs renumbered."""
    kept = [r for r in records if not (r.get("group") == "ep_transfer" and r["cseq"] >= cseq)]
    return [dict(r, seq=n) for n, r in enumerate(kept)]


def _wait_failed(records: list[dict], cseq: int) -> list[dict]:
    """``records`` with the end of ep_transfer collective ``cseq`` turned into a timeout (the rank gave up)."""
    out = []
    for r in records:
        if r.get("group") == "ep_transfer" and r["cseq"] == cseq and r["event"] == "collective_end":
            r = {k: v for k, v in r.items() if k != "duration_s"}
            r.update(event="collective_error", error="RuntimeError: Timed out waiting 2000ms for recv operation")
        out.append(r)
    return out


def test_a_rank_whose_trace_goes_on_but_not_in_the_group_never_joined_the_collective():
    """A stalled worker (nothing more in ep_transfer, engine stepping on) is a hang with a failed wait, not a skip."""
    job = SyntheticJob(world=2)
    job.run(32)
    records = job.records()
    report = diagnose({0: _wait_failed(records[0], 1), 1: _worker_stalled(records[1], 1)})
    first = report.findings[0]
    assert (report.verdict, report.culprit_ranks, first.step) == ("hang", [1], 9), report.summary
    assert report.summary.startswith("rank 1 never joined batch_isend_irecv (group ep_transfer, cseq 1, layer 1)")
    assert "rank 0 gave up waiting inside it (RuntimeError: Timed out" in report.summary
    assert {p["rank"]: p["status"] for p in first.ranks} == {0: "error", 1: "never_joined"}
    assert "nothing more in group ep_transfer though its trace went on" in first.ranks[1]["note"]


def test_a_rank_that_skipped_a_collective_and_issued_a_later_one_in_the_group_is_still_a_mismatch():
    """The same failed wait, but rank 1 went on in the group (its next wave takes the number): no hang is read."""
    job = SyntheticJob(world=2)
    job.run(32)
    records = job.records()
    skipped = [r for r in records[1] if not (r.get("group") == "ep_transfer" and r["cseq"] == 1)]
    skipped = [dict(r, seq=n, cseq=r["cseq"] - 1) if r.get("group") == "ep_transfer" and r["cseq"] > 1
               else dict(r, seq=n) for n, r in enumerate(skipped)]
    report = diagnose({0: _wait_failed(records[0], 1), 1: skipped})
    assert report.verdict == "collective_mismatch" and 1 in report.culprit_ranks, report.summary


def test_a_posted_all_reduce_its_rank_never_read_back_is_told_as_an_engine_stall(tmp_path):
    """Async ready flags posted by both ranks at step 18; rank 0 reads them at step 19 and waits in the next one,
    rank 1's engine never calls step() again (alive at step 18): a hang naming rank 1 that says it never read the
    posted all-reduce back (was: 'started ... and never finished', as if stuck inside a collective)."""
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.trace import EventTrace

    now = [1_700_000_000.0]
    traces = [EventTrace(r, 2, tmp_path, clock=lambda: now[0]) for r in range(2)]
    for trace in traces:
        trace.set_context(state="transferring", step=18)
        trace.header({"num_layers": 2}, run_id="run-posted", mode="async", group="ep", transfer_group="ep_transfer")
    posted = [t.open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"]) for t in traces]
    now[0] += 0.1
    traces[0].set_context(step=19)
    traces[0].close_collective(posted[0])
    waiting = traces[0].open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"])
    for _ in range(3):
        now[0] += 1.0
        for trace, seen in zip(traces, (19, 18)):
            trace.alive(1.0, seen)
    traces[0].close_collective(waiting, RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    traces[0].end("exception", error="RuntimeError: controller failed at step 19")
    for trace in traces:   # rank 1 writes no end: close() only closes its file
        trace.close()
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), report.summary
    assert report.summary.startswith("rank 1 posted all_reduce (group ep, cseq 0") and "never read it back" in \
        report.summary and report.summary.endswith("rank 0 finished it"), report.summary


def test_a_rank_killed_after_posting_its_ready_flags_reads_died_not_a_hang(tmp_path):
    """Both ranks post the ready all-reduce at step 18; rank 0 reads it back at step 19, rank 1 is SIGKILLed (no
    end; rank 0's next wait loses its connection): rank_died, rank 1, the posted collective a later finding (a red
    team's async kills read 'hang: rank 1 posted ... and never read it back', the death only a detail)."""
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.trace import EventTrace

    now = [1_700_000_000.0]
    traces = [EventTrace(r, 2, tmp_path, clock=lambda: now[0]) for r in range(2)]
    for trace in traces:
        trace.set_context(state="transferring", step=18)
        trace.header({"num_layers": 2}, run_id="run-killed", mode="async", group="ep", transfer_group="ep_transfer")
        trace.alive(1.0, 17)
    posted = [t.open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"]) for t in traces]
    now[0] += 0.1
    traces[0].set_context(step=19)
    traces[0].close_collective(posted[0])
    nxt = traces[0].open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"])
    now[0] += 0.05
    lost = RuntimeError("Read error [127.0.0.1]:10162: Connection reset by peer")
    traces[0].close_collective(nxt, lost)
    traces[0].end("exception", error=f"RuntimeError: {lost}")
    for trace in traces:   # rank 1 writes no end: close() only closes its file
        trace.close()
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [1]), report.summary
    assert any(f.kind == "hang" and "never read it back" in f.summary for f in report.findings), report.findings


def test_posted_ready_flags_every_rank_left_behind_when_it_ended_are_no_hang(tmp_path):
    """Every rank posts the ready all-reduce at step 18, then ends with an exception from its engine's collective
    (a reset link, a red team's real runs, 2 of 3): nobody waits in posted flags, so no 'every rank that joined it
    is still inside it' hang; the first exception is read instead."""
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.trace import EventTrace

    now = [1_700_000_000.0]
    traces = [EventTrace(r, 3, tmp_path, clock=lambda: now[0]) for r in range(3)]
    for trace in traces:
        trace.set_context(state="transferring", step=18)
        trace.header({"num_layers": 2}, run_id="run-reset", mode="async", group="ep", transfer_group="ep_transfer")
        trace.open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"])
    for r, trace in enumerate(traces):
        now[0] += 0.01
        trace.end("exception", error="RuntimeError: Read error [127.0.0.1]:30624: Connection reset by peer")
        trace.close()
    report = replay_dir(tmp_path)
    assert "still inside it" not in report.summary and "hang" not in [f.kind for f in report.findings], \
        report.summary



def test_ranks_still_below_an_extra_collectives_step_cast_no_vote(tmp_path):
    """Rank 0 sits in the controller's all-reduce at step 42 while ranks 1-3, still running (no `end`), write alive
    records at step 41: they have not got there yet, so no `collective_mismatch` finding naming rank 0 (a red team's
    healthy pipeline, its first stage steps ahead, read so while it ran). Ranks that went past step 42 do vote."""
    verdicts = []
    for others in (41, 43):
        ranks = [Rank(r).steps(40, collective_every=10) for r in range(WORLD)]
        ranks[0].steps(42)
        coll = {"op": "all_reduce", "group": "ep", "cseq": 4, "shape": [16], "dtype": "torch.float64",
                "parts": ["loads"]}
        ranks[0].emit("collective_start", **coll)
        ranks[0].wait(6)
        for rk in ranks[1:]:
            rk.steps(others).wait(6)
        (tmp_path / str(others)).mkdir()
        report = replay_dir(write(tmp_path / str(others), ranks))
        verdicts.append([(f.kind, f.culprits) for f in report.findings if f.kind == "collective_mismatch"])
    assert verdicts[0] == [] and verdicts[1] == [("collective_mismatch", [0])], verdicts
