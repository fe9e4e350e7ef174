"""Tests for eplb_fsm.config."""

import json

import numpy as np
import pytest

from eplb_fsm.config import MAX_SECONDS, EplbConfig


def test_defaults_match_documented_values():
    """The defaults are the documented ones (window 1000, interval 3000, no redundancy, sync, default policy)."""
    c = EplbConfig()
    assert (c.window_size, c.step_interval, c.num_redundant_experts) == (1000, 3000, 0)
    assert (c.use_async, c.policy, c.log_balancedness) == (False, "default", False)
    assert (c.log_balancedness_interval, c.enable_migration_batching) == (1, False)


def test_first_rearrangement_is_a_quarter_interval():
    """The first rearrangement comes step_interval // 4 steps after start, never at step 0."""
    assert EplbConfig(step_interval=3000).first_rearrangement_step == 750
    assert EplbConfig(step_interval=2).first_rearrangement_step == 1


def test_json_round_trip():
    """A config survives to_json/from_json unchanged."""
    c = EplbConfig(window_size=7, policy="movement_aware", use_async=True, extra={"k": 1})
    assert EplbConfig.from_json(c.to_json()) == c
    assert json.loads(c.to_json())["window_size"] == 7


def test_from_dict_and_kwargs_agree():
    """Building from a dict gives the same config as keyword arguments."""
    assert EplbConfig.from_dict({"step_interval": 10}) == EplbConfig(step_interval=10)


@pytest.mark.parametrize(
    "changes, field, rule",
    [
        ({"window_size": 0}, "window_size", ">= 1"),
        ({"window_size": 2.5}, "window_size", "integer"),
        ({"step_interval": -1}, "step_interval", ">= 1"),
        ({"num_redundant_experts": -2}, "num_redundant_experts", ">= 0"),
        ({"use_async": "yes"}, "use_async", "bool"),
        ({"log_balancedness": 1}, "log_balancedness", "bool"),
        ({"enable_migration_batching": None}, "enable_migration_batching", "bool"),
        ({"log_balancedness_interval": 0}, "log_balancedness_interval", ">= 1"),
        ({"policy": ""}, "policy", "non-empty"),
        ({"min_balancedness_gain": float("nan")}, "min_balancedness_gain", "finite"),
        ({"min_balancedness_gain": 2.0}, "min_balancedness_gain", "<= 1"),
        ({"collective_timeout_s": 0}, "collective_timeout_s", "> 0"),
        ({"watchdog_deadline_s": -1.0}, "watchdog_deadline_s", ">= 0"),
        ({"load_estimator": "median"}, "load_estimator", "one of"),
        ({"load_decay": 0.0}, "load_decay", "> 0"),
        ({"num_nodes": 0}, "num_nodes", ">= 1"),
        ({"extra": 3}, "extra", "mapping"),
        ({"extra": {"hook": object()}}, "extra", "JSON values"),
        ({"extra": {"ratio": float("nan")}}, "extra", "JSON values"),
        ({"policy": "bogus"}, "policy", "one of default, movement_aware"),
        ({"window_size": 10**12}, "window_size", "<= 100000"),
        ({"async_worker_nice": -1}, "async_worker_nice", ">= 0"),
        ({"async_worker_nice": 20}, "async_worker_nice", "<= 19"),
        ({"async_worker_nice": 1.5}, "async_worker_nice", "integer"),
        ({"async_max_bytes_per_step": -1}, "async_max_bytes_per_step", ">= 0"),
        ({"async_max_bytes_per_step": "4MB"}, "async_max_bytes_per_step", "integer"),
        ({"async_overlap_poll": 1}, "async_overlap_poll", "bool"),
        ({"align_slots": "no"}, "align_slots", "bool"),
        ({"collective_timeout_s": 1e10}, "collective_timeout_s", "<= 1000000"),
        ({"watchdog_deadline_s": 2e6}, "watchdog_deadline_s", "<= 1000000"),
        ({"window_size": np.bool_(True)}, "window_size", "integer"),
    ],
)
def test_bad_values_name_field_and_rule(changes, field, rule):
    """Every invalid value raises ValueError naming the field and the rule it breaks."""
    with pytest.raises(ValueError) as info:
        EplbConfig(**changes)
    assert field in str(info.value) and rule in str(info.value)


def test_unknown_field_is_rejected():
    """A typo in a config dict is an error that lists the known fields."""
    with pytest.raises(ValueError, match="unknown config field.*windowsize.*window_size"):
        EplbConfig.from_dict({"windowsize": 3})


