"""README command 1 alone installs everything the README, the guides and the examples import.

Slow (a fresh virtual environment, ~2-5 min): ``python -m pytest -m slow
tests/test_fresh_install.py``. Skipped when pip cannot reach a package index. In the fresh venv
it runs README command 1's install (``pip install torch==2.13.0 -e ".[forecast]"``), imports
every top-level module that ``examples/*.py`` and the README / guide Python blocks import, and
runs ``opacus-structured epsilon balls-in-bins`` (which needs pld-accounting).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LOCAL = {"opacus_structured", "lightning_callbacks", "conftest", "__future__"}


def imported_top_level_modules() -> set[str]:
    """Top-level modules imported by the examples and the documentation's Python blocks."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_doc_snippets import SNIPPETS

    sources = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "examples").glob("*.py"))]
    sources += [s["code"] for s in SNIPPETS]
    names: set[str] = set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:  # a sketch with `...` in an argument list still parses; others skip
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    stdlib = set(sys.stdlib_module_names)
    return {n for n in names if n not in stdlib and n not in _LOCAL}


def test_examples_import_only_known_packages():
    # cheap guard that runs in the normal suite: a new third-party import must be added here
    # and to an extra that README command 1 installs (setup.cfg: install_requires or forecast)
    assert imported_top_level_modules() <= {
        "torch", "opacus", "numpy", "scipy", "dp_accounting", "PLD_accounting", "lightning",
        "gluonts", "pandas", "matplotlib", "sklearn", "tqdm"}


@pytest.mark.slow
def test_readme_command_1_installs_what_the_docs_use(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "-e", f"{ROOT}[forecast]"],
        capture_output=True, text=True, timeout=1500)
    if install.returncode != 0:
        text = install.stderr + install.stdout
        if any(s in text for s in ("No matching distribution", "Could not find a version",
                                   "Failed to establish", "Network is unreachable",
                                   "Temporary failure in name resolution")):
            pytest.skip("no package index reachable: " + text.strip().splitlines()[-1])
        pytest.fail(text[-3000:])
    modules = sorted(imported_top_level_modules())
    check = subprocess.run([str(py), "-c", "import importlib, sys\n"
                            f"for m in {modules!r}: importlib.import_module(m)\n"],
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    cli = env_dir / "bin" / "opacus-structured"
    r = subprocess.run([str(cli), "epsilon", "balls-in-bins", "--num-bins", "100", "--epochs", "1",
                        "--noise-multiplier", "1", "--delta", "1e-5"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "epsilon" in r.stdout, r.stderr[-3000:]
