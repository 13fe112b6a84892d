"""The ``forecast`` command's verdict (split out of :mod:`opacus_structured.commands.forecast`):
does the DP release beat the free alternatives on this panel's test split, and if not, what to
do; and the series left out of the MASE (constant or exactly periodic training parts).

**The rule.** The DP release (the table's first row, the forecast that is released) *beats* a
baseline when it is strictly better on **both** metrics of the table: CRPS (mean weighted
quantile loss, the probabilistic score) and MASE (the median's scaled error); where no series
has a MASE scale (:data:`~opacus_structured.forecasting.metrics.MASE_UNDEFINED_REASON`), on
CRPS alone. The baselines are the two that cost no training privacy: **seasonal naive** and the
public **zero-shot** model (absent with ``--init-from none``; then only seasonal naive counts).

**Noise-dominated.** With noise multiplier σ and ``B`` series per step, the Gaussian noise
added to the *average* clipped gradient has standard deviation ``σ·C/B`` per coordinate, where
``C`` (the clipping norm) bounds the norm of that average itself. When ``σ/B >=``
:data:`NOISE_DOMINATED` (= 1), the noise in every single coordinate is as large as the whole
gradient can be: the steps mostly follow the noise, and fine-tuning cannot be expected to help.
This is the case on small panels, where the batch is the whole panel (issue 41's runs with
6–12 series: σ = 17–54, so σ/B >= 17/12 ≈ 1.4), and not on the bundled 148-series panel
(σ ≈ 10 with B = 64: σ/B ≈ 0.16).

**Advice.** When the release loses to a baseline, or σ/B >= 1, the verdict lists what to do:
private hyperparameter selection (``--tune``; named "when available" while the command has no
such flag, and left out of a run that was tuned), more series (a larger B at the same ε lowers σ/B), a larger ε, and releasing the
free baseline that won instead (it costs no training privacy).
"""

from __future__ import annotations

import functools
import math
import sys

from ..forecasting.metrics import MASE_UNDEFINED_REASON, mase_undefined_series

__all__ = ["NOISE_DOMINATED", "VERDICT_METRICS", "dp_verdict", "add_verdicts",
           "mase_exclusion"]

#: σ/B at or above which the run is called noise-dominated (module docstring).
NOISE_DOMINATED = 1.0
#: The metrics a win needs (both, strictly lower; CRPS alone where no series has a MASE).
VERDICT_METRICS = ("crps", "mase")
_NAMES = {"seasonal_naive": "seasonal naive", "zero_shot": "the public zero-shot model"}


def _compare(crps, mase, base) -> dict:
    metrics = [m for m in VERDICT_METRICS
               if {"crps": crps, "mase": mase}[m] is not None and base.get(m) is not None]
    own = {"crps": crps, "mase": mase}
    better = {m: own[m] < base[m] for m in metrics}
    return {"beats": all(better.values()), "metrics": metrics, "better": better,
            "release": {m: own[m] for m in metrics}, "baseline": {m: base[m] for m in metrics}}


def _numbers(cmp) -> str:
    spec = {"crps": ".4f", "mase": ".3f"}
    return ", ".join(f"{m.upper()} {format(cmp['release'][m], spec[m])} vs "
                     f"{format(cmp['baseline'][m], spec[m])}" for m in cmp["metrics"])


def dp_verdict(*, label: str, crps: float, mase, dp_sgd: bool, epsilon, noise_multiplier,
               batch_size: int, num_series: int, baselines: dict,
               tune_available) -> dict:
    """The verdict on one released forecast (module docstring): ``beats_seasonal_naive``,
    ``beats_zero_shot`` (``None`` where that baseline was not run), ``noise_to_signal``
    (σ/B, ``None`` without DP-SGD), ``noise_dominated``, the per-baseline ``comparisons``, a
    one-line ``text`` and the ``advice`` list (empty when the release wins and is not
    noise-dominated)."""
    comparisons = {key: _compare(crps, mase, baselines[key])
                   for key in _NAMES if isinstance(baselines.get(key), dict)
                   and baselines[key].get("crps") is not None}
    ratio = (noise_multiplier / batch_size
             if dp_sgd and noise_multiplier is not None and batch_size else None)
    noisy = ratio is not None and ratio >= NOISE_DOMINATED
    what = label + (f" at ε = {epsilon:.3g}" if dp_sgd and "ε" not in label and epsilon
                    is not None and math.isfinite(epsilon) else "")
    if not comparisons:
        return {"beats_seasonal_naive": None, "beats_zero_shot": None,
                "metric": "CRPS and MASE", "noise_to_signal": ratio, "noise_dominated": noisy,
                "comparisons": {}, "advice": [],
                "text": f"no verdict for {what}: no baseline was run (--no-baselines)"}
    parts = []
    for key, cmp in comparisons.items():
        verb = "beats" if cmp["beats"] else "does NOT beat"
        parts.append(f"{verb} {_NAMES[key]} ({_numbers(cmp)})")
    text = f"{what} " + "; ".join(parts)
    if "zero_shot" not in comparisons:
        text += "; no zero-shot model to compare (--init-from none)"
    if noisy:
        text += (f"; noise-dominated: σ/B = {noise_multiplier:.3g}/{batch_size} = {ratio:.2g} "
                 f">= {NOISE_DOMINATED:g}, the noise per coordinate is as large as the whole "
                 "clipped mean gradient")
    losing = [key for key, cmp in comparisons.items() if not cmp["beats"]]
    advice = []
    if dp_sgd and (losing or noisy):
        if callable(tune_available):  # computed only when the advice is given
            tune_available = tune_available()
        if isinstance(tune_available, str):  # --tune's gate says a search cannot pay here
            advice.append(tune_available)
        elif tune_available is not None:  # None: this run was already tuned (or asked to be)
            advice.append("private hyperparameter selection: rerun with --tune"
                          if tune_available else
                          "private hyperparameter selection (--tune, when available)")
        advice.append(f"more series: the batch is {batch_size} of {num_series} series; a "
                      "larger panel allows a larger batch at the same ε and lowers σ/B")
        advice.append("a larger ε (--epsilon), or --epsilons 1,2,4,8,inf to see from which "
                      "budget DP fine-tuning pays")
    for key in losing:
        advice.append(f"release {_NAMES[key]} instead: it is better here and costs no "
                      "training privacy")
    return {"beats_seasonal_naive": comparisons.get("seasonal_naive", {}).get("beats"),
            "beats_zero_shot": comparisons.get("zero_shot", {}).get("beats"),
            "metric": ("CRPS and MASE (strictly lower on both)"
                       if any(len(c["metrics"]) == 2 for c in comparisons.values())
                       else "CRPS (no series has a MASE scale)"),
            "noise_to_signal": ratio, "noise_dominated": noisy,
            "comparisons": comparisons, "text": text, "advice": advice}


