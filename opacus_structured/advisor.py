r"""Which batching scheme gives the least noise for a setting? (``opacus-structured advise``)

:func:`advise` calibrates the noise multiplier σ of every applicable scheme to the same
``(target_epsilon, delta)`` for the same setting — ``dataset_size`` N examples, expected batch
size B, ``steps`` T optimizer steps (or ``epochs``; an epoch is :math:`k = \mathrm{round}(N/B)`
steps) — and ranks them by one **utility proxy**:

    the root-mean-squared error of the T noisy prefix sums of the averaged clipped gradients,
    per unit clipping norm and per coordinate,
    :math:`\mathrm{RMSE} = \frac{\sigma}{E[|\text{batch}|]}\sqrt{\tfrac{1}{T}\lVert A C^{-1}\rVert_F^2}`,

with :math:`A` the all-ones lower-triangular workload and :math:`C` the noise strategy
(unit column norm). For independent noise (:math:`C = I`) the square root is
:math:`\sqrt{(T+1)/2}` for every scheme, so at equal T the ranking is exactly the ranking by
**the standard deviation of the noise on the averaged update**, :math:`\sigma C/E[|\text{batch}|]`
(column ``noise_std``); for correlated noise (BandMF, random-allocation MF) it is the matrix
mechanism's prefix-sum RMSE (column ``prefix_sum_rmse``), the objective BandMF optimises. Every
row reports both; the rank uses ``prefix_sum_rmse``. Lower is better. It is a proxy: it ignores
what a batch size does to optimisation other than noise (e.g. full batch costs N/B times the
compute per step).

Rows (one per scheme, one per band count for the matrix mechanisms):

* ``poisson`` — Poisson sampling at q = B/N (Opacus' DP-SGD); σ is what
  ``opacus-structured calibrate poisson --sample-rate B/N --steps T`` prints at the same
  discretisation.
* ``truncated-poisson`` — Poisson at q = B/N truncated to ``max_batch_size``; suggested (unless
  given) as the smallest B_max whose ε at Poisson's σ is within 1% of Poisson's ε (a fixed
  memory bound for ~no privacy cost), found by galloping then bisection over integers. The
  table is followed by ε against B_max at Poisson's σ (B_max = ⌈Nq⌉ × 1, 1.25, 1.5, 2 and the
  chosen one; row parameter ``epsilon_by_max_batch_size``): just above the expected batch the
  price of truncation is large.
* ``balls-in-bins`` — k bins reused for ``ceil(T/k)`` epochs (the planned run is priced whole;
  a T that is not a multiple of k is priced as the full last epoch).
* ``shuffle`` — shuffling into k fixed-size batches per epoch has **no sound amplification
  bound** in this package: it is priced without amplification, one participation per epoch
  (μ-GDP with μ = √E/σ, E = ceil(T/k)), which is a valid upper bound but not one of the
  package's samplers (``make_private`` refuses shuffled loaders).
* ``bandmf-cyclic-poisson`` (per ``bands`` b ≤ k) — BandMF, optimal b-banded strategy over T
  steps, cyclic Poisson sampling.
* ``random-allocation-mf`` (per ``bands``) — the same strategy under balls-in-bins (``b = 1``:
  DP-SGD), priced by its Rényi accountant (``method="renyi"``: the faster of its two sound
  bounds; ``"best"`` adds conditional composition, which can only lower ε and is much slower,
  so this row may be slightly pessimistic). Its calibration takes seconds in the issue-41
  setting (N = 60000, B = 256, 10 epochs: ~15 evaluations of ~0.2 s) but grows steeply with
  the band count and the orders it affords; these rows run in child processes sharing
  ``time_budget`` seconds of wall time (default 60) and are skipped, with that reason, when it is
  spent.
* ``bminsep-mc`` (per ``bands``) — BandMF with b-min-sep sampling is priced only by Monte Carlo:
  listed, labelled ``monte-carlo``, never calibrated here and never ranked (certify σ with
  ``opacus-structured bminsep-mc certify``).
* ``gdp`` — full-batch DP-GD for the same T steps (E[batch] = N).

Structured time-series windows are not listed: their neighbouring relation (w-event / w-user
level) is not add/remove of one example, so their ε is not comparable (use
``opacus-structured calibrate structured``).

Every σ comes from a sound (pessimistic) accountant at ``discretization`` (default 1e-3:
this ranks, and a coarser pessimistic discretisation only over-states ε, so the σ shown are
valid, slightly conservative); calibrate the chosen scheme at 1e-4 for training
(``opacus_structured.make_private_with_epsilon`` does).

JSON (``--json``, :meth:`Advice.to_dict`) follows :data:`JSON_SCHEMA`
(``"schema": "opacus-structured/advise/1"``).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import queue as queue_lib
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ._validation import check_int, check_positive
from .accounting import truncated_poisson as tp_lib
from .accounting.calibration import (
    CalibrationError,
    calibrate_noise_multiplier,
    smallest_passing_int,
)
from .accounting.strategies import strategy_coefficients, toeplitz_prefix_sum_loss
from .advisor_results import (  # noqa: F401  (re-exported: the advisor's public results)
    _CURVE_FACTORS,
    _MAX_BATCH_FACTORS,
    DEFAULT_TIME_BUDGET,
    JSON_SCHEMA,
    SCHEMA_ID,
    TRUNCATION_SLACK,
    UTILITY_PROXY,
    Advice,
    AdvisorRow,
    AdvisorSetting,
    _fmt,
)
from .schemes.balls_in_bins import BallsInBinsScheme
from .schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from .schemes.gdp import GDPScheme
from .schemes.poisson import PoissonScheme
from .schemes.random_allocation_mf import RandomAllocationMFScheme
from .schemes.truncated_poisson import TruncatedPoissonScheme

__all__ = ["advise", "Advice", "AdvisorRow", "AdvisorSetting", "suggest_max_batch_size",
           "JSON_SCHEMA", "SCHEMA_ID", "UTILITY_PROXY", "plot_advice"]


# ---- pricing helpers ------------------------------------------------------------------------
def suggest_max_batch_size(dataset_size: int, sample_rate: float, noise_multiplier: float,
                           steps: int, delta: float, *, slack: float = TRUNCATION_SLACK,
                           discretization: float = 1e-3, epoch_steps: Optional[int] = None,
                           poisson_epsilon: Optional[float] = None) -> int:
    """Smallest truncated-Poisson ``max_batch_size`` B_max whose ε at ``noise_multiplier``
    after ``steps`` steps is at most ``(1 + slack)`` times untruncated Poisson's ε there.

    ε is non-increasing in B_max (less truncation); the search gallops up from
    ``ceil(N·q)`` (doubling the excess) and then bisects over integers. Returns N if no smaller
    B_max is within the slack. ``poisson_epsilon``: Poisson's ε at these arguments when the
    caller has priced it already (the advisor's Poisson row).
    """
    n = check_int("dataset_size", dataset_size, minimum=1)
    poisson = (PoissonScheme(sample_rate).epsilon(noise_multiplier, steps, delta,
                                                  discretization=discretization)
               if poisson_epsilon is None else float(poisson_epsilon))
    limit = (1.0 + check_positive("slack", slack)) * poisson

    def ok(b: int) -> bool:
        scheme = TruncatedPoissonScheme(n, sample_rate, b, epoch_steps=epoch_steps)
        return scheme.epsilon(noise_multiplier, steps, delta,
                              discretization=discretization) <= limit

    start = max(1, min(n, math.ceil(n * sample_rate)))
    if ok(start):
        return start
    lo, step = start, 1
    while True:
        hi = min(n, start + step)
        if ok(hi):
            return smallest_passing_int(ok, lo, hi)
        if hi == n:
            return n
        lo, step = hi, step * 2


def _rmse_factor(c: np.ndarray, steps: int) -> float:
    """sqrt(||A C^-1||_F^2 / T) of the Toeplitz strategy with first column ``c`` (unit norm)."""
    return math.sqrt(toeplitz_prefix_sum_loss(np.asarray(c, dtype=float), steps))


@dataclasses.dataclass
class _Job:
    scheme: str
    label: str
    noise: str
    bands: int
    expected_batch_size: float
    epsilon_of: Optional[Callable[[float], float]]   # σ -> ε (None: not calibrated)
    rmse_factor: float
    bound: str = "upper"
    note: str = ""
    parameters: tuple = ()
    isolate: bool = False          # run in a child process under the time budget
    prepare: Optional[Callable[[], tuple]] = None    # -> (note, parameters, E[batch]) updates


def _memoised(epsilon_of: Callable[[float], float]) -> Callable[[float], float]:
    """``epsilon_of`` remembering its answers: the calibration asks one σ twice (the doubling's
    lower end, then the halving's first probe) and the row asks ε at the σ found again; the
    values, hence σ, are unchanged."""
    seen: dict[float, float] = {}

    def ev(sigma: float) -> float:
        if sigma not in seen:
            seen[sigma] = epsilon_of(sigma)
        return seen[sigma]
    return ev


def _calibrate(job: _Job, setting: AdvisorSetting, curves: bool) -> dict:
    """σ, ε at σ, and optionally an (ε, σ, RMSE) curve, for one job (run in-process or in a
    child process)."""
    start = time.perf_counter()
    out: dict[str, Any] = {}
    if job.prepare is not None:
        note, params, ebatch, eps_of = job.prepare()
        out.update(note=note, parameters=params, expected_batch_size=ebatch)
        job.epsilon_of = eps_of
        job.expected_batch_size = ebatch
    eps_of = _memoised(job.epsilon_of)
    try:
        sigma = calibrate_noise_multiplier(eps_of, setting.target_epsilon)
    except CalibrationError as err:
        out.update(error=str(err), seconds=time.perf_counter() - start)
        return out
    out["noise_multiplier"] = sigma
    out["epsilon"] = float(eps_of(sigma))
    if curves:
        pts = []
        for f in _CURVE_FACTORS:
            s = sigma * f
            pts.append((float(eps_of(s)), s,
                        s / job.expected_batch_size * job.rmse_factor))
        out["curve"] = tuple(sorted(pts))
    out["seconds"] = time.perf_counter() - start
    return out


def _child(conn_queue, job: _Job, setting: AdvisorSetting, curves: bool) -> None:
    try:
        conn_queue.put(("ok", _calibrate(job, setting, curves)))
    except Exception as err:  # noqa: BLE001 - reported to the parent as the row's note
        conn_queue.put(("error", f"{type(err).__name__}: {err}"))


def _run_isolated(job: _Job, setting: AdvisorSetting, curves: bool,
                  budget: float) -> dict:
    """:func:`_calibrate` in a forked child process, killed after ``budget`` seconds."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return {"skipped": "needs the 'fork' start method to bound its time on this platform"}
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(q, job, setting, curves), daemon=True)
    start = time.perf_counter()
    proc.start()
    try:
        status, payload = q.get(timeout=budget)
    except queue_lib.Empty:
        status, payload = "timeout", None
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(5)
    if status == "timeout":
        return {"skipped": f"its accountant did not finish within the remaining time budget "
                           f"({budget:.3g} s) (Rényi DP / conditional composition over a "
                           f"{setting.steps_per_epoch}-bin x {setting.epochs}-epoch run); "
                           f"raise --time-budget or price it with `opacus-structured "
                           f"calibrate random-allocation-mf`",
                "seconds": time.perf_counter() - start}
    if status == "error":
        return {"error": payload, "seconds": time.perf_counter() - start}
    return payload


# ---- the table ------------------------------------------------------------------------------
def _jobs(s: AdvisorSetting) -> list[_Job]:
    N, T, q, k, E = s.dataset_size, s.steps, s.sample_rate, s.steps_per_epoch, s.epochs
    d, delta = s.discretization, s.delta
    indep = _rmse_factor([1.0], T)
    jobs: list[_Job] = []

    poisson = PoissonScheme(sample_rate=q)
    poisson_sigma: dict[str, float] = {}
    poisson_seen: dict[float, float] = {}

    def poisson_eps(sg: float) -> float:
        # memoised: the truncated-Poisson row calibrates Poisson again (deterministically, the
        # same σ sequence) and prices Poisson at that σ; both replay the Poisson row's values
        if sg not in poisson_seen:
            poisson_seen[sg] = poisson.epsilon(sg, T, delta, discretization=d)
        return poisson_seen[sg]

    jobs.append(_Job("poisson", "poisson", "independent", 1, N * q, poisson_eps, indep,
                     bound=poisson.bound.value, note="q = B/N (Opacus' DP-SGD)",
                     parameters=(("sample_rate", q),)))

    def prepare_truncated():
        if s.max_batch_size is not None:
            bmax, how = s.max_batch_size, "given"
        else:
            if "sigma" not in poisson_sigma:  # the Poisson row's σ (same calibration)
                poisson_sigma["sigma"] = calibrate_noise_multiplier(poisson_eps,
                                                                    s.target_epsilon)
            sigma_p = poisson_sigma["sigma"]
            bmax = suggest_max_batch_size(N, q, sigma_p, T, delta, discretization=d,
                                          epoch_steps=k, poisson_epsilon=poisson_eps(sigma_p))
            how = (f"suggested: smallest B_max with epsilon within "
                   f"{TRUNCATION_SLACK:.0%} of Poisson's at Poisson's sigma")
        tps = TruncatedPoissonScheme(N, q, bmax, epoch_steps=k)
        return (f"B_max = {bmax} ({how})",
                (("sample_rate", q), ("max_batch_size", bmax),
                 ("epsilon_by_max_batch_size", _epsilon_by_max_batch_size(bmax))),
                tp_lib.expected_batch_size(N, q, bmax),
                lambda sg: tps.epsilon(sg, T, delta, discretization=d))

    def _epsilon_by_max_batch_size(bmax: int) -> dict:
        """ε against B_max at Poisson's calibrated σ (what a B_max costs): B_max = ceil(Nq)
        times 1, 1.25, 1.5, 2, and the chosen one; ``None`` is untruncated Poisson."""
        if "sigma" not in poisson_sigma:
            poisson_sigma["sigma"] = calibrate_noise_multiplier(poisson_eps, s.target_epsilon)
        sigma_p = poisson_sigma["sigma"]
        base = max(1, math.ceil(N * q - 1e-9))
        sizes = sorted({min(N, max(1, round(base * f))) for f in _MAX_BATCH_FACTORS} | {bmax})
        points = [[b, TruncatedPoissonScheme(N, q, b, epoch_steps=k).epsilon(
            sigma_p, T, delta, discretization=d)] for b in sizes]
        return {"noise_multiplier": sigma_p, "poisson_epsilon": poisson_eps(sigma_p),
                "points": points}

    jobs.append(_Job("truncated-poisson", "truncated-poisson", "independent", 1, N * q, None,
                     indep, prepare=prepare_truncated))

    bib = BallsInBinsScheme(num_bins=k, epochs=E)
    planned = "" if E * k == T else f"; priced as the planned {E} epochs ({E * k} steps)"
    jobs.append(_Job("balls-in-bins", "balls-in-bins", "independent", 1, N / k,
                     lambda sg: bib.epsilon(sg, T, delta, discretization=d), indep,
                     note=f"{k} bins reused for {E} epochs{planned}",
                     parameters=(("num_bins", k), ("epochs", E))))

    gdp = GDPScheme()
    jobs.append(_Job("shuffle", "shuffle (no amplification)", "independent", 1, N / k,
                     lambda sg: gdp.epsilon(sg, E, delta, discretization=d), indep,
                     note=(f"no sound amplification bound for shuffling: priced as one "
                           f"participation per epoch (GDP, mu = sqrt({E})/sigma); no sampler "
                           f"in this package"),
                     parameters=(("epochs", E),)))

    for b in s.bands:
        if b > k:
            jobs.append(_Job("bandmf-cyclic-poisson", f"bandmf-cyclic-poisson (b={b})",
                             "correlated", b, N / k, None, 0.0,
                             note=f"skipped: bands={b} > k={k} steps per epoch (b*B <= N)"))
            continue
        cyc = BandMFCyclicPoissonScheme(dataset_size=N, batch_size=N / k, bands=b)
        c = strategy_coefficients("optimal-banded", max(T, b), b)
        jobs.append(_Job("bandmf-cyclic-poisson", f"bandmf-cyclic-poisson (b={b})",
                         "correlated" if b > 1 else "independent", b, N / k,
                         lambda sg, cyc=cyc: cyc.epsilon(sg, T, delta, discretization=d),
                         _rmse_factor(c, T), note=f"optimal {b}-banded C over {T} steps",
                         parameters=(("bands", b), ("batch_size", N / k),
                                     ("strategy", "optimal-banded"))))
    for b in s.bands:
        if b > E * k:
            continue
        strat = "identity" if b == 1 else "bandmf"
        ra = RandomAllocationMFScheme(strategy=strat, bands=b, epochs=E, batches_per_epoch=k,
                                      method="renyi")
        c = [1.0] if b == 1 else strategy_coefficients("optimal-banded", E * k, b)
        jobs.append(_Job("random-allocation-mf", f"random-allocation-mf (b={b})",
                         "correlated" if b > 1 else "independent", b, N / k,
                         lambda sg, ra=ra: ra.epsilon(sg, T, delta, discretization=d),
                         _rmse_factor(c, T), isolate=True,
                         note=f"{strat} C, {k} bins x {E} epochs{planned}; Rényi accountant",
                         parameters=(("strategy", strat), ("bands", b), ("epochs", E),
                                     ("batches_per_epoch", k), ("method", "renyi"))))
    for b in s.bands:
        jobs.append(_Job("bminsep-mc", f"bminsep-mc (b={b})", "correlated" if b > 1
                         else "independent", b, N * q, None, 0.0, bound="monte-carlo",
                         note=("Monte Carlo estimate only: not calibrated, not ranked; "
                               "certify sigma with `opacus-structured bminsep-mc certify`"),
                         parameters=(("bands", b), ("batch_size", N * q))
                         + ((("horizon", T),) if b > 1 else ())))

    jobs.append(_Job("gdp", "gdp (full batch)", "independent", 1, float(N),
                     lambda sg: gdp.epsilon(sg, T, delta, discretization=d), indep,
                     bound=gdp.bound.value,
                     note=f"every example every step, same T: {N / s.batch_size:.3g}x the "
                          f"compute per step"))
    return jobs


def advise(*, dataset_size: int, batch_size: float, target_epsilon: float, delta: float,
           steps: Optional[int] = None, epochs: Optional[float] = None,
           bands: Sequence[int] = (), max_batch_size: Optional[int] = None,
           discretization: float = 1e-3, time_budget: float = DEFAULT_TIME_BUDGET,
           curves: bool = False, progress: bool = False) -> Advice:
    """Calibrate σ for every applicable scheme in one setting and rank them (module docstring).

    Args:
        dataset_size: N examples. batch_size: expected batch size B in (0, N].
        target_epsilon, delta: the privacy budget every scheme is calibrated to.
        steps: T optimizer steps; or ``epochs`` (T = ceil(epochs·k), k = round(N/B)).
        bands: band counts of the matrix-mechanism rows (none: no such rows).
        max_batch_size: truncated Poisson's B_max (default: suggested, see
            :func:`suggest_max_batch_size`).
        discretization: pessimistic discretisation of every accountant (1e-3: ranking).
        time_budget: seconds shared by the random-allocation-MF rows (each runs in a child
            process, killed when the budget is spent; later rows are then skipped).
        curves: also compute (ε, σ, RMSE) points around each σ (for :func:`plot_advice`).
        progress: show a tqdm progress bar on stderr.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps and epochs")
    n = check_int("dataset_size", dataset_size, minimum=1)
    b = check_positive("batch_size", batch_size)
    if steps is None:
        e = check_positive("epochs", epochs)
        k = max(1, round(n / b)) if b <= n else 1
        x = e * k
        steps = int(round(x)) if abs(x - round(x)) <= 1e-9 * max(1.0, x) else math.ceil(x)
    setting = AdvisorSetting(dataset_size=n, batch_size=b, steps=steps,
                             target_epsilon=target_epsilon, delta=delta, bands=tuple(bands),
                             max_batch_size=max_batch_size, discretization=discretization)
    budget = check_positive("time_budget", time_budget)  # shared by the isolated rows
    started = time.perf_counter()
    timed_out = False
    jobs = _jobs(setting)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), unit="scheme", file=sys.stderr, desc="advise")
    results = []
    for job in jobs:
        if bar is not None:
            bar.set_postfix_str(job.label)
        if job.epsilon_of is None and job.prepare is None:
            res: dict[str, Any] = {}
        elif job.isolate:
            if timed_out or budget <= 0.5:
                res = {"skipped": f"the time budget ({time_budget:g} s, shared by the "
                                  f"random-allocation-mf rows) was spent; raise --time-budget "
                                  f"or price it with `opacus-structured calibrate "
                                  f"random-allocation-mf`"}
            else:
                res = _run_isolated(job, setting, curves, budget)
                budget -= float(res.get("seconds", 0.0))
                timed_out = "skipped" in res
        else:
            try:
                res = _calibrate(job, setting, curves)
            except (ValueError, FloatingPointError) as err:
                res = {"error": f"{type(err).__name__}: {err}"}
        results.append(_row(job, setting, res))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ranked = sorted((r for r in results if r.certified and r.prefix_sum_rmse is not None),
                    key=lambda r: r.prefix_sum_rmse)
    order = {id(r): i + 1 for i, r in enumerate(ranked)}
    rows = [dataclasses.replace(r, rank=order.get(id(r))) for r in results]
    rows.sort(key=lambda r: (r.rank is None, r.rank or 0))
    return Advice(setting=setting, rows=tuple(rows), seconds=time.perf_counter() - started)


def _row(job: _Job, s: AdvisorSetting, res: dict) -> AdvisorRow:
    sigma = res.get("noise_multiplier")
    ebatch = float(res.get("expected_batch_size", job.expected_batch_size))
    note = res.get("note", job.note)
    if "skipped" in res:
        note = f"skipped: {res['skipped']}"
    elif "error" in res:
        note = f"not calibrated: {res['error']}"
    certified = job.bound in ("tight", "upper") and sigma is not None
    return AdvisorRow(
        scheme=job.scheme, label=job.label, noise=job.noise, bound=job.bound,
        certified=certified, bands=job.bands, steps=s.steps, expected_batch_size=ebatch,
        noise_multiplier=sigma, epsilon=res.get("epsilon"),
        noise_std=None if sigma is None else sigma / ebatch,
        prefix_sum_rmse=None if sigma is None else sigma / ebatch * job.rmse_factor,
        rank=None, note=note, seconds=float(res.get("seconds", 0.0)),
        parameters=tuple(res.get("parameters", job.parameters)),
        curve=tuple(res.get("curve", ())))


# ---- plot -----------------------------------------------------------------------------------
def plot_advice(advice: Advice, path: str) -> None:
    """Prefix-sum RMSE (the ranking proxy) against ε for every calibrated scheme, from the
    curves of ``advise(..., curves=True)``; the target ε is a vertical line (needs
    matplotlib)."""
    import matplotlib  # optional: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(r for r in advice.rows if r.curve):
        eps, _, rmse = zip(*r.curve, strict=True)
        # the colour cycle has 10 colours: later rows repeat them, dashed
        ax.plot(eps, rmse, marker="o", ms=3, ls=("-", "--", ":")[(i // 10) % 3], label=r.label)
    s = advice.setting
    ax.axvline(s.target_epsilon, color="k", ls="--", lw=0.8)
    ax.set_xlabel(f"epsilon (delta = {s.delta:g})")
    ax.set_ylabel("prefix-sum RMSE per unit clip (lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"N = {s.dataset_size}, B = {s.batch_size:g}, T = {s.steps}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
