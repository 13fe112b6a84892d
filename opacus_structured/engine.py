"""Every scheme by name in a stock Opacus ``PrivacyEngine``: one line changes.

.. code-block:: python

    import opacus_structured
    from opacus import PrivacyEngine

    engine = PrivacyEngine(accountant="truncated-poisson")       # was: PrivacyEngine()
    model, optimizer, loader = opacus_structured.make_private(    # was: engine.make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0,
        max_batch_size=80)                   # the one parameter no DataLoader carries
    ...
    engine.get_epsilon(delta=1e-5)

:func:`make_private` and :func:`make_private_with_epsilon` take exactly the keyword arguments of
Opacus' ``PrivacyEngine.make_private`` / ``make_private_with_epsilon``, plus the engine and the
scheme's own parameters where a DataLoader cannot carry them. They do what
``engine.make_private(poisson_sampling=True)`` does with Opacus' ``DPDataLoader``, for the
scheme named by the engine's accountant:

1. **The scheme** is the engine's accountant's (``PrivacyEngine(accountant=NAME)``; or
   ``scheme=`` a name, a scheme class or a configured scheme object). Its parameters come from
   the DataLoader as Opacus reads them: the dataset size is ``len(data_loader.dataset)``, the
   steps per epoch ``len(data_loader)`` (so the expected batch size is their ratio, Opacus'
   ``sample_rate = 1/len(data_loader)``), plus ``epochs`` where the scheme prices a planned run
   and the scheme options below (:meth:`Scheme.from_training
   <opacus_structured.schemes.base.Scheme.from_training>` builds it).
2. **The DataLoader is replaced** by one drawing with the scheme's sampler, exactly as Opacus
   replaces it with ``DPDataLoader``: same dataset, collate function wrapped with Opacus'
   ``wrap_collate_with_empty`` (empty batches keep their structure), workers, pinning, timeout
   and worker init kept. ``poisson_sampling=False`` keeps Opacus' meaning — "leave my loader
   alone" — and then the loader must already draw with this scheme's sampler (checked). A
   weighted or partial sampler (``WeightedRandomSampler``, ``SubsetRandomSampler``,
   ``RandomSampler`` with ``replacement=True`` or ``num_samples`` < the dataset) is refused
   rather than replaced: uniform sampling over every row at 1/len(loader) would train another
   run than the one written (Opacus issue #813: batches of ~12,500 instead of 16).
3. **The scheme's accountant** (bound to that scheme) replaces the engine's before Opacus'
   ``make_private`` runs with ``poisson_sampling=False``, so Opacus attaches its step hook to
   it and the accountant checks the loader returned and every batch drawn
   (:mod:`opacus_structured.accountants.base`).
4. **Correlated noise**: for a matrix-mechanism scheme (``bandmf-cyclic-poisson``,
   ``random-allocation-mf`` with more than one band) the engine must be a
   :class:`~opacus_structured.optim.privacy_engine.CorrelatedNoisePrivacyEngine` and the
   strategy's ``noise_correlation`` is passed to its optimizer.
5. **Every trainable parameter is moved only by the noisy step**: a parameter of ``module``
   with ``requires_grad=True`` that ``optimizer`` does not step is refused before anything is
   wrapped, unless declared public (``public_parameters=``), and no other optimizer may step
   the module's parameters while the DP optimizer lives
   (:mod:`opacus_structured.accountants.parameter_guard`).

:func:`make_private_with_epsilon` calibrates σ with the scheme's own accountant (bisection on σ
until ε is within ``epsilon_tolerance`` = 1% *below* the target, never above) over
``epochs × len(loader)`` steps of the installed loader, then calls :func:`make_private`.
Monte Carlo schemes (``bminsep-mc``) and optimistic lower bounds are refused there: they are not
guarantees.

Scheme options (keyword arguments; an option of another scheme raises, naming it):

==========================  ================================================================
accountant / scheme          needs
==========================  ================================================================
``poisson``                  nothing (q = 1/len(loader))
``truncated-poisson``        ``max_batch_size`` (B; default chosen, below); ``relation``,
                             ``analysis``; ``pad``; ``target_delta`` (for the default B)
``balls-in-bins``            ``epochs`` (make_private; make_private_with_epsilon has it)
``bandmf-cyclic-poisson``    ``bands``, ``epochs`` (the strategy is optimised for the run);
                             ``strategy``, ``partition``
``random-allocation-mf``     ``epochs``; ``bands`` (default 1 = DP-SGD), ``strategy``,
                             ``method``, ``renyi_bands``, ``max_dp_cost``
``gdp-full-batch``           nothing (one full batch per epoch)
``shuffle``                  nothing (the loader's ``batch_size`` and ``drop_last``);
                             ``relation`` (``zero-out`` / ``replace-one``)
``structured``               a ``WindowDataset`` (lengths, context and forecast lengths);
                             ``batch_size`` (default the loader's), ``top_level``, …
``bminsep-mc``               a configured ``scheme=`` (with ``horizon`` for
                             ``optimal-banded``, ``bands > 1``) and a DataLoader you built
                             (no registered sampler); never calibrated here
==========================  ================================================================

**Public sampling constants** (both functions). Under add/remove adjacency the dataset size is
private, and Opacus derives the rate ``q = 1/len(data_loader) = 1/ceil(n/B)`` and the
mean-reduction normaliser ``expected_batch_size = int(n·q)`` from it (Opacus issue #819; its
stock ``make_private`` still does). ``dataset_size=N`` (a declared public size) replaces ``n``
in both: ``q = 1/ceil(N/B)`` (B the DataLoader's ``batch_size``; floor with ``drop_last``) and
the normaliser ``N·q`` (a float); ``sample_rate=1/k`` declares the rate (normaliser: the
DataLoader's ``batch_size``) and ``expected_batch_size=E`` the normaliser. The scheme is built
from the public values, its sampler draws every actual example at the public rate, and the
``DPOptimizer``'s ``expected_batch_size`` (which Opacus' ``make_private`` computes and passes
itself) is set to the public normaliser before any step. Nothing declared: as before, recorded
in ``engine.accountant.sampling_constants`` (``dataset_size_source="data"``) with a one-time
:class:`~opacus_structured.samplers.public_sizes.DatasetSizeFromDataWarning`.

Also accepted by both: ``sampler_generator`` (a ``torch.Generator`` for the batch sampler; by
default OS entropy; a seeded generator makes the batches reproducible by whoever knows the
seed — tests only), ``discretization`` (of the
accountant; default: the engine's accountant's, else 1e-4) and ``public_parameters`` (item 5:
parameters or names of ``module`` trained only on public data, your claim; the coverage check
and the run-time guard leave them out).

Truncated Poisson's default B: without ``max_batch_size`` (tight analysis, the scheme built
from the DataLoader) B is :func:`default_max_batch_size`, the smallest
B ≥ ⌈np⌉ whose ε is within :data:`TRUNCATION_SLACK` (1 %) of untruncated
Poisson's at the same σ, steps (``epochs × len(data_loader)``, so ``epochs`` is then needed) and
δ (``target_delta=``, default :data:`DEFAULT_SELECTION_DELTA`), p = 1/len(data_loader), same
relation and discretization; the choice is announced by a ``UserWarning``. A B just above the
expected batch can cost a lot (``examples/mnist.py``: B = 1.25 × 64 gives ε ≈ 2.6 against
Poisson's 0.49 at σ = 1, 10 epochs). :func:`make_private_with_epsilon` first calibrates σ for
Poisson at the target, chooses B at that σ, then calibrates σ for truncated Poisson with that B
(so ε ≤ target always holds; B is within 1 % of Poisson at Poisson's σ, and the final σ is a
little larger).

Truncated Poisson's fixed batch shape: the default ``pad=False`` draws the truncated batches
without padding (at most ``max_batch_size`` real rows, so a stock loop runs unchanged; the same
mechanism, since the optimizer divides by a fixed public batch size). ``pad=True`` pads every
batch to exactly ``max_batch_size`` rows with masked slots: the dataset is wrapped in
:class:`~opacus_structured.samplers.truncated_poisson.PaddedDataset` (each item gains a 0/1
mask) and the loop must multiply the per-sample loss by it
(:func:`~opacus_structured.samplers.truncated_poisson.masked_loss`).

Not covered (each raises, naming the way out): distributed training (``DPDDP`` / ``DDP``
modules; see "Scaling out"), ``IterableDataset`` loaders (no dataset size) and Opacus'
``secure_mode`` (its ``make_private(poisson_sampling=False)`` only re-seeds torch
``BatchSampler`` loaders).
"""