def test_bad_json_is_rejected():
    """Malformed JSON gives a ValueError, not a JSONDecodeError from deep inside."""
    with pytest.raises(ValueError, match="not valid"):
        EplbConfig.from_json("{window_size: 3")
    with pytest.raises(ValueError, match="mapping"):
        EplbConfig.from_json("[1, 2]")


def test_a_field_given_twice_in_json_is_rejected(tmp_path):
    """A key twice in config JSON (top level or in ``extra``) is a ValueError naming it, not the last value taken."""
    with pytest.raises(ValueError, match="'window_size' twice"):
        EplbConfig.from_json('{"window_size": 3, "step_interval": 7, "window_size": 5}')
    with pytest.raises(ValueError, match="'note' twice"):
        EplbConfig.from_json('{"extra": {"note": "a", "note": "b"}}')
    path = tmp_path / "eplb.json"
    path.write_text('{"window_size": 3, "window_size": 3}', encoding="utf-8")
    with pytest.raises(ValueError, match=f"config file {path}: .*'window_size' twice"):
        EplbConfig.from_file(path)
    assert EplbConfig.from_json('{"window_size": 3, "extra": {"window_size": 4}}').window_size == 3


def test_replace_validates_again():
    """replace() returns a validated copy and leaves the original untouched."""
    c = EplbConfig()
    assert c.replace(window_size=5).window_size == 5 and c.window_size == 1000
    with pytest.raises(ValueError, match="window_size"):
        c.replace(window_size=0)


def test_unknown_keyword_is_a_value_error():
    """An unknown keyword to EplbConfig(...) is a ValueError naming it and the known fields, like from_dict."""
    with pytest.raises(ValueError, match="unknown config field.*windowsize.*window_size"):
        EplbConfig(windowsize=3)


def test_registered_policy_is_accepted():
    """A policy registered under a new name is a valid choice (the check reads the registry)."""
    from eplb_fsm.policy.registry import _REGISTRY, register_policy

    register_policy("config-test-alias", "eplb_fsm.policy.default:DefaultEplbPolicy")
    try:
        assert EplbConfig(policy="config-test-alias").policy == "config-test-alias"
    finally:
        _REGISTRY.pop("config-test-alias")


def test_from_file_reads_a_path_and_from_json_says_so(tmp_path):
    """from_file reads a JSON file; from_json given a path explains to use from_file; errors name the file."""
    path = tmp_path / "eplb.json"
    path.write_text(json.dumps({"window_size": 7, "policy": "movement_aware"}))
    assert EplbConfig.from_file(path) == EplbConfig(window_size=7, policy="movement_aware")
    assert EplbConfig.from_file(str(path)).window_size == 7
    with pytest.raises(ValueError, match="from_file"):
        EplbConfig.from_json(str(path))
    with pytest.raises(ValueError, match="eplb.missing.*cannot read"):
        EplbConfig.from_file(tmp_path / "eplb.missing")
    (tmp_path / "bad.json").write_text(json.dumps({"window_size": 0}))
    with pytest.raises(ValueError, match="bad.json.*window_size must be >= 1"):
        EplbConfig.from_file(tmp_path / "bad.json")


def test_async_knobs_default_off_and_round_trip():
    """async_worker_nice and async_max_bytes_per_step default to 0 (off) and survive to_dict/from_dict."""
    assert (EplbConfig().async_worker_nice, EplbConfig().async_max_bytes_per_step) == (0, 0)
    cfg = EplbConfig(use_async=True, async_worker_nice=10, async_max_bytes_per_step=4 << 20)
    assert EplbConfig.from_dict(cfg.to_dict()) == cfg
    assert EplbConfig().async_overlap_poll is True      # posted ready flags are the default
    off = EplbConfig(use_async=True, async_overlap_poll=False)
    assert EplbConfig.from_dict(off.to_dict()) == off


def test_numpy_numbers_are_taken_and_held_as_plain_python_numbers():
    """Counts and seconds read from numpy arrays pass, and are stored as int / float, so to_json holds them."""
    c = EplbConfig(window_size=np.int64(8), num_nodes=np.int32(2), collective_timeout_s=np.float32(2.5))
    assert type(c.window_size) is int and type(c.num_nodes) is int and type(c.collective_timeout_s) is float
    assert json.loads(c.to_json())["window_size"] == 8 and c == EplbConfig(window_size=8, num_nodes=2,
                                                                          collective_timeout_s=2.5)
    assert EplbConfig(collective_timeout_s=MAX_SECONDS).collective_timeout_s == MAX_SECONDS


