"""A rank with no ``end`` whose trace stops before its peers' signal ``end``: it died, the signals followed.

The records are those of a real 3-rank run (``eplb-fsm simulate --ranks 3 --scale 12:4``) whose rank 0 was
SIGKILLed right after its ``scale_requested`` transition: ranks 1-2 waited for the joiner (``alive`` records,
no controller collective), and the launcher stopped them with SIGTERM 1.6 s later. Replay once named ranks 1-2
``signalled`` ("stopped from outside"). The other cases check what must not change: a stop from outside with
every rank's ``end``, a crash that explains the launcher's signals, a signal before the rank's own stop.
"""

from __future__ import annotations

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose

T0 = 1_796_575_261.0
SCALE = {"trigger": "scale_requested", "source": "collecting", "dest": "scaling", "layer": 1, "num_layers": 2,
         "layer_after": 1, "kind": "scale_up", "generation": 1, "from_ranks": 3, "to_ranks": 4,
         "rank_mapping": {"0": 0, "1": 1, "2": 2}, "joiners": [3], "leaving": [], "timeout_s": 20.0}


def rank_records(rank: int, tail: list[tuple[float, str, dict]]) -> list[dict]:
    """A rank's records: header, 11 quiet steps, the scale request at step 12 (t+0.9 s), then ``tail``
    ((t, event, fields) each, in the scaling state at step 12)."""
    head = [(0.0, "header", {"schema": 1, "run_id": "e330720c1e104627", "mode": "sync", "group": "ep",
                             "transfer_group": "ep_transfer", "config": {"num_layers": 2}}),
            (0.5, "steps", {"count": 11, "dummy": 0, "step": 1, "state": "collecting"}),
            (0.9, "transition", dict(SCALE, state="scaling"))]
    out = []
    for seq, (t, event, fields) in enumerate(head + tail):
        rec = {"ts": round(T0 + t, 6), "rank": rank, "world": 3, "event": event, "state": "scaling", "step": 12,
               "seq": seq}
        rec.update(fields)
        rec.setdefault("step", 12)
        out.append(rec)
    out[0].update(state="collecting", step=0)
    return out


def waited_then(end: dict | None, end_t: float = 2.5) -> list[tuple[float, str, dict]]:
    """Alive records of a wait at step 12 (t+1.3, t+2.3 s), then ``end`` at ``end_t`` (None: no end record)."""
    tail = [(1.3, "alive", {"interval_s": 1.0, "steps_seen": None, "waiting_on": None}),
            (2.3, "alive", {"interval_s": 1.0, "steps_seen": 12, "waiting_on": None})]
    return tail + ([(end_t, "end", end)] if end is not None else [])


SIGTERM = {"how": "signal", "signal": "SIGTERM"}


def killed_during_scale() -> dict[int, list[dict]]:
    """Rank 0's trace stops at its scale request (SIGKILL); ranks 1-2 wait, then end by the launcher's SIGTERM."""
    return {0: rank_records(0, []), 1: rank_records(1, waited_then(SIGTERM)), 2: rank_records(2, waited_then(SIGTERM))}


def test_a_rank_killed_before_the_launcher_sigterms_the_others_died():
    """Rank 0 without an end, its trace stopping before ranks 1-2's SIGTERM ends: rank_died rank 0, the SIGTERMs
    are consequences (was: signalled, ranks 1-2)."""
    report = diagnose(killed_during_scale())
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [0]), format_report(report)
    assert "before ranks 1-2 were stopped by SIGTERM" in report.summary
    assert any(c.startswith("rank 1 was stopped by SIGTERM") for c in report.consequences)
    assert any(c.startswith("rank 2 was stopped by SIGTERM") for c in report.consequences)
    # a rank frozen (SIGSTOP, no SIGCONT) when the job was stopped from outside leaves these very records: the
    # detail says so (docs/debugging-hangs.md: the traces cannot tell the two apart)
    assert report.findings[0].details == [
        "rank 0: last record at t+0.9 s; ranks 1-2 were stopped by SIGTERM from t+2.5 s and wrote their end "
        "records; had it still been running, it took no signal in the launcher's grace (no Python ran: a C call "
        "holding the GIL?) (a process frozen for good looks the same)"]
    assert not [f for f in report.findings if f.kind == "signalled"]


