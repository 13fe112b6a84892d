"""DP-SGD step time of a DeepAR-sized LSTM: cuDNN non-private vs Opacus DPLSTM vs FastDPLSTM.

``--cell gru`` runs the same rows for ``nn.GRU`` / Opacus ``DPGRU`` / ``FastDPGRU``.

Issue 10 setting (defaults): 2 layers, hidden 40, 10 input features, 60 time steps, batch 256,
linear head with an MSE loss on every step. Rows (all with SGD, one full step each:
forward, backward, [clip, noise], update):

* ``nn.LSTM non-private`` — cuDNN on CUDA (the reference for the ratios);
* ``opacus DPLSTM DP-SGD`` — ``ModuleValidator.fix`` + ``PrivacyEngine.make_private``;
* ``FastDPLSTM DP-SGD (hooks, …)`` — per-sample gradients materialised by Opacus' Linear
  sampler;
* ``FastDPLSTM DP-SGD (ghost, …)`` — ``grad_sample_mode="ghost"`` (norms by the Gram trick,
  clipped sum by a second backward);
  each with ``recurrence="native"`` (torch's LSTM kernel: cuDNN on CUDA) and ``"python"`` (our
  time loop and hand-written BPTT); ``"auto"``, the default, is native on CUDA, python on CPU;
* ``FastDPLSTM non-private`` — our forward/backward without DP (``"auto"``).

Prints a table (ms/step median over ``--repeats`` after ``--warmup`` steps, peak memory, ratio
to the non-private cuDNN step) and optionally writes ``--json OUT``. Needs only torch and
opacus: if ``opacus_structured`` is not installed, ``fast_rnn.py`` is loaded from this
checkout. Usage::

    python benchmarks/dp_lstm.py --device cuda --json dp_lstm_cuda.json
    python benchmarks/dp_lstm.py --device cpu --batch 64 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import types
import warnings

import torch
from _timing import median_ms  # benchmarks/ is on sys.path (scripts run from there)
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator
from torch import nn

warnings.filterwarnings("ignore")


def _load_fast_rnn():
    try:
        from opacus_structured.forecasting import fast_rnn
        return fast_rnn
    except ImportError:  # only torch + opacus: load the module file without the package deps
        import importlib

        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                            "opacus_structured")
        for name, path in (("opacus_structured", root),
                           ("opacus_structured.forecasting", os.path.join(root, "forecasting"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.normpath(path)]
            sys.modules.setdefault(name, pkg)
        mod = importlib.import_module("opacus_structured.forecasting.fast_rnn")
        return mod


fast_rnn = _load_fast_rnn()


class Net(nn.Module):
    def __init__(self, rnn, hidden):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).squeeze(-1)


def run(args):
    device = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.steps, args.features, device=device)
    y = torch.randn(args.batch, args.steps, device=device)
    ds = torch.utils.data.TensorDataset(x, y)
    torch_cls = nn.LSTM if args.cell == "lstm" else nn.GRU
    rnn = torch_cls(args.features, args.hidden, num_layers=args.layers, batch_first=True)
    base = Net(rnn, args.hidden).to(device)
    replace = fast_rnn.replace_lstm if args.cell == "lstm" else fast_rnn.replace_gru
    cell, fast = args.cell.upper(), "FastDP" + args.cell.upper()
    mse = nn.MSELoss()

    def plain(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            mse(model(x), y).backward()
            opt.step()
        return step

    def private(model, mode):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch)
        engine = PrivacyEngine(accountant="rdp")
        kw = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                  max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode)
        if mode == "ghost":
            model, opt, crit, _ = engine.make_private(criterion=nn.MSELoss(), **kw)
        else:
            model, opt, _ = engine.make_private(**kw)
            crit = mse

        def step():
            opt.zero_grad(set_to_none=True)
            out = model(x)
            if mode == "ghost":  # per-window loss = mean over its time steps
                crit(out.reshape(-1), y.reshape(-1), shape=(y.shape[0], y.shape[1])).backward()
            else:
                crit(out, y).backward()
            opt.step()
        return step

    rows = []
    configs = [
        (f"nn.{cell} non-private" + (" (cuDNN)" if device.type == "cuda" else ""),
         lambda: plain(copy.deepcopy(base))),
        (f"opacus DP{cell} DP-SGD",
         lambda: private(ModuleValidator.fix(copy.deepcopy(base)).to(device), "hooks")),
    ]
    for rec in ("native", "python") if args.cell == "lstm" else ("native",):
        for mode in ("hooks", "ghost"):
            configs.append((f"{fast} DP-SGD ({mode}, {rec})",
                            lambda rec=rec, mode=mode: private(
                                replace(copy.deepcopy(base), recurrence=rec), mode)))
    configs.append((f"{fast} non-private", lambda: plain(replace(copy.deepcopy(base)))))
    for name, make in configs:
        if args.skip_opacus and name.startswith("opacus"):
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ms, peak = median_ms(make(), device, args.warmup, args.repeats)
        rows.append({"method": name, "ms_per_step": ms, "peak_mem_mib": peak})
    ref = rows[0]["ms_per_step"]
    for r in rows:
        r["ratio_vs_nonprivate"] = r["ms_per_step"] / ref
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60, help="time steps")
    p.add_argument("--features", type=int, default=10)
    p.add_argument("--hidden", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--cell", choices=("lstm", "gru"), default="lstm",
                   help="gru: nn.GRU vs Opacus DPGRU vs FastDPGRU (native recurrence only)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--skip-opacus", action="store_true", help="skip the (slow) Opacus row")
    p.add_argument("--json", default=None, help="write the rows and settings to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    dev = args.device
    if dev.startswith("cuda"):
        dev += f" ({torch.cuda.get_device_name()})"
    print(f"device {dev}, torch {torch.__version__}; {args.cell.upper()} {args.layers}x{args.hidden}, "
          f"{args.features} features, T={args.steps}, batch {args.batch}; torch.compile: not "
          f"used (plain eager kernels)")
    print(f"{'method':<34}{'ms/step':>10}{'peak MiB':>10}{'x non-private':>15}")
    for r in rows:
        peak = "-" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        print(f"{r['method']:<34}{r['ms_per_step']:>10.2f}{peak:>10}"
              f"{r['ratio_vs_nonprivate']:>15.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": vars(args), "device": dev, "torch": torch.__version__,
                       "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
