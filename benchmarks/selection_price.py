"""The price of a private selection over structured-subsampling trials (issue 47, item 5).

Four parts, all pricing only (nothing is trained):

1. **The issue's setting** (100 series of length 50, context 10, horizon 5, batch 5, σ = 2, 100
   steps, E[K] = 10, η = 1, δ = 1e-5): the selection's ε by the switching-pair route (what
   :func:`~opacus_structured.tuning.selection_epsilon` takes now), by the pessimistic PLD's
   Rényi divergences (the route before, at two discretizations), and dp_accounting's
   ``RepeatAndSelectDpEvent`` of the equivalent event (Poisson-subsampled Gaussian, σ/2,
   q = ρr); one run's ε for scale.
2. **The tuning gate's limits** (``private_tuning.tuning_gate``): the series a search needs at
   ε = 1, 4, 8 and the ε it needs on each public panel. The gate reads only the score's noise
   (a Gaussian mechanism), so the cheaper trial price leaves these unchanged; printed to show it.
3. **Each trial's σ against the untuned σ** on the public panels (the 8 evaluation panels at
   ε = 1, the 4 study panels at ε = 1 and 4), through the ``forecast`` command's own set-up
   (DLinear, δ = 1e-7): the search's σ now and with the PLD route (as before), over the σ of
   one untuned run.
4. **Two-sided pairs** (the issue's setting under Theorems E.8, F.2, F.1 with λ = 2, and E.1 /
   F.1 at λ = 1): the selection's ε by the mixture-pair route
   (:mod:`~opacus_structured.accounting.mixture_renyi`, what ``selection_epsilon`` takes now),
   by the PLD route (the route before; refused where the PLD is not a pair's), one run's ε,
   and the quadrature's gap (upper over lower bound of the unit pair's log-moment, largest over
   the default orders).

Run::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/selection_price.py --json selection_price.json
    python benchmarks/selection_price.py --json selection_price.json --report
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402

DELTA_SETTING = 1e-5
SETTING = dict(num_series=100, series_length=50, context_length=10, forecast_length=5,
               batch_size=5)
EVALUATION = ("nyc_weather", "swiss_nox", "fx_rates", "online_retail", "commodities", "prison",
              "arrivals", "life_expectancy")
STUDY_RUNS = (("synthetic-8", 1.0), ("synthetic-8", 4.0), ("synthetic-30", 1.0),
              ("synthetic-30", 4.0), ("synthetic-148", 1.0), ("synthetic-148", 4.0),
              ("txhousing", 1.0), ("txhousing", 4.0))


@contextlib.contextmanager
def pld_route():
    """Price structured trials as before issue 47: the pessimistic PLD's Rényi divergences."""
    from opacus_structured.tuning import pricing

    saved = pricing._switching_route, pricing._mixture_routes
    pricing._switching_route = lambda *args: None
    pricing._mixture_routes = lambda *args: None
    try:
        yield
    finally:
        pricing._switching_route, pricing._mixture_routes = saved


def part_setting() -> dict:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.accounting import private_selection as ps
    from opacus_structured.schemes.structured import StructuredScheme
    from opacus_structured.tuning import selection_epsilon

    scheme = StructuredScheme(**SETTING)
    law = dict(mean_trials=10, eta=1.0, delta=DELTA_SETTING)
    out = {"rho": scheme.series_sampling_rate(), "r": scheme.hit_probability()}
    q = out["rho"] * out["r"]
    for d in (1e-3, 1e-4):
        acc = SchemeAccountant(scheme, discretization=d)
        acc.step(noise_multiplier=2.0, sample_rate=scheme.expected_sample_rate(),
                 num_steps=100)
        t0 = time.perf_counter()
        now = selection_epsilon(acc, **law)
        t1 = time.perf_counter()
        with pld_route():
            before = selection_epsilon(acc, **law)
        t2 = time.perf_counter()
        out[f"d={d:g}"] = {"one_run": float(acc.get_epsilon(DELTA_SETTING)),
                           "switching_pair": float(now), "route": now.route,
                           "pld_renyi": float(before), "seconds_switching": t1 - t0,
                           "seconds_pld": t2 - t1}
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.0)), 100)
    acc = rdp.RdpAccountant(list(ps.DEFAULT_ORDERS))
    acc.compose(dp_event.RepeatAndSelectDpEvent(event, 10, 1.0))
    out["equivalent_event"] = float(acc.get_epsilon(DELTA_SETTING))
    return out


