"""``opacus-structured plot structured``: δ(ε) curves of structured subsampling (log–log).

Examples (the paper's Fig. 2 and Fig. 4 comparisons, Schuchardt et al. ICML 2025)::

    opacus-structured plot structured --preset fig2 -o fig2.png
    opacus-structured plot structured --preset fig4 -o fig4.png
    opacus-structured plot structured --num-series 320 --series-length 20 --context-length 1 \\
        --forecast-length 1 --batch-size 32 --noise-multiplier 1 --steps 10 100 \\
        --curve top_level=deterministic --curve top_level=wor -o mine.png

Each ``--curve`` overrides fields of the base scheme (``key=value[,key=value]``); every curve is
drawn after each of the ``--steps`` counts. Curves priced by an optimistic lower bound are
labelled "(lower bound)" and dashed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Iterable, Sequence

import numpy as np

from .. import _progress
from ..accounting import pld as pld_lib
from ..schemes.structured import StructuredScheme
from ._registry import register_command

__all__ = ["structured_curves", "PRESETS", "parse_curve", "coinciding_curves"]

_FIG_BASE = dict(num_series=320, series_length=20, context_length=1, forecast_length=1,
                 batch_size=32)

#: Paper settings (Schuchardt et al., ICML 2025, Fig. 2): N = 320, Λ = 32, σ = 1, r = 0.1 (L_C = L_F = 1, L = 20).
PRESETS = {
    "fig2": dict(base=_FIG_BASE, noise_multiplier=1.0, steps=[1, 10, 100],
                 curves=[{"top_level": "deterministic"}, {"top_level": "wor"}]),
    "fig4": dict(base=_FIG_BASE, noise_multiplier=1.0, steps=[1, 100],
                 curves=[{"instances_per_series": 1}]
                 + [{"instances_per_series": lam, "bound": "lower"} for lam in (2, 4, 8)]),
}

_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(StructuredScheme)}


def parse_curve(text: str) -> dict:
    """``"top_level=wor,instances_per_series=2"`` → dict with typed values."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"--curve entries are key=value, got {part!r}")
        key, value = (s.strip() for s in part.split("=", 1))
        key = key.replace("-", "_")
        if key == "lambda":
            key = "instances_per_series"
        if key not in _FIELD_TYPES:
            raise ValueError(f"--curve: unknown scheme field {key!r}; known: {sorted(_FIELD_TYPES)}")
        kind = str(_FIELD_TYPES[key])
        out[key] = int(value) if kind == "int" else float(value) if kind == "float" else value
    return out


def structured_curves(base: StructuredScheme, curves: Iterable[dict], steps: Sequence[int],
                      noise_multiplier: float, epsilons, *,
                      discretization: float = 1e-3) -> list[dict]:
    """δ(ε) after each step count for each variant of ``base``.

    Returns dicts with ``label``, ``scheme``, ``steps``, ``compositions``, ``bound``,
    ``epsilons``, ``deltas``.
    """
    eps = np.asarray(epsilons, dtype=np.float64)
    rows = []
    for change in curves:
        scheme = dataclasses.replace(base, **change)
        unit = scheme.pld(noise_multiplier, discretization=discretization)
        for n in steps:
            k = scheme.compositions(n)
            composed = pld_lib.self_compose(unit, k)
            deltas = np.atleast_1d(pld_lib.delta_for_epsilon(composed, eps))
            desc = ", ".join(f"{key}={val}" for key, val in change.items()) or "base"
            label = (f"{desc} [{scheme.theorem}] after {n} step{'s' if n != 1 else ''}"
                     + (f" ({k} epoch{'s' if k != 1 else ''})" if scheme.unit == "epoch" else "")
                     + (" (lower bound)" if scheme.bound == "lower" else ""))
            rows.append(dict(label=label, scheme=scheme, steps=n, compositions=k,
                             bound=scheme.bound, epsilons=eps, deltas=deltas))
    return rows


def coinciding_curves(rows: Sequence[dict], *, rtol: float = 1e-9) -> list:
    """For each row, the index of an earlier row with the same ε grid and δ(ε) (to ``rtol``),
    else ``None``: such a curve would be drawn exactly over the earlier one and be invisible."""
    out = []
    for i, row in enumerate(rows):
        twin = next((j for j in range(i)
                     if np.array_equal(rows[j]["epsilons"], row["epsilons"])
                     and np.allclose(rows[j]["deltas"], row["deltas"], rtol=rtol, atol=0.0)),
                    None)
        out.append(twin)
    return out


