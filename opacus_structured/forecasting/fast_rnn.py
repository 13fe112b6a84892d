r"""Fast DP-compatible LSTM (and GRU): exact per-sample gradients without a hooked Python time loop.

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

Two recurrences compute ``(hs, h_n, c_n)`` and ``G`` (``recurrence=``):

* ``"native"`` — torch's own LSTM kernel (**cuDNN on CUDA**) run on the projected input ``Xp``
  with ``W_ih = I`` (4H×4H), ``b_ih = 0`` and detached ``W_hh``/``b_hh``: its pre-activation is
  exactly ``z_t``, so the gradient it returns for its input *is* ``G`` (recurrent path
  included), and it computes no weight gradient. The kernel's graph is recorded once on
  detached leaves; ``_NativeBackprop`` hands its input gradient to ``Z = Xp + hh(Hp)``.
* ``"python"`` — :func:`_scan` and the hand-written BPTT of ``_LSTMRecurrence``: ~17 small
  kernels per time step and layer, fine on CPU, launch-bound on a GPU.
* ``"auto"`` (default) — ``"native"`` for CUDA tensors, ``"python"`` otherwise (on CPU the
  identity projection costs more than the loop saves; ``benchmarks/dp_lstm.py``).

Why not a module with its own grad sampler for ``W_hh``? Opacus' full backward hook fires
before the module's internal backward when the module input does not require grad, so a
recurrence module could not hand its internal ``G`` to a registered grad sampler reliably; the
formulation above needs no custom sampler at all.

Exactness: with the weights of an ``nn.LSTM`` (``replace_lstm`` copies them) the forward is the
LSTM recurrence of ``torch.nn.LSTM`` and the per-sample gradients equal those of Opacus'
``DPLSTM`` + ``GradSampleModule`` up to floating-point rounding (``tests/test_fast_dp_rnn.py``
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
import functools
import math
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .._validation import check_int

__all__ = ["FastDPGRU", "FastDPGRULayer", "FastDPLSTM", "FastDPLSTMLayer", "replace_gru",
           "replace_lstm"]


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


RECURRENCES = ("auto", "native", "python")


@functools.lru_cache(maxsize=16)
def _identity_input(size: int, dtype: torch.dtype, device: torch.device):
    """The kernel's constant ``W_ih = I`` and ``b_ih = 0`` (made once, never written to)."""
    return (torch.eye(size, dtype=dtype, device=device),
            torch.zeros(size, dtype=dtype, device=device))


def _native_rnn(mode: str, xp: Tensor, states: Tuple[Tensor, ...], w_hh: Tensor,
                b_hh: Optional[Tensor], lengths: Optional[Tensor], train: bool):
    """Torch's own one-layer ``mode`` (``"lstm"``/``"gru"``) kernel — cuDNN on CUDA — on the
    *projected* input ``xp`` (B, T, gH).

    ``W_ih`` is the identity (gH×gH) and ``b_ih`` is 0, so the kernel's input-side
    pre-activation at step t is ``xp_t`` and the gradient it returns for its input is
    ``∂L/∂xp_t`` (for the LSTM: ``G_t = ∂L/∂z_t``). ``lengths`` (CPU, ≥ 1) runs a packed sequence
    (states frozen after each length, padded outputs 0). Returns ``(hs, final_states)``.
    """
    eye, zero = _identity_input(xp.shape[-1], xp.dtype, xp.device)
    weights = [eye, w_hh] if b_hh is None else [eye, w_hh, zero, b_hh]
    kernel = torch.lstm if mode == "lstm" else torch.gru
    hx = tuple(h.unsqueeze(0) for h in states)
    if lengths is None:
        out = kernel(xp, hx if mode == "lstm" else hx[0], weights, b_hh is not None, 1, 0.0,
                     train, False, True)
        return out[0], tuple(h[0] for h in out[1:])
    packed = pack_padded_sequence(xp, lengths.cpu(), batch_first=True, enforce_sorted=False)
    hx = tuple(h.index_select(1, packed.sorted_indices) for h in hx)
    out = kernel(packed.data, packed.batch_sizes, hx if mode == "lstm" else hx[0], weights,
                 b_hh is not None, 1, 0.0, train, False)
    hs, _ = pad_packed_sequence(
        PackedSequence(out[0], packed.batch_sizes, packed.sorted_indices,
                       packed.unsorted_indices),
        batch_first=True, total_length=xp.shape[1])
    return hs, tuple(h[0].index_select(0, packed.unsorted_indices) for h in out[1:])


