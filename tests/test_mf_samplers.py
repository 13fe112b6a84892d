"""MF batch samplers: exact mode distributions (b = 2, n = 3), invariants, resumption."""

import itertools

import numpy as np
import pytest
import torch

from opacus_structured.accounting.bminsep_mc import (
    bminsep_sampling_prob,
    bminsep_stationary_rate,
)
from opacus_structured.samplers.balls_in_bins import BallsInBinsBatchSampler
from opacus_structured.samplers.bminsep import BMinSepBatchSampler, WarmStartBMinSepBatchSampler
from opacus_structured.samplers.cyclic_poisson import CyclicPoissonBatchSampler
from opacus_structured.samplers.multi_attribution import MultiAttributionBMinSepBatchSampler
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme


def _patterns(sampler, n_steps):
    x = np.zeros((sampler.num_samples, n_steps), dtype=int)
    i = 0
    while i < n_steps:  # iterate epochs until n_steps batches were drawn
        for batch in sampler:
            for e in batch:
                x[e, i] = 1
            i += 1
            if i == n_steps:
                break
    return x


def _exact_bminsep_modes(p, b, n, warm):
    """Brute force over the definitions of Algorithms 1/2 (arXiv:2602.09338): initial state ×
    Bernoulli coins."""
    probs = {}
    starts = [(0, 1.0)]
    if warm and b > 1:
        starts = [(0, 1 / (1 + (b - 1) * p))] + [
            (s, (b - 1) * p / (1 + (b - 1) * p) / (b - 1)) for s in range(1, b)]
    for s, ps in starts:
        for coins in itertools.product([0, 1], repeat=n):
            pr, x, last = ps, [], (-s if s else -10**9)  # virtual batch -s
            for i, c in enumerate(coins):
                pr *= p if c else 1 - p
                avail = i - last >= b
                x.append(int(c and avail))
                if c and avail:
                    last = i
            probs[tuple(x)] = probs.get(tuple(x), 0.0) + pr
    return probs


@pytest.mark.parametrize("warm", [False, True])
def test_bminsep_mode_distribution_b2_n3(warm):
    p, b, n, m = 0.4, 2, 3, 40000
    exact = _exact_bminsep_modes(p, b, n, warm)
    # Closed forms, cold start (Markov chain of Fig. 1): P(000)=(1-p)^3, P(101)=p^2, ...
    if not warm:
        assert exact[(0, 0, 0)] == pytest.approx((1 - p) ** 3)
        assert exact[(1, 0, 1)] == pytest.approx(p * p)
        assert exact[(1, 0, 0)] == pytest.approx(p * (1 - p))
        assert exact[(0, 1, 0)] == pytest.approx((1 - p) * p)
        assert exact[(0, 0, 1)] == pytest.approx((1 - p) ** 2 * p)
        assert set(exact) == {(0, 0, 0), (1, 0, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)}
    sampler = BMinSepBatchSampler(m, p, b, warm_start=warm, steps=n, seed=123)
    x = _patterns(sampler, n)
    keys, counts = np.unique(x, axis=0, return_counts=True)
    emp = {tuple(k): c / m for k, c in zip(keys, counts, strict=True)}
    assert set(emp) <= set(exact)
    for k, pk in exact.items():  # 5-sigma binomial tolerance
        assert abs(emp.get(k, 0.0) - pk) <= 5 * np.sqrt(pk * (1 - pk) / m) + 1e-12


def test_min_sep_invariant_and_warm_stationary_batch_size():
    N, B, b = 5000, 100, 8
    s = BMinSepBatchSampler.from_expected_batch_size(N, B, b, seed=0)
    assert isinstance(s, WarmStartBMinSepBatchSampler)
    assert bminsep_stationary_rate(s.p, b) == pytest.approx(B / N)
    assert s.p == pytest.approx(B / (N - (b - 1) * B))
    n = 60
    x = _patterns(BMinSepBatchSampler(N, s.p, b, warm_start=True, steps=n, seed=1), n)
    for e in range(N):
        idx = np.flatnonzero(x[e])
        assert np.all(np.diff(idx) >= b)
    sizes = x.sum(0)
    # E|B_i| = N p0 = B at every step; each step's size ~ sd ~ 10.
    assert abs(sizes[:4].mean() - B) < 4 * 10 / 2 and abs(sizes.mean() - B) < 3
    cold = _patterns(BMinSepBatchSampler(N, s.p, b, steps=n, seed=1), 1)
    assert abs(cold.sum() - N * s.p) < 5 * np.sqrt(N * s.p)  # cold start: E|B_0| = N p