#: Part 4: (label, scheme overrides, selection law's E[K])
TWO_SIDED = (("thm_e_8", dict(top_level="deterministic", bottom_level="poisson"), 10),
             ("thm_f_2", dict(bottom_level="poisson", bound="upper"), 10),
             ("thm_f_1 (lambda=2)", dict(bound="upper", instances_per_series=2), 10),
             ("thm_f_1 (lambda=1)", dict(bound="upper"), 10),
             ("thm_e_1 (lambda=1)", dict(top_level="deterministic", bound="upper"), 10),
             ("thm_f_1 (lambda=1), E[K]=3, 10 steps", dict(bound="upper"), 3))


def part_two_sided() -> list:
    import numpy as np

    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.accounting import mixture_renyi as mr
    from opacus_structured.accounting import private_selection as ps
    from opacus_structured.schemes.structured import StructuredScheme
    from opacus_structured.tuning import selection_epsilon

    rows = []
    for label, overrides, mean in TWO_SIDED:
        scheme = StructuredScheme(**SETTING, **overrides)
        acc = SchemeAccountant(scheme, discretization=1e-3)
        acc.step(noise_multiplier=2.0, sample_rate=scheme.expected_sample_rate(),
                 num_steps=10 if "10 steps" in label else 100)
        law = dict(mean_trials=mean, eta=1.0, delta=DELTA_SETTING)
        t0 = time.perf_counter()
        now = selection_epsilon(acc, **law)
        t1 = time.perf_counter()
        try:
            with pld_route():
                before = float(selection_epsilon(acc, **law))
            refusal = None
        except ValueError as err:
            before, refusal = None, str(err)
        t2 = time.perf_counter()
        _, pair = mr.profile_pairs(scheme.profile(2.0))[0]
        lower, upper = mr.log_moment_bounds(pair, ps.DEFAULT_ORDERS)
        gap = float(np.max((upper - lower) / np.maximum(upper, 1e-3)))
        rows.append({"theorem": label, "unit": scheme.unit, "mean_trials": mean,
                     "one_run": float(acc.get_epsilon(DELTA_SETTING)),
                     "mixture_pair": float(now), "route": now.route, "pld_renyi": before,
                     "pld_refusal": refusal, "quadrature_gap": gap,
                     "seconds_mixture": t1 - t0, "seconds_pld": t2 - t1})
    return rows


def part_gate(panels: dict) -> dict:
    from opacus_structured.forecasting import private_tuning as pt

    limits = {}
    for eps in (1.0, 2.0, 4.0, 8.0):
        g = pt.tuning_gate(epsilon=eps, delta=1e-7, num_series=1)
        limits[f"{eps:g}"] = {"score_sigma": g.score_sigma, "series_needed": g.series_needed}
    per_panel = {}
    for name, n in panels.items():
        g = pt.tuning_gate(epsilon=1.0, delta=1e-7, num_series=n)
        per_panel[name] = {"num_series": n, "search_run": g.tune,
                           "score_noise_sd": g.score_noise_sd,
                           "series_needed": g.series_needed,
                           "epsilon_needed": (g.epsilon_needed
                                              if math.isfinite(g.epsilon_needed) else None)}
    return {"max_score_noise": pt.MAX_SCORE_NOISE, "limits": limits, "panels": per_panel}


def _job(path: str, n: int, freq: str, h: int, epsilon: float):
    from opacus_structured.commands.forecast import _prepare_job, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "dlinear", "--data", path, "--freq", freq,
                              "--prediction-length", str(h), "--dataset-size", str(n),
                              "--seed", "0", "--epsilon", f"{epsilon:g}", "--tune",
                              "--no-progress", "--json", "--output", ""])
    return _prepare_job(args)


