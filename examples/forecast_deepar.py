"""DP DeepAR on the bundled US employment panel (structured subsampling).

DeepAR's LSTM is replaced by this package's FastDPLSTM (the default, ``lstm_impl="fast"``): a
drop-in ``nn.LSTM`` with exact per-sample gradients, the same as Opacus' DPLSTM gives
(``lstm_impl="opacus"``) but much faster. DeepAR's model input window includes the lags:
``L_C = context_length + max(lags) - 1``; the accountant is given exactly that window.

Run: ``python examples/forecast_deepar.py [--device cuda] [--epsilon 1]``.
"""

import argparse

from opacus_structured.forecasting.baselines import seasonal_naive_predictor
from opacus_structured.forecasting.data import load_us_employment, train_test_split
from opacus_structured.forecasting.metrics import evaluate_predictor
from opacus_structured.forecasting.training import train_forecaster

parser = argparse.ArgumentParser()
parser.add_argument("--epsilon", type=float, default=1.0, help="privacy budget ε (default 1)")
parser.add_argument("--delta", type=float, default=1e-7, help="δ (default 1e-7)")
parser.add_argument("--max-steps", type=int, default=200, help="training steps")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where to train")
parser.add_argument("--seed", type=int, default=None,
                    help="reproducible sampler and noise: the DP model is then NOT private "
                         "(evaluation only); default: OS entropy")
args = parser.parse_args()

H = 12
train, test = train_test_split(load_us_employment(), H)
test_ds = test.to_gluonts()
settings = dict(prediction_length=H, batch_size=64, max_steps=args.max_steps, lr=1e-2,
                device=args.device, seed=args.seed, progress=True)

dp = train_forecaster("deepar", train, epsilon=args.epsilon, delta=args.delta, **settings)
non_private = train_forecaster("deepar", train, **settings)
rows = [("DeepAR DP", dp), ("DeepAR non-private", non_private)]
for name, res in rows:
    m, _, _ = evaluate_predictor(res.create_predictor(), test_ds)
    print(f"{name:<20} CRPS {m['crps']:.4f}  MASE {m['mase']:.3f}  epsilon {res.epsilon:.3g}  "
          f"steps {res.steps}  {res.step_seconds * 1e3:.1f} ms/step")
m, _, _ = evaluate_predictor(seasonal_naive_predictor(H, train.freq), test_ds)
print(f"{'seasonal naive':<20} CRPS {m['crps']:.4f}  MASE {m['mase']:.3f}")
print(f"L_C (context + lags) = {dp.prepared.past_length}, sigma = {dp.noise_multiplier:.3g}")
if not dp.private:
    print(f"NOT PRIVATE: {dp.not_private_reason}; for evaluation only")
