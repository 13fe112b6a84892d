"""Which parameters the noisy step covers: every trainable parameter is moved only by it.

The accountant prices the DP optimizer's noisy step. A parameter of the private model that
receives a gradient from a private batch but is moved by *another* optimizer (a plain ``Adam``
for the head next to the DP optimizer for the body, a second optimizer per part) is released
without noise: its update is a deterministic function of the sampled batch, the true ε is
infinite, and the ε printed covers only the other parameters. Two checks close this:

**1. At make_private time, the optimizer covers the module.** The module's trainable parameters
(``requires_grad=True``) must all be in the DP optimizer's ``param_groups``, else
:class:`UncoveredParametersError` (a ``ValueError``) names how many and which (names from
``module.named_parameters()``), why, and the three fixes: add them to the optimizer; freeze them
(``p.requires_grad_(False)``: a frozen parameter never counts); or declare them **public** —
``public_parameters=`` of :func:`opacus_structured.make_private`,
:func:`~opacus_structured.make_private_with_epsilon`, ``DPCallback`` and
``CorrelatedNoisePrivacyEngine.make_private``, or :func:`declare_public_parameters` before
Opacus' own ``engine.make_private``. A declaration is **your claim**, not checked: those
parameters are trained only on public data, or are not moved from private gradients at all
(e.g. a pretrained layer that some other, public, procedure updates). Checked on every path:
our ``make_private`` / ``make_private_with_epsilon`` (before the module is wrapped), Opacus'
``engine.make_private`` with one of our accountants (its step-hook factory
:meth:`~opacus_structured.accountants.base.SchemeAccountant.get_optimizer_hook_fn`),
``CorrelatedNoisePrivacyEngine.make_private`` (any accountant) and ``DPCallback`` (the
LightningModule's parameters against the optimizer ``configure_optimizers`` returned).

**2. At run time, no other optimizer steps a guarded parameter.** The module is then *guarded*
while its DP optimizer lives (a weak registry: parameter id → owner, dropped when the module
or its DP optimizers are garbage collected; ``DPCallback`` releases it when the fit ends;
:func:`release_parameters` releases it by hand, e.g. before public fine-tuning). One global
torch optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``,
installed once per process) raises :class:`ForeignOptimizerStepError` (a ``RuntimeError``)
before any optimizer that is not a DP optimizer — not an Opacus ``DPOptimizer`` and not the
torch optimizer wrapped in one (``original_optimizer``, stepped by the DP optimizer's own
``step`` after clipping and noise) — steps a guarded parameter that holds a gradient. Public
parameters are not guarded; parameters that do not require grad, or hold no gradient at that
step (a torch optimizer does not move them), never count. Other modules are untouched: a GAN's
generator optimizer stepping the generator (not the private discriminator) passes. Stepping
the wrapped torch optimizer directly (``optimizer.original_optimizer.step()``) is caught by the
privacy ledger at ``get_epsilon``
(:meth:`~opacus_structured.accountants.ledger.ReleaseLedger.check_optimizer`).

**Not seen: direct tensor updates.** Writing ``p.data``, ``p.copy_``, ``torch.no_grad()``
in-place arithmetic or a ``load_state_dict`` of values computed from private batches without
the DP step moves a parameter without any optimizer; the hook cannot see it cheaply, so it is
**your responsibility** (updates computed only from the noisy released parameters, such as
an EMA or tail averaging of iterates, are post-processing and fine).
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable, Union

import torch
from torch import nn

__all__ = ["UncoveredParametersError", "ForeignOptimizerStepError", "check_coverage",
           "guard_parameters", "declare_public_parameters", "declared_public_parameters",
           "release_parameters", "is_guarded", "unwrap_module", "uncovered_parameters"]

#: How many parameter names an error message lists.
SHOWN = 5

PublicParameters = Union[None, nn.Module, torch.Tensor, str, Iterable[Union[torch.Tensor, str]]]


class UncoveredParametersError(ValueError):
    """Trainable parameters of the private module are not stepped by the DP optimizer (see
    the module docstring, 1.)."""


class ForeignOptimizerStepError(RuntimeError):
    """A non-DP optimizer is about to step a parameter of a guarded private module (see the
    module docstring, 2.)."""


# ---- the module the optimizer trains -----------------------------------------------------
def unwrap_module(module) -> nn.Module:
    """The user's module inside Opacus' wrappers (``GradSampleModule`` and its ghost variant,
    ``DPDDP``), the hooks object of ``make_private(..., wrap_model=False)`` (Opacus 1.6's
    ``GradSampleHooks`` and its ghost variant, which are not modules), torch's
    ``DistributedDataParallel`` and a ``torch.compile`` wrapper: the one whose parameter
    names the user knows."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch.compile's wrapper exists only once Dynamo is imported (not imported here: ~1.5 s)
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())
    for _ in range(8):
        if isinstance(module, AbstractGradSampleHooks):  # GradSampleModule too
            module = module._module
        elif compiled and isinstance(module, compiled):
            module = module._orig_mod
        elif isinstance(module, (DPDDP, DDP)):
            module = module.module
        else:
            break
    return module


