"""Tests for the ``eplb-fsm plan`` verb (eplb_fsm.commands.plan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb_fsm.cli import main
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.sim.loads import load_matrix

REPO = Path(__file__).resolve().parents[1]


def _plan_json(capsys, *argv) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_example_text(capsys):
    """Without --load the bundled example is planned and the text report has every figure."""
    assert main(["plan", "--ranks", "8", "--replicas", "72"]) == 0
    out = capsys.readouterr().out
    for word in ("initial", "new", "bound", "default", "ms", "26 layers x 64 experts"):
        assert word in out


def test_plan_json_figures(capsys):
    """The JSON report orders initial <= new <= bound and records the shape."""
    report = _plan_json(capsys, "--load", "example", "--ranks", "8", "--replicas", "72")
    assert (report["layers"], report["experts"], report["slots_per_rank"]) == (26, 64, 9)
    assert report["balancedness_initial"] < report["balancedness"] <= report["balancedness_bound"] + 1e-12
    assert report["policy_time_s"] > 0 and report["hierarchical"] is False


def test_plan_hierarchical(capsys, tmp_path):
    """Groups divisible by nodes plans hierarchically on a .npy load."""
    path = tmp_path / "load.npy"
    np.save(path, np.random.default_rng(0).integers(0, 1000, (4, 16)))
    report = _plan_json(
        capsys, "--load", str(path), "--ranks", "4", "--replicas", "20", "--nodes", "2", "--groups", "4"
    )
    assert report["hierarchical"] is True and report["nodes"] == 2


@pytest.mark.parametrize("suffix", [".npz", ".pt", ".json"])
def test_plan_out_round_trip(capsys, tmp_path, suffix):
    """--out saves the same maps the policy returns, in the format the suffix names."""
    out = tmp_path / f"plan{suffix}"
    report = _plan_json(capsys, "--ranks", "8", "--replicas", "72", "--out", str(out))
    assert report["out"] == str(out)
    expected = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(load_matrix("example")), 72, 1, 1, 8)
    if suffix == ".npz":
        with np.load(out) as data:
            saved = [data[k] for k in ("phy2log", "log2phy", "replica_count")]
    elif suffix == ".pt":
        data = torch.load(out, weights_only=True)
        saved = [data[k].numpy() for k in ("phy2log", "log2phy", "replica_count")]
    else:
        data = json.loads(out.read_text())
        saved = [np.array(data[k]) for k in ("phy2log", "log2phy", "replica_count")]
    for got, want in zip(saved, expected):
        assert (got == want.numpy()).all()


def _bad_load(tmp_path, name, array):
    path = tmp_path / name
    np.save(path, array)
    return str(path)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--ranks", "8", "--slots", "70"], "--slots"),
        (["--ranks", "8", "--slots", "56"], "--slots"),
        (["--ranks", "8", "--replicas", "70"], "--slots"),  # the old name still parses
        (["--ranks", "0", "--slots", "72"], "--ranks"),
        (["--ranks", "8", "--slots", "72", "--nodes", "0"], "--nodes"),
        (["--ranks", "8", "--slots", "72", "--groups", "3", "--nodes", "1"], "--groups"),
        (["--ranks", "6", "--slots", "72", "--groups", "4", "--nodes", "4"], "--nodes"),
        (["--ranks", "2", "--slots", "72", "--nodes", "3"], "--nodes"),  # global mode too
        (["--ranks", "8", "--redundant", "-1"], "--redundant"),
        (["--ranks", "1000000", "--slots", "1000000000"], "--ranks"),
        (["--ranks", "8", "--slots", "1000000000"], "--slots"),
        (["--ranks", "8", "--slots", "16384", "--load", "BAD:tall"], "--slots"),
        (["--ranks", "8", "--slots", "72", "--out", "plan.txt"], "--out"),
        (["--ranks", "8", "--slots", "72", "--out", "/no/such/dir/plan.pt"], "--out"),
        (["--ranks", "8", "--slots", "72", "--out", "BAD:dir"], "--out"),
        (["--ranks", "8", "--slots", "72", "--load", "/no/such/file.npy"], "--load"),
        (["--ranks", "8", "--slots", "72", "--load", "esft:nope"], "--load"),
        (["--ranks", "8", "--slots", "72", "--load", "BAD:1d"], "--load"),
        (["--ranks", "8", "--slots", "72", "--load", "BAD:nan"], "--load"),
        (["--ranks", "8", "--slots", "72", "--load", "BAD:neg"], "--load"),
        (["--ranks", "4096", "--slots", "16384", "--load", "BAD:wide", "--policy", "movement_aware"], "--policy"),
        # 64 x 4096 x (16384 - 4096 + 1) log2phy entries (25 GB) within every other limit
        (["--ranks", "8", "--slots", "16384", "--load", "BAD:log2phy"], "--slots"),
    ],
)
def test_plan_bad_input_exits_2_naming_the_option(capsys, tmp_path, argv, option):
    """Bad options or loads exit with status 2 and a message naming the option."""
    bad = {
        "BAD:1d": _bad_load(tmp_path, "one_d.npy", np.ones(64)),
        "BAD:nan": _bad_load(tmp_path, "nan.npy", np.full((2, 64), np.nan)),
        "BAD:neg": _bad_load(tmp_path, "neg.npy", -np.ones((2, 64))),
        "BAD:tall": _bad_load(tmp_path, "tall.npy", np.ones((100, 64))),
        "BAD:wide": _bad_load(tmp_path, "wide.npy", np.ones((16, 16384))),  # 2^30 layers x experts x ranks
        "BAD:log2phy": _bad_load(tmp_path, "log2phy.npy", np.ones((64, 4096))),
        "BAD:dir": str(tmp_path),
    }
    argv = [bad.get(a, a) for a in argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm plan: error: {option}:"), err
    assert err.count("\n") == 1  # one line


def test_plan_unknown_policy_lists_the_choices(capsys):
    """An unknown --policy is a usage error (exit 2) listing the registered policies on one line."""
    with pytest.raises(SystemExit) as info:
        main(["plan", "--ranks", "8", "--slots", "72", "--policy", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--policy" in err and "default" in err and "movement_aware" in err and err.count("\n") == 1


def test_plan_redundant_gives_the_slots(capsys):
    """--redundant R plans experts + R slots, the same plan as --slots N + R (and the old --replicas)."""
    by_redundant = _plan_json(capsys, "--ranks", "8", "--redundant", "8")
    by_slots = _plan_json(capsys, "--ranks", "8", "--slots", "72")
    by_replicas = _plan_json(capsys, "--ranks", "8", "--replicas", "72")
    assert by_redundant["slots"] == by_slots["slots"] == by_replicas["slots"] == 72
    assert by_redundant["balancedness"] == by_slots["balancedness"] == by_replicas["balancedness"]


def test_plan_slots_and_redundant_exclude_each_other(capsys):
    """Giving both --slots and --redundant (or neither) is a usage error."""
    for argv in (["--slots", "72", "--redundant", "8"], []):
        with pytest.raises(SystemExit) as info:
            main(["plan", "--ranks", "8", *argv])
        assert info.value.code == 2
        assert "--slots" in capsys.readouterr().err


def test_plan_missing_required_option_is_usage_error(capsys):
    """Leaving out --ranks is an argparse usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["plan", "--slots", "72"])
    assert info.value.code == 2
    assert "--ranks" in capsys.readouterr().err