def test_warm_start_p1_is_balls_in_bins():
    N, T = 200, 5
    s = BMinSepBatchSampler(N, 1.0, T, warm_start=True, steps=T, seed=3)
    x = _patterns(s, 3 * T)
    assert np.all(x.sum(1) == 3)  # every example exactly once per T steps, same slot
    first = x[:, :T].argmax(1)
    assert np.all(x[np.arange(N), first + T] == 1)


def test_truncated_and_padded():
    s = BMinSepBatchSampler(1000, 0.2, 3, truncated_batch_size=50, pad_index=1000, steps=10,
                            seed=0)
    batches = list(s)
    assert all(len(bt) == 50 for bt in batches)
    # history uses pre-truncation samples: cold E|B_0| = 200 > 50, so those truncated away
    # are barred at steps 1, 2 too. Check against the internal state: every index sampled at
    # step 0 (incl. truncated) has next_available >= 3 or was resampled later.
    s2 = BMinSepBatchSampler(1000, 0.2, 3, truncated_batch_size=50, steps=1, seed=0)
    b0 = next(iter(s2))
    assert len(b0) == 50 and int((s2.next_available == 3).sum()) > 100
    with pytest.raises(ValueError, match="pad_index"):
        BMinSepBatchSampler(10, 0.5, 2, pad_index=0)


def test_warm_start_probability_validation():
    # one formula for p = B/(N - (b-1)B), in accounting (the scheme and the samplers call it)
    with pytest.raises(ValueError, match="min_sep"):
        bminsep_sampling_prob(100, 30, 4)
    assert bminsep_sampling_prob(100, 25, 4) == 1.0
    s = BMinSepBatchSampler.from_expected_batch_size(100, 25, 4, seed=0)
    assert s.p == 1.0 and s.scheme.sampling_prob == 1.0


def test_bminsep_samplers_carry_the_scheme_they_draw():
    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.samplers.verification import scheme_of_batch_sampler
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    scheme = BMinSepMonteCarloScheme(bands=2, dataset_size=300, batch_size=10.0, min_sep=3,
                                     warm_start=True, truncate=14, strategy="max-error")
    s = scheme.sampler(300, seed=5, pad_index=300)
    assert type(s) is BMinSepBatchSampler and s.scheme is scheme
    assert scheme_of_batch_sampler(s) is scheme and s.p == scheme.sampling_prob
    assert (s.warm_start, s.truncated_batch_size, s.min_sep) == (True, 14, 3)
    assert all(len(b) == 14 for b in itertools.islice(s, 4))
    # the same parameters built by hand draw the same batches, with a one-band scheme of them
    direct = BMinSepBatchSampler(300, scheme.sampling_prob, 3, warm_start=True,
                                 truncated_batch_size=14, pad_index=300, seed=5)
    again = scheme.sampler(300, seed=5, pad_index=300)
    assert list(itertools.islice(direct, 6)) == list(itertools.islice(again, 6))
    assert isinstance(direct.scheme, BMinSepMonteCarloScheme) and direct.scheme.bands == 1
    assert direct.scheme.batch_distribution() == scheme.batch_distribution()
    assert scheme.implemented_by(direct.scheme)  # the strategy and bands are the accountant's
    assert SchemeAccountant(direct.scheme).scheme is direct.scheme
    cold = BMinSepBatchSampler(300, scheme.sampling_prob, 3, seed=5)
    assert not scheme.implemented_by(cold.scheme)
    with pytest.raises(ValueError, match="draws the batches of"):
        BMinSepBatchSampler(300, scheme.sampling_prob, 3, seed=5, scheme=scheme)
    with pytest.raises(ValueError, match="dataset_size=300"):
        scheme.sampler(301)
    with pytest.raises(ValueError, match="burn_in"):
        scheme.sampler(300, burn_in=3)


