r"""The dataset budget's file: its format, and reading and appending it under locks.

:class:`~opacus_structured.dataset_budget.DatasetBudget` decides (the filter, the charges);
this module only keeps the file (split out of ``dataset_budget.py`` when it passed 600 lines).

**Format**: JSON lines, append-only. Line 1 is the header (``format``, ``version``, the cap
``epsilon`` and ``delta``, ``orders``, ``tail_share``, ``route``, ``created``, ``id``); every
later line is a record with ``seq`` (1, 2, ...: a gap or a repeat is corruption), ``run``,
``kind``, ``time`` (UTC, ISO 8601), ``pid`` and, for a record that charges, ``run_rdp`` (the
run's cumulative curve, ``null`` = no bound at that order) and ``run_tail`` (its tail mass).
:class:`BudgetState` is what the lines read so far say: the records, each run's last charge and
their total.

**Locks and crashes**: :meth:`BudgetFile.locked` holds ``fcntl.flock`` on the file (shared to
read, exclusive to append); :meth:`BudgetFile.refresh` reads only the complete lines appended
since the last read; a torn last line (no newline: a write interrupted before the release it
guarded) is skipped, and cut by the next writer (``repair``); any other malformed line raises
:class:`BudgetFileError` naming it. The file is created atomically with its header (a hard
link of a written temporary file; an exclusive create under the lock where the file system has
no hard links).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import uuid
from typing import Any, Optional

import numpy as np

from ._warnings import warn
from .accounting.renyi_filter import RenyiFilter, check_curve

try:  # POSIX advisory locks (Linux, macOS)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["FORMAT", "VERSION", "BudgetFileError", "BudgetState", "BudgetFile", "now",
           "encode_curve"]

#: The header's ``format`` value.
FORMAT = "opacus-structured/dataset-budget"
#: The file format version this module writes (and the newest it reads).
VERSION = 1


class BudgetFileError(ValueError):
    """The budget file cannot be used: unreadable, not a budget file, a malformed record, or
    created with another cap (ε, δ, orders) than the one asked for."""


def now() -> str:
    """The time of a record: UTC, ISO 8601, microseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def encode_curve(curve: np.ndarray) -> list:
    """A curve as JSON: finite values as numbers, ``inf`` (no bound) as ``null``."""
    return [float(v) if math.isfinite(v) else None for v in curve]


def _decode_curve(values, orders, where: str) -> np.ndarray:
    if not isinstance(values, list):
        raise BudgetFileError(f"{where}: run_rdp must be a list of {len(orders)} numbers")
    try:
        return check_curve("run_rdp", [math.inf if v is None else v for v in values], orders)
    except ValueError as err:
        raise BudgetFileError(f"{where}: {err}") from None


def _json_default(value: Any):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class BudgetState:
    """What the file says so far: the header, the records, each run's last charge."""

    def __init__(self, header: dict, filt: RenyiFilter):
        self.header = header
        self.filter = filt
        self.offset = 0          # bytes of the file consumed (complete lines only)
        self.line = 0            # lines consumed
        self.records: list[dict] = []
        self.runs: dict[str, tuple[np.ndarray, float]] = {}
        self.total = np.zeros(len(filt.orders))
        self.tail = 0.0

    def apply(self, record: dict, where: str) -> None:
        """Add one record (``where``: the file and line, for errors)."""
        if not isinstance(record, dict):
            raise BudgetFileError(f"{where}: a record must be a JSON object")
        seq = record.get("seq")
        if seq != len(self.records) + 1:
            raise BudgetFileError(f"{where}: record seq {seq!r}, expected "
                                  f"{len(self.records) + 1} (records lost or reordered)")
        if not isinstance(record.get("run"), str) or not isinstance(record.get("kind"), str):
            raise BudgetFileError(f"{where}: a record needs a string 'run' and 'kind'")
        if "run_rdp" in record:
            curve = _decode_curve(record["run_rdp"], self.filter.orders, where)
            tail = record.get("run_tail", 0.0)
            if isinstance(tail, bool) or not isinstance(tail, (int, float)) \
                    or not math.isfinite(tail) or tail < 0:
                raise BudgetFileError(f"{where}: run_tail must be a finite number >= 0, got "
                                      f"{tail!r}")
            self.runs[record["run"]] = (curve, float(tail))
            self.total, self.tail = self.sum_runs()
        self.records.append(record)

    def sum_runs(self, without: Optional[str] = None) -> tuple[np.ndarray, float]:
        """The total curve and tail mass of every run's last charge (but ``without``'s)."""
        total = np.zeros(len(self.filter.orders))
        tail = 0.0
        for run, (curve, t) in self.runs.items():
            if run != without:
                total = total + curve
                tail += t
        return total, tail

    def snapshot(self) -> "BudgetState":
        """A copy to read outside the lock (records and runs copied, shallowly)."""
        snap = BudgetState(self.header, self.filter)
        snap.records, snap.runs = list(self.records), dict(self.runs)
        snap.total, snap.tail = self.total.copy(), self.tail
        snap.offset, snap.line = self.offset, self.line
        return snap


