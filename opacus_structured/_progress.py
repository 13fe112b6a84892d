"""Progress output of long commands (layer 0): tqdm bars on stderr, or plain lines.

Bars are shown only when stderr is a terminal and ``--no-progress`` is not given; the
environment variable ``OPACUS_STRUCTURED_PROGRESS=1`` forces them on (logs, tests) and ``=0``
off. Where no bar is drawn because stderr is not a terminal (logs, CI, notebooks), long steps
(pretraining, DP training, the noise calibration) print a plain line instead, at most every
:data:`LINE_INTERVAL` seconds (:class:`LineProgress`, :class:`Heartbeat`,
:func:`lines_wanted`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

from tqdm import tqdm

__all__ = ["enabled", "bar", "elapsed", "counting", "staged", "format_seconds",
           "lines_wanted", "LineProgress", "Heartbeat", "LINE_INTERVAL"]

ENV = "OPACUS_STRUCTURED_PROGRESS"
#: seconds between two plain progress lines (:class:`LineProgress`)
LINE_INTERVAL = 10.0


def enabled(no_progress: bool = False) -> bool:
    """Whether to draw progress: not with ``--no-progress``; ``$OPACUS_STRUCTURED_PROGRESS``
    (1/0) if set; otherwise only when stderr is a terminal."""
    if no_progress:
        return False
    forced = os.environ.get(ENV)
    if forced is not None and forced.strip() != "":
        return forced.strip() not in ("0", "false", "no", "off")
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def lines_wanted() -> bool:
    """Whether plain progress lines replace a bar: stderr is not a terminal and
    ``$OPACUS_STRUCTURED_PROGRESS`` is not ``0`` (with ``1`` a bar is drawn instead)."""
    forced = os.environ.get(ENV)
    if forced is not None and forced.strip() != "":
        return False  # 1: a bar is drawn; 0: nothing
    isatty = getattr(sys.stderr, "isatty", None)
    return not (isatty and isatty())


class LineProgress:
    """Plain progress lines ``"<desc>: k/total <unit> (t elapsed, about r left)"`` through
    ``log`` (a ``str -> None`` callable), at most every ``interval`` seconds of the clock
    :func:`now` (looked up at each call, so tests can replace it), and always at the last
    unit: progress that a log file, a CI job or a notebook shows without flooding it."""

    def __init__(self, desc: str, total: int, log: Callable[[str], None], *,
                 unit: str = "steps", interval: float = LINE_INTERVAL):
        self.desc, self.total, self.log, self.unit = desc, int(total), log, unit
        self.interval = float(interval)
        self.start = now()
        self.last = self.start
        self.lines = 0

    def update(self, done: int) -> bool:
        """Report ``done`` units if ``interval`` has passed since the last line (or at the
        end); returns whether a line was written."""
        t = now()
        if done < self.total and t - self.last < self.interval:
            return False
        self.last = t
        spent = t - self.start
        text = f"{self.desc}: {done}/{self.total} {self.unit} ({format_seconds(spent)} elapsed"
        if 0 < done < self.total:
            text += f", about {format_seconds(spent * (self.total - done) / done)} left"
        self.log(text + ")")
        self.lines += 1
        return True


class Heartbeat:
    """Plain ``"<desc>: <note> (t elapsed)"`` lines through ``log`` at most every ``interval``
    seconds of :func:`now`, for a long step whose total is not known in advance (e.g. the
    noise calibration's ε evaluations)."""

    def __init__(self, desc: str, log: Callable[[str], None], *,
                 interval: float = LINE_INTERVAL):
        self.desc, self.log, self.interval = desc, log, float(interval)
        self.start = self.last = now()

    def tick(self, note: str) -> bool:
        """Write ``note`` if ``interval`` has passed since the last line; whether it did."""
        t = now()
        if t - self.last < self.interval:
            return False
        self.last = t
        self.log(f"{self.desc}: {note} ({format_seconds(t - self.start)} elapsed)")
        return True


def bar(*, total=None, desc: str = "", show: bool, unit: str = "it", **options) -> tqdm:
    """A tqdm bar on stderr (``disable`` unless ``show``)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not show,
                leave=False, dynamic_ncols=True, **options)


@contextlib.contextmanager
def elapsed(desc: str, *, show: bool, interval: float = 0.5) -> Iterator[tqdm]:
    """An elapsed-time bar for one long call with no steps to count (refreshed by a thread)."""
    with bar(desc=desc, show=show, unit="s", bar_format="{desc}: {elapsed} elapsed") as b:
        stop = threading.Event()

        def tick():
            while not stop.wait(interval):
                b.refresh()

        thread = threading.Thread(target=tick, daemon=True) if show else None
        if thread is not None:
            thread.start()
        try:
            yield b
        finally:
            stop.set()
            if thread is not None:
                thread.join()


def counting(f: Callable, b: tqdm) -> Callable:
    """``f`` wrapped to advance bar ``b`` by one per call."""
    def wrapped(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        finally:
            b.update(1)
    return wrapped


def staged(b: tqdm, prefix: str) -> Callable[[str, int, int], None]:
    """A ``progress(stage, done, total)`` callback drawing each stage on bar ``b``."""
    def progress(stage: str, done: int, total: int) -> None:
        desc = f"{prefix}: {stage}"
        if b.desc != desc:
            b.set_description(desc, refresh=False)
            b.reset(total=total)
        b.n = done
        b.refresh()
    return progress


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def now() -> float:
    return time.perf_counter()
