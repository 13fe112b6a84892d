"""Entry point of the ``opacus-structured`` command (``console_scripts`` and ``python -m``).

Top-level ``--help`` / ``--version`` (and a missing command) are answered here from the command
names and help strings alone: the built-in commands below, and the plugin commands read from
the ``register_command("name", "help", ...)`` call of each ``opacus_structured/commands/*.py``
*source* (:func:`plugin_commands`, no import). Any command hands over to
:func:`opacus_structured.cli.main`, which imports the layers that command needs (``epsilon``
needs the accounting core, not torch). docs/architecture.md, "Lazy loading".
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from . import __version__

__all__ = ["main", "plugin_commands", "BUILTIN_COMMANDS"]

PROG = "opacus-structured"
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command_word(argv) is None:
        plugins = plugin_commands()
        if plugins is not None:
            top_level_parser(plugins).parse_args(argv)  # prints help/version/usage and exits
    from . import cli  # lazy: a command imports the layers it needs, --help none

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
