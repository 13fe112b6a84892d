"""Regenerates the PNGs of docs/guides/random_allocation_mf.md (a few CPU minutes).

    python docs/guides/random_allocation_mf_plots.py
"""
import pathlib

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from opacus_structured.accounting import conditional_composition as cc  # noqa: E402
from opacus_structured.accounting import random_allocation_mf as ra  # noqa: E402
from opacus_structured.schemes.poisson import PoissonScheme  # noqa: E402

HERE = pathlib.Path(__file__).parent
DELTA = 1e-5

# (1) epsilon vs sigma, DP-SGD, N = b = 100, k = 1
m = ra.mixture_means(np.eye(100), 1, 100)
sigmas = [0.8, 1.0, 1.5, 2.0, 3.0]
ren = [ra.renyi_accountant(means=m, noise_multiplier=s, orders=np.arange(2, 81)).epsilon(DELTA)
       for s in sigmas]
ccs = [cc.conditional_composition_epsilon(m, s, DELTA, discretization=1e-3) for s in sigmas]
poi = [PoissonScheme(sample_rate=0.01).epsilon(s, 100, DELTA, discretization=1e-3)
       for s in sigmas]
mc = [ra.monte_carlo_epsilon_estimate(m, s, DELTA, samples=400_000, seed=0)["epsilon"]
      for s in sigmas]
fig, ax = plt.subplots(figsize=(5, 3.4))
ax.plot(sigmas, ren, "o-", label="Rényi DP (Alg. 1–3)")
ax.plot(sigmas, ccs, "s-", label="conditional composition (Alg. 4)")
ax.plot(sigmas, np.minimum(ren, ccs), "k--", lw=1, label="best of both")
ax.plot(sigmas, mc, "x:", label="Monte Carlo (estimate only)")
ax.plot(sigmas, poi, "^-", alpha=.6, label="Poisson q=1/b (other scheme)")
ax.set(xlabel="noise multiplier σ", ylabel="ε at δ=1e-5", yscale="log",
       title="DP-SGD, random allocation, N=b=100, k=1")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "random_allocation_mf_eps_vs_sigma.png", dpi=90)

# (2) epsilon vs epochs (b = 100, sigma = 3): DP-SGD and BSR(p=4), Rényi; Poisson for reference
ks = [1, 2, 4, 6, 8, 10]
bsr_c = np.array([1.0, 0.5, 0.375, 0.3125])
fig, ax = plt.subplots(figsize=(5, 3.4))
for name, mk in [("DP-SGD", None), ("BSR p=4", bsr_c)]:
    eps = []
    for k in ks:
        N = 100 * k
        if mk is None:
            C = np.eye(N)
        else:
            C = sum(np.diag(np.full(N - j, mk[j]), -j) for j in range(4))
        rb = ra.renyi_accountant(C, k, 100, 3.0, orders=np.arange(2, 9 if mk is not None else 81))
        eps.append(rb.epsilon(DELTA))
    ax.plot(ks, eps, "o-", label=f"{name}, Rényi")
ax.plot(ks, [PoissonScheme(sample_rate=0.01).epsilon(3.0, 100 * k, DELTA, discretization=1e-3)
             for k in ks], "^-", alpha=.6, label="DP-SGD Poisson q=1/b")
ax.set(xlabel="epochs k (same bins every epoch)", ylabel="ε at δ=1e-5",
       title="b=100 batches per epoch, σ=3")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "random_allocation_mf_eps_vs_epochs.png", dpi=90)
print("eps_vs_sigma", dict(zip(sigmas, zip(ren, ccs, mc, poi))))
