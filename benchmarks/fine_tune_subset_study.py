"""Fine-tune fewer parameters under DP? A study on PUBLIC panels only (issue 30, item 3).

DP-SGD adds noise of the same size to every trained coordinate, so training fewer coordinates
(a head, the biases, low-rank adapters) puts more of each clipped gradient into the
coordinates that move. This study fine-tunes DLinear from the public weights at ε = 1
(δ = 1e-7) with its recipe, training only:

* ``all``: every parameter (the recipe);
* ``skip``: the baseline skip alone (issue 47: the combination weights of the local forecasts
  and the scale skip, 6 parameters);
* ``head``: the distribution head (``args_proj``, 63 parameters) and the baseline skip (2 when
  the study ran; 5 + the scale skip's 1 with issue 47's local forecasts);
* ``bias``: the head, the skip and the biases of the two linear maps (545 parameters);
* ``lora-R``: the head, the skip and rank-R adapters ``W + B·A`` of the two linear maps
  (``B`` starts at zero; merged into ``W`` after training, so the released network has
  DLinear's own layout).

each at the recipe's learning rate times ``--lr-multipliers``, and scores the released
forecast (zero-shot share ``w`` 0 and 0.25) on the public study panels of
``forecast_recipe.py`` (score: mean of (CRPS/SN + MASE/SN)/2; lower is better). Only the
subset changes: the noise calibration, the steps and the accounting are the recipe's. It is a
study harness, not a product option: it swaps the module that ``train_forecaster`` trains
(``training._window_module``) for one whose frozen parameters have ``requires_grad=False``
(Opacus then neither clips nor noises them)::

    PYTHONPATH=benchmarks:. python benchmarks/fine_tune_subset_study.py \\
        --subsets all head bias lora-4 --lr-multipliers 1 10 --json subset_study.json
"""

from __future__ import annotations

import argparse
import statistics
import warnings

from forecast_recipe import study_score, study_split, write_study_json

WEIGHTS = (0.0, 0.25)


def _low_rank(base, rank: int):
    import torch
    from torch import nn

    class LowRankAdapter(nn.Module):
        """``base(x) + B(A(x))`` with ``base`` frozen; :meth:`merged` folds ``B·A`` into it."""

        def __init__(self):
            super().__init__()
            self.base = base
            self.A = nn.Linear(base.in_features, rank, bias=False)
            self.B = nn.Linear(rank, base.out_features, bias=False)
            nn.init.normal_(self.A.weight, std=base.in_features ** -0.5)
            nn.init.zeros_(self.B.weight)

        def forward(self, x):
            return self.base(x) + self.B(self.A(x))

        def merged(self):
            with torch.no_grad():
                self.base.weight += self.B.weight @ self.A.weight
            return self.base

    return LowRankAdapter()


def _trained(subset: str, name: str) -> bool:
    if "skip" in name:
        return True
    if subset == "skip":  # issue 47: the local forecasts' combination alone
        return False
    if name.startswith("args_proj"):
        return True
    if subset == "all":
        return True
    if subset == "bias":
        return name.endswith("bias") and ".base." not in name
    if subset.startswith("lora-"):
        return ".A." in name or ".B." in name
    return False


def install(subset: str):
    """Make ``train_forecaster`` train only ``subset`` (module docstring)."""
    from opacus_structured.forecasting import lightning_parts, training

    window_module = lightning_parts._window_module

    def subset_module(prepared, **kwargs):
        net = prepared.module.model
        if subset.startswith("lora-"):
            rank = int(subset.split("-", 1)[1])
            net.linear_seasonal = _low_rank(net.linear_seasonal, rank)
            net.linear_trend = _low_rank(net.linear_trend, rank)
        module = window_module(prepared, **kwargs)
        for name, p in module.model.named_parameters():
            p.requires_grad_(_trained(subset, name))
        return module

    training._window_module = subset_module


def released(net):
    """The network with adapters merged and every parameter trainable again."""
    for attr in ("linear_seasonal", "linear_trend"):
        layer = getattr(net, attr)
        if hasattr(layer, "merged"):
            setattr(net, attr, layer.merged())
    for p in net.parameters():
        p.requires_grad_(True)
    return net


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subsets", nargs="+", default=["all", "head", "bias", "lora-4"])
    ap.add_argument("--lr-multipliers", nargs="+", type=float, default=[1.0])
    ap.add_argument("--panels", nargs="+", default=["txhousing", "economics", "synthetic"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from opacus_structured.forecasting import training
    from opacus_structured.forecasting.model_defaults import model_defaults
    from opacus_structured.forecasting.pretraining import pretrained_weights

    recipe = model_defaults("dlinear")
    stock = training._window_module
    rows = []
    for panel_name in args.panels:
        train, batch, score, sn = study_split(panel_name)
        state, _ = pretrained_weights("dlinear", freq=train.freq, prediction_length=12)
        for subset in args.subsets:
            for mult in args.lr_multipliers:
                install(subset)
                try:
                    for seed in args.seeds:
                        res = training.train_forecaster(
                            "dlinear", train, prediction_length=12, batch_size=batch,
                            max_steps=recipe["max_steps"], lr=recipe["lr"] * mult,
                            max_grad_norm=recipe["max_grad_norm"],
                            tail_average=recipe["tail_average"], epsilon=1.0, delta=1e-7,
                            seed=seed, init_seed=seed, init_state=state,
                            trained_parameters="all")  # the harness chose the subset
                        released(res.prepared.module.model)
                        for w in WEIGHTS:
                            m = score(res.create_predictor(zero_shot_weight=w))
                            rows.append({"panel": panel_name, "subset": subset, "lr_mult": mult,
                                         "seed": seed, "w": w, "crps": m["crps"],
                                         "mase": m["mase"],
                                         "rel": study_score(m, sn)})
                            print(f"{panel_name:10s} {subset:7s} lr×{mult:<4g} seed {seed} "
                                  f"w={w:<4g} CRPS {m['crps']:.5f} MASE {m['mase']:.3f}",
                                  flush=True)
                finally:
                    training._window_module = stock
    print()
    print("| subset | lr × | " + " | ".join(f"score w={w:g}" for w in WEIGHTS) + " | "
          + " | ".join(f"{p} CRPS (w=0.25)" for p in args.panels) + " |")
    print("|---" * (2 + len(WEIGHTS) + len(args.panels)) + "|")
    for subset in args.subsets:
        for mult in args.lr_multipliers:
            sel = [r for r in rows if r["subset"] == subset and r["lr_mult"] == mult]
            scores = [statistics.fmean(statistics.fmean(r["rel"] for r in sel
                                                        if r["panel"] == p and r["w"] == w)
                                       for p in args.panels) for w in WEIGHTS]
            crps = [statistics.fmean(r["crps"] for r in sel if r["panel"] == p
                                     and r["w"] == 0.25) for p in args.panels]
            print(f"| {subset} | {mult:g} | " + " | ".join(f"{s:.4f}" for s in scores) + " | "
                  + " | ".join(f"{c:.5f}" for c in crps) + " |")
    write_study_json(args.json, args.panels, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