def _use_native(recurrence: str, x: Tensor) -> bool:
    """``"auto"``: torch's kernel on CUDA, where a Python time loop is bound by kernel launches
    (~17 small kernels per step and layer); the Python scan on CPU, where the kernel's identity
    input projection (4H×4H per step) costs more than the loop (``benchmarks/dp_lstm.py``)."""
    return recurrence == "native" or (recurrence == "auto" and x.is_cuda)


class _NativeBackprop(torch.autograd.Function):
    """``(Xp, Y, graph, reset, *states) -> (hs, *final_states)``: the native kernel's own BPTT.

    The forward returns the outputs of the kernel graph ``graph = (leaves, outputs)`` (recorded on
    detached leaves ``xp``, ``*states`` with constant weights, so the kernel computes no weight
    gradient). The backward asks that graph for ``∂L/∂xp`` (recurrent path included) and the
    state gradients; ``Xp = ih(X)`` gets ``∂L/∂xp`` and ``Y = hh(Hp)`` gets the gradient of the
    recurrent pre-activation: the same for the LSTM (``reset`` is None), and for the GRU the
    candidate block multiplied by the reset gate ``r_t`` (``n_t = tanh(x_n + r_t ⊙ y_n)``). The
    graph is retained, so Opacus' ghost clipping may backward twice.
    """

    @staticmethod
    def forward(ctx, xp, y, graph, reset, *states):
        ctx.graph, ctx.reset = graph, reset
        return tuple(t.detach().clone() for t in graph[1])

    @staticmethod
    def backward(ctx, *d_outputs):
        leaves, outputs = ctx.graph
        g, *d_states = torch.autograd.grad(outputs, leaves, d_outputs, retain_graph=True,
                                           allow_unused=True)
        g_y = g
        if ctx.reset is not None:
            H = ctx.reset.shape[-1]
            g_y = torch.cat([g[..., :2 * H], g[..., 2 * H:] * ctx.reset], dim=-1)
        return (g, g_y, None, None, *d_states)


