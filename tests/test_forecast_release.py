"""Issue 47: ``forecast --output DIR`` writes a publishable ``DIR/release/`` apart from the
operator's ``DIR/diagnostics/``, and the number of trials of ``--tune`` appears nowhere.

The acceptance run (``forecast --tune --tune-always --output DIR``, marked slow): the release
holds the weights and a card naming ε, δ and the privacy unit; no file in it holds CRPS, MASE
or the number of trials; stdout and stderr never print that number. The number of trials is
forced (17, then 1) so that the outputs can be searched for it, and the two runs must print the
same number of lines (a line per trial would show K by its count)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("gluonts")

from test_forecast_tuning import _panel_csv  # noqa: E402  (8 monthly series of 60 steps)

from opacus_structured.commands._forecast_release import (  # noqa: E402
    NOT_FOR_PUBLICATION,
    card_markdown,
    no_release_reason,
    privacy_unit,
)
from opacus_structured.schemes.structured import StructuredScheme  # noqa: E402

FORCED_TRIALS = 17


# ---- the parts, on made-up inputs ---------------------------------------------------------------
def test_the_privacy_unit_in_words():
    scheme = StructuredScheme(num_series=8, series_length=48, context_length=36,
                              forecast_length=12, batch_size=8)
    text = privacy_unit(scheme)
    assert text.startswith("one time step of one series: two panels are neighbours when the "
                           "value of a single time step of a single series differs")
    assert "same series, lengths" in text and "not the panel's structure" in text
    wider = StructuredScheme(num_series=8, series_length=48, context_length=36,
                             forecast_length=12, batch_size=8, relation="user", w=3)
    assert "up to 3 time steps of a single series" in privacy_unit(wider)


def test_what_gets_no_release():
    private = {"dp_sgd": True, "private": True}
    assert no_release_reason(private) is None
    assert "epsilon sweep" in no_release_reason({**private, "sweep": []})
    assert "without DP" in no_release_reason({"dp_sgd": False, "private": False})
    assert "reproducible noise" in no_release_reason(
        {"dp_sgd": True, "private": False, "not_private_reason": "reproducible noise: ..."})
    assert "NOT FOR PUBLICATION" in NOT_FOR_PUBLICATION


def test_the_card_in_words_names_epsilon_delta_and_the_unit():
    card = {"model": "dlinear",
            "privacy": {"epsilon": 0.9969, "delta": 1e-7, "bound": "tight",
                        "accounting": "structured subsampling", "target_epsilon": 1.0,
                        "privacy_unit": "one time step of one series: ...", "steps": 100,
                        "sigma": 10.44, "max_grad_norm": 1e-4, "batch_size": 64,
                        "scheme": {"num_series": 148}, "public_structure": {}},
            "forecast": {"freq": "M", "prediction_length": 12, "season_length": 12,
                         "season_length_source": "given", "forecast": "mixture",
                         "zero_shot_weight": 0.25},
            "public_weights": {"trained_on": "public data only", "key": "k", "source": "x"},
            "training": {"lr": 1e-4}, "files": {"predictor": "predictor/"},
            "not_in_this_folder": "../diagnostics/"}
    text = card_markdown(card)
    assert "(ε = 0.9969, δ = 1e-07)-DP" in text and "**Privacy unit:** one time step" in text
    assert "σ = 10.44" in text and "100 steps" in text and "Input:" not in text
    card["forecast"]["input"] = {"reads": "the last 960 steps of each series it forecasts"}
    assert "Input: the last 960 steps of each series it forecasts." in card_markdown(card)


# ---- end to end --------------------------------------------------------------------------------
def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _strings_of_weights(path: Path) -> str:
    """Every key and string value of a weights file (a torch zip holding a pickle)."""
    from opacus_structured.forecasting.pretraining import load_weights

    state, meta = load_weights(str(path))
    return json.dumps({"keys": sorted(state), "meta": meta}, default=str)


def _forecast(monkeypatch, capsys, tmp_path, trials: int, name: str):
    from opacus_structured import console
    from opacus_structured.tuning import search

    monkeypatch.setattr(search, "draw_num_trials", lambda mean, eta, rng=None: trials)
    out = tmp_path / name
    argv = ["forecast", "--tune", "--tune-always", "--tune-trials", "2",
            "--data", str(_panel_csv(tmp_path)), "--freq", "M", "--epsilon", "2",
            "--delta", "1e-5", "--dataset-size", "8", "--max-steps", "4", "--num-samples",
            "10", "--no-ets", "--no-plot", "--discretization", "1e-3", "--output", str(out)]
    assert console.main(argv) == 0
    captured = capsys.readouterr()
    # the temporary folder's name may hold any number (pytest-17/...): not the command's output
    return (out, captured.out.replace(str(tmp_path), "<tmp>"),
            captured.err.replace(str(tmp_path), "<tmp>"))


# A private search of 17 + 1 small trials and the verdict's reruns: 30-120 s on 2 shared cores.
@pytest.mark.slow
def test_tune_always_release_folder_holds_no_score_and_no_trial_count(monkeypatch, capsys,
                                                                       tmp_path):
    out, stdout, stderr = _forecast(monkeypatch, capsys, tmp_path, FORCED_TRIALS, "many")
    release, diagnostics = out / "release", out / "diagnostics"
    # the release: weights (or the public model itself), the predictor and the card
    files = _files(release)
    assert "model_card.json" in files and "MODEL_CARD.md" in files
    assert "predictor/predictor.json" in files
    card = json.loads(files["model_card.json"])
    report = json.loads((diagnostics / "report.json").read_text())
    w = report["tuning"]["chosen"]["zero_shot_weight"]
    assert ("weights.pt" in files) is (w < 1)
    privacy = card["privacy"]
    assert privacy["epsilon"] == report["epsilon"] <= 2.0 and privacy["delta"] == 1e-5
    assert privacy["privacy_unit"].startswith("one time step of one series")
    assert privacy["sigma"] == report["noise_multiplier"] and privacy["steps"] >= 1
    assert privacy["scheme"]["num_series"] == 8 and "private_selection" in privacy
    assert card["public_weights"]["trained_on"].startswith("public data only")
    md = files["MODEL_CARD.md"].decode()
    assert f"ε = {report['epsilon']:.4g}" in md and "δ = 1e-05" in md
    assert "Privacy unit:** one time step of one series" in md
    # no file of the release holds a score, a test-split number or the number of trials
    texts = {k: v.decode("utf-8", "replace") for k, v in files.items() if not k.endswith(".pt")}
    if "weights.pt" in files:
        texts["weights.pt"] = _strings_of_weights(release / "weights.pt")
    scores = [report["crps"], report["mase"], *(r["crps"] for r in report["rows"]),
              *(r["mase"] for r in report["rows"] if r["mase"] is not None)]
    for name, text in texts.items():
        low = text.lower()
        assert "crps" not in low and "mase" not in low, name
        assert "trials_drawn" not in low and "trials drawn" not in low, name
        for value in scores:
            assert repr(value) not in text and f"{value:.4f}" not in text, (name, value)
        assert not re.search(rf"(?<![\d.]){FORCED_TRIALS}(?![\d.])", text), name
    # the diagnostics say they are not for publication
    assert report["publication"] == NOT_FOR_PUBLICATION
    assert "NOT FOR PUBLICATION" in (diagnostics / "README.md").read_text()
    assert "trials_drawn" not in json.dumps(report) and "trials_run" not in json.dumps(report)
    assert report["rows"][0]["seconds"] is None and report["total_seconds"] is None
    # stdout and stderr never print the number of trials
    for stream in (stdout, stderr):
        assert not re.search(rf"(?<![\d.]){FORCED_TRIALS}(?![\d.])", stream), stream
        assert "trials drawn:" not in stream and "trial(s) done" not in stream
        assert not re.search(r"\d+\s*trial(?!s\b)", stream.replace("mean 2 trials", ""))
    # --tune-always says the search runs, not what the skipped gate would have done
    assert "--tune-always: running the private search although" in stderr
    assert "trained once at the whole epsilon instead" not in stderr + stdout
    assert "dlinear (DP, tuned)" in stdout and "number of trials drawn is secret" in stdout
    # one trial instead of 17: the same lines (no line per trial), the same release files
    _, stdout_1, stderr_1 = _forecast(monkeypatch, capsys, tmp_path, 1, "one")

    def fixed(text):  # the advice depends on the scores of the run, not on K
        return [ln for ln in text.splitlines() if not ln.startswith("  - ")
                and ln != "what to do:"]

    assert len(fixed(stdout_1)) == len(fixed(stdout))
    assert len(stderr_1.splitlines()) == len(stderr.splitlines()), (stderr_1, stderr)


# One small DP run with its reruns and baselines: 10-40 s on 2 shared cores.
@pytest.mark.slow
def test_the_release_is_the_forecaster_and_carries_its_record(capsys, tmp_path):
    """The untuned release: its predictor forecasts as the released model did, its weights
    carry a privacy record without the sampler's coin fingerprint, and the diagnostics hold
    the verdict over three runs."""
    from gluonts.model.predictor import Predictor

    from opacus_structured import console
    from opacus_structured.forecasting.pretraining import load_weights

    out = tmp_path / "out"
    argv = ["forecast", "--data", str(_panel_csv(tmp_path)), "--freq", "M", "--epsilon", "2",
            "--delta", "1e-5", "--dataset-size", "8", "--max-steps", "4", "--num-samples",
            "10", "--no-ets", "--no-plot", "--discretization", "1e-3", "--output", str(out)]
    assert console.main(argv) == 0
    stdout = capsys.readouterr().out
    assert f"release (publishable: the weights and their model card): {out / 'release'}" \
        in stdout
    report = json.loads((out / "diagnostics" / "report.json").read_text())
    assert report["verdict"]["runs"] == 3 and len(report["rows"][0]["runs"]) == 3
    assert report["rows"][0]["runs"][0] == {"crps": report["crps"], "mase": report["mase"]}
    predictor = Predictor.deserialize(out / "release" / "predictor")
    assert predictor.prediction_length == 12
    state, meta = load_weights(str(out / "release" / "weights.pt"))
    run = meta["privacy_record"]["runs"][-1]
    assert "fingerprint" not in (run["accountant"].get("ledger") or {})
    assert run["epsilon"] == pytest.approx(report["epsilon"]) and math.isfinite(run["epsilon"])
    card = json.loads((out / "release" / "model_card.json").read_text())
    assert card["publishable"] is True and card["privacy"]["target_epsilon"] == 2.0
    assert card["public_weights"]["key"] == report["pretrained"]["key"]
    assert "path" not in card["public_weights"]  # no local paths
    # the release forecasts as the command's rows did: DLinear's local ETS reads up to 80·H
    # past steps of each series, the network its 36 (issue 47); the card says so
    assert predictor.input_transform.transformations[-1].past_length == 80 * 12
    assert card["forecast"]["input"] == {
        "context_length": 36, "local_history_length": 960, "history_methods": ["ets"],
        "reads": card["forecast"]["input"]["reads"]}
    assert card["training"]["trained_parameters"]["names"] == [
        "args_proj", "baseline_skip", "scale_skip"]
