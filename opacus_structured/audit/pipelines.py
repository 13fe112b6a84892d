r"""Canaries planted into **real** training runs of every scheme and path (issue 19).

:func:`run_audit` trains ``runs`` independent models **with** a canary and ``runs`` without it,
through the package's own pieces — the scheme's sampler (``scheme.sampler(...)``), Opacus'
per-sample-gradient module and ``DPOptimizer`` (hooks), Opacus' ghost clipping, our
book-keeping optimizer, our correlated-noise (BandMF) optimizer, the scheme's registered
accountant, their ``state_dict`` / ``load_state_dict`` — observes what the pipeline releases
and returns one attack score per run as :class:`~opacus_structured.audit.estimators.AuditScores`
(with the ε the accountant reports for the same run), for
:func:`~opacus_structured.audit.estimators.epsilon_lower_bound`.

**What is released and what is scored.** Every run trains a bias-free linear model under the
linear loss (:mod:`~opacus_structured.audit.canaries`), so each example's gradient is its input
and the canary (:class:`~opacus_structured.audit.canaries.DiracCanary`) is a gradient
:math:`m C e_k` in a coordinate ``k`` of its own. The auditor reads, after every optimizer step
``t``, the released noisy gradient sum in that coordinate, :math:`y_t` (in units of ``C``); for
an independent-noise optimizer :math:`y = b + \sigma \xi`, for the matrix mechanism with
strategy ``C`` (lower-triangular Toeplitz, first column ``c``, read from the optimizer) the
optimizer releases :math:`y = b + \sigma C^{-1}\xi` and the auditor decorrelates,
:math:`w = C y = C b + \sigma \xi`, exactly as the accountant's mechanism does. Here
:math:`b \in \{0,1\}^T` is the canary's participation pattern (0 in the "without" runs). The
score is the log likelihood ratio of "with" against "without" under the scheme's participation
law :math:`P(S)` (Neyman–Pearson: the most powerful test of the priced mechanism),

.. math::

    s(y) = \log \sum_{S} P(S)\, \exp\Bigl(\frac{\langle w, C 1_S\rangle
            - \tfrac12 \lVert C 1_S \rVert^2}{\sigma^2}\Bigr),

summed over the participation patterns ``S`` (every subset of steps for Poisson, one step per
epoch for balls-in-bins, the canary's cycle steps for cyclic Poisson, ...). The black-box
:class:`~opacus_structured.audit.canaries.InputCanary` scores the drop of the canary's loss
instead (a post-processing: a weaker attack, still a valid one).

**Many runs, one pass.** ``R`` independent runs are trained side by side in one model of
``2R`` coordinates: run ``r`` owns coordinates ``2r`` (its canary) and ``2r + 1`` (its other
examples), its examples are nonzero only there, and its batches come from its **own** sampler
(``scheme.sampler(n, generator=...)``, one per run, :class:`ParallelRunsBatchSampler`). Since a
per-example gradient touches only its run's coordinates, per-example clipping (hooks, ghost,
book-keeping: all clip the norm over the whole model) clips it exactly as in a run of its own,
and the optimizer's i.i.d. (or per-coordinate correlated) noise is independent across
coordinates: the ``R`` runs are ``R`` independent copies of the same pipeline. The optimizer
sums (``loss_reduction="sum"``), so the released gradient is the noisy clipped sum itself.

**Mutations** (``mutation=``) break the real pipeline *after* the accountant was told the true
setting, to show that the audit catches each: ``"noise-halved"`` (the optimizer's
``noise_multiplier`` is σ/2), ``"rate-doubled"`` (the samplers draw at twice the priced rate),
``"no-clipping"`` (the optimizer clips at :math:`10^6 C` with the same noise std σC, so the
canary's gradient :math:`m C` passes unclipped), ``"wrong-band"`` (matrix mechanisms: the
optimizer's strategy has twice the bands the scheme prices, so a canary's participations
overlap through ``C``).

**Paths** (``path=``): ``"hooks"`` (Opacus ``GradSampleModule`` + ``DPOptimizer``),
``"ghost"`` (Opacus ghost clipping: ``GradSampleModuleFastGradientClipping`` +
``DPOptimizerFastGradientClipping`` + its loss wrapper), ``"bookkeeping"``
(:class:`~opacus_structured.optim.bookkeeping.BookKeepingHooks` + ``BookKeepingDPOptimizer``),
``"resume"`` (hooks, checkpointed after half the steps: samplers, optimizer — its correlated
noise state included — and accountant are rebuilt from scratch with *other* seeds and
restored with ``load_state_dict``), ``"ddp"`` / ``"ddp-ghost"`` / ``"ddp-bookkeeping"`` (hooks,
ghost clipping, book-keeping with :data:`DDP_WORLD_SIZE` gloo processes around Opacus'
``DifferentiallyPrivateDistributedDataParallel`` and its distributed optimizers: noise added
once, on rank 0, then all-reduced), ``"lightning"`` (``DPCallback`` on an unmodified
LightningModule; :func:`_run_lightning`), ``"forecaster"`` / ``"forecaster-ghost"``
(``structured`` only: :func:`~opacus_structured.forecasting.training.train_forecaster` end to
end, hooks or book-keeping, deterministic top level; :mod:`~opacus_structured.audit.forecaster`);
correlated-noise schemes use our correlated-noise variant of each optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
import types
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from .._validation import check_int, check_open_unit, check_positive, check_probability
from ..accountants.base import SchemeAccountant
from ..accounting.monte_carlo import MonteCarloSettings
from ..accounting.strategies import strategy_coefficients, toeplitz_matrix
from ..optim.bookkeeping import BookKeepingHooks, bookkeeping_optimizer_class
from ..optim.correlated_noise import correlated_optimizer_class
from ..optim.distributed import (
    DistributedCorrelatedNoiseDPOptimizer,
    DistributedCorrelatedNoiseDPOptimizerFastGradientClipping,
)
from ..optim.ghost_clipping import CorrelatedNoiseDPOptimizerFastGradientClipping
from ..samplers.distributed import DistributedBatchSampler, shard
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ..schemes.gdp import GDPScheme
from ..schemes.poisson import PoissonScheme
from ..schemes.structured import StructuredScheme
from ..schemes.truncated_poisson import TruncatedPoissonScheme
from .canaries import CANARIES, DiracCanary, EventCanary, LinearLoss
from .estimators import AuditScores

__all__ = ["run_audit", "AUDIT_SCHEMES", "AUDIT_PATHS", "MUTATIONS", "audit_registry",
           "audited_scheme",
           "ParallelRunsBatchSampler", "IndependentRunsBatchSampler", "likelihood_ratio_scores",
           "toeplitz_matrix"]

#: Clipping / execution paths every scheme can be audited on (``ddp``: hooks under DDP;
#: ``ddp-ghost`` / ``ddp-bookkeeping``: ghost clipping / book-keeping under DDP).
AUDIT_PATHS = ("hooks", "ghost", "bookkeeping", "resume", "ddp", "ddp-ghost",
               "ddp-bookkeeping", "lightning", "forecaster", "forecaster-ghost")
#: The paths through the forecasting trainer (``structured`` only;
#: :mod:`~opacus_structured.audit.forecaster`).
FORECASTER_PATHS = ("forecaster", "forecaster-ghost")
#: The paths every scheme's pipeline supports (the forecaster paths are ``structured``'s).
SCHEME_PATHS = tuple(p for p in AUDIT_PATHS if p not in FORECASTER_PATHS)
#: Processes of the ``ddp`` path (gloo, CPU).
DDP_WORLD_SIZE = 2
#: Deliberate breakages of the pipeline (each must be caught: audited ε > reported ε).
MUTATIONS = ("noise-halved", "rate-doubled", "no-clipping", "wrong-band")

#: Clipping norm of every audit (the scores are in units of it).
CLIP = 1.0
#: Clipping norm of the "no-clipping" mutation (noise multiplier scaled by CLIP/NO_CLIP).
NO_CLIP = 1e6
#: At most this many runs share one model (bounds the per-sample-gradient memory).
CHUNK_RUNS = 256
#: Participation patterns are enumerated exactly; refuse runs with more patterns.
MAX_PATTERNS = 4096


# ---- scoring ----------------------------------------------------------------------------------
def _log_mixture(y: np.ndarray, means: np.ndarray, log_probs: np.ndarray,
                 sigma2: float) -> np.ndarray:
    r""":math:`\log\sum_S P(S)\exp((\langle y, m_S\rangle - \|m_S\|^2/2)/\sigma^2)` per row of
    ``y`` (the Gaussian mixture density up to the factor common to all mixtures)."""
    logits = log_probs[None, :] + (y @ means.T - 0.5 * np.sum(means * means, axis=1)[None, :]) \
        / sigma2
    top = logits.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))).reshape(-1)


def likelihood_ratio_scores(observed, patterns, log_probs, noise_multiplier: float,
                            strategy: Optional[np.ndarray] = None, patterns_without=None,
                            log_probs_without=None) -> np.ndarray:
    r"""Log likelihood ratio of "canary present" for each row of ``observed`` (module docstring).

    Args:
        observed: ``(R, T)`` released canary-coordinate values :math:`y` in units of ``C``.
        patterns: ``(P, T)`` mean vectors :math:`b_S` of the canary coordinate "with" (0/1
            participation patterns :math:`1_S`, or e.g. :math:`2 \cdot 1_S - B` when an
            included canary displaces another example).
        log_probs: ``(P,)`` :math:`\log P(S)`.
        noise_multiplier: σ of the Gaussian noise (in units of ``C``).
        strategy: ``(T, T)`` matrix ``C`` of the matrix mechanism (``None``: the identity).
        patterns_without, log_probs_without: the same for the "without" runs (default: the
            single pattern 0, probability 1).

    Returns:
        ``(R,)`` :math:`\log\frac{\sum_S P(S)\,\varphi_\sigma(Cy - Cb_S)}
        {\sum_{S'} P'(S')\,\varphi_\sigma(Cy - Cb'_{S'})}`, :math:`\varphi_\sigma` the
        :math:`\mathcal N(0, \sigma^2 I)` density.
    """
    y = np.asarray(observed, dtype=np.float64)
    s = np.asarray(patterns, dtype=np.float64)
    lp = np.asarray(log_probs, dtype=np.float64)
    if patterns_without is None:
        s0, lp0 = np.zeros((1, s.shape[1] if s.ndim == 2 else 0)), np.zeros(1)
    else:
        s0 = np.asarray(patterns_without, dtype=np.float64)
        lp0 = np.asarray(log_probs_without, dtype=np.float64)
    for a, b in ((s, lp), (s0, lp0)):
        if y.ndim != 2 or a.ndim != 2 or a.shape[1] != y.shape[1] or b.shape != (a.shape[0],):
            raise ValueError(f"observed (R, T), patterns (P, T) and log_probs (P,) must agree, "
                             f"got {y.shape}, {a.shape}, {b.shape}")
    sigma2 = check_positive("noise_multiplier", noise_multiplier) ** 2
    if strategy is not None:
        c = np.asarray(strategy, dtype=np.float64)
        y, s, s0 = y @ c.T, s @ c.T, s0 @ c.T
    return _log_mixture(y, s, lp, sigma2) - _log_mixture(y, s0, lp0, sigma2)


def bernoulli_patterns(steps: int, eligible, rate: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Every pattern of independent participation with probability ``rate`` at each step of
    ``eligible`` (never at the others): :math:`P(S) = q^{|S|}(1-q)^{|E|-|S|}` for
    :math:`S \subseteq E`."""
    eligible = list(eligible)
    if 2 ** len(eligible) > MAX_PATTERNS:
        raise ValueError(f"steps: {len(eligible)} eligible steps give 2^{len(eligible)} "
                         f"participation patterns (max {MAX_PATTERNS}); audit fewer steps")
    q = check_probability("rate", rate)
    rows, lps = [], []
    for bits in itertools.product((0, 1), repeat=len(eligible)):
        k = sum(bits)
        if (q == 1.0 and k < len(eligible)):
            continue
        row = np.zeros(steps)
        row[[e for e, b in zip(eligible, bits, strict=True) if b]] = 1.0
        rows.append(row)
        lps.append(k * math.log(q) + (len(eligible) - k) * (math.log1p(-q) if q < 1 else 0.0))
    return np.array(rows), np.array(lps)


