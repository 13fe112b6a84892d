"""FastDPLSTM / FastDPGRU (issue 10): forward/backward equal ``nn.LSTM`` / ``nn.GRU``; per-sample
gradients, their norms and the clipped, noised DP-SGD update equal Opacus ``DPLSTM`` / ``DPGRU`` +
``GradSampleModule`` (float64, 1e-5 relative) and an independent brute-force per-example loop;
ghost-clipping norms equal the materialised ones; the correlated-noise optimizer works in ghost
mode. The equivalence tests run for every variant: LSTM with torch's kernel ("native") and with
the Python recurrence, and the GRU (native)."""

import copy
import math

import pytest
import torch
from opacus.grad_sample import GradSampleHooks, GradSampleModule
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)
from opacus.layers import DPGRU, DPLSTM
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from opacus.validators import ModuleValidator
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from opacus_structured.forecasting.fast_rnn import FastDPGRU, FastDPLSTM, replace_gru, replace_lstm

RTOL = 1e-5  # issue 10 acceptance: 1e-5 relative in float64
B, T, I, HID = 6, 7, 3, 5


def close(a, b, rtol=RTOL):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    scale = max(float(b.abs().max()), 1e-12)
    return float((a - b).abs().max()) <= rtol * scale


class Net(nn.Module):
    """LSTM + linear head; per-sequence scalar prediction from the outputs and the final state."""

    def __init__(self, rnn, num_directions):
        super().__init__()
        self.gru = isinstance(rnn, nn.GRU)
        self.rnn = rnn
        self.head = nn.Linear(HID * num_directions, 1)

    def forward(self, x, lengths=None, hx=None):
        inp = x
        if lengths is not None:
            inp = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        if hx is not None and self.gru:
            hx = hx[0]
        out, state = self.rnn(inp, hx)
        h, c = (state, state) if self.gru else state
        if lengths is not None:
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(out).squeeze(-1).sum(1) + (h * c).sum(0).sum(-1)


@pytest.fixture(params=[("lstm", "native"), ("lstm", "python"), ("gru", "native")],
                ids=["lstm-native", "lstm-python", "gru"])
def variant(request):
    """(kind, variant): every equivalence test runs for each."""
    return request.param


def _nets(num_layers, bidirectional, variant=("lstm", "auto"), seed=0):
    kind, recurrence = variant
    torch.manual_seed(seed)
    rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(I, HID, num_layers=num_layers,
                                                 batch_first=True, bidirectional=bidirectional)
    d = 2 if bidirectional else 1
    ref = Net(rnn.double(), d).double()
    opacus_net = ModuleValidator.fix(copy.deepcopy(ref)).double()  # fix builds float32
    assert isinstance(opacus_net.rnn, DPLSTM if kind == "lstm" else DPGRU)
    replace = replace_lstm if kind == "lstm" else replace_gru
    fast_net = replace(ref, recurrence=recurrence)
    assert isinstance(fast_net.rnn, FastDPLSTM if kind == "lstm" else FastDPGRU)
    return ref, opacus_net, fast_net


def _name_map(num_layers, bidirectional):
    """Opacus DPLSTM parameter name (nn.LSTM style) -> FastDPLSTM parameter name."""
    d = 2 if bidirectional else 1
    out = {"head.weight": "head.weight", "head.bias": "head.bias"}
    for k in range(num_layers):
        for r in range(d):
            cell = f"l{k}" + ("_reverse" if r else "")
            for m in ("ih", "hh"):
                for w in ("weight", "bias"):
                    out[f"rnn.{w}_{m}_{cell}"] = f"rnn.layers.{k * d + r}.{m}.{w}"
    return out


def _inputs(case, num_layers, bidirectional, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, I, generator=g, dtype=torch.float64)
    y = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = None
    if case in ("packed", "packed_hx"):
        lengths = torch.tensor([7, 3, 5, 1, 7, 4])
    elif case == "sorted_hx":  # descending lengths: the packed order is the batch order
        lengths = torch.tensor([7, 7, 5, 4, 3, 1])
    hx = None
    if case in ("hx", "packed_hx", "sorted_hx"):
        n = num_layers * (2 if bidirectional else 1)
        hx = (torch.randn(n, B, HID, generator=g, dtype=torch.float64),
              torch.randn(n, B, HID, generator=g, dtype=torch.float64))
    return x, y, lengths, hx


