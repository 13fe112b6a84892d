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
import inspect
import json
import math
import sys
import warnings

from . import __version__, _progress
from ._discovery import import_submodules
from .accounting import pld as pld_lib
from .accounting import resource_guard
from .accounting.calibration import calibrate_noise_multiplier
from .commands import _common
from .commands._registry import COMMANDS as _COMMANDS
from .commands._registry import register_command
from .schemes import SCHEMES, Scheme

__all__ = ["main", "build_parser", "register_command", "epochs_to_steps"]


def _has_epochs(scheme_class) -> bool:
    """Whether the scheme defines an epoch (``--epochs`` is offered only then)."""
    return scheme_class.steps_per_epoch is not Scheme.steps_per_epoch


def _add_common(p: argparse.ArgumentParser, *, calibrate: bool, epochs: bool = True) -> None:
    if calibrate:
        p.add_argument("--target-epsilon", type=float, required=True, help="privacy budget ε > 0")
    else:
        p.add_argument("--noise-multiplier", type=float, required=True,
                       help="σ: noise std divided by the clipping norm, > 0")
    scheme_owns_epochs = "--epochs" in p._option_string_actions
    if scheme_owns_epochs:  # the scheme's own --epochs sets the length unless --steps is given
        p.add_argument("--steps", type=int, help="number of optimizer steps, >= 0 "
                       "(default: --epochs × steps per epoch)")
    elif not epochs:  # the scheme has no notion of an epoch: do not offer --epochs
        p.add_argument("--steps", type=int, required=True,
                       help="number of optimizer steps, >= 0 (this scheme has no epochs)")
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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (hidden anyway when stderr is not a terminal)")


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
    if route == "pld":  # certified against its numerical error (accounting.numerics)
        roundoff = record.get("numerical_roundoff")
        return record, ("" if roundoff is None else
                        f"  [PLD route: numerical error <= {roundoff:.2g} in delta, certified "
                        f"for delta >= {record['certified_min_delta']:.2g}]")
    if route == "closed-form":
        return record, "  (exact closed form)"
    return record, f"  [{route.upper()} route: {record['route_note']}]"


def _notes(scheme: Scheme, record: dict) -> None:
    """The scheme's notes on what it prices (e.g. structured's short-series regime): one
    ``note:`` line each on stderr (also with --json) and ``record["notes"]``."""
    notes = list(getattr(scheme, "notes", lambda: [])())
    if notes:
        record["notes"] = notes
    for note in notes:
        print(f"opacus-structured: note: {note}", file=sys.stderr)


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
    show = _progress.enabled(getattr(args, "no_progress", False))
    # schemes that report their stages (random-allocation-mf) get a bar per stage, the others
    # an elapsed-time bar
    staged = show and "progress" in inspect.signature(scheme.epsilon).parameters
    with resource_guard.memory_budget_scope(getattr(args, "memory_budget", None)), \
            (_progress.bar(desc=f"pricing {scheme.name}", show=True) if staged
             else _progress.elapsed(f"pricing {scheme.name}", show=show)) as bar:
        extra = {"progress": _progress.staged(bar, scheme.name)} if staged else {}
        eps = scheme.epsilon(args.noise_multiplier, steps, args.delta,
                             discretization=args.discretization, **options, **extra)
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
    _notes(scheme, record)
    label = route_label + {"lower": "  (LOWER BOUND, not a guarantee)",
             "monte-carlo": "  (MONTE CARLO estimate, holds only with high probability"
                            + ("" if seed is None else f"; seed {seed}") + ")"}.get(
        scheme.bound, "")
    if math.isinf(eps):  # never a bare "inf": say why
        reason = _infinite_epsilon_reason(scheme, args.noise_multiplier, steps, args.delta)
        record["epsilon_infinite_reason"] = reason
        label += f"\n  epsilon is infinite: {reason}"
    _emit(args, record, f"epsilon = {eps:.6g} at delta = {args.delta:g} after {steps} steps "
                        f"(scheme {scheme.name}, noise multiplier {args.noise_multiplier:g}){label}")
    return 0


def _infinite_epsilon_reason(scheme: Scheme, noise_multiplier: float, steps: int,
                             delta: float) -> str:
    """One sentence on why ε(δ) is infinite: the scheme's own (``infinite_epsilon_reason``)
    or the generic one."""
    own = getattr(scheme, "infinite_epsilon_reason", None)
    reason = own(noise_multiplier, steps, delta) if own is not None else None
    if reason is None and scheme.bound == "monte-carlo":
        reason = (f"the Monte Carlo estimate's confidence bound cannot reach delta = {delta:g} "
                  f"with this many samples (or the privacy loss is unbounded at this delta); "
                  f"raise --samples or --delta")
    return reason or (
        f"the privacy-loss distribution puts more than delta = {delta:g} of probability on an "
        f"infinite privacy loss (an outcome possible under one neighbouring dataset only), so "
        f"no finite epsilon holds at this delta; raise --delta or change the scheme")


