"""Public pretraining is a deterministic function of the recipe, whatever ran before it in the
process (issue 39's loader instrumentation, Opacus engines, Lightning runs, torch flags left by
other tests): 40 DeepAR steps in this (test-worn) process equal 40 steps in a fresh interpreter,
bit for bit. The shipped weights' own 5000-step reproduction is ``long`` (~8 min,
tests/test_model_defaults.py)."""

import dataclasses
import subprocess
import sys

import pytest

pytest.importorskip("gluonts")
torch = pytest.importorskip("torch")

from opacus_structured.forecasting import pretraining  # noqa: E402

STEPS = 40
_SCRIPT = """
import dataclasses, sys, torch
from opacus_structured.forecasting import pretraining as p
recipe = dataclasses.replace(p.PRETRAIN_RECIPE["deepar"], steps={steps})
state, _ = p.pretrain("deepar", recipe=recipe)
torch.save(state, sys.argv[1])
"""


@pytest.mark.slow  # ~2 x 10 s
def test_pretraining_in_a_used_process_equals_a_fresh_one(tmp_path):
    fresh = tmp_path / "fresh.pt"
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(steps=STEPS), str(fresh)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    recipe = dataclasses.replace(pretraining.PRETRAIN_RECIPE["deepar"], steps=STEPS)
    here, _ = pretraining.pretrain("deepar", recipe=recipe)
    there = torch.load(fresh)
    assert set(here) == set(there)
    for name, value in here.items():
        assert torch.equal(value, there[name]), name