def _per_sample(net, x, y, lengths, hx):
    gsm = GradSampleModule(net, batch_first=True, loss_reduction="sum")
    loss = ((gsm(x, lengths, hx) - y) ** 2).sum()
    loss.backward()
    out = {n.removeprefix("_module."): p.grad_sample.detach().clone()
           for n, p in gsm.named_parameters()}
    gsm._close()
    return out


def _brute_force(ref, x, y, lengths, hx):
    """Independent per-example gradients: one nn.LSTM backward per sequence (cuDNN path off)."""
    grads = []
    for b in range(B):
        ref.zero_grad()
        lb = None if lengths is None else lengths[b:b + 1]
        hb = None if hx is None else tuple(h[:, b:b + 1] for h in hx)
        ((ref(x[b:b + 1], lb, hb) - y[b]) ** 2).sum().backward()
        grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
    return grads


def _norms(per_sample):
    return torch.stack([g.reshape(B, -1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)


CASES = [(1, False, "plain"), (2, False, "hx"), (2, False, "packed"), (2, True, "packed_hx"),
         (1, True, "hx")]


@pytest.mark.parametrize("num_layers,bidirectional,case", CASES)
def test_forward_and_input_gradients_equal_nn_lstm(num_layers, bidirectional, case, variant):
    ref, _, fast = _nets(num_layers, bidirectional, variant)
    x, y, lengths, hx = _inputs(case, num_layers, bidirectional)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    h1 = h2 = None
    if hx is not None:
        h1 = tuple(h.clone().requires_grad_() for h in hx)
        h2 = tuple(h.clone().requires_grad_() for h in hx)
    out_ref, out_fast = ref(x1, lengths, h1), fast(x2, lengths, h2)
    assert close(out_fast, out_ref, 1e-12)
    n_states = 2 if variant[0] == "lstm" else 1  # the GRU reads only hx[0]
    ins1 = [x1] + (list(h1[:n_states]) if h1 else [])
    ins2 = [x2] + (list(h2[:n_states]) if h2 else [])
    g1 = torch.autograd.grad(((out_ref - y) ** 2).sum(), ins1 + list(ref.parameters()))
    g2 = torch.autograd.grad(((out_fast - y) ** 2).sum(), ins2 + list(fast.parameters()))
    for a, b in zip(g2[:len(ins2)], g1[:len(ins1)]):
        assert close(a, b, 1e-10)


@pytest.mark.parametrize("num_layers,bidirectional,case", CASES)
def test_per_sample_gradients_equal_opacus_dplstm_and_brute_force(num_layers, bidirectional,
                                                                  case, variant):
    ref, opacus_net, fast_net = _nets(num_layers, bidirectional, variant)
    x, y, lengths, hx = _inputs(case, num_layers, bidirectional)
    gs_opacus = _per_sample(opacus_net, x, y, lengths, hx)
    if lengths is not None:
        # Opacus' DPLSTM + GradSampleModule on a PackedSequence (enforce_sorted=False) returns
        # the per-sample rows in the *length-sorted* order of the packed batch, not in batch
        # order (row j belongs to sample sorted_indices[j]); FastDPLSTM keeps batch order.
        # The clipped sum is permutation invariant, so the DP update agrees either way.
        order = pack_padded_sequence(x, lengths, batch_first=True,
                                     enforce_sorted=False).sorted_indices
        for n, g in gs_opacus.items():
            if n.startswith("rnn."):
                fixed = torch.empty_like(g)
                fixed[order] = g
                gs_opacus[n] = fixed
    gs_fast = _per_sample(fast_net, x, y, lengths, hx)
    names = _name_map(num_layers, bidirectional)
    assert set(names) == set(gs_opacus) and set(names.values()) == set(gs_fast)
    for n_op, n_fast in names.items():
        assert close(gs_fast[n_fast], gs_opacus[n_op]), n_op
    assert close(_norms(gs_fast), _norms(gs_opacus))
    # independent check: per-example backward of the plain nn.LSTM (lstm names: weight_ih_l0..)
    brute = _brute_force(ref, x, y, lengths, hx)
    d = 2 if bidirectional else 1
    for b in range(B):
        for k in range(num_layers):
            for r in range(d):
                sfx = f"l{k}" + ("_reverse" if r else "")
                for m in ("ih", "hh"):
                    for w in ("weight", "bias"):
                        assert close(gs_fast[f"rnn.layers.{k * d + r}.{m}.{w}"][b],
                                     brute[b][f"rnn.{w}_{m}_{sfx}"]), (b, sfx, m, w)


def _dp_update(net, x, y, lengths, hx, *, sigma, clip, seed, mode="hooks"):
    """One DP-SGD step (SGD lr=1, mean reduction) from zero; returns {name: update}."""
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    base = torch.optim.SGD(net.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(seed)
    if mode == "hooks":
        gsm = GradSampleModule(net, batch_first=True, loss_reduction="mean")
        opt = DPOptimizer(base, noise_multiplier=sigma, max_grad_norm=clip,
                          expected_batch_size=B, generator=gen)
        opt.zero_grad()
        ((gsm(x, lengths, hx) - y) ** 2).mean().backward()
    else:
        gsm = GradSampleModuleFastGradientClipping(net, batch_first=True, loss_reduction="mean",
                                                   max_grad_norm=clip, use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(base, noise_multiplier=sigma, max_grad_norm=clip,
                                              expected_batch_size=B, generator=gen)
        crit = DPLossFastGradientClipping(gsm, opt, nn.MSELoss(reduction="mean"), "mean")
        opt.zero_grad()
        crit(gsm(x, lengths, hx), y).backward()
    opt.step()
    after = {n.removeprefix("_module."): p.detach() for n, p in gsm.named_parameters()}
    gsm._close()
    return {n: after[n] - before[n] for n in before}


@pytest.mark.parametrize("num_layers,bidirectional,case", [(2, False, "sorted_hx"),
                                                           (1, True, "plain")])
def test_clipped_noised_update_equals_opacus_dplstm(num_layers, bidirectional, case,
                                                    variant):
    # Variable lengths in *descending* order only: with unsorted lengths Opacus' DPLSTM rows
    # are in packed (sorted) order while the head's rows are in batch order, so Opacus clips
    # mixed-up per-sample gradients (see the per-sample test); that case is checked against
    # the brute-force clipped sum below instead.
    _, opacus_net, fast_net = _nets(num_layers, bidirectional, variant)
    x, y, lengths, hx = _inputs(case, num_layers, bidirectional)
    norms = _norms(_per_sample(copy.deepcopy(fast_net), x, y, lengths, hx))
    clip = float(norms.median())  # some windows clipped, some not
    assert (norms > clip).any() and (norms < clip).any()
    up_op = _dp_update(opacus_net, x, y, lengths, hx, sigma=0.7, clip=clip, seed=3)
    up_fast = _dp_update(fast_net, x, y, lengths, hx, sigma=0.7, clip=clip, seed=3)
    for n_op, n_fast in _name_map(num_layers, bidirectional).items():
        assert close(up_fast[n_fast], up_op[n_op]), n_op
    # the noise is really there (sigma=0 gives a different update)
    up0 = _dp_update(copy.deepcopy(fast_net), x, y, lengths, hx, sigma=0.0, clip=clip, seed=3)
    assert not close(up0["head.bias"], up_fast["head.bias"], 1e-3)


@pytest.mark.parametrize("case", ["hx", "packed"])
def test_ghost_norms_equal_materialised_norms_and_update(case, variant):
    _, _, fast_net = _nets(2, False, variant)
    x, y, lengths, hx = _inputs(case, 2, False)
    # materialised (per-sample gradients) norms, mean reduction, MSE per sample
    gsm = GradSampleModule(copy.deepcopy(fast_net), batch_first=True, loss_reduction="mean")
    ((gsm(x, lengths, hx) - y) ** 2).mean().backward()
    mat = torch.stack([p.grad_sample.reshape(B, -1).norm(dim=1)
                       for p in gsm.parameters()]).norm(dim=0)
    gsm._close()
    ghost = GradSampleModuleFastGradientClipping(copy.deepcopy(fast_net), batch_first=True,
                                                 loss_reduction="mean", max_grad_norm=1.0,
                                                 use_ghost_clipping=True)
    loss = nn.functional.mse_loss(ghost(x, lengths, hx), y, reduction="none")
    loss.mean().backward()
    assert close(ghost.get_norm_sample(), mat)
    ghost._close()
    clip = float(mat.median())
    up_hooks = _dp_update(copy.deepcopy(fast_net), x, y, lengths, hx, sigma=0.5, clip=clip,
                          seed=11)
    up_ghost = _dp_update(copy.deepcopy(fast_net), x, y, lengths, hx, sigma=0.5, clip=clip,
                          seed=11, mode="ghost")
    for n in up_hooks:
        assert close(up_ghost[n], up_hooks[n]), n


def test_replace_lstm_nested_and_inplace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential())
    model[1].add_module("rnn", nn.LSTM(3, 4, num_layers=2, dropout=0.25, batch_first=True))
    fixed = replace_lstm(model)
    assert isinstance(model[1].rnn, nn.LSTM)  # a copy by default
    fast = fixed[1].rnn
    assert isinstance(fast, FastDPLSTM)
    assert (fast.num_layers, fast.dropout, fast.batch_first) == (2, 0.25, True)
    assert ModuleValidator.validate(fixed, strict=False) == []
    assert all(isinstance(m, nn.Linear) for m in fast.modules()
               if any(True for _ in m.parameters(recurse=False)))
    same = replace_lstm(model, inplace=True)
    assert same is model and isinstance(model[1].rnn, FastDPLSTM)
    # an opacus DPLSTM is replaced too, weights preserved
    dpl = DPLSTM(3, 4)
    x = torch.randn(5, 2, 3)
    assert torch.allclose(replace_lstm(dpl)(x)[0], dpl(x)[0], atol=1e-6)


def test_replace_gru_unbatched_seq_first_and_dpgru():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 3), nn.GRU(3, 4, num_layers=2, bidirectional=True))
    fixed = replace_gru(model)
    assert isinstance(model[1], nn.GRU) and isinstance(fixed[1], FastDPGRU)
    assert ModuleValidator.validate(fixed, strict=False) == []
    gru = model[1].double()
    fast = replace_gru(gru)
    x = torch.randn(6, 3, dtype=torch.float64)  # unbatched (T, I), seq-first
    h0 = torch.randn(4, 4, dtype=torch.float64)
    (o1, h1), (o2, h2) = gru(x, h0), fast(x, h0)
    assert o2.shape == o1.shape and h2.shape == h1.shape
    assert close(o2, o1, 1e-12) and close(h2, h1, 1e-12)
    dpg = DPGRU(3, 4)
    x = torch.randn(5, 2, 3)
    assert torch.allclose(replace_gru(dpg)(x)[0], dpg(x)[0], atol=1e-6)
    with pytest.raises(ValueError, match="FastDPLSTM only"):
        FastDPGRU(3, 4, recurrence="python")
    with pytest.raises(ValueError, match="hx must be 1 tensor"):
        fast(x.double(), (h0, h0))


def test_unbatched_seq_first_and_dropout_match_nn_lstm():
    torch.manual_seed(2)
    lstm = nn.LSTM(3, 4, num_layers=2).double()
    fast = replace_lstm(lstm)
    x = torch.randn(6, 3, dtype=torch.float64)  # unbatched (T, I)
    (o1, (h1, c1)), (o2, (h2, c2)) = lstm(x), fast(x)
    assert o2.shape == o1.shape and h2.shape == h1.shape
    assert close(o2, o1, 1e-12) and close(h2, h1, 1e-12) and close(c2, c1, 1e-12)
    drop = FastDPLSTM(3, 4, num_layers=2, dropout=0.5)
    drop.eval()
    a = drop(torch.randn(4, 2, 3))[0]
    assert a.shape == (4, 2, 4)


def test_no_grad_inference_matches_training_forward(variant):
    torch.manual_seed(3)
    kind, recurrence = variant
    fast = (FastDPLSTM if kind == "lstm" else FastDPGRU)(3, 4, num_layers=2, batch_first=True,
                                                        recurrence=recurrence).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with torch.no_grad():
        a = fast(x)[0]
    b = fast(x)[0]
    assert b.requires_grad and torch.equal(a, b.detach())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="proj_size"):
        FastDPLSTM(3, 4, proj_size=2)
    with pytest.raises(ValueError, match="proj_size"):
        replace_lstm(nn.LSTM(3, 4, proj_size=2))
    with pytest.raises(ValueError, match="dropout"):
        FastDPLSTM(3, 4, dropout=1.5)
    with pytest.raises(ValueError, match="hidden_size"):
        FastDPLSTM(3, 0)
    with pytest.raises(ValueError, match="num_layers"):
        FastDPLSTM(3, 4, num_layers=0)
    with pytest.raises(ValueError, match="recurrence"):
        FastDPLSTM(3, 4, recurrence="cudnn")
    fast = FastDPLSTM(3, 4, num_layers=2, batch_first=True)
    with pytest.raises(ValueError, match="input_size"):
        fast(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="input must be"):
        fast(torch.randn(2, 5, 3, 1))
    with pytest.raises(ValueError, match="hx"):
        fast(torch.randn(2, 5, 3), (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))


