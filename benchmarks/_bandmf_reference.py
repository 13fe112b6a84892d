"""The per-parameter BandMF noise as it was before the contiguous ring (main at b2b7fcb), kept
for ``benchmarks/correlated_noise.py``'s interleaved comparison: one ``(b−1, *shape)`` buffer and
one ``tensordot`` per parameter, ``w = z − t``, ``w / c_0`` and a copy into the slot as separate
passes. (``tests/test_bandmf_flat_buffer.py`` keeps its own frozen copy for bit-identity.)"""

from __future__ import annotations

import torch
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer


class PerParameterBandMF(CorrelatedNoiseDPOptimizer):
    """``CorrelatedNoiseDPOptimizer`` with the former per-parameter ring buffers."""

    def _ref_slot_weights(self, buf):
        cache = self.__dict__.setdefault("_ref_cache", {})
        k = (self.noise_step, buf.dtype, buf.device)
        if k not in cache:
            cache.clear()
            i, m = self.noise_step, self.bands - 1
            a = [0.0] * m
            for j in range(1, min(i, m) + 1):
                a[(i - j) % m] = self._coef_list[j]
            cache[k] = torch.tensor(a, dtype=torch.float64).to(buf.dtype).to(buf.device)
        return cache[k]

    def _ref_correlate(self, idx, z):
        c0 = self._coef_list[0]
        if self.bands == 1:
            return z if c0 == 1.0 else z / c0
        buf = self._noise_buffers[idx]
        if buf is None:
            buf = torch.zeros((self.bands - 1, *z.shape), dtype=z.dtype, device=z.device)
            self._noise_buffers[idx] = buf
        if self.noise_step > 0:
            w = z - torch.tensordot(self._ref_slot_weights(buf), buf, dims=1)
        else:
            w = z
        if c0 != 1.0:
            w = w / c0
        buf[self.noise_step % (self.bands - 1)].copy_(w)
        return w

    def add_noise(self):
        self._check_clip_norm()
        sigma = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)
        for idx, p in enumerate(self.params):
            _check_processed_flag(p.summed_grad)
            z = _generate_noise(std=sigma * self.max_grad_norm, reference=p.summed_grad,
                                generator=self._noise_generator(p.summed_grad),
                                secure_mode=self.secure_mode)
            w = self._ref_correlate(idx, z)
            p.grad = (p.summed_grad + w).view_as(p)
            _mark_as_processed(p.summed_grad)
        self.noise_step += 1
