"""Entry point of the ``opacus-structured`` command (``console_scripts`` and ``python -m``).

Top-level ``--help`` / ``--version`` (and a missing command) are answered here from the command
names and help strings alone: the built-in commands below, and the plugin commands read from
the ``register_command("name", "help", ...)`` call of each ``opacus_structured/commands/*.py``
*source* (:func:`plugin_commands`, no import). Two commands start here too:

* ``forecast``: check first, import later. Its parser (``commands/_forecast_args.py``) and its
  checks of every flag and of the ``--data`` file (``commands/_forecast_check.py``, numpy and
  pandas only) run before torch, gluonts, Lightning, opacus or matplotlib is imported; only a
  run that passes them imports the training code (``commands/forecast.py``).
* ``schemes``: printed from ``data/schemes_index.json`` when the digest of the sources that
  define the schemes' names, summaries and flags (:func:`schemes_sources_digest`: ``schemes/``
  and the ``accounting/`` modules that add flags) matches the one stored with it; otherwise
  (an edited scheme) from the schemes themselves, the same rows, seconds slower (importing the
  schemes imports dp_accounting and scipy).

Any other command hands over to :func:`opacus_structured.cli.main`, which imports the layers
that command needs (``epsilon`` needs the accounting core, not torch). docs/architecture.md,
"Lazy loading".
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from . import __version__
from .commands._common import (  # noqa: F401  (re-exported: the console's names since issue 41)
    PROG,
    SCHEMES_INDEX,
    print_scheme_rows,
    read_schemes_index,
    run_command,
    schemes_sources_digest,
)

__all__ = ["main", "plugin_commands", "BUILTIN_COMMANDS", "run_command", "print_scheme_rows",
           "schemes_sources_digest", "read_schemes_index", "SCHEMES_INDEX"]
DESCRIPTION = "Sound and tight DP-SGD accounting for structured batching."
#: Commands defined in :mod:`opacus_structured.cli` itself, in --help order.
BUILTIN_COMMANDS = (("schemes", "list batching schemes and their flags"),
                    ("epsilon", "compute ε for a scheme"),
                    ("calibrate", "find the noise multiplier for a target ε"))


def _registration(path: Path):
    """``(name, help)`` of the module-level ``register_command("name", "help", ...)`` call in
    ``path``; ``None`` if there is none with literal strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "register_command"
                and len(call.args) >= 2
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                        for a in call.args[:2])):
            return call.args[0].value, call.args[1].value
    return None


def plugin_commands() -> list[tuple[str, str]] | None:
    """``[(name, help), ...]`` of the plugin commands, sorted by name, read from the sources of
    ``opacus_structured/commands/``; ``None`` if a module registers in a way this cannot read
    (the caller then builds the full parser)."""
    found = []
    for path in sorted((Path(__file__).parent / "commands").glob("*.py")):
        if path.name.startswith("_"):
            continue
        entry = _registration(path)
        if entry is None:
            return None
        found.append(entry)
    return sorted(found)


def _command_word(argv: list[str]) -> str | None:
    """The sub-command (first word that is not an option; top-level options take no value)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def top_level_parser(plugins: list[tuple[str, str]]) -> argparse.ArgumentParser:
    """The top-level parser with every command's name and help and no command's flags."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (*BUILTIN_COMMANDS, *plugins):
        sub.add_parser(name, help=helptext, add_help=False)
    return parser


# ---- forecast: check first, import later -----------------------------------------------------
def forecast_parser() -> argparse.ArgumentParser:
    """The ``forecast`` command's parser, the same as its sub-parser in the full parser."""
    from .commands._forecast_args import add_arguments  # lazy: no torch, no gluonts

    parser = argparse.ArgumentParser(prog=f"{PROG} forecast")
    add_arguments(parser)
    return parser


def _forecast(argv: list[str]) -> int:
    """``forecast``: parse, check every flag and the data, and only then import the training
    code and run (docs/architecture.md, "Lazy loading")."""
    args = forecast_parser().parse_args(argv)
    from .commands import _forecast_check  # lazy: numpy / pandas only

    def check(parsed) -> int:
        _forecast_check.check_forecast(parsed)  # leaves the checked data on ``parsed``
        return 0

    status = run_command(check, args)
    if status:
        return status
    return _run_checked_forecast(args)


def _run_checked_forecast(args) -> int:
    """Run a forecast whose flags and data passed the checks (imports the training code)."""
    from .commands import forecast  # lazy: torch, gluonts, Lightning (the checks passed)

    args.command, args.func = "forecast", forecast.run
    return run_command(forecast.run, args)


def schemes_parser() -> argparse.ArgumentParser:
    """The ``schemes`` command's parser, the same as its sub-parser in the full parser."""
    parser = argparse.ArgumentParser(prog=f"{PROG} schemes")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    return parser


def _schemes(argv: list[str]) -> int | None:
    """``schemes`` from the shipped index; ``None`` when the index does not match (the full
    command line then computes the rows)."""
    args = schemes_parser().parse_args(argv)
    rows = read_schemes_index(SCHEMES_INDEX)
    if rows is None:
        return None
    print_scheme_rows(rows, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(argv)
    if word is None:
        plugins = plugin_commands()
        if plugins is not None:
            top_level_parser(plugins).parse_args(argv)  # prints help/version/usage and exits
    elif argv[0] == "forecast":
        return _forecast(argv[1:])
    elif argv[0] == "schemes":
        status = _schemes(argv[1:])
        if status is not None:
            return status
    from . import cli  # lazy: a command imports the layers it needs, --help none

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