def test_clipped_sum_equals_brute_force_with_unsorted_lengths(variant):
    ref, _, fast_net = _nets(2, True, variant)
    x, y, lengths, hx = _inputs("packed_hx", 2, True)
    brute = _brute_force(ref, x, y, lengths, hx)  # gradients of (f(x_b) - y_b)^2
    names = list(brute[0])
    norms = torch.stack([torch.stack([brute[b][n].norm() for n in names]).norm()
                         for b in range(B)])
    clip = float(norms.median())
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)  # Opacus' clip factor
    fast_names = _name_map(2, True)
    up = _dp_update(fast_net, x, y, lengths, hx, sigma=0.0, clip=clip, seed=0)
    for n in names:
        expected = -sum(factor[b] * brute[b][n] for b in range(B)) / B  # SGD lr=1, mean
        assert close(up[fast_names[n]], expected), n


# ---- Deliver 2: ghost clipping in our optimizer wrappers ------------------------------------
def _engine_run(net, mode, x, y, noise_correlation, steps=3):
    from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine

    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    # a scheme that prices the correlated noise (the engine refuses Opacus' RDP for c != [1]);
    # batch_size = N/bands gives rate 1 within each group: the same batches in both modes
    scheme = BandMFCyclicPoissonScheme(dataset_size=len(x), batch_size=len(x) // steps, bands=3)
    ds = torch.utils.data.TensorDataset(x, y)
    m = copy.deepcopy(net)
    kw = dict(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
              data_loader=torch.utils.data.DataLoader(ds, batch_sampler=scheme.sampler(seed=0)),
              noise_multiplier=0.8, max_grad_norm=0.5, poisson_sampling=False,
              noise_correlation=noise_correlation, grad_sample_mode=mode,
              noise_generator=torch.Generator().manual_seed(5))
    engine = CorrelatedNoisePrivacyEngine(scheme=scheme)
    crit = nn.MSELoss()
    if mode == "ghost":
        m, opt, crit, loader = engine.make_private(criterion=crit, **kw)
    else:
        m, opt, loader = engine.make_private(**kw)
    for xb, yb in loader:
        opt.zero_grad()
        crit(m(xb), yb).backward()
        opt.step()
    return opt, [p.detach().clone() for p in m.parameters()]


def test_correlated_noise_optimizer_in_ghost_mode_equals_hooks_mode(variant):
    from opacus_structured.optim.correlated_noise import CorrelatedNoiseMixin
    from opacus_structured.optim.ghost_clipping import (
        CorrelatedNoiseDPOptimizerFastGradientClipping,
    )

    _, _, fast_net = _nets(2, False, variant)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, T, I, generator=g, dtype=torch.float64)
    y = torch.randn(12, generator=g, dtype=torch.float64)
    c = [v / math.sqrt(1.4) for v in (1.0, 0.6, 0.2)]  # unit norm: sensitivity 1
    opt_h, p_h = _engine_run(fast_net, "hooks", x, y, c)
    opt_g, p_g = _engine_run(fast_net, "ghost", x, y, c)
    assert isinstance(opt_g, CorrelatedNoiseDPOptimizerFastGradientClipping)
    assert isinstance(opt_g, CorrelatedNoiseMixin) and opt_g.noise_step == 3
    for a, b in zip(p_g, p_h):
        assert close(a, b)
    _, p_plain = _engine_run(fast_net, "ghost", x, y, [1.0])  # DP-SGD noise differs
    assert not all(close(a, b, 1e-3) for a, b in zip(p_plain, p_g))