class BudgetFile:
    """The budget file at ``path`` (module docstring)."""

    def __init__(self, path: str):
        if fcntl is None:  # pragma: no cover
            raise OSError("a dataset budget needs POSIX file locks (fcntl), which this "
                          "platform lacks")
        self.path = path

    # ---- creating ---------------------------------------------------------------------------
    def create(self, filt: RenyiFilter) -> None:
        """Create the file with the header of ``filt`` (nothing if another process made it)."""
        header = {"format": FORMAT, "version": VERSION, "epsilon": filt.epsilon,
                  "delta": filt.delta, "orders": list(filt.orders),
                  "tail_share": filt.tail_share, "route": filt.route, "created": now(),
                  "id": uuid.uuid4().hex}
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise BudgetFileError(f"{self.path}: the directory {directory} does not exist")
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(header, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:  # atomic: the file appears with its header, or another process made it first
                os.link(tmp, self.path)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links: exclusive create, then write
                self._create_exclusive(header)
        except OSError as err:
            raise BudgetFileError(f"{self.path}: cannot create the budget file ({err})") \
                from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _create_exclusive(self, header: dict) -> None:
        """Create the file with ``O_EXCL`` and write its header under an exclusive lock (a
        reader that opens it in between waits on the lock, then sees the whole header)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, (json.dumps(header, allow_nan=False) + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- reading ----------------------------------------------------------------------------
    @staticmethod
    def parse_header(line: bytes, path: str) -> dict:
        """The header of line 1 (``BudgetFileError`` naming what is wrong)."""
        try:
            header = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BudgetFileError(f"{path}: line 1 is not a dataset budget header ({err})") \
                from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise BudgetFileError(f"{path}: not a dataset budget file (line 1 has no "
                                  f"'format': {FORMAT!r})")
        version = header.get("version")
        if not isinstance(version, int) or version < 1 or version > VERSION:
            raise BudgetFileError(f"{path}: budget file version {version!r}; this version of "
                                  f"opacus-structured reads versions 1..{VERSION}")
        for key in ("epsilon", "delta", "orders", "tail_share", "route"):
            if key not in header:
                raise BudgetFileError(f"{path}: the header has no {key!r}")
        return header

    def read_header(self) -> dict:
        """The file's header (read under a shared lock)."""
        try:
            with open(self.path, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                first = f.readline()
        except OSError as err:
            raise BudgetFileError(f"{self.path}: cannot read the budget file ({err})") \
                from None
        if not first.endswith(b"\n"):
            raise BudgetFileError(f"{self.path}: the budget file has no complete header line")
        return self.parse_header(first, self.path)

    def open_state(self) -> BudgetState:
        """The state of the whole file, with the filter its header describes."""
        header = self.read_header()
        try:
            filt = RenyiFilter(header["epsilon"], header["delta"], tuple(header["orders"]),
                               header["tail_share"])
        except (TypeError, ValueError) as err:
            raise BudgetFileError(f"{self.path}: invalid header ({err})") from None
        state = BudgetState(header, filt)
        with self.locked(exclusive=False) as fd:
            self.refresh(state, fd)
        return state

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool):
        """The file's descriptor under ``flock`` (exclusive: opened to append)."""
        flags = os.O_RDWR | os.O_APPEND if exclusive else os.O_RDONLY
        try:
            fd = os.open(self.path, flags)
        except OSError as err:
            raise BudgetFileError(f"{self.path}: cannot open the budget file ({err})") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield fd
        finally:
            os.close(fd)  # closing releases the lock

    def refresh(self, state: BudgetState, fd: int, *, repair: bool = False) -> None:
        """Read into ``state`` what was appended since ``state.offset`` (complete lines only);
        ``repair`` (under the exclusive lock): cut a torn last line."""
        size = os.fstat(fd).st_size
        if size < state.offset:  # cut by another process (a torn tail): read it all again
            fresh = BudgetState(state.header, state.filter)
            self.refresh(fresh, fd, repair=repair)
            state.__dict__.update(fresh.__dict__)
            return
        if size == state.offset:
            return
        data = os.pread(fd, size - state.offset, state.offset)
        end = data.rfind(b"\n") + 1
        for raw in data[:end].split(b"\n")[:-1]:
            state.line += 1
            where = f"{self.path}, line {state.line}"
            if state.line == 1:
                self.parse_header(raw + b"\n", self.path)
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BudgetFileError(f"{where}: malformed record ({err}); the budget file is "
                                      f"corrupted and cannot be read safely") from None
            state.apply(record, where)
        state.offset += end
        if end < len(data):  # a torn last line: a crash before its release; never charged
            if repair:
                os.ftruncate(fd, state.offset)
                warn(f"{self.path}: cut an incomplete last line (a write interrupted before "
                     f"its release) of {len(data) - end} bytes", RuntimeWarning)

    # ---- appending --------------------------------------------------------------------------
    def append(self, state: BudgetState, fd: int, record: dict) -> dict:
        """Append ``record`` (under the exclusive lock, after :meth:`refresh`), ``fsync`` it
        and add it to ``state``; returns a copy."""
        try:
            line = json.dumps(record, allow_nan=False, default=_json_default)
        except (TypeError, ValueError) as err:
            raise ValueError(f"record fields must be JSON values (finite numbers, strings, "
                             f"lists, dicts): {err}") from None
        data = (line + "\n").encode("utf-8")
        os.write(fd, data)
        os.fsync(fd)
        state.apply(json.loads(line), f"{self.path}, line {state.line + 1}")
        state.line += 1
        state.offset += len(data)
        return dict(record)
