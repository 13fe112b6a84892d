r"""Which sampler draw, and which row of it, every row of a model input comes from (issue 39).

The accountants price a noisy step as "the clipped rows of one draw of the scheme's sampler,
one row per example, plus noise". What a training loop actually sums is observed here rather
than assumed: each batch the private DataLoader yields (the
:class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader` that
:func:`opacus_structured.make_private` returns, and Opacus' own loader on its engine path) is
handed to the loop as :class:`PrivateRows` tensors, a ``torch.Tensor`` subclass that carries a
**row token** per row: ``(draw, position)`` — the global draw index of the batch and the row's
position in it. The tokens follow the rows through the torch operations a loop applies
between the loader and the model:

* element-wise and dtype / device operations (``x.to(device)``, ``x.float() / 255``,
  ``x + noise``, ``torch.where``…) keep each row's token;
* indexing and slicing along the rows (``x[mask]``, ``x[:8]``, ``x[perm]``), ``torch.cat`` /
  ``split`` / ``chunk`` along the rows, and reshapes that keep the leading dimension move the
  tokens with the rows (``torch.cat([aug(x), aug(x)])`` gives every token twice: two rows per
  example);
* ``*_like`` factories (``torch.randn_like(x)``) carry no data of ``x`` and no token;
* every other operation on a tracked tensor gives a **mixed** result: each of its rows may
  depend on every example of the draws involved (the operation is named in ``lost_at``).

The wrapped module's forward pre-hook (:mod:`~opacus_structured.accountants.release_rows`)
reads the tokens of the model input and hands the model plain tensors (the forward itself runs
on ``torch.Tensor`` at full speed). Rows without a token (a tensor built outside torch from
private data, e.g. through NumPy, or generated rows) are **untracked**: they are priced as
rows whose examples are unknown, unless declared public with :func:`public` (rows of a
tensor) or :func:`public_rows` (every forward in a block), e.g. a GAN's generated samples or
public pretraining rows mixed into a batch. Declaring is the user's claim that the rows carry
no private data.

Token values: ``draw · 2**24 + position`` (a batch of at most 2**24 rows); ``UNTRACKED`` (-1)
for a row without provenance and ``PUBLIC`` (-2) for a declared public row.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .torch_calls import call_reporting_at_caller, eager_only, skip_wrapper_frames

__all__ = ["PrivateRows", "Provenance", "tag_batch", "untag", "public", "public_rows",
           "in_public_block", "UNTRACKED", "PUBLIC", "POSITION_BITS", "token_draws",
           "provenance_of"]

UNTRACKED = -1
PUBLIC = -2
POSITION_BITS = 24
_POSITIONS = 1 << POSITION_BITS


@dataclass(frozen=True)
class Provenance:
    """Where the rows of one tensor come from.

    ``tokens``: one token per row along ``dim`` (exact provenance), or ``None`` (mixed: every
    row may depend on every example of ``draws``; ``lost_at`` names the operation). ``span``:
    set only by :func:`tag_batch` on the tokens of a batch as delivered, ``draw`` when
    ``tokens`` is ``draw · 2**24 + arange(len(tokens))`` (one draw, each row once, in order:
    the recorder then needs no pass over them); operations that keep the rows keep this object.
    """

    tokens: Optional[np.ndarray]
    draws: frozenset
    dim: int = 0
    lost_at: Optional[str] = None
    span: Optional[int] = field(default=None, compare=False)

    @staticmethod
    def exact(tokens: np.ndarray, dim: int = 0) -> "Provenance":
        tokens = np.asarray(tokens, dtype=np.int64)
        return Provenance(tokens, token_draws(tokens), dim)

    @staticmethod
    def mixed(draws, lost_at: str) -> "Provenance":
        return Provenance(None, frozenset(draws), 0, lost_at)

    @property
    def is_exact(self) -> bool:
        return self.tokens is not None


def token_draws(tokens: np.ndarray) -> frozenset:
    """The draws that the valid tokens of ``tokens`` belong to."""
    valid = tokens[tokens >= 0]
    return frozenset(int(d) for d in np.unique(valid >> POSITION_BITS))


def provenance_of(tensor) -> Optional[Provenance]:
    """The :class:`Provenance` of a :class:`PrivateRows` tensor (``None`` for any other)."""
    return getattr(tensor, "_rows", None) if isinstance(tensor, PrivateRows) else None


# ---- public declarations ---------------------------------------------------------------------
_STATE = threading.local()


@contextlib.contextmanager
def public_rows():
    """Every forward of the private model inside this block is on **public** rows (e.g. a GAN
    discriminator on generated samples: ``with public_rows(): errD_fake = crit(netD(fake), 0)``).
    Their clipped rows are summed into the step but no example of the private dataset is in
    them, so they cost nothing. A forward inside the block on rows of the private loader raises
    (they are private whatever the block says)."""
    depth = getattr(_STATE, "public", 0)
    _STATE.public = depth + 1
    try:
        yield
    finally:
        _STATE.public = depth


def in_public_block() -> bool:
    """Whether the caller runs inside :func:`public_rows`."""
    return getattr(_STATE, "public", 0) > 0


def public(tensor: torch.Tensor) -> "PrivateRows":
    """``tensor`` with every row declared public (it may then be concatenated with private rows:
    ``torch.cat([x, public(x_pretrain)])``). Rows that carry a private token cannot be
    declared public."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"public() takes a tensor, got {type(tensor).__name__}")
    prov = provenance_of(tensor)
    if prov is not None and (not prov.is_exact or bool((prov.tokens >= 0).any())):
        raise ValueError("public(): these rows come from the private DataLoader (they carry "
                         "draw tokens); only rows that hold no private data can be declared "
                         "public")
    plain = tensor.as_subclass(torch.Tensor) if isinstance(tensor, PrivateRows) else tensor
    if plain.dim() == 0:
        raise ValueError("public() needs a tensor with a row dimension, got a scalar")
    return _wrap(plain, Provenance.exact(np.full(plain.shape[0], PUBLIC, dtype=np.int64)))