def test_ghost_norms_helper_and_clipping_mask():
    from opacus_structured.optim.ghost_clipping import ghost_per_sample_norms, set_clipping_mask

    _, _, fast_net = _nets(1, False)
    x, y, lengths, hx = _inputs("packed", 1, False)
    per = _per_sample(copy.deepcopy(fast_net), x, y, lengths, hx)  # sum-loss grads
    clip = float(_norms(per).median())
    ghost = GradSampleModuleFastGradientClipping(copy.deepcopy(fast_net), batch_first=True,
                                                 loss_reduction="sum", max_grad_norm=clip)
    with pytest.raises(ValueError, match="no per-sample norms"):
        ghost_per_sample_norms(ghost)
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(ghost.parameters(), lr=1.0),
                                          noise_multiplier=0.0, max_grad_norm=clip,
                                          expected_batch_size=B, loss_reduction="sum")
    crit = DPLossFastGradientClipping(ghost, opt, nn.MSELoss(reduction="sum"), "sum")
    mask = torch.tensor([0.0, 1, 1, 0, 1, 1], dtype=torch.float64)
    set_clipping_mask(ghost, mask)
    opt.zero_grad()
    crit(ghost(x, lengths, hx), y).backward()
    assert close(ghost_per_sample_norms(ghost), _norms(per))
    factor = (clip / (_norms(per) + 1e-6)).clamp(max=1.0) * mask
    for n, p in ghost.named_parameters():
        expected = torch.einsum("b,b...->...", factor, per[n.removeprefix("_module.")])
        assert close(p.grad, expected), n
    with pytest.raises(ValueError, match="GradSampleModuleFastGradientClipping"):
        ghost_per_sample_norms(fast_net)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        set_clipping_mask(ghost, torch.tensor([2.0]))
    set_clipping_mask(ghost, torch.ones(3))
    with pytest.raises(ValueError, match="3 entries"):
        crit(ghost(x, lengths, hx), y).backward()
    ghost._close()


