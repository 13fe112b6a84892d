"""The layers import downwards only, and no function hides an import of our own modules.

The order (docs/architecture.md, "Layers"), lowest first; a module may import modules of its
own layer or lower ones, never higher:

0. ``_validation``, ``_discovery``  — argument checks, submodule discovery
1. ``accounting``, ``dataset_budget`` — the math (numpy / scipy / dp_accounting; no torch);
                                      the file-backed dataset budget over its Renyi filter
2. ``schemes``                      — pure descriptions + the registry of what implements them
3. ``distributed``, ``samplers``,   — torch samplers and torch.distributed helpers;
   ``runners``, ``advisor``           Monte Carlo pricing at scale (process pool, shards, torch
                                      backend; schemes find it through the registry); the
                                      scheme advisor (prices schemes only)
4. ``accountants``                  — Opacus ``IAccountant`` adapters
5. ``optim``, ``engine``             — DP optimizers, correlated noise, the privacy engine;
   ``make_private`` for every scheme by name
6. ``lightning_callbacks``          — Lightning callbacks (a top-level package)
7. ``forecasting``, ``audit``       — gluonts / Lightning glue; empirical privacy audits
                                      (estimators, and canaries planted in every pipeline)
8. ``commands``, ``cli``            — the command line

The check also refuses any import of our own modules inside a function (a hidden cycle), unless
the line carries a comment naming the optional dependency it defers (``# optional: ...``), or,
in the command-line layer only, a ``# lazy: ...`` comment: the entry point defers the layers so
that ``opacus-structured --help`` starts fast (docs/architecture.md, "Lazy loading").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "opacus_structured._validation": 0, "opacus_structured._discovery": 0,
    "opacus_structured._defaults": 0,
    # the lazy-loading hook the package facade sets and the registry calls (no imports)
    "opacus_structured._lazy": 0,
    "opacus_structured.accounting": 1,
    # the file-backed dataset budget over the accounting core's Renyi filter (no torch)
    "opacus_structured.dataset_budget": 1, "opacus_structured.budget_file": 1,
    "opacus_structured.schemes": 2,
    "opacus_structured.distributed": 3, "opacus_structured.samplers": 3,
    # runs Monte Carlo pricing at scale (process pool, shard files, torch backend); schemes
    # find it through schemes.registry.runner_for, never by import
    "opacus_structured.runners": 3,
    "opacus_structured.accountants": 4,
    "opacus_structured.optim": 5,
    # make_private / make_private_with_epsilon: installs samplers and accountants on an
    # Opacus engine, and needs CorrelatedNoisePrivacyEngine (optim)
    "opacus_structured.engine": 5,
    "opacus_structured.engine_schemes": 5,
    # private selection: prices a trial through the accountants; the forecast job tunes with it
    "opacus_structured.tuning": 5,
    # the scheme advisor prices schemes (accounting, schemes) only; commands use it
    "opacus_structured.advisor": 3,
    "opacus_structured.advisor_results": 3,
    "lightning_callbacks": 6,
    "opacus_structured.forecasting": 7,
    # empirical auditing: its pipelines drive samplers, optimizers, accountants and callbacks
    "opacus_structured.audit": 7,
    "opacus_structured.commands": 8, "opacus_structured.cli": 8,
    # the console entry point: answers --help without importing the layers
    "opacus_structured.console": 8,
}


def layer_of(module: str):
    """Layer of a dotted module name (longest matching prefix), ``None`` if not ours."""
    best = None
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    return None if best is None else best[1]


def _resolve(node: ast.ImportFrom | ast.Import, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from pkg import sub` may name a submodule: check the deepest name that is ours
    return [f"{base}.{a.name}" if layer_of(f"{base}.{a.name}") is not None
            and not node.module else base for a in node.names]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Layer and function-level-import violations of one module's source."""
    tree = ast.parse(source)
    lines = source.splitlines()
    own = layer_of(module)
    found = []
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_function = {id(sub) for f in functions for sub in ast.walk(f)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in _resolve(node, module, is_package):
            rank = layer_of(target)
            if rank is None:
                continue
            if own is not None and rank > own:
                found.append(f"{module}:{node.lineno} imports {target} (layer {rank} > {own})")
            line = lines[node.lineno - 1]
            deferred = "# optional:" in line or ("# lazy:" in line and own == 8)
            if id(node) in in_function and not deferred:
                found.append(f"{module}:{node.lineno} imports {target} inside a function")
    return list(dict.fromkeys(found))


def _modules():
    for top in ("opacus_structured", "lightning_callbacks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            yield path, ".".join(parts), is_package


# Static layering check of every module (no privacy bound).
@pytest.mark.slow  # 3 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_layers_import_downwards_only_and_no_hidden_imports():
    problems = []
    for path, module, is_package in _modules():
        if module == "opacus_structured":
            continue  # the package facade imports its layers to register them
        problems += violations(path.read_text(), module, is_package)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, module, expected", [
    ("from ..accountants.base import SchemeAccountant\n", "opacus_structured.schemes.poisson",
     "layer 4 > 2"),
    ("def f():\n    from ..samplers import poisson\n", "opacus_structured.optim.x",
     "inside a function"),
    ("import lightning_callbacks.dp_callback\n", "opacus_structured.accountants.base",
     "layer 6 > 4"),
])
def test_the_check_catches_an_inverted_import(source, module, expected):
    found = violations(source, module)
    assert found and expected in found[0]


def test_lazy_comment_allows_a_deferred_import_in_the_command_line_layer_only():
    src = "def main():\n    from . import cli  # lazy: fast --help\n"
    assert violations(src, "opacus_structured.console") == []
    src = "def f():\n    from ..samplers import poisson  # lazy: no\n"
    assert violations(src, "opacus_structured.optim.x")


def test_optional_dependency_comment_allows_a_deferred_import():
    src = "def f():\n    from ..forecasting import data  # optional: gluonts\n"
    assert violations(src, "opacus_structured.commands.x") == []


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    return {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for target in _resolve(node, module, is_package)}


def _imports_module(targets: set[str], name: str) -> bool:
    return any(t == name or t.startswith(name + ".") for t in targets)


def test_the_command_line_points_one_way():
    """Issue 47: ``console`` → ``cli`` → the command modules → their registry, no circle.
    Only ``console`` (the entry point) imports ``cli``, lazily; only ``__main__`` imports
    ``console``; the command modules register with ``commands._registry`` and import neither
    ``cli`` nor ``console`` (they used to import ``cli.register_command`` while ``cli``
    imported ``console`` and ``console`` imported ``cli``)."""
    importers = {"opacus_structured.cli": set(), "opacus_structured.console": set()}
    for path, module, is_package in _modules():
        text = path.read_text()
        if "cli" not in text and "console" not in text:  # cannot import either: not parsed
            continue
        targets = _imports(path, module, is_package)
        for name, found in importers.items():
            if module != name and _imports_module(targets, name):
                found.add(module)
    assert importers["opacus_structured.cli"] == {"opacus_structured.console"}
    assert importers["opacus_structured.console"] <= {"opacus_structured.__main__"}
    registry = ROOT / "opacus_structured" / "commands" / "_registry.py"
    assert not (_imports(registry, "opacus_structured.commands._registry", False)
                & {"opacus_structured.cli", "opacus_structured.console"})
