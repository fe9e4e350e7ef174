"""The package's shape: no module reads another's private names, no import cycle, no module over 400 lines.

The line limits (400 lines, 120 characters) hold for the package's C sources and headers too.

Everything here reads source with ``ast``; nothing is imported. The scanner functions
take a package directory, so the tests at the end also prove on a planted package that
each check does catch what it looks for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eplb_fsm

PACKAGE_DIR = Path(eplb_fsm.__file__).resolve().parent
MAX_LINES = 400
MAX_LINE_LENGTH = 120

# Allow-lists of known violations: empty. A new violation must be fixed, not listed; the
# lists (and test_allow_lists_name_only_live_violations) stay for a migration in flight.
ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str]] = set()
ALLOWED_PRIVATE_ATTRIBUTE_MODULES: set[str] = set()
# Modules over MAX_LINES today (none: every module has been split by idea).
ALLOWED_LONG_MODULES: set[str] = set()
# Private-looking names of other libraries that are their public API (both in the Python docs: the process
# exit without clean-up, and every thread's top frame, which engine_wait reads)
EXTERNAL_PRIVATE_OK = {("os", "_exit"), ("sys", "_current_frames")}


# --------------------------------------------------------------------------- scanner


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package is its ``__init__``)."""
    root = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def is_private(name: str) -> bool:
    """``_x`` is private; dunders (``__all__``, ``__version__``) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _type_checking_ids(tree: ast.AST) -> set[int]:
    """ids of every node under an ``if TYPE_CHECKING:`` block (never imported at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def _source_of(module: str, node: ast.ImportFrom, files: dict[str, Path]) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if files[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan_module(module: str, files: dict[str, Path]) -> tuple[set[str], list[str], list[str]]:
    """One module's (modules it imports at run time, private names it takes from other
    package modules as ``"source.name"``, private attributes it reads on objects other
    than ``self``/``cls`` as ``"line: expr"``)."""
    package = module.split(".")[0]
    tree = ast.parse(files[module].read_text(encoding="utf-8"))
    skip = _type_checking_ids(tree)
    imports: set[str] = set()
    private: list[str] = []
    module_aliases: dict[str, str] = {}  # local name -> package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != package:
                    continue
                if id(node) not in skip:
                    imports.add(alias.name)
                module_aliases[alias.asname or package] = alias.name if alias.asname else package
                if any(is_private(p) for p in alias.name.split(".")):
                    private.append(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _source_of(module, node, files)
            if source.split(".")[0] != package:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if id(node) not in skip:
                    imports.add(full if full in files else source)
                if full in files:
                    module_aliases[alias.asname or alias.name] = full
                if is_private(alias.name) or any(is_private(p) for p in source.split(".")):
                    private.append(full)
    attributes: list[str] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        base = node.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in module_aliases and base is node.value:
            private.append(f"{module_aliases[base.id]}.{node.attr}")  # mod._name
        elif isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue  # an object's own members
        elif isinstance(node.value, ast.Name) and (node.value.id, node.attr) in EXTERNAL_PRIVATE_OK:
            continue
        else:
            attributes.append(f"{node.lineno}: {ast.unparse(node)}")
    imports.discard(module)
    return imports, private, attributes


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> package modules it imports at run time (module level or inside functions)."""
    return {m: {t for t in scan_module(m, files)[0] if t in files} for m in files}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def source_files(package_dir: Path) -> dict[str, Path]:
    """Path relative to the package's parent -> file, for every C source and header (``.c``, ``.h``) under it."""
    root = package_dir.parent
    return {path.relative_to(root).as_posix(): path for suffix in ("*.c", "*.h")
            for path in sorted(package_dir.rglob(suffix))}


def line_counts(files: dict[str, Path]) -> dict[str, int]:
    """module -> number of lines."""
    return {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in files.items()}


def long_lines(files: dict[str, Path]) -> dict[str, list[int]]:
    """module -> numbers of its lines over MAX_LINE_LENGTH characters (modules without one left out)."""
    out = {}
    for m, p in files.items():
        lines = p.read_text(encoding="utf-8").splitlines()
        over = [i for i, line in enumerate(lines, 1) if len(line) > MAX_LINE_LENGTH]
        if over:
            out[m] = over
    return out


# --------------------------------------------------------------------------- the package


FILES = module_files(PACKAGE_DIR)
C_FILES = source_files(PACKAGE_DIR)


def test_no_module_imports_or_reads_another_modules_private_name():
    """No ``from x import _y``, ``import x._y`` or ``x._y`` on a package module, outside the allow-list."""
    found = {(m, name) for m in FILES for name in scan_module(m, FILES)[1]}
    assert sorted(found - ALLOWED_PRIVATE_IMPORTS) == []


def test_no_private_attribute_read_on_another_object():
    """Outside the allow-listed modules, ``_x`` is read only on ``self`` / ``cls``."""
    found = {m: scan_module(m, FILES)[2] for m in sorted(set(FILES) - ALLOWED_PRIVATE_ATTRIBUTE_MODULES)}
    assert {m: sites for m, sites in found.items() if sites} == {}


def test_import_graph_has_no_cycle():
    """The package's run-time import graph (lazy imports included, TYPE_CHECKING not) is acyclic."""
    assert import_cycles(import_graph(FILES)) == []


def test_no_module_over_the_line_limit():
    """Every module has at most 400 lines (allow-listed ones are split on other branches)."""
    counts = line_counts(FILES)
    assert {m: n for m, n in counts.items() if n > MAX_LINES and m not in ALLOWED_LONG_MODULES} == {}


def test_no_line_over_the_length_limit():
    """No line of any package module is longer than 120 characters."""
    assert long_lines(FILES) == {}


def test_no_test_line_over_the_length_limit():
    """No line of any test file is longer than 120 characters (the tests are read as often as the package)."""
    tests = {p.name: p for p in sorted(Path(__file__).resolve().parent.glob("*.py"))}
    assert len(tests) > 50 and long_lines(tests) == {}


def test_c_sources_exist_and_none_is_over_the_line_limit():
    """Every C source and header of the package (the extensions' kernels) has at most 400 lines."""
    assert {"eplb_fsm/policy/cnative.c", "eplb_fsm/policy/movement/csearch.c"} <= set(C_FILES)
    assert {f: n for f, n in line_counts(C_FILES).items() if n > MAX_LINES} == {}


def test_no_c_line_over_the_length_limit():
    """No line of any C source or header of the package is longer than 120 characters."""
    assert long_lines(C_FILES) == {}


def test_allow_lists_name_only_live_violations():
    """Every allow-list entry still exists and still violates, so a fixed one must leave the list."""
    private = {(m, name) for m in FILES for name in scan_module(m, FILES)[1]}
    assert ALLOWED_PRIVATE_IMPORTS <= private
    assert all(scan_module(m, FILES)[2] for m in ALLOWED_PRIVATE_ATTRIBUTE_MODULES if m in FILES)
    counts = line_counts(FILES)
    assert all(counts[m] > MAX_LINES for m in ALLOWED_LONG_MODULES if m in FILES)


# --------------------------------------------------------------------------- the checks themselves


@pytest.fixture
def planted(tmp_path: Path) -> dict[str, Path]:
    """A small package ``pkg`` with one of every violation."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import _hidden, shown\n\ndef f():\n    from pkg import c\n"
                              "# " + "x" * (MAX_LINE_LENGTH - 1) + "\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.a as alias\n"
        "if TYPE_CHECKING:\n    from pkg.sub import d\n_hidden = shown = 1\nX = alias._secret\n"
        "# " + "y" * (MAX_LINE_LENGTH - 2) + "\n"
    )
    (pkg / "c.py").write_text("from . import a\nfrom .b import shown\n\ndef g(obj):\n    return obj._inner, self_ok()\n"
                              "\ndef self_ok():\n    return 0\n" + "\n" * 400)
    (pkg / "sub" / "d.py").write_text("from ..b import shown\n\nclass K:\n    def m(self):\n        return self._own\n")
    (pkg / "sub" / "k.c").write_text("int k;\n" * (MAX_LINES + 1))
    header = ["/* " + "z" * (MAX_LINE_LENGTH - width) + " */" for width in (5, 6)]  # 121 and 120 characters
    (pkg / "sub" / "k.h").write_text("\n".join(header) + "\n")
    return module_files(pkg)


def test_scanner_flags_private_imports_and_module_attributes(planted):
    """``from pkg.b import _hidden`` and ``alias._secret`` are flagged; public names are not."""
    assert scan_module("pkg.a", planted)[1] == ["pkg.b._hidden"]
    assert scan_module("pkg.b", planted)[1] == ["pkg.a._secret"]
    assert scan_module("pkg.sub.d", planted)[1] == []


def test_scanner_flags_private_attributes_on_objects_only(planted):
    """``obj._inner`` is flagged, ``self._own`` is not."""
    assert scan_module("pkg.c", planted)[2] == ["5: obj._inner"]
    assert scan_module("pkg.sub.d", planted)[2] == []


def test_cycles_include_lazy_and_relative_imports_but_not_type_checking(planted):
    """a -> b (top), c -> a (relative), a -> c (inside a function), b -> a: one cycle; b -> sub.d is type-only."""
    graph = import_graph(planted)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.d"] == {"pkg.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []


def test_line_counts_find_the_long_module(planted):
    """The planted module padded past 400 lines is the only one over the limit."""
    assert [m for m, n in line_counts(planted).items() if n > MAX_LINES] == ["pkg.c"]


def test_long_lines_find_the_long_line(planted):
    """The planted 121-character line is flagged by its line number; b's 120-character line is not."""
    assert long_lines(planted) == {"pkg.a": [5]}


def test_c_source_checks_find_the_long_file_and_the_long_line(planted):
    """The planted C file of 401 lines and the header's 121-character line are flagged; nothing else."""
    c_files = source_files(planted["pkg"].parent)
    assert sorted(c_files) == ["pkg/sub/k.c", "pkg/sub/k.h"]
    assert [f for f, n in line_counts(c_files).items() if n > MAX_LINES] == ["pkg/sub/k.c"]
    assert long_lines(c_files) == {"pkg/sub/k.h": [1]}
