"""The live progress line of ``eplb-fsm simulate``: every rank's state, redrawn on stderr.

Each rank writes a small JSON progress file (``eplb_fsm.sim.run.progress_path``); the
parent polls them in a thread and redraws one line (``\\r`` on a terminal, a plain line
every few seconds in a log).
"""

from __future__ import annotations

import json
import threading
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Polls the ranks' progress files and redraws one stderr line (``\\r``)."""

    def __init__(self, opts, stream: TextIO, interval_s: float = 0.25) -> None:
        self.opts = opts
        self.stream = stream
        # a log file (CI, a pipe) gets a plain line every few seconds instead of \r redraws
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval_s = interval_s if self.tty else max(interval_s, 5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="simulate-progress", daemon=True)
        self._width = 0

    def line(self) -> str:
        from eplb_fsm.sim.run import progress_path

        parts, step, committed = [], None, 0
        # every rank that wrote a file: with --scale, joiners beyond the first world too
        ranks = set(range(self.opts.ranks))
        try:
            ranks |= {int(p.stem[4:]) for p in progress_path(self.opts.log_dir, 0).parent.glob("rank*.json")
                      if p.stem[4:].isdigit()}
        except OSError:
            pass
        for rank in sorted(ranks):
            try:
                info = json.loads(progress_path(self.opts.log_dir, rank).read_text())
            except (OSError, ValueError):
                parts.append(f"r{rank}:starting")
                continue
            state = info.get("state", "?")
            if state == "transferring":
                state = f"transferring[{info.get('layer')}]"
            parts.append(f"r{rank}:{state}")
            if state != "left":  # a rank that left stopped stepping; the job goes on without it
                step = info.get("step") if step is None else min(step, info.get("step", step))
            committed = max(committed, info.get("rearrangements", 0))
        shown = "-" if step is None else step
        return f"simulate step {shown}/{self.opts.steps} | {' '.join(parts)} | rearrangements {committed}"

    def draw(self) -> None:
        text = self.line()
        if not self.tty:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.draw()

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.draw()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
