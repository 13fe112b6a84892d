"""Red-team loops for the privacy ledger (tests/test_privacy_ledger_redteam.py).

A *case* is (scheme, path, loop shape, num_workers). :func:`run_case` trains a tiny model with
the loop as a user would write it, over a dataset whose every item carries its own index, and
records the index set of every batch an optimizer step actually trained on. :func:`oracle`
then prices that participation pattern **independently of the accountant's bookkeeping**:

* the released batches are matched, in order, against the scheme's own sampler stream
  regenerated from the same seed (``scheme.sampler(n, generator=...)``): a released batch
  that is not the next unused draw of that stream (a batch released twice, a stream that went
  back) makes the pattern one the scheme does not describe;
* a matched pattern is priced by the scheme's own pricing of what ran — the number of releases
  for per-step schemes (and, for Poisson, dp_accounting's PLD), every draw up to the last
  release for schemes whose unit spans several steps (a subset of a unit's releases is
  post-processing of the unit), the releases only when they are the stream's first draws in
  order for correlated noise — at the **largest** noise multiplier used (a lower bound of the
  true ε when σ changed during the run).

The test then requires: a clear error (:class:`LedgerError`, ``ValueError``, ``RuntimeError``
raised by this package, with a message), or a printed ε at least the oracle's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import tempfile
import warnings
from typing import Callable, Optional

import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from redteam_rows import (
    LIGHTNING_MERGING,
    MERGING,
    ROW_MUST_RAISE,
    ROW_SHAPES,
    accumulate_shape,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_structured.engine import make_private
from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme
from opacus_structured.schemes.shuffle import ShuffleScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

N = 60           # examples
B = 10           # batch size: 6 steps per epoch
EPOCHS = 3
SIGMA = 1.0
DELTA = 1e-5
D = 1e-3         # coarse pessimistic discretization (unit tests)
SEED = 7

torch.set_num_threads(1)  # tiny models: threads only add contention

#: One small instance per registered scheme (and per release policy of schemes that have
#: several). Each planned run is EPOCHS epochs of N/B steps.
SCHEMES = {
    "poisson": PoissonScheme(sample_rate=B / N),
    "truncated-poisson": TruncatedPoissonScheme(N, B / N, 2 * B),
    "gdp": GDPScheme(),
    "balls-in-bins": BallsInBinsScheme(num_bins=N // B, epochs=EPOCHS),
    "bandmf-identity": BandMFCyclicPoissonScheme(dataset_size=N, batch_size=float(B), bands=2,
                                                 strategy="identity"),
    "bandmf-banded": BandMFCyclicPoissonScheme(dataset_size=N, batch_size=float(B), bands=2),
    "random-allocation-identity": RandomAllocationMFScheme(
        strategy="identity", epochs=EPOCHS, batches_per_epoch=N // B, method="renyi"),
    "random-allocation-bandmf": RandomAllocationMFScheme(
        strategy="bandmf", bands=2, epochs=EPOCHS, batches_per_epoch=N // B, method="renyi"),
    "shuffle": ShuffleScheme(dataset_size=N, batch_size=B),
    # time-series windows: built by make_private from a WindowDataset (see _structured_data)
    "structured-wor": "wor",
    "structured-deterministic": "deterministic",
}
NUM_SERIES, SERIES_LENGTH, WINDOWS_PER_STEP = 12, 20, 2

#: Loop shapes whose every run is one the ledger must refuse or price above the oracle; shapes
#: in MAY_RAISE are ones where refusing is always an acceptable answer.
SHAPES = ("plain", "skip2", "skip3", "break", "eval_draw", "early_stop", "noise_schedule",
          "batch_memory_manager", "double_step", "accumulate", "rewrap", "stale_reload",
          "resume_checkpoint", "resume_history_only", "other_loader", "detached_step",
          *ROW_SHAPES)
MAY_RAISE = {"double_step", "rewrap", "resume_history_only", "other_loader", "detached_step",
             *ROW_MUST_RAISE}
#: Priceable runs a scheme refuses on purpose (random allocation prices one σ for the run).
REFUSED_BY_DESIGN = {("random-allocation-identity", "noise_schedule"),
                     ("random-allocation-bandmf", "noise_schedule")}
#: Loops Opacus itself refuses on its stock path: its Poisson ``DPDataLoader`` forbids two
#: backward passes per step ("Poisson sampling is not compatible with grad accumulation").
REFUSED_BY_OPACUS = {("poisson", "accumulate"), ("poisson", "public_fakes")}
#: Shapes that sum more rows than the step's batch has: where rows carry no tokens
#: (``DPCallback`` under Lightning) they raise, naming the cause (``rows_per_example``).
ROWS_BEYOND_THE_BATCH = {"two_views", "three_views", *MERGING}
#: Shapes whose run no ε describes: they must raise (a batch released twice, batches that did
#: not come from the scheme's loader, private training outside the DP optimizer, a stale state).
MUST_RAISE = {"double_step", "rewrap", "other_loader", "detached_step", *ROW_MUST_RAISE}


@dataclasses.dataclass
class Outcome:
    """What a loop printed (``epsilon``) or the error it raised, and what it trained on."""

    released: list
    sigmas: list
    parts: Optional[list] = None  # per release: [(batch keys, rows per example), ...]
    scheme: object = None
    epsilon: Optional[float] = None
    error: Optional[BaseException] = None
    stock: bool = False      # Opacus' own DPDataLoader: its stream cannot be regenerated
    lightning: bool = False  # DPCallback
    shape: str = ""


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g),
                         torch.arange(N))


def _engine(scheme):
    correlated = not isinstance(scheme, str) and scheme.correlated_noise
    return CorrelatedNoisePrivacyEngine() if correlated else PrivacyEngine()


def _structured_data():
    from opacus_structured.forecasting.windowing import WindowDataset

    g = torch.Generator().manual_seed(0)
    series = [torch.randn(SERIES_LENGTH, generator=g) for _ in range(NUM_SERIES)]
    return WindowDataset(series, context_length=2, forecast_length=1)


def _private(scheme, model, optimizer, *, workers: int, engine=None, **opacus_kw):
    """``(engine, *make_private(...))``; ``opacus_kw`` go to ``make_private`` (e.g.
    ``criterion=`` and ``grad_sample_mode="ghost"``: then the criterion comes third)."""
    engine = engine if engine is not None else _engine(scheme)
    generator = torch.Generator().manual_seed(SEED)
    if isinstance(scheme, str):  # structured: the scheme is read from the WindowDataset
        data = _structured_data()
        loader = DataLoader(data, batch_size=WINDOWS_PER_STEP, num_workers=workers,
                            collate_fn=data.collate)
        return (engine, *make_private(
            engine, module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=1.0, scheme="structured", top_level=scheme,
            epochs=EPOCHS, sampler_generator=generator, **opacus_kw))
    extra = {"pad": False} if isinstance(scheme, TruncatedPoissonScheme) else {}
    loader = DataLoader(_data(), batch_size=B, num_workers=workers)
    return (engine, *make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=1.0, scheme=scheme, epochs=EPOCHS, sampler_generator=generator, **extra,
        **opacus_kw))


def _fresh_model(scheme=None):
    torch.manual_seed(0)
    model = nn.Linear(2, 1) if isinstance(scheme, str) else nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


class _Loop:
    """Training helpers that record what each optimizer step trained on."""

    def __init__(self, model, optimizer, criterion=None):
        self.model, self.optimizer = model, optimizer
        self.criterion = criterion  # Opacus' ghost-clipping loss (None: torch's functional)
        self.released: list = []
        self.parts: list = []     # per release: [(batch keys, rows per example), ...]
        self.sigmas: list = []
        self._accumulated: list = []
        self._parts: list = []

    @staticmethod
    def keys(batch) -> list:
        if isinstance(batch, dict):  # windows: keys (series, start)
            return list(zip(batch["window_series"].tolist(), batch["window_start"].tolist(), strict=True))
        return batch[2].tolist()

    def backward(self, batch, views: int = 1) -> None:
        """One forward/backward on ``batch`` (``views`` augmented copies of each row)."""
        self.forward_backward([batch], views=views)

    def forward_backward(self, batches: list, views: int = 1) -> None:
        """One forward/backward on the concatenation of ``batches``, each row ``views``
        times (noisy copies: two augmented views per example)."""
        windows = isinstance(batches[0], dict)
        xs = [b["context"] if windows else b[0] for b in batches]
        ys = [b["target"] if windows else b[1] for b in batches]
        x, y = torch.cat(xs), torch.cat(ys)
        if views > 1:
            x = torch.cat([x + 0.01 * torch.randn_like(x) for _ in range(views)])
            y = torch.cat([y] * views)
        if len(x):
            loss = self.criterion or (nn.functional.mse_loss if windows
                                      else nn.functional.cross_entropy)
            loss(self.model(x), y).backward()
        for b in batches:
            keys = self.keys(b)
            self._accumulated.extend(keys * views)
            self._parts.append((tuple(sorted(keys)), views))

    def step(self, batch=None) -> None:
        if batch is not None:
            self.optimizer.zero_grad()
            self.backward(batch)
        peek = getattr(self.optimizer, "_check_skip_next_step", None)
        if peek is not None and peek(pop_next=False):
            self.optimizer.step()  # BatchMemoryManager: a physical batch, not a noisy step
            self._physical = True
            return
        if getattr(self, "_physical", False):  # the physical batches of one logical batch
            self._parts = [(tuple(sorted(k for keys, _ in self._parts for k in keys)), 1)]
            self._physical = False
        # recorded before the step: a step the accountant refuses was still attempted
        self.released.append(tuple(sorted(self._accumulated)))
        self.parts.append(list(self._parts))
        self.sigmas.append(self.optimizer.noise_multiplier)
        self._accumulated, self._parts = [], []
        self.optimizer.step()


def run_case(scheme_name: str, shape: str, workers: int = 0) -> Outcome:
    """Run one loop shape on the ``make_private`` path (module docstring)."""
    scheme = SCHEMES[scheme_name]
    model, optimizer = _fresh_model(scheme)
    engine, model, optimizer, loader = _private(scheme, model, optimizer, workers=workers)
    out = Outcome([], [], scheme=engine.accountant.scheme, shape=shape)
    epochs = EPOCHS if not isinstance(scheme, GDPScheme) else 4
    return _drive(out, engine, _Loop(model, optimizer), loader, scheme, epochs, workers)


#: Loop shapes run with Opacus' ghost clipping (``make_private(..., grad_sample_mode="ghost")``,
#: its ``DPLossFastGradientClipping`` criterion): rows per example and draws per release. Not
#: ``accumulate``: Opacus' ghost ``loss.backward()`` zeroes ``p.grad`` between its passes, so
#: a second backward before the step drops the first batch's clipped sum (one draw released).
GHOST_SHAPES = ("plain", "two_views", "three_views", "concat2", "skip_accumulate2",
                "skip_accumulate3", "cached", "public_fakes", "skip2")


def run_ghost_case(scheme_name: str, shape: str, workers: int = 0) -> Outcome:
    """Run one loop shape on the ``make_private`` path with Opacus' ghost clipping."""
    scheme = SCHEMES[scheme_name]
    model, optimizer = _fresh_model(scheme)
    criterion = nn.MSELoss() if isinstance(scheme, str) else nn.CrossEntropyLoss()
    engine, model, optimizer, criterion, loader = _private(
        scheme, model, optimizer, workers=workers, criterion=criterion,
        grad_sample_mode="ghost")
    out = Outcome([], [], scheme=engine.accountant.scheme, shape=shape)
    epochs = EPOCHS if not isinstance(scheme, GDPScheme) else 4
    return _drive(out, engine, _Loop(model, optimizer, criterion), loader, scheme, epochs,
                  workers)