class _FastDPRNNLayer(nn.Module):
    """One direction of one recurrent layer: ``ih`` and ``hh`` are ``nn.Linear`` (module doc).

    ``forward(x, states, mask, lengths)`` with ``x`` (B, T, I) batch-first, ``states`` the
    initial states (``(h0, c0)`` for the LSTM, ``(h0,)`` for the GRU; each (B, H)), an optional
    bool ``mask`` (B, T, 1) and the matching CPU ``lengths`` (B,) returns ``(out, final_states)``.
    """

    mode = ""
    gates = 0

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 recurrence: str = "auto"):
        super().__init__()
        if recurrence not in RECURRENCES:
            raise ValueError(f"recurrence must be one of {RECURRENCES}, got {recurrence!r}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.recurrence = recurrence
        self.ih = nn.Linear(input_size, self.gates * hidden_size, bias=bias)
        self.hh = nn.Linear(hidden_size, self.gates * hidden_size, bias=bias)

    def _tracked(self, xp: Tensor, states) -> bool:
        return torch.is_grad_enabled() and (
            xp.requires_grad or any(p.requires_grad for p in self.hh.parameters())
            or any(h.requires_grad for h in states))

    def _reset_gate(self, xp: Tensor, y: Tensor) -> Optional[Tensor]:
        return None

    def _forward_native(self, xp, states, mask, lengths):
        if mask is not None and lengths is None:
            lengths = mask.reshape(mask.shape[0], -1).sum(1).cpu()
        tracked = self._tracked(xp, states)
        b_hh = None if self.hh.bias is None else self.hh.bias.detach()
        with torch.enable_grad() if tracked else torch.no_grad(), warnings.catch_warnings():
            # cuDNN copies our 4 weight tensors into its flat buffer (a few KiB) on every call
            warnings.filterwarnings("ignore", message="RNN module weights are not part")
            leaves = tuple(t.detach().requires_grad_(tracked) for t in (xp, *states))
            hs, finals = _native_rnn(self.mode, leaves[0], leaves[1:], self.hh.weight.detach(),
                                     b_hh, lengths, train=tracked)
        if not tracked:
            return hs, finals
        h_prev = torch.cat([states[0].detach().unsqueeze(1), hs.detach()[:, :-1]], dim=1)
        y = self.hh(h_prev)  # the recurrent pre-activation the kernel used; gets its gradient
        outs = _NativeBackprop.apply(xp, y, (leaves, (hs, *finals)), self._reset_gate(xp, y),
                                     *states)
        return outs[0], tuple(outs[1:])


class FastDPLSTMLayer(_FastDPRNNLayer):
    """One direction of one LSTM layer. ``recurrence``: ``"native"`` runs the recurrence and its
    BPTT in torch's LSTM kernel (cuDNN on CUDA); ``"python"`` in :func:`_scan` /
    ``_LSTMRecurrence``; ``"auto"`` (default) picks ``"native"`` for CUDA tensors and
    ``"python"`` otherwise. All hand the same ``G`` to ``ih`` and ``hh``."""

    mode = "lstm"
    gates = 4

    def forward(self, x: Tensor, states: Tuple[Tensor, Tensor], mask: Optional[Tensor] = None,
                lengths: Optional[Tensor] = None):
        xp = self.ih(x)
        if _use_native(self.recurrence, xp):
            return self._forward_native(xp, states, mask, lengths)
        h0, c0 = states
        w_hh, b_hh = self.hh.weight, self.hh.bias
        with torch.no_grad():
            hs, cs, acts, tcs = _scan(xp.detach(), w_hh.detach(),
                                      None if b_hh is None else b_hh.detach(),
                                      h0.detach(), c0.detach(), mask)
        if self._tracked(xp, states):
            h_prev = torch.cat([h0.detach().unsqueeze(1), hs[:, :-1]], dim=1)
            z = xp + self.hh(h_prev)
            hs, cs = _LSTMRecurrence.apply(z, h0, c0, w_hh.detach(), hs, cs, acts, tcs, mask)
        out = hs if mask is None else hs * mask.to(hs.dtype)
        return out, (hs[:, -1], cs[:, -1])


class FastDPGRULayer(_FastDPRNNLayer):
    """One direction of one GRU layer (gate order r, z, n as in ``nn.GRU``); torch's GRU kernel
    (cuDNN on CUDA) for every ``recurrence`` except ``"python"``, which is refused.

    With ``a = ih(x_t)`` and ``y = hh(h_{t−1})``: ``r = σ(a_r + y_r)``, ``u = σ(a_z + y_z)``,
    ``n = tanh(a_n + r ⊙ y_n)``, ``h_t = (1 − u) ⊙ n + u ⊙ h_{t−1}``. The kernel returns
    ``∂L/∂a``; ``∂L/∂y`` equals it on the r and z blocks and is ``r ⊙ ∂L/∂a_n`` on the n block.
    """

    mode = "gru"
    gates = 3

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 recurrence: str = "auto"):
        if recurrence == "python":
            raise ValueError("recurrence='python' is implemented for FastDPLSTM only; "
                             "FastDPGRU takes 'auto' or 'native'")
        super().__init__(input_size, hidden_size, bias=bias, recurrence=recurrence)

    def _reset_gate(self, xp: Tensor, y: Tensor) -> Tensor:
        H = self.hidden_size
        return torch.sigmoid(xp.detach()[..., :H] + y.detach()[..., :H])

    def forward(self, x: Tensor, states: Tuple[Tensor], mask: Optional[Tensor] = None,
                lengths: Optional[Tensor] = None):
        return self._forward_native(self.ih(x), states, mask, lengths)