def test_every_rank_stopped_by_sigterm_is_still_signalled():
    """The same job stopped from outside, rank 0 writing its SIGTERM end too: signalled, ranks 0-2."""
    records = killed_during_scale()
    records[0] = rank_records(0, waited_then(SIGTERM))
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1, 2]), format_report(report)


def test_a_crash_before_the_signals_is_still_the_cause():
    """Rank 2 crashes (an engine error) at t+1.5 s, the launcher SIGTERMs rank 1 and kills rank 0 (no end, its
    last record after the crash): crashed, rank 2; rank 0 is no culprit."""
    records = killed_during_scale()
    records[0] = rank_records(0, [(1.6, "alive", {"interval_s": 1.0, "steps_seen": 12, "waiting_on": None})])
    records[2] = rank_records(2, [(1.5, "end", {"how": "exception", "error": "RuntimeError: engine boom"})])
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("crashed", [2]), format_report(report)
    assert not [f for f in report.findings if f.kind == "rank_died"]


def test_a_rank_that_stopped_writing_before_a_crash_and_took_no_signal_died_too():
    """Rank 0's trace stops at t+0.9 s, rank 2 crashes at t+1.5 s, the launcher SIGTERMs rank 1 (its end) and rank 0
    writes none: both are named, rank 0 died first (a red team's torchrun runs: a SIGKILL and an engine error at one
    step read only the crash, with rank 0's SIGTERMed peer named in a hang)."""
    records = killed_during_scale()
    records[2] = rank_records(2, [(1.5, "end", {"how": "exception", "error": "RuntimeError: engine boom"})])
    report = diagnose(records)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [0]), text
    assert [f.culprits for f in report.findings if f.kind == "crashed"] == [[2]], text


def test_a_signal_before_the_rank_stopped_writing_is_no_reaction_to_it():
    """Ranks 1-2 are stopped by SIGTERM at t+1.0 s while rank 0 writes on until t+2.3 s (then no end): the signals
    came first, so the verdict is signalled, ranks 1-2, and rank 0 did not die before them."""
    records = killed_during_scale()
    records[0] = rank_records(0, waited_then(None))
    records[1] = rank_records(1, [(1.0, "end", SIGTERM)])
    records[2] = rank_records(2, [(1.0, "end", SIGTERM)])
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [1, 2]), format_report(report)
    assert not [f for f in report.findings if f.kind == "rank_died"]



def test_a_rank_killed_just_before_a_fast_launchers_sigterm_died():
    """Rank 0 waits like its peers (alive at t+1.3, t+2.3 s) and its trace stops 0.2 s before ranks 1-2's SIGTERM
    ends: no tick missed (torchrun reacts within its 0.1 s --monitor-interval), still rank_died, rank 0 (was:
    signalled, ranks 1-2, the ranks the launcher stopped after the kill)."""
    records = killed_during_scale()
    records[0] = rank_records(0, waited_then(None))
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [0]), format_report(report)
    assert "0.20 s before ranks 1-2 were stopped by SIGTERM" in report.summary


def _writes_failed(records: list[dict], how: str) -> list[dict]:
    """``records`` with failed writes shown: a ``write_errors`` count on the last alive, or a torn last line."""
    if how == "count":
        alive = [r for r in records if r["event"] == "alive"]
        alive[-1]["write_errors"] = 3
        return records
    return records + [{"torn": True}]


def _diagnose_torn(records: dict[int, list[dict]]):
    """diagnose() of records where a ``{"torn": True}`` last entry stands for a half-written last line."""
    import json
    import tempfile
    from pathlib import Path

    from eplb_fsm.inspect.replay import replay_dir

    with tempfile.TemporaryDirectory() as tmp:
        for rank, recs in records.items():
            lines = [json.dumps(r) for r in recs if not r.get("torn")]
            torn = any(r.get("torn") for r in recs)
            text = "\n".join(lines) + "\n" + ('{"ts": 1796575263.4, "rank": 0, "ev' if torn else "")
            (Path(tmp) / f"rank{rank:05d}.jsonl").write_text(text)
        return replay_dir(tmp)


