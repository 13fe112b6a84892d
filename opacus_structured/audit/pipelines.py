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

import functools
import time
import types
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from .._validation import check_int
from ..accounting.strategies import toeplitz_matrix
from ..optim.correlated_noise import correlated_optimizer_class
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ..schemes.poisson import PoissonScheme
from .canaries import CANARIES, DiracCanary, LinearLoss
from .estimators import AuditScores
from .runs import (  # noqa: F401  (re-exported: the audit's constants and run machinery)
    AUDIT_PATHS,
    CHUNK_RUNS,
    CLIP,
    DDP_WORLD_SIZE,
    FORECASTER_PATHS,
    MAX_PATTERNS,
    MUTATIONS,
    NO_CLIP,
    SCHEME_PATHS,
    ParallelRunsBatchSampler,
    _Chunk,
    _clipping,
    _distributed,
    _Plan,
    _strategy_of,
    runs_dataset,
)
from .scheme_audits import (  # noqa: F401  (re-exported)
    _SPECS,
    AUDIT_SCHEMES,
    _flags,
    _GDPFilterAudit,
    audit_registry,
    audited_scheme,
    min_sep_patterns,
)
from .scoring import bernoulli_patterns, likelihood_ratio_scores  # noqa: F401

__all__ = ["run_audit", "AUDIT_SCHEMES", "AUDIT_PATHS", "MUTATIONS", "audit_registry",
           "audited_scheme",
           "ParallelRunsBatchSampler", "IndependentRunsBatchSampler", "likelihood_ratio_scores",
           "toeplitz_matrix"]

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

