"""Extra ``opacus-structured`` sub-commands, one module each.

Each module calls :func:`opacus_structured.cli.register_command` at import; the CLI imports
every module here (skipping those whose optional extra is not installed).
"""