def test_a_rank_whose_writes_failed_needs_a_missed_tick_to_have_died():
    """Rank 0's trace shows failed writes (a write_errors count, or a torn last line), so its own end may be what
    was lost: without a liveness tick it missed the verdict stays signalled, ranks 1-2."""
    for how in ("count", "torn"):
        records = killed_during_scale()
        records[0] = _writes_failed(rank_records(0, waited_then(None)), how)
        report = _diagnose_torn(records) if how == "torn" else diagnose(records)
        assert (report.verdict, report.culprit_ranks) == ("signalled", [1, 2]), (how, format_report(report))
        assert not [f for f in report.findings if f.kind == "rank_died"]


def test_a_tick_missed_against_alive_records_without_an_interval_uses_the_default():
    """Rank 0's writes failed (write_errors on its last alive), its peers' alive records carry no interval_s: the
    default interval (1 s) makes their t+2.3 s alive a tick it missed after t+0.95 s (rank_died, rank 0), but
    not after t+1.6 s (signalled, ranks 1-2)."""
    records = killed_during_scale()
    for r in (1, 2):
        for rec in records[r]:
            rec.pop("interval_s", None)
    records[0] = rank_records(0, [(0.95, "alive", {"steps_seen": 12, "waiting_on": None, "write_errors": 1})])
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [0]), format_report(report)
    records[0] = rank_records(0, [(1.6, "alive", {"steps_seen": 12, "waiting_on": None, "write_errors": 1})])
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [1, 2]), format_report(report)


def in_flight_job(waited: float, interval: float = 1.0, fails: float | None = None,
                  gives_up: bool = False) -> dict[int, list[dict]]:
    """Two ranks step to 24 (alive records every ``interval`` s); rank 0 then enters an all-reduce that rank 1
    has not reached, and ``waited`` s later both are stopped by SIGTERM (rank 1 a fraction of a ms after).
    ``fails``: rank 1 is stopped first instead, and rank 0's wait fails ``fails`` s after rank 1's ``end`` (a
    negative value: before it), 0.1 s before rank 0's own signal ``end``. ``gives_up``: rank 1 alone is stopped,
    and rank 0 ends 10 ms later with an exception from another thread's failed wait, its all-reduce still open."""
    coll = {"op": "all_reduce", "group": "ep", "cseq": 0, "shape": [16], "dtype": "torch.float64", "parts": ["loads"]}
    out = {}
    for rank in range(2):
        t, recs = 0.0, [("header", {"schema": 1, "run_id": "inflight00000001", "mode": "sync", "group": "ep",
                                    "transfer_group": "ep_transfer", "config": {"num_layers": 2}})]
        timed = [(0.0, *recs[0])]
        for step in range(1, 25):
            t = step * 0.1
            timed.append((t, "step", {"step": step}))
            if step % 10 == 0:
                timed.append((t, "alive", {"step": step, "interval_s": interval, "steps_seen": step - 10,
                                           "waiting_on": None}))
        if rank == 0:
            timed.append((t + 0.001, "collective_start", dict(coll, step=24)))
            beat = t + 0.001 + interval
            while beat < t + 0.001 + waited:
                timed.append((beat, "alive", {"step": 24, "interval_s": interval, "steps_seen": 24,
                                              "waiting_on": {"op": "all_reduce", "group": "ep", "cseq": 0}}))
                beat += interval
        stop = t + 0.001 + waited
        if gives_up:
            timed.append((stop + (1 - rank) * 0.01, "end", dict(SIGTERM, step=24) if rank else {
                "how": "exception", "step": 24, "error": "RuntimeError: Connection reset by peer [127.0.0.1]:4242"}))
        elif fails is None:
            timed.append((stop + rank * 0.0003, "end", dict(SIGTERM, step=24)))
        elif rank == 1:
            timed.append((stop, "end", dict(SIGTERM, step=24)))
        else:
            timed.append((stop + fails, "collective_error", dict(coll, step=24, error="RuntimeError: Connection "
                                                                                      "closed by peer")))
            timed.append((stop + max(fails, 0.0) + 0.1, "end", dict(SIGTERM, step=24)))
        timed.sort(key=lambda x: x[0])
        out[rank] = [dict({"ts": round(T0 + ts, 6), "rank": rank, "world": 2, "event": event, "state": "collecting",
                           "step": 0, "seq": seq}, **fields) for seq, (ts, event, fields) in enumerate(timed)]
    return out


