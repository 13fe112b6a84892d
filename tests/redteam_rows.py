"""Red-team loop shapes of issue 39: what one noisy step sums, and how batches are delivered.

Each shape is a loop as users write it (tests/redteam.py runs it over every scheme and path,
and prices what it trained on independently):

* draws per release: ``skip_accumulate2`` / ``skip_accumulate3`` (manual accumulation with
  ``optimizer.signal_skip_step(True)`` over K loader batches), ``concat2`` / ``concat3``
  (K loader batches concatenated into one forward), and ``accumulate`` (K backward passes,
  one step; in redteam.py);
* rows per example: ``two_views`` / ``three_views`` (two or three augmented views of each
  example in one forward);
* delivery: ``cached`` (``list(loader)`` first), ``prefetched`` (one batch ahead),
  ``rebuilt`` (a DataLoader rebuilt over the returned loader's batch sampler), ``peek``
  (``next(iter(loader))`` before training); ``reuse_cached`` trains one cached batch twice;
* public rows: ``public_fakes`` (a discriminator step on the private batch plus generated
  samples declared with ``opacus_structured.public_rows()``);
* ``sampler_mutation``: the sampler's rate or batch size changed after epoch 1.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import opacus_structured


def accumulate_shape(k: int, *, skip: bool):
    """``k`` loader batches per noisy step: ``k`` backward passes then one step, or (``skip``)
    a skipped ``optimizer.step()`` after each of the first ``k - 1`` (manual accumulation with
    ``signal_skip_step``, Opacus keeping the clipped sum)."""
    def shape(loop, engine, loader, scheme, epochs, workers):
        for _ in range(epochs):
            pending = 0
            loop.optimizer.zero_grad()
            for batch in loader:
                loop.backward(batch)
                pending += 1
                if pending < k:
                    if skip:
                        loop.optimizer.signal_skip_step(do_skip=True)
                        loop.optimizer.step()       # clips and keeps the sum, no noise
                        loop.optimizer.zero_grad()  # keeps summed_grad after a skipped step
                    continue
                loop.step()
                loop.optimizer.zero_grad()
                pending = 0
    return shape


def _concat(k: int):
    def shape(loop, engine, loader, scheme, epochs, workers):
        for _ in range(epochs):
            it = iter(loader)
            for _ in range(len(loader) // k):
                parts = [next(it) for _ in range(k)]
                loop.optimizer.zero_grad()
                loop.forward_backward(parts)
                loop.step()
    return shape


def _views(k: int):
    """``k`` augmented views of each example in one forward: ``k`` rows per example."""
    def shape(loop, engine, loader, scheme, epochs, workers):
        for _ in range(epochs):
            for batch in loader:
                loop.optimizer.zero_grad()
                loop.backward(batch, views=k)
                loop.step()
    return shape


def _cached(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        batches = list(loader)
        for batch in batches:
            loop.step(batch)


def _reuse_cached(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        batches = list(loader)
        if epoch == 1:
            batches.append(batches[0])  # one cached batch trained twice
        for batch in batches:
            loop.step(batch)


def _prefetched(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        it = iter(loader)
        nxt = next(it, None)
        while nxt is not None:
            batch, nxt = nxt, next(it, None)
            loop.step(batch)


def _rebuilt(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        if epoch == 1:
            loader = DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                collate_fn=loader.collate_fn)
        for batch in loader:
            loop.step(batch)


def _peek(loop, engine, loader, scheme, epochs, workers):
    next(iter(loader))  # look at the shapes first
    for _ in range(epochs):
        for batch in loader:
            loop.step(batch)


def _public_fakes(loop, engine, loader, scheme, epochs, workers):
    for _ in range(epochs):
        for batch in loader:
            loop.optimizer.zero_grad()
            loop.backward(batch)
            x = batch["context"] if isinstance(batch, dict) else batch[0]
            fake = torch.randn(4, *x.shape[1:])
            with opacus_structured.public_rows():
                out = loop.model(fake)
            out.sum().backward()
            loop.step()


def _sampler_mutation(loop, engine, loader, scheme, epochs, workers):
    for epoch in range(epochs):
        if epoch == 1:
            sampler = loader.batch_sampler
            for name, factor in (("sample_rate", 3.0), ("batch_size", 2), ("num_bins", 0.5),
                                 ("series_per_step", 2), ("steps", 2)):
                value = getattr(sampler, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    setattr(sampler, name, type(value)(max(1, value * factor))
                            if isinstance(value, int) else min(1.0, value * factor))
                    break
        for batch in loader:
            loop.step(batch)


ROW_SHAPES = {
    "skip_accumulate2": accumulate_shape(2, skip=True),
    "skip_accumulate3": accumulate_shape(3, skip=True),
    "concat2": _concat(2), "concat3": _concat(3), "two_views": _views(2),
    "three_views": _views(3),
    "cached": _cached, "reuse_cached": _reuse_cached, "prefetched": _prefetched,
    "rebuilt": _rebuilt, "peek": _peek, "public_fakes": _public_fakes,
    "sampler_mutation": _sampler_mutation,
}
#: Shapes that sum several draws or rows per example: priced, except under correlated noise
#: (one draw per noise position), where refusing is the answer.
MERGING = {"skip_accumulate2", "skip_accumulate3", "concat2", "concat3", "accumulate"}
#: The same on the Lightning path (tests/redteam_lightning.py): ``accumulate_grad_batches``.
LIGHTNING_MERGING = {"accumulate2", "accumulate3", "accumulate4", "ghost_accumulate2",
                     "ghost_accumulate4"}
#: Shapes whose run must raise.
ROW_MUST_RAISE = {"reuse_cached", "sampler_mutation"}
