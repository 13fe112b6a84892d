"""Public pretraining for DP fine-tuning: weights learnt on the synthetic public corpus.

DP-SGD from a random initialisation spends its whole budget learning what every seasonal
series looks like; starting from weights pretrained on public data it only has to adapt them.
:func:`pretrain` trains a model **non-privately** on
:func:`~opacus_structured.forecasting.public_corpus.synthetic_panel` (public, synthetic,
disjoint from every user panel) with a fixed recipe (:data:`PRETRAIN_RECIPE`) and fixed seeds,
so the weights are a deterministic function of the model geometry and the recipe.

:func:`pretrained_weights` returns them for a geometry ``(model, freq, prediction_length,
context_length)`` from, in order:

1. the weights shipped with the package (``opacus_structured/data/pretrained/``; the default
   geometry of each model, monthly data, 12-month horizon);
2. the user cache (``$OPACUS_STRUCTURED_CACHE``, else ``$XDG_CACHE_HOME/opacus-structured``,
   else ``~/.cache/opacus-structured``), ``pretrained/<key>.pt``;
3. a fresh :func:`pretrain` run (progress bar), saved to the cache.

The file name carries a hash of the recipe, so a changed recipe never loads stale weights.
``opacus-structured pretrain`` runs step 3 ahead of time (and ``--output`` writes the weights
where you like); ``forecast --init-from public`` (the default) or ``--init-from PATH`` starts DP
fine-tuning from them. The privacy guarantee covers the fine-tuning panel only; nothing private
is read while pretraining. The weights are public by construction: their meta carries a
privacy record without runs (:func:`~.provenance.public_record`), and the weights returned here
are registered public, so ``train_forecaster(init_state=...)`` takes them without
``init_public`` (:mod:`.provenance`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
from typing import Any, Optional

import numpy as np
import torch

from .. import _progress
from .._validation import check_int
from .baseline_skip import check_skip_features
from .competition_corpus import competition_kind, competition_panel
from .data import Panel
from .estimators import default_context_length, prepare_estimator
from .lightning_parts import _lightning
from .provenance import public_record, register_public_weights
from .public_corpus import synthetic_panel
from .public_weights import (
    CHEAPER_STEPS,
    base_freq,
    base_geometry,
    pretrain_seconds_estimate,
    truncate_dlinear,
)
from .seasonality import season_length as default_season_length
from .training import train_forecaster
from .user_cache import cache_root

__all__ = ["CORPORA", "PretrainRecipe", "PRETRAIN_RECIPE", "recipe_for", "pretrain", "pretraining_panel",
           "pretrained_weights", "zero_shot_predictor", "shipped_weights_path",
           "weights_key", "cache_dir", "load_weights", "save_weights"]


#: The public corpora a recipe can name (:attr:`PretrainRecipe.corpus`)
CORPORA = ("synthetic", "synthetic+competition")


@dataclasses.dataclass(frozen=True)
class PretrainRecipe:
    """How the public weights are trained (all public; fixed seeds).

    ``corpus``: ``"synthetic"`` (:func:`~.public_corpus.synthetic_panel` only) or
    ``"synthetic+competition"``: the synthetic panel plus, at yearly, quarterly and monthly
    frequencies, the real M1/M3 competition series
    (:func:`~.competition_corpus.competition_panel`, less those that overlap an evaluation
    panel); at other frequencies the two are the same corpus (:meth:`for_freq`).
    ``competition_series``: how many of those series to use (a draw without replacement
    seeded by ``corpus_seed``: public randomness), None for all of them.
    ``skip_features`` (DLinear): pretrain the network **with** the baseline skip over these
    local forecasts (:mod:`.baseline_skip`, :mod:`.local_forecasts`), so the public weights
    carry a combination of the network and the local methods; None pretrains plain DLinear (its
    skip then starts at zero when fine-tuning).
    """

    num_series: int = 2000
    min_length: int = 120
    max_length: int = 480
    corpus_seed: int = 0
    steps: int = 1000
    batch_size: int = 128
    lr: float = 1e-3
    init_seed: int = 0
    sampler_seed: int = 0
    corpus: str = "synthetic"
    competition_series: Optional[int] = None
    skip_features: Optional[tuple] = None

    def __post_init__(self):
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.competition_series is not None:
            check_int("competition_series", self.competition_series, minimum=1)
        if self.skip_features is not None:
            object.__setattr__(self, "skip_features", check_skip_features(self.skip_features))

    def uses_competition(self, freq: str) -> bool:
        """Whether the corpus at ``freq`` includes the competition series."""
        return self.corpus == "synthetic+competition" and competition_kind(freq) is not None

    def for_freq(self, freq: str) -> "PretrainRecipe":
        """The recipe as it runs at ``freq``: ``corpus="synthetic"`` where the competitions
        have no series of that frequency (the same weights, so the same file key)."""
        if self.corpus != "synthetic" and not self.uses_competition(freq):
            return dataclasses.replace(self, corpus="synthetic", competition_series=None)
        return self

    def to_dict(self) -> dict:
        """The fields; ``corpus`` and ``competition_series`` only for a corpus other than the
        synthetic one (so the keys of weights pretrained before they existed stay valid)."""
        d = dataclasses.asdict(self)
        if d["corpus"] == "synthetic":
            del d["corpus"], d["competition_series"]
        if d["skip_features"] is None:
            del d["skip_features"]
        else:
            d["skip_features"] = list(d["skip_features"])
        return d


#: The recipe of the shipped weights, per model (:func:`recipe_for`: fewer DeepAR steps in some
#: frequency families).
PRETRAIN_RECIPE = {
    "dlinear": PretrainRecipe(),
    "simpleff": PretrainRecipe(),
    # DeepAR: 5000 steps at lr 3e-3 (600 steps at 1e-3 left it worse than seasonal naive on
    # both public study panels; docs/guides/forecasting.md, "Public pretraining of DeepAR")
    "deepar": PretrainRecipe(steps=5000, batch_size=64, lr=3e-3),
}


def recipe_for(model: str, freq: str) -> PretrainRecipe:
    """The pretraining recipe of ``model`` at ``freq``: :data:`PRETRAIN_RECIPE`, with at most
    :data:`~.public_weights.CHEAPER_STEPS` steps in the frequency families listed there
    (DeepAR at daily, hourly, yearly, business-day and minute data: 2000 steps, so that every
    family's weights could be trained and shipped; documented in the forecasting guide)."""
    recipe = PRETRAIN_RECIPE[model]
    cap = CHEAPER_STEPS.get((model, base_freq(freq)))
    if cap is not None and recipe.steps > cap:
        return dataclasses.replace(recipe, steps=cap)
    return recipe


def weights_key(model: str, *, freq: str, prediction_length: int,
                context_length: Optional[int] = None,
                recipe: Optional[PretrainRecipe] = None,
                season_length: Optional[int] = None) -> str:
    """File stem naming a geometry and a recipe, e.g. ``dlinear-M-h12-c36-<hash>``.

    A ``season_length`` other than ``freq``'s default
    (:func:`~opacus_structured.forecasting.seasonality.season_length`) is part of the key
    (``-s<m>``): the corpus' seasonal period differs, so do the weights."""
    h = check_int("prediction_length", prediction_length, minimum=1)
    ctx = (default_context_length(model, h) if context_length is None
           else check_int("context_length", context_length, minimum=1))
    recipe = (recipe_for(model, freq) if recipe is None else recipe).for_freq(freq)
    digest = hashlib.sha256(json.dumps(recipe.to_dict(), sort_keys=True).encode()).hexdigest()
    season = ""
    if season_length is not None:
        m = check_int("season_length", season_length, minimum=1)
        if m != default_season_length(freq):
            season = f"-s{m}"
    return f"{model}-{freq}-h{h}-c{ctx}{season}-{digest[:10]}"


def cache_dir() -> str:
    """The user cache directory for pretrained weights (module docstring)."""
    return os.path.join(cache_root(), "pretrained")


def save_weights(path: str, state: dict, meta: dict) -> None:
    """Write ``{"state_dict", "meta"}`` to ``path`` (directories created)."""
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"state_dict": state, "meta": meta}, path)


