"""StructuredWindowSampler: Algorithms 3–6 of Schuchardt et al. (ICML 2025)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opacus_structured.accountants.structured import StructuredSubsamplingAccountant
from opacus_structured.samplers.structured import StructuredWindowSampler
from opacus_structured.schemes.structured import StructuredScheme


def make(lengths=None, seed=0, **kw):
    base = dict(num_series=12, series_length=30, context_length=4, forecast_length=3,
                batch_size=4)
    base.update(kw)
    scheme = StructuredScheme(**base)
    return scheme.sampler(lengths, generator=torch.Generator().manual_seed(seed))


def binomial_ok(count, n, p, z=5.0):
    return abs(count - n * p) <= z * np.sqrt(n * p * (1 - p)) + 1


def test_wor_wr_semantics_and_inclusion_frequency():
    """Each element's inclusion frequency per step matches ρ·r within binomial tolerance."""
    sampler = make(seed=1)
    s = sampler.scheme
    L_C, L_F, T = s.context_length, s.forecast_length, s.series_length - s.forecast_length + 1
    j = 15  # mid-series element: covered by L_C + L_F starts
    covering = set(range(j - L_F + 1, j + L_C + 1))  # starts whose window holds element j
    assert len(covering) == L_C + L_F
    hits = np.zeros(s.num_series)
    steps = 0
    for _ in range(800):
        for batch in sampler:
            steps += 1
            assert len(batch) == s.batch_size  # fixed batch size N'·λ
            series = [n for n, _ in batch]
            assert len(set(series)) == s.series_per_step  # distinct series (WOR)
            for n, t in batch:
                assert 0 <= t <= T - 1
                hits[n] += t in covering
    p = s.series_sampling_rate() * s.hit_probability()
    assert p == pytest.approx((4 / 12) * (7 / 28))
    for n in range(s.num_series):
        assert binomial_ok(hits[n], steps, p), (n, hits[n], steps * p)


def test_wr_lambda_gt_1_and_deterministic_partition():
    sampler = make(instances_per_series=2, batch_size=4, top_level="deterministic",
                   bound="upper")
    assert len(sampler) == 12 * 2 // 4 == 6
    seen = []
    for batch in sampler:
        assert len(batch) == 4
        seen.extend(n for n, _ in batch[::2])
        assert batch[0][0] == batch[1][0]  # λ windows per drawn series
    assert seen == list(range(12))  # Algorithm 3: consecutive blocks, each series once


def test_shuffle_uses_every_series_once_per_epoch():
    sampler = make(top_level="shuffle")
    epochs = [sorted(n for b in sampler for n, _ in b) for _ in range(3)]
    assert all(e == list(range(12)) for e in epochs)
    orders = [[n for b in sampler for n, _ in b] for _ in range(2)]
    assert orders[0] != orders[1]


def test_poisson_bottom_level_rate():
    sampler = make(bottom_level="poisson", top_level="deterministic", instances_per_series=2,
                   batch_size=4)
    T = 28
    counts = np.zeros(T)
    sizes = []
    for _ in range(300):
        for batch in sampler:
            sizes.append(len(batch))
            for _, t in batch:
                counts[t] += 1
    n_series_draws = 300 * 12  # every series once per epoch
    rate = 2 / T
    for t in range(T):
        assert binomial_ok(counts[t], n_series_draws, rate)
    assert len(set(sizes)) > 1  # variable batch size


def test_variable_lengths_and_errors():
    lengths = [30, 40, 35, 30, 50, 60, 30, 31, 32, 33, 34, 90]
    sampler = make(lengths)
    T = np.asarray(lengths) - 3 + 1
    for _ in range(50):
        for batch in sampler:
            for n, t in batch:
                assert 0 <= t < T[n]
    with pytest.raises(ValueError, match="from_lengths"):
        make([29] + lengths[1:])
    with pytest.raises(ValueError, match="forecast_length"):
        make([2] + lengths[1:])
    with pytest.raises(ValueError, match="one length per series"):
        make(lengths[:-1])
    with pytest.raises(ValueError, match="forecast_length"):
        StructuredScheme(num_series=2, series_length=2, context_length=1, forecast_length=3,
                         batch_size=1)
    # Poisson + variable lengths with a short worst case is not covered
    short = StructuredScheme(num_series=3, series_length=5, context_length=4,
                             forecast_length=3, batch_size=1, bottom_level="poisson",
                             top_level="deterministic")
    with pytest.raises(ValueError, match="poisson"):
        short.sampler([5, 6, 9])
    short.sampler([5, 5, 5])  # equal lengths: fine


def test_boundary_length_equals_context_plus_forecast():
    """L = L_C + L_F: T = L_C + 1 starts; the first ones read padding zeros."""
    s = StructuredScheme(num_series=2, series_length=7, context_length=4, forecast_length=3,
                         batch_size=1)
    assert s.hit_probability() == 1.0  # k = min(7, T = 5) = 5 = T
    sampler = s.sampler(generator=torch.Generator().manual_seed(0))
    starts = {t for _ in range(200) for b in sampler for _, t in b}
    assert starts == set(range(5))
    L1 = StructuredScheme(num_series=2, series_length=3, context_length=4, forecast_length=3,
                          batch_size=1).sampler(generator=torch.Generator().manual_seed(0))
    assert {t for b in L1 for _, t in b} == {0}


@pytest.mark.parametrize("kw", [dict(), dict(top_level="shuffle"),
                                dict(bottom_level="poisson", top_level="deterministic")])
def test_state_dict_resumes_exactly(kw):
    a = make(seed=7, **kw)
    full = [b for _ in range(2) for b in a]
    b = make(seed=7, **kw)
    it = iter(b)
    first = [next(it) for _ in range(2)]
    state = b.state_dict()
    c = make(seed=123, **kw)
    c.load_state_dict(state)
    rest = list(c) + list(c)
    assert first + rest == full
    with pytest.raises(ValueError, match="sampler state"):
        make(seed=1, batch_size=3).load_state_dict(state)


def test_sampler_drives_dataloader_and_accountant():
    from opacus_structured.forecasting.windowing import WindowDataset

    rng = np.random.default_rng(0)
    series = [rng.normal(size=30 + i) for i in range(12)]
    scheme = StructuredScheme.from_lengths([len(x) for x in series], context_length=4,
                                           forecast_length=3, batch_size=4)
    sampler = scheme.sampler([len(x) for x in series], generator=torch.Generator().manual_seed(0))
    ds = WindowDataset.from_scheme(series, scheme)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=ds.collate)
    assert len(loader) == scheme.steps_per_epoch() == 3
    acc = StructuredSubsamplingAccountant.from_sampler(sampler, discretization=1e-3)
    for batch in loader:
        assert batch["target"].shape == (4, 3)
        acc.step(noise_multiplier=2.0, sample_rate=1 / len(loader))
    assert len(acc) == 3 and acc.get_epsilon(1e-5) > 0


def test_throughput_is_vectorised():
    import time

    s = StructuredScheme(num_series=2000, series_length=500, context_length=48,
                         forecast_length=24, batch_size=256)
    sampler = s.sampler(generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    n = sum(len(b) for b in sampler)
    rate = n / (time.perf_counter() - t0)
    assert rate > 2e4, rate  # windows per second (typically ~1e6)
    assert isinstance(sampler, StructuredWindowSampler)
