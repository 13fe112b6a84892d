"""Which parameters DP fine-tuning trains (forecasting/trained_parameters.py): the recipe's
subset from public weights, every parameter from a random start; the frozen ones keep their
values bit for bit, Opacus clips and noises the trained ones only, ε is the same as training
every parameter, the released network is an ordinary one; bad input names the argument."""

import warnings

import pytest
import torch

pytest.importorskip("gluonts")
warnings.filterwarnings("ignore", category=FutureWarning)

from test_zero_shot_mixture import CTX, H, _panel, _public_state  # noqa: E402

from opacus_structured.forecasting.estimators import prepare_estimator  # noqa: E402
from opacus_structured.forecasting.model_defaults import model_defaults  # noqa: E402
from opacus_structured.forecasting.trained_parameters import (  # noqa: E402
    freeze_all_but,
    resolve_trained_parameters,
    thaw,
)
from opacus_structured.forecasting.training import train_forecaster  # noqa: E402

HEAD = ("args_proj", "baseline_skip", "scale_skip")


def _train(**kw):
    return train_forecaster("dlinear", _panel(), prediction_length=H, context_length=CTX,
                            batch_size=4, max_steps=3, lr=1e-2, seed=0, noise_multiplier=2.0,
                            delta=1e-5, dataset_size=6, **kw)


def test_resolution_rules_and_bad_input():
    assert resolve_trained_parameters(None, HEAD, fine_tuning=True) == HEAD
    assert resolve_trained_parameters(None, HEAD, fine_tuning=False) is None
    assert resolve_trained_parameters(None, None, fine_tuning=True) is None
    assert resolve_trained_parameters("all", HEAD, fine_tuning=True) is None
    assert resolve_trained_parameters(["args_proj"], HEAD, fine_tuning=False) == ("args_proj",)
    for bad in ("head", [], [""], [3]):
        with pytest.raises(ValueError, match="trained_parameters"):
            resolve_trained_parameters(bad, HEAD, fine_tuning=True)
    net = prepare_estimator("dlinear", freq="M", prediction_length=H,
                            context_length=CTX).module.model
    with pytest.raises(ValueError, match=r"trained_parameters \['decoder'\] match no"):
        freeze_all_but(net, ("args_proj", "decoder"))
    # a recipe's prefix the network lacks is skipped; none left: every parameter trains
    total = sum(p.numel() for p in net.parameters())
    assert freeze_all_but(net, ("decoder",), strict=False) == total
    assert all(p.requires_grad for p in net.parameters())
    head = freeze_all_but(net, ("args_proj", "decoder"), strict=False)
    assert head == sum(p.numel() for n, p in net.named_parameters() if n.startswith("args_proj"))
    thaw(net)
    assert all(p.requires_grad for p in net.parameters())


def test_recipe_subset_from_public_weights_trains_only_it_at_the_same_epsilon():
    assert tuple(model_defaults("dlinear")["trained_parameters"]) == HEAD
    public = _public_state()
    sub = _train(init_state=public, init_public=True)
    full = _train(init_state=public, init_public=True, trained_parameters="all")
    after = sub.state_dict()
    for name, before in public.items():
        moved = not torch.equal(after[name], before)
        assert moved == name.startswith(HEAD), name
    assert any(not torch.equal(full.state_dict()[k], public[k])
               for k in public if k.startswith("linear_"))
    # the same mechanism: the steps and ε do not depend on which coordinates are trained
    assert sub.noise_multiplier == full.noise_multiplier and sub.epsilon == full.epsilon
    count = sum(v.numel() for k, v in public.items() if k.startswith(HEAD))
    assert sub.trained_parameters == {"names": list(HEAD), "count": count}
    assert sub.summary()["trained_parameters"]["count"] == count
    assert full.trained_parameters["names"] == "all"
    assert all(p.requires_grad for p in sub.prepared.module.model.parameters())


def test_a_random_start_trains_every_parameter_and_a_given_subset_is_honoured():
    res = _train()
    assert res.trained_parameters["names"] == "all"
    res = _train(trained_parameters=["baseline_skip"])
    assert res.trained_parameters == {"names": ["baseline_skip"], "count": 5}
    with pytest.raises(ValueError, match="match no parameter"):
        _train(trained_parameters=["decoder"])


def test_opacus_clips_and_noises_the_trained_parameters_only():
    """The per-window gradients exist for the trained parameters only (Opacus skips a
    parameter with requires_grad=False), so the clipping norm bounds their gradient alone."""
    seen = {}

    class Probe:
        def on_before_optimizer_step(self, trainer, module, optimizer):
            for name, p in module.model.named_parameters():
                seen[name] = getattr(p, "grad_sample", None) is not None or p.grad is not None

    import lightning.pytorch as pl

    probe = type("ProbeCallback", (Probe, pl.Callback), {})()
    _train(init_state=_public_state(), init_public=True, callbacks=[probe])
    assert seen and all(v == k.startswith(HEAD) for k, v in seen.items()), seen


def test_ghost_clipping_releases_the_same_subset():
    public = _public_state()
    hooks = _train(init_state=public, init_public=True)
    ghost = _train(init_state=public, init_public=True, grad_sample_mode="ghost")
    for name, value in hooks.state_dict().items():
        torch.testing.assert_close(ghost.state_dict()[name], value, rtol=1e-5, atol=1e-7)