# ---- running many independent runs side by side -----------------------------------------------
class ParallelRunsBatchSampler(Sampler[list[int]]):
    """Batches of ``R`` independent runs, each drawn by its own sampler (one per run).

    Run ``r`` owns dataset rows ``r·n … r·n + n − 1``; at every step each run's sampler draws its
    batch (of its own indices ``0 … n−1``, or ``0 … n−2`` for a run whose dataset lacks its
    first example: ``shifts[r] = 1`` maps them to rows ``1 … n−1``) and the union, shifted to
    the run's rows, is the step's batch. ``len`` is ``steps``. The per-run samplers keep their
    own state (``state_dict`` of each), so a checkpoint restores every run exactly.
    """

    def __init__(self, samplers, examples_per_run: int, steps: int, shifts=None, row=int):
        self.samplers = list(samplers)
        self.row = row  # a drawn item (an index, or a (series, start) window) -> its row
        self.examples_per_run = check_int("examples_per_run", examples_per_run, minimum=1)
        self.steps = check_int("steps", steps, minimum=1)
        self.shifts = [0] * len(self.samplers) if shifts is None else [int(v) for v in shifts]
        self._iters: list = [None] * len(self.samplers)

    def __len__(self) -> int:
        return self.steps

    def _next(self, r: int) -> list[int]:
        for _ in range(2):
            if self._iters[r] is None:
                self._iters[r] = iter(self.samplers[r])
            try:
                return list(next(self._iters[r]))
            except StopIteration:  # the run's epoch is over: the next one continues
                self._iters[r] = None
        raise RuntimeError(f"the sampler of run {r} yields empty epochs")

    def __iter__(self):
        n = self.examples_per_run
        for _ in range(self.steps):
            batch: list[int] = []
            for r in range(len(self.samplers)):
                base = r * n + self.shifts[r]
                batch.extend(base + self.row(i) for i in self._next(r))
            self.last_batch = batch
            yield batch

    def state_dict(self) -> list[dict]:
        """Every run's sampler state (between draws)."""
        return [s.state_dict() for s in self.samplers]

    def load_state_dict(self, states) -> None:
        if len(states) != len(self.samplers):
            raise ValueError(f"state has {len(states)} runs, this sampler {len(self.samplers)}")
        for s, st in zip(self.samplers, states, strict=True):
            s.load_state_dict(st)
        self._iters = [None] * len(self.samplers)


def _distributed(path: str) -> bool:
    """Whether ``path`` trains with :data:`DDP_WORLD_SIZE` gloo processes."""
    return path == "ddp" or path.startswith("ddp-")


def _clipping(path: str) -> str:
    """How ``path`` clips: ``"hooks"``, ``"ghost"`` or ``"bookkeeping"``."""
    if path.startswith("ddp-"):
        return path[len("ddp-"):]
    return "hooks" if path in ("ddp", "resume", "lightning") else path


@dataclasses.dataclass
class _Plan:
    """One audit: the priced scheme and what the (possibly mutated) pipeline really does."""

    spec: "_SchemeAudit"
    flags: dict
    scheme: Any                   # what the accountant prices
    drawn: Any                    # what the samplers draw (== scheme unless rate-doubled)
    noise_multiplier: float       # σ told to the accountant
    actual_noise_multiplier: float
    clip: float                   # the optimizer's clipping norm
    coefficients: Optional[list]  # strategy the optimizer uses (None: independent noise)
    steps: int
    delta: float
    examples: int
    path: str
    canary: DiracCanary
    mutation: Optional[str] = None
    seed: Optional[int] = None


