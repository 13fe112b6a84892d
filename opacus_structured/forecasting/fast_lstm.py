r"""Fast DP-compatible LSTM: exact per-sample gradients without a hooked Python time loop.

Opacus' ``DPLSTM`` runs its cells step by step and calls two hooked ``RNNLinear`` layers at
every time step, so one training step costs ``2·T·num_layers`` hooked matmuls plus the per-step
bookkeeping of the hooks. :class:`FastDPLSTM` computes the *same* per-sample gradients (and hence
the same clipped, noised update) from three sequence-level tensors per layer:

* ``X`` (B, T, I): the layer input, ``Hp`` (B, T, H): the previous hidden states
  ``h_{t-1}`` (``h_{-1} = h_0``), and
* ``G`` (B, T, 4H) = ∂L/∂(gate pre-activations) (gate order i, f, g, o as in ``nn.LSTM``).

Since the pre-activation is ``z_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh``, the gradient of
window ``b`` is ``∇W_ih[b] = Σ_t G_bt ⊗ X_bt``, ``∇W_hh[b] = Σ_t G_bt ⊗ Hp_bt`` and
``∇b_ih[b] = ∇b_hh[b] = Σ_t G_bt``, i.e. ``einsum('btg,bti->bgi')`` — exactly what Opacus' grad
sampler for ``nn.Linear`` computes for a 3-D input. One layer is therefore built as

.. code-block:: text

    Xp   = ih(X)                      # nn.Linear over the whole sequence: one matmul
    Hp   = scan(Xp, W_hh, b_hh)       # the recurrence, no autograd graph (detached)
    Z    = Xp + hh(Hp)                # nn.Linear over the whole sequence: one matmul
    H, C = _LSTMRecurrence(Z, h0, c0) # custom autograd Function: BPTT in its backward

The backward of ``_LSTMRecurrence`` runs back-propagation through time by hand (including the
recurrent path ``h_{t-1} → z_t`` through ``W_hh``, which autograd does not see because ``Hp`` is
detached) and returns the *total* ``G`` as the gradient of ``Z``. Autograd then hands ``G`` to
both linear layers as their output gradient, so Opacus' stock hooks (``grad_sample_mode=
"hooks"``) materialise ``einsum(G, X)`` / ``einsum(G, Hp)`` per sample, and Opacus' ghost
clipping (``grad_sample_mode="ghost"``) computes the per-sample norms with the Gram trick
``‖∇W[b]‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (``compute_linear_norm_sample``) and takes the clipped
sum from a second backward, never materialising per-sample gradients. Every trainable parameter
lives in an ``nn.Linear``, so ``ModuleValidator.validate`` accepts the module and any Opacus
grad-sample mode that supports ``nn.Linear`` works.

Why not a module with its own grad sampler for ``W_hh``? Opacus' full backward hook fires
before the module's internal backward when the module input does not require grad, so a
recurrence module could not hand its internal ``G`` to a registered grad sampler reliably; the
formulation above needs no custom sampler at all (design choice, see the helper-10 brief).

Exactness: with the weights of an ``nn.LSTM`` (``replace_lstm`` copies them) the forward is the
LSTM recurrence of ``torch.nn.LSTM`` and the per-sample gradients equal those of Opacus'
``DPLSTM`` + ``GradSampleModule`` up to floating-point rounding (``tests/test_fast_dp_lstm.py``
checks 1e-5 relative in float64, with padding / variable lengths, multi-layer, bidirectional and
given ``(h0, c0)``). Per-window clipping of these gradients gives the same sensitivity bound as
``DPLSTM``, so the privacy accounting is unchanged (Algorithm 2 of Schuchardt et al., ICML 2025,
bounds one window's contribution by the clipping norm; this module only computes the gradient).

Variable lengths: a ``PackedSequence`` input is padded internally and a mask freezes the state
of sequence ``b`` after its length ``L_b`` (outputs there are 0, ``h_n``/``c_n`` are the states
at ``L_b − 1``, as in ``nn.LSTM``); padded steps have ``G = 0`` and contribute nothing.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._validation import check_int

__all__ = ["FastDPLSTM", "FastDPLSTMLayer", "replace_lstm"]


def _scan(xp: Tensor, w_hh: Tensor, b_hh: Optional[Tensor], h: Tensor, c: Tensor,
          mask: Optional[Tensor]):
    """The LSTM recurrence without autograd; returns states and what the backward needs.

    ``xp`` (B, T, 4H) holds ``W_ih x_t + b_ih``. Returns ``hs``/``cs`` (B, T, H): the states
    after each step (frozen after the length where ``mask`` is 0), ``acts`` (B, T, 4H): the
    activated gates (σ(i), σ(f), tanh(g), σ(o)) and ``tcs`` (B, T, H): ``tanh(c_new)``.
    """
    B, T, G4 = xp.shape
    H = G4 // 4
    hs = xp.new_empty(B, T, H)
    cs = xp.new_empty(B, T, H)
    tcs = xp.new_empty(B, T, H)
    acts = xp.new_empty(B, T, G4)
    w_t = w_hh.t()
    if b_hh is not None:
        xp = xp + b_hh
    for t in range(T):
        z = torch.addmm(xp[:, t], h, w_t)
        a = acts[:, t]
        torch.sigmoid(z, out=a)
        a[:, 2 * H:3 * H] = torch.tanh(z[:, 2 * H:3 * H])
        i, f, g, o = a.split(H, dim=1)
        c_new = torch.addcmul(f * c, i, g)
        tc = torch.tanh(c_new)
        h_new = o * tc
        if mask is not None:
            m = mask[:, t]
            c_new = torch.where(m, c_new, c)
            h_new = torch.where(m, h_new, h)
        tcs[:, t] = tc
        cs[:, t] = c_new
        hs[:, t] = h_new
        h, c = h_new, c_new
    return hs, cs, acts, tcs


class _LSTMRecurrence(torch.autograd.Function):
    """``(Z, h0, c0) -> (hs, cs)`` with the values precomputed by :func:`_scan`.

    The forward returns the cached states of the scan (the scan used exactly the ``Z`` that
    autograd sees). The backward is BPTT: for t = T−1 … 0, with ``dh``/``dc`` the gradients of
    the state after step t,

    ``dc_new = m(dc + dh·o·(1 − tanh²c_new))``, ``G_t = (dc_new·g·i(1−i), dc_new·c_{t−1}·f(1−f),
    dc_new·i·(1−g²), m·dh·tanh(c_new)·o(1−o))``, ``dc_{t−1} = dc_new·f + (1−m)dc``,
    ``dh_{t−1} = G_t W_hh + (1−m)dh``.
    """

    @staticmethod
    def forward(ctx, z, h0, c0, w_hh, hs, cs, acts, tcs, mask):
        # Whole-sequence factors of the BPTT step (computed once, so the backward time loop
        # runs ~7 kernels per step): G_t = (dc_new, dc_new, dc_new, dh) * M_t.
        H = hs.shape[-1]
        i, f, g, o = acts.split(H, dim=2)
        c_prev = torch.cat([c0.unsqueeze(1), cs[:, :-1]], dim=1)
        m_fac = torch.cat([g * i * (1.0 - i), c_prev * f * (1.0 - f), i * (1.0 - g * g),
                           tcs * o * (1.0 - o)], dim=2)
        o_dtanh = o * (1.0 - tcs * tcs)
        ctx.save_for_backward(w_hh, m_fac, o_dtanh, f.contiguous(),
                              mask if mask is not None else torch.empty(0))
        ctx.has_mask = mask is not None
        return hs.clone(), cs.clone()

    @staticmethod
    def backward(ctx, d_hs, d_cs):
        w_hh, m_fac, o_dtanh, f, mask = ctx.saved_tensors
        B, T, H = f.shape
        dh = m_fac.new_zeros(B, H)
        dc = m_fac.new_zeros(B, H)
        grads = [None] * T
        for t in range(T - 1, -1, -1):
            if d_hs is not None:
                dh = dh + d_hs[:, t]
            if d_cs is not None:
                dc = dc + d_cs[:, t]
            if ctx.has_mask:
                m = mask[:, t].to(dh.dtype)
                dh_in, dc_in = dh * m, dc * m
            else:
                dh_in, dc_in = dh, dc
            dc_new = torch.addcmul(dc_in, dh_in, o_dtanh[:, t])
            gz = torch.cat([dc_new, dc_new, dc_new, dh_in], dim=1).mul_(m_fac[:, t])
            grads[t] = gz
            dh_rec = gz @ w_hh
            if ctx.has_mask:
                dc = torch.addcmul(dc * (1.0 - m), dc_new, f[:, t])
                dh = torch.addcmul(dh_rec, dh, 1.0 - m)
            else:
                dc = dc_new * f[:, t]
                dh = dh_rec
        return torch.stack(grads, dim=1), dh, dc, None, None, None, None, None, None


class FastDPLSTMLayer(nn.Module):
    """One direction of one LSTM layer: ``ih`` and ``hh`` are ``nn.Linear`` (see module doc).

    ``forward(x, h0, c0, mask)`` with ``x`` (B, T, I) batch-first, ``h0``/``c0`` (B, H) and an
    optional bool ``mask`` (B, T, 1) returns ``(out, h_n, c_n)``.
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.ih = nn.Linear(input_size, 4 * hidden_size, bias=bias)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size, bias=bias)

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor, mask: Optional[Tensor] = None):
        xp = self.ih(x)
        w_hh, b_hh = self.hh.weight, self.hh.bias
        with torch.no_grad():
            hs, cs, acts, tcs = _scan(xp.detach(), w_hh.detach(),
                                      None if b_hh is None else b_hh.detach(),
                                      h0.detach(), c0.detach(), mask)
        tracked = torch.is_grad_enabled() and (
            xp.requires_grad or w_hh.requires_grad or h0.requires_grad or c0.requires_grad
            or (b_hh is not None and b_hh.requires_grad))
        if tracked:
            h_prev = torch.cat([h0.detach().unsqueeze(1), hs[:, :-1]], dim=1)
            z = xp + self.hh(h_prev)
            hs, cs = _LSTMRecurrence.apply(z, h0, c0, w_hh.detach(), hs, cs, acts, tcs, mask)
        out = hs if mask is None else hs * mask.to(hs.dtype)
        return out, hs[:, -1], cs[:, -1]


