"""``eplb-fsm simulate`` sizes: --ranks and each --scale size capped, drift phases bounded, load targets limited.

Every limit is checked before any process starts or any folder is made: one
``eplb-fsm simulate: error: --OPTION ...`` line naming the rule, exit 2.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from eplb_fsm.cli import build_parser, main
from eplb_fsm.commands.simulate import build_options
from eplb_fsm.sim.run import target_at

# the documented limits (README, `simulate --help`): eplb_fsm.sim.elastic.MAX_RANKS, eplb_fsm.sim.targets'
# MAX_DRIFT_PHASES and MAX_TARGET_BYTES
MAX_RANKS, MAX_DRIFT_PHASES, MAX_TARGET_BYTES = 64, 1024, 256 << 20


def test_the_limits_are_the_documented_ones():
    """The constants the checks use are the values the README and --help state."""
    from eplb_fsm.sim import elastic, targets

    assert (elastic.MAX_RANKS, targets.MAX_DRIFT_PHASES, targets.MAX_TARGET_BYTES) == (
        MAX_RANKS, MAX_DRIFT_PHASES, MAX_TARGET_BYTES)


def _options(tmp_path, *argv):
    return build_options(build_parser().parse_args(["simulate", *argv, "--trace-dir", str(tmp_path / "t")]))


@pytest.mark.parametrize("argv, rule", [
    (["--ranks", "65", "--experts", "65", "--redundant", "0", "--layers", "1"],
     "--ranks must be <= 64 (each rank is a local process), got 65"),
    (["--ranks", "100000", "--experts", "100000", "--redundant", "0", "--layers", "1"],
     "--ranks must be <= 64"),
    (["--ranks", "2", "--experts", "8", "--redundant", "0", "--scale", "5:65"],
     "--scale 5:65: RANKS must be in [1, 64]"),
    (["--ranks", "2", "--experts", "8", "--redundant", "0", "--scale", "5:1000000"],
     "--scale 5:1000000: RANKS must be in [1, 64]"),
])
def test_too_many_ranks_are_refused_before_any_work(tmp_path, capsys, argv, rule):
    """--ranks or a --scale size over 64 is a ValueError naming the option, and via the command one line, exit 2."""
    with pytest.raises(ValueError, match=re.escape(rule)):
        _options(tmp_path, *argv)
    assert main(["simulate", *argv, "--no-progress", "--trace-dir", str(tmp_path / "t2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm simulate: error: {rule}") and err.count("\n") == 1, err
    assert not (tmp_path / "t2").exists()


def test_64_ranks_are_still_accepted(tmp_path):
    """The cap itself is allowed: 64 ranks, and a scale to 64 (no process started here)."""
    opts = _options(tmp_path, "--ranks", "64", "--experts", "64", "--redundant", "64", "--layers", "1",
                    "--scale", "5:32", "--scale", "9:64")
    assert opts.ranks == 64 and opts.extra["scale"] == ["5:32", "9:64"]


def test_drift_phases_are_bounded_and_reused_in_a_cycle(tmp_path):
    """A run of more drift phases than MAX_DRIFT_PHASES builds that many (L, N) targets and cycles them."""
    steps = 3 * MAX_DRIFT_PHASES
    opts = _options(tmp_path, "--steps", str(steps), "--interval", "1")
    assert opts.targets.shape == (MAX_DRIFT_PHASES, 4, 32)
    first_cycle = [target_at(opts, s) for s in range(steps)]
    phase = [1 + (s - opts.phase_start) // opts.phase_steps if s >= opts.phase_start else 0 for s in range(steps)]
    for s in range(steps):
        assert first_cycle[s] is opts.targets[phase[s] % MAX_DRIFT_PHASES] or np.array_equal(
            first_cycle[s], opts.targets[phase[s] % MAX_DRIFT_PHASES])


def test_runs_within_the_phase_bound_keep_their_targets(tmp_path):
    """Below the bound the targets are what the unbounded builder made: the base load, then one drift per phase."""
    from eplb_fsm.sim import loads

    opts = _options(tmp_path, "--steps", "400", "--interval", "100")
    rng = np.random.default_rng(0)
    base = loads.zipf_load(4, 32, exponent=1.0, tokens_per_layer=1_000_000, rng=rng)
    expected = [(np.asarray(base, dtype=np.float64) + 1e-12)]
    expected[0] = expected[0] / expected[0].sum(axis=-1, keepdims=True)
    for _ in range(len(opts.targets) - 1):
        p = np.asarray(loads.drift(expected[-1], 0.6, rng), dtype=np.float64) + 1e-12
        expected.append(p / p.sum(axis=-1, keepdims=True))
    assert len(opts.targets) == 5
    assert np.array_equal(opts.targets, np.stack(expected))


def test_load_targets_over_the_memory_limit_are_refused_before_they_are_built(tmp_path, capsys):
    """Layers x experts x drift phases over MAX_TARGET_BYTES: one line naming --layers x --experts, exit 2,
    no trace folder made."""
    # 1024 phases x 32 layers x 2048 experts x 8 bytes = 512 MiB
    argv = ["--ranks", "2", "--layers", "32", "--experts", "2048", "--redundant", "0", "--steps", "4000",
            "--interval", "1", "--no-progress", "--trace-dir", str(tmp_path / "t")]
    assert 1024 * 32 * 2048 * 8 > MAX_TARGET_BYTES
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm simulate: error: --layers x --experts: 1024 drift phases") and "512 MiB" in err
    assert f"limit of {MAX_TARGET_BYTES >> 20} MiB" in err and err.count("\n") == 1, err
    assert not (tmp_path / "t").exists()


def _never_run(*args, **kwargs):
    raise AssertionError("the run started: the size check must come before any process")


@pytest.mark.parametrize("argv, named", [
    (["--hidden", "100000"], "--hidden 100000 / --tokens 128: 2 rank process(es)"),
    (["--tokens", str(10**13)], f"--hidden 16 / --tokens {10**13}: 2 rank process(es)"),
    (["--hidden", "1" + "0" * 400], "--hidden 1000000000"),   # past float's range: still one usage line
])
def test_model_sizes_past_this_machines_memory_are_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, named):
    """A --hidden / --tokens whose toy model cannot fit in memory: one line naming them and the memory rule,
    exit 2, no rank started and no trace folder made."""
    import eplb_fsm.commands.simulate as simulate

    monkeypatch.setattr(simulate, "run_simulation", _never_run)
    base = ["--ranks", "2", "--layers", "2", "--experts", "4", "--redundant", "2", "--steps", "4", "--no-png",
            "--no-progress", "--trace-dir", str(tmp_path / "t")]
    assert main(["simulate", *base, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm simulate: error: {named}"), err
    assert "needs at least" in err and "of memory, more than this machine's" in err and err.count("\n") == 1, err
    assert not (tmp_path / "t").exists()


def test_model_bytes_per_rank_counts_weights_reference_buffer_and_products():
    """The per-rank estimate is slots + one buffered layer + the reference's two copies of every expert
    (float64 (d, d) + (d,) each), one layer's (max(N, S), T, d) products and the (T, d) batch."""
    from eplb_fsm.commands.simulate_checks import model_bytes_per_rank

    # L=2, N=4, S=3, d=10, T=5: (2*3 + 3) * 110 + 2*2*4*110 + 4*5*10 + 5*10 = 3000 float64
    assert model_bytes_per_rank(2, 4, 3, 10, 5) == 8 * 3000


def test_model_memory_counts_the_largest_scaled_group(tmp_path, monkeypatch):
    """With --scale the check counts the largest group's processes: a model that fits 2 ranks but not 4
    passes without the scale and is refused (naming 4 processes) with a scale to 4."""
    import eplb_fsm.bench.options as bench_options
    from eplb_fsm.commands.simulate_checks import model_bytes_per_rank

    per_rank = model_bytes_per_rank(4, 8, 4, 16, 128)   # the shape below: 8 experts, 4 slots a rank
    monkeypatch.setattr(bench_options, "physical_memory", lambda: int(per_rank * 3))
    argv = ["--ranks", "2", "--layers", "4", "--experts", "8", "--redundant", "0", "--steps", "20"]
    assert _options(tmp_path, *argv).ranks == 2
    with pytest.raises(ValueError, match=re.escape("--hidden 16 / --tokens 128: 4 rank process(es)")):
        build_options(build_parser().parse_args(["simulate", *argv, "--scale", "5:4", "--trace-dir",
                                                 str(tmp_path / "t2")]))
    assert not (tmp_path / "t2").exists()