def _drive(out: Outcome, engine, loop: "_Loop", loader, scheme, epochs: int,
           workers: int) -> Outcome:
    """Run ``out.shape`` and read the ε the engine prints (or the error it raises)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _SHAPES[out.shape](loop, engine, loader, scheme, epochs, workers)
            out.epsilon = float(engine.accountant.get_epsilon(DELTA, discretization=D))
    except (RuntimeError, ValueError) as err:
        out.error = err
    # what the loop trained on (its model / optimizer may have been swapped by a re-wrap)
    out.released, out.sigmas, out.parts = loop.released, loop.sigmas, loop.parts
    return out


# ---- loop shapes ---------------------------------------------------------------------------
def _plain(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        for batch in loader:
            loop.step(batch)


def _skip(every: int, offset: int) -> Callable:
    def shape(loop, engine, loader, scheme, epochs, workers):
        for _ in range(epochs):
            for i, batch in enumerate(loader):
                if i % every == offset:
                    loop.optimizer.zero_grad()
                    continue
                loop.step(batch)
    return shape


def _break(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            if epoch == 0 and i == 3:
                break  # the batch drawn here is never trained on
            loop.step(batch)


def _eval_draw(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs - 1):
        for batch in loader:
            loop.step(batch)
        with torch.no_grad():  # "a quick look at the training loss" on a private batch
            next(iter(loader))


def _early_stop(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        for batch in loader:
            loop.step(batch)
            if len(loop.released) == 7:
                return


def _noise_schedule(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        if epoch == 1:
            loop.optimizer.noise_multiplier = 2.0 * SIGMA
        for batch in loader:
            loop.step(batch)


def _batch_memory_manager(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4,
                                optimizer=loop.optimizer) as physical:
            for batch in physical:
                loop.backward(batch)
                loop.step()
                loop.optimizer.zero_grad()


def _double_step(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            loop.step(batch)
            if epoch == 1 and i == 0:
                loop.step(batch)  # a second noisy step on the same batch


def _rewrap(loop, engine, loader, scheme, epochs, workers):
    for batch in loader:
        loop.step(batch)
    engine2, model2, optimizer2, loader2 = _private(scheme, loop.model, loop.optimizer,
                                                   workers=workers)
    loop.model, loop.optimizer = model2, optimizer2
    for batch in loader2:
        loop.step(batch)
    # both engines must refuse to print an epsilon of half the training
    engine2.accountant.get_epsilon(DELTA, discretization=D)


def _stale_reload(loop, engine, loader, scheme, epochs, workers):
    saved = None
    for _ in range(epochs):
        for batch in loader:
            loop.step(batch)
            if len(loop.released) == 3:
                saved = copy.deepcopy(engine.accountant.state_dict())
    engine.accountant.load_state_dict(saved)


def _resume(with_ledger: bool) -> Callable:
    def shape(loop, engine, loader, scheme, epochs, workers):
        steps_per_epoch = len(loader)
        done = 0
        while done < 4:
            for batch in loader:
                loop.step(batch)
                done += 1
                if done == 4:
                    break
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/ckpt.pt"
            engine.save_checkpoint(path=path, module=loop.model, optimizer=loop.optimizer)
            model, optimizer = _fresh_model(scheme)
            engine2, model, optimizer, loader2 = _private(scheme, model, optimizer,
                                                          workers=workers)
            if with_ledger:
                engine2.load_checkpoint(path=path, module=model, optimizer=optimizer)
            else:  # an old-format state: Opacus' history only, no ledger / sampler
                state = torch.load(path, weights_only=False)
                model.load_state_dict(state["module_state_dict"])
                acc_state = dict(state["privacy_accountant_state_dict"])
                acc_state.pop("ledger", None)
                engine2.accountant.load_state_dict(acc_state)
        loop.model, loop.optimizer = model, optimizer
        remaining = epochs * steps_per_epoch - 4
        while remaining > 0:
            for batch in loader2:
                loop.step(batch)
                remaining -= 1
                if remaining == 0:
                    break
        engine.accountant = engine2.accountant  # what the resumed run prints
    return shape


def _other_loader(loop, engine, loader, scheme, epochs, workers):
    if isinstance(scheme, str):  # windows: the scheme's sampler, but another one (other stream)
        data = _structured_data()
        other = engine.accountant.scheme.sampler(list(data.lengths), seed=SEED + 1)
        plain = DataLoader(data, batch_sampler=other, collate_fn=data.collate)
    else:
        plain = DataLoader(_data(), batch_size=B, shuffle=True)
    for _ in range(epochs):
        for batch in plain:  # the original loader, not the one make_private returned
            loop.step(batch)


def _detached_step(loop, engine, loader, scheme, epochs, workers):
    for batch in loader:
        loop.step(batch)
    for batch in loader:  # "fine-tune the head without DP" on private data
        loop.optimizer.zero_grad()
        loop.backward(batch)
        loop._accumulated, loop._parts = [], []
        for p in loop.model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        loop.optimizer.original_optimizer.step()


_SHAPES = {
    "plain": _plain, "skip2": _skip(2, 1), "skip3": _skip(3, 1), "break": _break,
    "eval_draw": _eval_draw, "early_stop": _early_stop, "noise_schedule": _noise_schedule,
    "batch_memory_manager": _batch_memory_manager, "double_step": _double_step,
    "accumulate": accumulate_shape(2, skip=False), "rewrap": _rewrap, "stale_reload": _stale_reload,
    "resume_checkpoint": _resume(True), "resume_history_only": _resume(False),
    "other_loader": _other_loader, "detached_step": _detached_step, **ROW_SHAPES,
}


# ---- the oracle ----------------------------------------------------------------------------
def reference_stream(scheme, draws: int) -> list:
    """The first ``draws`` batches of the scheme's sampler at the test's seed, as sorted index
    tuples (regenerated independently of the run)."""
    extra = {"pad": False} if isinstance(scheme, TruncatedPoissonScheme) else {}
    data = list(_structured_data().lengths) if scheme.name == "structured" else N
    sampler = scheme.sampler(data, generator=torch.Generator().manual_seed(SEED), **extra)
    out: list = []
    while len(out) < draws:
        before = len(out)
        try:
            for batch in sampler:
                out.append(tuple(sorted(batch)))
                if len(out) == draws:
                    break
        except RuntimeError:  # a planned run's sampler is exhausted
            break
        if len(out) == before:  # pragma: no cover - an empty sampler
            break
    return out


def match_positions(released: list, stream: list) -> Optional[list]:
    """Positions of the released batches in ``stream``, matched in order, each draw at most
    once; ``None`` if some released batch is not a later draw of the stream."""
    positions, at = [], 0
    for batch in released:
        while at < len(stream) and stream[at] != batch:
            at += 1
        if at == len(stream):
            return None
        positions.append(at)
        at += 1
    return positions


_PRICED: dict = {}


def _scheme_epsilon(scheme, sigma: float, steps: int) -> float:
    key = (repr(scheme), sigma, steps)
    if key not in _PRICED:
        _PRICED[key] = scheme.epsilon(sigma, steps, DELTA, discretization=D)
    return _PRICED[key]


def _deterministic_positions(scheme, released: list) -> Optional[list]:
    """Stream positions of windows batches under a deterministic top level, read off the
    batches themselves: step ``p`` of an epoch takes series ``p·s .. p·s + s − 1``, so a batch
    whose step does not follow the previous one's starts a new epoch (a ``break`` abandons an
    epoch and the sampler starts the next at step 0)."""
    per_epoch = scheme.steps_per_epoch()
    per_step = NUM_SERIES // per_epoch
    positions, epoch, last = [], 0, -1
    for batch in released:
        series = {s for s, _ in batch}
        if not series:
            return None
        p = min(series) // per_step
        if p <= last:
            epoch += 1
        positions.append(epoch * per_epoch + p)
        last = p
    return positions


@functools.lru_cache(maxsize=None)
def _poisson_dp_accounting(q: float, sigma: float, steps: int) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=D)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


def _release_structure(out: Outcome) -> list:
    """Per release, the list of ``(batch keys, rows per example)`` it summed; a release whose
    parts are slices of one batch (``BatchMemoryManager``'s physical batches) is one part."""
    if out.parts is None:
        return [[(b, 1)] for b in out.released]
    return [list(p) if p else [(b, 1)] for b, p in zip(out.released, out.parts, strict=True)]


def _match_parts(structure: list, stream: list) -> Optional[list]:
    """Per release, the stream positions of its parts (each a later unused draw, in order),
    trying first the union of its parts as one draw; ``None`` if some part is no draw."""
    positions, at = [], 0
    for parts in structure:
        union = tuple(sorted(k for keys, _ in parts for k in keys))
        found = None
        for candidate in ([union], [keys for keys, _ in parts]):
            trial, pos = [], at
            for keys in candidate:
                while pos < len(stream) and stream[pos] != keys:
                    pos += 1
                if pos == len(stream):
                    break
                trial.append(pos)
                pos += 1
            else:
                found = (trial, pos)
                break
        if found is None:
            return None
        positions.append(found[0])
        at = found[1]
    return positions


@functools.lru_cache(maxsize=None)
def _poisson_mixture_lower(q: float, sigma: float, releases: tuple) -> float:
    """dp_accounting's optimistic PLD (a lower bound of the true ε) of Poisson releases, each
    summing parts ``(k, …)``: an example's rows in a release are ``Σ_i k_i·Bernoulli(q)``
    (independent draws), a mixture of Gaussians against ``N(0, σ²)``."""
    from dp_accounting.pld import privacy_loss_distribution as pld_mod

    total = None
    for ks, count in releases:
        dist = {0: 1.0}
        for k in ks:
            nxt: dict = {}
            for shift, p in dist.items():
                nxt[shift] = nxt.get(shift, 0.0) + p * (1 - q)
                nxt[shift + k] = nxt.get(shift + k, 0.0) + p * q
            dist = nxt
        # optimistic at a coarse grid: still a lower bound, and fast
        one = pld_mod.from_mixture_gaussian_mechanism(
            sigma, [float(x) for x in dist], list(dist.values()), pessimistic_estimate=False,
            value_discretization_interval=1e-2, use_connect_dots=False)
        part = one.self_compose(count)
        total = part if total is None else total.compose(part)
    return float(total.get_epsilon_for_delta(DELTA))


def _grouped(structure: list) -> tuple:
    counts: dict = {}
    for parts in structure:
        ks = tuple(sorted(k for _, k in parts))
        counts[ks] = counts.get(ks, 0) + 1
    return tuple(sorted(counts.items()))


def oracle(scheme_name: str, out: Outcome) -> Optional[float]:
    """The independent ε of the pattern that ran (module docstring), or ``None`` if the
    pattern is not one the scheme describes (then only an error is acceptable). A release
    that sums ``K`` draws, or ``k`` rows of each example, is priced by its exact mechanism
    for Poisson (a Gaussian mixture, dp_accounting's optimistic PLD), by the scheme at
    ``σ/k`` for ``k`` rows per example, and for ``K`` draws of other schemes at least as one
    draw (the merged release reveals at least what one of its draws does)."""
    scheme = out.scheme
    released = out.released
    if not released:
        return 0.0
    sigma = max(out.sigmas)  # a lower bound of the true ε when σ varied
    structure = _release_structure(out)
    k_max = max(k for parts in structure for _, k in parts)
    merged = any(len(parts) > 1 for parts in structure)
    policy = scheme.release_policy
    if isinstance(scheme, GDPScheme):
        return _scheme_epsilon(scheme, sigma / k_max, len(released) * (2 if merged else 1))
    if out.shape in MUST_RAISE:
        return None
    if out.stock and isinstance(scheme, ShuffleScheme):
        # at least this many permutations were used: a new one starts at the first batch
        # holding an example already released in the current one
        permutations, seen = 1, set()
        for parts in structure:
            batch = {k for keys, _ in parts for k in keys}
            if seen & batch:
                permutations, seen = permutations + 1, set()
            seen |= batch
        return _scheme_epsilon(scheme, sigma / k_max, permutations * scheme.steps_per_epoch())
    if out.stock:  # Poisson at the loader's rate; a batch released twice is not Poisson
        if len(set(released)) < len(released):
            return None
        value = _scheme_epsilon(scheme, sigma / k_max, len(released))
        return max(value, _poisson_mixture_lower(scheme.sample_rate, sigma, _grouped(structure)))
    stream = reference_stream(scheme, 4 * EPOCHS * (N // B) + 8)
    positions = _match_parts(structure, stream)
    if positions is None and getattr(scheme, "top_level", None) == "deterministic" \
            and not merged:
        flat = _deterministic_positions(scheme, released)
        positions = None if flat is None else [[p] for p in flat]
    if positions is None:
        return None
    if len(positions) > 1 or any(len(p) > 1 for p in positions):
        structure = [parts if len(pos) == len(parts) else [(None, max(k for _, k in parts))]
                     for parts, pos in zip(structure, positions, strict=True)]
    merged = any(len(p) > 1 for p in positions)
    if policy == "independent":
        value = _scheme_epsilon(scheme, sigma / k_max, len(released))
        if isinstance(scheme, PoissonScheme):
            value = max(value, _poisson_mixture_lower(scheme.sample_rate, sigma,
                                                      _grouped(structure)))
            if not merged and k_max == 1:
                value = max(value, _poisson_dp_accounting(scheme.sample_rate, sigma,
                                                          len(released)))
        return value
    flat = [p for pos in positions for p in pos]
    if policy == "exact" and (merged or flat != list(range(len(flat)))):
        return None
    span = flat[-1] + 1 if policy == "span" else len(released)
    try:
        scheme.compositions(span)
    except ValueError:
        return None  # beyond the planned run
    return _scheme_epsilon(scheme, sigma / k_max, span)


def judge(scheme_name: str, shape: str, out: Outcome) -> None:
    """Assert the case's verdict: a clear error where the pattern is not priceable (or the
    shape may raise), else an ε at least the oracle's."""
    truth = oracle(scheme_name, out)
    if out.error is not None:
        assert str(out.error), "an error must say what went wrong"
        if truth is None or shape in MAY_RAISE or (scheme_name, shape) in REFUSED_BY_DESIGN:
            return
        if (shape in MERGING or shape in LIGHTNING_MERGING) \
                and out.scheme.release_policy == "exact":
            return  # correlated noise: one draw per noise position (refused, naming the fix)
        if out.stock and (scheme_name, shape) in REFUSED_BY_OPACUS:
            return
        if out.lightning and shape.removeprefix("ghost_") in ROWS_BEYOND_THE_BATCH:
            return  # DPCallback's batches carry no row tokens: undeclared views are refused
        raise AssertionError(f"{scheme_name}/{shape}: refused a priceable run "
                             f"(oracle ε={truth:.4f}): {out.error}")
    if shape in MUST_RAISE and not isinstance(out.scheme, GDPScheme):
        raise AssertionError(f"{scheme_name}/{shape}: printed ε={out.epsilon}; this loop must "
                             f"raise")
    assert truth is not None, (f"{scheme_name}/{shape}: printed ε={out.epsilon} for a run its "
                               f"scheme does not describe (released {len(out.released)} "
                               f"steps); it must raise")
    assert out.epsilon >= truth - 1e-9 * max(1.0, truth), (
        f"{scheme_name}/{shape}: printed ε={out.epsilon:.4f} below the independent pricing "
        f"{truth:.4f} of what ran ({len(out.released)} steps)")
    assert math.isfinite(out.epsilon)


# ---- Opacus' stock path (PrivacyEngine(accountant="poisson"), its DPDataLoader) -----------
STOCK_SHAPES = ("plain", "skip2", "break", "eval_draw", "early_stop", "noise_schedule",
                "batch_memory_manager", "double_step", "other_loader", "detached_step")


def run_stock_case(shape: str, workers: int = 0, accountant: str = "poisson") -> Outcome:
    """A stock Opacus script with our accountant: ``engine.make_private`` builds Opacus' own
    ``DPDataLoader`` (Poisson at q = 1/len(loader)), whose draws the accountant counts. Its
    generator is Opacus' (not seeded here), so the oracle prices the number of releases and a
    batch released twice or not drawn by the loader must raise."""
    model, optimizer = _fresh_model()
    engine = PrivacyEngine(accountant=accountant)
    shuffle = accountant == "shuffle"  # a plain DataLoader(shuffle=True), poisson_sampling=False
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(_data(), batch_size=B, num_workers=workers, shuffle=shuffle),
        noise_multiplier=SIGMA, max_grad_norm=1.0, poisson_sampling=not shuffle)
    scheme = SCHEMES["shuffle"] if shuffle else PoissonScheme(sample_rate=B / N)
    out = Outcome([], [], scheme=scheme, stock=True, shape=shape)
    return _drive(out, engine, _Loop(model, optimizer), loader, None, EPOCHS, workers)
