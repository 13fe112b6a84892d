"""DP DLinear on the bundled US employment panel (structured subsampling, ε = 1, δ = 1e-7).

Run: ``python examples/forecast_dlinear.py`` (about half a minute on 2 CPU cores).
"""

from opacus_structured.forecasting.baselines import seasonal_naive_predictor
from opacus_structured.forecasting.data import load_us_employment, train_test_split
from opacus_structured.forecasting.metrics import evaluate_predictor
from opacus_structured.forecasting.training import train_forecaster

H = 12  # forecast the last 12 months
train, test = train_test_split(load_us_employment(), H)

# σ is calibrated so that 200 steps spend at most ε = 1 at δ = 1e-7 under the
# structured-subsampling accountant (64 series per step, one window each). No seed: the window
# sampler and the noise draw OS entropy (seed=... would make the run reproducible and NOT
# private — result.private is then False).
result = train_forecaster("dlinear", train, prediction_length=H, batch_size=64,
                          epsilon=1.0, delta=1e-7, max_steps=200, lr=1e-2, progress=True)
dp_metrics, _, _ = evaluate_predictor(result.create_predictor(), test.to_gluonts())
naive, _, _ = evaluate_predictor(seasonal_naive_predictor(H, train.freq), test.to_gluonts())

print(f"DP DLinear:     CRPS {dp_metrics['crps']:.4f}  MASE {dp_metrics['mase']:.3f}  "
      f"epsilon {result.epsilon:.3f} (delta 1e-7, sigma {result.noise_multiplier:.3g}, "
      f"{result.steps} steps, {result.bound} bound, private: {result.private})")
print(f"seasonal naive: CRPS {naive['crps']:.4f}  MASE {naive['mase']:.3f}")
print(f"model input window L_C = {result.prepared.past_length} (accountant: "
      f"{result.scheme.context_length}), L_F = {result.scheme.forecast_length}")
