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
