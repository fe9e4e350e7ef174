"""Rearrangement blocks applied from a replayed template give what the record-by-record replay gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb_fsm.inspect import blocks
from eplb_fsm.inspect import summary as sm
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.testing import Faults, SyntheticJob, Stop
from eplb_fsm.trace import trace_path

WORLD = 3
STEPS = 600
INTERVAL = 20
LAYERS = 4


def simulate(folder: Path, faults=None, steps: int = STEPS) -> Path:
    """Rank 0's trace of a compact job: step lines and a rearrangement block every INTERVAL steps."""
    job = SyntheticJob(world=WORLD, num_layers=LAYERS, interval=INTERVAL, trace_dir=folder, ranks=[0], keep=False)
    job.run(steps, faults)
    job.close()
    return trace_path(folder, 0)


@pytest.fixture(scope="module")
def healthy_lines(tmp_path_factory) -> list[str]:
    path = simulate(tmp_path_factory.mktemp("healthy"))
    return path.read_text(encoding="utf-8").rstrip("\n").split("\n")


@pytest.fixture
def readers(monkeypatch) -> list:
    """Every BlockReader summarize_text makes, to see how many blocks took the fast path."""
    made = []

    class Spy(blocks.BlockReader):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(sm, "BlockReader", Spy)
    return made


def comparable(s: sm.RankSummary) -> tuple:
    colls = {g: [(c, e.op, e.group, e.cseq, e.shape, e.dtype, e.step, e.state, e.layer, e.seq, e.wave, e.parts,
                  e.ts, type(e.ts), e.status, e.duration_s, e.error) for c, e in idx.items()]
             for g, idx in s.collectives.items()}
    d = s.to_dict()
    d.pop("path")
    return (d, colls, dict(s.events), s.warnings, s.disorder, s.transitions, s.silences, s.illegal, s.faults,
            s.progress_after_stuck, s.num_layers)


def both(lines: list[str]) -> tuple[sm.RankSummary, sm.RankSummary]:
    """(summary through summarize_text, with blocks; summary of every record parsed and fed one by one)."""
    fast = sm.summarize_text("\n".join(lines) + "\n", 0)
    slow = sm.summarize_rank([json.loads(line) for line in lines], 0)
    return fast, slow


def block_starts(lines: list[str]) -> list[int]:
    """Line index of each rearrangement block's first record (the due step's transition)."""
    return [i for i, line in enumerate(lines) if '"trigger":"step"' in line and '"dest":"planning"' in line]


def committed_block(lines: list[str], at_least: int = 10) -> int:
    """The number of the first block from ``at_least`` on whose plan moved weights (a transfer per layer)."""
    starts = block_starts(lines)
    return next(b for b in range(at_least, len(starts)) if '"event":"collective_start"' in lines[starts[b] + 4])


def dump(rec: dict) -> str:
    return json.dumps(rec, separators=(",", ":"))


def test_the_writer_lays_records_out_as_json_dumps_does(healthy_lines):
    """The mutations below rewrite records with json.dumps; the synthetic trace is written the same way."""
    assert all(dump(json.loads(line)) == line for line in healthy_lines)


def test_identical_blocks_replay_to_the_same_summary(healthy_lines, readers):
    """A run of repeated rearrangement blocks: same summary through the fast path as record by record."""
    fast, slow = both(healthy_lines)
    assert comparable(fast) == comparable(slow)
    reader = readers[-1]
    n_blocks = len(block_starts(healthy_lines))
    assert n_blocks == STEPS // INTERVAL
    assert reader.applied >= n_blocks - 2 * reader.learned > 0, "the fast path was not taken"
    assert fast.rearrangements() == slow.rearrangements() > 0


