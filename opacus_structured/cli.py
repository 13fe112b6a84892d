"""The ``opacus-structured`` command.

Sub-commands::

    opacus-structured schemes                       # list schemes and their flags
    opacus-structured epsilon <scheme> --noise-multiplier S (--steps T | --epochs E) --delta D [flags] [--json]
    opacus-structured calibrate <scheme> --target-epsilon E --delta D (--steps T | --epochs E) [flags] [--json]

Every scheme in :data:`opacus_structured.schemes.SCHEMES` gets its own sub-parser under
``epsilon`` and ``calibrate`` with the flags its class declares; other modules add whole
sub-commands through :func:`register_command`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from typing import Callable

from . import __version__
from ._discovery import import_submodules
from .accounting import pld as pld_lib
from .accounting import resource_guard
from .accounting.calibration import calibrate_noise_multiplier
from .schemes import SCHEMES, Scheme

__all__ = ["main", "build_parser", "register_command", "epochs_to_steps"]

_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def register_command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    """Add a sub-command (used by forecasting, plotting and individual-ε modules)."""
    _COMMANDS[name] = (help, add_arguments, run)


def _add_common(p: argparse.ArgumentParser, *, calibrate: bool) -> None:
    if calibrate:
        p.add_argument("--target-epsilon", type=float, required=True, help="privacy budget ε > 0")
    else:
        p.add_argument("--noise-multiplier", type=float, required=True,
                       help="σ: noise std divided by the clipping norm, > 0")
    scheme_owns_epochs = "--epochs" in p._option_string_actions
    if scheme_owns_epochs:  # the scheme's own --epochs sets the length unless --steps is given
        p.add_argument("--steps", type=int, help="number of optimizer steps, >= 0 "
                       "(default: --epochs × steps per epoch)")
    else:
        length = p.add_mutually_exclusive_group(required=True)
        length.add_argument("--steps", type=int, help="number of optimizer steps, >= 0")
        length.add_argument("--epochs", type=float,
                            help="number of epochs (steps = epochs × steps per epoch, rounded "
                                 "up: a partial epoch is priced as run)")
    p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    p.add_argument("--discretization", type=float, default=pld_lib.DEFAULT_DISCRETIZATION,
                   help="privacy-loss discretisation interval (pessimistic; default %(default)g; "
                        "at most 0.1, a warning above 0.01)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory allowed for composing the privacy-loss distribution, e.g. 4GiB "
                        "(default: $OPACUS_STRUCTURED_MEMORY_BUDGET, else min(2 GiB, RAM/4)); "
                        "over it a sound cheaper route is used and named, or the command stops")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of ``epochs`` epochs of ``steps_per_epoch`` steps, **rounded up**.

    A fractional epoch starts its partial last epoch, so rounding to the nearest integer could
    price fewer steps than run (1.04 epochs of 10 steps: the nearest integer prices 10 steps,
    a loop that takes the started 11th step ran 11). Products within a relative ``1e-9`` of an
    integer are float round-off and snap to it (``0.14 × 50 = 7.000000000000001`` is 7 steps,
    ``2.9999999999`` is 3).
    """
    x = float(epochs) * int(steps_per_epoch)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"epochs × steps per epoch must be finite and >= 0, got {epochs} × "
                         f"{steps_per_epoch}")
    nearest = round(x)
    if abs(x - nearest) <= 1e-9 * max(1.0, x):
        return int(nearest)
    return int(math.ceil(x))


def _steps(scheme: Scheme, args) -> int:
    if args.steps is not None:
        if args.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {args.steps}")
        return args.steps
    epochs = getattr(args, "epochs", None)
    if epochs is None or not (0 <= epochs < float("inf")):
        raise ValueError(f"--epochs must be finite and >= 0, got {epochs}")
    try:
        per_epoch = scheme.steps_per_epoch()
    except NotImplementedError:
        raise ValueError(f"scheme {scheme.name!r} has no epochs; pass --steps") from None
    return epochs_to_steps(args.epochs, per_epoch)


