"""Extra ``opacus-structured`` sub-commands, one module each.

Each module calls :func:`~opacus_structured.commands._registry.register_command` at import
(the registry below the command modules: they never import ``cli`` or ``console``); the CLI
imports every module here (skipping those whose optional extra is not installed).
"""
