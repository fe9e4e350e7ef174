"""Tests for eplb_fsm.sim.plot: the balancedness PNG and what it shows beside the measured series."""

from __future__ import annotations

import sys

import pytest

from eplb_fsm.sim import plot

SERIES = [(s, 0.7 + 0.2 * (s >= 25)) for s in range(300)]
REARRANGEMENTS = [
    {"step": 24, "end_step": 25, "outcome": "committed", "balancedness_before": 0.79, "balancedness_after": 0.99,
     "measured_after": 0.9},
    {"step": 124, "end_step": 124, "outcome": "skipped", "balancedness_before": 0.9, "balancedness_after": 0.91,
     "measured_after": None},
]
SCALINGS = [
    {"step": 100, "from_ranks": 4, "to_ranks": 2, "requested_ranks": 2, "outcome": "switched"},
    {"step": 150, "from_ranks": 2, "to_ranks": 2, "requested_ranks": 3, "outcome": "aborted"},
    {"step": 180, "from_ranks": None, "to_ranks": None, "requested_ranks": 2, "outcome": "skipped"},
    {"step": 200, "from_ranks": 2, "to_ranks": 4, "requested_ranks": 4, "outcome": "switched"},
]


def test_rank_timeline_follows_the_scales_that_changed_the_group():
    """Switched scales change the rank count; aborted and same-size ones do not."""
    assert plot.rank_timeline(4, SCALINGS) == [(0, 4), (100, 2), (200, 4)]
    assert plot.rank_timeline(4) == [(0, 4)]


def _drawn(monkeypatch):
    """Capture the figure plot_balancedness saves (the PNG is written too)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    seen = {}
    original = Figure.savefig

    def capture(self, *args, **kwargs):
        seen["figure"] = self
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", capture)
    return seen


def test_elastic_plot_shows_planned_measured_phases_scales_and_ranks(tmp_path, monkeypatch):
    """The PNG carries planned markers, the measured mean after, drift phases, scale events and the rank count."""
    seen = _drawn(monkeypatch)
    path, note = plot.plot_balancedness(SERIES, REARRANGEMENTS, tmp_path / "b.png", title="4 -> 2 -> 4 ranks",
                                        phase_start=75, phase_steps=100, window=40, scalings=SCALINGS, ranks=4)
    assert note is None and path == str(tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = seen["figure"]
    main_ax, ranks_ax = fig.axes
    labels = [t.get_text() for t in main_ax.get_legend().get_texts()]
    for label in ("planned, new placement", "planned, old placement", "measured mean, 40 steps after",
                  "drift phase (load changes at each edge)", "scale event", "ranks", "rearrangement", "skipped"):
        assert label in labels, labels
    (line,) = ranks_ax.get_lines()
    assert list(line.get_ydata()) == [4, 2, 4, 4] and list(line.get_xdata()) == [0, 100, 200, 299]
    assert "4 -> 2 -> 4 ranks" == main_ax.get_title()
    assert any("planned" in t.get_text() and "measured" in t.get_text() for t in fig.texts)  # the caption
    annotations = [c.get_text() for c in main_ax.texts]
    assert "4->2" in annotations and "2->4" in annotations and "->2 skipped" in annotations


def test_fixed_group_plot_has_no_rank_axis_or_phases_without_drift(tmp_path, monkeypatch):
    """Without scalings there is one axis; without drift phases nothing is shaded."""
    seen = _drawn(monkeypatch)
    path, _ = plot.plot_balancedness(SERIES, REARRANGEMENTS, tmp_path / "b.png", window=40, ranks=4)
    assert path is not None
    fig = seen["figure"]
    assert len(fig.axes) == 1
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "ranks" not in labels and not any(label.startswith("drift phase") for label in labels)


def test_plot_says_why_without_matplotlib(tmp_path, monkeypatch):
    """Without matplotlib the PNG is skipped with a reason instead of an error."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path, note = plot.plot_balancedness([(0, 0.5), (1, 0.9)], [], tmp_path / "b.png")
    assert path is None and "matplotlib" in note
    assert not (tmp_path / "b.png").exists()


def test_empty_series_is_a_note(tmp_path):
    """Nothing to plot is a reason, not an error, and no file."""
    assert plot.plot_balancedness([], [], tmp_path / "b.png") == (None, "no balancedness samples to plot")
    assert not (tmp_path / "b.png").exists()