def _checked_discretization(args) -> None:
    """Refuse ``--discretization`` above 0.1; one warning line on stderr above 0.01."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resource_guard.check_discretization(args.discretization)
    for w in caught:
        print(f"opacus-structured: warning: {w.message}", file=sys.stderr)


def _route(eps) -> tuple[dict, str]:
    """JSON fields and a text label for the route that priced ``eps`` (PLD unless labelled)."""
    record = eps.record() if isinstance(eps, resource_guard.PricedEpsilon) else {"route": "pld"}
    route = record["route"]
    if route == "pld":
        return record, ""
    if route == "closed-form":
        return record, "  (exact closed form)"
    return record, f"  [{route.upper()} route: {record['route_note']}]"


def _emit(args, record: dict, text: str) -> None:
    if args.json:
        print(json.dumps(record, sort_keys=True))
    else:
        print(text)


def _run_epsilon(args) -> int:
    scheme_class = SCHEMES[args.scheme]
    scheme = scheme_class.from_cli_args(args)
    options = scheme_class.pricing_options_from_cli_args(args)  # e.g. a Monte Carlo run's settings
    steps = _steps(scheme, args)
    _checked_discretization(args)
    with resource_guard.memory_budget_scope(getattr(args, "memory_budget", None)):
        eps = scheme.epsilon(args.noise_multiplier, steps, args.delta,
                             discretization=args.discretization, **options)
    seed = getattr(getattr(eps, "estimate", None), "seed", None)  # a Monte Carlo run's seed
    parameters = scheme.describe()
    for value in options.values():
        parameters.update(value.to_dict() if hasattr(value, "to_dict") else {})
    if seed is not None:
        parameters["seed"] = seed
    record = {"scheme": scheme.name, "epsilon": eps, "delta": args.delta,
              "noise_multiplier": args.noise_multiplier, "steps": steps, "bound": scheme.bound,
              "discretization": args.discretization, "parameters": parameters}
    route_fields, route_label = _route(eps)
    record.update(route_fields)
    label = route_label + {"lower": "  (LOWER BOUND, not a guarantee)",
             "monte-carlo": "  (MONTE CARLO estimate, holds only with high probability"
                            + ("" if seed is None else f"; seed {seed}") + ")"}.get(
        scheme.bound, "")
    _emit(args, record, f"epsilon = {eps:.6g} at delta = {args.delta:g} after {steps} steps "
                        f"(scheme {scheme.name}, noise multiplier {args.noise_multiplier:g}){label}")
    return 0


def _run_calibrate(args) -> int:
    scheme = SCHEMES[args.scheme].from_cli_args(args)
    if scheme.bound == "lower":
        raise ValueError("cannot calibrate noise to a lower bound: choose --bound tight or upper")
    if scheme.bound == "monte-carlo":
        raise ValueError(f"scheme {scheme.name!r} is priced by Monte Carlo; bisecting on noisy "
                         f"estimates is not Algorithm 5: use `opacus-structured {scheme.name} "
                         f"certify` instead")
    steps = _steps(scheme, args)
    if steps == 0:
        raise ValueError("calibration needs at least one step")
    _checked_discretization(args)
    f = lambda s: scheme.epsilon(s, steps, args.delta, discretization=args.discretization)  # noqa: E731
    with resource_guard.memory_budget_scope(getattr(args, "memory_budget", None)):
        if hasattr(scheme, "noise_for_epsilon"):  # a closed form: calibrate by inversion
            sigma = scheme.noise_for_epsilon(args.target_epsilon, steps, args.delta)
        else:
            sigma = calibrate_noise_multiplier(f, args.target_epsilon)
        eps = f(sigma)
    route_fields, route_label = _route(eps)
    record = {"scheme": scheme.name, "noise_multiplier": sigma, "epsilon": eps,
              "target_epsilon": args.target_epsilon, "delta": args.delta, "steps": steps,
              "bound": scheme.bound, "discretization": args.discretization,
              "parameters": scheme.describe(), **route_fields}
    _emit(args, record, f"noise multiplier = {sigma:.6g} gives epsilon = {eps:.6g} <= "
                        f"{args.target_epsilon:g} at delta = {args.delta:g} after {steps} steps "
                        f"(scheme {scheme.name}){route_label}")
    return 0


def _run_schemes(args) -> int:
    rows = []
    for name, cls in sorted(SCHEMES.items()):
        p = argparse.ArgumentParser(prog=name, add_help=False)
        cls.add_cli_arguments(p)
        flags = [a.option_strings[0] for a in p._actions if a.option_strings]
        rows.append({"scheme": name, "summary": cls.summary, "flags": flags})
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['scheme']:<24} {r['summary']}")
            if r["flags"]:
                print(f"{'':<24} flags: {' '.join(r['flags'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opacus-structured",
        description="Sound and tight DP-SGD accounting for structured batching.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schemes", help="list batching schemes and their flags")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_schemes)

    for cmd, helptext, func, calibrate in (
            ("epsilon", "compute ε for a scheme", _run_epsilon, False),
            ("calibrate", "find the noise multiplier for a target ε", _run_calibrate, True)):
        p = sub.add_parser(cmd, help=helptext)
        ssub = p.add_subparsers(dest="scheme", required=True)
        for name, cls in sorted(SCHEMES.items()):
            sp = ssub.add_parser(name, help=cls.summary)
            cls.add_cli_arguments(sp)
            _add_common(sp, calibrate=calibrate)
            sp.set_defaults(func=func)

    for name, (helptext, add_arguments, run) in sorted(_COMMANDS.items()):
        p = sub.add_parser(name, help=helptext)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


def _load_plugins() -> None:
    """Import the modules that register sub-commands (optional extras may be missing)."""
    import_submodules("opacus_structured.commands")


def main(argv: list[str] | None = None) -> int:
    _load_plugins()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"opacus-structured: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a missing optional package: one line naming the extra
        from ._optional import install_hint

        hint = install_hint(exc)
        if hint is None:
            raise
        print(f"opacus-structured: error: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
