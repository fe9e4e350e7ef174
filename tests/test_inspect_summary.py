"""Stage 1 of the replay: one rank's walk through the machine, in memory and over file text."""

from __future__ import annotations

import json

import pytest

from eplb_fsm.inspect import summary as sm
from eplb_fsm.testing import Faults, SyntheticJob, hang_faults

WORLD = 4


def job_records(faults: Faults | None = None, steps: int = 40, world: int = WORLD) -> dict[int, list[dict]]:
    job = SyntheticJob(world=world)
    job.run(steps, faults)
    return job.records()


@pytest.fixture(scope="module")
def healthy() -> dict[int, list[dict]]:
    return job_records()


def test_every_record_is_checked_and_counted(healthy):
    """The rank summary counts every record, its compact steps, transitions and collectives."""
    s = sm.summarize_rank(healthy[0], 0)
    assert s.records == len(healthy[0])
    assert s.step_records == sum(1 for r in healthy[0] if r["event"] == "step")
    assert len(s.transitions) == sum(1 for r in healthy[0] if r["event"] == "transition")
    starts = sum(1 for r in healthy[0] if r["event"] == "collective_start")
    assert sum(len(g) for g in s.collectives.values()) == starts
    assert set(s.collectives) == {"ep", "ep_transfer"}
    assert (s.first_step, s.last_step, s.final_state) == (0, 39, "collecting")

def test_oracle_memoises_machine_answers():
    """The oracle fires a real machine once per distinct context and then answers from memory."""
    oracle = sm.MachineOracle()
    assert oracle.outcome("transferring", 0, 2, False, "layer_done", {"layer": 0}) == ("transferring", 1, False)
    assert oracle.outcome("transferring", 0, 2, False, "layer_done", {"layer": 0}) == ("transferring", 1, False)
    assert oracle.fired == 1
    refused = oracle.outcome("transferring", 0, 2, False, "layer_done", {"layer": 1})
    assert isinstance(refused, str) and "not allowed" in refused
    assert isinstance(oracle.outcome("collecting", 0, 2, False, "explode", {}), str)

def _comparable(s: sm.RankSummary):
    d = s.to_dict()
    d.pop("path")
    colls = {g: {c: vars(e) for c, e in v.items()} for g, v in s.collectives.items()}
    return d, s.transitions, colls, s.illegal, s.warnings, dict(s.events), s.bad_lines, s.truncated


def _variants(records: list[dict]) -> dict[str, str]:
    """JSONL texts of one rank's records, clean and damaged in the ways files get damaged."""
    lines = [json.dumps(r, separators=(",", ":")) for r in records]
    clean = "\n".join(lines) + "\n"
    step_at = [i for i, r in enumerate(records) if r["event"] == "step"]
    wrong_state = list(lines)
    wrong_state[step_at[3]] = wrong_state[step_at[3]].replace('"collecting"', '"planning"')
    due = list(lines)
    due[step_at[4]] = due[step_at[4]][:-1] + ',"due":true}'
    dummy = list(lines)
    dummy[step_at[5]] = dummy[step_at[5]][:-1] + ',"dummy":true}'
    garbage = list(lines)
    garbage[step_at[6]] = garbage[step_at[6]][:20]
    garbage.insert(30, "")
    garbage.insert(31, "[1, 2]")
    lost = [line for i, line in enumerate(lines) if i not in (step_at[7], step_at[8], step_at[-2])]
    lost.remove(next(line for line in lost if '"collective_end"' in line))
    return {
        "two_runs": clean + clean,
        "lost_lines": "\n".join(lost) + "\n",
        "clean": clean,
        "no_final_newline": clean[:-1],
        "crlf": clean.replace("\n", "\r\n"),
        "truncated": clean[:-20],
        "truncated_then_blank": clean[:-20] + "\n\n",
        "wrong_state": "\n".join(wrong_state) + "\n",
        "due_step": "\n".join(due) + "\n",
        "dummy_step": "\n".join(dummy) + "\n",
        "garbage": "\n".join(garbage) + "\n",
    }


@pytest.mark.parametrize("faults", [None, hang_faults(WORLD, 1, 19), Faults(illegal={1: 9}),
                                    Faults(skip_count={1: 3})], ids=["healthy", "hang", "illegal", "skip"])
def test_file_fast_path_equals_record_by_record_replay(faults):
    """summarize_text (runs of step lines checked in bulk) gives the same summary as parsing every line."""
    records = job_records(faults)[1]
    for name, text in _variants(records).items():
        parsed = [sm.parse_line(line) for line in text.splitlines() if line.strip()]
        good = [r for r in parsed if r is not None]
        lines = [line for line in text.splitlines() if line.strip()]
        expected = sm.summarize_rank(good, 1, bad_lines=len(parsed) - len(good),
                                     truncated=sm.parse_line(lines[-1]) is None)
        assert _comparable(sm.summarize_text(text, 1)) == _comparable(expected), name


