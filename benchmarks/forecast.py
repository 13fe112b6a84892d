"""Benchmark: DP forecasting on the bundled US employment panel.

Measures, for each model, (1) the time per optimizer step of DP training (per-window
gradients + clipping + noise) vs non-private training, and (2) CRPS / MASE at
ε ∈ {0.5, 1, 2, ∞} (δ = 1e-7) next to seasonal naive, over ``--repeats`` runs with fresh
(secret) sampler and noise coins, or over ``--seeds`` seeds (reproducible, hence NOT private:
the records say ``"private": false``). Uses CUDA when present (``--device auto``). Prints a
markdown table and writes JSON.

    python benchmarks/forecast.py                          # DeepAR + DLinear, auto device
    python benchmarks/forecast.py --models deepar --repeats 3 --max-steps 1000 --json out.json
    python benchmarks/forecast.py --seeds 0 1 2            # reproducible, NOT private

Acceptance target (issue 4, accelerator machine): DeepAR at ε = 1 (δ = 1e-7) better than
seasonal naive and within 25% of non-private CRPS.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time


def main(argv=None) -> int:
    import torch

    from opacus_structured.forecasting.baselines import seasonal_naive_predictor
    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.metrics import evaluate_predictor
    from opacus_structured.forecasting.training import train_forecaster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["deepar", "dlinear"],
                   choices=["deepar", "dlinear", "simpleff"])
    p.add_argument("--epsilons", nargs="+", type=float, default=[0.5, 1.0, 2.0, math.inf])
    p.add_argument("--delta", type=float, default=1e-7)
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="seed the sampler and noise (reproducible, NOT private)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs with fresh OS-entropy coins when --seeds is not given")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    runs = args.seeds if args.seeds is not None else [None] * args.repeats
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device

    H = 12
    train, test = train_test_split(load_us_employment(), H)
    test_ds = test.to_gluonts()
    naive, _, _ = evaluate_predictor(seasonal_naive_predictor(H, train.freq), test_ds)
    records = []
    for model in args.models:
        for eps in args.epsilons:
            for seed in runs:
                res = train_forecaster(
                    model, train, prediction_length=H, batch_size=args.batch_size,
                    epsilon=None if math.isinf(eps) else eps,
                    delta=None if math.isinf(eps) else args.delta, max_steps=args.max_steps,
                    lr=args.lr, device=device, seed=seed)
                t0 = time.perf_counter()
                m, _, _ = evaluate_predictor(res.create_predictor(), test_ds)
                records.append({"model": model, "target_epsilon": eps, "private": res.private,
                                **({} if seed is None else {"seed": seed}),
                                "epsilon": res.epsilon, "noise_multiplier": res.noise_multiplier,
                                "steps": res.steps, "step_ms": 1e3 * res.step_seconds,
                                "eval_seconds": time.perf_counter() - t0, **m})
                print(json.dumps({k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                  for k, v in records[-1].items()}), flush=True)

    print(f"\ndevice: {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
          f"{len(train)} series, {args.max_steps} steps, batch {args.batch_size}, "
          f"delta {args.delta:g}, " + (f"seeds {args.seeds} (NOT PRIVATE: reproducible noise; "
                                       f"for evaluation only)" if args.seeds is not None
                                       else f"{args.repeats} run(s) with fresh coins"))
    print("\n| model | ε | CRPS | MASE | σ | ms/step |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        for eps in args.epsilons:
            rs = [r for r in records if r["model"] == model and r["target_epsilon"] == eps]
            crps = [r["crps"] for r in rs]
            sd = statistics.stdev(crps) if len(crps) > 1 else 0.0
            sig = rs[0]["noise_multiplier"]
            print(f"| {model} | {eps:g} | {statistics.mean(crps):.4f} ± {sd:.4f} | "
                  f"{statistics.mean(r['mase'] for r in rs):.3f} | "
                  f"{'-' if sig is None else format(sig, '.3g')} | "
                  f"{statistics.mean(r['step_ms'] for r in rs):.1f} |")
    print(f"| seasonal naive | - | {naive['crps']:.4f} | {naive['mase']:.3f} | - | - |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device, "records": records, "seasonal_naive": naive,
                       "settings": vars(args)}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