# ---- DeepAR wiring ------------------------------------------------------------------------------
def _deepar_per_window_grads(lstm_impl):
    from gluonts.itertools import select

    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.estimators import prepare_estimator
    from opacus_structured.forecasting.windowing import GluonTSWindowDataset, collate_windows

    train, _ = train_test_split(load_us_employment().subset(range(0, 148, 18)), 6)
    torch.manual_seed(0)
    prep = prepare_estimator("deepar", freq="M", prediction_length=6, context_length=8,
                             batch_size=4, num_layers=2, hidden_size=4, lags_seq=[1, 2, 12],
                             lstm_impl=lstm_impl)
    model = prep.module.model.double()
    entries = list(prep.transformation.apply(train.to_gluonts(), is_train=True))
    ds = GluonTSWindowDataset(entries, prep.splitter, prep.input_names)
    batch = collate_windows([ds[k] for k in [(0, 0), (1, 40), (2, 7), (3, 3)]])
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    hooks = GradSampleHooks(model, loss_reduction="mean")
    model.loss(**select(prep.module.inputs, batch),
               future_observed_values=batch["future_observed_values"],
               future_target=batch["future_target"]).mean().backward()
    out = {n: p.grad_sample.detach().clone() for n, p in model.named_parameters()}
    hooks.cleanup()
    return prep, out