def part_sigma(name: str, epsilon: float) -> dict:
    """σ of the search (now and with the PLD route) over the untuned σ, on one panel."""
    from forecast_panels import PANELS, panel_csv
    from forecast_tuning import STUDY, study_csv

    from opacus_structured.accounting.calibration import calibrate_noise_multiplier
    from opacus_structured.forecasting import private_tuning as pt
    from opacus_structured.forecasting.data import train_test_split
    from opacus_structured.forecasting.estimators import prepare_estimator
    from opacus_structured.forecasting.training_scheme import make_scheme

    if name in STUDY:
        (path, n), freq, h = study_csv(name), "M", 12
    else:
        (path, n), freq, h = panel_csv(name), PANELS[name].freq, PANELS[name].prediction_length
    job = _job(path, n, freq, h, epsilon)
    common = {k: v for k, v in job.common.items() if k not in pt._SET_HERE}
    h, train = job.args.prediction_length, job.checked.train
    fit, _ = train_test_split(train, h)
    batch = job.common["batch_size"]
    d = job.common.get("discretization") or 1e-4
    prepared = prepare_estimator("dlinear", freq=fit.freq, prediction_length=h,
                                 context_length=job.common.get("context_length"),
                                 batch_size=batch, **(common.get("estimator_kwargs") or {}))
    options = dict(top_level=common.get("top_level", "wor"), num_series=common.get("dataset_size"))
    scheme = make_scheme(fit, prepared, batch, **options)
    whole = make_scheme(train, prepared, batch, **options)
    steps, delta = job.args.max_steps, job.args.delta
    untuned = calibrate_noise_multiplier(
        lambda s: whole.epsilon(s, steps, delta, discretization=d), epsilon, rtol=1e-2)
    t0 = time.perf_counter()
    plan = pt.plan_tuning(scheme, epsilon=epsilon, delta=delta, max_steps=steps,
                          discretization=d)
    t1 = time.perf_counter()
    with pld_route():
        before = pt.plan_tuning(scheme, epsilon=epsilon, delta=delta, max_steps=steps,
                                discretization=d)
    t2 = time.perf_counter()
    return {"panel": name, "epsilon": epsilon, "num_series": n, "theorem": scheme.theorem,
            "untuned_sigma": untuned, "sigma": plan.sigma, "route": plan.pricing_route,
            "sigma_pld_route": before.sigma, "score_sigma": plan.score_sigma,
            "trial_epsilon": plan.trial_epsilon, "selection_share": plan.selection_share,
            "selection_share_pld_route": before.selection_share,
            "seconds_plan": t1 - t0, "seconds_plan_pld_route": t2 - t1}


def _table(header: str, rows) -> list[str]:
    """A markdown table: ``header`` (its cells between bars), its rule, then ``rows``."""
    return [header, "|---" * (header.count("|") - 1) + "|", *rows]


def _setting_rows(s: dict):
    for d in ("1e-3", "1e-4"):
        row = s[f"d={float(d):g}"]
        yield (f"| {d} | {row['one_run']:.3f} | {row['switching_pair']:.3f} | "
               f"{row['pld_renyi']:.3f} | {s['equivalent_event']:.3f} | "
               f"{row['switching_pair'] / s['equivalent_event']:.3f} |")


def _two_sided_rows(rows: list):
    for r in rows:
        before = ("refused" if r["pld_renyi"] is None else f"{r['pld_renyi']:.3f}")
        ratio = ("-" if r["pld_renyi"] is None
                 else f"{r['mixture_pair'] / r['pld_renyi']:.3f}")
        yield (f"| {r['theorem']} ({r['unit']}) | {r['mean_trials']:g} | "
               f"{r['one_run']:.3f} | {r['mixture_pair']:.3f} | {before} | {ratio} | "
               f"{r['quadrature_gap']:.1e} |")


