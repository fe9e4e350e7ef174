"""Diagrams of the machine: generated from the live definition, committed files not stale; the docs' tables
and event lists name what the machine has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eplb_fsm.fsm.machine import EVENT_DATA, STATES, TRANSITIONS, EplbMachine
from eplb_fsm.inspect import diagrams

ROOT = Path(__file__).resolve().parents[1]


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def test_committed_diagram_files_are_up_to_date():
    """diagrams/eplb_machine.mmd and .dot equal a fresh rendering of the current machine."""
    for path, text in diagrams.expected_files(ROOT / "diagrams").items():
        assert path.exists(), f"{path} missing: run `eplb-fsm diagram --doc docs/machine.md`"
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is stale: run `eplb-fsm diagram --doc docs/machine.md` and commit it")


def test_docs_machine_md_embeds_the_current_mermaid():
    """docs/machine.md's generated ```mermaid block equals a fresh rendering."""
    doc = (ROOT / "docs" / "machine.md").read_text(encoding="utf-8")
    assert diagrams.embedded_mermaid(doc) == diagrams.render_mermaid(), (
        "docs/machine.md diagram block is stale: run `eplb-fsm diagram --doc docs/machine.md`")
    assert diagrams.stale_files(ROOT / "diagrams", ROOT / "docs" / "machine.md") == []


def _between(text: str, start: str, end: str) -> str:
    assert start in text, f"no {start!r}"
    return text.split(start, 1)[1].split(end, 1)[0]


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def test_machine_md_events_table_is_event_data():
    """docs/machine.md's events table names every event with its data, as EVENT_DATA does, in order."""
    rows = re.findall(r"^\| `(\w+)` \|([^|]*)\|", _between(_doc("machine.md"), "## Events and their data",
                                                              "## Every transition"), re.M)
    assert [(event, tuple(re.findall(r"`(\w+)`", data))) for event, data in rows] == list(EVENT_DATA.items())


def test_machine_md_transition_table_is_the_machine_table():
    """docs/machine.md's transition table has TRANSITIONS' rows in order: event, sources, dest, guards, update."""
    doc = []
    for line in _between(_doc("machine.md"), "## Every transition", "## Diagram").splitlines():
        if not re.match(r"\|\s*\d+\s*\|", line):
            continue
        _, event, sources, dest, guards = [c.strip() for c in line.strip().strip("|").split("|")][:5]
        names = [n.strip() for code in re.findall(r"`([^`]*)`", guards) for n in code.split("&&")]
        doc.append((event.strip("`"), set(STATES) if sources == "any" else {s.strip() for s in sources.split(",")},
                    None if dest == "(internal)" else dest, [n for n in names if n.startswith(("is_", "has_"))],
                    [n for n in names if not n.startswith(("is_", "has_"))]))
    code = [(row["trigger"], set(_as_list(row["source"])), row["dest"], _as_list(row.get("conditions")),
             _as_list(row.get("before"))) for row in TRANSITIONS]
    assert doc == code


def test_events_md_and_design_md_list_every_machine_event():
    """events.md's `transition` trigger list and design.md's §4.2 event list name exactly the machine's events."""
    trigger_row = next(line for line in _between(_doc("events.md"), "### `transition`", "### `").splitlines()
                       if line.startswith("| `trigger`"))
    assert set(re.findall(r"`(\w+)`", trigger_row)) - {"trigger"} == set(EVENT_DATA)
    listed = _between(_doc("design.md"), "### §4.2", "(machine.md lists")
    data = {d for fields in EVENT_DATA.values() for d in fields}
    assert set(re.findall(r"`(\w+)`", listed)) - data == set(EVENT_DATA)


def test_every_table_row_and_source_is_an_edge_with_its_guards():
    """Each (row, source) of TRANSITIONS appears once as an edge carrying its guards and update."""
    edges = diagrams.machine_edges()
    expected = []
    for row in TRANSITIONS:
        for source in _as_list(row["source"]):
            expected.append((row["trigger"], source, row["dest"] or source,
                             tuple(_as_list(row.get("conditions"))), tuple(_as_list(row.get("before"))),
                             row["dest"] is None))
    got = [(e.trigger, e.source, e.dest, e.conditions, e.before, e.internal) for e in edges]
    assert sorted(got) == sorted(expected)


def test_transferring_self_loop_and_state_label_are_drawn():
    """transferring is labelled transferring[k] and its layer_done self-loop advances k."""
    mmd = diagrams.render_mermaid()
    dot = diagrams.render_dot()
    assert 'state "transferring[k]" as transferring' in mmd
    assert ("transferring --> transferring: layer_done [is_current_layer && has_more_layers] / advance_layer"
            in mmd)
    assert "transferring --> committing: layer_done [is_current_layer && is_last_layer]" in mmd
    assert ('transferring -> transferring [label="layer_done [is_current_layer && has_more_layers] / '
            'advance_layer"]') in dot
    assert 'collecting -> planning [label="step [is_due]"]' in dot
    assert 'planning -> planning [label="step (internal)", style=dashed]' in dot
    for state in STATES:
        assert f"  {state} [label=" in dot


