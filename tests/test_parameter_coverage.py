"""Every trainable parameter that receives a gradient from a private batch is moved only by the
noisy step (issue 39; :mod:`opacus_structured.accountants.parameter_guard`).

At make_private (ours, Opacus' engine path with our accountant, CorrelatedNoisePrivacyEngine,
DPCallback) trainable parameters the DP optimizer does not step are refused, naming them; the
three fixes (add to the optimizer, freeze, declare public) run and price. At run time a plain
optimizer stepping a guarded parameter raises; one stepping another module (a GAN's generator)
does not.
"""

import gc

import pytest
import torch
from _training import small_mlp as body_head
from _training import xy_dataset
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import opacus_structured
from opacus_structured.accountants import parameter_guard
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.parameter_guard import (
    ForeignOptimizerStepError,
    UncoveredParametersError,
)
from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
from opacus_structured.schemes.poisson import PoissonScheme

N, B, SIGMA, DELTA, DISC = 60, 10, 1.0, 1e-5, 1e-3
STEPS_PER_EPOCH = N // B  # Poisson: q = 1/6


def dataset():
    return xy_dataset(N, 4)


def private(model, optimizer, **kw):
    engine = PrivacyEngine(accountant="poisson")
    args = dict(module=model, optimizer=optimizer, data_loader=DataLoader(dataset(), batch_size=B),
                noise_multiplier=SIGMA, max_grad_norm=1.0, dataset_size=N,
                sampler_generator=torch.Generator().manual_seed(7), discretization=DISC)
    args.update(kw)
    model, optimizer, loader = opacus_structured.make_private(engine, **args)
    return engine, model, optimizer, loader


def train(model, optimizers, loader, epochs=1):
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            for opt in optimizers:
                opt.zero_grad()
            if len(x):
                F.cross_entropy(model(x), y).backward()
            for opt in optimizers:
                opt.step()
            steps += 1
    return steps


def reference_epsilon(steps):
    acc = SchemeAccountant(PoissonScheme(sample_rate=1 / STEPS_PER_EPOCH), discretization=DISC)
    acc.step(noise_multiplier=SIGMA, sample_rate=1 / STEPS_PER_EPOCH, num_steps=steps)
    return acc.get_epsilon(DELTA)


# ---- 1. refusal at make_private ---------------------------------------------------------------
def test_our_make_private_refuses_a_head_the_dp_optimizer_does_not_step():
    model = body_head()
    with pytest.raises(UncoveredParametersError) as err:
        private(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    msg = str(err.value)
    assert msg.startswith("make_private: 2 trainable parameter tensor(s) of the module "
                          "(18 values) are not in the DP optimizer's param_groups: "
                          "'2.weight', '2.bias'.")
    for part in ("released without noise", "add them to the optimizer",
                 "p.requires_grad_(False)", "public_parameters=[...]"):
        assert part in msg
    assert isinstance(err.value, ValueError)
    assert not hasattr(model[0], "autograd_grad_sample_hooks")  # refused before wrapping
    GradSampleModule(model)  # the module can be wrapped again


def test_make_private_with_epsilon_refuses_too():
    model = body_head()
    with pytest.raises(UncoveredParametersError, match=r"^make_private_with_epsilon: 2 .*"
                       r"'2\.weight', '2\.bias'"):
        opacus_structured.make_private_with_epsilon(
            PrivacyEngine(accountant="poisson"), module=model,
            optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1),
            data_loader=DataLoader(dataset(), batch_size=B), target_epsilon=2.0,
            target_delta=DELTA, epochs=1, max_grad_norm=1.0, dataset_size=N)


def test_opacus_engine_path_with_our_accountant_refuses_and_unhooks_the_module():
    model = body_head()
    engine = PrivacyEngine(accountant="poisson")
    with pytest.raises(UncoveredParametersError) as err:
        engine.make_private(module=model, optimizer=torch.optim.SGD(model[0].parameters(),
                                                                     lr=0.1),
                            data_loader=DataLoader(dataset(), batch_size=B),
                            noise_multiplier=SIGMA, max_grad_norm=1.0)
    # names of the user's module, not of Opacus' GradSampleModule ('_module.2.weight')
    assert "param_groups: '2.weight', '2.bias'." in str(err.value)
    assert not hasattr(model, "autograd_grad_sample_hooks")
    GradSampleModule(model)