# ---- tagging and untagging batches ----------------------------------------------------------
def _wrap(tensor: torch.Tensor, prov: Provenance) -> "PrivateRows":
    out = tensor.as_subclass(PrivateRows)
    out._rows = prov
    return out


def _leaves(obj, fn):
    """Apply ``fn`` to every tensor leaf of a batch (tuples, lists, dicts, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_leaves(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_leaves(v, fn) for v in obj)
    if isinstance(obj, dict):
        try:
            return type(obj)((k, _leaves(v, fn)) for k, v in obj.items())
        except TypeError:
            return {k: _leaves(v, fn) for k, v in obj.items()}
    return obj


def _first_rows(batch) -> Optional[int]:
    found = []

    def look(t):
        if not found and t.dim() > 0:
            found.append(int(t.shape[0]))
        return t

    _leaves(batch, look)
    return found[0] if found else None


def tag_batch(batch, draw: int, rows: Optional[int] = None):
    """``batch`` with every tensor leaf a :class:`PrivateRows`: leaves with ``rows`` rows (by
    default the first leaf's leading size) get the tokens ``(draw, 0..rows-1)``; other leaves
    (scalars, per-batch metadata) are mixed over ``draw``."""
    if draw is None or draw < 0:
        return batch
    skip_wrapper_frames()  # torch.compile: tokens enter the program here (torch_calls)
    flat = type(batch) in (tuple, list) and all(type(t) is torch.Tensor for t in batch)
    if rows is None:  # the first leaf's leading size
        rows = (next((int(t.shape[0]) for t in batch if t.dim() > 0), None) if flat
                else _first_rows(batch))
    else:
        rows = int(rows)
    if rows is None or rows >= _POSITIONS:
        return batch
    draws = frozenset((int(draw),))  # known: no pass over the tokens
    exact = Provenance(int(draw) * _POSITIONS + np.arange(rows, dtype=np.int64), draws,
                       span=int(draw))
    mixed: list = []

    def tag(t):
        if isinstance(t, PrivateRows):
            return t
        if t.dim() > 0 and t.shape[0] == rows:
            return _wrap(t, exact)
        if not mixed:
            mixed.append(Provenance(None, draws, 0, "a batch leaf of another size"))
        return _wrap(t, mixed[0])

    if flat:  # the common (x, y): no walk over a nested batch
        return type(batch)(tag(t) for t in batch)
    return _leaves(batch, tag)


def untag(obj):
    """``(plain, found)``: ``obj`` with every :class:`PrivateRows` leaf turned into a plain
    ``torch.Tensor`` (no copy), and the list of ``(tensor, provenance or None)`` for every
    tensor leaf."""
    found: list = []

    def strip(t):
        prov = provenance_of(t)
        plain = t.as_subclass(torch.Tensor) if isinstance(t, PrivateRows) else t
        found.append((plain, prov))
        return plain

    return _leaves(obj, strip), found


# ---- propagation through torch operations --------------------------------------------------
def _names(*names) -> frozenset:
    return frozenset(names)


#: Operations whose output rows are computed from the same rows of their inputs.
_ROWWISE = _names(
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "true_divide", "floor_divide",
    "remainder", "fmod", "pow", "pow_", "neg", "abs", "exp", "log", "log1p", "log2", "log10",
    "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "relu_", "clamp",
    "clamp_", "clamp_min", "clamp_max", "clip", "clip_", "where", "masked_fill", "masked_fill_",
    "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char", "to",
    "type", "cuda", "cpu", "clone", "contiguous", "detach", "detach_", "requires_grad_",
    "pin_memory", "round", "floor", "ceil", "trunc", "sign", "nan_to_num", "square",
    "reciprocal", "lerp", "addcmul", "addcdiv", "erf", "exp2", "expm1", "frac", "maximum", "data",
    "minimum", "one_hot", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_not", "logical_xor", "isnan", "isfinite", "isinf", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "copy_", "fill_", "zero_", "normal_", "uniform_",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__floordiv__",
    "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__neg__", "__abs__", "__and__",
    "__or__", "__xor__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__rand__", "__ror__", "__rxor__", "__iand__", "__ior__")
#: Factories that read only the shape / dtype / device of their input.
_NO_DATA = _names("zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                  "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty",
                  "new_full", "size", "dim", "numel", "__len__", "shape", "dtype", "device",
                  "_base")
_RESHAPE = _names("view", "reshape", "flatten", "view_as", "reshape_as", "expand",
                  "expand_as")
_CONCAT = _names("cat", "concat", "concatenate")
_SPLIT = _names("split", "chunk", "tensor_split", "unbind")
_OWN_ROWS = _names("__setitem__", "index_put_", "masked_scatter_")


def _func_name(func) -> str:
    name = getattr(func, "__name__", None)
    if name is None or name == "__get__":  # a property getter such as Tensor.shape.__get__
        name = getattr(getattr(func, "__self__", None), "__name__", None) or repr(func)
    return name


def _tracked(args, kwargs) -> list:
    found: list = []

    def visit(obj):
        if isinstance(obj, PrivateRows):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(args)
    visit(tuple((kwargs or {}).values()))
    return found


def _union_draws(tracked) -> frozenset:
    out: set = set()
    for t in tracked:
        out |= t._rows.draws
    return frozenset(out)


def _same_rows(tracked) -> Optional[Provenance]:
    """The common exact provenance of ``tracked`` (identical tokens on the same dim), else
    ``None``."""
    first = tracked[0]._rows
    if not first.is_exact:
        return None
    for t in tracked[1:]:
        p = t._rows
        if not p.is_exact or p.dim != first.dim or not np.array_equal(p.tokens, first.tokens):
            return None
    return first


def _index_rows(prov: Provenance, index, shape) -> Optional[Provenance]:
    """Provenance after ``tensor[index]`` (``None``: rows no longer traceable)."""
    if prov.dim != 0:
        return None
    rest: tuple = ()
    if isinstance(index, tuple):
        if not index:
            return prov
        index, rest = index[0], index[1:]
        if index is Ellipsis:
            named = [i for i in rest if i is not None and i is not Ellipsis]
            if Ellipsis in rest or len(named) >= len(shape):
                return None
            return prov
        if any(i is Ellipsis for i in rest) and not isinstance(index, slice):
            return None
    if index is None or isinstance(index, (int, np.integer)):
        return None  # a new leading dimension, or one row taken out of the row dimension
    if isinstance(index, slice):
        return Provenance.exact(prov.tokens[index], 0)
    if isinstance(index, torch.Tensor):
        idx = index.as_subclass(torch.Tensor) if isinstance(index, PrivateRows) else index
        if idx.dtype == torch.bool:
            if idx.dim() != 1:
                return None
            return Provenance.exact(prov.tokens[idx.detach().cpu().numpy()], 0)
        if idx.dtype.is_floating_point or idx.dim() != 1:
            return None
        return Provenance.exact(prov.tokens[idx.detach().cpu().numpy()], 0)
    if isinstance(index, (list, range)):
        try:
            return Provenance.exact(prov.tokens[np.asarray(list(index))], 0)
        except (IndexError, ValueError, TypeError):
            return None
    return None


def _dim_arg(args, kwargs, position: int, default=0):
    if "dim" in (kwargs or {}):
        return kwargs["dim"]
    if "axis" in (kwargs or {}):
        return kwargs["axis"]
    return args[position] if len(args) > position else default


def _result_provenance(name, args, kwargs, out, tracked) -> Optional[Provenance]:
    """Exact provenance of a tensor result ``out`` of ``name``, or ``None`` (mixed)."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    common = _same_rows(tracked)
    if name in _ROWWISE:
        if common is not None and out.dim() > common.dim \
                and out.shape[common.dim] == len(common.tokens):
            return common
        return None
    if common is None:
        return None
    rows = len(common.tokens)
    if name in _RESHAPE:
        if common.dim == 0 and out.shape[0] == rows:
            return common
        return None
    moved = _moved_row_dim(name, args, kwargs, common.dim, args[0].dim()
                           if isinstance(args[0], torch.Tensor) else 0)
    if moved is not None:
        return Provenance.exact(common.tokens, moved) if out.dim() > moved \
            and out.shape[moved] == rows else None
    if name in _PER_ROW_DIMS and args and isinstance(args[0], PrivateRows):
        dims = _dims_touched(name, args, kwargs, args[0].dim())
        if dims is not None and common.dim not in dims and out.dim() > common.dim \
                and out.shape[common.dim] == rows:
            return common
    return None


#: Operations that act along the dimensions they are given (``dim`` / ``dims`` / ``axis``) or,
#: for padding, interpolation, normalisation and ``x @ W``, along the trailing dimensions:
#: their rows are their input's rows when the row dimension is not among those dimensions.
_PER_ROW_DIMS = _names(
    "sum", "mean", "nansum", "nanmean", "std", "var", "amax", "amin", "max", "min", "norm",
    "logsumexp", "prod", "cumsum", "cumprod", "argmax", "argmin", "softmax", "log_softmax",
    "flip", "roll", "rot90", "normalize", "pad", "interpolate", "layer_norm", "matmul",
    "__matmul__", "mm", "linear", "unfold", "diff", "sort", "topk", "median")


def _axis(value, ndim: int):
    if isinstance(value, (list, tuple)):
        return {int(v) % ndim for v in value}
    return {int(value) % ndim}


def _dims_touched(name, args, kwargs, ndim: int) -> Optional[set]:
    """The dimensions ``name`` reduces, mixes or moves data along (``None``: unknown or all)."""
    if ndim == 0:
        return None
    if name in ("pad",):
        pad = args[1] if len(args) > 1 else kwargs.get("pad")
        return None if pad is None else set(range(ndim - len(pad) // 2, ndim))
    if name in ("interpolate",):
        return set(range(2, ndim))
    if name in ("layer_norm",):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        return None if shape is None else set(range(ndim - len(tuple(shape)), ndim))
    if name in ("matmul", "__matmul__", "mm", "linear"):
        other = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
        return None if isinstance(other, PrivateRows) or ndim < 2 else {ndim - 1}
    if name == "normalize":
        return _axis(kwargs.get("dim", args[2] if len(args) > 2 else 1), ndim)
    if name == "rot90":
        return _axis(kwargs.get("dims", args[2] if len(args) > 2 else (0, 1)), ndim)
    if name in ("flip", "roll"):
        key = "dims"
        position = 1 if name == "flip" else 2
        value = kwargs.get(key, args[position] if len(args) > position else None)
        return None if value is None else _axis(value, ndim)
    for key in ("dim", "axis"):
        if key in kwargs and kwargs[key] is not None:
            return _axis(kwargs[key], ndim)
    if len(args) > 1 and isinstance(args[1], (int, list, tuple)) and not isinstance(args[1],
                                                                                      bool):
        return _axis(args[1], ndim)
    return None  # a reduction over every dimension


def _moved_row_dim(name, args, kwargs, dim: int, ndim: int) -> Optional[int]:
    """Where the row dimension ``dim`` goes under a dimension-moving operation (``None``: not
    such an operation, or the rows cannot be followed)."""
    def arg(i, key, default=None):
        return kwargs.get(key, args[i] if len(args) > i else default)

    try:
        if name == "unsqueeze":
            d = int(arg(1, "dim"))
            d = d % (ndim + 1)
            return dim + 1 if d <= dim else dim
        if name == "squeeze":
            d = arg(1, "dim")
            if d is None:
                shape = args[0].shape
                return dim - sum(1 for i in range(dim) if shape[i] == 1)
            ds = _axis(d, ndim)
            return None if dim in ds else dim - sum(1 for i in ds if i < dim)
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = int(arg(1, "dim0")) % ndim, int(arg(2, "dim1")) % ndim
            return b if dim == a else a if dim == b else dim
        if name in ("t", "T") and ndim == 2:
            return 1 - dim
        if name == "permute":
            order = args[1:] if len(args) > 2 else arg(1, "dims")
            order = [int(o) % ndim for o in (order if isinstance(order, (list, tuple))
                                              else [order])]
            return order.index(dim)
        if name == "movedim":
            src, dst = _axis(arg(1, "source"), ndim), arg(2, "destination")
            if dim in src and len(src) == 1:
                return int(dst) % ndim
            return None
    except (TypeError, ValueError, IndexError):
        return None
    return None


def _concat_provenance(args, kwargs) -> Optional[Provenance]:
    tensors = args[0] if args else kwargs.get("tensors")
    dim = _dim_arg(args, kwargs, 1)
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    provs = [provenance_of(t) for t in tensors]
    ndim = tensors[0].dim()
    dim = dim + ndim if isinstance(dim, int) and dim < 0 else dim
    if dim == 0:
        parts = []
        for t, p in zip(tensors, provs, strict=True):
            if p is None:
                parts.append(np.full(t.shape[0] if t.dim() else 1, UNTRACKED, dtype=np.int64))
            elif not p.is_exact or p.dim != 0:
                return None
            else:
                parts.append(p.tokens)
        return Provenance.exact(np.concatenate(parts), 0)
    tracked = [t for t in tensors if isinstance(t, PrivateRows)]
    common = _same_rows(tracked)
    if common is not None and common.dim != dim:
        return common
    return None


def _split_provenances(name, args, kwargs, out) -> Optional[list]:
    prov = args[0]._rows if isinstance(args[0], PrivateRows) else None
    if prov is None or not prov.is_exact:
        return None
    dim = _dim_arg(args, kwargs, 2 if name in ("split", "tensor_split", "chunk") else 1)
    if name == "unbind":
        dim = _dim_arg(args, kwargs, 1)
    if dim != prov.dim:
        return [prov] * len(out)
    if name == "unbind":
        return None
    provs, start = [], 0
    for piece in out:
        n = piece.shape[dim]
        provs.append(Provenance.exact(prov.tokens[start:start + n], dim))
        start += n
    return provs


_EAGER_REASON = (
    "opacus_structured tracks which example each row of a private batch comes from in "
    "PrivateRows.__torch_function__, which runs outside the compiled graph at every call. With "
    "fullgraph=True Dynamo cannot leave it out: operate on the batch outside the fullgraph "
    "region (compile the model, not the code that builds its input), or compile without "
    "fullgraph=True")


class PrivateRows(torch.Tensor):
    """A ``torch.Tensor`` whose rows carry the sampler draw and position they come from (module
    docstring). It behaves as a tensor everywhere; the private model's forward receives plain
    tensors."""

    _rows: Provenance

    @classmethod
    @eager_only(_EAGER_REASON)  # outside torch.compile graphs, at every call (torch_calls.py)
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():  # torch's warnings: at the user's line
            out = call_reporting_at_caller(_TORCH_FUNCTION_CODE, func, args, kwargs)
        name = _func_name(func)
        if name in _NO_DATA or (out is None and name not in _OWN_ROWS):  # loss.backward()
            return out
        tracked = _tracked(args, kwargs)
        if not tracked:
            return out
        if name in _CONCAT:
            prov = _concat_provenance(args, kwargs)
            return _attach(out, prov, tracked, name)
        if name == "__getitem__":
            base = args[0]._rows if isinstance(args[0], PrivateRows) else None
            prov = None
            if base is not None and base.is_exact and isinstance(out, torch.Tensor):
                prov = _index_rows(base, args[1], tuple(args[0].shape))
            return _attach(out, prov, tracked, name)
        if name in _SPLIT and isinstance(out, (list, tuple)):
            provs = _split_provenances(name, args, kwargs, out)
            if provs is not None:
                return type(out)(_wrap(o, p) if isinstance(o, torch.Tensor) else o
                                 for o, p in zip(out, provs, strict=True))
        if name in _OWN_ROWS and isinstance(args[0], PrivateRows):
            others = [t for t in tracked if t is not args[0]]
            if others and _same_rows([args[0], *others]) is None:
                args[0]._rows = Provenance.mixed(_union_draws(tracked), name)
            return out
        if isinstance(out, torch.Tensor):
            prov = _result_provenance(name, args, kwargs, out, tracked)
            if out is args[0] and isinstance(args[0], PrivateRows) and name.endswith("_"):
                args[0]._rows = prov or Provenance.mixed(_union_draws(tracked), name)
                return args[0]
            return _attach(out, prov, tracked, name)
        if isinstance(out, (list, tuple)):
            mixed = Provenance.mixed(_union_draws(tracked), name)
            return type(out)(_wrap(o, mixed) if isinstance(o, torch.Tensor) else o
                             for o in out) if not hasattr(out, "_fields") else out
        return out


_TORCH_FUNCTION_CODE = PrivateRows.__torch_function__.__func__._eager_only_code


def _attach(out, prov: Optional[Provenance], tracked, name: str):
    if not isinstance(out, torch.Tensor):
        return out
    if prov is None:
        prov = Provenance.mixed(_union_draws(tracked), name)
    return _wrap(out.as_subclass(torch.Tensor) if isinstance(out, PrivateRows) else out, prov)


def describe_token(token: int) -> str:
    """``draw d, row r`` (for messages)."""
    if token == PUBLIC:
        return "a public row"
    if token == UNTRACKED:
        return "an untracked row"
    return f"draw {token >> POSITION_BITS}, row {token & (_POSITIONS - 1)}"
