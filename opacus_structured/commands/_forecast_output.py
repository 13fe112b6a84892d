"""The ``forecast`` command's output and path checks (split out of
:mod:`opacus_structured.commands.forecast`): the result table, the forecast and ε-sweep plots,
and :func:`check_paths`, which checks every input and output path before any training."""

from __future__ import annotations

import math
import os

#: Defaults of the DP recipe, chosen on public panels only (``benchmarks/forecast_recipe.py``;
#: docs/guides/forecasting.md shows the study): fine-tuning the public pretrained weights.


def _fmt(x, spec=".4g"):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _table(rows: list[dict]) -> str:
    head = ["method", "epsilon", "sigma", "steps", "CRPS", "MASE", "time [s]"]
    body = [[r["method"], "not private" if r.get("private") is False and r.get("epsilon") is None
             else _fmt(r.get("epsilon"), ".3g"), _fmt(r.get("noise_multiplier"), ".3g"),
             _fmt(r.get("steps"), "d"), _fmt(r["crps"], ".4f"), _fmt(r["mase"], ".3f"),
             _fmt(r.get("seconds"), ".1f")] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=False)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


#: Line styles of the plotted methods after the first (the released forecast, drawn in blue
#: with its 10–90 % band): (colour, line style) in the order of the table's rows.
_PLOT_STYLES = (("tab:orange", "-"), ("tab:green", "-."), ("tab:red", "--"),
                ("tab:purple", ":"), ("tab:brown", "-"), ("tab:gray", "-"))


def _plot_privacy(report) -> str:
    """The released forecast's privacy for the plot: ``"ε = 0.997, δ = 1e-07"`` (DP),
    ``"ε = ∞ (non-private)"``, or the NOT-private mechanism's ε of a seeded run."""
    if not report.get("dp_sgd"):
        return "ε = ∞ (non-private)"
    eps = report.get("epsilon")
    text = (f"ε = {_fmt(eps, '.3g')}, δ = {report['delta']:g}, "
            f"σ = {_fmt(report.get('noise_multiplier'), '.3g')}")
    return text if report.get("private") else f"{text} (mechanism; NOT private: seeded)"


def _plot(path, panel_test, forecasts_by_method: dict, series_idx, prediction_length,
          banner=None, privacy=None):
    """Four test series with the median forecast of every method (the first, the released
    forecast, with its 10–90 % band; ``privacy``, e.g. ``"ε = 1, δ = 1e-07"``, in its legend
    label and the figure title). Saves to ``path`` and returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    if len(forecasts_by_method) > 1 + len(_PLOT_STYLES):
        raise ValueError(f"at most {1 + len(_PLOT_STYLES)} methods can be plotted, got "
                         f"{len(forecasts_by_method)}")
    n = len(series_idx)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n), squeeze=False)
    for ax, i in zip(axes[:, 0], series_idx, strict=False):
        y = panel_test.targets[i]
        hist = min(len(y), 4 * prediction_length)
        dates = pd.period_range(panel_test.starts[i], periods=len(y),
                                freq=panel_test.freq).to_timestamp()
        xs = dates[len(y) - hist:]
        ax.plot(xs, y[-hist:], color="black", lw=1.2, label="observed")
        x_f = dates[len(y) - prediction_length:]
        for k, (name, fcs) in enumerate(forecasts_by_method.items()):
            f = fcs[i]
            if k == 0:  # the released forecast
                label = f"{name} median" + (f" ({privacy})" if privacy else "")
                ax.plot(x_f, f.quantile(0.5), color="tab:blue", lw=1.6, label=label)
                ax.fill_between(x_f, f.quantile(0.1), f.quantile(0.9), color="tab:blue",
                                alpha=0.2)
            else:
                color, ls = _PLOT_STYLES[k - 1]
                ax.plot(x_f, f.quantile(0.5), color=color, ls=ls, lw=1.1,
                        label=f"{name} median")
        ax.set_title(_plot_title(panel_test, i), fontsize=9)
        ax.axvline(dates[len(y) - prediction_length], color="grey", ls=":", lw=0.8)
        ax.set_ylabel("value")
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("date (shaded: 10–90% band of the released forecast; from the "
                           "dotted line on: test)")
    title = f"released forecast: {privacy}" if privacy else None
    if banner:  # e.g. NOT_PRIVATE_SEEDED
        fig.suptitle(banner + (f"\n{title}" if title else ""), color="tab:red", fontsize=10,
                     fontweight="bold")
    elif title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _plot_title(panel, i) -> str:
    """``"title (id)"``, or the id alone when there is no title or it is the id."""
    item = str(panel.item_ids[i])
    title = str(panel.titles[i]) if panel.titles else item
    return item if title == item else f"{title} ({item})"


def _sweep_entry(budget, res, row) -> dict:
    return {"target_epsilon": budget, "method": row["method"], "epsilon": res.epsilon,
            "private": res.private,
            "dp_sgd": res.dp_sgd, "noise_multiplier": res.noise_multiplier,
            "steps": res.steps, "crps": row["crps"], "mase": row["mase"],
            "runs": row.get("runs"), "train_seconds": res.train_seconds}


def _plot_sweep(path, sweep, baselines, model, banner=None):
    """CRPS and MASE against ε (the layout of Table 1 of Schuchardt et al. 2025), with the
    seasonal-naive, non-private and zero-shot levels as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in sweep if math.isfinite(e["target_epsilon"])]
    infinite = [e for e in sweep if not math.isfinite(e["target_epsilon"])]
    xs = [e["target_epsilon"] for e in finite]
    x_inf = (max(xs) * 2.5) if xs else 1.0
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric in zip(axes, ("crps", "mase"), strict=True):
        ax.plot(xs, [e[metric] for e in finite], "o-", color="tab:blue", label=f"{model} DP")
        if infinite:
            ax.plot([x_inf], [infinite[0][metric]], "s", color="tab:blue",
                    label=f"{model} at ε=∞ (DP path)")
        for key, name, style in (("seasonal_naive", "seasonal naive", ("tab:red", "--")),
                                 ("non_private", f"{model} non-private", ("black", ":")),
                                 ("zero_shot", "pretrained, zero-shot", ("tab:green", "-.")),
                                 ("ets", "statsmodels ETS (NOT PRIVATE)",
                                  ("tab:purple", (0, (1, 3))))):
            if key in baselines and metric in baselines[key]:
                ax.axhline(baselines[key][metric], color=style[0], ls=style[1], lw=1,
                           label=name)
        ax.set_xscale("log")
        ticks = xs + ([x_inf] if infinite else [])
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in xs] + (["∞"] if infinite else []))
        ax.minorticks_off()
        ax.set_xlabel("ε (δ fixed)")
        ax.set_ylabel(metric.upper())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if banner:
        fig.suptitle(banner, color="tab:red", fontsize=10, fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _writable_target(flag: str, path: str, *, directory: bool) -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``path`` can be written: a directory (or a
    file) that exists and is writable, or a new one whose nearest existing parent is a
    writable directory. Nothing is created."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if directory and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a file, not a directory")
        if not directory and os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a directory, not a file path")
        probe = path
    else:
        probe = os.path.dirname(path)
        while probe and not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if not os.path.isdir(probe):
            raise ValueError(f"{flag} {path!r} cannot be created: {probe!r} is not a directory")
    if not os.access(probe, os.W_OK | (os.X_OK if os.path.isdir(probe) else 0)):
        raise ValueError(f"{flag} {path!r} is not writable (no write permission on "
                         f"{probe!r})")
    if directory and os.path.isdir(path):
        _check_output_folders(flag, path)


