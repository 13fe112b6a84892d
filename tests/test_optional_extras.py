"""A missing optional package prints one line naming the extra to install, never a traceback.

The packages are hidden in a subprocess (``sys.modules[name] = None``) (they are installed
here), so the checks run in the normal test environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opacus_structured._optional import (
    OPTIONAL_PACKAGES,
    MissingOptionalDependency,
    install_hint,
    require,
)

ROOT = Path(__file__).resolve().parents[1]

_BLOCK = """
import sys
for _name in {blocked!r}:
    sys.modules[_name] = None  # `import _name` now raises ModuleNotFoundError(name=_name)
"""


def _run_blocked(blocked: set[str], code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", _BLOCK.format(blocked=blocked) + code],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_require_names_the_extra(monkeypatch):
    assert require("math").sqrt(4) == 2
    monkeypatch.setitem(OPTIONAL_PACKAGES, "no_such_pkg_xyz", ("no-such-pkg", "forecast"))
    with pytest.raises(MissingOptionalDependency) as info:
        require("no_such_pkg_xyz.sub", "the widget")
    message = str(info.value)
    assert "\n" not in message and message.startswith("the widget needs")
    assert "opacus-structured[forecast]" in message and "no-such-pkg" in message
    with pytest.raises(ModuleNotFoundError) as other:  # unknown packages are not relabelled
        require("another_missing_pkg_xyz")
    assert not isinstance(other.value, MissingOptionalDependency)


def test_install_hint_only_for_known_optional_packages():
    hint = install_hint(ModuleNotFoundError("No module named 'sklearn'", name="sklearn.datasets"))
    assert hint is not None and "opacus-structured[forecast]" in hint and "scikit-learn" in hint
    assert "\n" not in hint
    core = install_hint(ModuleNotFoundError("x", name="PLD_accounting"))
    assert core is not None and "core dependency" in core and "pld-accounting" in core
    assert install_hint(ModuleNotFoundError("x", name="not_optional_at_all")) is None
    assert install_hint(ValueError("x")) is None


# A subprocess for the one-line error without an optional dependency (no privacy bound).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_cli_prints_one_line_when_pld_accounting_is_missing():
    r = _run_blocked({"PLD_accounting"}, (
        "from opacus_structured.cli import main\n"
        "sys.exit(main(['epsilon', 'balls-in-bins', '--num-bins', '10', '--epochs', '1',"
        " '--noise-multiplier', '1', '--delta', '1e-5']))\n"))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pld-accounting" in lines[0] and lines[0].startswith("opacus-structured: error:")


@pytest.mark.slow
def test_forecast_command_prints_one_line_without_gluonts():
    r = _run_blocked({"gluonts"}, (
        "from opacus_structured.cli import main\n"
        "sys.exit(main(['forecast', '--model', 'dlinear', '--epsilon', '1', '--delta', '1e-7']))\n"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "opacus-structured[forecast]" in lines[0]


@pytest.mark.slow  # 5-30 s: out of the README command (issue 41: <= 5 min); CI runs it
@pytest.mark.parametrize("example", [
    "swap_accountant_opacus.py",
    pytest.param("lightning_dp.py", marks=pytest.mark.slow),  # ~20 s each (imports lightning)
    pytest.param("individual_gdp_lightning.py", marks=pytest.mark.slow)])
def test_examples_print_one_line_without_sklearn(example):
    r = _run_blocked({"sklearn"}, (
        "import runpy\n"
        f"sys.argv = [{example!r}]\n"
        f"runpy.run_path('examples/{example}', run_name='__main__')\n"))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "opacus-structured[forecast]" in errors[0], r.stderr[-2000:]
