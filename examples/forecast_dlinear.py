"""DP DLinear on the bundled US employment panel (structured subsampling, ε = 1, δ = 1e-7).

Run: ``python examples/forecast_dlinear.py`` (about half a minute on 2 CPU cores);
``--help`` lists the settings.
"""

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=1.0, help="privacy budget ε (default 1)")
    parser.add_argument("--delta", type=float, default=1e-7, help="δ (default 1e-7)")
    parser.add_argument("--max-steps", type=int, default=200,
                        help="optimizer steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="series per step, one window each (default 64)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    # Parse first, then import the forecasting stack (gluonts, torch): --help answers at once.
    from opacus_structured.forecasting.baselines import seasonal_naive_predictor
    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.metrics import evaluate_predictor
    from opacus_structured.forecasting.training import train_forecaster

    H = 12  # forecast the last 12 months
    train, test = train_test_split(load_us_employment(), H)

    # σ is calibrated so that the steps spend at most ε at δ under the structured-subsampling
    # accountant (batch-size series per step, one window each). No seed: the window sampler
    # and the noise draw OS entropy (seed=... would make the run reproducible and NOT private
    # — result.private is then False).
    result = train_forecaster("dlinear", train, prediction_length=H, batch_size=args.batch_size,
                              epsilon=args.epsilon, delta=args.delta, max_steps=args.max_steps,
                              lr=1e-2, progress=not args.no_progress)
    dp_metrics, _, _ = evaluate_predictor(result.create_predictor(), test.to_gluonts())
    naive, _, _ = evaluate_predictor(seasonal_naive_predictor(H, train.freq), test.to_gluonts())

    print(f"DP DLinear:     CRPS {dp_metrics['crps']:.4f}  MASE {dp_metrics['mase']:.3f}  "
          f"epsilon {result.epsilon:.3f} (delta {args.delta:g}, sigma "
          f"{result.noise_multiplier:.3g}, {result.steps} steps, {result.bound} bound, "
          f"private: {result.private})")
    print(f"seasonal naive: CRPS {naive['crps']:.4f}  MASE {naive['mase']:.3f}")
    print(f"model input window L_C = {result.prepared.past_length} (accountant: "
          f"{result.scheme.context_length}), L_F = {result.scheme.forecast_length}")


if __name__ == "__main__":
    main()
