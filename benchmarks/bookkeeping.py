"""DP-SGD step time (and CUDA peak memory): book-keeping ghost clipping vs Opacus hooks / ghost.

Rows, each one full step (forward, backward, clip, noise, SGD update) of the same model:

* ``non-private`` — plain autograd (the reference for the ratios);
* ``opacus hooks`` — ``GradSampleModule`` + ``DPOptimizer`` (per-sample gradients materialised);
* ``opacus ghost`` — ``GradSampleModuleFastGradientClipping`` + ``DPLossFastGradientClipping``
  (ghost norms, second backward for the clipped sum);
* ``book-keeping`` — :class:`~opacus_structured.optim.bookkeeping.BookKeepingHooks` +
  ``BookKeepingDPOptimizer`` (ghost norms and the clipped sum from the one backward; what
  ``DPCallback(grad_sample_mode="ghost")`` runs).

Models: ``--model mlp`` (width-1024 ReLU MLP of ``--params`` parameters on (B, 1024) inputs) or
``--model seq`` (the same layers applied to (B, ``--seq-len``, 1024) sequences, mean-pooled:
the case where the Gram trick matters). Usage::

    python benchmarks/bookkeeping.py [--model mlp|seq] [--params N] [--batch B] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings

import torch
from _timing import median_ms  # benchmarks/ is on sys.path (scripts run from there)
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleModuleFastGradientClipping,
)
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

from opacus_structured.optim.bookkeeping import BookKeepingDPOptimizer, BookKeepingHooks

warnings.filterwarnings("ignore")


class Net(nn.Module):
    def __init__(self, num_params: int, width: int = 1024):
        super().__init__()
        depth = max(1, round(num_params / (width * width + width)))
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.body(x)
        if h.dim() == 3:
            h = h.mean(1)
        return self.head(h)


def run(args):
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = Net(args.params).to(device)
    shape = (args.batch, 1024) if args.model == "mlp" else (args.batch, args.seq_len, 1024)
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=args.batch)
    ce = nn.CrossEntropyLoss()

    def plain():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            ce(model(x), y).backward()
            opt.step()
        return step

    def hooks():
        model = GradSampleModule(copy.deepcopy(base))
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), **kw)

        def step():
            opt.zero_grad(set_to_none=True)
            ce(model(x), y).backward()
            opt.step()
        return step

    def ghost():
        model = GradSampleModuleFastGradientClipping(copy.deepcopy(base), max_grad_norm=1.0,
                                                     use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=1e-3),
                                              **kw)
        crit = DPLossFastGradientClipping(model, opt, nn.CrossEntropyLoss(), "mean")

        def step():
            opt.zero_grad(set_to_none=True)
            crit(model(x), y).backward()
            opt.step()
        return step

    def bookkeeping():
        model = copy.deepcopy(base)
        hooks_ = BookKeepingHooks(model, max_grad_norm=1.0)
        opt = BookKeepingDPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), **kw)
        opt.attach_bookkeeper(hooks_)

        def step():
            opt.zero_grad(set_to_none=True)
            ce(model(x), y).backward()
            opt.step()
        return step

    rows = []
    for name, make in (("non-private", plain), ("opacus hooks", hooks), ("opacus ghost", ghost),
                       ("book-keeping", bookkeeping)):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            ms, peak = median_ms(make(), device, args.warmup, args.repeats)
        except torch.OutOfMemoryError:
            ms, peak = float("nan"), float("nan")
        rows.append({"method": name, "ms_per_step": ms, "peak_mem_mib": peak})
    for r in rows:
        r["ratio_vs_nonprivate"] = r["ms_per_step"] / rows[0]["ms_per_step"]
    return {"device": str(device), "params": sum(p.numel() for p in base.parameters()),
            "settings": vars(args), "torch": torch.__version__, "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("mlp", "seq"), default="mlp")
    p.add_argument("--params", type=int, default=None,
                   help="parameters (default 10M on CUDA, 2M on CPU)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.params is None:
        args.params = 10_000_000 if args.device.startswith("cuda") else 2_000_000
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    print(f"device {res['device']}, torch {res['torch']}; model {args.model}, "
          f"{res['params']:,} parameters, batch {args.batch}"
          + (f", T={args.seq_len}" if args.model == "seq" else ""))
    print(f"{'method':<16}{'ms/step':>10}{'peak MiB':>10}{'x non-private':>15}")
    for r in res["rows"]:
        peak = "-" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
        print(f"{r['method']:<16}{r['ms_per_step']:>10.1f}{peak:>10}"
              f"{r['ratio_vs_nonprivate']:>15.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
