"""The public normaliser of a :class:`~lightning_callbacks.dp_callback.DPCallback` run and the
sampling constants it records.

Opacus' ``DPOptimizer`` divides the noisy sum by ``expected_batch_size`` (mean reduction).
Under add/remove adjacency the dataset size ``n`` is private, so a normaliser read from the data
(``int(len(dataset) × q)``) can differ between neighbours (Opacus issue #819). The callback
therefore takes, in order:

1. a declared ``expected_batch_size`` (public);
2. ``dataset_size × sample_rate`` with a declared public ``dataset_size`` (a float);
3. the structured scheme's ``batch_size`` Λ (windows per step, public);
4. else the sampler's ``expected_batch_size`` or ``int(len(dataset) × sample_rate)``, read from
   the data: :class:`~opacus_structured.samplers.public_sizes.DatasetSizeFromDataWarning` says
   so once, and the recorded ``dataset_size_source`` is ``"data"``.

A module's own ``DPOptimizer`` (``wrap_optimizer=False``) must divide by the declared normaliser
when one is declared. :class:`PublicNormaliser` is the callback's part for this; the record is
:func:`opacus_structured.samplers.public_sizes.sampling_constants`.
"""

from __future__ import annotations

import math
from typing import Optional

from opacus_structured.samplers import public_sizes
from opacus_structured.samplers.verification import innermost_sampler
from opacus_structured.schemes.base import Scheme

__all__ = ["PublicNormaliser"]


class PublicNormaliser:
    """Chooses the normaliser of a run (module docstring) and records where it came from."""

    def __init__(self, scheme: Scheme, *, dataset_size: Optional[int],
                 expected_batch_size: Optional[float], wrap_optimizer: bool):
        self.scheme = scheme
        self.dataset_size = dataset_size
        self.expected_batch_size = expected_batch_size
        self.wrap_optimizer = bool(wrap_optimizer)
        #: Where the last normaliser came from (words, for :attr:`sampling_constants`).
        self.source: Optional[str] = None

    @property
    def declared(self) -> bool:
        """Whether a public size or normaliser was declared."""
        return self.dataset_size is not None or self.expected_batch_size is not None

    def value(self, loader, sampler, sample_rate: float) -> float:
        """The normaliser the wrapped optimizer divides by (module docstring, rules 1–4)."""
        if self.expected_batch_size is not None:
            self.source = "declared expected_batch_size"
            return self.expected_batch_size
        if self.dataset_size is not None:
            self.source = "dataset_size * sample_rate (public)"
            return self.dataset_size * sample_rate
        batch = getattr(innermost_sampler(sampler), "expected_batch_size", None)
        if getattr(self.scheme, "name", None) == "structured":
            self.source = "scheme batch_size (windows/step)"
            return float(self.scheme.batch_size)
        self.source = "sampler (from the data): int(len(dataset) * sample_rate)"
        return max(1, int(len(loader.dataset) * sample_rate if batch is None else batch))

    def sampling_constants(self, loader, optimizer, normaliser: float, sample_rate: float,
                           accountant) -> dict:
        """The run's sampling constants (also set on ``accountant``), after checking that a
        module's own DPOptimizer divides by the declared normaliser; the one-time warning when
        the rate or the normaliser was read from the data."""
        rate_public = self.scheme.expected_sample_rate() is not None
        if not self.wrap_optimizer:
            own = getattr(optimizer, "expected_batch_size", None)
            if self.declared and (own is None
                                  or not math.isclose(own, normaliser, rel_tol=1e-12)):
                raise ValueError(
                    f"configure_optimizers returned a DPOptimizer with expected_batch_size="
                    f"{own} but DPCallback declares the public normaliser {normaliser} "
                    f"(dataset_size / expected_batch_size): build the DPOptimizer with "
                    f"expected_batch_size={normaliser}")
            if not self.declared:
                self.source = "the module's own DPOptimizer"
        source = (public_sizes.DECLARED if rate_public and self.declared else public_sizes.DATA)
        size = self.dataset_size if self.dataset_size is not None else len(loader.dataset)
        constants = public_sizes.sampling_constants(
            sample_rate=sample_rate,
            expected_batch_size=getattr(optimizer, "expected_batch_size", None),
            dataset_size=size, dataset_size_source=source, normaliser_source=self.source)
        try:
            accountant.sampling_constants = dict(constants)
        except AttributeError:  # pragma: no cover - an accountant refusing new attributes
            pass
        if source == public_sizes.DATA:
            public_sizes.warn_dataset_size_from_data(
                "DPCallback", len(loader.dataset),
                how="DPCallback(..., dataset_size=N) with a public N (normaliser N * "
                    "sample_rate) or expected_batch_size=E, with a scheme that carries its "
                    "sample_rate")
        return constants
