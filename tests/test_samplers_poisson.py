"""PoissonBatchSampler: semantics, peer check against Opacus, validation, resumable state."""

import itertools
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.samplers.poisson import (PoissonBatchSampler, default_steps,
                                                poisson_data_loader)
from opacus_structured.schemes.poisson import PoissonScheme


def test_same_draws_as_opacus_uniform_with_replacement_sampler():
    # Peer oracle: Opacus' DPDataLoader sampler draws the same masks from the same generator.
    ours = PoissonBatchSampler(50, 0.2, generator=torch.Generator().manual_seed(3))
    theirs = UniformWithReplacementSampler(num_samples=50, sample_rate=0.2,
                                           generator=torch.Generator().manual_seed(3))
    assert len(ours) == len(theirs) == 5
    assert list(ours) == list(theirs)


def test_inclusion_frequency_is_q_and_batches_vary():
    n, q, draws = 40, 0.25, 400
    s = PoissonBatchSampler(n, q, steps=draws, seed=0)
    counts = torch.zeros(n)
    sizes = set()
    for batch in s:
        assert len(set(batch)) == len(batch) and all(0 <= i < n for i in batch)
        counts[batch] += 1
        sizes.add(len(batch))
    # each index ~ Binomial(draws, q): 6 standard deviations
    sd = math.sqrt(draws * q * (1 - q))
    assert (counts - draws * q).abs().max() < 6 * sd
    assert len(sizes) > 3  # variable batch size
    assert s.expected_batch_size == n * q


def test_len_is_floor_inverse_rate_and_hook_rate_never_below_q():
    for q in (0.1, 1 / 3, 1 / 7, 0.03, 0.036, 1.0):
        steps = default_steps(q)
        assert steps == max(1, math.floor(1 / q + 1e-9))
        assert 1 / steps >= q * (1 - 1e-12)
    assert len(PoissonBatchSampler(10, 0.5, steps=7, seed=0)) == 7


def test_scheme_attribute_and_matching_accountant():
    s = PoissonBatchSampler(64, 1 / 8, seed=0)
    assert s.scheme == PoissonScheme(sample_rate=1 / 8)
    acc = SchemeAccountant(s.scheme, discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=1 / len(s))  # what Opacus' hook reports
    assert len(acc) == 1
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(noise_multiplier=1.0, sample_rate=0.5)     # a different loader


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_samples=0, sample_rate=0.1), "num_samples"),
    (dict(num_samples=10, sample_rate=0.0), "sample_rate"),
    (dict(num_samples=10, sample_rate=1.5), "sample_rate"),
    (dict(num_samples=10, sample_rate=float("nan")), "sample_rate"),
    (dict(num_samples=10, sample_rate=0.1, steps=0), "steps"),
    (dict(num_samples=10, sample_rate=0.1, seed=-1), "seed"),
    (dict(num_samples=10, sample_rate=0.1, seed=1, generator=torch.Generator()), "generator"),
    (dict(num_samples=10, sample_rate=0.1, generator=3), "generator"),
])
def test_bad_input_raises_value_error_naming_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PoissonBatchSampler(**kwargs)


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 5, 9])
def test_state_dict_resumes_exactly(stop):
    # 2 epochs of 5 batches; stop after `stop` batches, save, restore into a new sampler.
    ref = PoissonBatchSampler(30, 0.2, seed=11)
    full = list(itertools.chain(iter(ref), iter(ref)))

    a = PoissonBatchSampler(30, 0.2, seed=11)
    seen, it = [], iter(a)
    for _ in range(stop):
        try:
            seen.append(next(it))
        except StopIteration:
            it = iter(a)
            seen.append(next(it))
    if stop == 5:
        assert list(it) == []  # finish the epoch (exhausted): state = start of epoch 2
    state = a.state_dict()

    b = PoissonBatchSampler(30, 0.2, seed=999)  # different seed: state must override it
    b.load_state_dict(state)
    assert b.state_dict()["position"] == state["position"]
    rest = list(iter(b))
    resumed = seen + rest
    # the rest of the current epoch, then further epochs, match the uninterrupted run
    while len(resumed) < len(full):
        resumed += list(iter(b))
    assert resumed[:len(full)] == full


def test_load_state_dict_validates():
    s = PoissonBatchSampler(30, 0.2, seed=1)
    state = s.state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        PoissonBatchSampler(31, 0.2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({**state, "position": 5})


def test_empty_batches_collate_like_dploader():
    ds = TensorDataset(torch.randn(3, 4), torch.arange(3))
    loader = poisson_data_loader(ds, 0.3, steps=60, seed=0)
    sizes = []
    for x, y in loader:
        assert x.shape[1:] == (4,) and x.shape[0] == y.shape[0]
        sizes.append(x.shape[0])
    assert 0 in sizes and max(sizes) > 0
    assert isinstance(loader.batch_sampler, PoissonBatchSampler)
