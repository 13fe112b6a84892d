"""How finely must the private score resolve the candidates for ``forecast --tune`` to pay?
(issue 40; the public **study** panels of ``forecast_tuning.py --study`` only).

For each study panel and ε, through the ``forecast`` command's own set-up
(:func:`opacus_structured.commands.forecast._prepare_job`, DLinear, seeded: NOT PRIVATE, a study):

* the search's plan (:func:`~opacus_structured.forecasting.private_tuning.plan_tuning`): the
  trials' σ, the score's σ_s and so the score's noise standard deviation ``σ_s·C/N``;
* every candidate of the default grid trained once at the search's σ on the fit part (training
  minus its last h steps), with its **exact** validation score (the mean clipped scaled
  quantile loss the search would noise) and its test loss (the same loss, unclipped, of the
  release on the test window);
* the recipe trained once on the whole training part at the untuned σ (what ``forecast``
  without ``--tune`` releases), with its test loss.

From these, a Monte Carlo of the search itself (K drawn from the law, K candidates drawn
uniformly, the exact scores plus Gaussian noise of a given standard deviation, the best one
released) gives the expected test loss of the tuned release as a function of the score's noise,
next to the untuned release's: the largest noise up to which tuning pays at every noise from
0 (``sd*``) is what ``private_tuning.MAX_SCORE_NOISE`` is chosen from (``--seeds``: one entry per
training seed). Run::

    OMP_NUM_THREADS=1 python benchmarks/tuning_resolution.py --json resolution.json
    python benchmarks/tuning_resolution.py --json resolution.json --report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402
from forecast_tuning import STUDY, study_csv  # noqa: E402

EPSILONS = (1.0, 4.0)
NOISE_SDS = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def _job(path: str, n: int, epsilon: float, seed: int, model: str = "dlinear"):
    from opacus_structured.commands.forecast import _prepare_job, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, "--data", path, "--freq", "M",
                              "--prediction-length", "12", "--dataset-size", str(n),
                              "--seed", str(seed), "--epsilon", f"{epsilon:g}", "--tune",
                              "--no-progress", "--json", "--output", ""])
    return _prepare_job(args)


def _setup(name: str, epsilon: float, seed: int, model: str) -> dict:
    """The study panel's job, its fit part (training minus the last h steps) and the plan of a
    search over ``model`` on it (``forecast --tune``'s own set-up)."""
    from opacus_structured.forecasting import private_tuning as pt
    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.forecasting.estimators import prepare_estimator
    from opacus_structured.forecasting.training_scheme import make_scheme

    path, n = study_csv(name)
    job = _job(path, n, epsilon, seed, model=model)
    common = {k: v for k, v in job.common.items() if k not in pt._SET_HERE}
    h, train = job.args.prediction_length, job.checked.train
    fit, _ = train_test_split(train, h)
    batch = job.common["batch_size"]
    prepared = prepare_estimator(model, freq=fit.freq, prediction_length=h,
                                 context_length=job.common.get("context_length"),
                                 batch_size=batch, **(common.get("estimator_kwargs") or {}))
    scheme = make_scheme(fit, prepared, batch, top_level=common.get("top_level", "wor"),
                         num_series=common.get("dataset_size"))
    plan = pt.plan_tuning(scheme, epsilon=epsilon, delta=job.args.delta,
                          max_steps=job.args.max_steps)
    return dict(job=job, common=common, h=h, train=train, whole=job.checked.test, fit=fit,
                batch=batch, scheme=scheme, plan=plan, n=n)


def run_one(name: str, epsilon: float, seed: int = 0) -> dict:
    from opacus_structured.forecasting import private_tuning as pt
    from opacus_structured.forecasting.training import train_forecaster

    st = _setup(name, epsilon, seed, "dlinear")
    job, common, h, train, whole, fit = (st[k] for k in ("job", "common", "h", "train",
                                                        "whole", "fit"))
    batch, scheme, plan, n = st["batch"], st["scheme"], st["plan"], st["n"]
    lr, steps = job.lr, job.args.max_steps
    cands = pt.default_candidates(lr=lr, max_steps=steps, zero_shot=True)
    season = job.season_length
    entry = {"panel": name, "epsilon": epsilon, "seed": seed, "num_series": n,
             "sigma": plan.sigma, "score_sigma": plan.score_sigma,
             "score_noise_sd": plan.score_sigma * pt.SCORE_CLIP / scheme.num_series,
             "candidates": []}
    t0 = time.perf_counter()
    for i, cand in enumerate(cands):
        res = train_forecaster(
            "dlinear", fit, epsilon=None, delta=job.args.delta, noise_multiplier=plan.sigma,
            lr=cand.lr, max_steps=cand.max_steps, prediction_length=h, batch_size=batch,
            zero_shot_weight=cand.zero_shot_weight if cand.zero_shot_weight < 1 else 0.0,
            seed=seed + 7919 * (i + 1), discretization=job.args.discretization, log=None,
            progress=False, **common)
        released = pt.TuneResult(res, cand, float("nan"), plan, cands, 0, 0.0, job.init_state,
                                 "dlinear", fit.freq, h, job.common.get("context_length"))
        pred = released.create_predictor()
        val = pt.validation_losses(list(pred.predict(fit.to_gluonts(), num_samples=100)),
                                   fit, train, h, season)
        test = pt.validation_losses(list(pred.predict(train.to_gluonts(), num_samples=100)),
                                    train, whole, h, season, clip=1e9)
        entry["candidates"].append({**cand.describe(), "val": float(val.mean()),
                                    "test": float(test.mean())})
    untuned = train_forecaster("dlinear", train, epsilon=epsilon, delta=job.args.delta,
                               log=None, **{**job.common, "progress": False})
    test = pt.validation_losses(
        list(untuned.create_predictor().predict(train.to_gluonts(), num_samples=100)),
        train, whole, h, season, clip=1e9)
    entry.update(untuned_sigma=untuned.noise_multiplier, untuned_test=float(test.mean()),
                 seconds=time.perf_counter() - t0)
    return entry


def _grid(entry: dict, grid: str) -> list[dict]:
    """The candidates of ``grid``: ``full`` (the 19 of ``forecast --tune``) or ``weights``
    (the recipe's lr and steps, W in {0, 0.25, 0.5, 1}: the "fewer candidates" lever)."""
    cands = entry["candidates"]
    if grid == "full":
        return cands
    if grid == "with-deepar":
        return cands + entry.get("deepar", [])
    lr, steps = max(c["lr"] for c in cands) / 3.0, max(c["max_steps"] for c in cands)
    return [c for c in cands if c["max_steps"] == steps and math.isclose(c["lr"], lr)]


def run_deepar(entry: dict, seed: int = 0) -> list[dict]:
    """The DeepAR-against-DLinear lever, optimistically: DeepAR's recipe trained once at the σ
    a search over DeepAR alone would need (its own scheme and steps, the same law and score
    share), on the same fit part, scored and tested at W in {0, 0.25, 0.5} (the mixture is
    post-processing of one run). A real DLinear-or-DeepAR search prices each trial as both runs
    composed, so its σ is larger than this: these are lower bounds on its losses."""
    from opacus_structured.forecasting import private_tuning as pt
    from opacus_structured.forecasting.training import train_forecaster

    st = _setup(entry["panel"], entry["epsilon"], seed, "deepar")
    job, common, h, train, whole, fit = (st[k] for k in ("job", "common", "h", "train",
                                                        "whole", "fit"))
    batch, plan = st["batch"], st["plan"]
    res = train_forecaster("deepar", fit, epsilon=None, delta=job.args.delta,
                           noise_multiplier=plan.sigma, lr=job.lr, max_steps=job.args.max_steps,
                           prediction_length=h, batch_size=batch, zero_shot_weight=0.25,
                           seed=seed + 104729, discretization=job.args.discretization,
                           log=None, progress=False, **common)
    out = []
    for w in (0.0, 0.25, 0.5):
        pred = res.create_predictor(zero_shot_weight=w)
        val = pt.validation_losses(list(pred.predict(fit.to_gluonts(), num_samples=100)),
                                   fit, train, h, job.season_length)
        test = pt.validation_losses(list(pred.predict(train.to_gluonts(), num_samples=100)),
                                    train, whole, h, job.season_length, clip=1e9)
        out.append({"model": "deepar", "lr": job.lr, "max_steps": job.args.max_steps,
                    "zero_shot_weight": w, "sigma": plan.sigma, "val": float(val.mean()),
                    "test": float(test.mean())})
    return out


def simulate(entry: dict, sd: float, *, mean_trials: float = 3.0, eta: float = 1.0,
             draws: int = 20000, seed: int = 0, grid: str = "full") -> float:
    """Expected test loss of the search's release at score noise ``sd`` (module docstring)."""
    from opacus_structured.tuning.search import draw_num_trials

    rng = np.random.default_rng(seed)
    cands = _grid(entry, grid)
    val = np.array([c["val"] for c in cands])
    test = np.array([c["test"] for c in cands])
    total = 0.0
    for _ in range(draws):
        k = draw_num_trials(mean_trials, eta, rng=rng)
        picks = rng.integers(len(val), size=max(k, 1))
        noisy = val[picks] + rng.normal(0.0, sd, size=len(picks))
        total += test[picks[int(np.argmin(noisy))]]
    return total / draws


def _label(entry: dict) -> str:
    return entry["panel"] + (f", seed {entry['seed']}" if entry.get("seed", 0) else "")


def report(runs: list[dict]) -> str:
    out = ["| panel | N | ε | seed | σ untuned → search | score noise sd | untuned test | "
           "best candidate test | " + " | ".join(f"tuned at sd {s:g}" for s in NOISE_SDS)
           + " | sd* |", "|" + "---|" * (9 + len(NOISE_SDS))]
    for e in runs:
        sims = [simulate(e, s) for s in NOISE_SDS]
        pays = []  # sd*: the noises from 0 up at which the search beats the untuned release
        for sd, value in zip(NOISE_SDS, sims, strict=True):
            if not value < e["untuned_test"]:
                break
            pays.append(sd)
        best = min(c["test"] for c in e["candidates"])
        out.append(f"| {e['panel']} | {e['num_series']} | {e['epsilon']:g} | {e['seed']} | "
                   f"{e['untuned_sigma']:.3g} → {e['sigma']:.3g} | {e['score_noise_sd']:.3g} | "
                   f"{e['untuned_test']:.4f} | {best:.4f} | "
                   + " | ".join(f"{v:.4f}" for v in sims)
                   + f" | {max(pays) if pays else 'none'} |")
    out += ["", "Levers at the search's σ (expected test loss of the release; sd = the score's "
            "noise): fewer candidates (W only, at the recipe's lr and steps), more trials "
            "(E[K] = 10), and the best a perfect choice of W alone could do (oracle, test "
            "losses).", "",
            "| panel | N | ε | untuned test | recipe W = 0.25 at the search's σ | oracle W | "
            "W only, sd 0 | W only, sd of the run | E[K] = 10, sd 0 | E[K] = 10, sd of the run |",
            "|" + "---|" * 10]
    for e in runs:
        w = _grid(e, "weights")
        recipe = next(c["test"] for c in w if c["zero_shot_weight"] == 0.25)
        sd = e["score_noise_sd"]
        out.append(f"| {_label(e)} | {e['num_series']} | {e['epsilon']:g} | "
                   f"{e['untuned_test']:.4f} | {recipe:.4f} | "
                   f"{min(c['test'] for c in w):.4f} | "
                   f"{simulate(e, 0.0, grid='weights'):.4f} | "
                   f"{simulate(e, sd, grid='weights'):.4f} | "
                   f"{simulate(e, 0.0, mean_trials=10.0):.4f} | "
                   f"{simulate(e, sd, mean_trials=10.0):.4f} |")
    with_deepar = [e for e in runs if e.get("deepar")]
    if with_deepar:
        out += ["", "DeepAR against DLinear (optimistic: DeepAR at the σ of a DeepAR-only search; "
                "a search over both prices each trial as both runs):", "",
                "| panel | N | ε | untuned DLinear test | DeepAR σ | DeepAR test at W 0 / 0.25 / "
                "0.5 | search with DeepAR, sd 0 | search with DeepAR, sd of the run |",
                "|" + "---|" * 8]
        for e in with_deepar:
            d = e["deepar"]
            out.append(f"| {_label(e)} | {e['num_series']} | {e['epsilon']:g} | "
                       f"{e['untuned_test']:.4f} | {d[0]['sigma']:.3g} | "
                       + " / ".join(f"{c['test']:.4f}" for c in d)
                       + f" | {simulate(e, 0.0, grid='with-deepar'):.4f} | "
                       f"{simulate(e, e['score_noise_sd'], grid='with-deepar'):.4f} |")
    return "\n".join(out)


def _save(path, state: dict) -> None:
    if path:
        state["machine"] = {"cpu": cpu_name(), "python": platform.python_version()}
        with open(path + ".tmp", "w") as fh:
            json.dump(state, fh, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--panels", nargs="+", default=list(STUDY), choices=list(STUDY))
    ap.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="training seeds of the study (one entry per panel, ε and seed)")
    ap.add_argument("--deepar", action="store_true",
                    help="add the DeepAR lever (run_deepar) to the entries that lack it")
    args = ap.parse_args(argv)
    state = {"runs": []}
    if args.json and os.path.isfile(args.json):
        with open(args.json) as fh:
            state = json.load(fh)
    if args.deepar and not args.report:
        for entry in state["runs"]:
            if entry["panel"] in args.panels and entry["epsilon"] in args.epsilons \
                    and "deepar" not in entry:
                t0 = time.perf_counter()
                entry["deepar"] = run_deepar(entry)
                print(f"{entry['panel']} ε={entry['epsilon']:g} DeepAR: "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
                _save(args.json, state)
    elif not args.report:
        done = {(r["panel"], r["epsilon"], r.get("seed", 0)) for r in state["runs"]}
        for seed in args.seeds:
            for name, eps in ((p, e) for p in args.panels for e in args.epsilons):
                if (name, eps, seed) in done:
                    continue
                entry = run_one(name, eps, seed)
                state["runs"].append(entry)
                print(f"{name} ε={eps:g} seed {seed}: {entry['seconds']:.0f} s",
                      file=sys.stderr)
                _save(args.json, state)
    print(report(state["runs"]))
    print(f"CPU: {cpu_name()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
