"""``eplb-fsm diagram``: writes mermaid/DOT, refreshes the doc block, --check, optional images."""

from __future__ import annotations

import builtins
import os
import shlex

import pytest

from eplb_fsm.cli import main
from eplb_fsm.inspect import diagrams


def test_writes_mermaid_and_dot_by_default(tmp_path, capsys):
    """With no --format the command writes eplb_machine.mmd and .dot matching the renderers."""
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "eplb_machine.mmd").read_text() == diagrams.render_mermaid()
    assert (tmp_path / "eplb_machine.dot").read_text() == diagrams.render_dot()
    assert "wrote" in capsys.readouterr().out


def test_check_exits_1_when_stale_and_0_when_fresh(tmp_path, capsys):
    """--check writes nothing, exits 1 on missing/stale files and 0 once they are regenerated."""
    assert main(["diagram", "--out", str(tmp_path), "--check"]) == 1
    assert not any(tmp_path.iterdir())
    assert "stale" in capsys.readouterr().out
    main(["diagram", "--out", str(tmp_path)])
    assert main(["diagram", "--out", str(tmp_path), "--check"]) == 0


def test_doc_block_is_refreshed(tmp_path):
    """--doc rewrites the marked mermaid block of a markdown page; a page without markers is exit 2."""
    doc = tmp_path / "machine.md"
    doc.write_text(f"# Machine\n{diagrams.DOC_BEGIN}\n{diagrams.DOC_END}\ntail\n")
    assert main(["diagram", "--out", str(tmp_path / "d"), "--format", "mermaid", "--doc", str(doc)]) == 0
    assert diagrams.embedded_mermaid(doc.read_text()) == diagrams.render_mermaid()
    assert main(["diagram", "--out", str(tmp_path / "d"), "--format", "mermaid", "--doc", str(doc),
                 "--check"]) == 0
    bare = tmp_path / "bare.md"
    bare.write_text("# nothing\n")
    assert main(["diagram", "--out", str(tmp_path / "d"), "--doc", str(bare)]) == 2
    assert main(["diagram", "--out", str(tmp_path / "d"), "--doc", str(tmp_path / "absent.md")]) == 2