from __future__ import annotations

from typing import Optional

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader

from ._validation import check_int, check_open_unit, check_positive
from .accountants import parameter_guard
from .accountants.budget_guard import guard_budget
from .accountants.release_guard import refuse_adaptive
from .accounting import truncated_poisson as tp_lib
from .accounting.calibration import calibrate_within_tolerance
from .engine_plan import _Plan
from .engine_schemes import (  # noqa: F401  (scheme_for_training, SCHEME_OPTIONS: re-exported)
    _SAMPLER_OPTIONS,
    DEFAULT_SELECTION_DELTA,
    SCHEME_OPTIONS,
    TRUNCATION_SLACK,
    _all_option_names,
    _choose_max_batch_size,
    _dataset_size,
    _resolve_discretization,
    _resolve_scheme,
    _template_options,
    _wants_default_max_batch_size,
    default_max_batch_size,
    scheme_for_training,
)
from .samplers.verification import check_replaceable_sampler

__all__ = ["make_private", "make_private_with_epsilon", "scheme_for_training",
           "SCHEME_OPTIONS", "default_max_batch_size", "TRUNCATION_SLACK"]

def _refuse_adaptive_clipping(engine, clipping) -> None:
    """Adaptive clipping releases a data-dependent clip norm that no scheme accountant prices
    (:mod:`opacus_structured.accountants.release_guard`): refused by argument and by engine."""
    refuse_adaptive(clipping=clipping)
    if type(engine).__name__ == "PrivacyEngineAdaptiveClipping":
        refuse_adaptive(clipping="adaptive")