def test_extra_is_a_copy_the_callers_dict_cannot_change():
    """A change to the dict passed as extra after construction does not reach the config (or the trace header)."""
    settings = {"engine": "toy", "ranks": [0, 1]}
    c = EplbConfig(extra=settings)
    settings["engine"] = float("nan")
    settings["ranks"].append(object())
    assert c.extra == {"engine": "toy", "ranks": [0, 1]}
    assert json.loads(c.to_json())["extra"] == {"engine": "toy", "ranks": [0, 1]}


def test_from_dict_names_unknown_keys_that_are_not_strings():
    """A non-string key is an unknown field listed by its repr, not a TypeError from sorting mixed keys."""
    with pytest.raises(ValueError, match=r"unknown config field\(s\) 3, windw_size; known"):
        EplbConfig.from_dict({"windw_size": 5, 3: 1})


def test_check_replacement_allows_only_num_redundant_experts_to_change():
    """A running controller's config may be replaced by one differing in num_redundant_experts alone."""
    c = EplbConfig(num_redundant_experts=4)
    assert c.check_replacement(c.replace(num_redundant_experts=8)).num_redundant_experts == 8
    with pytest.raises(ValueError, match="may change only num_redundant_experts, not window_size, step_interval"):
        c.check_replacement(c.replace(window_size=4, step_interval=8))
    with pytest.raises(ValueError, match="config must be an EplbConfig, got dict"):
        c.check_replacement(c.to_dict())


@pytest.mark.parametrize("extra, where", [({1: "a", "1": "b"}, "extra"), ({"a": {2: 1}}, r"extra\['a'\]"),
                                          ({"a": [{None: 1}]}, r"extra\['a'\]\[0\]")])
def test_extra_keys_must_be_strings(extra, where):
    """A non-string key anywhere in extra is a ValueError naming extra (JSON would turn 1 into "1" and drop one)."""
    with pytest.raises(ValueError, match=rf"extra must have string keys \(JSON object keys\), got key .* in {where}$"):
        EplbConfig(extra=extra)


@pytest.mark.parametrize("given", [60, np.float64(60.0), np.int64(60), 60.0], ids=["int", "float64", "int64", "float"])
def test_float_fields_are_always_held_as_python_floats(given):
    """A float field given 60, np.float64(60) or np.int64(60) holds float 60.0, so to_dict and to_json match 60.0's."""
    config = EplbConfig(collective_timeout_s=given, load_decay=np.float64(0.5), min_balancedness_gain=0)
    reference = EplbConfig(collective_timeout_s=60.0, load_decay=0.5, min_balancedness_gain=0.0)
    for name in ("collective_timeout_s", "load_decay", "min_balancedness_gain", "watchdog_deadline_s",
                 "movement_balancedness_target"):
        assert type(getattr(config, name)) is float, name
    assert config.to_dict() == reference.to_dict() and config.to_json() == reference.to_json()


def test_equal_configs_given_as_int_and_float_replay_healthy():
    """Two ranks whose configs differ only in 60 vs 60.0 write equal headers: replay finds no config_mismatch."""
    from eplb_fsm.inspect import replay
    from eplb_fsm.testing import SyntheticJob

    as_int = EplbConfig(window_size=10, step_interval=10, collective_timeout_s=60)
    as_float = EplbConfig(window_size=10, step_interval=10, collective_timeout_s=60.0)
    job = SyntheticJob(world=2, num_layers=2, num_experts=8, interval=10, config=as_int.to_dict(),
                       config_overrides={1: as_float.to_dict()})
    job.run(25)
    records = job.records()
    assert records[0][0]["config"] == records[1][0]["config"]
    job.close()
    report = replay.diagnose(records)
    assert report.verdict == "healthy" and report.findings == [], report.findings


@pytest.mark.parametrize("name", ["collective_timeout_s", "min_balancedness_gain", "watchdog_deadline_s",
                                  "load_decay", "movement_balancedness_target"])
def test_an_integer_too_large_for_a_float_is_a_value_error(name):
    """10**400 in a float field is a ValueError naming the field and 'finite number', not an OverflowError."""
    with pytest.raises(ValueError, match=f"^{name} must be a finite number, got an integer of 1329 bits"):
        EplbConfig(**{name: 10**400})


def test_from_file_names_the_file_for_an_integer_too_large_for_a_float(tmp_path):
    """A config file holding 1 followed by 400 zeros is refused with the 'config file PATH:' prefix."""
    path = tmp_path / "cfg.json"
    path.write_text('{"collective_timeout_s": 1' + "0" * 400 + "}")
    with pytest.raises(ValueError, match=f"^config file {path}: collective_timeout_s must be a finite number"):
        EplbConfig.from_file(path)
