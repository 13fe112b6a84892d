"""The registry of the plugin sub-commands (the leading underscore keeps this module out of the
command discovery).

Each module of :mod:`opacus_structured.commands` calls :func:`register_command` at import (a
module-level ``register_command("name", "help", add_arguments, run)`` with literal strings:
the console reads that call from the source for ``--help`` without importing the module);
:mod:`opacus_structured.cli` imports the modules and builds its parser from :data:`COMMANDS`.
The command modules import this registry, never ``cli`` or ``console``: the command line points
one way (``console`` → ``cli`` → the command modules → this registry; issue 47).
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["COMMANDS", "register_command"]

#: name → (help, add_arguments, run) of every registered sub-command.
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def register_command(name: str, help: str,
                     add_arguments: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    """Add a sub-command (used by forecasting, plotting and individual-ε modules)."""
    COMMANDS[name] = (help, add_arguments, run)
