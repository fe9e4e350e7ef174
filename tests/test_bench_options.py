"""The option checks the bench verbs share (eplb_fsm.bench.options)."""

from __future__ import annotations

import pytest

from eplb_fsm.bench import options


def test_refuse_raises_the_first_failed_rule_only():
    """refuse() names the verb and the first rule that failed; passing rules raise nothing."""
    options.refuse("step", [(True, "never shown")])
    with pytest.raises(SystemExit) as info:
        options.refuse("step", [(True, "a"), (False, "--x must be >= 1, got 0"), (False, "--y")])
    assert info.value.code == "eplb-fsm bench step: --x must be >= 1, got 0"


@pytest.mark.parametrize("value, ok", [(0, False), (1, True), (1024, True), (1025, False), (100000, False)])
def test_thread_rule_bounds_the_count_to_1_through_1024(value, ok):
    """A thread count is taken in 1..1024, and the rule names the option, the range and the value."""
    assert options.thread_rule("--torch-threads", value) == (
        ok, f"--torch-threads must be in 1..1024 (threads), got {value}")


def test_memory_rule_compares_with_physical_memory(monkeypatch):
    """Up to the machine's memory passes, a byte more is refused naming what needs it; no figure: nothing refused."""
    monkeypatch.setattr(options, "physical_memory", lambda: 2**30)
    assert options.memory_rule(2**30, "--x 1")[0] is True
    ok, rule = options.memory_rule(2**31, "--x 2")
    assert not ok and rule == "--x 2 needs at least 2 GiB of memory, more than this machine's 1 GiB"
    monkeypatch.setattr(options, "physical_memory", lambda: None)
    assert options.memory_rule(2**60, "--x 3")[0] is True


def test_physical_memory_is_a_positive_byte_count_here():
    """On Linux the OS reports the machine's memory (the figure the memory rules compare with)."""
    total = options.physical_memory()
    assert total is None or total > 2**20


def test_disk_rule_compares_with_the_folders_free_space(tmp_path):
    """Within the free space passes; a write past it is refused naming what writes it and the folder."""
    assert options.disk_rule(1, "--x 1", str(tmp_path))[0] is True
    ok, rule = options.disk_rule(2**70, "--x 2", str(tmp_path))
    assert not ok and rule.startswith("--x 2 writes at least ") and f" to {tmp_path}, which has " in rule


@pytest.mark.parametrize("runs, follows", [(1, False), (6, False), (7, True), (21, True)])
def test_judged_on_says_how_many_runs_a_median_took(runs, follows):
    """judged_on() names the statistic and the run count, and whether that is issue 14's >= 7."""
    assert options.judged_on(runs) == {"statistic": "median", "runs": runs, "option": "--repeats", "method_runs": 7,
                                       "follows_method": follows}


@pytest.mark.parametrize("rule, ok, text", [
    (options.at_least("--layers", 0, 1), False, "--layers must be >= 1, got 0"),
    (options.positive_finite("--mb", float("nan")), False, "--mb must be > 0 and finite, got nan"),
    (options.positive_finite("--mb", 0.5), True, "--mb must be > 0 and finite, got 0.5"),
    (options.seed_rule(-1), False, "--seed must be >= 0 (a numpy seed), got -1"),
    (options.timeout_rule(float("inf")), False, "--timeout must be in (0, 1e+06] seconds, got inf"),
    (options.timeout_rule(60.0), True, "--timeout must be in (0, 1e+06] seconds, got 60.0"),
])
def test_shared_rules_name_the_option_and_the_rule(rule, ok, text):
    """Each shared rule holds or not as its bound says, and its text names the option, the rule and the value."""
    assert rule == (ok, text)
