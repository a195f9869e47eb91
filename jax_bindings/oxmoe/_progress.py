"""Progress on stderr for the long jobs (the benchmark, the training job): log lines and, on a
terminal, a live bar under them.

The bar (rich.progress) shows the units done of all, the time since the start, the time left
and what runs now; the log lines scroll above it. When stderr is not a terminal (a file, CI)
there is no bar: the log lines alone, as plain text, so that the file reads as a log.
"""

from __future__ import annotations

import sys


class Progress:
    """A context manager: the bar runs inside it. ``total`` units (``unit`` names them);
    :meth:`running` says what runs now, :meth:`advance` counts a unit, :meth:`log` writes a
    line. ``live`` tells whether there is a bar (else the caller's log lines are all there is)."""

    def __init__(self, total: int, unit: str):
        self._bar = _live_bar(unit) if sys.stderr.isatty() else None
        self._task = self._bar.add_task("", total=total) if self._bar else None
        self.live = self._bar is not None

    def __enter__(self) -> Progress:
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self._bar:  # the bar stays on the screen: the units done and the time they took
            self.running("done" if exc_type is None else "stopped")
            self._bar.stop()

    def log(self, message: str) -> None:
        if self._bar:
            self._bar.console.out(message, highlight=False)  # no markup: "[1/66]" is not a style
        else:
            print(message, file=sys.stderr, flush=True)

    def running(self, what: str) -> None:
        if self._bar:
            self._bar.update(self._task, description=what)

    def advance(self) -> None:
        if self._bar:
            self._bar.advance(self._task)


def _live_bar(unit: str):
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress
    except ImportError as e:
        raise ImportError("the progress bar needs rich: pip install 'oxmoe[tools]'") from e
    return RichProgress(BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn(), TextColumn("left"),
                        TimeRemainingColumn(), TextColumn("{task.description}"), console=Console(stderr=True))