class _FastDPRNN(nn.Module):
    """Shared body of :class:`FastDPLSTM` / :class:`FastDPGRU`: ``nn.LSTM``/``nn.GRU``
    arguments, input forms (batched, unbatched, ``PackedSequence``), layers, directions."""

    layer_class = _FastDPRNNLayer
    n_states = 1

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None,
                 recurrence: str = "auto"):
        super().__init__()
        self.input_size = check_int("input_size", input_size, minimum=1)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        if proj_size != 0:
            raise ValueError(f"proj_size must be 0 (projections are not supported by "
                             f"{type(self).__name__}), got {proj_size}")
        dropout = float(dropout)
        if not (0.0 <= dropout <= 1.0) or math.isnan(dropout):
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = dropout
        self.bidirectional = bool(bidirectional)
        self.proj_size = 0
        self.num_directions = 2 if self.bidirectional else 1
        self.recurrence = recurrence
        layers = []
        for k in range(self.num_layers):
            in_size = self.input_size if k == 0 else self.hidden_size * self.num_directions
            for _ in range(self.num_directions):
                layers.append(self.layer_class(in_size, self.hidden_size, bias=self.bias,
                                               recurrence=recurrence))
        self.layers = nn.ModuleList(layers)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """U(−1/√H, 1/√H) for every weight and bias, as ``nn.LSTM`` / ``nn.GRU``."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def _layer(self, k: int, d: int) -> _FastDPRNNLayer:
        return self.layers[k * self.num_directions + d]

    @torch.no_grad()
    def load_from_rnn(self, rnn: nn.Module) -> "_FastDPRNN":
        """Copy the weights of a torch / Opacus RNN of the same kind and shape."""
        sd = rnn.state_dict()
        for k in range(self.num_layers):
            for d in range(self.num_directions):
                sfx = f"l{k}" + ("_reverse" if d else "")
                layer = self._layer(k, d)
                for m in ("ih", "hh"):
                    getattr(layer, m).weight.copy_(sd[f"weight_{m}_{sfx}"])
                    if self.bias:
                        getattr(layer, m).bias.copy_(sd[f"bias_{m}_{sfx}"])
        return self

    def forward(self, input, hx=None):
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
        want = (self.num_layers * self.num_directions, B, self.hidden_size)
        if hx is None:
            states = (x.new_zeros(want),) * self.n_states
        else:
            states = (hx,) if isinstance(hx, Tensor) else tuple(hx)
            if unbatched and all(isinstance(h, Tensor) for h in states):
                states = tuple(h.unsqueeze(1) for h in states)
            if len(states) != self.n_states or any(
                    not isinstance(h, Tensor) or tuple(h.shape) != want for h in states):
                raise ValueError(f"hx must be {self.n_states} tensor(s) of shape {want}, got "
                                 f"{[tuple(getattr(h, 'shape', ())) for h in states]}")
        rev_index = None
        if self.bidirectional:
            t_idx = torch.arange(T, device=x.device).expand(B, T)
            if lengths is None:
                rev_index = (T - 1 - t_idx)
            else:
                L = lengths.to(x.device)[:, None]
                rev_index = torch.where(t_idx < L, L - 1 - t_idx, t_idx)
        finals = []
        layer_in = x
        for k in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                s = k * self.num_directions + d
                inp = layer_in
                if d == 1:
                    idx = rev_index.unsqueeze(-1).expand(B, T, inp.shape[-1])
                    inp = inp.gather(1, idx)
                out, final = self._layer(k, d)(inp, tuple(h[s] for h in states), mask, lengths)
                if d == 1:
                    out = out.gather(1, rev_index.unsqueeze(-1).expand_as(out))
                outs.append(out)
                finals.append(final)
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if self.dropout > 0 and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, self.training)
        output = layer_in
        h_n = tuple(torch.stack([f[j] for f in finals]) for j in range(self.n_states))
        if packed:
            output = pack_padded_sequence(output, lengths, batch_first=True,
                                          enforce_sorted=False)
        else:
            if not self.batch_first:
                output = output.transpose(0, 1)
            if unbatched:
                output = output.squeeze(0 if self.batch_first else 1)
                h_n = tuple(h.squeeze(1) for h in h_n)
        return output, (h_n if self.n_states > 1 else h_n[0])

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}, "
                f"bidirectional={self.bidirectional}, recurrence={self.recurrence!r}")


class FastDPLSTM(_FastDPRNN):
    r"""Drop-in replacement of ``torch.nn.LSTM`` with fast exact per-sample gradients.

    Same constructor and ``forward(input, (h0, c0)) -> (output, (h_n, c_n))`` as
    ``nn.LSTM`` (``input`` a tensor — batched or unbatched — or a ``PackedSequence``;
    ``num_layers``, ``bias``, ``batch_first``, ``dropout`` between layers, ``bidirectional``).
    ``proj_size`` is not supported (ValueError). ``recurrence``: ``"auto"`` (default; torch's
    LSTM kernel — cuDNN — on CUDA, the Python scan on CPU), ``"native"`` or ``"python"`` (module
    docstring); all give the same gradients. Parameters live in
    ``layers[k·D + d].ih``/``.hh`` (``nn.Linear``; D = 2 if bidirectional), in the order of
    Opacus' ``DPLSTM`` (``l{k}.ih``, ``l{k}.hh``, ``l{k}_reverse.ih``, …), so seeded noise of an
    Opacus optimizer lands on the same tensors. See the module docstring for the method and why
    the per-sample gradients equal those of ``DPLSTM``.
    """

    layer_class = FastDPLSTMLayer
    n_states = 2

    def load_from_lstm(self, lstm: nn.Module) -> "FastDPLSTM":
        """Copy the weights of an ``nn.LSTM`` (or Opacus ``DPLSTM``) with the same shape."""
        return self.load_from_rnn(lstm)


class FastDPGRU(_FastDPRNN):
    r"""Drop-in replacement of ``torch.nn.GRU`` with fast exact per-sample gradients.

    Same constructor and ``forward(input, h0) -> (output, h_n)`` as ``nn.GRU`` (arguments and
    input forms as :class:`FastDPLSTM`). The recurrence always runs in torch's GRU kernel (cuDNN
    on CUDA; ``recurrence`` ``"auto"``/``"native"``); ``ih``/``hh`` hold ``W_i{r,z,n}``,
    ``W_h{r,z,n}`` in Opacus' ``DPGRU`` order, and the per-sample gradients equal ``DPGRU``'s
    (``tests/test_fast_dp_rnn.py``).
    """

    layer_class = FastDPGRULayer
    n_states = 1


def _replacement(rnn: nn.Module, cls, recurrence: str) -> _FastDPRNN:
    if getattr(rnn, "proj_size", 0):
        raise ValueError(f"cannot replace {rnn!r}: proj_size != 0 is not supported")
    ref = next(rnn.parameters(), None)
    fast = cls(rnn.input_size, rnn.hidden_size, num_layers=rnn.num_layers, bias=rnn.bias,
               batch_first=rnn.batch_first, dropout=rnn.dropout, bidirectional=rnn.bidirectional,
               recurrence=recurrence)
    if ref is not None:
        fast.to(device=ref.device, dtype=ref.dtype)
    fast.load_from_rnn(rnn)
    fast.train(rnn.training)
    return fast


def _replace(model: nn.Module, kinds, cls, inplace: bool, recurrence: str) -> nn.Module:
    if isinstance(model, kinds):
        return _replacement(model, cls, recurrence)
    if not inplace:
        model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kinds):
                setattr(parent, name, _replacement(child, cls, recurrence))
    return model


def replace_lstm(model: nn.Module, *, inplace: bool = False,
                 recurrence: str = "auto") -> nn.Module:
    """Replace every ``nn.LSTM`` / Opacus ``DPLSTM`` in ``model`` by :class:`FastDPLSTM`.

    Like ``opacus.validators.ModuleValidator.fix``: returns the fixed model (a deep copy unless
    ``inplace``), weights copied, so the forward is unchanged. ``model`` may itself be an LSTM.
    ``recurrence`` is passed to every :class:`FastDPLSTM`.
    """
    from opacus.layers import DPLSTM

    return _replace(model, (nn.LSTM, DPLSTM), FastDPLSTM, inplace, recurrence)


def replace_gru(model: nn.Module, *, inplace: bool = False,
                recurrence: str = "auto") -> nn.Module:
    """Replace every ``nn.GRU`` / Opacus ``DPGRU`` in ``model`` by :class:`FastDPGRU` (as
    :func:`replace_lstm`)."""
    from opacus.layers import DPGRU

    return _replace(model, (nn.GRU, DPGRU), FastDPGRU, inplace, recurrence)
