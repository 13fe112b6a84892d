"""The plan of one ``make_private`` call: the scheme's sampler, the loader, the accountant.

:class:`_Plan` is what :func:`opacus_structured.make_private` and
:func:`~opacus_structured.make_private_with_epsilon` share: it builds the scheme from the
DataLoader (:mod:`opacus_structured.engine_schemes`), replaces the loader's sampler by the
scheme's (as Opacus installs its ``DPDataLoader``, as a
:class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader`), resolves the public
sampling constants (rate and normaliser) and installs the accountant on the engine.
"""

from __future__ import annotations

import copy
from typing import Any

from opacus import PrivacyEngine
from opacus.data_loader import dtype_safe, shape_safe, wrap_collate_with_empty
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ._validation import check_int, check_positive
from .accountants.base import SchemeAccountant, accountant_class_for
from .accounting import pld as pld_lib
from .engine_schemes import (
    _all_option_names,
    _dataset_size,
    _resolve_scheme,
    _template_options,
    scheme_for_training,
)
from .optim.privacy_engine import CorrelatedNoisePrivacyEngine
from .samplers import public_sizes
from .samplers.ledger_loader import LedgerDataLoader
from .samplers.truncated_poisson import PaddedDataset
from .schemes.base import Scheme, noise_bands
from .schemes.shuffle import ShuffleScheme
from .schemes.structured import StructuredScheme
from .schemes.truncated_poisson import TruncatedPoissonScheme


def _sampler_for(scheme: Scheme, dataset, generator, *, pad: bool):
    data = list(dataset.lengths) if isinstance(scheme, StructuredScheme) else len(dataset)
    extra = {"pad": pad} if isinstance(scheme, TruncatedPoissonScheme) else {}
    try:
        return scheme.sampler(data, generator=generator, **extra)
    except NotImplementedError:
        raise ValueError(
            f"scheme {scheme.name!r} has no registered sampler, so make_private cannot build "
            f"its DataLoader: build a DataLoader whose batch_sampler carries this scheme and "
            f"pass poisson_sampling=False (the accountant checks it)") from None


def _empty_shapes(dataset):
    """Opacus' ``DPDataLoader`` empty-batch shapes and dtypes for tuple items (else None)."""
    try:
        first = dataset[0]
    except Exception:  # noqa: BLE001 - a dataset whose item 0 needs a special key
        return None, None
    if not isinstance(first, (tuple, list)):
        return None, None
    return [(0, *shape_safe(x)) for x in first], [dtype_safe(x) for x in first]


def _loader_with(loader: DataLoader, batch_sampler, dataset, *, batch_first: bool,
                 rand_on_empty: bool) -> DataLoader:
    """A copy of ``loader`` over ``dataset`` drawing with ``batch_sampler`` (as
    ``DPDataLoader.from_data_loader`` copies it)."""
    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    collate = loader.collate_fn
    if not hasattr(collate, "wrapped_collator_fn"):  # not yet Opacus' empty-batch wrapper
        shapes, dtypes = _empty_shapes(dataset)
        collate = wrap_collate_with_empty(collate_fn=collate, batch_first=batch_first,
                                          rand_on_empty=rand_on_empty,
                                          sample_empty_shapes=shapes, dtypes=dtypes)
    return LedgerDataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate, **kwargs)


