"""Tests for eplb_fsm.cli and the package's lazy re-exports."""

import subprocess
import sys

import pytest

from eplb_fsm.cli import VERBS, build_parser, main


def test_help_does_not_import_torch():
    """Building the parser (``eplb-fsm --help``) imports no torch, so the command starts fast."""
    code = "import sys, eplb_fsm.cli as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_every_verb_is_wired():
    """Every listed verb parses with its minimal arguments and none is marked missing."""
    parser = build_parser()
    minimal = {"bench": ["policy"], "replay": ["somewhere"], "plan": ["--ranks", "8", "--replicas", "72"]}
    for verb in VERBS:
        args = parser.parse_args([verb, *minimal.get(verb, [])])
        assert not getattr(args, "_missing", False), verb


def test_unknown_verb_exits_with_usage_error(capsys):
    """An unknown verb is a usage error (exit 2) naming the choices."""
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_package_re_exports_resolve_lazily():
    """``from eplb_fsm import X`` gives the submodule's object; unknown names raise AttributeError."""
    import eplb_fsm
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    assert eplb_fsm.EplbConfig is EplbConfig and eplb_fsm.EplbController is EplbController
    assert set(eplb_fsm.__all__) <= set(dir(eplb_fsm))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        eplb_fsm.Nope  # noqa: B018


def _all_parsers():
    """(prog, parser) for every verb and every bench kind."""
    import argparse

    out, todo = [], [build_parser()]
    while todo:
        parser = todo.pop()
        out.append((parser.prog, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return out


def test_help_shows_every_default_and_it_is_the_real_one():
    """Every option with a default shows it in --help, and a default the help text states is the actual one."""
    import argparse
    import re

    from eplb_fsm.cli import HelpFormatter

    checked = 0
    for prog, parser in _all_parsers():
        formatter = HelpFormatter(prog)
        for action in parser._actions:
            if (not action.option_strings or action.help == argparse.SUPPRESS or action.required
                    or action.default in (None, argparse.SUPPRESS, False, True) or isinstance(action.default, list)):
                continue
            text = formatter._expand_help(action)
            assert "default" in text.lower(), f"{prog} {action.option_strings[0]}: no default in {text!r}"
            said = text.lower().split("default", 1)[1]
            if isinstance(action.default, (int, float)):
                numbers = [float(n.replace(",", "").replace("_", "")) for n in re.findall(r"-?\d[\d,_]*\.?\d*", said)]
                assert float(action.default) in numbers, f"{prog} {action.option_strings[0]}: {text!r}"
            else:
                assert str(action.default).lower() in said, f"{prog} {action.option_strings[0]}: {text!r}"
            checked += 1
    assert checked > 40


def test_version_prints_the_package_version(capsys):
    """``eplb-fsm --version`` prints the version pyproject reads from eplb_fsm.__version__, exit 0."""
    import eplb_fsm

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"eplb-fsm {eplb_fsm.__version__}"


@pytest.mark.parametrize("argv", [["simulate", "--ranks", "x"], ["plan", "--ranks", "8"], ["bench", "nope"],
                                  ["bench", "transfer", "--ranks", "x"], ["diagram", "--format", "gif"], []])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv):
    """An argparse usage error on any verb is one line naming the problem and pointing at --help, exit 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and "--help" in err, err


def test_one_name_per_idea_with_old_spellings_hidden(capsys):
    """--ranks, --slots, --repeats and --trace-dir are the names --help shows; the old ones parse to the same value."""
    parser = build_parser()
    assert parser.parse_args(["bench", "transfer", "--world", "3"]).ranks == 3
    assert parser.parse_args(["bench", "transfer", "--slots", "6"]).slots_per_rank == 6
    assert parser.parse_args(["bench", "replay", "--repeat", "2"]).repeats == 2
    assert parser.parse_args(["bench", "step", "--log-dir", "x"]).trace_dir == "x"
    assert parser.parse_args(["simulate", "--log-dir", "x"]).log_dir == "x"
    assert parser.parse_args(["simulate", "--trace-dir", "y"]).log_dir == "y"
    assert parser.parse_args(["plan", "--ranks", "8", "--replicas", "72"]).slots == 72
    for argv, shown, hidden in ((["bench", "transfer"], "--ranks", "--world"),
                                (["bench", "replay"], "--repeats", "--repeat"),
                                (["simulate"], "--trace-dir", "--log-dir"), (["plan"], "--slots", "--replicas")):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert shown in out and f"{hidden} " not in out and f"{hidden}," not in out, (argv, out)


def test_bench_without_json_prints_text_and_with_json_one_object(capsys, tmp_path):
    """bench prints indented 'key: value' text by default and one JSON object with --json, like every verb."""
    import json

    argv = ["bench", "step", "--layers", "2", "--slots", "6", "--experts", "4", "--window", "4", "--steps", "20",
            "--rounds", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert not text.lstrip().startswith("{") and "shape:" in text and "  layers: 2" in text
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"]["layers"] == 2


@pytest.mark.parametrize("argv, prog", [(["simulate", "--bogus"], "eplb-fsm simulate"),
                                        (["plan", "--ranks", "4", "--slots", "8", "extra"], "eplb-fsm plan"),
                                        (["replay", "somewhere", "--nope", "1"], "eplb-fsm replay"),
                                        (["diagram", "--out", "x", "--nope"], "eplb-fsm diagram"),
                                        (["bench", "policy", "--bogus"], "eplb-fsm bench policy")])
def test_an_unknown_option_is_refused_by_the_verb_it_was_given_to(capsys, argv, prog):
    """An argument no parser knows: one line `eplb-fsm VERB: error: unrecognized arguments: ...`, exit 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    extra = argv[-2:] if argv[-2] == "--nope" else argv[-1:]
    assert capsys.readouterr().err == (f"{prog}: error: unrecognized arguments: {' '.join(extra)}; "
                                       f"see {prog} --help\n")


@pytest.mark.parametrize("argv", [["plan", "--ranks", "4", "--slots", "64"],
                                  ["plan", "--ranks", "4", "--slots", "64", "--json"],
                                  ["diagram", "--out", "{tmp}/d"],
                                  ["diagram", "--out", "{tmp}/fresh", "--check"],
                                  ["simulate", "--ranks", "1", "--steps", "3", "--interval", "2", "--window", "1",
                                   "--no-png", "--no-progress", "--trace-dir", "{tmp}/t"],
                                  ["bench", "step", "--steps", "200", "--rounds", "1"],
                                  ["bench", "step", "--steps", "200", "--rounds", "1", "--json"]])
def test_a_reader_that_stops_early_gets_no_traceback(tmp_path, argv):
    """stdout closed by its reader before the output comes (`eplb-fsm plan ... | head -0`): no BrokenPipeError,
    the verb's own exit code."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    expected = 1 if "--check" in argv else 0  # a --check of an empty folder: stale
    proc = subprocess.Popen([sys.executable, "-m", "eplb_fsm", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything was written: every write gets EPIPE
    try:
        err = proc.stderr.read()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert code == expected, err
