"""``eplb-fsm replay``: text and JSON reports, exit codes 0/1/2, the per-rank timeline."""

from __future__ import annotations

import json
import shutil

import pytest

from eplb_fsm.cli import main
from eplb_fsm.inspect.findings import KINDS
from eplb_fsm.testing import Faults, Stop, SyntheticJob, hang_faults, write_traces
from eplb_fsm.trace import trace_path

WORLD = 4


def make_dir(tmp_path, faults=None, steps=30, name="logs"):
    job = SyntheticJob(world=WORLD, trace_dir=tmp_path / name, keep=False)
    job.run(steps, faults)
    job.close()
    return tmp_path / name


@pytest.fixture(scope="module")
def healthy_dir(tmp_path_factory):
    return make_dir(tmp_path_factory.mktemp("healthy"))


@pytest.fixture(scope="module")
def hang_dir(tmp_path_factory):
    return make_dir(tmp_path_factory.mktemp("hang"), hang_faults(WORLD, culprit=2, step=19))


def test_healthy_exit_0_and_verdict_first(healthy_dir, capsys):
    """Healthy traces: exit 0 and the first line is the healthy verdict."""
    assert main(["replay", str(healthy_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("healthy: 4 of 4 ranks agree")
    assert "illegal transitions: none" in "\n".join(out)


def waited_in(logs) -> dict:
    """Rank 0's last record in a hang folder: the start of the collective it waits in (the builder's layout sets
    its cseq and shape, so tests read them here)."""
    return json.loads(trace_path(logs, 0).read_text().splitlines()[-1])


def test_hang_exit_1_with_culprit_in_the_verdict_line(hang_dir, capsys):
    """A hang: exit 1, verdict line naming rank 2 and the collective, then every rank's position."""
    start = waited_in(hang_dir)
    assert main(["replay", str(hang_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"hang: rank 2 never joined all_reduce (group ep, cseq {start['cseq']}")
    assert any(line.strip().startswith("0-1,3") and "inside since step 19" in line for line in out)
    assert any(f"collective: all_reduce group=ep cseq={start['cseq']}" in line for line in out)


def test_json_report_fields(hang_dir, capsys):
    """--json prints one object with verdict, culprit_ranks, step, state, layer, collective and more."""
    start = waited_in(hang_dir)
    assert main(["replay", str(hang_dir), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "hang" and data["culprit_ranks"] == [2]
    assert (data["step"], data["state"], data["layer"]) == (19, "planning", None)
    assert data["collective"] == {"op": "all_reduce", "group": "ep", "cseq": start["cseq"], "shape": start["shape"],
                                  "dtype": "torch.float64"}
    assert data["illegal_transitions"] == [] and isinstance(data["warnings"], list)
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]


def test_unusable_input_exits_2(tmp_path, capsys):
    """No folder, an empty folder, or unreadable files: exit 2 with an `eplb-fsm replay: error:` line on stderr."""
    assert main(["replay", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith(f"eplb-fsm replay: error: {tmp_path / 'absent'} is not a directory")
    assert main(["replay", str(tmp_path)]) == 2
    assert "no rank*.jsonl" in capsys.readouterr().err
    (tmp_path / "rank00000.jsonl").write_text("garbage\n")
    assert main(["replay", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "unusable_input"


def test_unusable_input_with_rank_and_json_prints_the_json_error(tmp_path, capsys):
    """--rank R --json on unusable input exits 2 with the same unusable_input object the report prints."""
    assert main(["replay", str(tmp_path / "absent"), "--rank", "0", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"verdict": "unusable_input",
                                        "error": f"{tmp_path / 'absent'} is not a directory"}
    assert captured.err.startswith("eplb-fsm replay: error: ")
    logs = make_dir(tmp_path)
    trace_path(logs, 2).write_text("")
    assert main(["replay", str(logs), "--rank", "2", "--json"]) == 2
    assert "has no readable record" in json.loads(capsys.readouterr().out)["error"]


def test_missing_rank_and_truncated_file_are_reported(tmp_path, capsys):
    """A missing rank file exits 1 (missing_ranks); a truncated last line alone is a warning (exit 0)."""
    logs = make_dir(tmp_path)
    for rank in range(WORLD):  # read while the job runs: no rank has written its end record yet
        path = trace_path(logs, rank)
        path.write_text("".join(line for line in path.read_text().splitlines(True) if '"event":"end"' not in line))
    path = trace_path(logs, 1)
    path.write_text(path.read_text()[:-30])
    assert main(["replay", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "rank 1: last line of rank00001.jsonl is truncated" in out
    trace_path(logs, 3).unlink()
    assert main(["replay", str(logs), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "missing_ranks" and data["culprit_ranks"] == [3]
    assert main(["replay", str(logs), "--ranks", "6", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["missing_ranks"] == [3, 4, 5]


def test_rank_timeline(hang_dir, capsys):
    """--rank R prints one line per record of that rank (plus title and header), exit 0."""
    assert main(["replay", str(hang_dir), "--rank", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = sum(1 for _ in open(trace_path(hang_dir, 0)))
    assert lines[0] == f"rank 0: {n} records"
    assert len(lines) == n + 2
    start = waited_in(hang_dir)
    assert "collective_start" in lines[-1] and f"all_reduce ep#{start['cseq']} {start['shape']}" in lines[-1]


def test_rank_timeline_json_and_illegal_marks(tmp_path, capsys):
    """--rank --json gives rows; an illegal transition is marked in both forms."""
    logs = tmp_path / "logs"
    job = SyntheticJob(world=WORLD, trace_dir=logs)
    job.run(20, Faults(illegal={1: 9}))
    job.close()
    assert main(["replay", str(logs), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("!! ") and "committed: transferring->collecting" in line for line in out.splitlines())
    assert main(["replay", str(logs), "--rank", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    marked = [row for row in data["timeline"] if "illegal" in row]
    assert len(marked) == 1 and marked[0]["step"] == 9
    assert main(["replay", str(logs), "--rank", "9"]) == 2
    assert "no trace for rank 9" in capsys.readouterr().err


def test_rank_died_via_files(tmp_path, capsys):
    """Files written by a job whose rank 3 stops early replay to rank_died on rank 3."""
    job = SyntheticJob(world=WORLD)
    job.run(30, Faults(stop={3: Stop(12)}))
    write_traces(job.records(), tmp_path)
    assert main(["replay", str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "rank_died" and data["culprit_ranks"] == [3] and data["step"] == 11


def down_up_job(trace_dir=None) -> SyntheticJob:
    """A closed 4 -> 2 -> 4 job: 12 steps, the scale-down, 6 steps, the scale-up, 5 steps.

    4 slots a rank, so the 8 experts still fit on 2 ranks (``request_scale`` refuses a scale-down without room).
    """
    job = SyntheticJob(world=WORLD, num_layers=2, interval=10, trace_dir=trace_dir, slots_per_rank=4)
    job.run(12)
    job.scale(2)
    job.run(6)
    job.scale(4)
    job.run(5)
    job.close()
    return job


def test_elastic_dir_report_and_two_session_timeline(tmp_path, capsys):
    """A 4 -> 2 -> 4 job: exit 0 with the scales listed; --rank 3 shows both sessions and marks only the joiner's."""
    logs = tmp_path / "logs"
    down_up_job(trace_dir=logs)
    assert main(["replay", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "scales (2):\n    generation 1 at step 12: scale_down 4 -> 2 ranks, switched" in out
    assert "traces: 4 of world 4 (6 sessions)" in out
    path = trace_path(logs, 3)
    lines = path.read_text().splitlines()
    joiner = next(i for i, line in enumerate(lines) if '"role":"joiner"' in line)
    ready = next(i for i in range(joiner, len(lines)) if '"trigger":"groups_ready"' in lines[i])
    bad = json.loads(lines[ready])
    lines[ready] = json.dumps({**bad, "source": "collecting"}, separators=(",", ":"))  # the session-1 record
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(logs), "--rank", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sessions"] == 2 and [i["session"] for i in data["illegal_transitions"]] == [1]
    marked = [row for row in data["timeline"] if "illegal" in row]
    assert len(marked) == 1 and marked[0]["seq"] == bad["seq"]
    assert main(["replay", str(logs), "--rank", "3"]) == 0
    text = capsys.readouterr().out
    assert "header (joiner of generation 2, a new session)" in text and "group_switch ep->None (leaving" in text


def test_rank_timeline_follows_a_joiner_file_as_the_next_session(tmp_path, capsys):
    """--rank 3 reads rank00003.jsonl, then the joiner's rank00003.g2.jsonl, as one timeline of two sessions."""
    job = down_up_job()
    first, joiner = [s for s in job.sessions if s.trace.records[0]["rank"] == 3]
    files, shared = tmp_path / "files", tmp_path / "shared"
    for d, parts in ((files, [("rank00003.jsonl", first), ("rank00003.g2.jsonl", joiner)]),
                     (shared, [("rank00003.jsonl", first), ("rank00003.jsonl", joiner)])):
        d.mkdir()
        for name, session in parts:   # the shared folder: the joiner appended to the first file, as before
            with open(d / name, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in session.trace.records))
    lines = (files / "rank00003.g2.jsonl").read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if '"trigger": "groups_ready"' in line)
    lines[ready] = json.dumps({**json.loads(lines[ready]), "source": "collecting"})  # illegal, in session 1
    (files / "rank00003.g2.jsonl").write_text("\n".join(lines) + "\n")
    (shared / "rank00003.jsonl").write_text("".join(line + "\n" for line in
                                                     (files / "rank00003.jsonl").read_text().splitlines() + lines))
    views = {}
    for d in (files, shared):
        assert main(["replay", str(d), "--rank", "3", "--json"]) == 0
        views[d] = json.loads(capsys.readouterr().out)
    got, want = views[files], views[shared]
    assert (got["sessions"], got["timeline"], got["illegal_transitions"]) == \
        (want["sessions"], want["timeline"], want["illegal_transitions"])
    assert got["sessions"] == 2 and [i["session"] for i in got["illegal_transitions"]] == [1]
    assert got["paths"] == [str(files / "rank00003.jsonl"), str(files / "rank00003.g2.jsonl")]
    assert len(got["timeline"]) == len(first.trace.records) + len(joiner.trace.records)
    assert main(["replay", str(files), "--rank", "3"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].endswith("(files rank00003.jsonl, then rank00003.g2.jsonl)")
    assert text.index("group_switch ep->None (leaving") < text.index("header (joiner of generation 2, a new session)")
    assert "!! session 1 seq" in text


def deny(monkeypatch, path):
    """Make opening ``path`` fail as chmod 000 would for a user (root ignores chmod)."""
    real_open = open

    def guarded(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded)


def test_rank_timeline_follows_the_rank_the_records_carry(tmp_path, capsys):
    """Swapped files: --rank 2 shows the file holding rank 2's records (as the report does) and names that file."""
    logs = make_dir(tmp_path, hang_faults(WORLD, culprit=2, step=19))
    a, b = trace_path(logs, 1), trace_path(logs, 2)
    text_a, text_b = a.read_text(), b.read_text()
    a.write_text(text_b)
    b.write_text(text_a)
    assert main(["replay", str(logs), "--rank", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    title = f"rank 2: {len(text_b.splitlines())} records (read from rank00001.jsonl, a file named for rank 1)"
    assert lines[0] == title
    assert main(["replay", str(logs), "--rank", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(a)


def test_rank_timeline_without_records_exits_2(tmp_path, capsys):
    """--rank R on an empty file exits 2 as the report does, naming the file; so does a folder of one empty file."""
    logs = make_dir(tmp_path)
    trace_path(logs, 2).write_text("")
    assert main(["replay", str(logs), "--rank", "2"]) == 2
    assert "rank 2: rank00002.jsonl has no readable record" in capsys.readouterr().err
    lone = tmp_path / "lone"
    lone.mkdir()
    trace_path(lone, 0).write_text("")
    assert main(["replay", str(lone), "--rank", "0"]) == 2
    assert "no readable records" in capsys.readouterr().err


def test_rank_timeline_applies_run_id(tmp_path, capsys):
    """--rank R --run-id ID shows only that run's records of R's file; a run id no file holds exits 2."""
    from eplb_fsm.trace import encode_record

    written = {}
    for run_id, steps in (("old", 30), ("new", 5)):
        job = SyntheticJob(world=1)
        job.run(steps)
        job.close()
        written[run_id] = recs = job.records()[0]
        recs[0]["run_id"] = run_id
        with open(trace_path(tmp_path, 0), "a") as fh:
            fh.write("".join(encode_record(rec) + "\n" for rec in recs))
    assert main(["replay", str(tmp_path), "--rank", "0", "--run-id", "old"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"rank 0: {len(written['old'])} records"
    assert main(["replay", str(tmp_path), "--rank", "0", "--run-id", "other"]) == 2
    assert "no trace of run 'other'" in capsys.readouterr().err


def test_an_unknown_run_id_lists_every_run_the_folder_holds(tmp_path, capsys):
    """A --run-id no file holds exits 2 naming every run id found, an older job appended before a newer one too."""
    from eplb_fsm.trace import encode_record

    for run_id in ("older", "newer"):
        job = SyntheticJob(world=2)
        job.run(5)
        job.close()
        for rank, recs in job.records().items():
            recs[0]["run_id"] = run_id
            with open(trace_path(tmp_path, rank), "a") as fh:
                fh.write("".join(encode_record(rec) + "\n" for rec in recs))
    assert main(["replay", str(tmp_path), "--run-id", "other"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm replay: error: no trace of run 'other'; the folder holds runs newer, older: ")
    assert main(["replay", str(tmp_path), "--run-id", "older"]) == 0


def test_rank_timeline_rejects_ranks(healthy_dir, capsys):
    """--ranks N has no meaning for one rank's timeline: --rank R with --ranks N is a usage error (exit 2)."""
    assert main(["replay", str(healthy_dir), "--rank", "0", "--ranks", "4"]) == 2
    assert "--ranks N sets the world the report expects" in capsys.readouterr().err


def test_ranks_with_rank_is_one_usage_error_line_naming_the_option(healthy_dir, capsys):
    """--rank R with --ranks N prints one 'eplb-fsm replay: error: --ranks ...' line, as every usage error does."""
    assert main(["replay", str(healthy_dir), "--ranks", "2", "--rank", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm replay: error: --ranks is not allowed with --rank: ") and err.count("\n") == 1


def test_unreadable_folder_or_file_exits_2(healthy_dir, monkeypatch, capsys):
    """A folder that cannot be listed, or --rank R on a file that cannot be read: exit 2 with the OS error."""
    deny(monkeypatch, trace_path(healthy_dir, 1))
    assert main(["replay", str(healthy_dir), "--rank", "1"]) == 2
    assert "rank 1: cannot read" in (err := capsys.readouterr().err) and "Permission denied" in err

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(healthy_dir), "iterdir", refuse)
    assert main(["replay", str(healthy_dir)]) == 2
    assert "cannot list the trace files of" in (err := capsys.readouterr().err) and "Permission denied" in err


@pytest.fixture(scope="module")
def two_rank_dir(tmp_path_factory):
    job = SyntheticJob(world=2, trace_dir=(d := tmp_path_factory.mktemp("two") / "logs"), keep=False)
    job.run(25)
    job.close()
    return d


@pytest.mark.parametrize("event, where, key, value, said", [
    ("transition", {"trigger": "plan_ready"}, "moves", None, "event data of the wrong type"),
    ("transition", {"trigger": "layer_done"}, "layer", [0], "event data of the wrong type"),
    ("transition", {"trigger": "plan_ready"}, "source", ["planning"], "recorded source ['planning']"),
    ("transition", {"trigger": "committed"}, "dest", ["collecting"], "field 'dest' is list"),
    ("collective_start", {"step": 19}, "op", ["all_reduce"], "issued ['all_reduce']"),
    ("collective_start", {"op": "batch_isend_irecv"}, "layer", [0], "layer [0]"),
    ("collective_start", {"op": "batch_isend_irecv"}, "wave", [0], "collective_mismatch"),
    ("collective_start", {"step": 19}, "event", ["collective_start"], "field 'event' is list"),
    ("header", {}, "world", 10**20, "world 100000000000000000000 is not a plausible job size"),
    ("header", {}, "rank", 10**20, "outside the world of 2"),
])
def test_a_wrong_typed_field_is_reported_never_a_traceback(two_rank_dir, tmp_path, capsys, event, where, key, value,
                                                          said):
    """One field of one record set to a list, null or a huge number: a verdict and what was wrong, no exception."""
    logs = tmp_path / "logs"
    shutil.copytree(two_rank_dir, logs)
    path = logs / "rank00001.jsonl"
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if (rec := json.loads(line))["event"] == event
             and all(rec.get(k) == v for k, v in where.items()))
    lines[i] = json.dumps(dict(json.loads(lines[i]), **{key: value}), separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(logs)]) in (0, 1)
    out = capsys.readouterr().out
    assert out.split(":")[0] in ("healthy", *KINDS) and said in out, out


def test_help_says_healthy_is_agreement_up_to_where_the_traces_stop(tmp_path, capsys):
    """--help words exit 0 as the verdict table does: ranks without an `end` record can be healthy too."""
    job = SyntheticJob(world=2, trace_dir=tmp_path / "logs", keep=False)
    job.run(12)                        # no close(): no rank wrote `end`
    assert main(["replay", str(tmp_path / "logs")]) == 0
    for session in job.sessions:       # closed without `end`: no open trace outlives the test
        session.trace.close()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "0 healthy: every rank agrees, up to where its trace stops" in help_text
    assert "ended in order" not in help_text


def test_a_negative_header_rank_is_ignored_with_a_warning(two_rank_dir, tmp_path, capsys):
    """A header claiming rank -1: the file name's rank is used and the field named, never a traceback."""
    logs = tmp_path / "logs"
    shutil.copytree(two_rank_dir, logs)
    path = logs / "rank00001.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = json.dumps(dict(json.loads(lines[0]), rank=-1), separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(logs)]) in (0, 1)
    out = capsys.readouterr().out
    assert out.split(":")[0] in ("healthy", *KINDS) and "-1" in out, out


@pytest.mark.parametrize("as_json", [False, True])
def test_a_rank_timeline_with_an_unhashable_seq_is_printed(two_rank_dir, tmp_path, capsys, as_json):
    """--rank R over a record whose seq is a list: the timeline is printed (exit 0), never a TypeError."""
    logs = tmp_path / "logs"
    shutil.copytree(two_rank_dir, logs)
    path = logs / "rank00001.jsonl"
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "transition")
    lines[i] = json.dumps(dict(json.loads(lines[i]), seq=[]), separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(logs), "--rank", "1", *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    assert (json.loads(out)["timeline"] if as_json else out.count("\n")) , out


@pytest.mark.parametrize("where", ["alone", "appended"])
def test_a_line_nested_past_the_json_depth_limit_is_an_unreadable_line(two_rank_dir, tmp_path, capsys, where):
    """A line of 100000 nested brackets (json's RecursionError): counted as unreadable, in replay and --rank."""
    logs = tmp_path / "logs"
    shutil.copytree(two_rank_dir, logs)
    deep = "[" * 100_000 + "]" * 100_000
    path = logs / "rank00001.jsonl"
    if where == "alone":
        path.write_text(deep + "\n")
        assert main(["replay", str(logs)]) == 1        # rank 1 has no readable record: named, not a traceback
        assert "rank 1" in capsys.readouterr().out
    else:
        path.write_text(path.read_text() + deep + "\n")
        assert main(["replay", str(logs)]) == 0
        assert "healthy" in capsys.readouterr().out
        assert main(["replay", str(logs), "--rank", "1"]) == 0
        assert "1 unreadable line(s) skipped" in capsys.readouterr().out


def test_replay_imports_no_torch(hang_dir):
    """`eplb-fsm replay` reads traces without importing torch (1.5 s or more of start-up on a login node)."""
    import subprocess
    import sys

    script = ("import sys\nfrom eplb_fsm.cli import main\ncode = main(['replay', sys.argv[1], '--json'])\n"
              "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    done = subprocess.run([sys.executable, "-c", script, str(hang_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "1 []", done.stdout[-500:]