def _check_output_folders(flag: str, path: str) -> None:
    """What ``--output DIR`` will write into an existing ``DIR``: ``release/`` and
    ``diagnostics/`` must be folders (or absent), an existing ``release/`` one that this
    command wrote (it holds ``model_card.json``; it is replaced) or an empty one, and the
    diagnostics' files must be overwritable (:mod:`._forecast_release`)."""
    for sub in ("release", "diagnostics"):
        folder = os.path.join(path, sub)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"{flag} {path!r}: {folder!r} is a file, not a directory")
    release = os.path.join(path, "release")
    if (os.path.isdir(release) and os.listdir(release)
            and not os.path.exists(os.path.join(release, "model_card.json"))):
        raise ValueError(f"{flag} {path!r}: {release!r} exists and was not written by this "
                         "command (it would be replaced by the release); choose another "
                         f"{flag}")
    for name in ("report.json", "forecasts.png", "sweep.png", "README.md"):
        f = os.path.join(path, "diagnostics", name)
        if os.path.exists(f) and (os.path.isdir(f) or not os.access(f, os.W_OK)):
            raise ValueError(f"{flag} {path!r}: {f!r} cannot be overwritten")


def check_paths(args) -> None:
    """Check every input and output path of ``args`` before any data is read or any training
    runs (one-line ``ValueError`` naming the flag): ``--data`` and ``--init-from PATH`` must be
    readable files, ``--output`` a writable (or creatable) directory, ``--save-weights`` a
    writable (or creatable) file path."""
    data = getattr(args, "data", None)
    if data is not None:
        if not os.path.exists(data):
            raise ValueError(f"--data {data!r}: no such file")
        if not os.path.isfile(data):
            raise ValueError(f"--data {data!r} is not a file (a CSV file is expected)")
        if not os.access(data, os.R_OK):
            raise ValueError(f"--data {data!r} is not readable (no read permission)")
    init_from = getattr(args, "init_from", None)
    if init_from not in (None, "public", "none"):
        if not os.path.isfile(init_from):
            raise ValueError(f"--init-from {init_from!r}: no such file (use --init-from public "
                             "for the public pretrained weights or --init-from none for a "
                             "random initialisation)")
        if not os.access(init_from, os.R_OK):
            raise ValueError(f"--init-from {init_from!r} is not readable (no read permission)")
    if getattr(args, "output", None):
        _writable_target("--output", args.output, directory=True)
    if getattr(args, "save_weights", None):
        _writable_target("--save-weights", args.save_weights, directory=False)