def test_plan_subprocess():
    """`python -m eplb_fsm plan --json` runs end to end in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "eplb_fsm", "plan", "--json", "--ranks", "8", "--slots", "72"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["balancedness"] > report["balancedness_initial"]


def test_plan_module_does_not_import_torch_at_top():
    """Importing the verb module alone does not import torch (fast --help)."""
    code = "import sys, eplb_fsm.commands.plan; print('torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules['eplb_fsm'] = type(sys)('eplb_fsm'); "
         f"sys.modules['eplb_fsm'].__path__ = [{str(REPO / 'eplb_fsm')!r}]; {code}"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# A child whose files may not grow past 8 KiB stands in for a full disk: every plan file is
# larger, so each write fails part-way. SIGXFSZ is ignored so the write raises EFBIG.
_FULL_DISK_CHILD = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch  # imported before the limit, so nothing but the plan's own write meets it
from eplb_fsm.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
codes = {path: main(["plan", "--ranks", "8", "--slots", "72", "--out", path]) for path in sys.argv[1:]}
print(json.dumps(codes))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="needs RLIMIT_FSIZE and SIGXFSZ (Linux)")
def test_plan_out_failed_write_keeps_the_previous_file(tmp_path):
    """A write that fails part-way (file size limit) exits 2 per format and leaves the previous file and no temp."""
    previous = {f"plan{suffix}": f"previous {suffix} plan\n".encode() for suffix in (".npz", ".pt", ".json")}
    for name, data in previous.items():
        (tmp_path / name).write_bytes(data)
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, *previous], cwd=tmp_path, capture_output=True, text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {name: 2 for name in previous}, proc.stderr
    errors = proc.stderr.splitlines()
    assert len(errors) == 3 and all(line.startswith("eplb-fsm plan: error: --out: cannot write plan.") and
                                    "File too large" in line for line in errors), proc.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == previous


@pytest.mark.parametrize("suffix, error", [(".pt", RuntimeError), (".json", KeyboardInterrupt)])
def test_plan_out_writer_failing_mid_write_keeps_the_previous_file(capsys, tmp_path, monkeypatch, suffix, error):
    """A writer that stops half-way (torch's RuntimeError: exit 2; Ctrl-C: raised) leaves the old file, no temp."""
    import eplb_fsm.commands.plan as plan_module

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"\x00" * 100)
        raise error("stopped half-way")

    def written_then_interrupted(fd):   # Ctrl-C once the temporary file holds the plan, before the rename
        raise error("stopped half-way")

    if suffix == ".pt":
        monkeypatch.setattr(torch, "save", half_then_fail)
    else:
        monkeypatch.setattr(plan_module.os, "fsync", written_then_interrupted)
    out = tmp_path / f"plan{suffix}"
    out.write_bytes(b"previous plan")
    if error is RuntimeError:
        assert main(["plan", "--ranks", "8", "--slots", "72", "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"eplb-fsm plan: error: --out: cannot write {out}: stopped half-way\n"
    else:
        with pytest.raises(KeyboardInterrupt):
            main(["plan", "--ranks", "8", "--slots", "72", "--out", str(out)])
    assert [p.name for p in tmp_path.iterdir()] == [out.name] and out.read_bytes() == b"previous plan"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_plan_out_folder_that_takes_no_file_is_refused_before_the_policy(capsys, monkeypatch):
    """An --out folder that refuses new files (/proc, even to root) exits 2 before the policy runs."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the policy ran before --out was checked")

    monkeypatch.setattr(DefaultEplbPolicy, "rebalance_experts", must_not_run)
    assert main(["plan", "--ranks", "8", "--slots", "72", "--out", "/proc/eplb-fsm-plan.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm plan: error: --out: cannot create a file in /proc") and err.count("\n") == 1


def test_plan_movement_aware_repairs_the_initial_placement(capsys, tmp_path):
    """--policy movement_aware starts from the initial placement: fewer moved slots than default, within target."""
    default = _plan_json(capsys, "--ranks", "8", "--slots", "72", "--out", str(tmp_path / "d.npz"))
    aware = _plan_json(capsys, "--ranks", "8", "--slots", "72", "--policy", "movement_aware",
                       "--out", str(tmp_path / "m.npz"))
    assert 0 < aware["moved_slots"] < default["moved_slots"]
    assert aware["moved_slots_worst_layer"] <= 72 and default["moved_slots_worst_layer"] <= 72
    assert aware["balancedness"] >= 0.99 * default["balancedness"] - 1e-12  # the class's target
    from eplb_fsm.maps import initial_phy2log
    from eplb_fsm.policy.movement import moved_mask

    with np.load(tmp_path / "d.npz") as d, np.load(tmp_path / "m.npz") as m:
        assert not np.array_equal(d["phy2log"], m["phy2log"])  # not the default's plan under another name
    initial = initial_phy2log(26, 64, 72)
    for name, report in (("d.npz", default), ("m.npz", aware)):
        with np.load(tmp_path / name) as data:
            moved = moved_mask(initial, data["phy2log"], 8).sum(1)  # the policy package's own count agrees
        assert (int(moved.sum()), int(moved.max())) == (report["moved_slots"], report["moved_slots_worst_layer"])


@pytest.mark.parametrize(
    "redundant, rule",
    [
        ("20000", "at most 16384 slots per layer (a plan for more would run for minutes), got 20064 slots per "
                  "layer (64 experts + 20000 redundant)"),
        ("3", "67 slots per layer (64 experts + 3 redundant) is not divisible by --ranks 8"),
    ],
)
def test_plan_redundant_errors_name_redundant(capsys, redundant, rule):
    """Slot rules broken through --redundant name --redundant and the sum, not the --slots the user did not give."""
    assert main(["plan", "--ranks", "8", "--redundant", redundant]) == 2
    assert capsys.readouterr().err == f"eplb-fsm plan: error: --redundant: {rule}\n"


@pytest.mark.parametrize("big, layer", [(1e300, 1), (1e38, 2)])
def test_a_layer_total_past_float32_is_refused_naming_load_file_and_layer(tmp_path, capsys, big, layer):
    """Loads the policies cannot plan in float32 (a layer's total at or past 2**126): one line naming --load,
    the file and the layer, exit 2, before the policy runs."""
    load = np.ones((3, 8))
    load[layer, :] = big
    path = tmp_path / "big.npy"
    np.save(path, load)
    assert main(["plan", "--ranks", "4", "--slots", "8", "--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm plan: error: --load: {path}: layer {layer}'s loads sum to ") and "2**126" in err
    assert err.count("\n") == 1 and "--slots" not in err, err


def test_a_layer_total_just_below_the_float32_limit_is_planned(tmp_path, capsys):
    """The check is the policy's own bound: a total just below 2**126 is still planned."""
    load = np.ones((2, 8))
    load[0, :] = 2.0**126 / 8 * 0.99
    path = tmp_path / "edge.npy"
    np.save(path, load)
    assert main(["plan", "--ranks", "4", "--slots", "8", "--load", str(path)]) == 0


@pytest.mark.parametrize("tiny, layer, everywhere", [
    (1e-60, 1, True),         # becomes 0 in float32: the layer would be planned as if it had no load
    (1e-40, 0, True),         # becomes a subnormal: its ratios lose precision
    (2.0**-127, 2, False),    # one subnormal load among normal ones
    (1e-300, 1, False),
])
def test_nonzero_loads_below_float32s_normal_range_are_refused(tmp_path, capsys, monkeypatch, tiny, layer, everywhere):
    """A nonzero load that float32 holds only as 0 or a subnormal (below 2**-126): one line naming --load,
    the file, the layer and the rule, saying a power-of-2 scale-up keeps the placement; exit 2, no policy run."""
    def no_policy(*args, **kwargs):
        raise AssertionError("the policy ran")

    monkeypatch.setattr(DefaultEplbPolicy, "rebalance_experts", no_policy)
    load = np.ones((3, 8))
    load[layer, :] = np.arange(1, 9) * tiny if everywhere else load[layer, :]
    load[layer, 5] = tiny
    path = tmp_path / "tiny.npy"
    np.save(path, load)
    assert main(["plan", "--ranks", "4", "--slots", "8", "--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm plan: error: --load: {path}: layer {layer}'s nonzero loads underflow float32"), err
    assert "2**-126" in err and "power of 2" in err and err.count("\n") == 1, err


def test_the_smallest_normal_float32_load_and_zeros_are_planned(tmp_path, capsys):
    """The rule is float32's normal range: loads of exactly 2**-126, beside zeros, are still planned."""
    load = np.full((2, 8), 2.0**-126)
    load[1, ::2] = 0.0
    path = tmp_path / "edge.npy"
    np.save(path, load)
    assert main(["plan", "--ranks", "4", "--slots", "12", "--load", str(path)]) == 0


def test_a_power_of_2_scale_up_keeps_the_default_policys_placement(tmp_path, capsys):
    """What the underflow message advises holds: the same ratios scaled by 2**100 plan the same placement."""
    ratios = np.array([[1, 1, 1, 1, 1, 1, 1, 50.0], [3, 1, 4, 1, 5, 9, 2, 6]]) * 2.0**-100
    maps = []
    for scale in (1.0, 2.0**100):
        np.save(tmp_path / "load.npy", ratios * scale)
        out = tmp_path / f"maps{len(maps)}.json"
        assert main(["plan", "--ranks", "4", "--slots", "12", "--load", str(tmp_path / "load.npy"),
                     "--out", str(out)]) == 0
        maps.append(json.loads(out.read_text())["phy2log"])
    assert maps[0] == maps[1]