def test_correlated_noise_engine_refuses_whatever_the_accountant():
    model = body_head()
    engine = CorrelatedNoisePrivacyEngine(accountant="prv")
    kw = dict(data_loader=DataLoader(dataset(), batch_size=B), noise_multiplier=SIGMA,
              max_grad_norm=1.0)
    with pytest.raises(UncoveredParametersError, match=r"'2\.weight', '2\.bias'"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model[0].parameters(),
                                                                     lr=0.1), **kw)
    model = body_head()
    _, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1),
        public_parameters=["2.weight", "2.bias"], **kw)
    assert isinstance(optimizer, DPOptimizer)


# ---- the three fixes --------------------------------------------------------------------------
def test_fix_1_every_part_in_the_dp_optimizer_as_param_groups():
    model = body_head()
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[2].parameters(), "lr": 0.01}], lr=0.1)
    engine, model, opt, loader = private(model, opt)
    steps = train(model, [opt], loader, epochs=2)
    assert steps == 2 * STEPS_PER_EPOCH
    assert engine.get_epsilon(DELTA) == reference_epsilon(steps)


def test_fix_2_frozen_parameters_never_count():
    model = body_head()
    model[2].requires_grad_(False)
    head = [p.detach().clone() for p in model[2].parameters()]
    engine, model, opt, loader = private(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    # a plain optimizer over the frozen head has nothing to step: it moves nothing, passes
    idle = torch.optim.SGD(model._module[2].parameters(), lr=0.1)
    steps = train(model, [opt, idle], loader)
    assert all(torch.equal(a, b) for a, b in zip(head, model._module[2].parameters(), strict=True))
    assert engine.get_epsilon(DELTA) == reference_epsilon(steps)


@pytest.mark.parametrize("declare", ["names", "parameters", "module"])
def test_fix_3_public_parameters_are_left_to_the_user(declare):
    model = body_head()
    public = {"names": ["2.weight", "2.bias"], "parameters": model[2].parameters(),
              "module": model[2]}[declare]
    head_opt = torch.optim.Adam(model[2].parameters(), lr=0.01)
    head = [p.detach().clone() for p in model[2].parameters()]
    engine, model, opt, loader = private(model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                                         public_parameters=public)
    assert parameter_guard.declared_public_parameters(model) == ["2.weight", "2.bias"]
    # declared public: a plain optimizer may step them (the user's claim: public data only)
    steps = train(model, [opt, head_opt], loader)
    moved = zip(head, model._module[2].parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in moved)
    assert engine.get_epsilon(DELTA) == reference_epsilon(steps)


def test_public_parameters_unknown_name_or_foreign_tensor_is_refused():
    model = body_head()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"names 'head\.weight', which is not a parameter of "
                                         r"the module \(its parameters: '0\.weight'"):
        private(model, opt, public_parameters=["head.weight"])
    with pytest.raises(ValueError, match=r"tensor of shape \(3,\) that is not a parameter"):
        private(model, opt, public_parameters=[nn.Parameter(torch.zeros(3))])