def test_images_are_skipped_cleanly_without_pygraphviz(tmp_path, capsys, monkeypatch):
    """svg/png without pygraphviz: a message on stderr, the text formats still written, exit 0."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "pygraphviz":
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    assert main(["diagram", "--out", str(tmp_path), "--format", "mermaid,svg,png"]) == 0
    err = capsys.readouterr().err
    assert "skipped svg" in err and "skipped png" in err and "pip install" in err
    assert (tmp_path / "eplb_machine.mmd").exists()
    assert not (tmp_path / "eplb_machine.svg").exists()


def test_images_are_written_with_pygraphviz(tmp_path):
    """With pygraphviz installed, svg and png files are produced from the DOT text."""
    pytest.importorskip("pygraphviz")
    assert main(["diagram", "--out", str(tmp_path), "--format", "svg,png"]) == 0
    assert (tmp_path / "eplb_machine.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (tmp_path / "eplb_machine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_format_is_a_usage_error(tmp_path, capsys):
    """--format gif is rejected by argparse (exit 2) naming the valid formats."""
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--out", str(tmp_path), "--format", "gif"])
    assert info.value.code == 2
    assert "mermaid, dot, svg, png" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, option, rule",
    [
        (lambda t: ["--out", str(t / "file.txt")], "--out", "is not a folder"),
        (lambda t: ["--out", str(t / "file.txt" / "sub")], "--out", "is not a folder"),
        (lambda t: ["--out", str(t / "d"), "--doc", str(t)], "--doc", "is not a file"),
        (lambda t: ["--out", str(t / "d"), "--doc", str(t / "absent.md")], "--doc", "does not exist"),
        (lambda t: ["--out", str(t / "d"), "--doc", str(t / "file.txt")], "--doc", "no diagram markers"),
    ],
)
def test_bad_paths_exit_2_before_writing(tmp_path, capsys, make, option, rule):
    """A bad --out or --doc prints a line naming the option and rule, exits 2 and writes no file."""
    (tmp_path / "file.txt").write_text("no generated block here\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["diagram", *make(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, a page without the markers too
    assert err.startswith(f"eplb-fsm diagram: error: {option}") and rule in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_doc_without_markers_is_one_line_naming_both_markers(tmp_path, capsys):
    """--doc on a page without the markers prints one error line that names the BEGIN and END marker lines."""
    from eplb_fsm.inspect.diagrams import DOC_BEGIN, DOC_END

    page = tmp_path / "page.md"
    page.write_text("# a page\n")
    assert main(["diagram", "--out", str(tmp_path / "d"), "--doc", str(page)]) == 2
    err = capsys.readouterr().err
    assert err == (f"eplb-fsm diagram: error: --doc: {page}: no diagram markers found (add the BEGIN/END marker "
                   f"lines, each on its own line: {DOC_BEGIN} and {DOC_END})\n")
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_an_out_folder_the_file_system_refuses_exits_2(capsys):
    """A folder that passes the checks but cannot be made (/proc takes no new folders) is one error line, exit 2."""
    assert main(["diagram", "--out", "/proc/eplb-fsm-diagrams"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm diagram: error: --out: cannot create /proc/eplb-fsm-diagrams")
    assert "Traceback" not in err


def test_check_with_nothing_to_compare_is_a_usage_error(tmp_path, capsys):
    """--check with no mermaid/dot format and no --doc exits 2 naming --check, instead of reporting up to date."""
    out = tmp_path / "empty"
    assert main(["diagram", "--out", str(out), "--check", "--format", "svg"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("eplb-fsm diagram: error: --check") and "mermaid or dot" in captured.err
    assert "up to date" not in captured.out and not out.exists()


def test_check_hint_regenerates_the_folder_checked(tmp_path, capsys):
    """The 'regenerate with' hint of a stale --check names the --out given, so running it fixes that folder."""
    out = tmp_path / "my diagrams"
    assert main(["diagram", "--out", str(out), "--check"]) == 1
    assert f"regenerate with: eplb-fsm diagram --out {shlex.quote(str(out))}\n" in capsys.readouterr().out
    assert main(["diagram", "--out", str(out)]) == 0
    assert main(["diagram", "--out", str(out), "--check"]) == 0


def test_a_folder_where_a_file_goes_is_refused_before_anything_is_written(tmp_path, capsys):
    """--out holding a folder named eplb_machine.dot: one error line naming --out and that path, exit 2, and
    eplb_machine.mmd is not written either (no half-written output)."""
    (tmp_path / "eplb_machine.dot").mkdir()
    assert main(["diagram", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"eplb-fsm diagram: error: --out: {tmp_path / 'eplb_machine.dot'} exists and is not a file " \
                  "(move or remove it)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eplb_machine.dot"]


def test_a_write_the_file_system_refuses_is_one_line_and_leaves_the_old_files(tmp_path):
    """A real failed write (the process may write at most 100 bytes a file: EFBIG) is one `--out: cannot write`
    line, exit 2; the files already there keep their content and no temp file is left."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "d"
    out.mkdir()
    (out / "eplb_machine.mmd").write_text("old mermaid\n")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))  # Python ignores SIGXFSZ: the write fails with EFBIG

    run = subprocess.run([sys.executable, "-m", "eplb_fsm", "diagram", "--out", str(out)], capture_output=True,
                         text=True, timeout=120, preexec_fn=small_files)
    assert run.returncode == 2, run
    assert run.stderr == f"eplb-fsm diagram: error: --out: cannot write {out / 'eplb_machine.mmd'}: File too large\n"
    assert sorted(p.name for p in out.iterdir()) == ["eplb_machine.mmd"]
    assert (out / "eplb_machine.mmd").read_text() == "old mermaid\n"


def test_files_are_replaced_whole_with_their_mode_kept(tmp_path):
    """A rewrite goes through a temp file renamed over the old one: new content, the old file's mode, no temp left."""
    out = tmp_path / "d"
    assert main(["diagram", "--out", str(out)]) == 0
    (out / "eplb_machine.dot").write_text("stale\n")
    os.chmod(out / "eplb_machine.dot", 0o640)
    assert main(["diagram", "--out", str(out)]) == 0
    assert (out / "eplb_machine.dot").read_text() == diagrams.render_dot()
    assert (os.stat(out / "eplb_machine.dot").st_mode & 0o777) == 0o640
    assert sorted(p.name for p in out.iterdir()) == ["eplb_machine.dot", "eplb_machine.mmd"]


def test_a_doc_behind_a_symlink_is_refreshed_through_the_link(tmp_path):
    """--doc naming a symlink: the page it points to gets the fresh block and the link stays a link."""
    page = tmp_path / "real.md"
    page.write_text(f"# page\n{diagrams.DOC_BEGIN}\nold\n{diagrams.DOC_END}\n")
    link = tmp_path / "link.md"
    link.symlink_to(page)
    assert main(["diagram", "--out", str(tmp_path / "d"), "--doc", str(link)]) == 0
    assert link.is_symlink() and diagrams.render_mermaid() in page.read_text()


def test_the_doc_page_is_rewritten_in_place_keeping_its_inode_and_hard_links(tmp_path):
    """--doc: the page keeps its inode, so a hard link to it shows the fresh block (a rename would leave it stale)."""
    page = tmp_path / "page.md"
    page.write_text(f"# page\n{diagrams.DOC_BEGIN}\nold\n{diagrams.DOC_END}\n")
    twin = tmp_path / "twin.md"
    os.link(page, twin)
    inode = page.stat().st_ino
    assert main(["diagram", "--out", str(tmp_path / "d"), "--doc", str(page)]) == 0
    assert page.stat().st_ino == inode and page.stat().st_nlink == 2
    assert diagrams.render_mermaid() in twin.read_text()