def test_deepar_fast_lstm_per_window_gradients_equal_opacus_dplstm():
    pytest.importorskip("gluonts")
    prep_fast, g_fast = _deepar_per_window_grads("fast")
    prep_op, g_op = _deepar_per_window_grads("opacus")
    rnn = prep_fast.module.model.rnn
    assert isinstance(rnn, FastDPLSTM) and isinstance(prep_op.module.model.rnn, DPLSTM)
    assert not any(isinstance(m, (nn.LSTM, DPLSTM)) for m in prep_fast.module.model.modules())
    names = {n: n for n in g_op if not n.startswith("rnn.")}
    names.update({k: v for k, v in _name_map(2, False).items() if k.startswith("rnn.")})
    assert set(names) == set(g_op) and set(names.values()) == set(g_fast)
    for n_op, n_fast in names.items():
        assert close(g_fast[n_fast], g_op[n_op]), n_op
    with pytest.raises(ValueError, match="lstm_impl"):
        from opacus_structured.forecasting.estimators import prepare_estimator
        prepare_estimator("deepar", freq="M", prediction_length=6, lstm_impl="cudnn")


def test_train_forecaster_deepar_fast_two_dp_steps_and_forecast():
    pytest.importorskip("lightning")
    import numpy as np

    from opacus_structured.commands.forecast import add_arguments
    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.training import train_forecaster

    train, test = train_test_split(load_us_employment().subset(range(0, 148, 18)), 6)
    res = train_forecaster("deepar", train, prediction_length=6, context_length=8,
                           batch_size=4, noise_multiplier=1.0, delta=1e-5, max_steps=2,
                           discretization=1e-3, lr=1e-2, lstm_impl="fast",
                           estimator_kwargs=dict(num_layers=2, hidden_size=4,
                                                 lags_seq=[1, 2, 12], num_parallel_samples=5))
    assert res.steps == 2 and isinstance(res.prepared.module.model.rnn, FastDPLSTM)
    fc = next(iter(res.create_predictor().predict(test.to_gluonts(), num_samples=5)))
    assert np.isfinite(np.asarray(fc.quantile(0.5))).all()
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).lstm_impl == "fast"
    assert parser.parse_args(["--lstm-impl", "opacus"]).lstm_impl == "opacus"


