"""The controller provides every name of the elastic port, and elastic EP reads nothing private of it."""

from __future__ import annotations

import ast
from pathlib import Path

from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic.port import PORT_NAMES
from eplb_fsm.fsm.controller import EplbController


def test_the_controller_has_every_port_name():
    """Each attribute and method the port lists exists on a fresh single-rank controller."""
    ctl = EplbController(EplbConfig(window_size=2, step_interval=4))
    try:
        missing = [name for name in PORT_NAMES if not hasattr(ctl, name)]
        assert missing == []
    finally:
        ctl.close()


def test_elastic_code_uses_only_public_names_of_the_controller():
    """No ``ctl._x`` access anywhere in eplb_fsm/elastic (the port is the only way in)."""
    folder = Path(__file__).resolve().parents[1] / "eplb_fsm" / "elastic"
    private = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ctl" \
                    and node.attr.startswith("_"):
                private.append(f"{path.name}:{node.lineno} ctl.{node.attr}")
    assert private == []