def test_clean_step_runs_take_the_bulk_path(healthy, monkeypatch):
    """On a clean file no step line is json-parsed on its own: runs are matched in bulk."""
    calls = []
    real = sm.parse_line
    monkeypatch.setattr(sm, "parse_line", lambda line: calls.append(line) or real(line))
    text = "\n".join(json.dumps(r, separators=(",", ":")) for r in healthy[0]) + "\n"
    summary = sm.summarize_text(text, 0)
    assert summary.step_records == 36 and summary.illegal == []
    assert len(calls) <= 3  # only the first and last records, read for the summary


def test_collective_outcomes_are_indexed_by_group_and_cseq():
    """Start/end/error records become one entry per (group, cseq) with its status and duration."""
    recs = [
        {"event": "header", "rank": 0, "world": 2, "state": "collecting", "step": 0, "seq": 0},
        {"event": "collective_start", "op": "all_reduce", "group": "ep", "cseq": 0, "shape": [4],
         "state": "collecting", "step": 1, "seq": 1},
        {"event": "collective_end", "op": "all_reduce", "group": "ep", "cseq": 0, "duration_s": 0.5,
         "state": "collecting", "step": 1, "seq": 2},
        {"event": "collective_start", "op": "barrier", "group": "x", "cseq": 0, "state": "collecting",
         "step": 2, "seq": 3},
        {"event": "collective_error", "op": "barrier", "group": "x", "cseq": 0, "error": "Timeout",
         "state": "collecting", "step": 2, "seq": 4},
        {"event": "collective_start", "op": "all_reduce", "group": "ep", "cseq": 1, "shape": [4],
         "state": "collecting", "step": 3, "seq": 5},
        {"event": "collective_end", "op": "all_gather", "group": "ep", "cseq": 7, "state": "collecting",
         "step": 3, "seq": 6},
    ]
    s = sm.summarize_rank(recs)
    assert s.rank == 0 and s.world == 2
    ep, x = s.collectives["ep"], s.collectives["x"]
    assert (ep[0].status, ep[0].duration_s, ep[1].status) == ("ended", 0.5, "open")
    assert (x[0].status, x[0].error) == ("error", "Timeout")
    assert [c.cseq for c in s.open_collectives()] == [1]
    assert any("ep#7 without a start" in w for w in s.warnings)
    assert s.max_cseq("ep") == 1 and s.max_cseq("nope") == -1


def test_collective_signature_ignores_p2p_shapes_but_not_layers():
    """Point-to-point ops compare by op, layer and wave; collectives also by shape."""
    a = sm.Collective("batch_isend_irecv", "t", 0, [3, 4], None, 1, "transferring", 0, 1, 0)
    b = sm.Collective("batch_isend_irecv", "t", 0, [9], None, 1, "transferring", 0, 1, 0)
    c = sm.Collective("batch_isend_irecv", "t", 0, [9], None, 1, "transferring", 1, 1, 0)
    assert a.signature() == b.signature() != c.signature()
    d = sm.Collective("all_reduce", "ep", 0, [3], None, 1, "planning", None, 1)
    e = sm.Collective("all_reduce", "ep", 0, [4], None, 1, "planning", None, 1)
    assert d.signature() != e.signature()


def test_missing_num_layers_is_checked_loosely_with_a_warning(healthy):
    """Transition records without num_layers still replay (layer guards loosened) and say so."""
    recs = [{k: v for k, v in r.items() if k != "num_layers"} for r in healthy[0]
            if r["event"] not in ("model_added", "header")]
    s = sm.summarize_rank(recs, 0)
    assert s.illegal == []
    assert any("no num_layers" in w for w in s.warnings)


def test_records_stamped_with_another_state_are_counted(healthy):
    """A collective record stamped with a state the replay is not in gives one summary warning."""
    recs = [dict(r) for r in healthy[0]]
    for r in recs:
        if r["event"] == "collective_start" and r["step"] == 9:
            r["state"] = "scaling"
    s = sm.summarize_rank(recs, 0)
    assert any("stamped with a state other than the replayed one" in w for w in s.warnings)


def test_read_records_bulk_and_line_by_line(tmp_path):
    """read_records parses a clean file in one go and a damaged one line by line."""
    path = tmp_path / "rank00000.jsonl"
    path.write_text('{"a":1}\n{"b":2}\n')
    assert sm.read_records(path) == ([{"a": 1}, {"b": 2}], 0, False)
    path.write_text('{"a":1}\n\n[3]\n{"b":2}\n{"c":')
    assert sm.read_records(path) == ([{"a": 1}, {"b": 2}], 2, True)
    path.write_text("")
    assert sm.read_records(path) == ([], 0, False)