def test_edges_match_transitions_builtin_mermaid():
    """transitions' own GraphMachine mermaid output has the same (source, dest, trigger) edges."""
    from transitions.extensions.diagrams import GraphMachine

    class Model:
        pass

    model = Model()
    GraphMachine(model=model, states=list(STATES), initial="collecting", auto_transitions=False,
                 transitions=[{k: v for k, v in r.items() if k != "note"} for r in TRANSITIONS],
                 graph_engine="mermaid", show_conditions=True)
    builtin = set()
    for line in model.get_graph().draw(None).splitlines():
        m = re.match(r"\s*(\w+) --> (\w+): (.*)$", line)
        if m:
            for label in m.group(3).split(" | "):
                builtin.add((m.group(1), m.group(2), label.split(" ")[0]))
    ours = {(e.source, e.dest, e.trigger) for e in diagrams.machine_edges()}
    assert ours == builtin


def test_edges_come_from_the_machine_object_not_a_copy():
    """A machine with an extra transition added at runtime shows it in the rendering."""
    m = EplbMachine(2)
    m.machine.add_transition("recovered", "scaling", "collecting", conditions="is_recoverable")
    text = diagrams.render_mermaid(diagrams.machine_edges(m))
    assert "scaling --> collecting: recovered [is_recoverable]" in text
    assert "scaling --> collecting: recovered" not in diagrams.render_mermaid()


def test_unless_guards_render_negated():
    """An ``unless`` condition is drawn as !guard."""
    e = diagrams.Edge("fault", "collecting", "failed", conditions=("a",), unless=("b",), before=("c",))
    assert e.label == "fault [a && !b] / c"


def test_dot_is_well_formed():
    """The DOT text has one digraph, balanced braces and quoted labels (parsed by pygraphviz if present)."""
    dot = diagrams.render_dot()
    assert dot.startswith("// generated") and dot.count("{") == dot.count("}")
    assert dot.count("digraph ") == 1
    try:
        import pygraphviz
    except ImportError:
        return
    graph = pygraphviz.AGraph(string=dot)
    assert set(graph.nodes()) == set(STATES) | {"__start__"}
    assert len(graph.edges()) == len(diagrams.machine_edges()) + 1


def test_embed_replaces_only_the_marked_block():
    """embed_in_markdown rewrites the block between the markers and keeps the rest of the page."""
    page = f"# T\nbefore\n{diagrams.DOC_BEGIN}\nold junk\n{diagrams.DOC_END}\nafter\n"
    out = diagrams.embed_in_markdown(page)
    assert out.startswith("# T\nbefore\n") and out.endswith("after\n")
    assert "old junk" not in out
    assert diagrams.embedded_mermaid(out) == diagrams.render_mermaid()
    assert diagrams.embed_in_markdown(out) == out  # idempotent
    with pytest.raises(ValueError, match="markers"):
        diagrams.embed_in_markdown("# no markers here\n")


def test_missing_markers_error_is_one_line_naming_both_markers():
    """A page without the markers raises one ValueError line that names the BEGIN and END marker lines exactly."""
    with pytest.raises(ValueError) as info:
        diagrams.embed_in_markdown("# no markers here\n")
    message = str(info.value)
    assert "\n" not in message and message.startswith("no diagram markers found")
    assert diagrams.DOC_BEGIN in message and diagrams.DOC_END in message


def test_stale_files_reports_edited_and_missing_files(tmp_path):
    """stale_files names a missing file, an edited file and an outdated doc block."""
    assert len(diagrams.stale_files(tmp_path)) == 2
    for path, text in diagrams.expected_files(tmp_path).items():
        path.write_text(text)
    assert diagrams.stale_files(tmp_path) == []
    mmd = tmp_path / "eplb_machine.mmd"
    mmd.write_text(mmd.read_text().replace("is_due", "is_late"))
    doc = tmp_path / "machine.md"
    doc.write_text(f"{diagrams.DOC_BEGIN}\n```mermaid\nstateDiagram-v2\n```\n{diagrams.DOC_END}\n")
    stale = diagrams.stale_files(tmp_path, doc)
    assert stale == [str(mmd), f"{doc} (embedded mermaid block)"]


def test_images_need_pygraphviz(tmp_path, monkeypatch):
    """render_image raises GraphvizUnavailable (not ImportError) when pygraphviz is missing."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "pygraphviz":
            raise ImportError("no pygraphviz")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(diagrams.GraphvizUnavailable, match="eplb-fsm\\[graphviz\\]"):
        diagrams.render_image("svg", tmp_path / "x.svg")
    with pytest.raises(ValueError):
        diagrams.render_image("gif", tmp_path / "x.gif")
