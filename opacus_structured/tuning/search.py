r"""Private hyperparameter selection over a candidate space: :class:`PrivateSelection`.

The procedure of Papernot & Steinke (ICLR 2022), which :func:`~opacus_structured.tuning.
selection_epsilon` prices:

1. draw the number of trials :math:`K` *secretly* (OS entropy) from the chosen law
   (truncated negative binomial of shape ``eta``, or Poisson for ``eta=None``);
2. run :math:`K` trials; each picks a candidate **uniformly at random, with replacement**
   (what the theorem covers: the trials are i.i.d. runs of one randomized mechanism), trains
   it and scores it privately (``train_and_score(config) -> (score, trial)``);
3. release only the best (configuration, score): the highest score (``maximize=True``) or the
   lowest (``maximize=False``, a loss), ties broken by the candidate's index, so the outputs
   are totally ordered as the theorem assumes.

Every trial must be the same base mechanism (same privacy parameters): the first trial's
:func:`~opacus_structured.tuning.pricing.trial_signature` is kept and every later one is
checked against it (or against ``expected_trial`` when given).

**What may be published**: the winner's configuration, its private score and the ε of the
whole search (:attr:`SelectionResult.epsilon`). :math:`K` and the other trials' scores are for
the operator only: releasing them voids the theorem (given :math:`K` the output is the best of
a known number of runs). So :math:`K` appears nowhere but in the search's own state
(:meth:`PrivateSelection.state_dict`, the checkpoint): not in the result, not in a ``repr``,
and the progress shows the elapsed time and the budget, never a count of trials (a bar that
counts trials ends at :math:`K`; issue 47). The search's duration still grows with :math:`K`:
logs with timestamps stay with the operator too.

**Checkpointing**: :meth:`PrivateSelection.state_dict` holds :math:`K`, the trials done and
their results; :meth:`PrivateSelection.load_state_dict` (or ``checkpoint=path``, saved after
each trial) resumes without drawing :math:`K` again. The checkpoint file holds :math:`K`: keep
it private.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import pickle
import secrets
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

from .. import _progress
from .._validation import check_open_unit
from ..accounting import private_selection as ps
from .budget import selection_rdp
from .pricing import selection_epsilon, trial_signature

__all__ = ["PrivateSelection", "SelectionResult", "draw_num_trials", "candidate_list"]

_STATE_VERSION = 1


def _secret_rng() -> np.random.Generator:
    return np.random.default_rng(secrets.randbits(128))


def draw_num_trials(mean_trials: float, eta: Optional[float],
                    rng: Optional[np.random.Generator] = None) -> int:
    r"""One draw of :math:`K`. Poisson(:math:`\mu`) for ``eta=None`` (may be 0: then nothing
    is released); otherwise the truncated negative binomial on :math:`\{1, 2, \dots\}`,
    :math:`P[K=k] \propto \binom{k+\eta-1}{k}(1-\gamma)^k` (logarithmic
    :math:`\propto (1-\gamma)^k/k` at :math:`\eta=0`), by inverse CDF with the ratio
    :math:`p_k/p_{k-1} = (1-\gamma)(k+\eta-1)/k`. ``rng`` defaults to OS entropy."""
    mean_trials, eta = ps.check_mean_trials(mean_trials), ps.check_eta(eta)
    rng = _secret_rng() if rng is None else rng
    if eta is None:
        return int(rng.poisson(mean_trials))
    gamma = ps.tnb_gamma(mean_trials, eta)
    if gamma >= 1:
        return 1
    if eta == 0:
        p = (1 - gamma) / -math.log(gamma)
    else:
        p = eta * (1 - gamma) / math.expm1(-eta * math.log(gamma))
    u, k, cum = rng.random(), 1, p
    while cum < u and p > 0:
        k += 1
        p *= (1 - gamma) * (k + eta - 1) / k
        cum += p
    return k


def candidate_list(candidates) -> Optional[list]:
    """A list of configurations from a list/tuple, or a grid dict (``{name: [values]}`` →
    every combination, as dicts); ``None`` for a callable sampler."""
    if callable(candidates):
        return None
    if isinstance(candidates, dict):
        names = list(candidates)
        for name in names:
            values = candidates[name]
            if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
                raise ValueError(f"candidates[{name!r}] must be a list of values, got "
                                 f"{values!r}")
        grid = [dict(zip(names, combo, strict=True))
                for combo in itertools.product(*(list(candidates[n]) for n in names))]
        if not grid:
            raise ValueError("candidates: the grid is empty (a parameter has no value)")
        return grid
    if isinstance(candidates, (list, tuple)):
        if not candidates:
            raise ValueError("candidates must not be empty")
        return list(candidates)
    raise ValueError(f"candidates must be a list of configurations, a grid dict or a callable "
                     f"sampler(rng) -> config; got {type(candidates).__name__}")


@dataclasses.dataclass(frozen=True)
class SelectionResult:
    """Outcome of a private selection.

    ``config`` / ``score``: the winner and its private score (``None`` when the Poisson law
    drew :math:`K = 0`: nothing is released). ``epsilon``: the ε at ``delta`` of the *whole*
    search, the one to report. The result does not hold :math:`K` (module docstring): only
    the search's own state does (``PrivateSelection.state_dict()["num_trials"]``).
    """

    config: Any
    score: Optional[float]
    epsilon: float
    delta: float
    mean_trials: float
    eta: Optional[float]
    candidate_index: Optional[int]
    #: what the winning trial returned as its third element (e.g. the trained model), kept in
    #: memory only: ``None`` when ``train_and_score`` returns pairs, or when the winner ran
    #: before a checkpoint was resumed
    output: Any = None

    @property
    def law(self) -> str:
        return ps.law_name(self.eta)

    def __str__(self) -> str:
        return (f"winner {self.config!r} (private score {self.score}); epsilon of the whole "
                f"search = {self.epsilon:.4g} at delta = {self.delta:g} "
                f"({self.law} law, mean {self.mean_trials:g} trials)")


class PrivateSelection:
    r"""Private selection (Papernot & Steinke 2022) over ``candidates``.

    Args:
        candidates: a list of configurations, a grid dict ``{name: [values, ...]}`` (every
            combination), or a callable ``sampler(rng) -> config`` (``rng`` a numpy
            ``Generator``).
        train_and_score: ``config -> (score, trial)``: one DP training run and its *private*
            score (e.g. :func:`~opacus_structured.tuning.private_score`), and the trial's cost
            (a ``DpEvent``, our accountant, or a :class:`~opacus_structured.tuning.TrialCost`)
            including the score's release. It may return ``(score, trial, output)``: the
            winner's ``output`` (e.g. its trained model) comes back as
            :attr:`SelectionResult.output` (only the best so far is kept, in memory).
        mean_trials: :math:`\mathbb E[K] \ge 1`.
        eta: shape of the truncated negative binomial (> -1; 0 logarithmic, 1 geometric), or
            ``None`` for the Poisson law.
        delta: δ of the reported ε, in (0, 1).
        maximize: ``True`` if a higher score is better (accuracy), ``False`` for a loss.
        expected_trial: the trial every run must equal; needed for the Poisson law (which
            may draw :math:`K = 0`, so no trial may run), optional otherwise.
        checkpoint: a file path: the state is saved there after every trial and loaded at
            construction if it exists (a resumed search keeps its :math:`K`). It is a pickle
            (configurations may be any object): load only your own checkpoints.
        progress: ``True``/``False`` to force progress output; default a tqdm bar on a
            terminal and plain lines (at most every ~10 s) otherwise.
        rng: a numpy ``Generator`` for tests only (:math:`K` must be secret: the default
            draws from OS entropy).
        pricing: keyword arguments of :func:`selection_epsilon` (``orders``,
            ``discretization``).
        budget: a :class:`~opacus_structured.dataset_budget.DatasetBudget`: the *whole*
            search is charged to the dataset's budget once, as one mechanism
            (:mod:`~opacus_structured.tuning.budget`: never per trial, which would count
            :math:`K`), before any trial runs when ``expected_trial`` is given, else right
            after the first trial (whose output is then withheld if the budget refuses);
            :class:`~opacus_structured.dataset_budget.BudgetExhaustedError` when it does not
            fit. The trials must not charge the budget themselves.
    """

    def __init__(self, candidates, train_and_score: Callable[[Any], tuple], *,
                 mean_trials: float, eta: Optional[float] = 1.0, delta: float,
                 maximize: bool = False, expected_trial=None,
                 checkpoint: Optional[str | os.PathLike] = None,
                 progress: Optional[bool] = None, rng: Optional[np.random.Generator] = None,
                 budget=None, **pricing):
        self.mean_trials = ps.check_mean_trials(mean_trials)
        self.eta = ps.check_eta(eta)
        self.delta = check_open_unit("delta", delta)
        if not callable(train_and_score):
            raise ValueError("train_and_score must be a callable config -> (score, trial)")
        self.candidates = candidates
        self._list = candidate_list(candidates)
        self.train_and_score = train_and_score
        self.maximize = bool(maximize)
        self.pricing = pricing
        self._rng = _secret_rng() if rng is None else rng
        self._signature = None if expected_trial is None else trial_signature(expected_trial)
        self._epsilon = None if expected_trial is None else self._price(expected_trial)
        if self.eta is None and expected_trial is None:
            raise ValueError("eta=None (the Poisson law) can draw K = 0 trials: pass "
                             "expected_trial= (the trial every run will be) so the search's "
                             "epsilon is known before any trial runs")
        self._progress = progress
        self.budget, self._budget_run = budget, f"selection-{secrets.token_hex(6)}"
        self._expected, self._first_trial = expected_trial, None  # what the budget prices
        self._k: Optional[int] = None
        self._results: list[tuple[int, Any, float]] = []
        self._output: Optional[tuple[int, Any]] = None  # (position, output) of the best
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        if self.checkpoint is not None and os.path.exists(self.checkpoint):
            with open(self.checkpoint, "rb") as f:
                self.load_state_dict(pickle.load(f))
        if self._k is None:
            self._k = draw_num_trials(self.mean_trials, self.eta, self._rng)

    # ---- pricing ----------------------------------------------------------------------
    def _price(self, trial) -> float:
        return selection_epsilon(trial, mean_trials=self.mean_trials, eta=self.eta,
                                 delta=self.delta, **self.pricing)

    @property
    def epsilon(self) -> Optional[float]:
        """ε of the whole search (known once the trial is: ``expected_trial`` or the first
        trial run)."""
        return self._epsilon

    @property
    def trials_done(self) -> int:
        """Trials run so far: :math:`K` once :meth:`run` returned (operator only)."""
        return len(self._results)

    def __repr__(self) -> str:  # never shows K, nor the trials done (K once the search ran)
        return (f"PrivateSelection(law={ps.law_name(self.eta)!r}, mean_trials="
                f"{self.mean_trials:g}, delta={self.delta:g})")

    # ---- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """:math:`K`, the trials done and their results (keep it private: it holds K)."""
        return {"version": _STATE_VERSION, "num_trials": self._k,
                "results": [list(r) for r in self._results], "signature": self._signature,
                "epsilon": self._epsilon, "mean_trials": self.mean_trials, "eta": self.eta,
                "delta": self.delta, "maximize": self.maximize,
                "candidates": None if self._list is None else repr(self._list),
                "budget_run": self._budget_run}

    def load_state_dict(self, state: dict) -> None:
        """Resume: keep the saved :math:`K` and results; raises if the search differs."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}")
        for key in ("mean_trials", "eta", "delta", "maximize"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved search has {key}={state[key]!r}, this one "
                                 f"{getattr(self, key)!r}: resume with the same settings")
        saved_candidates = state.get("candidates")
        if self._list is not None and saved_candidates != repr(self._list):
            raise ValueError("the saved search ran over other candidates: resume with the same "
                             "candidate space")
        if (self._signature is not None and state.get("signature") is not None
                and state["signature"] != self._signature):
            raise ValueError("the saved search's trials differ from expected_trial")
        self._k = int(state["num_trials"])
        self._budget_run = state.get("budget_run", self._budget_run)
        self._results = [(int(i), c, float(s)) for i, c, s in state["results"]]
        self._signature = state.get("signature") or self._signature
        self._epsilon = state.get("epsilon") if self._epsilon is None else self._epsilon

    def _save(self) -> None:
        if self.checkpoint is None:
            return
        tmp = f"{self.checkpoint}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self.state_dict(), f)
        os.replace(tmp, self.checkpoint)

    # ---- running ----------------------------------------------------------------------
    def _draw_candidate(self) -> tuple[int, Any]:
        if self._list is None:
            return -1, self.candidates(self._rng)
        index = int(self._rng.integers(len(self._list)))
        return index, self._list[index]

    def _check_trial(self, trial) -> None:
        self._first_trial = trial if self._first_trial is None else self._first_trial
        signature = trial_signature(trial)
        if self._signature is None:
            self._signature = signature
        elif signature != self._signature:
            raise ValueError(
                f"a trial has other privacy parameters than the first "
                f"(or expected_trial): {signature} != {self._signature}. Private selection "
                f"needs every trial to be the same mechanism: same noise, sampling, steps and "
                f"score noise for every candidate")
        if self._epsilon is None:
            self._epsilon = self._price(trial)

    def _run_one(self) -> None:
        index, config = self._draw_candidate()
        out = self.train_and_score(config)
        if not (isinstance(out, tuple) and len(out) in (2, 3)):
            raise ValueError("train_and_score must return (score, trial) or "
                             "(score, trial, output)")
        score, trial = out[:2]
        score = float(score)
        if not math.isfinite(score):
            raise ValueError(f"train_and_score returned a non-finite score {score!r}")
        self._check_trial(trial)
        best = self._best()
        self._results.append((index, config, score))
        if len(out) == 3 and (best is None or self._key((index, config, score)) <
                              self._key(best)):
            self._output = (len(self._results) - 1, out[2])
        self._save()

    def _key(self, result: tuple[int, Any, float]) -> tuple[float, int]:
        return ((-1.0 if self.maximize else 1.0) * result[2], result[0])

    def _best_position(self) -> Optional[int]:
        if not self._results:
            return None
        return min(range(len(self._results)), key=lambda i: self._key(self._results[i]))

    def _best(self) -> Optional[tuple[int, Any, float]]:
        pos = self._best_position()
        return None if pos is None else self._results[pos]

    def run(self) -> SelectionResult:
        """Run the remaining trials (resuming a checkpoint) and return the winner.

        The progress (a bar on a terminal, else a plain line at most every ~10 s) shows the
        elapsed time and the search's budget, never how many trials ran (module docstring)."""
        show_bar = _progress.enabled(self._progress is False)
        plain = self._progress is not False and not show_bar
        start = time.monotonic()
        last = start - 10.0  # the first trial prints a line
        self._charge_budget()  # before any trial when the trial is known up front
        with _progress.elapsed("private selection", show=show_bar) as bar:
            while self.trials_done < self._k:
                self._run_one()
                self._charge_budget()
                note = self._progress_note()
                bar.set_description_str(f"private selection ({note})", refresh=False)
                if plain and time.monotonic() - last >= 10.0:
                    print(f"private selection: running, "
                          f"{_progress.format_seconds(time.monotonic() - start)} elapsed; "
                          f"{note}", file=sys.stderr, flush=True)
                    last = time.monotonic()
        best = self._best()
        position = self._best_position()
        output = (self._output[1] if self._output is not None
                  and self._output[0] == position else None)
        epsilon = self._epsilon
        if epsilon is None:  # K = 0 under Poisson needs expected_trial, checked at init
            raise RuntimeError("no trial ran and no expected_trial prices the search")
        return SelectionResult(
            config=None if best is None else best[1], score=None if best is None else best[2],
            epsilon=float(epsilon), delta=self.delta, mean_trials=self.mean_trials,
            eta=self.eta, candidate_index=None if best is None or best[0] < 0 else best[0], output=output)

    def _charge_budget(self) -> None:
        """Charge the whole search to :attr:`budget` once (its run id is in the state, so a
        resumed search is not charged twice); a no-op without a budget or before the trial
        is known."""
        if self.budget is None or (self._expected is None and self._first_trial is None):
            return
        if self.budget.last_record(self._budget_run, kind="charge") is not None:
            return
        trial = self._expected if self._expected is not None else self._first_trial
        curve, tail = selection_rdp(trial, self.budget.orders, mean_trials=self.mean_trials,
                                    eta=self.eta)
        self.budget.charge(self._budget_run, rdp=curve, tail_mass=tail,
                           what="private selection (one mechanism: the best of a secret "
                                "number of trials)", law=ps.law_name(self.eta),
                           mean_trials=self.mean_trials, epsilon_alone=self._epsilon)

    def _progress_note(self) -> str:
        eps = "?" if self._epsilon is None else f"{self._epsilon:.3g}"
        return f"budget: epsilon={eps} at delta={self.delta:g} for the whole search"