def test_find_trace_files_picks_rank_files_only(tmp_path):
    """Only rank<N>.jsonl files count, keyed and sorted by rank."""
    for name in ("rank00002.jsonl", "rank00000.jsonl", "rank00001.log", "notes.jsonl", "rank7.jsonl"):
        (tmp_path / name).write_text("{}\n")
    assert list(sm.find_trace_files(tmp_path)) == [0, 2, 7]


def test_a_second_header_starts_a_new_run(healthy):
    """A controller appending to the file (a second header) makes the replay start over from it."""
    recs = healthy[0] + healthy[0]
    s = sm.summarize_rank(recs, 0)
    single = sm.summarize_rank(healthy[0], 0)
    assert s.illegal == [] and s.records == single.records and s.transitions == single.transitions
    assert any("holds 2 runs" in w for w in s.warnings)


def test_lost_lines_are_reported_by_seq(healthy):
    """Records missing from the seq sequence (lost lines) give one warning with the count."""
    recs = [r for r in healthy[0] if r["seq"] not in (5, 6, 30)]
    s = sm.summarize_rank(recs, 0)
    lost = "3 record(s) missing by seq (lost lines), the first between seq 4 and seq 7"   # steps 5-6 lost
    assert any(w.startswith(lost) for w in s.warnings)
    assert not any("missing by seq" in w for w in sm.summarize_rank(healthy[0], 0).warnings)


def test_transfer_group_resets_are_collected():
    """transfer_group_reset records name the re-created group, which every rank belongs to."""
    job = SyntheticJob(world=2)
    job.run(40, Faults(transfer_error={1: (19, 0)}))
    s = sm.summarize_rank(job.records()[0], 0)
    assert s.named_groups == {"ep_transfer.1"}
    assert [t.trigger for t in s.transitions].count("fault") == 1
    assert "ep_transfer.1" in s.collectives


def _down_up_records() -> dict[int, list[dict]]:
    # 4 slots a rank: the 8 experts still fit on 2 ranks, as request_scale requires of a scale-down
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=4)
    job.run(12)
    job.scale(2)
    job.run(6)
    job.scale(4)
    job.run(6)
    return job.records()


def test_a_joiner_header_keeps_the_session_before_it():
    """A leaving rank's run then a joiner's in one file: both are summarised; the joiner starts in scaling."""
    recs = _down_up_records()[3]
    s = sm.summarize_rank(recs, 3)
    (first,) = s.previous
    assert (first.session, first.role, first.left["generation"], first.last_step) == (0, "member", 1, 12)
    assert (s.session, s.role, s.generation, s.first_step) == (1, "joiner", 2, 18)
    assert first.illegal == [] and s.illegal == [] and s.warnings == []
    assert s.transitions[0].trigger == "groups_ready" and s.transitions[0].generation == 2
    assert set(s.collectives) == {"ep@2", "ep_transfer@2"} and set(first.collectives) == {"ep", "ep_transfer"}
    assert first.records + s.records == len(recs)


def test_two_session_text_gives_the_same_summaries_as_records():
    """summarize_text (bulk step runs) and summarize_rank agree on both sessions of a joiner's file."""
    recs = _down_up_records()[2]
    text = "\n".join(json.dumps(r, separators=(",", ":")) for r in recs) + "\n"
    bulk, plain = sm.summarize_text(text, 2), sm.summarize_rank(recs, 2)
    for a, b in zip(bulk.previous + [bulk], plain.previous + [plain]):
        assert _comparable(a) == _comparable(b)
        assert (a.switches, a.left, a.scalings, a.role) == (b.switches, b.left, b.scalings, b.role)


def test_interleaved_sessions_are_told_apart_by_seq():
    """Two sessions writing one file at once (a renumbered rank and a joiner) are routed record by record."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, slots_per_rank=4)   # 8 experts fit on 2 ranks
    job.run(12)
    job.scale(2, rank_mapping={0: -1, 1: 0, 2: 1})
    job.run(6)
    job.scale(3)
    job.run(6)
    old, joiner = job.sessions[2], job.sessions[3]
    mixed = sorted(old.trace.records + joiner.trace.records, key=lambda r: r["ts"])
    s = sm.summarize_rank(mixed, 2)
    (first,) = s.previous
    assert (first.records, s.records) == (len(old.trace.records), len(joiner.trace.records))
    assert first.illegal == [] and s.illegal == [] and s.role == "joiner" and first.final_state == "collecting"


def test_parse_records_reads_text_as_read_records_reads_the_file(tmp_path):
    """parse_records over a file's text gives what read_records gives for the file, bad lines counted."""
    path = tmp_path / "rank00000.jsonl"
    path.write_text('{"a":1}\n\n[3]\n{"b":2}\n{"c":')
    assert sm.parse_records(path.read_text()) == sm.read_records(path) == ([{"a": 1}, {"b": 2}], 2, True)


