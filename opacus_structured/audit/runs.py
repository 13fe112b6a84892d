"""Many independent audit runs side by side: the audit's paths and constants, the batch sampler
that runs them in parallel, a run's plan and one chunk of runs sharing a model (split from
:mod:`~opacus_structured.audit.pipelines`, which re-exports every name)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from .._validation import check_int
from ..accounting.strategies import toeplitz_matrix
from ..optim.bookkeeping import BookKeepingHooks, bookkeeping_optimizer_class
from ..optim.correlated_noise import correlated_optimizer_class
from ..optim.distributed import (
    DistributedCorrelatedNoiseDPOptimizer,
    DistributedCorrelatedNoiseDPOptimizerFastGradientClipping,
)
from ..optim.ghost_clipping import CorrelatedNoiseDPOptimizerFastGradientClipping
from ..samplers.distributed import DistributedBatchSampler, shard
from .canaries import DiracCanary, LinearLoss

if TYPE_CHECKING:  # the plan names its spec; scheme_audits imports this module
    from .scheme_audits import _SchemeAudit


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



def _strategy_of(optimizer, steps: int) -> Optional[np.ndarray]:
    """The strategy matrix of the optimizer that ran (``None``: independent noise)."""
    c = getattr(optimizer, "noise_coefficients", None)
    if c is None or len(c) == 1 and float(c[0]) == 1.0:
        return None
    return toeplitz_matrix(c, steps)