def test_multi_attribution_sampler_from_the_scheme():
    from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme

    users = [[i % 50] for i in range(300)]
    scheme = BMinSepMonteCarloScheme(bands=2, dataset_size=300, batch_size=8.0, min_sep=3,
                                     max_user_examples=6, sampling_probability=0.05)
    s = scheme.sampler(users, seed=5, burn_in=4)
    assert type(s) is MultiAttributionBMinSepBatchSampler and s.scheme is scheme
    assert (s.p, s.min_sep, s.max_user_examples, s.burn_in) == (0.05, 3, 6, 4)
    direct = MultiAttributionBMinSepBatchSampler(users, 0.05, 3, max_user_examples=6, seed=5,
                                                 burn_in=4)
    assert list(itertools.islice(direct, 5)) == list(itertools.islice(s, 5))
    assert scheme.implemented_by(direct.scheme) and direct.scheme.max_user_examples == 6
    with pytest.raises(ValueError, match="user_sets"):
        scheme.sampler(300)
    with pytest.raises(ValueError, match="user_sets"):
        scheme.sampler_for_dataset(300)
    with pytest.raises(ValueError, match="dataset_size=300"):
        scheme.sampler(users[:-1])
    with pytest.raises(ValueError, match="draws the batches of"):
        MultiAttributionBMinSepBatchSampler(users, 0.06, 3, max_user_examples=6, scheme=scheme)


def test_cyclic_poisson_semantics():
    N, B, b = 1200, 30, 4
    s = CyclicPoissonBatchSampler(N, B, b, seed=0)
    assert isinstance(s.scheme, BandMFCyclicPoissonScheme) and s.sample_rate == pytest.approx(0.1)
    assert len(s) == 40 and s.scheme.expected_sample_rate() == pytest.approx(1 / 40)
    assert torch.bincount(s.groups).tolist() == [300] * 4
    x = _patterns(s, 80)
    for e in range(N):
        steps = np.flatnonzero(x[e])
        assert np.all(steps % b == int(s.groups[e]))
    assert abs(x.sum() / 80 - B) < 3
    with pytest.raises(ValueError, match="bands"):
        CyclicPoissonBatchSampler(100, 30, 4)


def test_balls_in_bins_semantics():
    s = BallsInBinsBatchSampler(300, 6, epochs=2, seed=0)
    x = _patterns(s, 12)
    assert np.all(x.sum(1) == 2) and np.all(x[:, :6] == x[:, 6:])
    with pytest.raises(RuntimeError, match="exhausted"):
        list(s)


def test_multi_attribution_user_separation():
    rng = np.random.default_rng(0)
    user_sets = [[int(u) for u in rng.choice(40, size=rng.integers(1, 3), replace=False)]
                 for _ in range(120)]
    s = MultiAttributionBMinSepBatchSampler(user_sets, 0.1, 4, max_user_examples=20, burn_in=10,
                                            steps=30, seed=0)
    x = _patterns(s, 30)
    for u in range(40):
        ex = [e for e, us in enumerate(user_sets) if u in us]
        steps = np.flatnonzero(x[ex].any(0))
        assert np.all(np.diff(steps) >= 4)
    with pytest.raises(ValueError, match="max_user_examples"):
        MultiAttributionBMinSepBatchSampler([[0]] * 5, 0.1, 2, max_user_examples=2)


@pytest.mark.parametrize("make", [
    lambda: BMinSepBatchSampler(300, 0.1, 3, warm_start=True, steps=7, seed=5),
    lambda: CyclicPoissonBatchSampler(300, 10, 3, steps=7, seed=5),
    lambda: BallsInBinsBatchSampler(300, 7, epochs=3, seed=5),
    lambda: MultiAttributionBMinSepBatchSampler([[i % 50] for i in range(300)], 0.1, 3,
                                                max_user_examples=6, steps=7, seed=5),
])
def test_state_dict_resumes_exactly(make):
    full = make()
    ref = list(full) + list(full)
    a = make()
    it = iter(a)
    first = [next(it) for _ in range(3)]
    sd = a.state_dict()
    b = make()
    b.load_state_dict(sd)
    rest = list(b) + list(b)
    assert first + rest[: len(ref) - 3] == ref[: 3 + len(rest[: len(ref) - 3])]
    other = BMinSepBatchSampler(301, 0.1, 3, seed=5)
    with pytest.raises(ValueError):
        other.load_state_dict(sd)
