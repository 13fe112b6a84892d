r"""DP-SGD training of gluonts forecasters with structured subsampling (Schuchardt et al., ICML 2025).

One optimizer step (Algorithm 1 with Algorithms 5 + 4 + 2 of the paper, λ = 1):

1. the structured sampler draws ``N' = Λ`` series without replacement (fresh every step) and
   one window start per drawn series, uniform over the ``T_n = L_n − L_F + 1`` split points of
   the series with ``L_C`` zeros prepended;
2. :class:`~opacus_structured.forecasting.windowing.GluonTSWindowDataset` cuts exactly those
   windows with the estimator's own ``InstanceSplitter`` (context ``L_C`` = the model's
   ``past_length``, lags included; forecast ``L_F``);
3. DP-SGD is wired in by :class:`~lightning_callbacks.DPCallback`, the one wiring every path
   shares: it verifies the loader's sampler against the scheme, Opacus' ``GradSampleHooks``
   compute one gradient per window, a stock Opacus ``DPOptimizer`` clips each to norm ``C``,
   adds ``N(0, σ²C²I)`` to the sum and divides by ``Λ`` (``expected_batch_size``); Adam then
   takes the step;
4. the structured-subsampling accountant (Theorem 4.4 of the paper: per step
   ``P = (1 − ρr)·N(0, σ) + ρr·N(2, σ)`` vs ``N(0, σ)``, ``ρ = Λ/N``,
   ``r = (L_C + L_F)/(L − L_F + 1)``, ``L`` the shortest training series) records the step
   through the optimizer's step hook.

``σ`` is calibrated up front so that the planned number of steps spends at most the target
``ε`` at ``δ`` (like Opacus' ``make_private_with_epsilon``); with a fixed ``σ`` training stops
before the step that would exceed the budget. The model input window and the accountant's
``L_C``/``L_F`` are taken from the same splitter and checked against each other
(:func:`check_window_matches_scheme`), so they cannot disagree.

Randomness. The *privacy coins* — the structured sampler's draws and the Gaussian noise — come
from OS entropy (:func:`~opacus_structured.samplers._generator.fresh_seed`, one fresh 63-bit
seed each) unless ``seed`` is given; those seeds are never returned or written anywhere. With
``seed`` the run is reproducible and **not private**: whoever knows the seed regenerates the
noise and subtracts it from the released model (:attr:`TrainResult.private` is ``False`` and
:attr:`TrainResult.not_private_reason` says why). ``init_seed`` seeds only the public
randomness — weight initialisation, dropout and the process RNGs later used to sample
forecasts — which DP-SGD does not need to hide (the guarantee holds for every fixed
initialisation and dropout mask).

Not covered by the guarantee (documented limits): the *test* steps (used only for scoring),
hyper-parameter choices, and the train-loss values shown on the progress bar (visible to the
operator only; nothing selects a checkpoint by them and no learning-rate schedule uses them).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

from lightning_callbacks import DPCallback

from .. import _progress
from .._validation import check_int, check_open_unit, check_positive
from ..accountants.structured import StructuredSubsamplingAccountant
from ..accounting import pld as pld_lib
from ..accounting.calibration import calibrate_noise_multiplier
from ..samplers import public_sizes
from ..samplers._generator import fresh_seed
from . import calibration_memo
from . import provenance as prov
from . import trained_parameters as subset
from .data import Panel
from .estimators import check_static_cats, estimator_model, prepare_estimator
from .lightning_parts import _lightning, _progress_callback, _tail_average_callback, _window_module
from .model_defaults import model_defaults
from .train_result import TrainResult  # noqa: F401  (re-exported)
from .training_scheme import (  # noqa: F401  (re-exported)
    _epochs_to_steps,
    check_window_matches_scheme,
    make_scheme,
    max_steps_within_budget,
)
from .user_data import _period_freq as period_freq
from .warning_filters import known_harmless_warnings_filtered
from .windowing import GluonTSWindowDataset
from .zero_shot_mixture import zero_shot_start

__all__ = ["TrainResult", "train_forecaster", "check_window_matches_scheme", "make_scheme",
           "max_steps_within_budget", "DEFAULT_MAX_GRAD_NORM", "TRAINER_OPTIONS"]

#: Per-window clipping norm. The paper uses 1e-4 (found by shrinking C until the noise-free
#: loss got worse); with Adam the update is nearly invariant to C, only the noise-to-signal
#: ratio σ·C/(Λ·C) = σ/Λ matters.
DEFAULT_MAX_GRAD_NORM = 1e-4

#: Lightning ``Trainer`` arguments ``train_forecaster(trainer_options=...)`` passes on: they
#: change neither the steps, the batches nor the update.
TRAINER_OPTIONS = ("enable_model_summary", "deterministic", "benchmark", "default_root_dir")


def _period_freq(freq: str) -> str:
    """A pandas frequency as its Period alias (``"MS"``/``"ME"`` → ``"M"``), for comparing."""
    try:
        return period_freq(freq)
    except ValueError:
        return str(freq)


@contextlib.contextmanager
def _quiet_lightning():
    """Silence Lightning's INFO banners (GPU available, tips, max_steps reached) and the
    named, known-harmless warnings of :mod:`.warning_filters`; every other warning (Opacus'
    included) is shown."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning", "pytorch_lightning")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with known_harmless_warnings_filtered():
            yield
    finally:
        for lg, lv in zip(loggers, levels, strict=False):
            lg.setLevel(lv)


