r"""Torch backend of the b-min-sep Monte Carlo sampler (CPU or CUDA, float64).

The same mathematics as :mod:`opacus_structured.accounting.bminsep_mc` (Dong & Ganesh,
arXiv:2602.09338, Theorem 5.1 (cold/warm), Theorem 6.1 (multi-attribution), Corollary D.2
(truncated + padded), and the cyclic Poisson / balls-in-bins comparisons), written with torch
tensors so that it runs on a GPU. Every variant of the numpy backend is supported, and for the
same inputs (``y``, and the other examples' counts ``r`` for the truncated variant) the
log-ratio vectors agree with numpy to rounding (tested to ``1e-10`` on CPU in float64).

It lives in the runner layer, next to :mod:`opacus_structured.runners.monte_carlo`, which chooses the backend of a
run (``device``): :mod:`opacus_structured.accounting` never imports torch. The random streams
differ from numpy's (and a CUDA generator's from a CPU one's), so the same seed gives different
(identically distributed) samples.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .._validation import check_int
from ..accounting.bminsep_mc import DIRECTIONS, BandMFMonteCarlo, binomial_log_weights

__all__ = ["TorchBandMF", "sample_losses_torch", "torch_seed"]

F64 = torch.float64


def torch_seed(seed) -> int:
    """A non-negative 63-bit torch seed from an int, a ``SeedSequence`` or ``None``."""
    if isinstance(seed, (int, np.integer)):
        return int(seed) & 0x7FFF_FFFF_FFFF_FFFF
    ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    return int(ss.generate_state(2, np.uint64)[0]) & 0x7FFF_FFFF_FFFF_FFFF


def _suffix_recursion(log_stay: float, log_go: torch.Tensor, b: int) -> torch.Tensor:
    """``log f_i = logaddexp(log_stay + log f_{i+1}, log_go_i + log f_{i+b})``, ``f_{≥n} = 1``.

    Returns the ``(b, S)`` circular buffer (row ``i mod b`` holds ``log f_i`` for ``i < b``).
    """
    n, S = log_go.shape
    buf = torch.zeros((b, S), dtype=F64, device=log_go.device)
    for i in range(n - 1, -1, -1):
        r = i % b
        buf[r] = torch.logaddexp(buf[(i + 1) % b] + log_stay, buf[r] + log_go[i])
    return buf


def _combine_start(buf: torch.Tensor, p: float, b: int, warm_start: bool) -> torch.Tensor:
    """Cold: ``log f_0``; warm: ``log[(f_0 + p Σ_{i=1}^{b−1} f_i)/(1+(b−1)p)]`` (Algorithm 2)."""
    if not warm_start or b == 1:
        return buf[0]
    terms = buf.clone()
    terms[1:] += math.log(p)
    return torch.logsumexp(terms, 0) - math.log1p((b - 1) * p)


def _group_logsumexp(per: torch.Tensor, b: int) -> torch.Tensor:
    """``logsumexp_s Σ_{i ≡ s (mod b)} per_i − ln b`` (cyclic Poisson / balls-in-bins)."""
    n, S = per.shape
    groups = torch.stack([per[s::b].sum(0) if s < n else per.new_zeros(S) for s in range(b)])
    return torch.logsumexp(groups, 0) - math.log(b)


class TorchBandMF:
    """A :class:`~opacus_structured.accounting.bminsep_mc.BandMFMonteCarlo` mechanism on a torch
    device.

    :meth:`log_ratio` and :meth:`truncated_log_ratios` evaluate the same dynamic programs as
    the numpy functions; :meth:`sample_losses` draws privacy-loss samples.
    """

    def __init__(self, mechanism: BandMFMonteCarlo, device="cpu",
                 generator: Optional[torch.Generator] = None):
        if not isinstance(mechanism, BandMFMonteCarlo):
            raise ValueError(f"mechanism must be a BandMFMonteCarlo, got "
                             f"{type(mechanism).__name__}")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        self.mechanism, self.device = mechanism, dev
        self.gen = generator if generator is not None else torch.Generator(device=dev)
        st = mechanism.strategy
        self.n, self.bands = st.n, st.bands
        self.cols = torch.as_tensor(np.array(st.columns), dtype=F64, device=dev)
        self.sq = torch.as_tensor(np.array(st.squared_norms), dtype=F64, device=dev)[:, None]
        p = mechanism.sampling_prob
        self.log_p = math.log(p)
        self.log_q1 = math.log1p(-p) if p < 1 else -math.inf

    # ---- linear algebra -----------------------------------------------------------------
    def _tensor(self, a) -> torch.Tensor:
        t = torch.as_tensor(a, dtype=F64, device=self.device)
        if t.ndim == 1:
            t = t[:, None]
        if t.ndim != 2 or t.shape[0] != self.n:
            raise ValueError(f"y must have shape (n={self.n}, samples), got {tuple(t.shape)}")
        return t

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``C x`` for ``x`` of shape ``(n, S)``."""
        res = torch.zeros_like(x)
        n = self.n
        for k in range(self.bands):
            res[k:] += self.cols[: n - k, k, None] * x[: n - k]
        return res

    def window_dots(self, y: torch.Tensor) -> torch.Tensor:
        """``⟨c_i, y_{i:i+L}⟩`` for ``y`` of shape ``(n, S)``."""
        n = self.n
        res = self.cols[:, 0, None] * y
        for k in range(1, self.bands):
            res[: n - k] += self.cols[: n - k, k, None] * y[k:]
        return res

    # ---- the dynamic programs -----------------------------------------------------------
    def log_ratio(self, y) -> torch.Tensor:
        """``ln(P/Q)(y)`` for the untruncated samplings (Theorems 5.1 and 6.1, §3)."""
        m = self.mechanism
        if m.truncated_batch_size is not None:
            raise ValueError("the truncated variant needs the other counts: use "
                             "truncated_log_ratios")
        y = self._tensor(y)
        sigma, b, p = m.noise_multiplier, m.min_sep, m.sampling_prob
        d = self.window_dots(y)
        if m.sampling == "bminsep" and m.max_user_examples > 1:
            k_u = m.max_user_examples
            j = torch.arange(1, k_u + 1, dtype=F64, device=self.device)[:, None, None]
            lw = torch.as_tensor(binomial_log_weights(k_u, p), dtype=F64,
                                 device=self.device)[:, None, None]
            go = torch.logsumexp(lw + (2 * j * d - j**2 * self.sq) / (2 * sigma**2), 0)
            return _combine_start(_suffix_recursion(k_u * self.log_q1, go, b), p, b, False)
        lr = (2 * d - self.sq) / (2 * sigma**2)
        if m.sampling == "bminsep":
            buf = _suffix_recursion(self.log_q1, lr + self.log_p, b)
            return _combine_start(buf, p, b, m.warm_start)
        if m.sampling == "cyclic-poisson":
            lr = torch.logaddexp(torch.full_like(lr, self.log_q1), lr + self.log_p)
        return _group_logsumexp(lr, b)

    def truncated_log_ratios(self, y, other_counts) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ln P/R, ln Q/R)(y)`` for truncated + padded b-min-sep (Corollary D.2); see
        :func:`~opacus_structured.accounting.bminsep_mc.truncated_bminsep_log_ratios` for the
        recursions."""
        m = self.mechanism
        if m.truncated_batch_size is None:
            raise ValueError("truncated_log_ratios needs a mechanism with truncated_batch_size")
        y = self._tensor(y)
        r = torch.as_tensor(other_counts, dtype=F64, device=self.device)
        if r.ndim == 1:
            r = r[:, None]
        if r.shape != y.shape or bool(torch.any(r < 0)):
            raise ValueError(f"other_counts must be non-negative with the shape of y "
                             f"{tuple(y.shape)}, got {tuple(r.shape)}")
        sigma, b, p, B = m.noise_multiplier, m.min_sep, m.sampling_prob, m.truncated_batch_size
        d = self.window_dots(y)
        trunc = r >= B
        log_keep = torch.log(torch.clamp(B / (r + 1.0), max=1.0))
        log_drop = torch.log(torch.clamp((r + 1.0 - B) / (r + 1.0), min=0.0))
        lr1 = (2 * d - self.sq) / (2 * sigma**2)
        lr2 = (2 * d - 2 * self.sq) / sigma**2
        lrm = (-2 * d - self.sq) / (2 * sigma**2)
        go_p = self.log_p + torch.where(trunc, torch.logaddexp(log_keep + lr2, log_drop), lr1)
        go_q = self.log_p + torch.where(trunc, torch.logaddexp(log_keep + lrm, log_drop),
                                        torch.zeros_like(lr1))
        out_p = _combine_start(_suffix_recursion(self.log_q1, go_p, b), p, b, m.warm_start)
        out_q = _combine_start(_suffix_recursion(self.log_q1, go_q, b), p, b, m.warm_start)
        return out_p, out_q

    # ---- samplers -----------------------------------------------------------------------
    def _rand(self, *shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device, dtype=F64)

    def participation(self, S: int, max_user_examples: Optional[int] = None) -> torch.Tensor:
        """Participation counts ``x`` (``(n, S)``) of the sensitive example or user; the same
        law as :func:`~opacus_structured.accounting.bminsep_mc.sample_bminsep_participation`
        (and the cyclic samplers)."""
        m, n, dev = self.mechanism, self.n, self.device
        b, p = m.min_sep, m.sampling_prob
        if m.sampling != "bminsep":
            phase = torch.randint(0, b, (S,), generator=self.gen, device=dev)
            on = (torch.arange(n, device=dev)[:, None] % b) == phase[None, :]
            if m.sampling == "balls-in-bins":
                return on.to(F64)
            return (on & (self._rand(n, S) < p)).to(F64)
        k_u = m.max_user_examples if max_user_examples is None else max_user_examples
        p_any = -math.expm1(k_u * math.log1p(-p)) if p < 1 else 1.0
        if m.warm_start and b > 1:
            busy = self._rand(S) < (b - 1) * p / (1 + (b - 1) * p)
            a = torch.where(busy, torch.randint(1, b, (S,), generator=self.gen, device=dev),
                            torch.zeros(S, dtype=torch.int64, device=dev))
        else:
            a = torch.zeros(S, dtype=torch.int64, device=dev)
        K = -(-n // b) + 1
        if p_any < 1:  # Geom(p_any) on {1, 2, ...} by inversion, capped past the horizon
            g = torch.floor(torch.log1p(-self._rand(K, S)) / math.log1p(-p_any)) + 1
            gaps = torch.clamp(g, max=n + 1).to(torch.int64)
        else:
            gaps = torch.ones((K, S), dtype=torch.int64, device=dev)
        gaps[1:] += b - 1
        tau = a[None, :] - 1 + torch.cumsum(gaps, 0)
        mask = tau < n
        x = torch.zeros((n, S), dtype=F64, device=dev)
        colidx = torch.arange(S, device=dev).expand(K, S)[mask]
        count = int(mask.sum())
        if k_u == 1 or count == 0:
            x[tau[mask], colidx] = 1.0
        else:  # Binom(k_u, p) conditioned on >= 1
            probs = torch.as_tensor(np.exp(binomial_log_weights(k_u, p)), dtype=F64, device=dev)
            draws = torch.multinomial(probs / probs.sum(), count, replacement=True,
                                      generator=self.gen)
            x[tau[mask], colidx] = (draws + 1).to(F64)
        return x

    def other_counts(self, S: int) -> torch.Tensor:
        """Counts ``r_i`` of the other ``|D| − 1`` examples (pre-truncation); the law of
        :func:`~opacus_structured.accounting.bminsep_mc.sample_other_counts` (warm start: the
        stationary multinomial, drawn as successive conditional binomials)."""
        m, n, dev = self.mechanism, self.n, self.device
        b, p, others = m.min_sep, m.sampling_prob, m.dataset_size - 1
        full = lambda v: torch.full((S,), float(v), dtype=F64, device=dev)  # noqa: E731
        hist = torch.zeros((max(b - 1, 0), S), dtype=F64, device=dev)
        if m.warm_start and b > 1:
            pi = [1.0 / (1 + (b - 1) * p)] + [p / (1 + (b - 1) * p)] * (b - 1)
            remaining, mass = full(others), 1.0
            for k in range(b - 1):  # Multinomial(others, pi) by conditional binomials
                cnt = torch.binomial(remaining, full(min(1.0, pi[k] / mass)), generator=self.gen)
                if k >= 1:
                    hist[k - 1] = cnt
                remaining = remaining - cnt
                mass -= pi[k]
            hist[b - 2] = remaining
        r = torch.zeros((n, S), dtype=F64, device=dev)
        p_t = full(p)
        for i in range(n):
            avail = full(others) - (hist.sum(0) if b > 1 else 0.0)
            r[i] = torch.binomial(avail, p_t, generator=self.gen)
            if b > 1:
                hist = torch.roll(hist, -1, 0)
                hist[-1] = r[i]
        return r

    def sample_losses(self, S: int, direction: str) -> torch.Tensor:
        """``S`` privacy-loss samples: ``ln(P/Q)(y), y ~ P`` (``"remove"``) or
        ``ln(Q/P)(y), y ~ Q`` (``"add"``); the truncated variant follows Corollary D.2."""
        m, n = self.mechanism, self.n
        sigma = m.noise_multiplier
        noise = torch.randn((n, S), generator=self.gen, device=self.device, dtype=F64) * sigma
        if m.truncated_batch_size is None:
            if direction == "remove":
                noise += self.apply(self.participation(S))
            loss = self.log_ratio(noise)
            return loss if direction == "remove" else -loss
        B = m.truncated_batch_size
        r = self.other_counts(S)
        x = self.participation(S)
        trunc = r >= B
        survive = self._rand(n, S) < torch.clamp(B / (r + 1.0), max=1.0)
        one, zero = torch.ones_like(x), torch.zeros_like(x)
        if direction == "remove":
            mode = torch.where(trunc, torch.where(survive, 2 * one, zero), one) * x
        else:
            mode = torch.where(trunc & survive, -one, zero) * x
        lp, lq = self.truncated_log_ratios(self.apply(mode) + noise, r)
        return lp - lq if direction == "remove" else lq - lp


def sample_losses_torch(mechanism: BandMFMonteCarlo, num_samples: int, direction: str, *,
                        seed=None, device="cuda", chunk_size: int = 65536) -> np.ndarray:
    """Privacy-loss samples on a torch device (float64), in chunks; returns a numpy array.

    Used by :func:`.monte_carlo.sample_losses` when ``device`` is given.
    """
    S = check_int("num_samples", num_samples, minimum=1)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    backend = TorchBandMF(mechanism, device)
    backend.gen.manual_seed(torch_seed(seed))
    out = np.empty(S)
    for start in range(0, S, chunk_size):
        k = min(chunk_size, S - start)
        out[start:start + k] = backend.sample_losses(k, direction).cpu().numpy()
    return out
