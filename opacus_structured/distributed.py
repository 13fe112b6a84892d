"""Small ``torch.distributed`` helpers shared by the distributed sampler, optimizer and callbacks.

Everything here is a no-op (or the identity) when ``torch.distributed`` is not initialised or the
world has one process, so single-process code paths stay unchanged. Collectives are plain
``torch.distributed`` calls (gloo on CPU, nccl on GPU); every rank must call them in the same
order, as with any collective.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ._validation import check_int

__all__ = ["is_distributed", "world_info", "broadcast_object", "all_reduce_sum",
           "all_gather_cat"]


def is_distributed() -> bool:
    """``True`` when ``torch.distributed`` is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_info(num_replicas: Optional[int] = None, rank: Optional[int] = None
               ) -> tuple[int, int]:
    """``(num_replicas, rank)``, defaulting to the initialised process group.

    Raises ``ValueError`` if a value is missing and ``torch.distributed`` is not initialised,
    or if ``rank`` is not in ``[0, num_replicas)``.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        if not initialised:
            raise ValueError("num_replicas is required when torch.distributed is not "
                             "initialised (call init_process_group first or pass it)")
        num_replicas = dist.get_world_size()
    if rank is None:
        if not initialised:
            raise ValueError("rank is required when torch.distributed is not initialised "
                             "(call init_process_group first or pass it)")
        rank = dist.get_rank()
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=num_replicas - 1)
    return num_replicas, rank


def _device() -> torch.device:
    """Device collectives must use: CUDA for nccl, CPU otherwise."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (identity without a process group)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device())
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor holding the element-wise sum of ``tensor`` over all ranks (a copy alone)."""
    out = tensor.detach().clone()
    if not is_distributed():
        return out
    dev = _device()
    work = out.to(dev)
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def all_gather_cat(tensor: torch.Tensor, *, return_lengths: bool = False):
    """Concatenation (rank 0 first) of the 1-d ``tensor`` of every rank; lengths may differ.

    Ranks exchange lengths first, pad to the longest and strip the padding, so empty shards
    are fine. The result is on ``tensor``'s device and identical on every rank; with
    ``return_lengths`` also the list of per-rank lengths.
    """
    if tensor.ndim != 1:
        raise ValueError(f"all_gather_cat needs a 1-d tensor, got shape {tuple(tensor.shape)}")
    if not is_distributed():
        return (tensor.clone(), [tensor.numel()]) if return_lengths else tensor.clone()
    dev = _device()
    world = dist.get_world_size()
    n = torch.tensor([tensor.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    lengths = [int(s.item()) for s in sizes]
    longest = max(max(lengths), 1)
    padded = torch.zeros(longest, dtype=tensor.dtype, device=dev)
    padded[:tensor.numel()] = tensor.to(dev)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.cat([p[:k] for p, k in zip(parts, lengths, strict=True)]).to(tensor.device)
    return (out, lengths) if return_lengths else out
