"""``opacus-structured audit <scheme> [scheme flags] --runs R``: empirical privacy audit of a
scheme's real training pipeline (issue 19).

Trains ``R`` runs with and ``R`` runs without a canary through the scheme's sampler, optimizer
and accountant (:func:`opacus_structured.audit.pipelines.run_audit`), and reports the ε the
accountant claims next to the audited ε **lower bound** at the requested confidence
(:func:`opacus_structured.audit.estimators.epsilon_lower_bound`), their ratio, and optionally
the attack's ROC against the accountant's predicted trade-off curve (``--plot``). An audit can
expose a pipeline that leaks more than its accountant reports (exit status 1, for the
assumption-free Clopper–Pearson bound; a GDP estimate above the reported ε is flagged but is no
proof); it can never certify that a pipeline is private.

The per-scheme flags come from the audit registry, which lives with the torch pipelines: the
``audit`` parser adds them on first use (:class:`_AuditParser`), so building the command line
for any other command (and ``opacus-structured --help``) imports no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .. import _progress
from .._validation import check_int
from ._registry import register_command

#: Help for the scheme settings the audit registry exposes (fallback: a generic line).
_FLAG_HELP = {
    "noise_multiplier": "σ: noise std divided by the clipping norm, > 0",
    "steps": "optimizer steps per run, >= 1",
    "delta": "δ in (0, 1) at which ε is reported and audited",
    "examples": "training examples per run, the canary's slot included, >= 1",
    "sample_rate": "sampling probability per example and step, in (0, 1]",
    "max_batch_size": "truncation: at most this many examples per batch, >= 1",
    "num_bins": "bins (steps) per epoch, >= 1",
    "epochs": "epochs, >= 1",
    "bands": "bands of the BandMF strategy, >= 1",
    "batch_size": "expected batch size of the sampler, > 0",
    "top_level": "top-level sampling of series: wor (without replacement) or deterministic",
    "num_series": "time series in the data set, >= 1",
    "series_length": "time steps per series, >= 1",
    "context_length": "context window length, >= 0",
    "forecast_length": "forecast window length, >= 1",
    "budget": "per-example GDP budget B of the individual filter, > 0",
    "mc_samples": "Monte Carlo samples of the accountant's ε estimate, >= 1000",
    "design": "canary design: displace (the canary displaces an opposite example: the "
              "truncation branch) or add (it is only added: where truncation is rare)",
}
_PREFIX = "scheme_flag_"


def _add_scheme_parsers(parser: argparse.ArgumentParser) -> None:
    """One sub-parser per auditable scheme, with its settings and the audit's own flags
    (imports the torch pipelines: called only when the ``audit`` command is parsed)."""
    if getattr(parser, "_schemes_added", False):
        return
    parser._schemes_added = True
    from ..audit.estimators import METHODS  # lazy: the audit layer loads with `audit` only
    from ..audit.pipelines import audit_registry  # lazy: imports torch

    sub = parser.add_subparsers(dest="scheme", required=True, metavar="SCHEME",
                                parser_class=argparse.ArgumentParser)
    for name, info in sorted(audit_registry().items()):
        p = sub.add_parser(name, help=info["summary"], description=info["summary"])
        for key, default in info["defaults"].items():
            kind = (str if isinstance(default, str) else
                    int if isinstance(default, int) and not isinstance(default, bool) else float)
            p.add_argument("--" + key.replace("_", "-"), type=kind, default=default,
                           dest=_PREFIX + key, metavar=kind.__name__.upper(),
                           help=f"{_FLAG_HELP.get(key, f'scheme setting {key}')} "
                                f"(default %(default)s)")
        p.add_argument("--runs", type=int, default=200,
                       help="runs with the canary, and as many without, >= 2 (default "
                            "%(default)s); the bound tightens with more runs")
        p.add_argument("--confidence", type=float, default=0.95,
                       help="confidence of the ε lower bound, in [0.5, 1) (default %(default)s)")
        p.add_argument("--method", choices=METHODS, default="clopper-pearson",
                       help="estimator: clopper-pearson (no assumption) or gdp (assumes a "
                            "Gaussian trade-off curve; tighter) (default %(default)s)")
        p.add_argument("--seed", type=int, default=None,
                       help="seed of every sampler, noise draw and data set (default: fresh "
                            "entropy, reported in the output)")
        p.add_argument("--path", choices=info["paths"], default=info["paths"][0],
                       help="training path: Opacus hooks, ghost clipping, book-keeping, a "
                            "checkpoint/resume mid-run, DDP with 2 gloo ranks (ddp: hooks, "
                            "ddp-ghost, ddp-bookkeeping) or the Lightning callback, as the "
                            "scheme offers (default %(default)s)")
        p.add_argument("--mutation", choices=info["mutations"], default=None,
                       help="deliberately break the pipeline (the accountant is told the "
                            "unbroken setting) to see the audit catch it (default: none)")
        p.add_argument("--canary", choices=("dirac", "input"), default="dirac",
                       help="dirac: white-box gradient canary with a likelihood-ratio score; "
                            "input: black-box input canary scored by its loss (default "
                            "%(default)s)")
        p.add_argument("--plot", default=None, metavar="PATH",
                       help="save the audit's ROC against the accountant's predicted "
                            "trade-off curve to PATH (PNG/PDF/SVG; needs matplotlib)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("--no-progress", action="store_true",
                       help="no progress bar on stderr (hidden anyway when stderr is not a "
                            "terminal)")


class _AuditParser(argparse.ArgumentParser):
    """The ``audit`` parser: adds the per-scheme sub-parsers just before it parses or prints
    help, so that only the ``audit`` command imports the torch pipelines."""

    def _parse_known_args(self, *args, **kwargs):
        _add_scheme_parsers(self)
        return super()._parse_known_args(*args, **kwargs)

    def format_help(self):
        _add_scheme_parsers(self)
        return super().format_help()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.__class__ = _AuditParser  # built by cli.build_parser as a plain ArgumentParser
    parser.description = ("Empirical privacy audit: ε LOWER BOUND from canaries planted in "
                          "the scheme's real training pipeline, against the ε its accountant "
                          "reports. `opacus-structured audit SCHEME --help` lists a scheme's "
                          "flags.")


def _reported_profile(scores):
    """δ(ε) of the audited mechanism as its accountant prices it, or ``None`` and why not.

    The individual GDP filter certifies B-GDP per example (Koskela, Tobaben & Honkela,
    "Individual privacy accounting with Gaussian differential privacy", ICLR 2023, Theorem 1),
    so its curve is that of B-GDP; a Monte Carlo accountant's ε is an
    estimate, not a curve to plot; every other scheme's is its accountant's privacy profile
    (:func:`~opacus_structured.audit.report.scheme_profile`)."""
    from ..accounting.gaussian import gdp_delta  # lazy: the audit layer loads with `audit` only
    from ..audit import pipelines  # lazy: imports torch
    from ..audit.report import scheme_profile  # lazy: the audit layer loads with `audit` only

    flags = scores.meta.get("flags", {})
    name = scores.meta.get("scheme")
    if name == "gdp-filter":
        return (lambda eps: gdp_delta(eps, flags["budget"])), None
    try:
        scheme = pipelines.audited_scheme(name, flags)
        if getattr(scheme, "bound", None) == "monte-carlo":  # BoundKind is a str enum
            return None, "the accountant's epsilon is a Monte Carlo estimate"
        return scheme_profile(scheme, flags["noise_multiplier"], flags["steps"]), None
    except (KeyError, TypeError, ValueError, NotImplementedError) as exc:
        return None, f"the scheme's privacy profile is not available ({exc})"


def _run(args: argparse.Namespace) -> int:
    from ..audit.estimators import _confidence, epsilon_lower_bound  # lazy: audit layer
    from ..audit.pipelines import run_audit  # lazy: imports torch

    runs = check_int("--runs", args.runs, minimum=2)
    confidence = _confidence(args.confidence)
    seed = args.seed
    if seed is None:  # fresh entropy, reported so that the audit can be re-run
        import numpy as np

        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    flags = {k[len(_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_PREFIX)}
    show = _progress.enabled(args.no_progress)
    with _progress.bar(total=2 * runs, desc=f"auditing {args.scheme}", show=show,
                       unit="run") as bar:
        def progress(done, total):
            bar.update(done - bar.n)
        scores = run_audit(args.scheme, runs=runs, seed=seed, path=args.path,
                           mutation=args.mutation, canary=args.canary, progress=progress,
                           **flags)
    bound = epsilon_lower_bound(scores.scores_with, scores.scores_without, delta=scores.delta,
                                confidence=confidence, method=args.method)
    reported = scores.reported_epsilon
    ratio = bound.epsilon / reported if 0 < reported < math.inf else None
    exceeds = bound.epsilon > reported
    violation = exceeds and bound.assumption is None  # a proof only without an assumption
    record = {"scheme": args.scheme, "reported_epsilon": reported, "delta": scores.delta,
              **bound.to_dict(), "ratio": ratio, "exceeds_reported": exceeds,
              "violation": violation,
              "runs_per_side": runs, "seed": seed, "path": args.path,
              "mutation": args.mutation, "canary": args.canary,
              "settings": scores.meta.get("flags", flags)}
    note = None
    if args.plot:
        from ..audit.report import plot_audit  # lazy: the audit layer loads with `audit` only

        profile, note = _reported_profile(scores)
        plot_audit(scores, args.plot, delta_of_epsilon=profile, bound=bound,
                   title=f"audit of {args.scheme} ({args.path}"
                         + (f", mutation {args.mutation}" if args.mutation else "") + ")")
        record["plot"] = args.plot
        if note:
            record["plot_note"] = f"no predicted curve: {note}"
    if args.json:
        print(json.dumps(record, sort_keys=True))
    else:
        lines = [f"scheme {args.scheme} ({args.path}"
                 + (f", MUTATION {args.mutation}" if args.mutation else "")
                 + f"), {runs} runs with and {runs} without the canary, seed {seed}",
                 f"reported epsilon      = {reported:.4g} at delta = {scores.delta:g} "
                 f"(what the accountant reports)",
                 f"audited epsilon       >= {bound.epsilon:.4g} (EMPIRICAL LOWER BOUND, "
                 f"{confidence:.0%} confidence, {bound.method})"]
        if ratio is not None:
            lines.append(f"audited / reported    = {ratio:.3f}")
        if bound.assumption:
            lines.append(f"assumption: {bound.assumption}")
        lines.append("VIOLATION: the pipeline leaks more than its accountant reports"
                     if violation else
                     "ABOVE the reported epsilon under the assumption above: not a proof; "
                     "confirm with --method clopper-pearson" if exceeds else
                     "consistent: no leakage beyond the reported epsilon detected (an audit "
                     "cannot certify privacy)")
        if args.plot:
            lines.append(f"ROC plot: {args.plot}" + (f" (no predicted curve: {note})"
                                                     if note else ""))
        print("\n".join(lines))
    if violation:
        print("opacus-structured: audit: the audited epsilon lower bound exceeds the reported "
              "epsilon", file=sys.stderr)
        return 1
    return 0


register_command("audit", "empirical privacy audit: ε lower bound from canaries in a real run",
                 _add_arguments, _run)