def test_load_rank_file_says_why_a_file_gave_no_summary(tmp_path, monkeypatch):
    """An unreadable file (open denied) or an empty one: no summary, and one warning naming the file and the cause."""
    denied, empty = tmp_path / "rank00001.jsonl", tmp_path / "rank00002.jsonl"
    denied.write_text('{"event":"header"}\n')
    empty.write_text("")
    real_open = open

    def guarded(file, *args, **kwargs):
        if str(file) == str(denied):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded)   # chmod 000 does not stop root
    assert sm.load_rank_file(1, denied) == (1, None, [f"rank 1: cannot read {denied}: Permission denied"])
    assert sm.load_rank_file(2, empty) == (2, None, ["rank 2: rank00002.jsonl has no readable record"])


def test_load_rank_file_reads_only_the_run_asked_for(tmp_path):
    """A file another run appended to: with run_id, the summary is that run's alone (its header, its records)."""
    path = tmp_path / "rank00000.jsonl"
    runs = {}
    for run_id, steps in (("old", 30), ("new", 5)):
        recs = job_records(steps=steps, world=2)[0]
        recs[0]["run_id"] = run_id
        runs[run_id] = recs
        with open(path, "a") as fh:
            fh.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
    _, old, _ = sm.load_rank_file(0, path, run_id="old")
    _, new, _ = sm.load_rank_file(0, path)
    assert (old.header["run_id"], old.records, old.last_step) == ("old", len(runs["old"]), 29)
    assert (new.header["run_id"], new.records, new.last_step) == ("new", len(runs["new"]), 4)


def test_a_warning_names_the_rotated_segment_and_its_own_line(tmp_path):
    """A bad field in an older segment is reported as <segment file>:<its line>, not the live file's name."""
    from eplb_fsm.trace import EventTrace
    from eplb_fsm.trace_segments import segment_paths

    trace = EventTrace(0, 1, tmp_path, clock=lambda: 1_700_000_000.0, max_bytes=2048, max_segments=10)
    trace.set_context(state="collecting", step=0)
    trace.header({"num_layers": 2}, run_id="r")
    for i in range(80):
        with trace.collective("all_reduce", "ep", [3]):
            pass
    trace.close()
    paths = segment_paths(trace.path)
    assert len(paths) >= 3
    lines = paths[1].read_text().splitlines()
    rec = json.loads(lines[4])
    rec["cseq"] = "x"
    lines[4] = json.dumps(rec, separators=(",", ":"))
    paths[1].write_text("\n".join(lines) + "\n")
    _, summary, _ = sm.load_rank_file(0, trace.path)
    assert [w.split(": field")[0] for w in summary.warnings if "'cseq'" in w] == [f"{paths[1].name}:5"]


@pytest.mark.parametrize("field, value", [("step", "x"), ("seq", "7"), ("ts", "t"), ("rank", [1]), ("count", "x")])
def test_in_memory_walk_checks_field_types_of_step_records_as_the_file_walk_does(healthy, field, value):
    """A wrongly typed field on a step record amid steps: summarize_rank warns and ignores it as summarize_text does."""
    records = [dict(r) for r in healthy[1]]
    i = next(i for i in range(2, len(records)) if records[i - 1]["event"] == records[i]["event"] == "step")
    records[i][field] = value
    text = "\n".join(json.dumps(r, separators=(",", ":")) for r in records) + "\n"
    in_memory = sm.summarize_rank(records, 1)
    assert any(f"field {field!r}" in w for w in in_memory.warnings)
    assert _comparable(in_memory) == _comparable(sm.summarize_text(text, 1))


def test_the_several_runs_warning_names_the_run_replayed_and_how_to_pick_the_one_before(healthy):
    """A second run appended to the file (a restarted job): the warning gives both run ids and the --run-id to use."""
    first, second = ([dict(r, run_id=run) if r["event"] == "header" else r for r in healthy[0]]
                     for run in ("first00000000001", "second0000000002"))
    s = sm.summarize_rank(first + second, 0)
    assert any(w.endswith("replaying the last one (run second0000000002); --run-id first00000000001 replays the "
                          "one before it") for w in s.warnings), s.warnings