def _add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plot_kind", required=True)
    sp = sub.add_parser("structured", help="δ(ε) curves of structured subsampling")
    sp.add_argument("--preset", choices=sorted(PRESETS),
                    help="paper figure settings (Schuchardt et al., ICML 2025, Fig. 2 / Fig. 4); "
                         "flags given as well override the preset")
    for flag, kind, metavar, helptext in (
            ("--num-series", int, "N", "number of time series N"),
            ("--series-length", int, "L", "length L of every series"),
            ("--context-length", int, "LC", "context (input) window length L_C"),
            ("--forecast-length", int, "LF", "forecast (target) window length L_F"),
            ("--batch-size", int, "B", "batch size Λ (windows per step)"),
            ("--instances-per-series", int, "LAMBDA",
             "windows drawn per sampled series λ (default 1)"),
            ("--w", int, "W", "bottom-level window-start range W (default: all starts)"),
            ("--context-noise", float, "SC", "data-augmentation noise σ_C on the context"),
            ("--forecast-noise", float, "SF", "data-augmentation noise σ_F on the forecast")):
        sp.add_argument(flag, type=kind, metavar=metavar, help=helptext)
    sp.add_argument("--top-level", choices=("wor", "deterministic", "shuffle"),
                    help="how series are chosen per step: without replacement, deterministic "
                         "(cyclic) or shuffled epochs")
    sp.add_argument("--bottom-level", choices=("wr", "poisson"),
                    help="how windows are drawn inside a series: with replacement or Poisson")
    sp.add_argument("--relation", choices=("event", "user"),
                    help="neighbouring relation: one time step (event) or one whole series (user)")
    sp.add_argument("--bound", choices=("tight", "upper", "lower"),
                    help="which analysis prices the scheme (lower: optimistic, not a guarantee)")
    sp.add_argument("--noise-multiplier", type=float, help="σ (preset: 1)")
    sp.add_argument("--steps", type=int, nargs="+", help="step counts (one curve each)")
    sp.add_argument("--curve", action="append", default=[],
                    help="scheme overrides key=value[,key=value] for one curve (repeatable)")
    sp.add_argument("--eps-min", type=float, default=1e-3,
                    help="smallest ε on the x axis (default %(default)g)")
    sp.add_argument("--eps-max", type=float, default=10.0,
                    help="largest ε on the x axis (default %(default)g)")
    sp.add_argument("--points", type=int, default=120,
                    help="ε values per curve, log-spaced (default %(default)d)")
    sp.add_argument("--discretization", type=float, default=1e-3,
                    help="pessimistic PLD discretisation (default %(default)g)")
    sp.add_argument("-o", "--output", required=True,
                    help="output image (PNG/PDF/SVG); its directory is created")
    sp.add_argument("--title", default=None, help="figure title (default: names σ)")
    sp.add_argument("--no-progress", action="store_true",
                    help="no progress bar on stderr (it is hidden anyway when stderr is not a "
                         "terminal)")


def _run(args) -> int:
    preset = PRESETS.get(args.preset) if args.preset else None
    base = dict(preset["base"]) if preset else {}
    for key in ("num_series", "series_length", "context_length", "forecast_length",
                "batch_size", "instances_per_series", "w", "context_noise", "forecast_noise",
                "top_level", "bottom_level", "relation", "bound"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    missing = [k for k in ("num_series", "series_length", "context_length", "forecast_length",
                           "batch_size") if k not in base]
    if missing:
        raise ValueError("plot structured needs --preset or --" + ", --".join(
            m.replace("_", "-") for m in missing))
    sigma = args.noise_multiplier or (preset["noise_multiplier"] if preset else None)
    if sigma is None or sigma <= 0:
        raise ValueError("--noise-multiplier must be > 0")
    steps = args.steps or (preset["steps"] if preset else None)
    if not steps or min(steps) < 1:
        raise ValueError("--steps needs one or more step counts >= 1")
    curves = [parse_curve(c) for c in args.curve] or (preset["curves"] if preset else [{}])
    if not 0 < args.eps_min < args.eps_max:
        raise ValueError("need 0 < --eps-min < --eps-max (log axis)")
    if args.points < 2:
        raise ValueError("--points must be >= 2")
    eps = np.logspace(np.log10(args.eps_min), np.log10(args.eps_max), args.points)
    with _progress.elapsed("pricing curves", show=_progress.enabled(args.no_progress)):
        rows = structured_curves(StructuredScheme(**base), curves, steps, sigma, eps,
                                 discretization=args.discretization)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, twin in zip(rows, coinciding_curves(rows), strict=True):
        d = np.maximum(row["deltas"], 1e-300)
        style = dict(linestyle="--" if row["bound"] == "lower" else "-", label=row["label"])
        if twin is not None:  # drawn exactly over an earlier curve: markers + dots, and say so
            style.update(linestyle=":", marker="o", markevery=max(1, len(d) // 12),
                         markersize=4, markerfacecolor="none",
                         label=f"{row['label']} (coincides with curve {twin + 1})")
        ax.loglog(row["epsilons"], d, **style)
    ax.set_xlabel("ε")
    ax.set_ylabel("δ(ε)")
    ax.set_title(args.title or f"structured subsampling, σ = {sigma:g}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # like forecast
        fig.savefig(args.output, dpi=110)
    except OSError as exc:  # unwritable directory, unknown extension's backend error, ...
        raise ValueError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    print(f"wrote {args.output} ({len(rows)} curves)")
    return 0


register_command("plot", "plot privacy curves (plot structured ...)", _add_arguments, _run)