def _check_parameters(module, optimizer, public_parameters, where: str) -> None:
    """Declare ``public_parameters`` public (if given) and refuse trainable parameters of
    ``module`` that ``optimizer`` does not step, before the module is hooked
    (:mod:`~opacus_structured.accountants.parameter_guard`)."""
    if public_parameters is not None:
        parameter_guard.declare_public_parameters(module, public_parameters)
    parameter_guard.check_coverage(module, optimizer, where=where)


# ---- public API -----------------------------------------------------------------------------
def make_private(engine: PrivacyEngine, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                 data_loader: DataLoader, noise_multiplier: float, max_grad_norm,
                 criterion=None, batch_first: bool = True, loss_reduction: str = "mean",
                 poisson_sampling: bool = True, clipping: str = "flat", noise_generator=None,
                 grad_sample_mode: str = "hooks", wrap_model: bool = True,
                 rand_on_empty: bool = False, scheme=None, epochs: Optional[int] = None,
                 sampler_generator: Optional[torch.Generator] = None,
                 discretization: Optional[float] = None, dataset_size: Optional[int] = None,
                 sample_rate: Optional[float] = None,
                 expected_batch_size: Optional[float] = None, public_parameters=None,
                 budget=None, **kwargs):
    """``engine.make_private(...)`` for the scheme of ``engine``'s accountant (module docstring).

    ``module``, ``optimizer``, ``data_loader``, ``noise_multiplier``, ``max_grad_norm``,
    ``criterion``, ``batch_first``, ``loss_reduction``, ``clipping``, ``noise_generator``,
    ``grad_sample_mode``, ``wrap_model`` and ``rand_on_empty`` are Opacus' ``make_private``
    arguments.

    Args:
        engine: an Opacus ``PrivacyEngine`` built with one of this package's accountant names
            (``PrivacyEngine(accountant="balls-in-bins")``), or any engine with ``scheme=``;
            a ``CorrelatedNoisePrivacyEngine`` for correlated-noise schemes.
        poisson_sampling: ``True`` (default, as in Opacus): replace the DataLoader by one drawing
            with the scheme's sampler. ``False``: keep it (it must already use the sampler).
        scheme: a scheme name, class or configured object; default the engine accountant's.
        epochs: the planned epochs, for schemes that price a planned run or optimise their
            strategy for it (see the module table).
        sampler_generator: ``torch.Generator`` for the batch sampler (default OS entropy).
        discretization: the accountant's pessimistic discretisation interval.
        dataset_size: a declared **public** dataset size N (under add/remove adjacency the
            real size is private): the sampling rate is ``1/ceil(N/batch_size)`` (floor with
            ``drop_last``) and the mean-reduction normaliser ``N × rate``, for every
            neighbouring dataset alike (the sampler draws each actual example at that rate).
        sample_rate: a declared public rate ``1/k`` (k batches per epoch), instead of or with
            ``dataset_size``.
        expected_batch_size: a declared public normaliser (the optimizer divides the noisy
            clipped sum by it with ``loss_reduction="mean"``); default ``N × rate``, or the
            DataLoader's ``batch_size`` with ``sample_rate`` alone. Without any of the three,
            the rate is ``1/len(data_loader)`` and the normaliser Opacus'
            ``int(len(dataset)/len(data_loader))`` — both read the private size: a
            :class:`~opacus_structured.samplers.public_sizes.DatasetSizeFromDataWarning` says
            so once and ``engine.accountant.sampling_constants`` records
            ``dataset_size_source="data"``.
        public_parameters: parameters of ``module`` (an iterable of parameters or of names
            from ``module.named_parameters()``, or a sub-module) declared **public**: trained
            only on public data, or not moved from private gradients. Your claim, not checked.
            Every other trainable parameter (``requires_grad=True``) must be in ``optimizer``
            (else :class:`~opacus_structured.accountants.parameter_guard.
            UncoveredParametersError`, naming them), and while the returned optimizer lives no
            other optimizer may step them
            (:class:`~opacus_structured.accountants.parameter_guard.ForeignOptimizerStepError`;
            :mod:`~opacus_structured.accountants.parameter_guard`). ``None`` keeps an earlier
            :func:`~opacus_structured.accountants.parameter_guard.declare_public_parameters`.
        budget: a :class:`~opacus_structured.dataset_budget.DatasetBudget`: every noisy step
            of the run is charged to the dataset's budget file before its noise is added, and
            a step that would take the dataset's total past the cap raises
            :class:`~opacus_structured.dataset_budget.BudgetExhaustedError` instead
            (:mod:`~opacus_structured.accountants.budget_guard`).
        **kwargs: the scheme's options (module table), the rest go to Opacus (e.g.
            ``noise_correlation`` to override the strategy's).

    Returns:
        What ``engine.make_private`` returns: ``(module, optimizer, data_loader)`` (plus the
        criterion in ghost mode), ``data_loader`` drawing with the scheme's sampler. The engine's
        accountant is the scheme's (``engine.get_epsilon(delta)``).
    """
    _refuse_adaptive_clipping(engine, clipping)
    _check_parameters(module, optimizer, public_parameters, "make_private")
    kwargs = dict(kwargs)
    shared = getattr(data_loader, "__dict__", {}).get("_make_private_plan")
    if shared is not None:  # another private module on the draws of an earlier call
        plan = shared.for_another_module(
            engine, discretization=discretization, sampler_generator=sampler_generator,
            kwargs=kwargs, dataset_size=dataset_size, sample_rate=sample_rate,
            expected_batch_size=expected_batch_size)
        return _finish(engine, plan, module=module, optimizer=optimizer,
                       noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                       criterion=criterion, batch_first=batch_first,
                       loss_reduction=loss_reduction, clipping=clipping,
                       noise_generator=noise_generator, grad_sample_mode=grad_sample_mode,
                       wrap_model=wrap_model, rand_on_empty=rand_on_empty, budget=budget)
    if poisson_sampling:
        check_replaceable_sampler(data_loader, "make_private")
    if _wants_default_max_batch_size(engine, scheme, kwargs, poisson_sampling):
        delta = check_open_unit("target_delta",
                                kwargs.pop("target_delta", DEFAULT_SELECTION_DELTA))
        _choose_max_batch_size(engine, data_loader, kwargs, epochs=epochs,
                               noise_multiplier=check_positive("noise_multiplier",
                                                               noise_multiplier),
                               delta=delta,
                               discretization=_resolve_discretization(engine, discretization),
                               how="the run's")
    plan = _Plan(engine, module=module, data_loader=data_loader, scheme=scheme, epochs=epochs,
                 batch_first=batch_first, rand_on_empty=rand_on_empty,
                 poisson_sampling=poisson_sampling, sampler_generator=sampler_generator,
                 discretization=discretization, kwargs=kwargs,
                 dataset_size=dataset_size, sample_rate=sample_rate,
                 expected_batch_size=expected_batch_size)
    return _finish(engine, plan, module=module, optimizer=optimizer,
                   noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                   criterion=criterion, batch_first=batch_first, loss_reduction=loss_reduction,
                   clipping=clipping, noise_generator=noise_generator,
                   grad_sample_mode=grad_sample_mode, wrap_model=wrap_model,
                   rand_on_empty=rand_on_empty, budget=budget)


