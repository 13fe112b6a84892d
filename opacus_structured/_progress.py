"""Progress output of long commands (layer 0): tqdm bars on stderr.

Shown only when stderr is a terminal and ``--no-progress`` is not given; the environment
variable ``OPACUS_STRUCTURED_PROGRESS=1`` forces them on (logs, tests) and ``=0`` off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

from tqdm import tqdm

__all__ = ["enabled", "bar", "elapsed", "counting", "staged", "format_seconds"]

ENV = "OPACUS_STRUCTURED_PROGRESS"


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
