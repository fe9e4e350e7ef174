"""Tests for eplb_fsm.sim.loads: file readers, ESFT traces, synthetic loads and scenarios."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb_fsm.sim import loads
from eplb_fsm.sim.loads import (
    drift,
    esft_load_windows,
    esft_layers,
    esft_sequence_loads,
    esft_token_scores,
    iter_esft_windows,
    load_matrix,
    load_scenarios,
    scenario_load,
    zipf_load,
)

# the ESFT traces bundled with the package (eplb_fsm/data/esft_routing.npz); no test reads data outside the repository
INTENT, LAW = "esft:intent", "esft:law"
LOAD = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def _write_trace(directory: Path, layer: int, sequences: list[list[int]]) -> None:
    lines = []
    for ids in sequences:
        ids_text = "\t".join(str(i) for i in ids)
        weights = "\t".join("0.1" for _ in ids)
        lines.append(f"{ids_text}\t\t{weights}\n")
    (directory / f"expert_weights_{layer}.txt").write_text("".join(lines))


# --------------------------------------------------------------------------- readers


@pytest.mark.parametrize(
    "name, write",
    [
        ("load.npy", lambda p: np.save(p, LOAD)),
        ("load.npz", lambda p: np.savez(p, load=LOAD)),
        ("single.npz", lambda p: np.savez(p, anything=LOAD)),
        ("load.pt", lambda p: torch.save(torch.from_numpy(LOAD), p)),
        ("dict.pt", lambda p: torch.save({"load": torch.from_numpy(LOAD).int()}, p)),
        ("list.json", lambda p: p.write_text(json.dumps(LOAD.tolist()))),
        ("obj.json", lambda p: p.write_text(json.dumps({"load": LOAD.tolist()}))),
        (
            "history.json",
            lambda p: p.write_text(
                json.dumps({"load_history": [{"logical_expert_load": (LOAD / 2).tolist()}] * 2})
            ),
        ),
        (
            "summary.json",
            lambda p: p.write_text(
                json.dumps({"token_scores": {"2": {"0": 4, "1": 5, "2": 6}, "1": {"2": 3, "1": 2, "0": 1}}})
            ),
        ),
    ],
)
def test_load_matrix_formats(tmp_path, name, write):
    """Every supported file format reads back the same float64 (L, N) matrix."""
    path = tmp_path / name
    write(path)
    got = load_matrix(path)
    assert got.dtype == np.float64
    assert got.tolist() == LOAD.tolist()


def test_trace_directory_sums_token_counts(tmp_path):
    """A trace directory gives per-layer token counts, layers in numeric order."""
    _write_trace(tmp_path, 10, [[0, 1, 1], [2]])
    _write_trace(tmp_path, 2, [[2, 2, 0], [0]])
    got = load_matrix(tmp_path)
    assert got.tolist() == [[2, 0, 2], [1, 2, 1]]
    per_seq = esft_sequence_loads(tmp_path, num_experts=4)
    assert per_seq.shape == (2, 2, 4)
    assert per_seq[1].tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]


def test_directory_with_only_summary(tmp_path):
    """A directory without traces falls back to its summary.json."""
    (tmp_path / "summary.json").write_text(json.dumps({"token_scores": {"1": {"0": 0.25, "1": 0.75}}}))
    assert load_matrix(tmp_path).tolist() == [[0.25, 0.75]]


def test_example_is_bundled():
    """'example' reads the bundled 26 x 64 ESFT intent token counts (6 per token)."""
    got = load_matrix("example")
    assert got.shape == (26, 64)
    assert (got.sum(axis=1) == got.sum(axis=1)[0]).all()
    assert got.sum(axis=1)[0] % 6 == 0


def test_example_equals_intent_traces():
    """The bundled example is exactly the bundled intent trace aggregate."""
    assert (load_matrix("example") == load_matrix(INTENT)).all()


def test_real_esft_directories(tmp_path: Path):
    """The bundled ESFT tasks read as (layers present, 64) with 6 selections per token."""
    law = load_matrix(LAW)
    assert law.shape == (3, 64)
    assert law.sum(axis=1).tolist() == [6 * 8327] * 3  # source README: law has 8,327 tokens
    assert esft_layers(LAW) == [1, 13, 26] and esft_layers(INTENT) == list(range(1, 27))
    scores = esft_token_scores("law")
    summary = {"token_scores": {str(layer + 1): {str(e): float(scores[layer, e]) for e in range(64)}
                                for layer in range(26)}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    fractions = load_matrix(tmp_path / "summary.json")
    assert fractions.shape == (26, 64)
    assert fractions[0, 5] == summary["token_scores"]["1"]["5"]
    # the summary's layer-1 fractions agree with the trace counts to their 4 decimals
    assert np.abs(law[0] / law[0].sum() - fractions[0]).max() < 1e-4


def test_esft_windows():
    """Windows sum consecutive sequences: (steps, L, N), remainder dropped unless asked."""
    per_seq = esft_sequence_loads(INTENT)
    assert per_seq.shape == (127, 26, 64)
    windows = esft_load_windows(INTENT, 16)
    assert windows.shape == (7, 26, 64)
    assert (windows[1] == per_seq[16:32].sum(axis=0)).all()
    with_last = list(iter_esft_windows(INTENT, 16, drop_last=False))
    assert len(with_last) == 8 and (with_last[-1] == per_seq[112:].sum(axis=0)).all()


def test_bundled_traces_read_like_text_traces(tmp_path: Path):
    """Text trace files holding the bundled counts read back to the same (S, L, N) counts and layer choice."""
    bundled = esft_sequence_loads(LAW)
    for li, layer in enumerate([1, 13, 26]):
        _write_trace(tmp_path, layer, [np.repeat(np.arange(64), row).tolist() for row in bundled[:, li]])
    assert (esft_sequence_loads(tmp_path, num_experts=64) == bundled).all()
    assert (esft_sequence_loads(tmp_path, num_experts=64, layers=[13]) == esft_sequence_loads(LAW, layers=[13])).all()
    assert (load_matrix(tmp_path) == load_matrix(LAW)).all()


@pytest.mark.parametrize("bad, match", [("esft:nope", "unknown bundled ESFT task"), ("esft:", "unknown bundled")])
def test_unknown_bundled_task(bad, match):
    """An unknown bundled task is a ValueError naming the choices."""
    with pytest.raises(ValueError, match=match):
        load_matrix(bad)
    with pytest.raises(ValueError, match="intent, law"):
        esft_sequence_loads(bad)


def test_bundled_layer_selection_checked():
    """Asking the bundled law traces for a layer they lack names the layers present."""
    with pytest.raises(ValueError, match=r"present: \[1, 13, 26\]"):
        esft_sequence_loads(LAW, layers=[2])


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("x.npy", lambda p: np.save(p, np.ones(3)), "2-D"),
        ("x3.npy", lambda p: np.save(p, np.ones((2, 2, 2))), "2-D"),
        ("e.npy", lambda p: np.save(p, np.ones((0, 3))), "empty"),
        ("nan.npy", lambda p: np.save(p, np.array([[1.0, np.nan]])), "NaN"),
        ("inf.npy", lambda p: np.save(p, np.array([[1.0, np.inf]])), "infinite"),
        # finite loads whose layer sum overflows: they used to become a uniform load
        ("big.json", lambda p: p.write_text("[[1e308, 1e308, 1, 1], [1, 2, 3, 4]]"), "layer 0 sum past the largest"),
        ("neg.json", lambda p: p.write_text("[[1, -2]]"), "negative"),
        ("ragged.json", lambda p: p.write_text("[[1, 2], [3]]"), "rectangular"),
        ("str.json", lambda p: p.write_text('[["a", "b"]]'), 'load\\[0\\]\\[0\\] is "a"; every load must be a JSON '
         'number'),
        ("bad.json", lambda p: p.write_text("{not json"), "cannot read as JSON"),
        ("keys.json", lambda p: p.write_text('{"other": 1}'), "none of the keys"),
        ("junk.npy", lambda p: p.write_bytes(b"not numpy"), "cannot read as .npy"),
        ("junk.pt", lambda p: p.write_bytes(b"not torch"), "cannot read as a torch file"),
        ("str.pt", lambda p: torch.save({"nope": 1}, p), "without a 'load'"),
        ("load.csv", lambda p: p.write_text("1,2"), "unknown load file type"),
        # values numpy would read as numbers, and tensors with no plain values
        ("digits.json", lambda p: p.write_text('[[1, 2], ["3", 4]]'), r'load\[1\]\[0\] is "3"'),
        ("bools.json", lambda p: p.write_text("[[1, true, 3]]"), r"load\[0\]\[1\] is true"),
        ("null.json", lambda p: p.write_text('{"load": [[1, null]]}'), r"load\[0\]\[1\] is null"),
        ("hist.json", lambda p: p.write_text('{"load_history": [{"logical_expert_load": [["1", "2"]]}]}'),
         r'load_history\[0\].logical_expert_load\[0\]\[0\] is "1"'),
        ("histsum.json", lambda p: p.write_text(json.dumps({"load_history": [{"logical_expert_load": [[1e308, 1]]}
                                                                             for _ in range(2)]})),
         "windows sum past the largest float"),
        ("score_str.json", lambda p: p.write_text('{"token_scores": {"0": {"0": "0.5", "1": 1}}}'),
         'expert 0: "0.5" is not a JSON number'),
        ("score_bool.json", lambda p: p.write_text('{"token_scores": {"0": {"0": 0.5, "1": true}}}'),
         "expert 1: true is not a JSON number"),
        ("score_huge.json", lambda p: p.write_text('{"token_scores": {"0": {"0": 1' + "0" * 400 + "}}}"),
         "malformed token_scores: int too large"),
        ("td.npy", lambda p: np.save(p, np.ones((2, 2), dtype="m8[s]")), "real numbers, got dtype timedelta64"),
        ("ld.npy", lambda p: np.save(p, np.full((1, 2), np.finfo(np.longdouble).max)), "past the largest float64"),
        ("meta.pt", lambda p: torch.save(torch.empty(2, 3, device="meta"), p), "got a meta"),
        ("sparse.pt", lambda p: torch.save(torch.eye(3).to_sparse(), p), "got a torch.sparse_coo tensor"),
        pytest.param("quant.pt", lambda p: torch.save(torch.quantize_per_tensor(torch.ones(2, 3), 0.1, 0,
                                                                              torch.quint8), p),
                     "got a quantized tensor", marks=pytest.mark.filterwarnings("ignore::UserWarning")),
    ],
)
def test_bad_files_name_the_file(tmp_path, name, content, match):
    """Unreadable, mis-shaped or invalid loads raise ValueError naming the file and the problem."""
    path = tmp_path / name
    content(path)
    with pytest.raises(ValueError, match=match) as info:
        load_matrix(path)
    assert str(path) in str(info.value)


@pytest.mark.filterwarnings("error")
def test_refusals_warn_of_nothing(tmp_path):
    """A long double past float64 and windows whose sum overflows are refused without a numpy warning first."""
    np.save(ld := tmp_path / "ld.npy", np.full((1, 2), np.finfo(np.longdouble).max))
    (hist := tmp_path / "hist.json").write_text(json.dumps({"load_history": [{"logical_expert_load": [[1e308]]}] * 2}))
    for path in (ld, hist):
        with pytest.raises(ValueError, match="past the largest"):
            load_matrix(path)


def test_missing_path_and_empty_directory(tmp_path):
    """A missing path or a directory without loads raises ValueError naming it."""
    with pytest.raises(ValueError, match="no such file"):
        load_matrix(tmp_path / "missing.npy")
    with pytest.raises(ValueError, match="neither expert_weights"):
        load_matrix(tmp_path)


def test_bad_traces(tmp_path):
    """Non-integer ids and layers with different sequence counts are rejected."""
    (tmp_path / "expert_weights_1.txt").write_text("1\tx\t\t0.1\t0.2\n")
    with pytest.raises(ValueError, match="expert_weights_1.txt:1: expert ids are not integers"):
        load_matrix(tmp_path)
    _write_trace(tmp_path, 1, [[0], [1]])
    _write_trace(tmp_path, 2, [[0]])
    with pytest.raises(ValueError, match="different numbers of sequences"):
        load_matrix(tmp_path)
    with pytest.raises(ValueError, match="no trace file for layer"):
        esft_sequence_loads(tmp_path, layers=[3])
    with pytest.raises(ValueError, match="num_experts"):
        esft_sequence_loads(tmp_path, num_experts=1, layers=[1])


# --------------------------------------------------------------------------- generators


def test_zipf_load_shape_totals_and_determinism():
    """zipf_load gives int counts summing to tokens_per_layer, reproducible from a seed."""
    a = zipf_load(5, 64, 1.0, 10_000, rng=7)
    assert a.shape == (5, 64) and a.dtype == np.int64
    assert (a.sum(axis=1) == 10_000).all()
    assert (a == zipf_load(5, 64, 1.0, 10_000, rng=7)).all()
    assert not (a == zipf_load(5, 64, 1.0, 10_000, rng=8)).all()


def test_zipf_load_follows_the_distribution():
    """The hottest expert takes about 1/H_N of the tokens and sits at a different place per layer."""
    a = zipf_load(50, 256, 1.0, 1_000_000, rng=0)
    harmonic = (1.0 / np.arange(1, 257)).sum()
    share = np.sort(a, axis=1)[:, -1] / 1_000_000
    assert share.mean() == pytest.approx(1 / harmonic, rel=0.02)
    assert len(set(a.argmax(axis=1).tolist())) > 10


def test_drift():
    """drift multiplies by lognormal noise: sigma 0 is the identity, results are reproducible."""
    base = zipf_load(3, 8, 1.0, 1000, rng=1)
    assert (drift(base, 0.0, rng=1) == base).all()
    moved = drift(base, 0.3, rng=2)
    assert moved.shape == base.shape and (moved >= 0).all()
    assert (moved == drift(torch.from_numpy(base), 0.3, rng=2)).all()
    with pytest.raises(ValueError, match="sigma"):
        drift(base, -1.0)


# --------------------------------------------------------------------------- scenarios


def test_load_scenarios_default_is_the_bundled_file(monkeypatch):
    """Without arguments or $EPLB_FSM_SCENARIOS the copy bundled with the package is read (nothing outside it)."""
    monkeypatch.delenv(loads.SCENARIOS_ENV, raising=False)
    data = load_scenarios()
    assert "dsv3_ep32_hier" in data["shapes"]
    assert Path(data["path"]) == loads.BUNDLED_SCENARIOS


def test_bundled_scenarios_hold_the_benchmark_shapes():
    """The bundled copy (byte-equal to shared/bench/scenarios.json when bundled) has every benchmark shape."""
    bundled = load_scenarios(loads.BUNDLED_SCENARIOS)
    assert set(bundled["shapes"]) == {"dsv3_ep32_hier", "dsv3_ep32_global", "dsv3_ep64_global", "qwen3_ep16",
                                      "v2lite_ep8"}
    assert bundled["shapes"]["v2lite_ep8"]["experts"] == 64
    assert bundled["synthetic_load"]["kind"] == "zipf"


def test_load_scenarios_env_override(tmp_path, monkeypatch):
    """$EPLB_FSM_SCENARIOS points load_scenarios at another file."""
    path = tmp_path / "s.json"
    spec = {"layers": 2, "experts": 4, "replicas": 4, "ranks": 2, "nodes": 1, "groups": 1}
    path.write_text(json.dumps({"shapes": {"tiny": spec}}))
    monkeypatch.setenv(loads.SCENARIOS_ENV, str(path))
    assert list(load_scenarios()["shapes"]) == ["tiny"]
    assert scenario_load("tiny").shape == (2, 4)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "cannot read scenarios"),
        ('{"shapes": {}}', "no 'shapes'"),
        ('{"shapes": {"a": {"layers": 1}}}', "positive integer 'experts'"),
        (
            '{"shapes": {"a": {"layers": 1, "experts": 4, "replicas": 5, "ranks": 2, "nodes": 1, "groups": 1}}}',
            "divisible by ranks",
        ),
    ],
)
def test_bad_scenarios(tmp_path, content, match):
    """A malformed scenarios file raises ValueError naming the file."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        load_scenarios(path)
    assert str(path) in str(info.value)


def test_scenario_load_unknown_shape():
    """Asking for a shape that is not in the file lists the known ones."""
    with pytest.raises(ValueError, match="unknown shape 'nope'.*v2lite_ep8"):
        scenario_load("nope")


def test_a_load_whose_repeated_experts_overflow_is_refused(tmp_path):
    """A file with fewer experts than the run repeats them; a layer sum that then overflows is a ValueError."""
    from eplb_fsm.sim.run import SimOptions, load_targets

    path = tmp_path / "near_max.json"
    path.write_text("[[1e308, 5e307], [1, 2]]")  # each layer's sum is finite: the file itself is accepted
    assert load_matrix(path).shape == (2, 2)
    with pytest.raises(ValueError, match="repeated to 8 experts, a layer's loads sum past the largest float"):
        load_targets(SimOptions(ranks=2, layers=2, experts=8, redundant=0, steps=10, interval=5, load=str(path)))
