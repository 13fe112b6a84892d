"""A remembered σ is checked in two evaluations and is then exactly the search's answer; a
stale one is searched again (issue 41: the main job's start-up)."""

import json

import pytest

from opacus_structured.accounting.calibration import (
    calibrate_noise_multiplier,
    hinted_noise_multiplier,
)
from opacus_structured.forecasting import calibration_memo


class Counted:
    """ε(σ) = c/σ (non-increasing), counting evaluations."""

    def __init__(self, c=3.7):
        self.c, self.calls = c, 0

    def __call__(self, sigma):
        self.calls += 1
        return self.c / sigma


def test_hint_accepted_only_where_the_search_contract_holds():
    f = Counted()
    sigma = calibrate_noise_multiplier(f, 1.3, rtol=1e-2)
    assert f.c / sigma <= 1.3 < f.c / (sigma * (1 - 1e-2))  # the contract, by hand
    f.calls = 0
    assert hinted_noise_multiplier(f, 1.3, sigma, rtol=1e-2) == sigma and f.calls == 2
    assert hinted_noise_multiplier(f, 1.3, sigma * 0.98, rtol=1e-2) is None  # over budget
    assert hinted_noise_multiplier(f, 1.3, sigma * 1.05, rtol=1e-2) is None  # not smallest
    with pytest.raises(ValueError, match="hint"):
        hinted_noise_multiplier(f, 1.3, -1.0, rtol=1e-2)


def test_memo_remembers_checks_and_refuses_stale_entries(monkeypatch, tmp_path):
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_memo, "_shipped", lambda: {})
    key = calibration_memo.calibration_key("Scheme(x=1)", 100, 1e-7, 1.0, 1e-3, 1e-2)
    f = Counted()
    cold, source = calibration_memo.calibrate(f, 1.0, key=key, rtol=1e-2)
    assert source == "search" and f.calls > 5
    # the memo's search starts from the scaled guess (issue 41: a first run's calibration)
    assert cold == calibrate_noise_multiplier(Counted(), 1.0, rtol=1e-2, initial="scaled")
    assert json.loads((tmp_path / "calibrations.json").read_text())[key] == cold
    f.calls = 0
    warm, source = calibration_memo.calibrate(f, 1.0, key=key, rtol=1e-2)
    assert (warm, source, f.calls) == (cold, "cache", 2)
    # the accounting got tighter since: the remembered σ is no longer the smallest
    tighter = Counted(c=3.0)
    sigma, source = calibration_memo.calibrate(tighter, 1.0, key=key, rtol=1e-2)
    assert source == "search" and sigma == calibrate_noise_multiplier(
        Counted(3.0), 1.0, rtol=1e-2, initial="scaled")


def test_shipped_entry_is_used_after_the_check(monkeypatch, tmp_path):
    monkeypatch.setenv("OPACUS_STRUCTURED_CACHE", str(tmp_path / "empty"))
    sigma = calibrate_noise_multiplier(Counted(), 2.0, rtol=1e-2)
    monkeypatch.setattr(calibration_memo, "_shipped", lambda: {"k": sigma, "bad": "x"})
    f = Counted()
    assert calibration_memo.calibrate(f, 2.0, key="k", rtol=1e-2) == (sigma, "shipped")
    assert f.calls == 2


def test_every_shipped_entry_is_a_well_formed_key():
    for key, sigma in calibration_memo._shipped().items():
        assert key.startswith("StructuredScheme(") and "|steps=" in key, key
        assert isinstance(sigma, float) and sigma > 0
