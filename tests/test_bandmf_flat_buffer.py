"""BandMF's contiguous ring buffer (issue 32, item 3): bit-identical to the per-parameter
implementation it replaced, exact resumes (old and new states), one contiguous buffer per
(device, dtype), and a per-step path whose only buffer-wide reduction is one BLAS product."""

import warnings

import pytest
import torch
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_structured.accounting import strategies as st
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer

warnings.filterwarnings("ignore", message="Secure RNG turned off")


class _FrozenPerParameterBandMF(CorrelatedNoiseDPOptimizer):
    """The per-parameter BandMF noise as it was before the contiguous ring (main at b2b7fcb,
    ``CorrelatedNoiseMixin._correlate`` / ``_new_buffer`` / ``_slot_weights`` / ``_on_device``
    copied verbatim): one ``(b−1, *shape)`` buffer and one ``tensordot`` per parameter."""

    def _ref_on_device(self, key, like, make):
        cache = self.__dict__.setdefault("_ref_cache", {})
        k = (key, self.noise_step, like.dtype, like.device)
        if k not in cache:
            cache[k] = make().to(dtype=like.dtype, device=like.device)
        return cache[k]

    def _ref_slot_weights(self, buf):
        def make():
            i, m = self.noise_step, self.bands - 1
            a = [0.0] * m
            for k in range(1, min(i, m) + 1):
                a[(i - k) % m] = self._coef_list[k]
            return torch.tensor(a, dtype=torch.float64)
        return self._ref_on_device("slots", buf, make)

    def _ref_new_buffer(self, idx, z, slots):
        buf = self._noise_buffers[idx]
        if buf is None or buf.shape[1:] != z.shape or buf.dtype != z.dtype or \
                buf.device != z.device:
            if self.noise_step > 0 and buf is not None:
                raise RuntimeError("buffer mismatch")
            buf = torch.zeros((slots, *z.shape), dtype=z.dtype, device=z.device)
            self._noise_buffers[idx] = buf
        return buf

    def _ref_correlate(self, idx, z):
        c0 = self._coef_list[0]
        if self.bands == 1:
            return z if c0 == 1.0 else z / c0
        buf = self._ref_new_buffer(idx, z, self.bands - 1)
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
        self._advance()  # noise_step += 1, recorded in the noise lineage (issue 46)

    def load_noise_state_dict(self, state):
        super().load_noise_state_dict(state)
        self._noise_buffers = [None if b is None else b.contiguous()
                               for b in self._noise_buffers]


# MKL's float32 sgemm sums the b−1 products in an order that depends on the column count for
# b − 1 ≥ 8 (tail columns differ from the body): shapes with n mod 16 ≠ 0 and b = 16 exercise it
SHAPES = [(3, 4), (5,), (), (64, 33), (1000,), (7, 9, 11), (4099,)]


def _params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _make(cls, coefs, shapes=SHAPES, dtype=torch.float64, seed=7, **kw):
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)
    params = [q for s, d in zip(shapes, dtypes, strict=True) for q in _params([s], d)]
    return cls(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.1, max_grad_norm=0.8,
               expected_batch_size=1, generator=torch.Generator().manual_seed(seed),
               noise_correlation=coefs, **kw)


def _stream(opt, steps, start=0):
    out = []
    for s in range(start, start + steps):
        for j, p in enumerate(opt.params):
            p.summed_grad = torch.full_like(p, 0.25 * (s + j))
        opt.add_noise()
        out.append([p.grad.detach().clone() for p in opt.params])
    return out


def _assert_bit_identical(a_steps, b_steps):
    assert len(a_steps) == len(b_steps)
    for a, b in zip(a_steps, b_steps, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), (x - y).abs().max()