def load_weights(path: str) -> tuple[dict, dict]:
    """``(state_dict, meta)`` from a file written by :func:`save_weights` (or a bare
    ``state_dict``, meta then empty). Raises ``ValueError`` naming the path if unreadable."""
    import torch

    if not os.path.isfile(path):
        raise ValueError(f"--init-from {path!r}: no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a bad file
        raise ValueError(f"--init-from {path!r} is not a weights file: {err}") from None
    if isinstance(blob, dict) and "state_dict" in blob:
        return blob["state_dict"], dict(blob.get("meta") or {})
    if isinstance(blob, dict):
        return blob, {}
    raise ValueError(f"--init-from {path!r} holds a {type(blob).__name__}, not a state dict")


def _step_log_callback(total: int, desc: str, log, interval: float = _progress.LINE_INTERVAL):
    """A Lightning callback writing ``"<desc>: k/total steps (t elapsed, about r left)"``
    through ``log`` at most every ``interval`` seconds and at the last step
    (:class:`~opacus_structured._progress.LineProgress`): progress in plain lines where no bar
    is drawn (stderr not a terminal, ``--json`` piped to a file, CI logs)."""
    pl = _lightning()

    class _StepLog(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.lines = _progress.LineProgress(desc, total, log, interval=interval)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.lines.update(int(trainer.global_step))

    return _StepLog()


def pretrain(model: str, *, freq: str = "M", prediction_length: int = 12,
             context_length: Optional[int] = None, recipe: Optional[PretrainRecipe] = None,
             progress: bool = False, estimator_kwargs: Optional[dict] = None,
             season_length: Optional[int] = None, log=None) -> tuple[dict, dict[str, Any]]:
    """Pretrain ``model`` non-privately on the synthetic corpus; returns ``(state_dict, meta)``.

    Any pandas ``freq`` works: the corpus' seasonal period is ``season_length``, default
    :func:`~opacus_structured.forecasting.seasonality.season_length` of ``freq`` (``"M"``:
    12, ``"30min"``: 48, ``"W"``: 52, ``"Y"``: 1).

    Deterministic for a given geometry, recipe and torch build (fixed corpus, sampler and
    initialisation seeds; public randomness only). The training runs on **one** torch CPU
    thread (restored afterwards): a multi-threaded reduction sums in another order, and over
    DeepAR's 5000 steps those last-bit differences grow to different weights (largest
    difference 3.6 with 2 threads), so the shipped weights are reproducible bit for bit only
    on one thread.

    ``progress`` draws a bar on stderr; ``log`` (a ``str -> None`` callable, e.g. a print to
    stderr) additionally gets a plain line at most every ~10 s and at the last step, for runs
    whose stderr is not a terminal.
    """
    recipe = (recipe_for(model, freq) if recipe is None else recipe).for_freq(freq)
    season = (default_season_length(freq) if season_length is None
              else check_int("season_length", season_length, minimum=1))
    corpus, corpus_name = pretraining_panel(model, recipe, freq=freq, season_length=season,
                                            prediction_length=prediction_length,
                                            context_length=context_length)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _pretrain_run(model, corpus, prediction_length, context_length, recipe,
                               progress, estimator_kwargs, log)
    finally:
        torch.set_num_threads(threads)
    state = {k: v.detach().cpu().clone() for k, v in
             result.prepared.module.model.state_dict().items()}
    meta = {"model": model, "freq": freq, "prediction_length": int(prediction_length),
            "context_length": int(default_context_length(model, prediction_length)
                                  if context_length is None else context_length),
            "recipe": recipe.to_dict(), "corpus": corpus_name, "season_length": season,
            "train_seconds": result.train_seconds,
            "key": weights_key(model, freq=freq, prediction_length=prediction_length,
                               context_length=context_length, recipe=recipe,
                               season_length=season)}
    meta["privacy_record"] = public_record(
        state, f"pretrained on the public corpus: {corpus_name} (opacus-structured pretrain)")
    return state, meta


def pretraining_panel(model: str, recipe: PretrainRecipe, *, freq: str, season_length: int,
                      prediction_length: int, context_length: Optional[int] = None
                      ) -> tuple[Panel, str]:
    """The pretraining panel of ``recipe`` at ``freq`` and its description: the synthetic
    panel, plus (:meth:`PretrainRecipe.uses_competition`) the competition series at least one
    model window (context + prediction length) long.

    Raises:
        ValueError: DeepAR with the competition series: they carry no calendar dates
            (:mod:`.competition_corpus`), and DeepAR reads calendar features.
    """
    if model == "deepar" and recipe.uses_competition(freq):
        raise ValueError("the M1/M3 competition series have no calendar dates, and DeepAR "
                         "reads calendar features: pretrain DeepAR on the synthetic corpus")
    synthetic = synthetic_panel(recipe.num_series, freq=freq, season_length=season_length,
                                min_length=recipe.min_length, max_length=recipe.max_length,
                                seed=recipe.corpus_seed)
    if not recipe.uses_competition(freq):
        return synthetic, "synthetic_panel"
    ctx = (default_context_length(model, prediction_length) if context_length is None
           else int(context_length))
    real = competition_panel(freq, min_length=ctx + int(prediction_length))
    if recipe.competition_series is not None and recipe.competition_series < len(real):
        rng = np.random.default_rng(recipe.corpus_seed)
        real = real.subset(sorted(rng.choice(len(real), recipe.competition_series,
                                             replace=False).tolist()))
    panel = Panel(synthetic.targets + real.targets, synthetic.starts + real.starts,
                  synthetic.item_ids + real.item_ids, freq)
    return panel, f"synthetic_panel + {len(real)} M1/M3 competition series"


def _pretrain_run(model, corpus, prediction_length, context_length, recipe, progress,
                  estimator_kwargs, log):
    if model == "dlinear" and recipe.skip_features is None:  # DLinear's own; skip starts at 0
        estimator_kwargs = {"baseline_skip": False, **(estimator_kwargs or {})}
    elif model == "dlinear":  # pretrained with the skip over the recipe's local forecasts
        estimator_kwargs = {"skip_features": recipe.skip_features, **(estimator_kwargs or {})}
    return train_forecaster(model, corpus, prediction_length=prediction_length,
                            context_length=context_length, batch_size=recipe.batch_size,
                            max_steps=recipe.steps, lr=recipe.lr, seed=recipe.sampler_seed,
                            init_seed=recipe.init_seed, progress=progress,
                            estimator_kwargs=estimator_kwargs,
                            callbacks=() if log is None else (
                                _step_log_callback(recipe.steps, f"pretraining {model}", log),))


def shipped_weights_path(key: str) -> Optional[str]:
    """Path of the weights shipped in the package for :func:`weights_key` ``key``, or None."""
    res = importlib.resources.files("opacus_structured") / "data" / "pretrained" / f"{key}.pt"
    return str(res) if res.is_file() else None


def pretrained_weights(model: str, *, freq: str = "M", prediction_length: int = 12,
                       context_length: Optional[int] = None, progress: bool = False,
                       log=None, season_length: Optional[int] = None,
                       series_length: Optional[int] = None
                       ) -> tuple[dict, dict[str, Any]]:
    """Public pretrained weights for the geometry, in order: shipped or cached for exactly this
    geometry; the shipped (or cached) weights of the frequency's base geometry
    (:func:`~.public_weights.base_geometry`: any horizon for DeepAR, the first ``h`` output
    steps of a longer-horizon DLinear, with its context when ``context_length`` is None);
    else pretrained now (announced before it starts, with an estimate and the way to skip it)
    and cached. Returns ``(state_dict, meta)``: ``meta["source"]`` says which,
    ``meta["prediction_length"]`` / ``meta["context_length"]`` the geometry the weights fit
    (a DLinear base model brings its own context), ``meta["base"]`` the base geometry used.

    ``log`` (``str -> None``) gets the announcement and, without a ``progress`` bar, a line at
    most every ~10 s; without ``log`` both go to stderr. Any pandas ``freq`` works (the
    corpus' season: ``season_length``, default from ``freq``). ``series_length`` (the shortest
    training series) keeps a longer-horizon DLinear whose context would not fit it out
    (:func:`~.public_weights.base_geometry`)."""
    say = log or _stderr
    key = weights_key(model, freq=freq, prediction_length=prediction_length,
                      context_length=context_length, season_length=season_length)
    for source, path in (("shipped", shipped_weights_path(key)),
                         ("cache", os.path.join(cache_dir(), f"{key}.pt"))):
        if path is not None and os.path.isfile(path):  # cache: written by pretrain (public)
            state, meta = load_weights(path)
            register_public_weights(state)
            return state, {**meta, "source": source, "path": path}
    default_season = (season_length is None
                      or int(season_length) == default_season_length(freq))
    base = (base_geometry(model, freq=freq, prediction_length=prediction_length,
                          context_length=context_length, series_length=series_length)
            if default_season else None)
    if base is not None:
        found = _base_weights(base, freq, prediction_length, context_length)
        if found is not None:
            return found
        if model == "deepar":  # one pretraining of the base geometry serves every horizon
            _pretrain_announced(model, base.freq, base.prediction_length,
                                base.context_length, None, progress, say,
                                why=f"no public DeepAR weights for the {base.freq} family "
                                    f"are shipped or cached")
            state, meta = _base_weights(base, freq, prediction_length, context_length)
            return state, {**meta, "source": "pretrained now"}
    why = ("no public weights are shipped for this geometry" if base is None
           else "the shipped base weights are missing")
    if not default_season:
        why = f"season_length={season_length} is not {freq}'s default"
    state, meta, cached = _pretrain_announced(model, freq, prediction_length, context_length,
                                              season_length, progress, say, why=why)
    return state, {**meta, "source": "pretrained now", "path": cached}


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def _pretrain_announced(model, freq, prediction_length, context_length, season_length,
                        progress, say, *, why):
    """Pretrain (announced first: what, why, an estimate, how to skip) and cache."""
    recipe = recipe_for(model, freq).for_freq(freq)
    key = weights_key(model, freq=freq, prediction_length=prediction_length,
                      context_length=context_length, season_length=season_length)
    cached = os.path.join(cache_dir(), f"{key}.pt")
    ctx = (default_context_length(model, prediction_length) if context_length is None
           else int(context_length))
    corpus = ("synthetic and M1/M3 competition series"
              if recipe.uses_competition(freq) else "synthetic")
    estimate = pretrain_seconds_estimate(model, recipe.steps, prediction_length, ctx)
    say(f"pretraining {model} now: {why} (freq {freq}, horizon {prediction_length}, context "
        f"{ctx}); {recipe.steps} steps on the public {corpus} corpus, about "
        f"{_progress.format_seconds(estimate)} on one idle CPU core (longer under load); once, "
        f"then cached at {cached}. To skip it: --init-from none (init_from='none': a random "
        f"start), or run `opacus-structured pretrain --model {model} --freq {freq} "
        f"--prediction-length {prediction_length}"
        + ("" if context_length is None else f" --context-length {ctx}")
        + ("" if season_length is None or int(season_length) == default_season_length(freq)
           else f" --season-length {season_length}")
        + "` beforehand")
    state, meta = pretrain(model, freq=freq, prediction_length=prediction_length,
                           context_length=context_length, progress=progress,
                           season_length=season_length, log=None if progress else say)
    save_weights(cached, state, meta)
    say(f"pretrained {model} in {meta['train_seconds']:.0f} s: {cached}")
    return state, meta, cached


def _base_weights(base, freq, prediction_length, context_length):
    """``(state, meta)`` of the base geometry ``base`` adapted to the run (None: no file)."""
    key = weights_key(base.model, freq=base.freq, prediction_length=base.prediction_length,
                      context_length=base.context_length)
    source, path = "shipped", shipped_weights_path(key)
    if path is None:
        source, path = "cache", os.path.join(cache_dir(), f"{key}.pt")
        if not os.path.isfile(path):
            return None
    state, meta = load_weights(path)
    note = base.describe(freq)
    if base.model == "dlinear" and base.use_horizon != base.prediction_length:
        hidden = int(state["args_proj.proj.0.weight"].shape[1])
        state = truncate_dlinear(state, base.use_horizon, hidden)
        meta = {**meta, "privacy_record": public_record(
            state, f"the first {base.use_horizon} output steps of public pretrained weights "
                   f"{key} (synthetic corpus; opacus-structured pretrain)")}
    register_public_weights(state)
    ctx = (base.run_context if base.run_context is not None else
           default_context_length(base.model, prediction_length) if context_length is None
           else int(context_length))
    return state, {**meta, "source": source, "path": path, "key": key,
                   "prediction_length": int(prediction_length), "context_length": ctx,
                   "base": {"freq": base.freq, "prediction_length": base.prediction_length,
                            "context_length": base.context_length, "describe": note}}


def zero_shot_predictor(model: str, state: dict, *, freq: str, prediction_length: int,
                        context_length: Optional[int] = None):
    """A gluonts predictor of the pretrained weights as they are (no fine-tuning: it reads no
    private data, so it costs no privacy) — the reference DP fine-tuning must improve on."""
    prepared = prepare_estimator(model, freq=freq, prediction_length=prediction_length,
                                 context_length=context_length)
    prepared.module.model.load_state_dict(state)
    prepared.module.eval()
    return prepared.create_predictor()