def _optimizer_pieces(plan: _Plan, model: nn.Module, generator: torch.Generator):
    """``(module, optimizer, criterion)`` of ``plan.path`` around ``model`` (real classes)."""
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    correlated = plan.coefficients is not None
    kw = dict(noise_multiplier=plan.actual_noise_multiplier, max_grad_norm=plan.clip,
              expected_batch_size=1, loss_reduction="sum", generator=generator)
    if correlated:
        kw["noise_correlation"] = list(plan.coefficients)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    clipping, distributed = _clipping(plan.path), _distributed(plan.path)
    if distributed:  # Opacus' order: DPDDP inside, the per-sample machinery outside
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
        from opacus.optimizers import DistributedDPOptimizer
        from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
            DistributedDPOptimizerFastGradientClipping,
        )

        inner = DPDDP(model)
        hooks_cls = DistributedCorrelatedNoiseDPOptimizer if correlated else DistributedDPOptimizer
        fast_cls = (DistributedCorrelatedNoiseDPOptimizerFastGradientClipping if correlated
                    else DistributedDPOptimizerFastGradientClipping)
    else:
        inner = model
        hooks_cls = correlated_optimizer_class(DPOptimizer) if correlated else DPOptimizer
        fast_cls = (CorrelatedNoiseDPOptimizerFastGradientClipping if correlated
                    else DPOptimizerFastGradientClipping)
    if clipping == "hooks":
        module = GradSampleModule(inner, batch_first=True, loss_reduction="sum")
        return module, hooks_cls(sgd, **kw), LinearLoss("sum")
    if clipping == "ghost":
        module = GradSampleModuleFastGradientClipping(
            inner, batch_first=True, loss_reduction="sum", max_grad_norm=plan.clip,
            use_ghost_clipping=True)
        optimizer = fast_cls(sgd, **kw)
        criterion = DPLossFastGradientClipping(module, optimizer, LinearLoss("sum"),
                                               loss_reduction="sum")
        return module, optimizer, criterion
    if clipping == "bookkeeping":
        hooks = BookKeepingHooks(inner, max_grad_norm=plan.clip, loss_reduction="sum")
        optimizer = bookkeeping_optimizer_class(fast_cls)(sgd, **kw)
        optimizer.attach_bookkeeper(hooks)
        return inner, optimizer, LinearLoss("sum")
    raise ValueError(f"path must be one of {AUDIT_PATHS}, got {plan.path!r}")


def _loader(dataset, batch_sampler, width: int) -> DataLoader:
    from opacus.data_loader import wrap_collate_with_empty
    from torch.utils.data._utils.collate import default_collate

    collate = wrap_collate_with_empty(collate_fn=default_collate,
                                      sample_empty_shapes=[(0, width), (0,)],
                                      dtypes=[torch.float32, torch.float32])
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate)


def runs_dataset(plan: _Plan, present: np.ndarray, rng: np.random.Generator) -> TensorDataset:
    """The examples of ``R = present.size`` runs side by side (module docstring): run ``r``
    owns rows ``r·n …`` and coordinates ``2r`` (canary) and ``2r + 1``; targets are 1 (linear
    loss). Canary rows hold ``m·C`` in the canary coordinate where ``present``, else 0 (or the
    scheme's ``others`` value under substitution)."""
    spec = plan.spec
    R, n = present.size, plan.examples
    x = torch.zeros(R * n, 2 * R)
    rows = torch.arange(R) * n
    mine = 2 * torch.arange(R)  # each run's canary coordinate
    canary_rows = set(spec.canary_rows(plan))
    others = spec.others_value(plan)
    for j in range(n):
        if j in canary_rows:  # the canary; "without": zero (zero-out/removal) or `others`
            absent = 0.0 if others is None or not spec.substitution else float(others)
            x[rows + j, mine] = torch.as_tensor(np.where(
                present, plan.canary.value(CLIP), absent * CLIP).astype(np.float32))
        elif others is None:  # gradients in the run's second coordinate, not the canary's
            x[rows + j, mine + 1] = torch.as_tensor(
                rng.uniform(-1.0, 1.0, R).astype(np.float32)) * CLIP
        else:  # a fixed gradient in the canary's coordinate (e.g. -C: displaced by it)
            x[rows + j, mine] = float(others) * CLIP
    return TensorDataset(x, torch.ones(R * n))