COEFS = {1: [1.0], 2: st.banded_sqrt_coefficients(2), 8: st.banded_sqrt_coefficients(8),
         16: st.banded_sqrt_coefficients(16),
         "c0≠1": [float(v) for v in 1.7 * st.banded_sqrt_coefficients(5)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bands", list(COEFS))
def test_noise_bit_identical_to_per_parameter_reference(dtype, bands):
    coefs = COEFS[bands]
    steps = 2 * len(coefs) + 3  # the ring wraps around at least twice
    ref = _stream(_make(_FrozenPerParameterBandMF, coefs, dtype=dtype), steps)
    new = _make(CorrelatedNoiseDPOptimizer, coefs, dtype=dtype)
    _assert_bit_identical(ref, _stream(new, steps))
    if len(coefs) > 1:
        assert new._flat_rings is not None and len(new._flat_rings) == 1


def test_mixed_dtypes_one_ring_each_and_bit_identical():
    dtypes = [torch.float32, torch.float64] * 3 + [torch.float32]
    coefs = COEFS[16]
    ref = _stream(_make(_FrozenPerParameterBandMF, coefs, dtype=dtypes), 20)
    new = _make(CorrelatedNoiseDPOptimizer, coefs, dtype=dtypes)
    _assert_bit_identical(ref, _stream(new, 20))
    rings = new._flat_rings
    assert sorted(str(k[1]) for k in rings) == ["torch.float32", "torch.float64"]
    for (_device, dt), ring in rings.items():
        storage = ring["storage"]
        assert storage.is_contiguous() and storage.dtype == dt
        need = 15 * sum(p.numel() for p in new.params if p.dtype == dt)
        pieces = sum(p.dtype == dt for p in new.params)
        assert need <= storage.numel() < need + 128 * pieces  # block alignment padding only


def test_single_gemv_same_recursion_up_to_rounding():
    """One GEMV per ring: the same w_i up to the float rounding of the (b−1)-term sum."""
    coefs = COEFS[16]
    ref = _stream(_make(_FrozenPerParameterBandMF, coefs), 20)
    flat = _stream(_make(CorrelatedNoiseDPOptimizer, coefs, single_gemv=True), 20)
    for a, b in zip(ref, flat, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="single_gemv"):
        _make(CorrelatedNoiseDPOptimizer, coefs, single_gemv=1)


@pytest.mark.parametrize("single_gemv", [False, True])
def test_resume_exact_new_and_old_format_states(single_gemv):
    coefs, n, cut = COEFS[8], 21, 11
    full = _stream(_make(CorrelatedNoiseDPOptimizer, coefs, single_gemv=single_gemv), n)
    # the state of today's optimizer
    first = _make(CorrelatedNoiseDPOptimizer, coefs, single_gemv=single_gemv)
    _stream(first, cut)
    sd = first.state_dict()
    bufs = sd["correlated_noise"]["buffers"]
    assert all(b.shape == (7, *p.shape) and b.is_contiguous()
               for b, p in zip(bufs, first.params, strict=True))  # the historical per-parameter format
    resumed = _make(CorrelatedNoiseDPOptimizer, coefs, seed=999, single_gemv=single_gemv)
    resumed.load_state_dict(sd)
    _assert_bit_identical(full[cut:], _stream(resumed, n - cut, cut))
    # a state written by the per-parameter implementation continues bit for bit, both ways
    # (each state is the last save of its stream: a continuation, so its generator is restored)
    if not single_gemv:
        old = _make(_FrozenPerParameterBandMF, coefs)
        _stream(old, cut)
        from_old = _make(CorrelatedNoiseDPOptimizer, coefs, seed=999)
        from_old.load_state_dict(old.state_dict())
        _assert_bit_identical(full[cut:], _stream(from_old, n - cut, cut))
        again = _make(_FrozenPerParameterBandMF, coefs)
        _stream(again, cut)
        to_old = _make(_FrozenPerParameterBandMF, coefs, seed=999)
        to_old.load_state_dict(again.state_dict())
        _assert_bit_identical(full[cut:], _stream(to_old, n - cut, cut))


def test_restored_buffer_of_wrong_shape_is_refused_before_any_write():
    coefs = COEFS[8]
    opt = _make(CorrelatedNoiseDPOptimizer, coefs)
    _stream(opt, 3)
    sd = opt.noise_state_dict()
    sd["buffers"][1] = torch.zeros(7, 6, dtype=torch.float64)
    fresh = _make(CorrelatedNoiseDPOptimizer, coefs)
    fresh.load_noise_state_dict(sd)
    with pytest.raises(RuntimeError, match="parameter 1"):
        _stream(fresh, 1)
    # a gradient of the wrong dtype mid-run: refused before a slot is overwritten
    _stream(opt, 1)
    before = [b.clone() for b in opt._noise_buffers]
    for p in opt.params:
        p.summed_grad = torch.zeros_like(p, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="does not match the gradient"):
        opt.add_noise()
    assert all(torch.equal(a, b) for a, b in zip(before, opt._noise_buffers, strict=True))
    # a parameter frozen mid-run: the buffers no longer line up with the parameters
    opt.params[0].requires_grad_(False)
    for p in opt.params:
        p.summed_grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="frozen or unfrozen"):
        opt.add_noise()
    assert all(torch.equal(a, b) for a, b in zip(before, opt._noise_buffers, strict=True))


class _OpLog(TorchDispatchMode):
    """Aten ops of a region, with whether an input aliases ``watched``'s storage."""

    def __init__(self, watched):
        super().__init__()
        self.ptr = watched.untyped_storage().data_ptr()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr
                    for a in args)
        self.ops.append((func.overloadpacket.__name__, reads))
        return func(*args, **kwargs)


