"""README command 1 alone installs everything the README, the guides and the examples import.

Slow (a fresh virtual environment, ~2-5 min): ``python -m pytest -m slow
tests/test_fresh_install.py``. Skipped when pip cannot reach a package index. In the fresh venv
it runs README command 1's install (``pip install torch==2.13.0 -e ".[forecast]"``), imports
every top-level module that ``examples/*.py`` and the README / guide Python blocks import, runs
``opacus-structured epsilon <scheme>`` for every scheme the command offers, and runs every example
end to end with small settings (``EXAMPLE_ARGS``; two at a time). A scheme or example added
without an entry here fails the cheap guards below, which run in the normal suite.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LOCAL = {"opacus_structured", "lightning_callbacks", "conftest", "__future__"}

#: Small settings for ``opacus-structured epsilon <scheme>`` (after the common flags, so a
#: scheme's own ``--delta`` wins).
_COMMON = ["--noise-multiplier", "1", "--delta", "1e-5", "--discretization", "1e-2",
           "--no-progress"]
SCHEME_ARGS = {
    "balls-in-bins": ["--num-bins", "20", "--epochs", "1"],
    "bandmf-cyclic-poisson": ["--bands", "2", "--dataset-size", "1000", "--batch-size", "100",
                              "--steps", "20"],
    "bminsep-mc": ["--bands", "2", "--dataset-size", "1000", "--batch-size", "100",
                   "--steps", "20", "--samples", "20000", "--seed", "0", "--delta", "1e-3"],
    "gdp": ["--steps", "10"],
    "poisson": ["--sample-rate", "0.01", "--steps", "100"],
    "random-allocation-mf": ["--batches-per-epoch", "10", "--epochs", "1"],
    "shuffle": ["--dataset-size", "1000", "--batch-size", "10", "--steps", "150"],
    "structured": ["--num-series", "100", "--series-length", "60", "--context-length", "12",
                   "--forecast-length", "4", "--batch-size", "10", "--steps", "20"],
    "truncated-poisson": ["--dataset-size", "1000", "--sample-rate", "0.01",
                          "--max-batch-size", "20", "--steps", "20"],
}
#: Small settings for each example (run in a temporary directory).
EXAMPLE_ARGS = {
    "bandmf_cifar_like.py": ["--epochs", "1", "--bands", "2"],
    "ddp_training.py": ["--n", "200", "--epochs", "1"],
    "forecast_deepar.py": ["--max-steps", "3"],
    "forecast_dlinear.py": ["--max-steps", "3", "--no-progress"],
    "individual_gdp_lightning.py": ["--steps", "4", "--filter-steps", "2", "--out", "gdp_out"],
    "lightning_dp.py": ["--epochs", "1", "--log-dir", "logs"],
    "structured_accounting.py": ["--discretization", "1e-2"],
    "swap_accountant_opacus.py": ["--scheme", "all", "--epochs", "1", "--steps-per-epoch", "5",
                                  "--discretization", "1e-2"],
    "truncated_poisson.py": [],
    "tune_private_selection.py": ["--mean-trials", "2"],
    "what_a_step_sums.py": [],
}


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


#: Imported only by documentation blocks of features behind an extra that README command 1 does
#: not install; the library loads them through ``_optional.require`` (one-line install hint).
OPTIONAL_EXTRA_MODULES = {"distributed": "cluster"}


def test_examples_import_only_known_packages():
    # cheap guard that runs in the normal suite: a new third-party import must be added here
    # and to an extra that README command 1 installs (setup.cfg: install_requires or forecast),
    # or be an optional extra's module with a one-line install hint
    from opacus_structured import _optional

    assert imported_top_level_modules() <= {
        "torch", "opacus", "numpy", "scipy", "dp_accounting", "PLD_accounting", "lightning",
        "gluonts", "pandas", "matplotlib", "sklearn", "tqdm", *OPTIONAL_EXTRA_MODULES}
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    for module, extra in OPTIONAL_EXTRA_MODULES.items():
        assert f"\n{extra} =" in setup, extra
        assert _optional.OPTIONAL_PACKAGES[module][1] == extra, module


def test_every_scheme_and_example_has_small_settings():
    from opacus_structured.schemes import SCHEMES

    assert set(SCHEME_ARGS) == set(SCHEMES)
    assert set(EXAMPLE_ARGS) == {p.name for p in (ROOT / "examples").glob("*.py")}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPACUS_STRUCTURED_PROGRESS": "0", "MPLBACKEND": "Agg"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd, env=env)


@pytest.mark.slow
@pytest.mark.long  # ~6 min: a fresh venv and every example end to end (-m long)
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
    modules = sorted(imported_top_level_modules() - set(OPTIONAL_EXTRA_MODULES))
    check = subprocess.run([str(py), "-c", "import importlib, sys\n"
                            f"for m in {modules!r}: importlib.import_module(m)\n"],
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    cli = env_dir / "bin" / "opacus-structured"
    jobs = {f"epsilon {name}": [str(cli), "epsilon", name, *_COMMON, *args]
            for name, args in SCHEME_ARGS.items()}
    jobs.update({f"examples/{name}": [str(py), str(ROOT / "examples" / name), *args]
                 for name, args in EXAMPLE_ARGS.items()})
    work = tmp_path / "work"
    work.mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = dict(zip(jobs, pool.map(lambda cmd: _run(cmd, work), jobs.values()), strict=True))
    failed = {name: (r.stderr or r.stdout)[-1500:] for name, r in done.items()
              if r.returncode != 0}
    assert not failed, failed
    for name in SCHEME_ARGS:
        assert "epsilon = " in done[f"epsilon {name}"].stdout, done[f"epsilon {name}"].stdout