def _gate_panel_rows(g: dict):
    for name, row in g["panels"].items():
        need = "none" if row["epsilon_needed"] is None else f"{row['epsilon_needed']:.3g}"
        yield (f"| {name} | {row['num_series']} | {row['score_noise_sd']:.3g} | "
               f"{'yes' if row['search_run'] else 'no'} | {row['series_needed']} | {need} |")


def _sigma_rows(rows: list):
    for r in rows:
        u = r["untuned_sigma"]
        yield (f"| {r['panel']} | {r['num_series']} | {r['epsilon']:g} | "
               f"{r['theorem']} | {u:.3g} | {r['sigma']:.3g} | "
               f"{r['sigma'] / u:.2f} | {r['sigma_pld_route']:.3g} | "
               f"{r['sigma_pld_route'] / u:.2f} | {r['selection_share']:.2f} / "
               f"{r['selection_share_pld_route']:.2f} |")


def report(state: dict) -> str:
    lines = [f"machine: {state.get('machine')}", ""]
    s = state.get("setting")
    if s:
        lines += _table("| discretization | one run | selection, switching pair (now) | "
                        "selection, PLD Rényi (before) | equivalent event (dp_accounting) | "
                        "now / event |", _setting_rows(s)) + [""]
    rows = state.get("two_sided") or []
    if rows:
        lines += _table("| theorem (unit) | E[K] | one run | selection, mixture pair (now) | "
                        "selection, PLD Rényi (before) | now / before | quadrature gap |",
                        _two_sided_rows(rows)) + [""]
    g = state.get("gate")
    if g:
        lines += [f"gate (MAX_SCORE_NOISE = {g['max_score_noise']}):", ""]
        lines += _table("| ε | σ_s | series needed |",
                        (f"| {eps} | {row['score_sigma']:.3g} | {row['series_needed']} |"
                         for eps, row in g["limits"].items())) + [""]
        lines += _table("| panel | N | score noise sd at ε = 1 | search runs | series needed "
                        "| ε needed |", _gate_panel_rows(g)) + [""]
    rows = state.get("sigma") or []
    if rows:
        lines += _table("| panel | N | ε | theorem | σ untuned | σ of the search (now) | × | "
                        "σ, PLD route (before) | × | selection share now / before |",
                        _sigma_rows(rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="results file (resumable)")
    parser.add_argument("--report", action="store_true", help="print the tables only")
    parser.add_argument("--parts", default="setting,two_sided,gate,sigma")
    args = parser.parse_args(argv)
    state = {}
    if args.json and os.path.isfile(args.json):
        with open(args.json) as fh:
            state = json.load(fh)
    if args.report:
        print(report(state))
        return 0
    state["machine"] = f"{cpu_name()}, {os.cpu_count()} cores, {platform.python_version()}"

    def save():
        if args.json:
            with open(args.json + ".tmp", "w") as fh:
                json.dump(state, fh, indent=1)
            os.replace(args.json + ".tmp", args.json)

    parts = args.parts.split(",")
    if "setting" in parts and "setting" not in state:
        state["setting"] = part_setting()
        save()
    if "two_sided" in parts and "two_sided" not in state:
        state["two_sided"] = part_two_sided()
        save()
    if "sigma" in parts:
        done = {(r["panel"], r["epsilon"]) for r in state.get("sigma", [])}
        for name, eps in [*((p, 1.0) for p in EVALUATION), *STUDY_RUNS]:
            if (name, eps) in done:
                continue
            try:
                row = part_sigma(name, eps)
            except (Exception, SystemExit) as err:  # a panel's data is missing: say so
                print(f"{name} at epsilon={eps:g}: {type(err).__name__}: {err}", file=sys.stderr)
                continue
            state.setdefault("sigma", []).append(row)
            print(f"{name} eps={eps:g}: sigma {row['untuned_sigma']:.3g} -> {row['sigma']:.3g}"
                  f" (PLD route {row['sigma_pld_route']:.3g})", file=sys.stderr)
            save()
    if "gate" in parts:
        sizes = {r["panel"]: r["num_series"] for r in state.get("sigma", [])}
        state["gate"] = part_gate(sizes)
        save()
    print(report(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