@pytest.mark.parametrize("single_gemv", [False, True])
def test_one_contiguous_buffer_and_one_reduction_per_step(single_gemv):
    coefs = COEFS[16]
    opt = _make(CorrelatedNoiseDPOptimizer, coefs, single_gemv=single_gemv)
    _stream(opt, 3)
    (ring,) = opt._flat_rings.values()
    storage = ring["storage"]
    d = sum(p.numel() for p in opt.params)
    assert storage.is_contiguous() and storage.dim() == 1
    assert 15 * d <= storage.numel() <= 15 * d + (0 if single_gemv else 128 * len(opt.params))
    assert storage.dtype == torch.float64
    start = storage.data_ptr()
    end = start + storage.numel() * storage.element_size()
    for view, p in zip(opt._noise_buffers, opt.params, strict=True):  # every parameter's ring is a view
        assert view.shape == (15, *p.shape) and start <= view.data_ptr() < end
        assert view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        if not single_gemv:  # parameter-major: each block contiguous, blocks back to back
            assert view.is_contiguous()
    if not single_gemv:
        ptrs = [v.data_ptr() for v in opt._noise_buffers]
        sizes = [v.numel() * v.element_size() for v in opt._noise_buffers]
        assert ptrs[0] == start and all(ptrs[k] + sizes[k] <= ptrs[k + 1]
                                        for k in range(len(ptrs) - 1))  # in order, disjoint
        assert all((q - start) % (128 * storage.element_size()) == 0 for q in ptrs)
    for p in opt.params:
        p.summed_grad = torch.zeros_like(p)
    with _OpLog(storage) as log:
        opt.add_noise()
    names = [op for op, _ in log.ops]
    reductions = [op for op in names if op in ("mm", "addmm", "mv", "addmv", "dot", "matmul",
                                               "bmm", "vdot")]
    # single_gemv: one GEMV for the ring; default: one per parameter (the reference's call)
    assert len(reductions) == (1 if single_gemv else len(opt.params)), reductions
    # the buffer is read by the reduction, w_i is written once into its slot (sub, out=) and
    # read once by p.grad = S + w: no copy, clone, cat or second reduction of the buffer
    touching = {op for op, reads in log.ops if reads}
    assert touching <= {"mm", "dot", "sub", "div_", "add", "select", "slice", "view", "reshape",
                        "_unsafe_view", "t", "transpose", "permute", "expand"}, touching
    assert not any(op in ("copy_", "clone", "cat", "stack") for op in names), names
    assert names.count("sub") == len(opt.params)
    # w = (z − t) / c_0: the division, when c_0 ≠ 1, is in place on the slot
    assert names.count("div_") == (len(opt.params) if opt._coef_list[0] != 1.0 else 0)
    assert "div" not in names