def test_a_sigterm_while_a_collective_is_in_flight_is_signalled_not_a_hang():
    """SIGTERM from outside 1.5 ms after rank 0 entered an all-reduce rank 1 had not reached yet: signalled, ranks
    0-1, the collective named in a detail (was: hang, rank 1 "never joined")."""
    report = diagnose(in_flight_job(0.0015))
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)
    assert "rank 0 was inside all_reduce (group ep, cseq 0) for 1.5 ms at most when stopped, which rank 1 had not " \
           "joined yet: a collective in flight, no hang" in report.findings[0].details[0]
    assert not [f for f in report.findings if f.kind == "hang"], format_report(report)


def test_a_sigterm_after_a_wait_of_one_interval_is_still_the_hang():
    """Rank 0 waited 1.5 s (one liveness interval and more) in an all-reduce rank 1 never joined, then SIGTERM on
    both: hang, rank 1, the signal a detail (an operator ending a hung job)."""
    report = diagnose(in_flight_job(1.5))
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), format_report(report)
    assert "stopped from outside, not its cause" in report.findings[0].details[0]


def test_the_wait_a_hang_needs_is_the_interval_the_records_announce():
    """The same 0.5 s wait is a hang when the alive records announce interval_s 0.2, and a collective in flight
    (signalled) at interval_s 1.0: the threshold comes from the records, not from the machine replaying them."""
    assert diagnose(in_flight_job(0.5, interval=0.2)).verdict == "hang"
    report = diagnose(in_flight_job(0.5, interval=1.0))
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)


def test_a_waiter_whose_wait_failed_as_the_culprit_was_stopped_first_still_reads_the_hang():
    """The launcher stops the stalled rank 1 first; rank 0's 1.5 s wait fails on the closed socket 5 ms later, then
    its own SIGTERM: hang, rank 1 (was: signalled, ranks 0-1, since rank 0 was no longer inside at its end)."""
    report = diagnose(in_flight_job(1.5, fails=0.005))
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), format_report(report)
    assert "stopped from outside, not its cause" in report.findings[0].details[0]
    assert any("after its wait inside all_reduce (group ep, cseq 0) failed" in c for c in report.consequences)


def test_a_wait_that_failed_before_any_signal_or_was_short_keeps_the_signal():
    """Rank 0's wait failed 0.2 s before rank 1 was stopped (not the stop's doing), or lasted 1.5 ms (in flight):
    the verdict stays signalled, ranks 0-1."""
    for job in (in_flight_job(1.5, fails=-0.2), in_flight_job(0.0015, fails=0.005)):
        report = diagnose(job)
        assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)


def test_a_waiter_that_gave_up_with_its_wait_still_open_reads_the_hang():
    """Only the stalled rank 1 is stopped; rank 0 ends 10 ms later with an exception from another thread (async
    mode: the engine's collective failed first), its 1.5 s all-reduce still open: hang, rank 1 (was: signalled)."""
    report = diagnose(in_flight_job(1.5, gives_up=True))
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), format_report(report)
    assert "stopped from outside, not its cause" in report.findings[0].details[0]
    report = diagnose(in_flight_job(0.0015, gives_up=True))   # a wait of 1.5 ms: in flight, the signal stays
    assert (report.verdict, report.culprit_ranks) == ("signalled", [1]), format_report(report)