def _optimizer_parameter_ids(optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


# ---- public declarations -------------------------------------------------------------------
_DECLARED: "weakref.WeakKeyDictionary[nn.Module, frozenset[int]]" = weakref.WeakKeyDictionary()


def _resolve_public(module: nn.Module, public_parameters: PublicParameters) -> frozenset[int]:
    """Ids of the parameters of ``module`` named by ``public_parameters``: a module (all its
    parameters), a parameter, a name, or an iterable of parameters and names (names as in
    ``module.named_parameters()``). Raises ``ValueError`` for an unknown name or a tensor
    that is not a parameter of ``module``."""
    if public_parameters is None:
        return frozenset()
    if isinstance(public_parameters, nn.Module):
        items: list = list(public_parameters.parameters())
    elif isinstance(public_parameters, (torch.Tensor, str)):
        items = [public_parameters]
    else:
        try:
            items = list(public_parameters)
        except TypeError:
            raise ValueError(f"public_parameters must be an iterable of parameters or of "
                             f"parameter names (or a module), got "
                             f"{type(public_parameters).__name__}") from None
    named = dict(module.named_parameters())
    own = {id(p) for p in named.values()}
    ids = set()
    for item in items:
        if isinstance(item, str):
            if item not in named:
                known = ", ".join(repr(n) for n in list(named)[:SHOWN])
                raise ValueError(f"public_parameters names {item!r}, which is not a parameter "
                                 f"of the module (its parameters: {known}"
                                 f"{', ...' if len(named) > SHOWN else ''})")
            ids.add(id(named[item]))
        elif isinstance(item, torch.Tensor):
            if id(item) not in own:
                raise ValueError(f"public_parameters holds a tensor of shape "
                                 f"{tuple(item.shape)} that is not a parameter of the module")
            ids.add(id(item))
        else:
            raise ValueError(f"public_parameters must hold parameters or parameter names, got "
                             f"{type(item).__name__}")
    return frozenset(ids)


def declare_public_parameters(module: nn.Module, public_parameters: PublicParameters) -> None:
    """Declare parameters of ``module`` **public**: trained only on public data, or not moved
    from private gradients. Your claim, not checked. They are left out of the coverage check
    and of the run-time guard. Replaces an earlier declaration for ``module`` (``None`` or an
    empty iterable removes it). What ``make_private(..., public_parameters=...)`` and
    ``DPCallback(public_parameters=...)`` do; call it before Opacus' own ``engine.make_private``
    (with one of our accountants) to declare them there."""
    module = unwrap_module(module)
    ids = _resolve_public(module, public_parameters)
    if ids:
        _DECLARED[module] = ids
    else:
        _DECLARED.pop(module, None)


def declared_public_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters of ``module`` declared public (:func:`declare_public_parameters`)."""
    module = unwrap_module(module)
    ids = _DECLARED.get(module, frozenset())
    return [name for name, p in module.named_parameters() if id(p) in ids]


# ---- 1. coverage at make_private ---------------------------------------------------------------
def uncovered_parameters(module: nn.Module, optimizer) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every trainable parameter of ``module`` (``requires_grad``,
    not declared public) that is not in ``optimizer.param_groups``."""
    module = unwrap_module(module)
    covered = _optimizer_parameter_ids(optimizer)
    public = _DECLARED.get(module, frozenset())
    return [(name, p) for name, p in module.named_parameters()
            if p.requires_grad and id(p) not in covered and id(p) not in public]


def check_coverage(module: nn.Module, optimizer, *, where: str = "make_private") -> None:
    """Raise :class:`UncoveredParametersError` if a trainable parameter of ``module`` is not in
    the (DP) ``optimizer``'s ``param_groups`` and was not declared public (module docstring)."""
    missing = uncovered_parameters(module, optimizer)
    if not missing:
        return
    names = ", ".join(repr(name) for name, _ in missing[:SHOWN])
    more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    numel = sum(p.numel() for _, p in missing)
    raise UncoveredParametersError(
        f"{where}: {len(missing)} trainable parameter tensor(s) of the module ({numel} values) "
        f"are not in the DP optimizer's param_groups: {names}{more}. They receive gradients "
        f"from the private batches (requires_grad=True) but the noisy step does not move them, "
        f"so if any other optimizer or code moves them (a second optimizer for one part, a "
        f"manual update) they are released without noise and the epsilon does not cover them "
        f"(it would be infinite). Fix one of: (1) add them to the optimizer passed to "
        f"make_private (e.g. SGD(module.parameters(), ...), with a param group per part for "
        f"other learning rates); (2) freeze them (p.requires_grad_(False)) if they are not "
        f"trained; (3) if they are trained only on public data / never moved from private "
        f"gradients, declare them public (your claim): public_parameters=[...] (parameters or "
        f"names) of opacus_structured.make_private / make_private_with_epsilon / DPCallback / "
        f"CorrelatedNoisePrivacyEngine.make_private, or opacus_structured.accountants."
        f"parameter_guard.declare_public_parameters(module, [...]) before engine.make_private")


# ---- 2. the run-time guard ----------------------------------------------------------------------
class _Guard:
    """One guarded module: its DP optimizers (weak) and the names of its guarded parameters."""

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.names: dict[int, str] = {}

    def live(self) -> bool:
        return self.module() is not None and len(self.optimizers) > 0


#: parameter id -> (weakref to the parameter, its guard)
_PARAMS: dict[int, tuple[weakref.ref, _Guard]] = {}
_GUARDS: "weakref.WeakKeyDictionary[nn.Module, _Guard]" = weakref.WeakKeyDictionary()
#: the torch optimizers wrapped by a guarding DP optimizer (stepped by its own ``step``)
_INNER: "weakref.WeakSet" = weakref.WeakSet()
_HOOK: list = []  # the handle of the global pre-hook, once installed


def _drop(guard: _Guard) -> None:
    for key in [k for k, (_, g) in _PARAMS.items() if g is guard]:
        del _PARAMS[key]


def _install_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_pre_step))


