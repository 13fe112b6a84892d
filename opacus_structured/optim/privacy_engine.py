"""``PrivacyEngine`` entry point for correlated (BandMF) noise: an existing Opacus script changes
one line.

.. code-block:: python

    from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
    from opacus_structured.optim.strategies import banded_toeplitz_coefficients
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    scheme = BandMFCyclicPoissonScheme(dataset_size=len(ds), batch_size=256, bands=8)
    engine = CorrelatedNoisePrivacyEngine(scheme=scheme)        # was: PrivacyEngine()
    loader = DataLoader(ds, batch_sampler=scheme.sampler(generator=g))
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False,
        noise_correlation=banded_toeplitz_coefficients(steps, 8))

``noise_correlation`` (first column of the banded Toeplitz strategy ``C``) flows through
``make_private(**kwargs)`` into :meth:`CorrelatedNoisePrivacyEngine._prepare_optimizer`, which
builds the correlated-noise subclass of the optimizer class Opacus would have chosen. Without it
the engine behaves exactly like Opacus' (stock ``DPOptimizer``).

The privacy guarantee of correlated noise depends on the strategy *and* the sampler: use an
accountant that knows both (``scheme=`` here builds it), never the stock Poisson one.
"""

from __future__ import annotations

from typing import Optional

from opacus import PrivacyEngine
from opacus.optimizers import get_optimizer_class
from opacus.optimizers.optimizer import DPOptimizer

from ..accountants import parameter_guard
from ..accountants.base import SchemeAccountant
from ..schemes.base import noise_bands
from .correlated_noise import correlated_optimizer_class

__all__ = ["CorrelatedNoisePrivacyEngine"]


class CorrelatedNoisePrivacyEngine(PrivacyEngine):
    """Opacus ``PrivacyEngine`` whose ``make_private`` accepts ``noise_correlation=c``.

    Args:
        accountant: Opacus accountant name (ignored when ``scheme`` is given).
        secure_mode: Opacus' secure RNG option (the correlated noise draws its fresh ``z_i``
            from the same secure generator).
        scheme: optional batching scheme; its accountant (``SchemeAccountant``) replaces the
            named one, e.g. ``BandMFCyclicPoissonScheme`` for BandMF with cyclic Poisson.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False, scheme=None):
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        if scheme is not None:
            self.accountant = SchemeAccountant(scheme)

    def make_private(self, *args, public_parameters=None, **kwargs):
        """Opacus' ``make_private``; in ghost mode the returned criterion also refuses a
        per-sample loss that is not 1-d (see :class:`CheckedGhostLoss`).

        Whatever the accountant, every trainable parameter of ``module`` must be in
        ``optimizer`` unless declared public (``public_parameters=``: parameters or names,
        your claim that they are trained only on public data); refused before the module is
        wrapped (:class:`~opacus_structured.accountants.parameter_guard.
        UncoveredParametersError`), and no other optimizer may step the module's parameters
        while the returned optimizer lives (:mod:`~opacus_structured.accountants.
        parameter_guard`)."""
        module, optimizer = kwargs.get("module"), kwargs.get("optimizer")
        if module is not None and public_parameters is not None:
            parameter_guard.declare_public_parameters(module, public_parameters)
        if module is not None and optimizer is not None:
            parameter_guard.check_coverage(module, optimizer, where="make_private")
        out = super().make_private(*args, **kwargs)
        if module is not None:
            parameter_guard.guard_parameters(module, out[1], where="make_private")
        if len(out) == 4:
            module, optimizer, criterion, loader = out
            return module, optimizer, CheckedGhostLoss(criterion), loader
        return out

    def _prepare_optimizer(self, *, optimizer, noise_multiplier, max_grad_norm,
                           expected_batch_size, loss_reduction="mean", distributed=False,
                           clipping="flat", noise_generator=None, grad_sample_mode="hooks",
                           noise_correlation=None, **kwargs) -> DPOptimizer:
        if noise_correlation is None:
            return super()._prepare_optimizer(
                optimizer=optimizer, noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
                loss_reduction=loss_reduction, distributed=distributed, clipping=clipping,
                noise_generator=noise_generator, grad_sample_mode=grad_sample_mode, **kwargs)
        scheme = getattr(self.accountant, "scheme", None)
        if scheme is not None:
            scheme.check_noise_correlation(noise_correlation)
        elif noise_bands(noise_correlation) > 1:
            raise ValueError(
                f"noise_correlation with {noise_bands(noise_correlation)} bands under Opacus' "
                f"{self.accountant.mechanism()!r} accountant, which prices independent noise: "
                f"the reported epsilon would be wrong. Pass scheme=... (e.g. "
                f"BandMFCyclicPoissonScheme) to CorrelatedNoisePrivacyEngine")
        if distributed and (clipping != "flat" or grad_sample_mode == "ghost"):
            raise ValueError("noise_correlation with distributed=True supports only flat "
                             "clipping with per-sample gradients (DistributedDPOptimizer), got "
                             f"clipping={clipping!r}, grad_sample_mode={grad_sample_mode!r}")
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        generator: Optional[object] = None
        if self.secure_mode:
            generator = self.secure_rng
        elif noise_generator is not None:
            generator = noise_generator
        base = get_optimizer_class(clipping=clipping, distributed=distributed,
                                   grad_sample_mode=grad_sample_mode)
        cls = correlated_optimizer_class(base)
        return cls(optimizer=optimizer, noise_multiplier=noise_multiplier,
                   max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
                   loss_reduction=loss_reduction, generator=generator,
                   secure_mode=self.secure_mode, noise_correlation=noise_correlation, **kwargs)


class CheckedGhostLoss:
    """Opacus' ghost-clipping loss wrapper, refusing per-sample losses that are not 1-d.

    Opacus 1.6's ``DPTensorFastGradientClipping.backward`` multiplies the clipping coefficients
    (shape ``(B,)``) by the per-sample loss; a ``(B, 1)`` loss (e.g. ``MSELoss`` on a
    ``(B, 1)`` regression head) broadcasts to ``(B, B)``, and the second backward then returns
    ``(Σ_b coef_b)·Σ_b g_b`` — an *unclipped* sum, whose sensitivity the accountant does not
    bound. This wrapper raises instead (squeeze the model output / target to ``(B,)``).
    """

    def __init__(self, criterion):
        self._criterion = criterion

    def __call__(self, *args, **kwargs):
        out = self._criterion(*args, **kwargs)
        loss = getattr(out, "loss_per_sample", None)
        if loss is not None and loss.ndim != 1:
            raise ValueError(
                f"ghost clipping needs a 1-d per-sample loss, got shape {tuple(loss.shape)}: "
                f"Opacus would broadcast the clipping coefficients and clip nothing; squeeze "
                f"the output and target to shape (batch,) (or pass shape=(B, T) for sequences)")
        return out

    def __getattr__(self, name):
        return getattr(self._criterion, name)
