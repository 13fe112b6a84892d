"""Private selection around a Lightning module trained with ``DPCallback`` (issue 40: "a
train-and-score callable (an Opacus loop), or a Lightning module with DPCallback").

Each trial fits Lightning's own ``BoringModel`` under ``DPCallback`` (Poisson sampling) at one
learning rate and scores it with :func:`~opacus_structured.tuning.private_score`, handing the
callback's accountant over as the run. The search's ε is checked against an independent
computation: dp_accounting's RDP accountant on ``RepeatAndSelectDpEvent`` of the trial written
as dp_accounting events by hand.
"""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pl = pytest.importorskip("lightning.pytorch")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant as rdp  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset  # noqa: E402

from lightning_callbacks import DPCallback  # noqa: E402
from opacus_structured.schemes.poisson import PoissonScheme  # noqa: E402
from opacus_structured.tuning import PrivateSelection, private_score  # noqa: E402

warnings.filterwarnings("ignore")

N, RATE, SIGMA, SCORE_SIGMA, STEPS, DELTA = 64, 1 / 8, 2.0, 20.0, 4, 1e-5


class _LrModel(BoringModel):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _train_and_score(lr):
    torch.manual_seed(0)
    model = _LrModel(lr)
    dp = DPCallback(scheme=PoissonScheme(sample_rate=RATE), noise_multiplier=SIGMA,
                    max_grad_norm=1.0, delta=DELTA, discretization=1e-3)
    pl.Trainer(max_steps=STEPS, callbacks=[dp], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
               limit_val_batches=0, num_sanity_val_steps=0).fit(
        model, DataLoader(RandomDataset(32, N)))
    assert len(dp.accountant) == STEPS
    with torch.no_grad():  # per-example validation losses on a held-out split
        val = RandomDataset(32, 16).data
        losses = ((model(val) - 1.0) ** 2).mean(dim=1)
    score, trial = private_score(losses, clip=4.0, noise_multiplier=SCORE_SIGMA,
                                 run=dp.accountant, num_examples=16)
    return score, trial, model


@pytest.mark.slow  # fits 2+ Lightning runs (~6 s); CI runs it
def test_search_over_a_dp_callback_module_is_priced_as_dp_accountings_repeat_and_select():
    search = PrivateSelection([0.01, 0.1], _train_and_score, mean_trials=2, eta=1,
                              delta=DELTA, rng=np.random.default_rng(1))
    result = search.run()
    trial = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(RATE, dp_event.GaussianDpEvent(SIGMA)), STEPS),
        dp_event.GaussianDpEvent(SCORE_SIGMA)])
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(trial, 2, 1))
    assert result.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)
    assert result.config in (0.01, 0.1) and isinstance(result.output, _LrModel)
    assert result.output.lr == result.config