def guard_parameters(module: nn.Module, optimizer, *, where: str = "make_private") -> None:
    """Check coverage (:func:`check_coverage`), then guard ``module``'s parameters (all but
    those declared public) against other optimizers while the DP ``optimizer`` lives
    (idempotent; a second DP optimizer on the same module joins the guard)."""
    module = unwrap_module(module)
    check_coverage(module, optimizer, where=where)
    guard = _GUARDS.get(module)
    if guard is None:
        guard = _GUARDS[module] = _Guard(module)
        weakref.finalize(module, _drop, guard)
    guard.optimizers.add(optimizer)
    inner = getattr(optimizer, "original_optimizer", None)
    if inner is not None:
        _INNER.add(inner)
    public = _DECLARED.get(module, frozenset())
    _drop(guard)
    guard.names = {}
    for name, p in module.named_parameters():
        if id(p) not in public:
            guard.names[id(p)] = name
            _PARAMS[id(p)] = (weakref.ref(p), guard)
    _install_hook()


def release_parameters(module: nn.Module) -> None:
    """Stop guarding ``module`` (e.g. before fine-tuning it on public data with a plain
    optimizer while its DP optimizer still exists). ``DPCallback`` calls it when the fit ends."""
    guard = _GUARDS.pop(unwrap_module(module), None)
    if guard is not None:
        _drop(guard)


def is_guarded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are guarded now (a live DP optimizer steps them)."""
    guard = _GUARDS.get(unwrap_module(module))
    return guard is not None and guard.live()


def _is_dp_optimizer(optimizer) -> bool:
    from opacus.optimizers import DPOptimizer

    return isinstance(optimizer, DPOptimizer) or optimizer in _INNER


def _inside_dp_step(optimizer, max_depth: int = 8) -> bool:
    """Whether ``optimizer`` is being stepped by the ``step`` of a DP optimizer that wraps it
    (one not registered here: built outside ``make_private`` / ``DPCallback``)."""
    from opacus.optimizers import DPOptimizer

    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if isinstance(owner, DPOptimizer) and \
                getattr(owner, "original_optimizer", None) is optimizer:
            return True
        frame = frame.f_back
    return False


def _pre_step(optimizer, args, kwargs) -> None:
    """The global step pre-hook (module docstring, 2.)."""
    if not _PARAMS or _is_dp_optimizer(optimizer):
        return
    stepped: list[tuple[str, _Guard]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _PARAMS.get(id(p))
            if entry is None or p.grad is None or not p.requires_grad:
                continue
            ref, guard = entry
            if ref() is p and guard.live():
                stepped.append((guard.names.get(id(p), "?"), guard))
    if not stepped or _inside_dp_step(optimizer):
        return
    names = ", ".join(repr(name) for name, _ in stepped[:SHOWN])
    more = f" and {len(stepped) - SHOWN} more" if len(stepped) > SHOWN else ""
    module = stepped[0][1].module()
    raise ForeignOptimizerStepError(
        f"{type(optimizer).__module__}.{type(optimizer).__name__} is about to step "
        f"{len(stepped)} parameter(s) of the private module ({type(module).__name__}) that a "
        f"DP optimizer guards: {names}{more}. It is not the DP optimizer, so their update "
        f"would be the raw gradient of the private batch, released without clipping or noise "
        f"(the printed epsilon would not cover it). Fix: step every private parameter with the "
        f"DP optimizer (one optimizer, a param group per part for other learning rates); or "
        f"freeze them (requires_grad_(False)); or, if this optimizer trains them only on "
        f"public data, declare them public: public_parameters=[...] of make_private / "
        f"DPCallback (your claim); after private training, "
        f"opacus_structured.accountants.parameter_guard.release_parameters(module) ends the "
        f"guard")
