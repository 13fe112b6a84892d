"""Which shipped public weights serve a run: the base set, and how any frequency and horizon
map to it (so that a first run at a new frequency or horizon does not pretrain).

The package ships, for DLinear and DeepAR, weights pretrained on the synthetic public corpus
(:mod:`.pretraining`, recipe :data:`~.pretraining.PRETRAIN_RECIPE`) at one **base frequency**
per pandas step family (:data:`BASE_GEOMETRIES`):

=====================================  =========  ===============================  =============================
pandas step (offset class)             base freq  DeepAR h                         DLinear horizons (context 3h)
=====================================  =========  ===============================  =============================
year (``Y``, ``YS``, ``BY`` …)         ``Y``      6 (2000 steps)                   4, 6, 12
quarter (``Q``, ``QS``, ``BQ`` …)      ``Q``      8                                8, 16
month (``M``, ``MS``, ``ME``, ``BM``)  ``M``      12                               12, 24
week (``W``, every anchor)             ``W``      13 (2000 steps)                  13, 26
day (``D``)                            ``D``      14 (2000 steps)                  14, 28
business day (``B``, ``C``)            ``B``      10 (2000 steps)                  20
hour (``h``)                           ``h``      12 (2000 steps)                  24
minute (``min``)                       ``15min``  12 (2000 steps)                  24
=====================================  =========  ===============================  =============================

A panel's frequency maps to the base of its step family whatever the multiple (``2h`` → ``h``,
``5min`` → ``15min``, ``W-MON`` → ``W``, ``QS-JAN`` → ``Q``): the networks' shapes depend only on
the family (DeepAR's calendar features, ``gluonts.time_feature``), and DP fine-tuning adapts
the weights to the panel. The run's log line and ``meta["base"]`` name the base geometry used.
Only a ``season_length`` other than the frequency's default
(:func:`~.seasonality.season_length`) asks for weights pretrained at that season (exact key:
the user cache, else a pretraining run).

**DeepAR** is a recurrent network: none of its weights depends on the prediction or context
length, so the one file of a family serves every horizon and context.

**DLinear**'s two linear maps are ``context × (horizon · hidden)``; output step ``t`` reads rows
``t·hidden … (t+1)·hidden − 1`` only (gluonts reshapes the output to ``(horizon, hidden)``
before the distribution head). The first ``h`` output steps of a horizon-``H`` model are
therefore exactly a horizon-``h`` model: :func:`truncate_dlinear` keeps those rows. The
context cannot be cut that way (every output reads every input), so a run at horizon ``h``
uses the shipped model of the smallest horizon ``H ≥ h`` **and its context** ``3H``, when the
context length is left to its default; with a context length given, a shipped ``H ≥ h`` whose
context equals it. Horizons beyond the largest shipped one, other contexts, frequencies
outside the table (``SM``, ``bh``, seconds) and non-default season lengths pretrain once
(announced on stderr with a time estimate) and are cached.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .seasonality import _offset

__all__ = ["BASE_GEOMETRIES", "DEEPAR_HORIZONS", "DEFAULT_HORIZONS", "FALLBACK_HORIZON",
           "FAMILIES", "CHEAPER_STEPS", "BaseWeights", "base_freq", "base_geometry",
           "default_prediction_length", "truncate_dlinear", "pretrain_seconds_estimate"]

#: pandas offset class name → base frequency of its family (module docstring).
FAMILIES = {
    "YearBegin": "Y", "YearEnd": "Y", "BYearBegin": "Y", "BYearEnd": "Y",
    "QuarterBegin": "Q", "QuarterEnd": "Q", "BQuarterBegin": "Q", "BQuarterEnd": "Q",
    "MonthBegin": "M", "MonthEnd": "M", "BusinessMonthBegin": "M", "BusinessMonthEnd": "M",
    "Week": "W", "Day": "D", "BusinessDay": "B", "CustomBusinessDay": "B",
    "Hour": "h", "Minute": "15min",
}

#: base frequency → the ``forecast`` command's default horizon (``--prediction-length`` left
#: out; :func:`default_prediction_length`): M4's horizons (Y 6, Q 8, W 13, D 14) where they are
#: shipped, and where they are not, the one seasonal cycle that ships: monthly 12 (M4's 18
#: would take the shipped h = 24 DLinear with its context 72, longer than many monthly
#: panels' training parts; every measured number of the project is at 12), hourly 24 (one
#: day; M4's 48 ships for no model and would pretrain on first use), business days 10 (two
#: weeks; DeepAR's shipped horizon, DLinear's h = 20 cut to it), minutes 24 (the shipped
#: DLinear horizon). Every default is served by shipped weights of DLinear and DeepAR
#: (``tests/test_public_weights.py``).
DEFAULT_HORIZONS = {"Y": 6, "Q": 8, "M": 12, "W": 13, "D": 14, "B": 10, "h": 24, "15min": 24}
#: the default horizon of a frequency outside the step families (seconds, semi-months, ...)
FALLBACK_HORIZON = 12

#: base frequency → the horizon (context 2h) DeepAR's weights of the family are pretrained at;
#: they serve every horizon (module docstring)
DEEPAR_HORIZONS = {"Y": 6, "Q": 8, "M": 12, "W": 13, "D": 14, "B": 10, "h": 12, "15min": 12}

#: base frequency → (DeepAR pretraining horizon if its file ships, else None; DLinear shipped
#: horizons); every geometry listed ships (tests/test_public_weights.py checks the files
#: against this table). A family absent here pretrains once, announced.
BASE_GEOMETRIES: dict[str, tuple[Optional[int], tuple[int, ...]]] = {
    "Y": (6, (4, 6, 12)),  # 4 and 6: yearly panels are short (a context of 36 rarely fits)
    "Q": (8, (8, 16)),
    "M": (12, (12, 24)),
    "W": (13, (13, 26)),
    "D": (14, (14, 28)),
    "B": (10, (20,)),
    "h": (12, (24,)),
    "15min": (12, (24,)),
}

#: (model, base frequency) → at most this many pretraining steps: DeepAR's 5000-step recipe
#: (:data:`~.pretraining.PRETRAIN_RECIPE`) at monthly and quarterly data, 2000 steps in the
#: other families (on one CPU thread at load 7–13 a 5000-step run took 25–35 min; 2000 steps
#: let the other families be pretrained and shipped on 2026-11-28; the meta's ``recipe`` and
#: the file key say so)
CHEAPER_STEPS = {("deepar", base): 2000 for base in ("W", "D", "B", "h", "15min", "Y")}

#: DLinear's default context multiple at the shipped geometries (model_defaults' row)
_DLINEAR_CONTEXT_MULTIPLE = 3
#: DeepAR's default context multiple at the shipped geometries (model_defaults' row)
_DEEPAR_CONTEXT_MULTIPLE = 2


@dataclasses.dataclass(frozen=True)
class BaseWeights:
    """A shipped geometry serving a run: pretrained at ``freq`` (the family's base),
    ``prediction_length`` and ``context_length``; the run uses the first ``use_horizon`` output
    steps (DLinear) and the context ``run_context`` (None: any, DeepAR)."""

    model: str
    freq: str
    prediction_length: int
    context_length: int
    use_horizon: int
    run_context: Optional[int]

    def describe(self, panel_freq: str) -> str:
        text = (f"{self.model} pretrained at freq {self.freq}, horizon "
                f"{self.prediction_length}, context {self.context_length}")
        if self.freq != panel_freq:
            text += f" (the base of this panel's {panel_freq})"
        if self.model == "dlinear" and self.use_horizon != self.prediction_length:
            text += f"; its first {self.use_horizon} output steps (exact)"
        return text


def base_freq(freq: str) -> Optional[str]:
    """The base frequency of ``freq``'s step family, or None outside the table."""
    try:
        offset = _offset(freq)
    except ValueError:
        return None
    return FAMILIES.get(type(offset).__name__)


def default_prediction_length(freq: str) -> int:
    """The ``forecast`` command's horizon for a panel of frequency ``freq`` when
    ``--prediction-length`` is left out (:data:`DEFAULT_HORIZONS`, else
    :data:`FALLBACK_HORIZON`)."""
    return DEFAULT_HORIZONS.get(base_freq(freq), FALLBACK_HORIZON)


def base_geometry(model: str, *, freq: str, prediction_length: int,
                  context_length: Optional[int] = None,
                  series_length: Optional[int] = None) -> Optional[BaseWeights]:
    """The listed base geometry serving ``(model, freq, prediction_length, context_length)``
    (module docstring), or None (no family, horizon beyond the shipped ones, or another
    context). Whether its file exists is :func:`~.pretraining.shipped_weights_path`'s.

    ``series_length``: the shortest training series. A DLinear of a longer horizon ``H > h``
    brings its context ``3H``; it serves only when its window ``3H + h`` is shorter than that
    series (else every window would be mostly padding: a yearly panel of 17 training steps at
    ``h = 4`` would read 36 steps of context), and the run's own geometry is used instead."""
    base = base_freq(freq)
    if base is None or model not in ("deepar", "dlinear"):
        return None
    h = int(prediction_length)
    if model == "deepar":  # shipped or not: one pretraining of the family serves every horizon
        deepar_h = DEEPAR_HORIZONS[base]
        return BaseWeights("deepar", base, deepar_h, _DEEPAR_CONTEXT_MULTIPLE * deepar_h,
                           use_horizon=h, run_context=None)
    fits = [H for H in BASE_GEOMETRIES.get(base, (None, ()))[1] if H >= h and (
        context_length is None or _DLINEAR_CONTEXT_MULTIPLE * H == int(context_length)) and (
        series_length is None or H == h
        or _DLINEAR_CONTEXT_MULTIPLE * H + h < int(series_length))]
    if not fits:
        return None
    H = min(fits)
    c = _DLINEAR_CONTEXT_MULTIPLE * H
    return BaseWeights("dlinear", base, H, c, use_horizon=h, run_context=c)


def truncate_dlinear(state: dict, horizon: int, hidden_dimension: int) -> dict:
    """A DLinear ``state_dict`` for horizon ``horizon`` from one of a longer horizon: the first
    ``horizon · hidden_dimension`` rows of the two linear maps (their first ``horizon`` output
    steps, exactly); every other tensor unchanged.

    Raises:
        ValueError: the state is for a shorter horizon, or its rows are not a multiple of
            ``hidden_dimension``.
    """
    rows = int(horizon) * int(hidden_dimension)
    out = {}
    for name, tensor in state.items():
        if name.split(".")[0] in ("linear_seasonal", "linear_trend"):
            have = int(tensor.shape[0])
            if have < rows or have % int(hidden_dimension):
                raise ValueError(f"{name} has {have} output rows: not a DLinear map of a horizon "
                                 f">= {horizon} with hidden dimension {hidden_dimension}")
            tensor = tensor[:rows].clone()
        out[name] = tensor
    return out


#: seconds per pretraining step on one idle CPU thread (AMD EPYC, 2026-11-28), the DeepAR rate
#: at the monthly default geometry (window 24 + 13 lags + 12)
_SECONDS_PER_STEP = {"dlinear": 0.025, "simpleff": 0.025, "deepar": 0.045}


def pretrain_seconds_estimate(model: str, steps: int, prediction_length: int,
                              context_length: int) -> float:
    """A rough idle one-thread estimate of a pretraining run (longer under load): DeepAR's
    step time grows with the unrolled window (context + 13 lags + horizon)."""
    rate = _SECONDS_PER_STEP.get(model, 0.045)
    if model == "deepar":
        rate *= max(1.0, (int(context_length) + 13 + int(prediction_length)) / 49.0)
    return float(steps) * rate