# ---- driver ----------------------------------------------------------------------------------
#: How the baseline skip's step size follows the noise (``train_forecaster(skip_lr_scaling=)``).
SKIP_LR_SCALINGS = ("none", "snr")


@known_harmless_warnings_filtered()
def _calibration_heartbeat(eps_of_sigma, log):
    """``eps_of_sigma`` writing ``"calibrating noise: k ε evaluations, last σ=… (t elapsed)"``
    through ``log`` at most every ~10 s where stderr is not a terminal (a long calibration
    is not silent in logs); ``eps_of_sigma`` itself without a ``log``."""
    if log is None or not _progress.lines_wanted():
        return eps_of_sigma
    beat = _progress.Heartbeat("calibrating noise", log)
    count = [0]

    def wrapped(sigma):
        value = eps_of_sigma(sigma)
        count[0] += 1
        beat.tick(f"{count[0]} epsilon evaluations, last sigma={sigma:.4g} gave "
                  f"epsilon={value:.4g}")
        return value

    return wrapped


def train_forecaster(model: Optional[str], train: Panel, *,
                     prediction_length: Optional[int] = None,
                     context_length: Optional[int] = None, batch_size: Optional[int] = None,
                     epsilon: Optional[float] = None, delta: Optional[float] = None,
                     noise_multiplier: Optional[float] = None,
                     max_grad_norm: float = DEFAULT_MAX_GRAD_NORM,
                     max_steps: Optional[int] = None, epochs: Optional[float] = None,
                     lr: Optional[float] = None, weight_decay: Optional[float] = None,
                     device: str = "cpu",
                     seed: Optional[int] = None, init_seed: Optional[int] = None,
                     progress: bool = False,
                     discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                     estimator_kwargs: Optional[dict] = None,
                     init_state: Optional[dict] = None, init_record: Optional[dict] = None,
                     init_public: bool = False, tail_average: float = 0.0,
                     callbacks: Sequence = (), sampler_wrapper: Optional[Callable] = None,
                     log: Optional[Callable[[str], None]] = None,
                     lstm_impl: str = "fast", grad_sample_mode: str = "hooks",
                     num_workers: int = 0, estimator=None,
                     top_level: str = "wor",
                     dataset_size: Optional[int] = None,
                     trainer_options: Optional[dict] = None,
                     skip_lr: Optional[float] = None,
                     skip_lr_scaling: Optional[str] = None,
                     zero_shot_weight: Optional[float] = None, budget=None,
                     trained_parameters=None) -> TrainResult:
    """Train a gluonts model on ``train`` with structured-subsampling DP-SGD (or without DP).

    Privacy modes:

    * ``epsilon`` finite, ``noise_multiplier=None``: σ is calibrated so that the planned steps
      (``max_steps``, or ``epochs × floor(N/Λ)`` rounded up) spend at most ``epsilon`` at
      ``delta``; all planned steps run.
    * ``epsilon`` finite and ``noise_multiplier`` given: training stops before the first step
      that would exceed ``epsilon`` (or at the step budget).
    * ``epsilon`` None and ``noise_multiplier`` given: DP with that σ; ε is reported.
    * ``epsilon`` None / ``inf`` and no ``noise_multiplier``: **non-private** training with the
      same sampler, model and steps (the ε = ∞ baseline).

    Args:
        model: "deepar", "dlinear" or "simpleff"; ``None`` with ``estimator`` (inferred).
        train: training panel (only it is touched by training).
        prediction_length: L_F (required unless ``estimator`` is given).
        context_length: model context length before lags (default per model).
        batch_size: Λ = series per step (one window each, λ = 1); default 32, or the
            estimator's ``batch_size``.
        lr, weight_decay: Adam's step size and weight decay (default 1e-3 and 1e-8, or the
            estimator's ``lr`` / ``weight_decay``).
        max_grad_norm: per-window clipping norm C.
        device: "cpu" or "cuda".
        seed: seeds the privacy coins — sampler (``seed``) and noise (``seed + 1``) — and,
            unless ``init_seed`` is given, the weight initialisation. ``None`` (default): fresh
            OS entropy, recorded nowhere. A seeded run is reproducible and **not private**
            (``result.private`` is ``False``): use it for evaluation only.
        init_seed: seeds the weight initialisation, dropout and the process RNGs (torch,
            numpy) that later sample forecasts: public randomness, the run stays private.
            Default ``seed``, or fresh entropy. Returned as ``result.init_seed``.
        discretization: PLD discretisation used for calibration and reporting (pessimistic).
        sampler_wrapper: optional ``f(sampler) -> batch_sampler`` (e.g. to record batches).
        lstm_impl: "fast" (:class:`~opacus_structured.forecasting.fast_rnn.FastDPLSTM`,
            default) or "opacus" (``DPLSTM``) for DeepAR's LSTM; both give the same per-window
            gradients (``tests/test_fast_dp_rnn.py``), "fast" is much faster.
        grad_sample_mode: "hooks" (Opacus materialises per-window gradients) or "ghost"
            (book-keeping: per-window norms by the Gram trick and the clipped sum from the same
            backward, :mod:`opacus_structured.optim.bookkeeping`); the same clipped sum, noise
            and ε. "ghost" needs ``lstm_impl="fast"`` (Opacus' DPLSTM re-runs its cells).
        num_workers: DataLoader worker processes that cut and collate the windows (the
            sampler, and so the batches, stay in the main process: same batches for any
            value); > 0 hides the data time behind a GPU step.
        estimator: a user-built gluonts ``DLinearEstimator``, ``SimpleFeedForwardEstimator`` or
            ``DeepAREstimator`` to train instead of building one (``model`` is inferred from
            its class; anything else raises). Its network, transformation, splitter,
            ``prediction_length``, ``context_length``, ``lr`` and ``weight_decay`` are used;
            ``prediction_length`` / ``context_length`` / ``lr`` / ``weight_decay`` given here
            must equal the estimator's, and ``estimator_kwargs`` must not be given (configure
            the estimator instead). ``batch_size`` given here is Λ, the sampler's batch size
            that the accountant prices; the estimator's own ``batch_size`` is then only the
            inference batch size of its predictor (public, no privacy effect) — without
            ``batch_size`` here, Λ is the estimator's ``batch_size``. The estimator's
            ``trainer_kwargs`` (e.g. gluonts' ``gradient_clip_val``), train sampler, batches
            per epoch and callbacks are not used: DP training takes its steps, sampler and
            clipping from the arguments here.
        top_level: how the series of a step are drawn: ``"wor"`` (default: a fresh uniform
            set of Λ distinct series every step, Theorem 4.4, per-step accounting),
            ``"deterministic"`` (step ``b`` of every epoch takes series ``bΛ … (b+1)Λ − 1``,
            Theorem 4.2, per-epoch accounting) or ``"shuffle"`` (one permutation per epoch);
            the scheme's accountant prices the one chosen.
        dataset_size: a declared **public** number of series N (the unit of the panel). The
            scheme, its per-step rate (ρ = Λ/N, the hook's ``1/floor(N/Λ)``), the epoch length
            for ``epochs`` and the normaliser (Λ) then come from N and ``batch_size`` only, the
            same for a panel of N or more series; the sampler draws Λ of the panel's N' >= N
            series (inclusion probability Λ/N' <= Λ/N: pricing with N is sound, see
            :meth:`StructuredScheme.implemented_by`). N' < N raises, and so does N' != N with
            a per-epoch ``top_level``. Default: N is the panel's (read from the data); a
            :class:`~opacus_structured.samplers.public_sizes.DatasetSizeFromDataWarning` says
            so once and ``result.sampling_constants`` records ``dataset_size_source="data"``.
            The accounted length ``L`` is the shortest series of the panel either way.
        init_state: initial weights (a ``state_dict`` of the network) to fine-tune from.
            Accepted as they are only when public: the package's pretrained weights (shipped
            or from :func:`~.pretraining.pretrained_weights`) or ``init_public=True``.
            Weights of an earlier run need that run's ``init_record``.
        init_record: the :attr:`TrainResult.privacy_record` of ``init_state`` (or the
            ``"privacy_record"`` of a file written by :meth:`TrainResult.save_weights`).
            Earlier DP runs on this data (a series in common) are **composed** with this run:
            ``result.epsilon`` is the ε of the composition (``result.run_epsilon`` this run
            alone, ``result.prior_runs`` each earlier run), ``epsilon`` is the budget of the
            composition (σ is calibrated so that the earlier runs plus the planned steps
            spend at most it; refused when the earlier runs alone reach it). Runs on other
            data are reported, not composed. See :mod:`.provenance`.
        init_public: declare ``init_state`` public (never trained on this data); refused when
            its record shows a run on this data.
        skip_lr: Adam's step size for the two weights of DLinear's baseline skip
            (:mod:`~opacus_structured.forecasting.baseline_skip`; they must move by O(1) in
            ``max_steps`` steps, the rest of the network by little). Default: the model's
            recipe row (``skip_lr`` of
            :data:`~opacus_structured.forecasting.model_defaults.MODEL_DEFAULTS`), or ``lr``
            for a network without the skip.
        skip_lr_scaling: ``"snr"`` (DP-SGD only) multiplies ``skip_lr`` by ``min(1, Λ/σ)``,
            the public bound on one step's signal-to-noise ratio per coordinate (a clipped
            mean of norm <= C against noise of standard deviation σC/Λ). Adam steps a
            coordinate by about its step size whatever the noise, so where the noise
            dominates, a full step only moves the skip at random; ``"none"`` keeps
            ``skip_lr``. Default: the recipe row's ``skip_lr_scaling``, else ``"none"``.
        zero_shot_weight: share ``w`` in [0, 1) of the public zero-shot model in the forecast
            of ``result.create_predictor()``: the mixture ``(1 − w)·fine-tuned + w·zero-shot``
            (:mod:`~opacus_structured.forecasting.zero_shot_mixture`; post-processing, no
            privacy cost). Default: the recipe row's ``zero_shot_weight``, which does not
            apply (recorded in ``result.zero_shot_note``) unless ``init_state`` is public
            weights; a weight given without public ``init_state`` raises.
        trained_parameters: the parameters training updates (:mod:`.trained_parameters`):
            ``"all"``, or name prefixes (``("args_proj", "baseline_skip")``); the others keep
            their initial values. Default: the recipe row's ``trained_parameters`` when
            ``init_state`` is given (DLinear: the distribution head and the skip), every
            parameter from a random start. A public choice: the privacy analysis is the same.
        trainer_options: Lightning ``Trainer`` arguments that change neither the steps, the
            batches nor the update: only :data:`TRAINER_OPTIONS` (model summary,
            determinism and cudnn benchmark flags, root directory); anything else raises.
        callbacks: extra Lightning callbacks, run after the DP, tail-average and progress
            callbacks. They must not change the training (see
            :class:`~opacus_structured.forecasting.dp_estimator.DPEstimator` for the ones it
            accepts).
        budget: a :class:`~opacus_structured.dataset_budget.DatasetBudget` of the panel: every
            noisy step is charged to it before its noise (``DPCallback(budget=...)``), and
            training stops before the step that would pass its cap (``result.steps`` says
            how many ran). Refused for non-private training (its ε is unbounded).
    """
    import torch

    pl = _lightning()
    if estimator is not None:
        inferred = estimator_model(estimator)
        if model is not None and model != inferred:
            raise ValueError(f"model={model!r} does not match the estimator "
                             f"{type(estimator).__name__} ({inferred!r}); pass model=None")
        model = inferred
        if estimator_kwargs:
            raise ValueError("estimator_kwargs cannot be combined with estimator=: configure "
                             "the estimator itself")
        for name, given in (("prediction_length", prediction_length),
                            ("context_length", context_length), ("lr", lr),
                            ("weight_decay", weight_decay)):
            own = getattr(estimator, name, None)
            if given is not None and own is not None and given != own:
                raise ValueError(f"{name}={given!r} differs from the estimator's {name}="
                                 f"{own!r}: leave {name} unset (the estimator's is used) or "
                                 f"build the estimator with it")
        prediction_length = int(estimator.prediction_length)
        batch_size = estimator.batch_size if batch_size is None else batch_size
        lr = getattr(estimator, "lr", 1e-3) if lr is None else lr
        weight_decay = (getattr(estimator, "weight_decay", 1e-8) if weight_decay is None
                        else weight_decay)
        own_freq = getattr(estimator, "freq", None)
        if own_freq is not None and _period_freq(own_freq) != _period_freq(train.freq):
            raise ValueError(f"the estimator's freq={own_freq!r} differs from the training "
                             f"panel's frequency {train.freq!r}")
    elif model is None:
        raise ValueError("pass a model name ('deepar', 'dlinear' or 'simpleff') or an "
                         "estimator")
    elif prediction_length is None:
        raise ValueError("prediction_length is required (unless an estimator is given)")
    batch_size = 32 if batch_size is None else batch_size
    lr = 1e-3 if lr is None else lr
    weight_decay = 1e-8 if weight_decay is None else weight_decay
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if grad_sample_mode not in ("hooks", "ghost"):
        raise ValueError(f"grad_sample_mode must be 'hooks' or 'ghost', got "
                         f"{grad_sample_mode!r}")
    if grad_sample_mode == "ghost" and model == "deepar" and lstm_impl != "fast":
        raise ValueError("grad_sample_mode='ghost' needs lstm_impl='fast': Opacus' DPLSTM runs "
                         "its linear layers once per time step")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    if init_seed is not None:
        init_seed = check_int("init_seed", init_seed, minimum=0)
    elif seed is not None:
        init_seed = seed
    else:
        init_seed = fresh_seed()
    num_workers = check_int("num_workers", num_workers, minimum=0)
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
    discretization = check_positive("discretization", discretization)
    check_positive("lr", lr)
    dp_sgd = noise_multiplier is not None or (epsilon is not None and math.isfinite(epsilon))
    if epsilon is not None and not (epsilon > 0):
        raise ValueError(f"epsilon must be > 0 (or inf for non-private), got {epsilon}")
    if dp_sgd:
        if delta is None:
            raise ValueError("delta is required for private training")
        delta = check_open_unit("delta", delta)
        if noise_multiplier is not None:
            noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    if (max_steps is None) == (epochs is None):
        raise ValueError("pass exactly one of max_steps and epochs")
    trainer_options = dict(trainer_options or {})
    unknown = sorted(set(trainer_options) - set(TRAINER_OPTIONS))
    if unknown:
        raise ValueError(f"trainer_options {unknown} not supported: only {TRAINER_OPTIONS} "
                         f"(options that change neither the steps, the batches nor the update)")
    say = log or (lambda msg: None)

    # public randomness only (weights, dropout, forecast sampling): never the privacy coins
    torch.manual_seed(init_seed)
    np.random.seed(init_seed % 2**32)
    if estimator is not None:
        prepared = prepare_estimator(model, estimator, lstm_impl=lstm_impl)
    else:
        prepared = prepare_estimator(model, freq=train.freq,
                                     prediction_length=prediction_length,
                                     context_length=context_length, batch_size=batch_size,
                                     lr=lr, weight_decay=weight_decay, lstm_impl=lstm_impl,
                                     **(estimator_kwargs or {}))
    check_static_cats(prepared.estimator, train)
    if init_state is not None:  # public pretrained weights (fine-tuning starts from them)
        try:
            prepared.module.model.load_state_dict(init_state)
        except RuntimeError as err:
            raise ValueError(f"init_state does not fit the {model} network built for "
                             f"prediction_length={prediction_length}, context_length="
                             f"{context_length}: {err}") from None
    elif init_record is not None or init_public:
        raise ValueError("init_record / init_public describe init_state: pass init_state too")
    # earlier runs the initial weights went through (public / composed / refused)
    provenance = (None if init_state is None else
                  prov.resolve_init(init_state, init_record=init_record,
                                    init_public=bool(init_public), panel=train, dp_sgd=dp_sgd))
    # the forecast mixture's public half (refused up front, before calibration, when missing)
    zero_shot_weight, public_state, zero_shot_note = zero_shot_start(
        model, zero_shot_weight, init_state, provenance)
    tail_average = float(tail_average)
    if not 0.0 <= tail_average <= 1.0:
        raise ValueError(f"tail_average must be in [0, 1] (fraction of the last steps whose "
                         f"iterates are averaged), got {tail_average}")
    # the panel's own scheme (what the sampler draws) and the priced one (declared N)
    sampler_scheme = make_scheme(train, prepared, batch_size, top_level=top_level)
    check_window_matches_scheme(sampler_scheme, prepared, train)
    if dataset_size is not None:
        dataset_size = check_int("dataset_size", dataset_size, minimum=1)
        if dataset_size > len(train):
            raise ValueError(
                f"dataset_size={dataset_size} declares more series than the panel holds "
                f"({len(train)}): each step would draw a series with probability "
                f"batch_size/{len(train)}, above the priced batch_size/{dataset_size}; declare "
                f"dataset_size <= {len(train)}")
        if dataset_size != len(train) and top_level != "wor":
            raise ValueError(
                f"dataset_size={dataset_size} differs from the panel's {len(train)} series: "
                f"only top_level='wor' (per-step accounting) can be priced with a public "
                f"number of series; top_level={top_level!r} prices epochs of the panel's own "
                f"length")
    scheme = make_scheme(train, prepared, batch_size, top_level=top_level,
                         num_series=dataset_size)
    per_epoch = scheme.steps_per_epoch()
    if max_steps is not None:
        steps = check_int("max_steps", max_steps, minimum=1)
    else:
        epochs = check_positive("epochs", epochs)
        if not math.isfinite(epochs):
            raise ValueError(f"epochs must be finite, got {epochs}")
        steps = max(1, _epochs_to_steps(epochs, per_epoch))  # rounded up: price every step run

    # ---- privacy calibration (before touching any data) ----
    t0 = time.perf_counter()
    accountant = None
    eps_of = None
    prior = None
    if dp_sgd:
        prior = None if provenance is None else provenance.prior_pld(discretization)
        if prior is None:
            def eps_of(sigma, n):
                return scheme.epsilon(sigma, n, delta, discretization=discretization)
        else:  # a target epsilon bounds the composition with the earlier runs on this data
            def eps_of(sigma, n):
                return prov.composed_epsilon(prior, scheme, sigma, n, delta, discretization)

            spent_before = pld_lib.epsilon_for_delta(prior, delta)
            say(f"init_state: earlier runs on this data spent epsilon={spent_before:.4g} at "
                f"delta={delta:g}; composed with this run")
            if epsilon is not None and math.isfinite(epsilon) and spent_before >= epsilon:
                raise ValueError(
                    f"the earlier runs on this data that init_state went through already spent "
                    f"epsilon={spent_before:.4g} >= the target epsilon={epsilon} (the target "
                    f"bounds the composition of every run): raise epsilon or start from public "
                    f"weights")

        if noise_multiplier is None:
            say(f"calibrating noise for epsilon={epsilon:g}, delta={delta:g}, {steps} steps")
            eps_checked = _calibration_heartbeat(lambda s: eps_of(s, steps), log)
            if prior is None:  # public inputs only: remembered answers are checked, not trusted
                noise_multiplier, source = calibration_memo.calibrate(
                    eps_checked, epsilon, rtol=1e-2,
                    key=calibration_memo.calibration_key(scheme, steps, delta, epsilon,
                                                         discretization, 1e-2))
                if source != "search":
                    say(f"noise multiplier {noise_multiplier:.4g} from the {source} "
                        f"calibration memo, checked in two evaluations")
            else:
                noise_multiplier = calibrate_noise_multiplier(eps_checked, epsilon, rtol=1e-2)
        elif epsilon is not None and math.isfinite(epsilon):
            steps = max_steps_within_budget(lambda n: eps_of(noise_multiplier, n), epsilon,
                                            steps)
            if steps == 0:
                raise ValueError(f"noise_multiplier={noise_multiplier} exceeds epsilon="
                                 f"{epsilon} in a single step"
                                 f"{' (composed with the earlier runs on this data)' if prior is not None else ''}"  # noqa: E501
                                 f"; raise the noise multiplier")
        accountant = StructuredSubsamplingAccountant(scheme, discretization=discretization)
    calibration_seconds = time.perf_counter() - t0

    # ---- data: transformed entries, structured sampler, loader ----
    entries = list(prepared.transformation.apply(train.to_gluonts(), is_train=True))
    dataset = GluonTSWindowDataset(entries, prepared.splitter, prepared.input_names)
    dataset.check_scheme(sampler_scheme)
    if not scheme.implemented_by(sampler_scheme):  # pragma: no cover - guarded above
        raise AssertionError(f"{sampler_scheme!r} does not implement {scheme!r}")
    # privacy coins: OS entropy unless the caller seeded them (then labelled not private)
    generator = torch.Generator().manual_seed(fresh_seed() if seed is None else seed)
    sampler = sampler_scheme.sampler(train.lengths, generator=generator)
    batch_sampler = sampler_wrapper(sampler) if sampler_wrapper is not None else sampler
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler,
                                         collate_fn=dataset.collate, num_workers=num_workers,
                                         persistent_workers=num_workers > 0)
    if len(loader) != sampler_scheme.steps_per_epoch():
        raise ValueError(f"the sampler yields {len(loader)} steps per epoch but the scheme "
                         f"says {sampler_scheme.steps_per_epoch()}")
    sampling = public_sizes.sampling_constants(
        sample_rate=scheme.expected_sample_rate(), expected_batch_size=float(scheme.batch_size),
        dataset_size=scheme.num_series,
        dataset_size_source=(public_sizes.DATA if dataset_size is None
                             else public_sizes.DECLARED),
        normaliser_source="batch_size (windows per step, public)")
    if dp_sgd and dataset_size is None:
        public_sizes.warn_dataset_size_from_data(
            "train_forecaster", len(train),
            how="train_forecaster(..., dataset_size=N) / `opacus-structured forecast "
                "--dataset-size N` with a public number of series N")

    if skip_lr is None:
        skip_lr = model_defaults(model).get("skip_lr", lr)
    skip_lr = check_positive("skip_lr", skip_lr)
    if skip_lr_scaling is None:
        skip_lr_scaling = model_defaults(model).get("skip_lr_scaling", "none")
    if skip_lr_scaling not in SKIP_LR_SCALINGS:
        raise ValueError(f"skip_lr_scaling must be one of {SKIP_LR_SCALINGS}, got "
                         f"{skip_lr_scaling!r}")
    if dp_sgd and skip_lr_scaling == "snr":
        skip_lr *= min(1.0, float(scheme.batch_size) / float(noise_multiplier))
    module = _window_module(prepared, lr=lr, weight_decay=weight_decay, skip_lr=skip_lr)
    trained = subset.resolve_trained_parameters(
        trained_parameters, model_defaults(model).get("trained_parameters"), init_state is not None)
    trained_count = subset.freeze_all_but(module.model, trained,
                                          strict=trained_parameters is not None)
    dp_callback = None
    if dp_sgd:
        # the one DP wiring every path shares: DPCallback verifies that the loader draws with
        # the scheme's sampler, hooks per-window gradients, wraps Adam into Opacus' DPOptimizer
        # (book-keeping variant for "ghost"; noise from its generator seeded with seed + 1, or
        # fresh entropy) and prices every step with the scheme's accountant.
        dp_callback = DPCallback(
            delta=delta, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            scheme=scheme, accountant=accountant, install_sampler=False, seed=seed,
            discretization=discretization, loss_reduction="mean",
            grad_sample_mode=grad_sample_mode, log_every_n_steps=max(1, steps),
            expected_batch_size=float(scheme.batch_size), budget=budget)
    elif budget is not None:
        raise ValueError("budget= with non-private training (no epsilon, no noise_multiplier): "
                         "its epsilon is unbounded, so no dataset budget can pay for it")
    label = (f"{model} DP (sigma={noise_multiplier:.3g})" if dp_sgd else f"{model} non-DP")
    with _quiet_lightning():
        trainer = pl.Trainer(
            max_steps=steps, max_epochs=-1, accelerator="gpu" if device == "cuda" else "cpu",
            devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            **{"enable_model_summary": False, **trainer_options},
            gradient_clip_val=None, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[*([dp_callback] if dp_callback is not None else []),
                       *([_tail_average_callback(steps, tail_average)] if tail_average > 0
                         else []),
                       _progress_callback(steps, label, progress, log), *callbacks])
    t1 = time.perf_counter()
    with _quiet_lightning():
        trainer.fit(module, train_dataloaders=loader)
    if dp_callback is not None:  # the trainer's record: the callback saw a declared Λ only
        dp_callback.sampling_constants = dict(sampling)
        accountant.sampling_constants = dict(sampling)
    train_seconds = time.perf_counter() - t1
    taken = int(trainer.global_step)
    subset.thaw(module.model)
    prepared.module.model = module.model
    prepared.module.to("cpu" if device == "cpu" else "cuda")
    prepared.module.eval()

    if dp_sgd:
        if len(accountant) != taken:
            raise RuntimeError(f"the accountant recorded {len(accountant)} steps but "
                               f"{taken} optimizer steps ran")
        run_epsilon = accountant.get_epsilon(delta)
        spent, bound = run_epsilon, accountant.bound
        if prior is not None:  # the released model went through the earlier runs too
            spent = pld_lib.epsilon_for_delta(
                prov.compose_plds([prior, accountant.composed_pld(discretization)]), delta)
            bound = prov.combined_bound(bound, *provenance.prior_bounds())
        if epsilon is not None and math.isfinite(epsilon) and spent > epsilon:
            raise RuntimeError(f"the run spent epsilon={spent} > target {epsilon}: refusing to "
                               f"release the model")
    else:
        spent, bound, run_epsilon = math.inf, None, None
    return TrainResult(prepared=prepared, scheme=scheme, accountant=accountant, dp_sgd=dp_sgd,
                       noise_multiplier=noise_multiplier if dp_sgd else None,
                       max_grad_norm=max_grad_norm if dp_sgd else None, steps=taken,
                       epsilon=spent, delta=delta, target_epsilon=epsilon, bound=bound,
                       train_seconds=train_seconds, calibration_seconds=calibration_seconds,
                       seed=seed, init_seed=init_seed,
                       sampling_constants=dict(sampling) if dp_sgd else None,
                       run_epsilon=run_epsilon,
                       init_provenance=provenance, train_panel=train,
                       weights_hash=prov.weights_fingerprint(
                           module.model.state_dict()),
                       zero_shot_weight=zero_shot_weight, public_state=public_state,
                       zero_shot_note=zero_shot_note,
                       trained_parameters={"names": "all" if trained is None else list(trained),
                                           "count": trained_count})