def _finish(engine, plan: _Plan, *, criterion, budget=None, **make_private_kwargs):
    plan.install(engine)
    if criterion is None:
        criterion = nn.CrossEntropyLoss()  # Opacus' default
    out = engine.make_private(data_loader=plan.loader, poisson_sampling=False,
                              criterion=criterion, **make_private_kwargs, **plan.opacus_kwargs)
    # no other optimizer steps the module's parameters while this DP optimizer lives (also
    # installed by the accountant's hook inside Opacus' make_private; idempotent)
    parameter_guard.guard_parameters(make_private_kwargs["module"], out[1])
    if plan.normaliser is not None:
        # Opacus' make_private passes expected_batch_size=int(len(dataset) * sample_rate) to
        # the DPOptimizer itself (a second expected_batch_size= would be a duplicate keyword);
        # the DPOptimizer stores that argument as .expected_batch_size, which scale_grad divides
        # by: set it to the public constant before any step
        out[1].expected_batch_size = plan.normaliser
    # the dataset's budget: each noisy step charged before its noise (Opacus' hook rate)
    guard_budget(budget, out[1], engine.accountant, sample_rate=1.0 / len(plan.loader),
                 label="make_private")
    return out


def make_private_with_epsilon(engine: PrivacyEngine, *, module: nn.Module,
                              optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                              target_epsilon: float, target_delta: float, epochs: int,
                              max_grad_norm, criterion=None, batch_first: bool = True,
                              loss_reduction: str = "mean", poisson_sampling: bool = True,
                              clipping: str = "flat", noise_generator=None,
                              grad_sample_mode: str = "hooks", wrap_model: bool = True,
                              scheme=None, sampler_generator: Optional[torch.Generator] = None,
                              discretization: Optional[float] = None,
                              epsilon_tolerance: float = 0.01,
                              dataset_size: Optional[int] = None,
                              sample_rate: Optional[float] = None,
                              expected_batch_size: Optional[float] = None,
                              public_parameters=None, budget=None, **kwargs):
    """``engine.make_private_with_epsilon(...)`` priced by the scheme's own accountant.

    Builds the scheme and its DataLoader as :func:`make_private` does, then finds the noise
    multiplier σ whose ε after ``epochs × len(loader)`` steps (the installed loader's length:
    1 step per epoch for full batch) is within ``epsilon_tolerance`` (relative, default 1%)
    *below* ``target_epsilon`` and never above it, evaluating ε with a fresh accountant of the
    scheme (the one installed), and calls :func:`make_private` with it. The σ used is
    ``optimizer.noise_multiplier``. Truncated Poisson without ``max_batch_size``: B is chosen
    first, at the σ that calibrates untruncated Poisson to the target (module docstring).

    Raises ``ValueError`` for a scheme whose ε is not a guarantee (``bminsep-mc`` is a Monte
    Carlo estimate: certify σ with Algorithm 5, ``opacus-structured bminsep-mc certify``, and
    pass it to :func:`make_private`), and
    :class:`~opacus_structured.accounting.calibration.CalibrationError` if no σ ≤ 10⁴ meets the
    target. ``public_parameters``: as in :func:`make_private` (trainable parameters that
    ``optimizer`` does not step are refused unless declared public). ``budget``: as in
    :func:`make_private` (the calibrated run is charged step by step to the dataset's budget;
    σ is calibrated for ``target_epsilon`` alone, not for what is left of the budget).
    """
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    target_delta = check_open_unit("target_delta", target_delta)
    epochs = check_int("epochs", epochs, minimum=1)
    _refuse_adaptive_clipping(engine, clipping)
    _check_parameters(module, optimizer, public_parameters, "make_private_with_epsilon")
    kwargs = dict(kwargs)
    if poisson_sampling:
        check_replaceable_sampler(data_loader, "make_private_with_epsilon")
    if _wants_default_max_batch_size(engine, scheme, kwargs, poisson_sampling):
        # B depends on σ and σ on B: calibrate σ for untruncated Poisson at the target, choose
        # B at that σ, then calibrate σ for truncated Poisson with that B (below).
        disc = _resolve_discretization(engine, discretization)
        k = len(data_loader)
        relation = kwargs.get("relation", "add-remove")
        sigma_poisson, _ = calibrate_within_tolerance(
            lambda sg: tp_lib.poisson_epsilon(1.0 / k, sg, epochs * k, target_delta, relation,
                                              discretization=disc),
            target_epsilon, epsilon_tolerance=epsilon_tolerance)
        _choose_max_batch_size(engine, data_loader, kwargs, epochs=epochs,
                               noise_multiplier=sigma_poisson, delta=target_delta,
                               discretization=disc,
                               how="Poisson's for the target epsilon")
    plan = _Plan(engine, module=module, data_loader=data_loader, scheme=scheme, epochs=epochs,
                 batch_first=batch_first, rand_on_empty=False,
                 poisson_sampling=poisson_sampling, sampler_generator=sampler_generator,
                 discretization=discretization, kwargs=kwargs,
                 dataset_size=dataset_size, sample_rate=sample_rate,
                 expected_batch_size=expected_batch_size)
    bound = plan.scheme.bound
    if not getattr(bound, "is_guarantee", False):
        kind = getattr(bound, "value", bound)
        how = (" Certify sigma with Algorithm 5 (scheme.certify(...) or `opacus-structured "
               "bminsep-mc certify`) and pass it to opacus_structured.make_private"
               if kind == "monte-carlo" else "")
        raise ValueError(f"scheme {plan.scheme.name!r} reports a {kind} epsilon, not a "
                         f"guarantee, so it is never used for calibration.{how}")
    steps = epochs * len(plan.loader)
    rate = 1.0 / len(plan.loader)

    def epsilon_of(sigma: float) -> float:
        acc = plan.accountant()
        acc.history = [(sigma, rate, steps)]
        return float(acc.get_epsilon(target_delta))

    sigma, _ = calibrate_within_tolerance(epsilon_of, target_epsilon,
                                          epsilon_tolerance=epsilon_tolerance)
    return _finish(engine, plan, module=module, optimizer=optimizer, noise_multiplier=sigma,
                   max_grad_norm=max_grad_norm, criterion=criterion, batch_first=batch_first,
                   loss_reduction=loss_reduction, clipping=clipping,
                   noise_generator=noise_generator, grad_sample_mode=grad_sample_mode,
                   wrap_model=wrap_model, rand_on_empty=False, budget=budget)
