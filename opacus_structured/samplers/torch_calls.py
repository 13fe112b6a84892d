r"""How the row tokens' own code runs inside a user's loop: eagerly, and warning at the user's line.

The :class:`~opacus_structured.samplers.row_provenance.PrivateRows` tensor subclass runs every
torch operation of the loop on a row-tagged batch through its ``__torch_function__``, and the
recorder of :mod:`~opacus_structured.accountants.release_rows` reads the tokens in a forward
pre-hook of the private module. Two things a user sees must not change because of that code.

**``torch.compile``** (issue 46). Dynamo traces a compiled model's forward pre-hooks and the
``__torch_function__`` of a tensor subclass it is given, and cannot trace this bookkeeping (NumPy
token arrays, Python sets): it recursed and raised ``InternalTorchDynamoError`` where stock
Opacus runs ``torch.compile(model)`` after ``make_private``. :func:`eager_only` marks both
functions for Dynamo to leave out of the graph (a graph break) and call **eagerly on every
call**, so the tokens of every forward are still recorded (a function traced into a graph would
run once, at tracing, and never again). It is ``torch.compiler.disable`` without importing
Dynamo (about 1.5 s) for programs that never compile: Dynamo's tracer skips a function that
carries ``_torchdynamo_disable``, and once Dynamo is imported the call goes through
``torch._dynamo.disable`` (the eval-frame callback is switched off inside, so the function's own
frames are not compiled either).

**Warnings.** A warning torch raises inside an operation (a C++ ``TORCH_WARN``, or a Python
``warnings.warn(..., stacklevel=2)`` in ``torch.nn.functional``) is reported at the Python frame
that called the operation, which is ``__torch_function__`` here, not the user's line (issue
46). Python 3.12's ``skip_file_prefixes`` does not reach warnings raised from C++ and this
package runs on 3.11, so :func:`call_reporting_at_caller` runs the operation with two
temporary, thread-counted changes to the ``warnings`` module: a filter ``"always"`` for this
package's frames at the front of ``warnings.filters`` (so each such warning reaches the show
step, whatever the user's filters say about *our* module), and a ``warnings.showwarning`` that
re-issues each warning attributed to a frame of this package with ``warnings.warn_explicit`` at
the frame that called the torch operation (the frame stock torch would have named), with that
frame's module and ``__warningregistry__``. The user's filters, ``-W`` options,
``"default"`` once-per-line registry, ``"error"`` and ``catch_warnings(record=True)`` then
apply to the user's line exactly as without the subclass. Any other warning is passed on
unchanged. The frame that called the operation is the first frame above ``__torch_function__``
outside this package and Dynamo's ``disable`` wrapper; when torch dispatched from a Python
function (``handle_torch_function`` in ``torch/overrides.py``, e.g. ``F.softmax``), it is the
caller of that function, which is where its ``stacklevel=2`` points without the subclass.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from typing import Callable, Optional

__all__ = ["eager_only", "skip_wrapper_frames", "call_reporting_at_caller", "reporting_frame"]


# ---- torch.compile --------------------------------------------------------------------------
def eager_only(reason: str) -> Callable[[Callable], Callable]:
    """Decorator: the function left out of ``torch.compile`` graphs and run eagerly at every
    call (module docstring); no import of Dynamo until the program imports it. ``reason`` is
    what Dynamo says where it cannot leave the function out (``fullgraph=True``)."""
    return lambda fn: _eager_only(fn, reason)


def _eager_only(fn: Callable, reason: str) -> Callable:
    disabled: list = []

    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return fn(*args, **kwargs)
        if not disabled:
            import torch._dynamo  # already imported: costs nothing

            skip_wrapper_frames()
            disabled.append(torch._dynamo.disable(fn))
        return disabled[0](*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    call.__module__ = fn.__module__
    call._torchdynamo_disable = True  # Dynamo's tracer: graph break, call it eagerly
    call._torchdynamo_disable_msg = reason  # in its error where it cannot break (fullgraph)
    call._eager_only_code = fn.__code__
    _WRAPPER_CODE[:] = [call.__code__]  # one code object for every wrapper
    return call


_WRAPPER_CODE: list = []
_SKIPPING: list = []


def skip_wrapper_frames() -> None:
    """Once Dynamo is imported: tell its frame evaluation to run the wrappers of
    :func:`eager_only` as they are (``torch._dynamo.eval_frame.skip_code``) instead of
    compiling each call that follows a graph break (recompiles up to its limit, with
    warnings). Called where row tokens enter a program, before a compiled region can see
    them: when a batch is tagged and when the recorder is installed; a no-op until then."""
    if _SKIPPING or "torch._dynamo" not in sys.modules or not _WRAPPER_CODE:
        return
    skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip is not None:
        skip(_WRAPPER_CODE[0])
    _SKIPPING.append(True)


# ---- warnings at the caller's line --------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PACKAGE_MODULES = re.compile(r"opacus_structured\.samplers\.")
_ALWAYS = ("always", None, Warning, _PACKAGE_MODULES, 0)
_LOCK = threading.Lock()
_STATE = {"depth": 0, "showwarning": None}
_SKIPPED = os.sep + os.path.join("torch", "_dynamo") + os.sep  # Dynamo's disable wrapper
_DISPATCH = os.sep + os.path.join("torch", "overrides.py")


_OURS: dict = {}


def _ours(filename: str) -> bool:
    """Whether ``filename`` is a file of this package (cached: frames are walked per
    warning)."""
    known = _OURS.get(filename)
    if known is None:
        known = _OURS[filename] = os.path.abspath(filename).startswith(_PACKAGE_DIR)
    return known


def reporting_frame(frame, code) -> Optional[object]:
    """The frame a warning raised under the call of ``code`` (a ``__torch_function__``) is
    reported at: the frame that called the torch operation (module docstring). ``frame``: a
    frame inside that call; ``None`` if ``code`` is not on the stack."""
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return None
    frame = frame.f_back
    while frame is not None and (_ours(frame.f_code.co_filename)
                                 or _SKIPPED in frame.f_code.co_filename):
        frame = frame.f_back
    dispatched = False
    while frame is not None and frame.f_code.co_filename.endswith(_DISPATCH):
        frame, dispatched = frame.f_back, True
    if dispatched and frame is not None:  # the torch Python function that dispatched
        frame = frame.f_back
    return frame


def _showwarning(message, category, filename, lineno, file=None, line=None):
    """The ``warnings.showwarning`` installed during an operation (module docstring)."""
    previous = _STATE["showwarning"]
    code = _STATE.get("code")
    target = reporting_frame(sys._getframe(1), code) if code is not None and _ours(
        filename) else None
    if target is None:
        if previous is None or previous is warnings._showwarning_orig:
            warnings._showwarnmsg_impl(warnings.WarningMessage(message, category, filename,
                                                               lineno, file, line))
        else:
            previous(message, category, filename, lineno, file, line)
        return
    module_globals = target.f_globals
    # no module_globals=: CPython would read the module's source through its loader before
    # filtering, at every call (the shown line comes from linecache, as for any warning)
    warnings.warn_explicit(message, category, target.f_code.co_filename, target.f_lineno,
                           module=module_globals.get("__name__"),
                           registry=module_globals.setdefault("__warningregistry__", {}))


def _enter(code) -> None:
    with _LOCK:
        if _STATE["depth"] == 0:
            _STATE["showwarning"] = warnings.showwarning
            _STATE["code"] = code
            warnings.filters.insert(0, _ALWAYS)
            warnings.showwarning = _showwarning
        _STATE["depth"] += 1


def _exit() -> None:
    with _LOCK:
        _STATE["depth"] -= 1
        if _STATE["depth"] == 0:
            if warnings.showwarning is _showwarning:
                warnings.showwarning = _STATE["showwarning"]
            try:
                warnings.filters.remove(_ALWAYS)
            except ValueError:  # someone replaced the filter list meanwhile
                pass
            _STATE["showwarning"] = None


def call_reporting_at_caller(code, func, args, kwargs):
    """``func(*args, **kwargs)``, with every warning it raises reported at the frame that
    called the torch operation whose ``__torch_function__`` has code object ``code`` (module
    docstring)."""
    _enter(code)
    try:
        return func(*args, **kwargs)
    finally:
        _exit()
