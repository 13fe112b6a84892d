"""The digits MLP of ``swap_accountant_opacus.py``, in Lightning, made private by ``DPCallback``.

The LightningModule below is ordinary, non-private Lightning code: no Opacus import, a plain
shuffled DataLoader and a plain SGD optimizer. Attaching ``DPCallback`` to the Trainer hooks
per-sample gradients, wraps the optimizer in Opacus' ``DPOptimizer``, replaces the shuffled
loader's sampler with the scheme's Poisson sampler, logs ``dp/epsilon`` each step, and stops
before the step that would take ε above ``--target-epsilon``.

Run: ``python examples/lightning_dp.py`` (CPU, about a minute).
"""

import argparse
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_callbacks.dp_callback import DPCallback
from opacus_structured._optional import install_excepthook, require
from opacus_structured.schemes.poisson import PoissonScheme


class DigitsMLP(pl.LightningModule):
    def __init__(self, lr=0.5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs")
    parser.add_argument("--steps-per-epoch", type=int, default=20,
                        help="steps per epoch; the Poisson rate is 1 / steps per epoch")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="noise multiplier σ")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping norm C")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ at which ε is reported")
    parser.add_argument("--target-epsilon", type=float, default=2.5,
                        help="training stops before the step that would exceed this ε")
    parser.add_argument("--log-dir", default="lightning_logs_dp",
                        help="CSVLogger directory (per-step dp/epsilon)")
    parser.add_argument("--seed", type=int, default=0, help="data, model and noise seed")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)

    digits = require("sklearn.datasets", "this example's data set").load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    train, test = perm[:1400], perm[1400:]
    loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=70, shuffle=True)

    dp = DPCallback(scheme=PoissonScheme(sample_rate=1.0 / args.steps_per_epoch),
                    noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
                    delta=args.delta, target_epsilon=args.target_epsilon,
                    discretization=1e-3, seed=args.seed)
    model = DigitsMLP()
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", callbacks=[dp],
                         logger=CSVLogger(args.log_dir), log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(model, loader)

    model.eval()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"trained {dp.steps} DP steps (sigma={args.noise_multiplier}, "
          f"q=1/{args.steps_per_epoch}); epsilon={dp.epsilon():.4f} at delta={args.delta} "
          f"(target {args.target_epsilon}); test accuracy {acc:.3f}")
    print(f"per-step epsilon logged to {trainer.logger.log_dir}/metrics.csv (dp/epsilon)")


if __name__ == "__main__":
    install_excepthook()  # a missing extra: one install line, no traceback
    main()
