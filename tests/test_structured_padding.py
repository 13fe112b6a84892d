"""Issue 29, case 7: a context + forecast window as long as the series (structured scheme).

Such a window is accepted (the trainer's gluonts splitter and :class:`WindowDataset` left-pad
with zeros, Algorithm 4 of Schuchardt et al.), so the scheme must *say* what the padding does
and price it soundly. Independent oracles: a brute-force count of the windows that contain
each element, cut by :class:`WindowDataset` itself (padding included), and dp_accounting's
Poisson-subsampled Gaussian (the ``r = 1`` case of Theorem 4.4).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from opacus_structured import cli
from opacus_structured.accounting import structured as st
from opacus_structured.forecasting.windowing import WindowDataset
from opacus_structured.schemes.structured import StructuredScheme

# issue 29 case 7: N = 600, Λ = 60, L = 10, L_C = 20, L_F = 5, σ = 1, δ = 1e-5
SHORT = dict(num_series=600, series_length=10, context_length=20, forecast_length=5,
             batch_size=60)


def brute_force_windows_per_element(L, L_C, L_F, relation="event", w=1):
    """Max over protected units of the number of starts whose padded window reads one of its
    values, counted on the windows WindowDataset cuts (marker series: value j+1 at index j,
    zeros are padding)."""
    ds = WindowDataset([np.arange(1, L + 1, dtype=np.float64)], L_C, L_F)
    T = L - L_F + 1
    read = []
    for s in range(T):
        item = ds[(0, s)]
        values = torch.cat([item["past"][~item["past_is_pad"]], item["target"]])
        read.append({int(v) - 1 for v in values.tolist()})
        # padding is zeros and flagged: never a data value
        assert (item["past"][item["past_is_pad"]] == 0).all()
    if relation == "event":
        units = [set(range(j, j + w)) for j in range(L - w + 1)]
    else:  # w-user: any w indices; the worst case is the union count, bounded by brute force
        units = [set(c) for c in __import__("itertools").combinations(range(L), w)]
    return max(sum(1 for r in read if r & u) for u in units), T


@pytest.mark.parametrize("L,L_C,L_F,relation,w", [
    (10, 20, 5, "event", 1), (7, 4, 3, "event", 1), (3, 4, 3, "event", 1),
    (12, 3, 2, "event", 1), (30, 4, 3, "event", 1), (9, 2, 2, "event", 3),
    (9, 2, 2, "user", 2), (6, 0, 1, "event", 1), (8, 10, 1, "user", 3),
])
def test_priced_windows_bound_the_padded_windows(L, L_C, L_F, relation, w):
    """k priced >= the windows (padding included) that can read a protected unit, with
    equality (tight): padding adds no window."""
    count, T = brute_force_windows_per_element(L, L_C, L_F, relation, w)
    k = st.windows_per_element(L_C, L_F, L, relation, w)
    assert k >= count
    if relation == "event":
        assert k == count
    pad = st.padding_summary(st.StructuredSetting(
        num_series=1, series_length=L, context_length=L_C, forecast_length=L_F,
        batch_size=1, relation=relation, w=w))
    assert pad["start_positions"] == T
    assert pad["padded_starts"] == sum(1 for s in range(T) if s < L_C)
    assert pad["every_start_covers_element"] == (k == T and
                                                 pad["windows_per_element_unclamped"] >= T)


def test_short_series_is_stated_in_describe_and_notes():
    """Fails on the code before case 7: nothing said the window covers every start."""
    s = StructuredScheme(**SHORT)
    pad = s.describe()["padding"]
    assert pad["window_exceeds_series"] and pad["every_start_covers_element"]
    assert pad["window_sampling_amplifies"] is False
    assert pad["start_positions"] == 6 and pad["padded_starts"] == 6
    assert s.hit_probability() == 1.0
    (note,) = s.notes()
    for part in ("series_length=10", "context_length=20", "forecast_length=5", "T = 6",
                 "r = 1", "padding", "longer than 29"):
        assert part in note, part
    # a long series: nothing to say, window sampling amplifies
    long = StructuredScheme(**dict(SHORT, series_length=30))
    assert long.notes() == [] and long.padding()["window_sampling_amplifies"]
    assert long.hit_probability() == pytest.approx(25 / 26)
    # Poisson bottom level: every start covers the element, but the rate still amplifies
    pois = StructuredScheme(**dict(SHORT, top_level="deterministic", bottom_level="poisson"))
    assert pois.padding()["every_start_covers_element"]
    assert pois.padding()["window_sampling_amplifies"]
    assert "r = 1" not in pois.notes()[0]


def test_short_series_epsilon_is_the_series_level_mechanism():
    """r = 1: the bottom level amplifies nothing. With ρ = 1 every step is the Gaussian
    mechanism of sensitivity 2C: T steps are μ-GDP with μ = 2√T/σ (closed form). With
    ρ = 0.1 the scheme prices exactly what a series of one value (L = L_F = 1, L_C = 0, no
    padding at all) gets, and at least dp_accounting's Poisson-subsampled Gaussian
    (sensitivity 2C, rate ρ, max of add and remove)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    from opacus_structured.accounting.gaussian import gdp_delta

    sigma, steps, delta = 2.0, 5, 1e-5
    full = StructuredScheme(**dict(SHORT, num_series=60))
    assert full.series_sampling_rate() == 1.0 and full.hit_probability() == 1.0
    eps = full.epsilon(sigma, steps, delta, discretization=1e-3)
    mu = 2 * np.sqrt(steps) / sigma
    assert gdp_delta(eps, mu) <= delta * (1 + 1e-6)
    assert gdp_delta(eps - 0.05, mu) > delta  # and not much above the exact value

    s = StructuredScheme(**SHORT)
    one_value = StructuredScheme(num_series=600, series_length=1, context_length=0,
                                 forecast_length=1, batch_size=60)
    steps = 10
    ours = s.epsilon(1.0, steps, delta, discretization=1e-3)
    assert ours == one_value.epsilon(1.0, steps, delta, discretization=1e-3)
    ref = pld.from_gaussian_mechanism(standard_deviation=1.0, sensitivity=2.0,
                                      sampling_prob=0.1, value_discretization_interval=1e-3)
    assert ours >= ref.self_compose(steps).get_epsilon_for_delta(delta) - 1e-3
    assert ours == pytest.approx(12.48, abs=0.05)


def test_cli_prints_the_note_and_records_it(capsys):
    argv = ["epsilon", "structured", "--num-series", "600", "--series-length", "10",
            "--context-length", "20", "--forecast-length", "5", "--batch-size", "60",
            "--noise-multiplier", "1", "--steps", "2", "--delta", "1e-5",
            "--discretization", "1e-3", "--no-progress", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["parameters"]["padding"]["every_start_covers_element"] is True
    assert len(record["notes"]) == 1 and "r = 1" in record["notes"][0]
    assert "note: series_length=10" in err
    # a series long enough: no note
    argv[argv.index("--series-length") + 1] = "40"
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "notes" not in json.loads(out) and "note:" not in err
