"""``opacus-structured bminsep-mc {estimate,certify}``: Monte Carlo accounting of BandMF +
b-min-sep with explicit labels.

* ``estimate``: the Monte Carlo ε (point and high-confidence upper estimate; "holds with
  probability ≥ 1 − q", not a deterministic bound), with sharded, resumable sampling
  (``--directory``) and a progress bar.
* ``certify``: Algorithm 5 (Theorem A.1) σ calibration on a 1.01 grid with a closed-form
  fallback (``--fallback unamplified`` = same sampler, analytic Gaussian; ``cyclic-poisson`` =
  cyclic Poisson sampler, PLD). It uses δ′ = δ/2 and the minimum sample count per candidate
  (``--samples`` applies to ``estimate`` only).

(The generic ``epsilon bminsep-mc`` prints the same labelled upper estimate.)

Seeds: without ``--seed`` every run draws a fresh seed from OS entropy (``--directory`` resumes
with the seed recorded there) and reports the seed it used (``seed`` in ``--json``, and in the
text). A Monte Carlo seed is no secret, but choosing one is: re-running a failed ``certify`` or a
disappointing ``estimate`` with another seed and keeping the better result is multiple testing
and voids the stated confidence.
"""

from __future__ import annotations

import argparse
import json

from ..accounting.bounds import BoundKind
from ..accounting.certification import cyclic_poisson_fallback, unamplified_fallback
from ..accounting.monte_carlo import DEFAULT_SHARD_SIZE, MonteCarloSettings
from ..runners.monte_carlo import collect_with_settings
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ._registry import register_command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    for action, help_ in (("estimate", "Monte Carlo ε estimate (labelled; not a bound)"),
                          ("certify", "Algorithm 5: certified σ for a target (ε, δ)")):
        p = sub.add_parser(action, help=help_)
        BMinSepMonteCarloScheme.add_cli_arguments(p)
        p.add_argument("--steps", type=int, required=True, help="iterations n")
        p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if action == "estimate":
            p.add_argument("--noise-multiplier", type=float, required=True,
                           help="σ: noise std divided by the clipping norm, > 0")
            p.add_argument("--directory", default=None,
                           help="save/resume shards here (seed-addressed, mergeable)")
            p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                           help="Monte Carlo samples per shard (default %(default)d)")
            p.add_argument("--progress", action="store_true",
                           help="progress bar over the shards on stderr")
        else:
            p.add_argument("--target-epsilon", type=float, required=True,
                           help="privacy budget ε > 0 to certify")
            p.add_argument("--sigma-min", type=float, required=True,
                           help="smallest noise multiplier on the grid searched (least noise)")
            p.add_argument("--sigma-max", type=float, default=None,
                           help="largest noise multiplier on the grid (default: the fallback's)")
            p.add_argument("--fallback", choices=("unamplified", "cyclic-poisson"),
                           default="unamplified",
                           help="closed-form mechanism used when no grid point certifies "
                                "(default %(default)s)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    scheme = BMinSepMonteCarloScheme.from_cli_args(args)
    settings = MonteCarloSettings.from_cli_args(args)
    if args.action == "estimate":
        mech = scheme.mechanism(args.noise_multiplier, args.steps)
        # --seed, else the seed recorded in --directory (resume), else fresh entropy
        samples = collect_with_settings(mech, settings, directory=args.directory)
        est = samples.estimate(args.delta, settings.failure_probability)
        used = {**settings.to_dict(), "seed": samples.seed}
        record = {**est.to_dict(), "noise_multiplier": args.noise_multiplier,
                  "steps": args.steps, "bound": BoundKind.MONTE_CARLO, "seed": samples.seed,
                  "parameters": {**scheme.describe(), **used}}
        print(json.dumps(record, sort_keys=True) if args.json
              else f"{est.statement} [Monte Carlo seed {samples.seed}]")
        return 0
    mech = scheme.mechanism(1.0, args.steps)
    dp = args.delta / 2
    if args.fallback == "unamplified":
        fb = unamplified_fallback(mech, args.target_epsilon, dp)
    else:
        fb = cyclic_poisson_fallback(mech, args.batch_size / args.dataset_size,
                                     args.target_epsilon, dp)
    res = scheme.certify(args.target_epsilon, args.delta, args.steps, sigma_min=args.sigma_min,
                         settings=settings, sigma_max=args.sigma_max, fallback=fb)
    record = {"noise_multiplier": res.noise_multiplier, "fallback_used": res.fallback_used,
              "fallback": res.fallback.description, "epsilon": res.epsilon,
              "overall_delta": res.overall_delta, "base_delta": res.base_delta,
              "num_samples": res.num_samples, "verified": res.verified,
              "bound": res.kind, "seed": res.seed, "statement": res.statement}
    print(json.dumps(record, sort_keys=True) if args.json else res.statement)
    return 0


register_command("bminsep-mc", "BandMF + b-min-sep: Monte Carlo estimate / Algorithm 5 certify",
                 _add_arguments, _run)