class FastDPLSTM(nn.Module):
    r"""Drop-in replacement of ``torch.nn.LSTM`` with fast exact per-sample gradients.

    Same constructor and ``forward(input, (h0, c0)) -> (output, (h_n, c_n))`` as
    ``nn.LSTM`` (``input`` a tensor — batched or unbatched — or a ``PackedSequence``;
    ``num_layers``, ``bias``, ``batch_first``, ``dropout`` between layers, ``bidirectional``).
    ``proj_size`` is not supported (ValueError). Parameters live in
    ``layers[k·D + d].ih``/``.hh`` (``nn.Linear``; D = 2 if bidirectional), in the order of
    Opacus' ``DPLSTM`` (``l{k}.ih``, ``l{k}.hh``, ``l{k}_reverse.ih``, …), so seeded noise of an
    Opacus optimizer lands on the same tensors. See the module docstring for the method and why
    the per-sample gradients equal those of ``DPLSTM``.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__()
        self.input_size = check_int("input_size", input_size, minimum=1)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        if proj_size != 0:
            raise ValueError(f"proj_size must be 0 (projections are not supported by FastDPLSTM),"
                             f" got {proj_size}")
        dropout = float(dropout)
        if not (0.0 <= dropout <= 1.0) or math.isnan(dropout):
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = dropout
        self.bidirectional = bool(bidirectional)
        self.proj_size = 0
        self.num_directions = 2 if self.bidirectional else 1
        layers = []
        for k in range(self.num_layers):
            in_size = self.input_size if k == 0 else self.hidden_size * self.num_directions
            for _ in range(self.num_directions):
                layers.append(FastDPLSTMLayer(in_size, self.hidden_size, bias=self.bias))
        self.layers = nn.ModuleList(layers)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """U(−1/√H, 1/√H) for every weight and bias, as ``nn.LSTM``."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def _layer(self, k: int, d: int) -> FastDPLSTMLayer:
        return self.layers[k * self.num_directions + d]

    @torch.no_grad()
    def load_from_lstm(self, lstm: nn.LSTM) -> "FastDPLSTM":
        """Copy the weights of an ``nn.LSTM`` (or Opacus ``DPLSTM``) with the same shape."""
        sd = lstm.state_dict()
        for k in range(self.num_layers):
            for d in range(self.num_directions):
                sfx = f"l{k}" + ("_reverse" if d else "")
                layer = self._layer(k, d)
                for m in ("ih", "hh"):
                    getattr(layer, m).weight.copy_(sd[f"weight_{m}_{sfx}"])
                    if self.bias:
                        getattr(layer, m).bias.copy_(sd[f"bias_{m}_{sfx}"])
        return self

    def forward(self, input, hx: Optional[Tuple[Tensor, Tensor]] = None):
        packed = isinstance(input, PackedSequence)
        mask = None
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
            T = x.shape[1]
            mask = (torch.arange(T)[None, :] < lengths[:, None]).unsqueeze(-1).to(x.device)
            unbatched = False
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"input must be 2-D (unbatched) or 3-D, got shape "
                                 f"{tuple(input.shape)}")
            unbatched = input.dim() == 2
            x = input.unsqueeze(0 if self.batch_first else 1) if unbatched else input
            if not self.batch_first:
                x = x.transpose(0, 1)
            lengths = None
        if x.shape[-1] != self.input_size:
            raise ValueError(f"input has {x.shape[-1]} features, expected input_size="
                             f"{self.input_size}")
        B, T = x.shape[0], x.shape[1]
        n_states = self.num_layers * self.num_directions
        if hx is None:
            h0 = c0 = x.new_zeros(n_states, B, self.hidden_size)
        else:
            h0, c0 = hx
            if unbatched:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
            want = (n_states, B, self.hidden_size)
            if tuple(h0.shape) != want or tuple(c0.shape) != want:
                raise ValueError(f"hx must be two tensors of shape {want}, got "
                                 f"{tuple(h0.shape)} and {tuple(c0.shape)}")
        rev_index = None
        if self.bidirectional:
            t_idx = torch.arange(T, device=x.device).expand(B, T)
            if lengths is None:
                rev_index = (T - 1 - t_idx)
            else:
                L = lengths.to(x.device)[:, None]
                rev_index = torch.where(t_idx < L, L - 1 - t_idx, t_idx)
        h_n, c_n = [], []
        layer_in = x
        for k in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                s = k * self.num_directions + d
                inp = layer_in
                if d == 1:
                    idx = rev_index.unsqueeze(-1).expand(B, T, inp.shape[-1])
                    inp = inp.gather(1, idx)
                out, h, c = self._layer(k, d)(inp, h0[s], c0[s], mask)
                if d == 1:
                    out = out.gather(1, rev_index.unsqueeze(-1).expand_as(out))
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if self.dropout > 0 and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, self.training)
        output = layer_in
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed:
            output = pack_padded_sequence(output, lengths, batch_first=True,
                                          enforce_sorted=False)
            return output, (h_n, c_n)
        if not self.batch_first:
            output = output.transpose(0, 1)
        if unbatched:
            output = output.squeeze(0 if self.batch_first else 1)
            h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
        return output, (h_n, c_n)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}, "
                f"bidirectional={self.bidirectional}")