def _calibration_progress(f, show: bool, bar) -> object:
    """``f`` wrapped to count ε evaluations on ``bar`` and, after the first (slow) one, print
    a time estimate for the whole calibration (bracketing + bisection to rtol 1e-3: about 14
    evaluations, more when σ is far from 1)."""
    expected = 14
    state = {"calls": 0}

    def wrapped(sigma):
        start = _progress.now()
        try:
            return f(sigma)
        finally:
            state["calls"] += 1
            bar.update(1)
            if state["calls"] == 1 and show:
                took = _progress.now() - start
                if took > 1.0:
                    bar.write(f"calibrate: one epsilon evaluation took {took:.1f} s; a "
                              f"calibration needs about {expected} or more, so expect about "
                              f"{_progress.format_seconds(expected * took)} or more",
                              file=sys.stderr)
    return wrapped


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
            show = _progress.enabled(getattr(args, "no_progress", False))
            with _progress.bar(desc=f"calibrating {scheme.name}", show=show,
                               unit="eval") as bar:
                sigma = calibrate_noise_multiplier(_calibration_progress(f, show, bar),
                                                   args.target_epsilon)
        eps = f(sigma)
    route_fields, route_label = _route(eps)
    record = {"scheme": scheme.name, "noise_multiplier": sigma, "epsilon": eps,
              "target_epsilon": args.target_epsilon, "delta": args.delta, "steps": steps,
              "bound": scheme.bound, "discretization": args.discretization,
              "parameters": scheme.describe(), **route_fields}
    _notes(scheme, record)
    _emit(args, record, f"noise multiplier = {sigma:.6g} gives epsilon = {eps:.6g} <= "
                        f"{args.target_epsilon:g} at delta = {args.delta:g} after {steps} steps "
                        f"(scheme {scheme.name}){route_label}")
    return 0


def scheme_rows() -> list[dict]:
    """The rows of ``schemes``, from the schemes themselves: name, summary and flags."""
    rows = []
    for name, cls in sorted(SCHEMES.items()):
        p = argparse.ArgumentParser(prog=name, add_help=False)
        cls.add_cli_arguments(p)
        flags = [a.option_strings[0] for a in p._actions if a.option_strings]
        rows.append({"scheme": name, "summary": cls.summary, "flags": flags})
    return rows


def write_schemes_index(path=None) -> str:
    """Write the ``schemes`` rows with the digest of their sources to the shipped index
    (``commands._common.SCHEMES_INDEX``; the console prints the command from it while the
    digest matches); returns the path. Run after editing a scheme::

        python -c "from opacus_structured import cli; cli.write_schemes_index()"
    """
    path = _common.SCHEMES_INDEX if path is None else path
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"digest": _common.schemes_sources_digest(), "rows": scheme_rows()}, fh,
                  indent=1, ensure_ascii=False)
        fh.write("\n")
    return str(path)


def _run_schemes(args) -> int:
    _common.print_scheme_rows(scheme_rows(), args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opacus-structured",
        description="Sound and tight DP-SGD accounting for structured batching.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schemes", help="list batching schemes and their flags")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=_run_schemes)

    for cmd, helptext, func, calibrate in (
            ("epsilon", "compute ε for a scheme", _run_epsilon, False),
            ("calibrate", "find the noise multiplier for a target ε", _run_calibrate, True)):
        p = sub.add_parser(cmd, help=helptext)
        ssub = p.add_subparsers(dest="scheme", required=True)
        for name, cls in sorted(SCHEMES.items()):
            sp = ssub.add_parser(name, help=cls.summary)
            cls.add_cli_arguments(sp)
            _add_common(sp, calibrate=calibrate, epochs=_has_epochs(cls))
            sp.set_defaults(func=func)

    for name, (helptext, add_arguments, run) in sorted(_COMMANDS.items()):
        p = sub.add_parser(name, help=helptext)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


_BUILTIN = ("schemes", "epsilon", "calibrate")


def _load_plugins(argv: list[str] | None = None) -> None:
    """Import the modules that register sub-commands (optional extras may be missing), unless
    the command is a built-in one (they import torch; ``epsilon`` must start fast)."""
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    if words and words[0] in _BUILTIN:
        return
    import_submodules("opacus_structured.commands")


def main(argv: list[str] | None = None) -> int:
    _load_plugins(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return _common.run_command(args.func, args)


if __name__ == "__main__":  # `python -m opacus_structured.cli`: the full parser
    sys.exit(main())
