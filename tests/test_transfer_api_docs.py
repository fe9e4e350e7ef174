"""docs/transfer.md's API block matches the code's signatures, and the transfer modules' public functions say
what they do (with tensor shapes) in a docstring."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import eplb_fsm.transfer as transfer_pkg
from eplb_fsm.transfer.buffers import TransferBuffer

DOC = Path(__file__).resolve().parent.parent / "docs" / "transfer.md"
MODULES = ["eplb_fsm.transfer", "eplb_fsm.transfer.plan", "eplb_fsm.transfer.plan_all", "eplb_fsm.transfer.batching",
           "eplb_fsm.transfer.local_copies", "eplb_fsm.sim.launcher"]


def _api_signatures() -> list[tuple[str, list[str]]]:
    """(name, parameter names) of every ``name(...) -> ...`` line of the API block's python code."""
    text = DOC.read_text()
    block = text[text.index("## API"):]
    block = block[block.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    found = []
    for m in re.finditer(r"^(\w+)\(([^()]*(?:\([^()]*\)[^()]*)*)\)\s*->", block, re.M | re.S):
        args = re.sub(r"\([^()]*\)", "", m.group(2))  # default values such as args=() carry no names
        found.append((m.group(1), [a.split("=")[0].strip(" *\n") for a in args.split(",") if a.strip(" *\n")]))
    return found


SIGNATURES = _api_signatures()


def test_the_api_block_lists_the_launcher_and_planners():
    """The parser finds the signatures this file guards (run_ranks with rank_logs, all_layer_transfers)."""
    names = dict(SIGNATURES)
    assert "rank_logs" in names["run_ranks"] and names["all_layer_transfers"][-1] == "validate"


@pytest.mark.parametrize("name,documented", SIGNATURES, ids=[n for n, _ in SIGNATURES])
def test_each_documented_signature_names_the_code_parameters_in_order(name, documented):
    """Every function the API block shows takes exactly the parameters it lists, by name and in order."""
    obj = next(getattr(importlib.import_module(m), name) for m in MODULES if hasattr(importlib.import_module(m), name))
    assert documented == list(inspect.signature(obj).parameters)


def _public_functions():
    for info in pkgutil.iter_modules(transfer_pkg.__path__):
        mod = importlib.import_module(f"eplb_fsm.transfer.{info.name}")
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                yield f"{info.name}.{name}", obj
    for name in ("ensure", "tensors", "release"):
        yield f"buffers.TransferBuffer.{name}", getattr(TransferBuffer, name)


@pytest.mark.parametrize("name,fn", list(_public_functions()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_transfer_function_has_a_docstring(name, fn):
    """Each function in a transfer module's __all__ (and the buffer's methods) has a docstring."""
    assert (inspect.getdoc(fn) or "").strip(), f"{name} has no docstring"
