"""DP-SGD with several processes: one global Poisson batch per step, split across ranks.

Run with ``torchrun --nproc_per_node=2 examples/ddp_training.py`` (any backend: nccl if CUDA is
available, gloo otherwise) or plainly ``python examples/ddp_training.py``, which spawns 2 gloo CPU
processes. ``--bands 4`` switches to correlated (BandMF) noise with the cyclic Poisson sampler and
its matrix-mechanism accountant. Rank 0 prints ε; every rank's accountant is identical.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset


def train(args) -> None:
    from opacus import GradSampleModule
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.optimizers import DistributedDPOptimizer

    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.optim.distributed import DistributedCorrelatedNoiseDPOptimizer
    from opacus_structured.optim.strategies import banded_toeplitz_coefficients
    from opacus_structured.samplers.cyclic_poisson import CyclicPoissonBatchSampler
    from opacus_structured.samplers.distributed import (
        DistributedBatchSampler,
        distributed_data_loader,
    )
    from opacus_structured.samplers.poisson import PoissonBatchSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if (
        dist.get_backend() == "nccl") else torch.device("cpu")
    g = torch.Generator().manual_seed(0)  # same synthetic data on every rank
    X = torch.randn(args.n, 10, generator=g)
    y = (X @ torch.randn(10, 1, generator=g) > 0).float()
    data = TensorDataset(X, y)

    if args.bands > 1:
        global_sampler = CyclicPoissonBatchSampler(args.n, args.batch_size, args.bands,
                                                   seed=args.seed)
    else:
        global_sampler = PoissonBatchSampler(args.n, args.batch_size / args.n, seed=args.seed)
    sampler = DistributedBatchSampler(global_sampler)  # broadcasts rank 0's sampler state
    loader = distributed_data_loader(data, sampler)

    torch.manual_seed(args.seed)
    model = GradSampleModule(DPDDP(torch.nn.Linear(10, 1).to(device)))
    kwargs = dict(noise_multiplier=args.sigma, max_grad_norm=1.0,
                  expected_batch_size=sampler.local_expected_batch_size,
                  generator=torch.Generator(device=device).manual_seed(args.seed + 1))
    base = torch.optim.SGD(model.parameters(), lr=args.lr)
    steps = args.epochs * len(sampler)
    if args.bands > 1:
        opt = DistributedCorrelatedNoiseDPOptimizer(
            base, noise_correlation=banded_toeplitz_coefficients(steps, args.bands), **kwargs)
    else:
        opt = DistributedDPOptimizer(base, **kwargs)
    accountant = SchemeAccountant(sampler.scheme)
    opt.attach_step_hook(lambda o: accountant.step(noise_multiplier=o.noise_multiplier,
                                                   sample_rate=sampler.scheme
                                                   .expected_sample_rate() or 1 / len(sampler)))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        for xb, yb in loader:  # this rank's shard (possibly empty)
            opt.zero_grad()
            loss_fn(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
        if rank == 0:
            eps = accountant.get_epsilon(args.delta, discretization=1e-3)
            print(f"epoch {epoch + 1}: {len(accountant)} steps, ε({args.delta:g}) = {eps:.3f} "
                  f"({world} processes, {sampler.scheme.name})")


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=2000, help="synthetic training examples")
    p.add_argument("--batch-size", type=float, default=100.0,
                   help="expected global batch size (Poisson rate q = batch size / n)")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier σ")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--epochs", type=int, default=2, help="training epochs")
    p.add_argument("--bands", type=int, default=1,
                   help="1: independent noise, Poisson; > 1: BandMF with cyclic Poisson")
    p.add_argument("--delta", type=float, default=1e-5, help="δ at which ε is reported")
    p.add_argument("--seed", type=int, default=0, help="data and model seed")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun")
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
