"""DP training time of the forecast job against ε (issue 47: "training time flat in ε").

Trains the default recipe of ``opacus-structured forecast`` (DLinear fine-tuned from the
shipped public weights, 100 steps, Λ = 64, the recipe's clipping, learning rate and tail
average) on the bundled US employment panel at every ε of ``--epsilons``, **in one process**,
``--repeats`` times in an interleaved order (ε₁, ε₂, …, then again), and prints per ε the
median ``train_seconds`` (what ``report.json`` reports: the Lightning fit, every step priced
by the accountant and ε computed once at the last step), the median time per step, the
calibration time (outside ``train_seconds``) and the ratio to the first ε's
``train_seconds``. The step count is the same at every ε, so the ratio should stay near 1:

    python benchmarks/forecast_train_time.py                       # ε = 1, 2, 4, 8
    python benchmarks/forecast_train_time.py --epsilons 1 8 50 --repeats 3 --json out.json

Acceptance (issue 47): ``train_seconds`` at ε = 8 ≤ 1.5 × that at ε = 1, measured in the same
run. Before the fix the per-epoch ``dp/epsilon_epoch`` of ``DPCallback`` composed the whole
history at every epoch (two steps on this panel), and that composition grows as σ shrinks
(a wider privacy-loss distribution): 50 compositions per fit.

The numbers depend on the machine's load (printed before and after, with the CPU model):
compare ratios taken in the same run, never times from different runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

H = 12  # the command's default horizon for the monthly bundled panel


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None,
                   help="DP-SGD steps (default: the recipe's, 100)")
    p.add_argument("--json", default=None, help="write the records and the table here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(not (e > 0 and math.isfinite(e)) for e in args.epsilons):
        p.error(f"--epsilons must be finite and > 0, got {args.epsilons}")

    import torch

    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.model_defaults import model_defaults
    from opacus_structured.forecasting.pretraining import pretrained_weights
    from opacus_structured.forecasting.training import train_forecaster

    recipe = model_defaults("dlinear")
    steps = args.max_steps or recipe["max_steps"]
    train, _ = train_test_split(load_us_employment(), H)
    state, _ = pretrained_weights("dlinear", freq=train.freq, prediction_length=H)

    def run(eps: float):
        return train_forecaster(
            "dlinear", train, epsilon=eps, delta=args.delta, prediction_length=H,
            batch_size=min(64, len(train)), lr=recipe["lr"], max_steps=steps,
            max_grad_norm=recipe["max_grad_norm"], tail_average=recipe["tail_average"],
            init_state=state, dataset_size=len(train),
            estimator_kwargs={"season_length": 12})

    load_before = _load()
    run(args.epsilons[0])  # warm-up: imports, first Lightning fit (not recorded)
    records = []
    for repeat in range(args.repeats):
        for eps in args.epsilons:
            t0 = time.perf_counter()
            res = run(eps)
            records.append({"target_epsilon": eps, "repeat": repeat, "epsilon": res.epsilon,
                            "noise_multiplier": res.noise_multiplier, "steps": res.steps,
                            "train_seconds": res.train_seconds,
                            "step_ms": 1e3 * res.step_seconds,
                            "calibration_seconds": res.calibration_seconds,
                            "wall_seconds": time.perf_counter() - t0})
            print(json.dumps(records[-1]), flush=True)
    load_after = _load()

    rows = []
    for eps in args.epsilons:
        mine = [r for r in records if r["target_epsilon"] == eps]
        rows.append({"target_epsilon": eps, "noise_multiplier": mine[0]["noise_multiplier"],
                     "steps": mine[0]["steps"],
                     "train_seconds": statistics.median(r["train_seconds"] for r in mine),
                     "step_ms": statistics.median(r["step_ms"] for r in mine),
                     "calibration_seconds": statistics.median(r["calibration_seconds"]
                                                              for r in mine)})
    base = rows[0]["train_seconds"]
    for row in rows:
        row["ratio_to_first"] = row["train_seconds"] / base
    lines = [f"forecast DP training time against epsilon (bundled panel, dlinear, {steps} steps, "
             f"median of {args.repeats}); CPU: {cpu_name()}; torch threads "
             f"{torch.get_num_threads()}; load average {load_before:.2f} before, "
             f"{load_after:.2f} after",
             "",
             "| ε | σ | steps | train_seconds | ms / step | calibration [s] | × first ε |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['target_epsilon']:g} | {r['noise_multiplier']:.3g} | {r['steps']} | "
              f"{r['train_seconds']:.2f} | {r['step_ms']:.1f} | "
              f"{r['calibration_seconds']:.2f} | {r['ratio_to_first']:.2f} |" for r in rows]
    verdict = None
    if 1.0 in args.epsilons and 8.0 in args.epsilons:
        by = {r["target_epsilon"]: r["train_seconds"] for r in rows}
        ratio = by[8.0] / by[1.0]
        verdict = {"ratio_8_to_1": ratio, "target": 1.5, "met": ratio <= 1.5}
        lines += ["", f"acceptance: train_seconds at ε = 8 is {ratio:.2f} × that at ε = 1 "
                      f"(target <= 1.5): {'met' if verdict['met'] else 'NOT met'}"]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_name(), "load_before": load_before, "load_after": load_after,
                       "repeats": args.repeats, "records": records, "rows": rows,
                       "acceptance": verdict, "table": table}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