def test_ghost_loss_with_2d_per_sample_loss_is_refused():
    # Opacus broadcasts coef (B,) x loss (B, 1) -> (B, B): the "clipped" sum is unclipped.
    from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    x, y = torch.randn(8, 3), torch.randn(8, 1)
    model = nn.Linear(3, 1)
    scheme = BandMFCyclicPoissonScheme(dataset_size=8, batch_size=4, bands=1)
    engine = CorrelatedNoisePrivacyEngine(scheme=scheme)
    model, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                batch_sampler=scheme.sampler(seed=0)),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, criterion=nn.MSELoss(),
        grad_sample_mode="ghost", noise_correlation=[1.0])
    crit(model(x[:4]).squeeze(-1), y[:4, 0]).backward()  # the 1-d form works
    with pytest.raises(ValueError, match="1-d per-sample loss"):
        crit(model(x[:4]), y[:4])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("case", ["hx", "packed_hx"])
def test_cudnn_recurrence_per_sample_gradients_equal_cpu(case, kind):
    """On CUDA ``recurrence="auto"`` runs cuDNN; its per-sample gradients (float64) equal those
    of the CPU recurrence (itself checked against Opacus and brute force above)."""
    _, _, fast_cpu = _nets(2, True, (kind, "python" if kind == "lstm" else "native"))
    x, y, lengths, hx = _inputs(case, 2, True)
    fast_gpu = copy.deepcopy(fast_cpu).cuda()
    for layer in fast_gpu.rnn.layers:
        layer.recurrence = "auto"
    hx_gpu = None if hx is None else tuple(h.cuda() for h in hx)
    gs_gpu = _per_sample(fast_gpu, x.cuda(), y.cuda(), lengths, hx_gpu)
    gs_cpu = _per_sample(fast_cpu, x, y, lengths, hx)
    assert set(gs_gpu) == set(gs_cpu)
    for name, g in gs_cpu.items():
        assert close(gs_gpu[name].cpu(), g), name