def add_verdicts(report: dict, args, rows: list[dict], test, truth,
                 warnings_out: list) -> str:
    """Add ``report["verdict"]`` (the first row: the released forecast) and, in a sweep, a
    ``"verdict"`` to every budget of ``report["sweep"]``; return the lines printed under the
    table. First, :func:`mase_exclusion` on the test panel ``test`` and its ground truth
    ``truth``: where series have no MASE, ``report["mase_excluded"]`` and a warning (appended
    to ``warnings_out``, which becomes ``report["warnings"]``, and printed on stderr)."""
    excluded = mase_exclusion(test, truth, report["prediction_length"],
                              report["season_length"], warnings_out)
    if excluded is not None:
        report["mase_excluded"] = excluded
        report["warnings"] = warnings_out
    common = dict(dp_sgd=report["dp_sgd"], batch_size=report["batch_size"],
                  num_series=len(test), baselines=report["baselines"],
                  # the gate once, and only if some verdict gives advice
                  tune_available=functools.cache(lambda: _tune_advice(report, args, len(test))))
    main = rows[0]
    report["verdict"] = dp_verdict(label=main["method"], crps=main["crps"], mase=main["mase"],
                                   epsilon=report["epsilon"],
                                   noise_multiplier=report["noise_multiplier"], **common)
    verdicts = [report["verdict"]]
    for entry in report.get("sweep") or []:
        if entry is report["sweep"][0]:
            entry["verdict"] = report["verdict"]
            continue
        entry["verdict"] = dp_verdict(label=entry["method"], crps=entry["crps"], mase=entry["mase"],
                                      epsilon=entry["epsilon"],
                                      noise_multiplier=entry["noise_multiplier"],
                                      **{**common, "dp_sgd": entry["dp_sgd"]})
        verdicts.append(entry["verdict"])
    lines = [f"verdict: {v['text']}" for v in verdicts]
    advice = list(dict.fromkeys(a for v in verdicts for a in v["advice"]))
    if advice:
        lines.append("what to do:")
        lines.extend(f"  - {a}" for a in advice)
    return "\n".join(lines)


def mase_exclusion(test, truth, prediction_length: int, season_length: int,
                   warnings_out: list | None = None) -> dict | None:
    """``{"series": [item ids], "reason", "mase_series"}`` for the test series left out of every
    row's MASE (:func:`~opacus_structured.forecasting.metrics.mase_undefined_series`), or
    ``None`` when every series has a MASE. With ``warnings_out``, the warning is appended to
    it and printed on stderr (``warning: MASE leaves out ...``)."""
    idx = mase_undefined_series(truth, prediction_length, season_length)
    if not idx:
        return None
    ids = [str(test.item_ids[i]) for i in idx]
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    kept = len(truth) - len(idx)
    if warnings_out is not None:
        warnings_out.append(f"MASE leaves out {len(ids)} of {len(truth)} series ({shown}): "
                            f"{MASE_UNDEFINED_REASON}; they still count in the CRPS"
                            + ("" if kept else "; no series has a MASE, so the MASE column "
                               "is empty"))
        print("warning: " + warnings_out[-1], file=sys.stderr)
    return {"series": ids, "reason": MASE_UNDEFINED_REASON, "mase_series": kept}


def _tune_advice(report: dict, args, num_series: int):
    """What the verdict says of ``--tune``: ``None`` for a run that asked for it (its
    ``report["tuning"]`` says what happened), ``True`` where its gate would run the search,
    else the gate's reason (public quantities only: ε, δ, the law and the number of series)."""
    if getattr(args, "tune", False) or not hasattr(args, "tune"):
        return None if getattr(args, "tune", False) else False
    epsilon = report.get("target_epsilon")
    if not report.get("dp_sgd") or epsilon is None or not math.isfinite(epsilon):
        return True
    from ..forecasting.private_tuning import tuning_gate  # optional: gluonts

    gate = tuning_gate(epsilon=epsilon, delta=report["delta"],
                       num_series=getattr(args, "dataset_size", None) or num_series,
                       mean_trials=getattr(args, "tune_trials", 3.0),
                       eta=getattr(args, "tune_eta", 1.0))
    if gate.tune:
        return True
    return (f"private hyperparameter selection (--tune) cannot pay here: its score's noise "
            f"would have sd {gate.score_noise_sd:.3g} on the mean clipped loss (> "
            f"{gate.max_score_noise:g}); it needs >= {gate.series_needed} series at this "
            f"epsilon, or epsilon >= {gate.epsilon_needed:.3g}")