def _from_lstm(lstm: nn.Module) -> FastDPLSTM:
    if getattr(lstm, "proj_size", 0):
        raise ValueError(f"cannot replace {lstm!r}: proj_size != 0 is not supported")
    ref = next(lstm.parameters(), None)
    fast = FastDPLSTM(lstm.input_size, lstm.hidden_size, num_layers=lstm.num_layers,
                      bias=lstm.bias, batch_first=lstm.batch_first, dropout=lstm.dropout,
                      bidirectional=lstm.bidirectional)
    if ref is not None:
        fast.to(device=ref.device, dtype=ref.dtype)
    fast.load_from_lstm(lstm)
    fast.train(lstm.training)
    return fast


def replace_lstm(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Replace every ``nn.LSTM`` / Opacus ``DPLSTM`` in ``model`` by :class:`FastDPLSTM`.

    Like ``opacus.validators.ModuleValidator.fix``: returns the fixed model (a deep copy unless
    ``inplace``), weights copied, so the forward is unchanged. ``model`` may itself be an LSTM.
    """
    from opacus.layers import DPLSTM

    kinds = (nn.LSTM, DPLSTM)
    if isinstance(model, kinds):
        return _from_lstm(model)
    if not inplace:
        model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kinds):
                setattr(parent, name, _from_lstm(child))
    return model