class _Chunk:
    """``R`` runs trained side by side (module docstring): build, train, checkpoint."""

    def __init__(self, plan: _Plan, present: np.ndarray, seeds: np.ndarray):
        self.plan = plan
        self.present = present
        R = present.size
        self.width = 2 * R
        self.dataset = runs_dataset(plan, present, np.random.default_rng(int(seeds[0])))
        self.sampler_seeds = [int(s) for s in seeds[2:2 + R]]
        self.noise_seed = int(seeds[1])
        # add/remove audits of samplers that depend on the dataset size: the "without" runs
        # draw from the n - 1 examples that remain
        self.removed = [bool(plan.spec.removal and not p) for p in present]
        self.samplers = self._samplers(0)
        self.observed = np.zeros((R, plan.steps))
        self.model = nn.Linear(self.width, 1, bias=False)
        nn.init.zeros_(self.model.weight)
        self.initial = nn.Linear(self.width, 1, bias=False)
        nn.init.zeros_(self.initial.weight)
        self.step = 0
        self.accountant = plan.spec.new_accountant(self)
        self._build(torch.Generator().manual_seed(self.noise_seed))

    def _samplers(self, offset: int) -> list:
        return [self.plan.spec.sampler(self.plan, torch.Generator().manual_seed(s + offset),
                                       removed=removed)
                for s, removed in zip(self.sampler_seeds, self.removed, strict=True)]

    def _build(self, noise_generator: torch.Generator) -> None:
        self.batch_sampler = ParallelRunsBatchSampler(self.samplers, self.plan.examples,
                                                      self.plan.steps - self.step,
                                                      shifts=[int(r) for r in self.removed],
                                                      row=functools.partial(
                                                          self.plan.spec.row, self.plan))
        sampler = self.batch_sampler
        if _distributed(self.plan.path):  # every rank draws the global batch, keeps its shard
            sampler = DistributedBatchSampler(self.batch_sampler, sync_state=False)
        self.loader = _loader(self.dataset, sampler, self.width)
        self.module, self.optimizer, self.criterion = _optimizer_pieces(
            self.plan, self.model, noise_generator)
        self.plan.spec.attach(self)

    def local_batch(self) -> list[int]:
        """This process' rows of the step's batch, in the order of its per-sample gradients
        (the global batch; under DDP this rank's shard of it)."""
        batch = self.batch_sampler.last_batch
        if _distributed(self.plan.path):
            return shard(batch, self.loader.batch_sampler.num_replicas,
                         self.loader.batch_sampler.rank)
        return batch

    def train(self, until: int) -> None:
        spec = self.plan.spec
        weight = self.model.weight
        batches = iter(self.loader)
        while self.step < until:
            x, target = next(batches)
            spec.before_backward(self)
            self.optimizer.zero_grad()
            loss = self.criterion(self.module(x), target)
            loss.backward()
            spec.before_step(self)
            self.optimizer.step()
            spec.record(self)
            self.observed[:, self.step] = weight.grad.detach().reshape(-1)[0::2].double().numpy() \
                / CLIP
            self.step += 1

    def checkpoint_and_restore(self) -> None:
        """Save samplers, optimizer (noise state) and accountant, rebuild all of them from
        scratch with other seeds, and load the saved state (the ``resume`` path)."""
        spec = self.plan.spec
        state = {"samplers": self.batch_sampler.state_dict(),
                 "optimizer": self.optimizer.state_dict(),
                 "accountant": self.accountant.state_dict(),
                 "model": {k: v.clone() for k, v in self.model.state_dict().items()}}
        if hasattr(self.module, "_close"):
            self.module._close()
        # fresh pieces, other seeds: only the checkpoint can make them continue the run
        self.samplers = self._samplers(1)
        self.model = nn.Linear(self.width, 1, bias=False)
        self.model.load_state_dict(state["model"])
        self.accountant = spec.new_accountant(self)
        self.accountant.load_state_dict(state["accountant"])
        self._build(torch.Generator().manual_seed(self.noise_seed + 1))
        self.batch_sampler.load_state_dict(state["samplers"])
        self.optimizer.load_state_dict(state["optimizer"])

    def run(self) -> None:
        if self.plan.path == "resume":
            half = max(1, self.plan.steps // 2)
            self.train(half)
            self.checkpoint_and_restore()
        self.train(self.plan.steps)

    def loss_drop(self) -> np.ndarray:
        """Black-box scores: drop of the canary input's loss under the trained model."""
        x = torch.zeros(self.present.size, self.width)
        x[torch.arange(self.present.size), 2 * torch.arange(self.present.size)] = CLIP
        return self.plan.canary.loss_drop(self.initial, self.model, x).double().numpy()

    def strategy(self) -> Optional[np.ndarray]:
        """The strategy matrix of the optimizer that ran (white-box: read from it)."""
        return _strategy_of(self.optimizer, self.plan.steps)


# ---- per-scheme audit specs -------------------------------------------------------------------
#: Memo of reported ε (see :meth:`_SchemeAudit.reported`).
_REPORTED: dict = {}

class _SchemeAudit:
    """How to audit one scheme: its default flags, the scheme priced, the sampler of one run,
    the canary's participation law and (for matrix mechanisms) the strategy."""

    name = ""
    summary = ""
    defaults: dict = {}
    #: The other examples' gradient in the canary's coordinate (units of C); None: they use a
    #: coordinate of their own.
    others: Optional[float] = None
    #: "Without" runs remove the canary (their sampler draws from n - 1 examples) instead of
    #: zeroing it (the same mechanism for samplers drawing every example independently).
    removal = False
    #: Substitution relation: "without" runs hold ``others`` in the canary's rows.
    substitution = False
    #: Paths this scheme's pipeline supports.
    paths = SCHEME_PATHS
    #: Mutation -> flags (over the defaults) at which that mutation is audited, where the
    #: defaults cannot show it.
    mutation_flags: dict = {}
    #: Path -> flags (over the defaults) that path needs (the tools' sweeps use them).
    path_flags: dict = {}

    def others_value(self, plan: _Plan) -> Optional[float]:
        """:attr:`others` of this audit (a design flag may change it)."""
        return self.others

    def row(self, plan: _Plan, item) -> int:
        """The dataset row (within its run) of an item the sampler draws."""
        return int(item)

    def examples(self, f: dict) -> int:
        """Dataset rows per run."""
        return f["examples"]

    # -- the accountant, fed by the training loop -------------------------------------------
    def new_accountant(self, chunk: "_Chunk"):
        """A fresh accountant of the priced scheme (its registered class)."""
        return SchemeAccountant(chunk.plan.scheme)

    def record(self, chunk: "_Chunk") -> None:
        """After each optimizer step: the accountant is told the *claimed* σ and the scheme's
        rate (a mutation does not tell it)."""
        rate = chunk.plan.scheme.expected_sample_rate()
        chunk.accountant.step(noise_multiplier=chunk.plan.noise_multiplier,
                              sample_rate=rate if rate is not None else 1.0)

    def reported(self, chunk: "_Chunk") -> float:
        """The ε the pipeline's accountant reports at the plan's δ (memoised on the scheme, the
        accountant's recorded history, its Monte Carlo settings (seed included) and δ: the same
        record prices the same)."""
        acc = chunk.accountant
        key = (type(acc), acc.scheme, tuple(acc.history), acc.discretization,
               getattr(acc, "settings", None), chunk.plan.delta)
        if key not in _REPORTED:
            _REPORTED[key] = float(acc.get_epsilon(chunk.plan.delta))
        return _REPORTED[key]

    def attach(self, chunk: "_Chunk") -> None:
        """After the optimizer is built (hook for per-example machinery)."""

    def before_backward(self, chunk: "_Chunk") -> None:
        """Before each backward."""

    def before_step(self, chunk: "_Chunk") -> None:
        """Between backward and the optimizer step."""

    def canary_rows(self, plan: _Plan) -> list[int]:
        """Rows (within a run) that carry the canary."""
        return [0]

    def scheme(self, f: dict):
        raise NotImplementedError

    def doubled(self, scheme, f: dict):
        """The scheme the samplers draw under ``mutation="rate-doubled"``."""
        raise NotImplementedError

    def sampler(self, plan: _Plan, generator: torch.Generator, *, removed: bool = False):
        return plan.drawn.sampler(plan.examples, generator=generator)

    def patterns(self, plan: _Plan, sampler) -> tuple[tuple, np.ndarray, np.ndarray]:
        """``(key, patterns, log_probs)`` of the canary (row 0) of a run drawn by ``sampler``;
        runs with equal ``key`` share the law."""
        raise NotImplementedError

    def patterns_without(self, plan: _Plan):
        """``(patterns, log_probs)`` of the canary coordinate without the canary (``None``:
        always 0)."""
        return None

    def coefficients(self, scheme, f: dict) -> Optional[list]:
        return None

    def wrong_band(self, scheme, f: dict) -> list:
        raise ValueError(f"mutation 'wrong-band' applies to matrix-mechanism schemes; scheme "
                         f"{self.name!r} adds independent noise")


class _PoissonAudit(_SchemeAudit):
    """Poisson sampling (add/remove; a zeroed canary = a removed one, the sampler drawing every
    example independently). Also the ``lightning`` path: Poisson sampling of ``R`` runs of
    ``n`` examples each *is* Poisson sampling of their ``R·n`` examples, so ``DPCallback``
    installs the scheme's sampler over the union itself."""

    name = "poisson"
    paths = SCHEME_PATHS
    summary = "Poisson sampling, DP-SGD (add/remove; a zero canary = removed)"
    defaults = dict(sample_rate=0.5, noise_multiplier=0.7, steps=3, delta=0.05, examples=4)

    def scheme(self, f):
        return PoissonScheme(sample_rate=f["sample_rate"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, sample_rate=min(1.0, 2 * scheme.sample_rate))

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(plan.examples, generator=generator, steps=plan.steps)

    def patterns(self, plan, sampler):
        return (), *bernoulli_patterns(plan.steps, range(plan.steps), plan.scheme.sample_rate)


class _TruncatedPoissonAudit(_SchemeAudit):
    r"""Truncated Poisson, add/remove (Theorem 3.1 of Ganesh 2025), two canary designs
    (flag ``design``).

    ``"displace"`` (default): the worst case of its :math:`r = 2` branch is an included canary
    **displacing** another example whose gradient points the other way: the other examples here
    have gradient :math:`-C e_k` in the canary's coordinate, and the rate is high enough that at
    least ``B`` others are drawn almost always, so every batch sums to :math:`-B` without the
    canary and to :math:`-B + 2` when the canary is kept (probability ``q``, the scheme's
    conditional sampling probability): the pair :math:`(1-q)N(0) + qN(2)` vs :math:`N(0)` the
    accountant prices.

    ``"add"``: the other examples use a coordinate of their own, so the canary's coordinate
    releases :math:`1[\text{canary kept}]` (probability :math:`\pi` =
    ``scheme.inclusion_probability``, independently at every step): where truncation is rare
    (``B`` near ``n``) this is the :math:`r = 1` branch :math:`(1-p)N(0) + pN(1)` vs
    :math:`N(0)` that dominates the price. This is the design that sees a **doubled rate**: in
    the displacement regime (:math:`pn \gg B`) a kept canary has probability
    :math:`q \approx B/n` whatever the rate, so doubling ``p`` changes the release by almost
    nothing (the truncation caps it); with ``B`` near ``n`` it nearly doubles :math:`\pi`.

    "Without" runs draw from the ``n - 1`` other examples (removal)."""

    name = "truncated-poisson"
    summary = ("Poisson sampling truncated to B examples (add/remove; design=displace: the "
               "canary displaces an opposite example; design=add: it is only added)")
    defaults = dict(sample_rate=0.9, max_batch_size=3, noise_multiplier=1.4, steps=2,
                    delta=0.05, examples=6, design="displace")
    #: Settings where a doubled rate changes the release (``design="add"``, truncation rare
    #: unbroken, 38 % of the doubled sampler's batches truncated): the rate-doubled mutation's.
    RATE_DOUBLED = dict(design="add", sample_rate=0.4, max_batch_size=8, examples=10,
                        noise_multiplier=0.8, steps=3)
    DESIGNS = ("displace", "add")
    mutation_flags = {"rate-doubled": RATE_DOUBLED}
    others = -1.0
    removal = True

    def others_value(self, plan):
        return self.others if self._design(plan.flags) == "displace" else None

    def _design(self, f) -> str:
        design = f.get("design", "displace")
        if design not in self.DESIGNS:
            raise ValueError(f"design must be one of {list(self.DESIGNS)}, got {design!r}")
        return design

    def scheme(self, f):
        self._design(f)
        return TruncatedPoissonScheme(dataset_size=f["examples"], sample_rate=f["sample_rate"],
                                      max_batch_size=f["max_batch_size"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, sample_rate=min(1.0, 2 * scheme.sample_rate),
                                   epoch_steps=scheme.steps_per_epoch())

    def sampler(self, plan, generator, *, removed=False):
        scheme = plan.drawn
        if removed:
            scheme = dataclasses.replace(scheme, dataset_size=scheme.dataset_size - 1,
                                         epoch_steps=scheme.steps_per_epoch())
        return scheme.sampler(scheme.dataset_size, generator=generator, pad=False)

    def patterns(self, plan, sampler):
        if self._design(plan.flags) == "add":
            return (), *bernoulli_patterns(plan.steps, range(plan.steps),
                                           plan.scheme.inclusion_probability)
        B = plan.scheme.max_batch_size
        rows, lps = bernoulli_patterns(plan.steps, range(plan.steps),
                                       plan.scheme.conditional_sampling_probability)
        return (), 2.0 * rows - B, lps

    def patterns_without(self, plan):
        if self._design(plan.flags) == "add":
            return None
        return np.full((1, plan.steps), -float(plan.scheme.max_batch_size)), np.zeros(1)


class _BallsInBinsAudit(_SchemeAudit):
    name = "balls-in-bins"
    summary = "balls-in-bins (each example in one uniform bin, bins reused every epoch)"
    defaults = dict(num_bins=2, epochs=1, noise_multiplier=0.8, delta=0.05, examples=4)

    def scheme(self, f):
        return BallsInBinsScheme(num_bins=f["num_bins"], epochs=f["epochs"])

    def doubled(self, scheme, f):
        if scheme.num_bins % 2:
            raise ValueError(f"num_bins: 'rate-doubled' halves the bins, needs an even "
                             f"num_bins, got {scheme.num_bins}")
        return dataclasses.replace(scheme, num_bins=scheme.num_bins // 2,
                                   epochs=2 * scheme.epochs)

    def patterns(self, plan, sampler):
        k, T = plan.scheme.num_bins, plan.steps
        rows = np.zeros((k, T))
        for b in range(k):
            rows[b, b::k] = 1.0
        return (), rows, np.full(k, -math.log(k))


class _BandMFAudit(_SchemeAudit):
    name = "bandmf-cyclic-poisson"
    summary = "BandMF correlated noise with cyclic Poisson sampling (b-banded strategy)"
    defaults = dict(bands=2, batch_size=2.0, noise_multiplier=1.3, steps=12, delta=0.05,
                    examples=8)

    def scheme(self, f):
        return BandMFCyclicPoissonScheme(dataset_size=f["examples"], batch_size=f["batch_size"],
                                         bands=f["bands"])

    def doubled(self, scheme, f):
        return dataclasses.replace(scheme, batch_size=2 * scheme.batch_size)

    def coefficients(self, scheme, f):
        """The scheme's strategy over the run (``scheme.noise_correlation(steps)``)."""
        return [float(v) for v in scheme.noise_correlation(f["steps"])]

    def wrong_band(self, scheme, f):
        # banded over the whole run: the canary's participations (bands steps apart) overlap
        return [float(v) for v in strategy_coefficients(scheme.strategy, f["steps"],
                                                         f["steps"])]

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(plan.examples, generator=generator, steps=plan.steps)

    def patterns(self, plan, sampler):
        b = plan.scheme.bands
        group = int(sampler.groups[0])
        eligible = [t for t in range(plan.steps) if t % b == group]
        return (group,), *bernoulli_patterns(plan.steps, eligible, plan.scheme.sample_rate)


def min_sep_patterns(steps: int, min_sep: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Every participation pattern of one example under cold-start b-min-sep sampling
    (Algorithm 1 of Dong & Ganesh): at each step an *available* example joins with probability
    ``p`` and is then barred for the next ``b - 1`` steps, so
    :math:`P(S) = p^{|S|}(1-p)^{\#\text{available steps not taken}}`."""
    b, p = check_int("min_sep", min_sep, minimum=1), check_probability("rate", rate)
    rows, lps = [], []

    def walk(t: int, row: list, lp: float):
        if t >= steps:
            rows.append(row), lps.append(lp)
            return
        if p < 1:  # available, not taken
            walk(t + 1, row + [0.0], lp + math.log1p(-p))
        if p > 0:  # taken: barred for b - 1 steps
            barred = min(b - 1, steps - t - 1)
            walk(t + 1 + barred, row + [1.0] + [0.0] * barred, lp + math.log(p))

    walk(0, [], 0.0)
    if len(rows) > MAX_PATTERNS:
        raise ValueError(f"steps: {len(rows)} participation patterns (max {MAX_PATTERNS}); "
                         f"audit fewer steps")
    return np.array(rows), np.array(lps)


class _BMinSepAudit(_BandMFAudit):
    """BandMF with cold-start b-min-sep sampling (Dong & Ganesh), priced by its Monte Carlo
    accountant (an estimate that holds with probability 1 - q, not a bound; Algorithm 5
    certifies it). The canary's participations are at least ``min_sep`` steps apart, so with a
    strategy of at most ``min_sep`` bands they never overlap through ``C``."""

    name = "bminsep-mc"
    summary = "BandMF with b-min-sep sampling (Monte Carlo accountant: an estimate)"
    defaults = dict(bands=2, batch_size=8 / 3, noise_multiplier=1.3, steps=12, delta=0.05,
                    examples=8, mc_samples=100_000)

    def scheme(self, f):
        # horizon: the strategy the optimizer streams is optimised for the audited run
        return BMinSepMonteCarloScheme(bands=f["bands"], dataset_size=f["examples"],
                                       batch_size=f["batch_size"], min_sep=f["bands"],
                                       horizon=f["steps"])

    def new_accountant(self, chunk):
        seed = None if chunk.plan.seed is None else int(chunk.plan.seed)
        return SchemeAccountant(chunk.plan.scheme, settings=MonteCarloSettings(
            samples=check_int("mc_samples", chunk.plan.flags["mc_samples"], minimum=1000),
            seed=seed))

    def patterns(self, plan, sampler):
        scheme = plan.scheme
        return (), *min_sep_patterns(plan.steps, scheme.min_sep, scheme.sampling_prob)


class _StructuredAudit(_SchemeAudit):
    r"""Structured window subsampling (Schuchardt et al., ICML 2025), 1-event relation, WR
    bottom level, one window per drawn series. The canary is an **event**: one time step
    ``time`` of series 0 (:class:`~opacus_structured.audit.canaries.EventCanary`). Every window
    of every series has gradient :math:`-C e_k`; with the event, the
    :math:`k = L_C + L_F` windows covering it have :math:`+mC e_k` instead (clipped to
    :math:`+C e_k`: the substitution changes each of them by :math:`2C`). With ``batch_size``
    = 1 window per step, every step releases :math:`-1` without the event and :math:`+1` when a
    covering window was drawn (probability :math:`\rho r` for WOR, :math:`r = k/T` at the
    canary series' step of the epoch for the deterministic top level): exactly the pair
    :math:`(1-q)N(0) + qN(2)` vs :math:`N(0)` of Theorems 4.4 / 4.2 — the tight results."""

    name = "structured"
    summary = ("structured time-series windows, 1-event relation (the canary is one time step "
               "of one series), WOR or deterministic top level")
    defaults = dict(top_level="wor", num_series=2, series_length=3, context_length=2,
                    forecast_length=1, noise_multiplier=1.4, steps=3, delta=0.05)
    others = -1.0
    substitution = True
    #: Every path, and the forecasting trainer end to end (deterministic top level).
    paths = SCHEME_PATHS + FORECASTER_PATHS
    #: The trainer's paths audit the deterministic top level (2 series per run, one window per
    #: step: the canary series is drawn at the first step of every 2-step epoch; r = 2 of 4
    #: windows cover the event; 3 epochs).
    path_flags = {p: dict(top_level="deterministic", series_length=4, context_length=1, steps=6)
                  for p in FORECASTER_PATHS}

    def scheme(self, f):
        return StructuredScheme(num_series=f["num_series"], series_length=f["series_length"],
                                context_length=f["context_length"],
                                forecast_length=f["forecast_length"], batch_size=1,
                                top_level=f["top_level"], bottom_level="wr", relation="event",
                                w=1)

    def doubled(self, scheme, f):
        raise ValueError("mutation 'rate-doubled' is audited on the poisson scheme; the "
                         "structured sampler's rate is fixed by its geometry")

    def sampler(self, plan, generator, *, removed=False):
        return plan.drawn.sampler(generator=generator)

    @staticmethod
    def _starts(scheme) -> int:
        return scheme.series_length - scheme.forecast_length + 1

    def examples(self, f):
        return f["num_series"] * (f["series_length"] - f["forecast_length"] + 1)

    def row(self, plan, item) -> int:  # (series, start) -> series * T + start
        series, start = item
        return int(series) * self._starts(plan.scheme) + int(start)

    def event(self, plan):
        """The event: time ``L_F - 1`` of series 0, so that all ``min(L_C + L_F, T)`` windows
        that can cover an event cover it."""
        return EventCanary(series=0, time=plan.scheme.forecast_length - 1)

    def canary_rows(self, plan):
        # the window at (padded) start s reads x[s - L_C .. s + L_F - 1]
        scheme = plan.scheme
        return self.event(plan).covering_windows(
            [s - scheme.context_length for s in range(self._starts(scheme))],
            scheme.context_length + scheme.forecast_length)

    def patterns(self, plan, sampler):
        scheme = plan.scheme
        r = len(self.canary_rows(plan)) / self._starts(scheme)
        if scheme.top_level == "wor":  # one of num_series series per step, uniformly
            eligible, rate = range(plan.steps), r / scheme.num_series
        else:  # series 0 is in block 0: the first step of every epoch
            per_epoch = scheme.steps_per_epoch()
            eligible, rate = [t for t in range(plan.steps) if t % per_epoch == 0], r
        rows, lps = bernoulli_patterns(plan.steps, eligible, rate)
        return (), 2.0 * rows - 1.0, lps

    def patterns_without(self, plan):
        return np.full((1, plan.steps), -1.0), np.zeros(1)


class _GDPFilterAudit(_SchemeAudit):
    r"""Full-batch DP-GD with the individual GDP filter (Koskela, Tobaben & Honkela 2023,
    :class:`lightning_callbacks.gdp_filter.IndividualGDPFilter`, driven as in a plain Opacus
    loop). The canary's gradient has norm ``C``, so it spends :math:`\mu_t = 1/\sigma` per step
    and the filter keeps it for the first :math:`k = \lfloor B^2\sigma^2 \rfloor` steps only;
    the other examples (norms < C) stay active. The released canary coordinate is
    :math:`N(1, \sigma^2)` for ``k`` steps then :math:`N(0, \sigma^2)`: :math:`\sqrt{k}/\sigma`-GDP,
    equal to the budget ``B`` the filter certifies when :math:`B^2\sigma^2` is an integer
    (the defaults: σ = √2/1.5, B = 1.5, k = 2 of 4 steps). The reported ε is the filter's
    (:meth:`~lightning_callbacks.gdp_filter.IndividualGDPFilter.epsilon`). Paths: hooks
    (inactive ``grad_sample`` rows zeroed before the optimizer clips), ghost (the mask
    enters the clipping coefficients inside Opacus' backward), book-keeping (the mask enters
    the book-keeping coefficients), each under DDP too (the filter decides on the
    all-gathered global batch, every rank masks its shard), and lightning (the filter as a
    callback beside ``DPCallback``)."""

    name = "gdp-filter"
    summary = "full-batch DP-GD with the individual GDP filter (per-example budget B)"
    defaults = dict(budget=1.5, noise_multiplier=math.sqrt(2) / 1.5, steps=4, delta=0.05,
                    examples=4)
    paths = ("hooks", "ghost", "bookkeeping", "ddp", "ddp-ghost", "ddp-bookkeeping",
             "lightning")

    def scheme(self, f):
        check_positive("budget", f["budget"])
        return GDPScheme()

    def doubled(self, scheme, f):
        raise ValueError("mutation 'rate-doubled' needs a subsampled scheme; full-batch DP-GD "
                         "already uses every example")

    def new_accountant(self, chunk):
        from lightning_callbacks.gdp_filter import IndividualGDPFilter  # optional: lightning

        return IndividualGDPFilter(chunk.present.size * chunk.plan.examples,
                                   chunk.plan.flags["budget"])

    def record(self, chunk):
        """The filter recorded the step itself (its μ use the optimizer's σ)."""

    def reported(self, chunk):
        return float(chunk.accountant.epsilon(chunk.plan.delta))

    def attach(self, chunk):
        if _clipping(chunk.plan.path) == "ghost":
            chunk.accountant.attach_ghost(chunk.module, chunk.optimizer)
        elif _clipping(chunk.plan.path) == "hooks":
            # folded into Opacus' clipping factors (the path DPCallback takes in hooks mode)
            if not chunk.accountant.attach(chunk.optimizer):
                raise ValueError(f"{type(chunk.optimizer).__name__} does not clip as Opacus' "
                                 f"DPOptimizer: the filter cannot be folded into its factors")

    def before_backward(self, chunk):
        if _clipping(chunk.plan.path) in ("ghost", "hooks"):
            chunk.accountant.set_batch_indices(chunk.local_batch())

    def before_step(self, chunk):
        if _clipping(chunk.plan.path) in ("ghost", "hooks"):
            return  # the filter decides inside the ghost backward / the optimizer's clipping
        from lightning_callbacks.gdp_filter import step_norms  # optional: lightning

        # book-keeping: mask the coefficients
        norms, bookkeeper = step_norms(chunk.optimizer)
        params = [] if bookkeeper is not None else [
            p for p in chunk.module.parameters() if p.requires_grad]
        active = chunk.accountant.mask_and_record(
            params, torch.as_tensor(chunk.local_batch(), dtype=torch.int64), norms,
            chunk.optimizer.noise_multiplier, chunk.optimizer.max_grad_norm)
        if bookkeeper is not None:
            bookkeeper.set_mask(active.to(norms.dtype))

    def patterns(self, plan, sampler):
        mu2 = (1.0 / plan.noise_multiplier) ** 2
        k = min(plan.steps, int(math.floor(plan.flags["budget"] ** 2 / mu2 * (1 + 1e-9))))
        row = np.zeros((1, plan.steps))
        row[0, :k] = 1.0
        return (), row, np.zeros(1)


_SPECS: dict[str, _SchemeAudit] = {s.name: s for s in (
    _PoissonAudit(), _TruncatedPoissonAudit(), _BallsInBinsAudit(), _BandMFAudit(),
    _StructuredAudit(), _GDPFilterAudit(), _BMinSepAudit())}


def audit_registry() -> dict[str, dict]:
    """Scheme name -> ``{"summary", "paths", "mutations", "defaults", "mutation_flags",
    "path_flags"}`` of every auditable scheme (what ``opacus-structured audit <scheme>``
    accepts; ``mutation_flags[m]``: the flags, over the defaults, at which mutation ``m``
    changes the release, where the defaults cannot show it; ``path_flags[p]``: the flags, over
    the defaults, that path ``p`` needs)."""
    out = {}
    for name, spec in _SPECS.items():
        mutations = [m for m in MUTATIONS
                     if m != "wrong-band" or type(spec).wrong_band is not _SchemeAudit.wrong_band]
        out[name] = {"summary": spec.summary, "paths": list(spec.paths),
                     "mutations": mutations, "defaults": dict(spec.defaults),
                     "mutation_flags": {m: dict(v) for m, v in spec.mutation_flags.items()},
                     "path_flags": {p: dict(v) for p, v in spec.path_flags.items()}}
    return out


#: Auditable scheme names.
AUDIT_SCHEMES = tuple(_SPECS)


def audited_scheme(scheme_name: str, flags: dict):
    """The scheme object whose accountant prices an audit of ``scheme_name`` run with
    ``flags`` (an audit's ``AuditScores.meta["flags"]``): what the predicted trade-off curve of
    :mod:`~opacus_structured.audit.report` is drawn from."""
    spec = _SPECS.get(scheme_name)
    if spec is None:
        raise ValueError(f"scheme must be one of {list(AUDIT_SCHEMES)}, got {scheme_name!r}")
    return spec.scheme(flags)


def _flags(spec: _SchemeAudit, scheme_flags: dict) -> dict:
    unknown = sorted(set(scheme_flags) - set(spec.defaults))
    if unknown:
        raise ValueError(f"scheme {spec.name!r} takes no flag {unknown[0]!r}; its flags are "
                         f"{sorted(spec.defaults)}")
    f = {**spec.defaults, **scheme_flags}
    for key in ("steps", "examples", "num_bins", "epochs", "bands", "max_batch_size",
                "num_series", "series_length", "context_length", "forecast_length"):
        if key in f:
            f[key] = check_int(key, f[key], minimum=0 if key == "context_length" else 1)
    f["noise_multiplier"] = check_positive("noise_multiplier", f["noise_multiplier"])
    f["delta"] = check_open_unit("delta", f["delta"])
    if "num_bins" in f:
        f["steps"] = f["num_bins"] * f["epochs"]
    return f


def _plan(scheme_name: str, path: str, mutation: Optional[str], canary, flags: dict) -> _Plan:
    spec = _SPECS.get(scheme_name)
    if spec is None:
        raise ValueError(f"scheme must be one of {list(AUDIT_SCHEMES)}, got {scheme_name!r}")
    if path not in spec.paths:
        raise ValueError(f"path must be one of {list(spec.paths)} for scheme {scheme_name!r}, "
                         f"got {path!r}")
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"mutation must be None or one of {list(MUTATIONS)}, got {mutation!r}")
    if isinstance(canary, str):
        if canary not in CANARIES or canary == "event":
            raise ValueError(f"canary must be 'dirac' or 'input' (or a canary object), got "
                             f"{canary!r}")
        canary = CANARIES[canary]()
    if not isinstance(canary, DiracCanary):
        raise ValueError(f"canary must be a canary name or object, got {canary!r}")
    f = _flags(spec, flags)
    scheme = spec.scheme(f)
    sigma = f["noise_multiplier"]
    coefficients = spec.coefficients(scheme, f)
    plan = _Plan(spec=spec, flags=f, scheme=scheme, drawn=scheme, noise_multiplier=sigma,
                 actual_noise_multiplier=sigma, clip=CLIP, coefficients=coefficients,
                 steps=f["steps"], delta=f["delta"], examples=spec.examples(f), path=path,
                 canary=canary, mutation=mutation)
    if mutation == "noise-halved":
        plan.actual_noise_multiplier = sigma / 2
    elif mutation == "rate-doubled":
        plan.drawn = spec.doubled(scheme, f)
    elif mutation == "no-clipping":
        plan.clip = NO_CLIP
        plan.actual_noise_multiplier = sigma * CLIP / NO_CLIP  # same noise std σ·C
    elif mutation == "wrong-band":
        plan.coefficients = spec.wrong_band(scheme, f)
    return plan


def _scores(plan: _Plan, chunks: list[_Chunk]) -> np.ndarray:
    if plan.canary.observes == "loss":
        return np.concatenate([c.loss_drop() for c in chunks])
    out = []
    for chunk in chunks:
        laws: dict = {}
        keys = []
        for sampler in chunk.samplers:
            key, rows, lps = plan.spec.patterns(plan, sampler)
            laws[key] = (rows, lps)
            keys.append(key)
        scores = np.empty(chunk.present.size)
        strategy = chunk.strategy()
        without = plan.spec.patterns_without(plan) or (None, None)
        for key, (rows, lps) in laws.items():
            idx = np.array([i for i, k in enumerate(keys) if k == key])
            scores[idx] = likelihood_ratio_scores(chunk.observed[idx], rows, lps,
                                                  plan.noise_multiplier, strategy, *without)
        out.append(scores)
    return np.concatenate(out)


def run_audit(scheme: str, *, runs: int, seed: Optional[int] = None, path: str = "hooks",
              mutation: Optional[str] = None, canary="dirac",
              progress: Optional[Callable[[int, int], None]] = None,
              **scheme_flags) -> AuditScores:
    r"""Train ``runs`` runs with and ``runs`` without a canary through the real pipeline of
    ``scheme`` on ``path`` and score each (module docstring).

    Args:
        scheme: one of :data:`AUDIT_SCHEMES`.
        runs: runs **per side** (``runs`` with the canary, ``runs`` without), >= 2.
        seed: seeds every sampler, noise generator and dataset (``None``: OS entropy).
        path: one of :data:`AUDIT_PATHS`.
        mutation: ``None`` or one of :data:`MUTATIONS` (a deliberately broken pipeline).
        canary: ``"dirac"`` (white-box gradients, likelihood-ratio score), ``"input"``
            (black-box loss of the canary input) or a canary object.
        progress: called as ``progress(done_runs, total_runs)``.
        **scheme_flags: the scheme's settings (``audit_registry()[scheme]["defaults"]``:
            ``noise_multiplier``, ``steps``, ``delta``, ``examples`` per run, and the scheme's
            own, e.g. ``sample_rate``).

    Returns:
        :class:`~opacus_structured.audit.estimators.AuditScores` with the ε the scheme's
        accountant reports at ``delta`` after the run (told the *claimed* setting, also under a
        mutation) and ``meta`` (settings, seconds).
    """
    runs = check_int("runs", runs, minimum=2)
    plan = _plan(scheme, path, mutation, canary, scheme_flags)
    plan.seed = seed
    if _distributed(path):
        return _run_ddp(plan, runs, seed)
    if path == "lightning":
        return _run_lightning(plan, runs, seed)
    if path in FORECASTER_PATHS:
        from .forecaster import run_forecaster_audit  # optional: gluonts (the [forecast] extra)

        return run_forecaster_audit(plan, runs, seed, progress)
    return _run(plan, runs, seed, progress)


def _run(plan: _Plan, runs: int, seed: Optional[int],
         progress: Optional[Callable[[int, int], None]] = None) -> AuditScores:
    """The audit of ``plan`` in this process (every rank of the ``ddp`` path runs it)."""
    started = time.perf_counter()
    seq = np.random.SeedSequence(seed)
    present = np.concatenate([np.ones(runs, dtype=bool), np.zeros(runs, dtype=bool)])
    order = np.random.default_rng(seq.spawn(1)[0]).permutation(present.size)
    present = present[order]  # with/without runs interleaved across chunks
    chunks = []
    for start in range(0, present.size, CHUNK_RUNS):
        part = present[start:start + CHUNK_RUNS]
        child = seq.spawn(1)[0]
        chunk = _Chunk(plan, part, child.generate_state(part.size + 2, dtype=np.uint64)
                       .astype(np.int64) & ((1 << 62) - 1))
        chunk.run()
        chunks.append(chunk)
        if progress is not None:
            progress(min(start + CHUNK_RUNS, present.size), present.size)
    scores = _scores(plan, chunks)
    return _audit_scores(plan, present, scores, plan.spec.reported(chunks[0]), runs, seed,
                         started)


def _audit_scores(plan: _Plan, present: np.ndarray, scores: np.ndarray, reported: float,
                  runs: int, seed, started: float) -> AuditScores:
    meta = {"scheme": plan.spec.name, "path": plan.path, "mutation": plan.mutation,
            "canary": plan.canary.name, "runs_per_side": runs, "seed": seed,
            "noise_multiplier": plan.noise_multiplier, "steps": plan.steps, "clip": CLIP,
            "flags": dict(plan.flags), "scheme_object": repr(plan.scheme),
            "noise_correlation": None if plan.coefficients is None else list(plan.coefficients),
            "seconds": time.perf_counter() - started}
    return AuditScores(scores[present], scores[~present], reported, plan.delta, meta)


# ---- DDP: the same audit in DDP_WORLD_SIZE gloo processes ---------------------------------------
def _ddp_worker(rank: int, world: int, address: str, plan: _Plan, runs: int, seed, out: str):
    import pickle

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        scores = _run(plan, runs, seed)
        if rank == 0:
            with open(out, "wb") as fh:
                pickle.dump(scores, fh)
    finally:
        dist.destroy_process_group()


def _run_ddp(plan: _Plan, runs: int, seed: Optional[int]) -> AuditScores:
    """Every chunk trained by :data:`DDP_WORLD_SIZE` processes (``torch.multiprocessing``,
    gloo): each rank draws the same global batches (same sampler seeds) and trains on its shard
    (:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler`), Opacus'
    ``DifferentiallyPrivateDistributedDataParallel`` + ``DistributedDPOptimizer`` (our
    ``DistributedCorrelatedNoiseDPOptimizer`` for correlated noise) add the noise once (rank 0)
    and all-reduce; rank 0 reads the released sums."""
    import os
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "scores.pkl")
        # file rendezvous in a fresh directory: no port to race for
        address = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_ddp_worker, args=(DDP_WORLD_SIZE, address, plan, runs, seed, out),
                 nprocs=DDP_WORLD_SIZE, join=True)
        with open(out, "rb") as fh:
            return pickle.load(fh)


# ---- Lightning: DPCallback on an unmodified LightningModule ------------------------------------
#: Runs per Lightning fit (one Trainer each).
LIGHTNING_CHUNK_RUNS = 1024


class IndependentRunsBatchSampler(ParallelRunsBatchSampler):
    r""":class:`ParallelRunsBatchSampler` that names the scheme every one of its runs draws
    (``scheme``), so that ``DPCallback`` can be handed the audit's ``R`` independent runs.

    **Why the scheme's accountant prices it.** Run ``r``'s examples (rows ``r·n …``) are drawn
    by run ``r``'s own sampler of ``scheme`` and by nothing else, independently of every other
    run. Take an example ``x`` of run ``r`` and its neighbouring dataset (``x`` removed from,
    or changed in, run ``r``): the other runs' batches have the same law under both, and
    conditioned on them the release is run ``r``'s mechanism under ``scheme`` with some fixed,
    data-independent extra gradients added to the sum — which the scheme's worst-case analysis
    already covers. The hockey-stick divergence is jointly convex, so the mixture over the
    other runs is no leakier: ``scheme``'s ε holds for every example. (It is *not* ``scheme``
    over the union of the rows, which for a sampler depending on the dataset size, a cycle or
    a partition would draw differently; only Poisson sampling of ``R`` runs is Poisson
    sampling of their union.)
    """

    def __init__(self, scheme, samplers, examples_per_run: int, steps: int, shifts=None,
                 row=int):
        super().__init__(samplers, examples_per_run, steps, shifts=shifts, row=row)
        self.scheme = scheme


def _strategy_of(optimizer, steps: int) -> Optional[np.ndarray]:
    """The strategy matrix of the optimizer that ran (``None``: independent noise)."""
    c = getattr(optimizer, "noise_coefficients", None)
    if c is None or len(c) == 1 and float(c[0]) == 1.0:
        return None
    return toeplitz_matrix(c, steps)


def _run_lightning(plan: _Plan, runs: int, seed: Optional[int]) -> AuditScores:
    """Runs trained by ``lightning.Trainer`` with
    :class:`~lightning_callbacks.dp_callback.DPCallback`, which hooks the module for per-sample
    gradients, wraps SGD into Opacus' ``DPOptimizer`` (our correlated-noise optimizer for a
    matrix mechanism, through ``optimizer_class``) and prices every step with the scheme's
    accountant; the released sums are read after each step.

    The batches: for Poisson the callback installs ``scheme.sampler`` over the union of the
    runs' examples itself (Poisson over ``R·n`` examples = ``R`` independent Poisson runs); for
    every other scheme it is handed an :class:`IndependentRunsBatchSampler` of one sampler per
    run (``sampler=``), seeded as the hooks path seeds its chunk, so that with the callback's
    noise seed set to the chunk's, the callback releases exactly what the hooks path
    releases (one chunk: up to ``CHUNK_RUNS`` runs)."""
    import lightning.pytorch as pl
    from opacus.optimizers import DPOptimizer

    from lightning_callbacks import DPCallback  # optional: lightning

    if plan.mutation is not None:
        raise ValueError("mutation: the lightning path audits the unmodified DPCallback; run "
                         "mutations on the hooks path")
    if plan.canary.observes != "gradients":
        raise ValueError("canary: the lightning path reads the released gradients (a 'dirac' "
                         "canary); audit the 'input' canary on the hooks path")
    started = time.perf_counter()
    poisson = isinstance(plan.scheme, PoissonScheme)
    gdp = isinstance(plan.spec, _GDPFilterAudit)
    seq = np.random.SeedSequence(seed)
    present = np.concatenate([np.ones(runs, dtype=bool), np.zeros(runs, dtype=bool)])
    present = present[np.random.default_rng(seq.spawn(1)[0]).permutation(present.size)]
    chunks, reported = [], None

    class Canaries(pl.LightningModule):
        def __init__(self, width: int):
            super().__init__()
            self.net = nn.Linear(width, 1, bias=False)
            nn.init.zeros_(self.net.weight)
            self.loss = LinearLoss("sum")

        def training_step(self, batch, batch_idx):
            x, target = batch
            return self.loss(self.net(x), target)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            released.append(self.net.weight.grad.detach().reshape(-1)[0::2].double().numpy()
                            / CLIP)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    chunk_runs = LIGHTNING_CHUNK_RUNS
    for start in range(0, present.size, chunk_runs):
        part = present[start:start + chunk_runs]
        child = seq.spawn(1)[0]
        if poisson:
            state = child.generate_state(2, dtype=np.uint64).astype(np.int64) & ((1 << 62) - 1)
            dataset = runs_dataset(plan, part, np.random.default_rng(int(state[0])))
            samplers, sampler, callback_seed = [None] * part.size, None, int(state[1])
        else:  # the hooks path's seeds (_Chunk): dataset, noise, one sampler per run
            seeds = child.generate_state(part.size + 2, dtype=np.uint64).astype(np.int64) \
                & ((1 << 62) - 1)
            dataset = runs_dataset(plan, part, np.random.default_rng(int(seeds[0])))
            removed = [bool(plan.spec.removal and not p) for p in part]
            samplers = [plan.spec.sampler(plan, torch.Generator().manual_seed(int(s)),
                                          removed=r)
                        for s, r in zip(seeds[2:], removed, strict=True)]
            sampler = IndependentRunsBatchSampler(
                plan.scheme, samplers, plan.examples, plan.steps,
                shifts=[int(r) for r in removed], row=functools.partial(plan.spec.row, plan))
            if gdp:  # full batches of R runs = the full batch of their union: let it build one
                sampler = None
            callback_seed = int(seeds[1]) - 1  # DPCallback seeds its noise with seed + 1
        released: list = []
        extra: dict = {}
        if plan.coefficients is not None:
            extra.update(optimizer_class=correlated_optimizer_class(DPOptimizer),
                         optimizer_kwargs={"noise_correlation": list(plan.coefficients)})
        if isinstance(plan.scheme, BMinSepMonteCarloScheme):  # its ε is a labelled estimate
            extra.update(accountant=plan.spec.new_accountant(types.SimpleNamespace(plan=plan)),
                         allow_estimate=True)
        callback = DPCallback(delta=plan.delta, noise_multiplier=plan.actual_noise_multiplier,
                              max_grad_norm=plan.clip, scheme=plan.scheme, sampler=sampler,
                              seed=callback_seed, loss_reduction="sum",
                              log_every_n_steps=plan.steps, **extra)  # ε once, at the end
        callbacks = [callback]
        if gdp:  # the individual GDP filter, after DPCallback (it reads the recorded indices)
            from lightning_callbacks import IndividualGDPFilter  # optional: lightning

            callbacks.append(IndividualGDPFilter(part.size * plan.examples,
                                                 plan.flags["budget"]))
        trainer = pl.Trainer(max_steps=plan.steps, accelerator="cpu", logger=False,
                             callbacks=callbacks, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             num_sanity_val_steps=0)
        trainer.fit(Canaries(2 * part.size), DataLoader(dataset, batch_size=8))
        if len(released) != plan.steps:
            raise RuntimeError(f"the Lightning fit took {len(released)} steps, not "
                               f"{plan.steps}")
        chunks.append(types.SimpleNamespace(
            present=part, samplers=samplers, observed=np.stack(released, axis=1),
            strategy=functools.partial(_strategy_of, callback.optimizer, plan.steps)))
        if reported is None:  # the filter certifies B-GDP per example (its own ε)
            reported = float(callbacks[-1].epsilon(plan.delta) if gdp else callback.epsilon())
    return _audit_scores(plan, present, _scores(plan, chunks), reported, runs, seed, started)