def test_the_bench_traces_replay_to_the_same_verdict_with_and_without_blocks(tmp_path, monkeypatch):
    """Healthy and hung 3-rank jobs: the verdict, culprit, step and collective are the same with blocks off."""
    hang_step = (STEPS // INTERVAL) * INTERVAL - 1 - INTERVAL
    waiting = simulate(tmp_path / "w", Faults(stop={0: Stop(hang_step, "in_collective")}))
    culprit = simulate(tmp_path / "c", Faults(stop={0: Stop(hang_step, "before_collective")}))
    healthy = simulate(tmp_path / "h")
    for name, sources in (("hang", {0: waiting, 1: culprit, 2: waiting}), ("ok", {r: healthy for r in range(3)})):
        out = tmp_path / name
        out.mkdir()
        for r, src in sources.items():
            trace_path(out, r).write_text(src.read_text().replace(',"rank":0,', f',"rank":{r},'))
    reports = {}
    for blocks_on in (True, False):
        monkeypatch.setattr(sm, "MIN_BLOCK_LINES", blocks.MIN_BLOCK_LINES if blocks_on else 10 ** 9)
        reports[blocks_on] = {name: replay_dir(tmp_path / name).to_dict() for name in ("hang", "ok")}
    assert reports[True] == reports[False]
    hang = reports[True]["hang"]
    assert hang["verdict"] == "hang" and hang["culprit_ranks"] == [1] and hang["step"] == hang_step
    assert reports[True]["ok"]["verdict"] == "healthy"


def mutate(lines: list[str], block: int, change) -> list[str]:
    """A copy of ``lines`` with ``change(records)`` applied to the records of rearrangement block ``block``
    (the lines from its first record up to the next step line)."""
    start = block_starts(lines)[block]
    end = start
    while end < len(lines) and '"event":"step"' not in lines[end]:
        end += 1
    recs = [json.loads(line) for line in lines[start:end]]
    change(recs)
    return lines[:start] + [dump(r) for r in recs] + lines[end:]


def swap_events(recs):
    """Wrong event order: a collective's end written before its start (seqs still in order)."""
    k = next(j for j, r in enumerate(recs) if r["event"] == "collective_start")
    recs[k], recs[k + 1] = recs[k + 1], recs[k]
    recs[k]["seq"], recs[k + 1]["seq"] = recs[k + 1]["seq"], recs[k]["seq"]


def seq_gap(recs):
    """A lost line inside the block."""
    del recs[3]


def float_step(recs):
    """A mistyped field: a step written as a float."""
    recs[2]["step"] = recs[2]["step"] + 0.5


def string_cseq(recs):
    """A mistyped field: a cseq written as a string."""
    recs[1]["cseq"] = str(recs[1]["cseq"])


def other_layer_count(recs):
    """A different layer count in the block's transitions: the last layer_done does not commit at that count."""
    for r in recs:
        if r["event"] == "transition":
            r["num_layers"] = LAYERS + 1


def wrong_state(recs):
    """A record stamped with a state other than the replayed one."""
    recs[2]["state"] = "collecting"


def silence(recs):
    """Ten seconds of silence inside the block: the silence is kept."""
    for r in recs[5:]:
        r["ts"] = r["ts"] + 10.0


def reused_cseq(recs):
    """A collective started again with the cseq of an earlier block's."""
    for r in recs[1:3]:
        r["cseq"] = 0


def ended_other(recs):
    """A collective that ends with another cseq than it started with."""
    recs[2]["cseq"] = recs[2]["cseq"] + 100


@pytest.mark.parametrize("change", [swap_events, seq_gap, float_step, string_cseq,
                                    other_layer_count, wrong_state, silence, reused_cseq, ended_other])
def test_a_block_that_differs_falls_back_and_is_diagnosed_as_before(healthy_lines, readers, change):
    """A later block changed in one checked way is replayed record by record: the summary is the slow path's."""
    lines = mutate(healthy_lines, committed_block(healthy_lines), change)
    fast, slow = both(lines)
    assert comparable(fast) == comparable(slow)
    clean, _ = both(healthy_lines)
    assert comparable(fast) != comparable(clean), "the change left no trace in the summary"
    assert readers[-1].applied > 0


def test_a_number_json_refuses_makes_the_line_unreadable(healthy_lines, readers):
    """A seq written with a leading zero (no JSON number): that line is a bad line, as without blocks."""
    start = block_starts(healthy_lines)[committed_block(healthy_lines)]
    seq = json.loads(healthy_lines[start + 4])["seq"]
    lines = list(healthy_lines)
    lines[start + 4] = lines[start + 4].replace(f'"seq":{seq},', f'"seq":0{seq},')
    fast = sm.summarize_text("\n".join(lines) + "\n", 0)
    slow = sm.summarize_rank([json.loads(line) for n, line in enumerate(lines) if n != start + 4], 0, bad_lines=1)
    assert fast.bad_lines == 1
    assert comparable(fast) == comparable(slow)
    assert readers[-1].applied > 0


def test_a_changed_block_is_not_applied(healthy_lines, readers):
    """The changed block itself goes record by record: one fewer block applied than in the clean file."""
    sm.summarize_text("\n".join(healthy_lines) + "\n", 0)
    clean = readers[-1].applied
    sm.summarize_text("\n".join(mutate(healthy_lines, committed_block(healthy_lines), seq_gap)) + "\n", 0)
    assert readers[-1].applied == clean - 1


@pytest.mark.parametrize("inner", [{"x": 1, "seq": None, "y": 2}, {"seq": None, "x": 1}])
def test_a_counter_inside_a_nested_value_is_never_taken_for_the_record_s(healthy_lines, readers, inner):
    """A record's seq repeated inside a nested value: no template (same text twice) or no match (fixed text)."""
    def nested(recs):
        for r in recs:
            r["extra"] = dict(inner, seq=r["seq"])

    lines = healthy_lines
    for b in range(len(block_starts(lines))):
        lines = mutate(lines, b, nested)
    fast, slow = both(lines)
    assert comparable(fast) == comparable(slow)
    assert readers[-1].applied == 0
    if "y" in inner:
        assert readers[-1].learned == 0


def test_a_rank_that_stops_inside_a_block_is_the_hang_culprit(tmp_path, monkeypatch):
    """A file that ends inside a block (the rank died mid-transfer) is replayed like without blocks."""
    stop_at = 10 * INTERVAL - 1
    src = simulate(tmp_path / "s", Faults(stop={0: Stop(stop_at, "in_collective")}))
    lines = src.read_text().rstrip("\n").split("\n")
    fast, slow = both(lines)
    assert comparable(fast) == comparable(slow)
    assert fast.open_collectives(), "the stopped rank's last collective is open"


def test_later_error_records_for_a_template_s_collectives_do_not_leak_into_later_blocks(healthy_lines, readers):
    """collective_error records for every collective of the first blocks (the templates among them), later in
    the file: the blocks applied after them carry their own collectives' fields (no error), as record by record."""
    at = block_starts(healthy_lines)[5]
    before = json.loads(healthy_lines[at - 1])
    opened = [json.loads(line) for line in healthy_lines[:at] if '"event":"collective_start"' in line]
    errors = [dump(dict(before, event="collective_error", op=c["op"], group=c["group"], cseq=c["cseq"], error="boom",
                        seq=before["seq"] + 1 + j)) for j, c in enumerate(opened)]
    shifted = [dump(dict(r, seq=r["seq"] + len(errors))) for r in map(json.loads, healthy_lines[at:])]
    lines = healthy_lines[:at] + errors + shifted
    fast, slow = both(lines)
    assert comparable(fast) == comparable(slow)
    later = [c for idx in fast.collectives.values() for c in idx.one.values() if c.seq > before["seq"] + len(errors)]
    assert later and all(c.error is None and c.status == "ended" for c in later)
    assert readers[-1].applied > 0


def rank_file(lines: list[str], rank: int) -> str:
    """Rank 0's lines as another rank writes them: the same records but for the rank field."""
    return "\n".join(line.replace(',"rank":0,', f',"rank":{rank},') for line in lines) + "\n"


def test_templates_learned_on_one_rank_s_file_apply_to_another_s(healthy_lines, readers):
    """A second rank's file, read with the first one's templates: no template learned, the same summary
    as its record-by-record replay."""
    store = blocks.TemplateStore()
    sm.summarize_text(rank_file(healthy_lines, 0), 0, templates=store)
    assert readers[-1].learned > 0 and readers[-1].adopted == 0
    text = rank_file(healthy_lines, 1)
    fast = sm.summarize_text(text, 1, templates=store)
    slow = sm.summarize_rank([json.loads(line) for line in text.split("\n") if line], 1)
    assert comparable(fast) == comparable(slow)
    reader = readers[-1]
    assert reader.learned == 0 and reader.adopted > 0
    # every block but the last, which also holds the end record that no template has
    assert reader.applied == len(block_starts(healthy_lines)) - 1, "every whole block of the second file was applied"


def peers_changed(recs):
    """Another rank's transfer peers (a field that is no counter and no rank)."""
    for r in recs:
        if "peers" in r:
            r["peers"] = [2, 0]


def rank_as_string(recs):
    """A rank written as a string on one line of the block."""
    recs[1]["rank"] = str(recs[1]["rank"])


def rank_differs_inside(recs):
    """Two ranks in one block."""
    recs[1]["rank"] = 2


def rank_nested_too(recs):
    """A second "rank": key inside a nested value on every line."""
    for r in recs:
        r["extra"] = {"rank": r["rank"]}


@pytest.mark.parametrize("change", [peers_changed, rank_as_string, rank_differs_inside, rank_nested_too])
def test_another_file_s_block_that_differs_from_the_shared_template_is_read_as_before(healthy_lines, readers, change):
    """Blocks of a second file that differ from the first file's template in more than counters and one
    top-level integer rank are not applied from it: the summary is the record-by-record replay's."""
    store = blocks.TemplateStore()
    sm.summarize_text(rank_file(healthy_lines, 0), 0, templates=store)
    lines = healthy_lines
    for b in range(len(block_starts(lines))):
        lines = mutate(lines, b, change)
    text = rank_file(lines, 1)
    fast = sm.summarize_text(text, 1, templates=store)
    slow = sm.summarize_rank([json.loads(line) for line in text.split("\n") if line], 1)
    assert comparable(fast) == comparable(slow)
    assert readers[-1].adopted == 0 or readers[-1].learned > 0, "a changed block was taken for the template"


def test_a_replay_shares_templates_between_the_files_and_gives_the_same_report(tmp_path, monkeypatch, readers):
    """replay_dir with templates shared between rank files: the same report as with blocks off, and only
    the first file learns templates."""
    src = simulate(tmp_path / "s")
    lines = src.read_text().rstrip("\n").split("\n")
    out = tmp_path / "job"
    out.mkdir()
    for r in range(WORLD):
        trace_path(out, r).write_text(rank_file(lines, r))
    on = replay_dir(out).to_dict()
    assert [(x.learned > 0, x.adopted > 0) for x in readers] == [(True, False)] + [(False, True)] * (WORLD - 1)
    monkeypatch.setattr(sm, "MIN_BLOCK_LINES", 10 ** 9)
    assert replay_dir(out).to_dict() == on
    assert on["verdict"] == "healthy"


def test_an_end_read_before_its_start_keeps_later_blocks_off_the_template(tmp_path):
    """A collective_end whose cseq names a later block's collective: files and in-memory records warn alike."""
    from eplb_fsm.inspect import diagnose
    from eplb_fsm.testing import write_traces

    job = SyntheticJob(world=3, num_layers=2, interval=5)
    job.run(60)
    job.close()
    records = job.records()
    recs = records[0]
    # a planning all-reduce's end after the middle, renumbered to the next collective: the start of that one
    # comes later, in a block the template could otherwise stand for
    i = next(i for i, r in enumerate(recs) if i > len(recs) * 2 // 3 and r["event"] == "collective_end"
             and r.get("group") == "ep" and "loads" in r.get("parts", ()))
    recs[i] = dict(recs[i], cseq=recs[i]["cseq"] + 1)
    write_traces(records, tmp_path)
    in_memory, from_files = diagnose(records), replay_dir(tmp_path)
    assert (in_memory.verdict, in_memory.summary) == (from_files.verdict, from_files.summary)
    assert [w.replace("rank00000.jsonl", "rank 0") for w in in_memory.warnings] == \
        [w.replace("rank00000.jsonl", "rank 0") for w in from_files.warnings]