# ---- 2. the run-time guard --------------------------------------------------------------------
def test_a_plain_optimizer_stepping_a_guarded_parameter_raises_before_moving_it():
    model = body_head()
    head_opt = torch.optim.Adam(model[2].parameters(), lr=0.01)  # built before make_private
    engine, model, opt, loader = private(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert parameter_guard.is_guarded(model)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()  # the DP step (and its inner SGD step) passes
    head = [p.detach().clone() for p in model._module[2].parameters()]
    with pytest.raises(ForeignOptimizerStepError) as err:
        head_opt.step()
    msg = str(err.value)
    assert msg.startswith("torch.optim.adam.Adam is about to step 2 parameter(s) of the private "
                          "module (Sequential) that a DP optimizer guards: '2.weight', '2.bias'.")
    assert "without clipping or noise" in msg and "release_parameters(module)" in msg
    assert all(torch.equal(a, b) for a, b in zip(head, model._module[2].parameters(), strict=True))
    assert isinstance(err.value, RuntimeError)
    assert engine.get_epsilon(DELTA) == reference_epsilon(1)


def test_repro_02_shape_refused_at_make_private_or_at_the_first_head_step():
    # the reproduction: DP optimizer over the body, plain Adam over the head
    model = body_head()
    with pytest.raises(UncoveredParametersError):
        private(model, torch.optim.SGD(model[0].parameters(), lr=0.05))
    # the same loop with the DP optimizer over everything: the head's Adam step raises
    model = body_head()
    head_opt = torch.optim.Adam(model[2].parameters(), lr=0.01)
    _, model, opt, loader = private(model, torch.optim.SGD(model.parameters(), lr=0.05))
    with pytest.raises(ForeignOptimizerStepError, match="'2.weight', '2.bias'"):
        train(model, [opt, head_opt], loader)


def test_gan_generator_optimizer_on_another_module_passes():
    torch.manual_seed(0)
    net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    net_g = nn.Sequential(nn.Linear(3, 4))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=0.01)
    engine = PrivacyEngine(accountant="poisson")
    net_d, opt_d, loader = opacus_structured.make_private(
        engine, module=net_d, optimizer=torch.optim.SGD(net_d.parameters(), lr=0.05),
        data_loader=DataLoader(dataset(), batch_size=B), noise_multiplier=SIGMA,
        max_grad_norm=1.0, dataset_size=N, sampler_generator=torch.Generator().manual_seed(7),
        discretization=DISC, criterion=nn.BCEWithLogitsLoss())
    g_before = [p.detach().clone() for p in net_g.parameters()]
    steps = 0
    for x, _ in loader:
        opt_d.zero_grad()
        if len(x):
            F.binary_cross_entropy_with_logits(net_d(x).squeeze(1), torch.ones(len(x))).backward()
        opt_d.step()
        steps += 1
        opt_g.zero_grad()
        opt_d.zero_grad()
        fake = net_g(torch.randn(B, 3))  # the generator's loss flows through D's parameters
        F.binary_cross_entropy_with_logits(net_d(fake).squeeze(1), torch.ones(B)).backward()
        opt_g.step()  # steps net_g only: not guarded
    assert any(not torch.equal(a, b) for a, b in zip(g_before, net_g.parameters(), strict=True))
    assert not parameter_guard.is_guarded(net_g) and parameter_guard.is_guarded(net_d)
    assert engine.get_epsilon(DELTA) == reference_epsilon(steps)


def test_a_dp_optimizer_built_by_hand_on_a_guarded_module_is_not_flagged():
    model = body_head()
    _, model, opt, loader = private(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=SIGMA,
                        max_grad_norm=1.0, expected_batch_size=B)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    other.step()  # its inner SGD is stepped from DPOptimizer.step: allowed
    with pytest.raises(ForeignOptimizerStepError):
        torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_guard_ends_with_release_or_with_the_dp_optimizer():
    model = body_head()
    _, model, opt, loader = private(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    parameter_guard.release_parameters(model)
    assert not parameter_guard.is_guarded(model)
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # e.g. public fine-tuning afterwards

    model = body_head()
    _, model, opt, loader = private(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert parameter_guard.is_guarded(model)
    del opt, loader
    gc.collect()
    assert not parameter_guard.is_guarded(model)


# ---- DPCallback --------------------------------------------------------------------------------
def test_dp_callback_refuses_uncovered_and_accepts_declared_public():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_callbacks.dp_callback import DPCallback

    class BodyOnly(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = body_head()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net[0].parameters(), lr=0.1)

    def fit(module, **kw):
        cb = DPCallback(scheme=PoissonScheme(sample_rate=1 / STEPS_PER_EPOCH),
                        noise_multiplier=SIGMA, max_grad_norm=1.0, delta=DELTA,
                        discretization=DISC, seed=1, dataset_size=N, **kw)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, callbacks=[cb],
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(dataset(), batch_size=B))
        return cb

    module = BodyOnly()
    with pytest.raises(UncoveredParametersError, match=r"^DPCallback: 2 trainable parameter "
                       r"tensor\(s\) of the module \(18 values\) are not in the DP optimizer's "
                       r"param_groups: 'net\.2\.weight', 'net\.2\.bias'\."):
        fit(module)
    assert not hasattr(module, "autograd_grad_sample_hooks")
    module = BodyOnly()
    cb = fit(module, public_parameters=["net.2.weight", "net.2.bias"])
    assert cb.steps == 3 and cb.epsilon() == reference_epsilon(3)
    assert not parameter_guard.is_guarded(module)  # released when the fit ends
