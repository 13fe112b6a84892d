"""What the console entry point (:mod:`opacus_structured.console`) and the full parser
(:mod:`opacus_structured.cli`) share: running a command function with the command line's error
rule, and the shipped index of the ``schemes`` rows (the leading underscore keeps this module
out of the command discovery).

It sits below both so that the command line points one way (issue 47): ``console`` hands over
to ``cli`` (a lazy import), ``cli`` imports the command registry (:mod:`._registry`) and the
command modules register there; none of them imports ``console``, and nothing below imports
``cli`` (docs/architecture.md, "Lazy loading").
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Callable

from .. import __version__

__all__ = ["PROG", "run_command", "SCHEMES_INDEX", "schemes_sources_digest",
           "read_schemes_index", "print_scheme_rows"]

PROG = "opacus-structured"
_PACKAGE = Path(__file__).resolve().parent.parent


def run_command(func: Callable, args) -> int:
    """``func(args)`` as a command: a ``ValueError`` (bad input) is one line ``opacus-structured:
    error: ...`` on stderr and exit status 2, as argparse's own errors; so is a missing optional
    package (the line names the package and the extra that installs it)."""
    try:
        return int(func(args) or 0)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        from .._optional import install_hint

        hint = install_hint(exc)
        if hint is None:
            raise
        print(f"{PROG}: error: {hint}", file=sys.stderr)
        return 2


# ---- schemes: the shipped index ------------------------------------------------------------
#: The rows of ``opacus-structured schemes`` with the digest of the sources they come from.
SCHEMES_INDEX = _PACKAGE / "data" / "schemes_index.json"


def _schemes_sources(root: Path) -> list[Path]:
    """The sources the ``schemes`` rows come from: every ``.py`` under ``schemes/`` and the
    ``accounting/`` modules that add command-line flags (``def add_cli_arguments``, e.g. the
    Monte Carlo settings); an edit elsewhere in the accounting core leaves the index valid."""
    paths = sorted((root / "schemes").rglob("*.py"))
    paths += [path for path in sorted((root / "accounting").rglob("*.py"))
              if b"def add_cli_arguments" in path.read_bytes()]
    return paths


def schemes_sources_digest() -> str:
    """sha256 of the package version and of the sources of the ``schemes`` rows (path and
    bytes of each file of :func:`_schemes_sources`)."""
    digest = hashlib.sha256(__version__.encode())
    for path in _schemes_sources(_PACKAGE):
        digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def read_schemes_index(path: Path | None = None) -> list[dict] | None:
    """The shipped rows of ``schemes`` (from ``path``, default :data:`SCHEMES_INDEX`), or
    ``None`` if the index is missing or its digest is not the one of the sources here (then
    :func:`opacus_structured.cli.scheme_rows` computes them from the schemes)."""
    try:
        index = json.loads((SCHEMES_INDEX if path is None else Path(path)).read_text(
            encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if index.get("digest") != schemes_sources_digest():
        return None
    return index["rows"]


def print_scheme_rows(rows: list[dict], as_json: bool) -> None:
    """Print the ``schemes`` rows: one JSON list, or a name / summary / flags table."""
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['scheme']:<24} {r['summary']}")
        if r["flags"]:
            print(f"{'':<24} flags: {' '.join(r['flags'])}")