# ---- the plan shared by make_private and make_private_with_epsilon --------------------------
class _Plan:
    """Scheme, loader, accountant class and optimizer extras for one make_private call."""

    def __init__(self, engine, *, module, data_loader, scheme, epochs, batch_first,
                 rand_on_empty, poisson_sampling, sampler_generator, discretization, kwargs,
                 dataset_size=None, sample_rate=None, expected_batch_size=None):
        if not isinstance(engine, PrivacyEngine):
            raise ValueError(f"engine must be an opacus.PrivacyEngine (or "
                             f"CorrelatedNoisePrivacyEngine), got {type(engine).__name__}")
        if not isinstance(data_loader, DataLoader):
            raise ValueError(f"data_loader must be a torch DataLoader, got "
                             f"{type(data_loader).__name__}")
        if _is_distributed(module):
            raise ValueError("opacus_structured.make_private does not cover distributed "
                             "training (the module is DDP / DPDDP): wrap the scheme's sampler "
                             "with opacus_structured.samplers.distributed_data_loader and "
                             "attach the accountant by hand (docs: 'Scaling out')")
        if engine.secure_mode:
            raise ValueError(
                "secure_mode is not supported: Opacus' make_private(poisson_sampling=False) "
                "switches the generator only of torch BatchSamplers, so it would refuse the "
                "scheme's sampler; train with secure_mode=False (the samplers draw from OS "
                "entropy unless seeded)")
        if epochs is not None:
            epochs = check_int("epochs", epochs, minimum=1)
        cls, configured = _resolve_scheme(engine, scheme)
        names = _all_option_names()
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        opacus_kwargs = kwargs
        pad = bool(options.get("pad", False))
        dataset = data_loader.dataset
        size = _dataset_size(dataset)
        public_n, public_q, public_e = public_sizes.check_declared(
            dataset_size=dataset_size, sample_rate=sample_rate,
            expected_batch_size=expected_batch_size)
        self.declared = any(v is not None for v in (public_n, public_q, public_e))
        steps_per_epoch = self._public_steps_per_epoch(data_loader, public_n, public_q)
        if configured is not None:
            stray = [k for k in options if k != "pad"]
            if stray:
                raise ValueError(f"the scheme is already configured ({configured!r}); the "
                                 f"options {stray} would be ignored: drop them, or pass "
                                 f"scheme={cls.name!r} to build it from the DataLoader")
            self.scheme = configured
        else:
            options = {**_template_options(engine, scheme), **options}
            batch_size = options.pop("batch_size", None)
            if batch_size is None and issubclass(cls, (StructuredScheme, ShuffleScheme)):
                batch_size = data_loader.batch_size
            if issubclass(cls, ShuffleScheme):
                options.setdefault("drop_last", bool(data_loader.drop_last))
            if batch_size is not None and issubclass(cls, (StructuredScheme, ShuffleScheme)):
                options["batch_size"] = batch_size
            elif batch_size is not None:
                raise ValueError(f"scheme {cls.name!r} takes no option 'batch_size' (its "
                                 f"expected batch is len(dataset)/len(data_loader))")
            self.scheme = scheme_for_training(
                cls, dataset=dataset, steps_per_epoch=steps_per_epoch, epochs=epochs,
                dataset_size=public_n, **options)
        if getattr(self.scheme.bound, "value", self.scheme.bound) == "lower":
            raise ValueError(f"scheme {self.scheme!r} reports an optimistic lower bound, not a "
                             f"guarantee: use bound='tight' or 'upper' for training")
        # the loader
        if poisson_sampling:
            generator = sampler_generator
            if pad and not isinstance(self.scheme, TruncatedPoissonScheme):
                raise ValueError("pad=True is only for truncated-poisson")
            if pad:
                dataset = PaddedDataset(dataset)
            sampler = _sampler_for(self.scheme, dataset, generator, pad=pad)
            self.loader = _loader_with(data_loader, sampler, dataset, batch_first=batch_first,
                                       rand_on_empty=rand_on_empty)
        else:
            if sampler_generator is not None or pad:
                raise ValueError("poisson_sampling=False keeps your DataLoader: "
                                 "sampler_generator / pad would be ignored")
            self.loader = data_loader
        self.size = size
        self.user_loader = data_loader
        self._public_normaliser(data_loader, public_n, public_q, public_e, steps_per_epoch)
        # the accountant
        self.accountant_class = accountant_class_for(self.scheme)
        self.discretization, self.keep_accountant = _engine_accountant(
            engine, self.scheme, discretization, pld_lib.DEFAULT_DISCRETIZATION)
        # correlated noise
        self.opacus_kwargs = dict(opacus_kwargs)
        c = self.opacus_kwargs.get("noise_correlation")
        if c is None and self.scheme.prices_correlated_noise:
            c = self._noise_correlation(epochs)
            if noise_bands(c) > 1:
                self.opacus_kwargs["noise_correlation"] = c
        if "noise_correlation" in self.opacus_kwargs and \
                not isinstance(engine, CorrelatedNoisePrivacyEngine):
            raise ValueError(
                f"scheme {self.scheme.name!r} adds correlated noise "
                f"({noise_bands(self.opacus_kwargs['noise_correlation'])} bands), which a stock "
                f"PrivacyEngine cannot: use "
                f"opacus_structured.optim.CorrelatedNoisePrivacyEngine(accountant="
                f"{self.scheme.name!r}) instead of PrivacyEngine(...)")
        self.epochs = epochs

    @staticmethod
    def _public_steps_per_epoch(data_loader, public_n, public_q) -> int:
        """Batches per epoch from public values: ``1/sample_rate``, else
        ``ceil(dataset_size / batch_size)`` (floor with ``drop_last``), else (nothing declared)
        ``len(data_loader)``, which reads the private size (Opacus' rule)."""
        if public_q is not None:
            return public_sizes.steps_per_epoch_from_rate(public_q)
        if public_n is not None:
            B = data_loader.batch_size
            if B is None:
                raise ValueError(
                    "dataset_size needs the DataLoader's batch_size (the public B of "
                    "q = 1/ceil(dataset_size/B)); this DataLoader has a batch_sampler: declare "
                    "sample_rate=1/k (k batches per epoch) and expected_batch_size instead")
            k = public_n // B if data_loader.drop_last else -(-public_n // B)
            if k < 1:
                raise ValueError(f"dataset_size={public_n} is smaller than the batch size {B} "
                                 f"with drop_last=True: no batch per epoch")
            return k
        return len(data_loader)

    def _public_normaliser(self, data_loader, public_n, public_q, public_e,
                           steps_per_epoch) -> None:
        """``self.normaliser`` (``None``: Opacus' own ``int(len(dataset)/len(loader))``) and
        ``self.sampling_constants`` (the record kept by the accountant)."""
        # the sampler's epoch length comes from the scheme (built from the public values):
        # Opacus' hook prices sample_rate = 1/len(data_loader)
        if public_q is not None and len(self.loader) != steps_per_epoch:
            raise ValueError(
                f"the scheme's sampler draws {len(self.loader)} batches per epoch but "
                f"sample_rate=1/{steps_per_epoch} was declared (Opacus' hook prices "
                f"sample_rate = 1/len(data_loader)); declare sample_rate=1/{len(self.loader)}")
        q = 1.0 / len(self.loader)
        n_source = public_sizes.DECLARED if (public_n is not None or public_q is not None) \
            else public_sizes.DATA
        if public_e is not None:
            normaliser, how = public_e, "declared expected_batch_size"
        elif isinstance(self.scheme, StructuredScheme):
            normaliser, how = float(self.scheme.batch_size), "scheme batch_size (windows/step)"
        elif public_n is not None:
            normaliser, how = public_n * q, "dataset_size * sample_rate (public)"
        elif public_q is not None:
            if data_loader.batch_size is None:
                raise ValueError("sample_rate= alone leaves the mean-reduction normaliser "
                                 "undetermined for a DataLoader without batch_size: declare "
                                 "expected_batch_size= (or dataset_size=) too")
            normaliser, how = float(data_loader.batch_size), "DataLoader batch_size (public)"
        else:
            normaliser, how = None, "Opacus: int(len(dataset) / len(data_loader)) (from the data)"
        self.normaliser = normaliser
        self.sampling_constants = public_sizes.sampling_constants(
            sample_rate=q,
            expected_batch_size=(int(self.size * q) if normaliser is None else normaliser),
            dataset_size=public_n if public_n is not None else (
                None if n_source == public_sizes.DECLARED else self.size),
            dataset_size_source=n_source, normaliser_source=how)

    def _noise_correlation(self, epochs):
        """The scheme's ``noise_correlation(steps)`` for the run's planned steps (``None``
        without ``epochs``: schemes whose ``C`` depends on the run length then say so)."""
        scheme = self.scheme
        steps = None if epochs is None else max(scheme.bands, epochs * len(self.loader))
        return scheme.noise_correlation(steps)

    def accountant(self):
        return self.accountant_class(self.scheme, discretization=self.discretization)

    def for_another_module(self, engine, *, discretization, sampler_generator, kwargs,
                           dataset_size=None, sample_rate=None,
                           expected_batch_size=None) -> "_Plan":
        """The plan of a later ``make_private`` call whose ``data_loader`` is the private loader
        this plan returned: another private module (a head next to an encoder, one engine or
        two) trained on the same draws. Same scheme, loader and public constants; the engine's
        accountant is kept when it prices this scheme (one engine: every module's optimizer
        feeds it), else the scheme's accountant is installed. Each draw released through
        several modules is priced once, at their joint noise
        (:mod:`~opacus_structured.accountants.co_release`)."""
        if sampler_generator is not None:
            raise ValueError("data_loader is the private loader an earlier make_private "
                             "returned: it keeps its sampler, so sampler_generator would be "
                             "ignored; drop it")
        declared = {"dataset_size": dataset_size, "sample_rate": sample_rate,
                    "expected_batch_size": expected_batch_size}
        mine = {"dataset_size": self.sampling_constants.get("dataset_size"),
                "sample_rate": self.sampling_constants.get("sample_rate"),
                "expected_batch_size": self.normaliser}
        for name, value in declared.items():
            if value is not None and mine[name] is not None and \
                    abs(float(value) - float(mine[name])) > 1e-12 * max(1.0, abs(float(value))):
                raise ValueError(f"{name}={value} differs from the {mine[name]} of the earlier "
                                 f"make_private that built this private loader: one stream of "
                                 f"draws has one set of public constants")
        stray = [k for k in kwargs if k in _all_option_names() and k != "noise_correlation"]
        if stray:
            raise ValueError(f"data_loader is the private loader an earlier make_private "
                             f"returned, with its scheme {self.scheme!r}: the options {stray} "
                             f"would be ignored; drop them")
        plan = copy.copy(self)
        plan.opacus_kwargs = {**self.opacus_kwargs, **kwargs}
        plan.discretization, plan.keep_accountant = _engine_accountant(
            engine, self.scheme, discretization, self.discretization)
        return plan

    def install(self, engine) -> None:
        if self.loader is not self.user_loader:  # ours: a second module may share it
            self.loader.__dict__["_make_private_plan"] = self
        if not self.keep_accountant:
            engine.accountant = self.accountant()
        engine.accountant.sampling_constants = dict(self.sampling_constants)
        if self.sampling_constants["dataset_size_source"] == public_sizes.DATA:
            public_sizes.warn_dataset_size_from_data(
                "opacus_structured.make_private", self.size,
                how="make_private(..., dataset_size=N) with a public N (the rate is then "
                    "1/ceil(N/batch_size), the normaliser N*rate), or sample_rate=1/k and "
                    "expected_batch_size=E")


def _engine_accountant(engine, scheme: Scheme, discretization, default: float):
    """``(discretization, keep)``: the discretisation of the run's accountant (the argument,
    else the engine's scheme accountant's, else ``default``) and whether the engine's
    accountant already prices ``scheme`` at it (then it is kept: e.g. a second private module
    on one engine). Raises rather than drop steps an accountant already recorded."""
    old = engine.accountant
    if discretization is None:
        discretization = old.discretization if isinstance(old, SchemeAccountant) else default
    discretization = check_positive("discretization", discretization)
    keep = (isinstance(old, SchemeAccountant) and old.scheme is scheme
            and old.discretization == discretization)
    if not keep and len(old) > 0:
        raise ValueError(f"the engine's accountant has already recorded {len(old)} steps; "
                         f"installing the scheme's accountant would drop them and "
                         f"under-report epsilon: use a fresh PrivacyEngine")
    return discretization, keep


def _is_distributed(module) -> bool:
    return isinstance(module, (DPDDP, DDP))
