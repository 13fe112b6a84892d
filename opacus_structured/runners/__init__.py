"""Runners: how a computation runs — processes, devices, files — above the math it runs.

:mod:`opacus_structured.accounting` is pure math in one process (numpy / scipy, no torch). A
runner executes it at scale: :mod:`.monte_carlo` draws Monte Carlo privacy-loss samples in
seed-addressed shards over a process pool or a torch device, saves and resumes them on disk,
shows progress, holds a run's settings (:class:`~.monte_carlo.MonteCarloSettings`) and runs
Algorithm 5; :mod:`.bminsep_mc_torch` is the torch backend of the b-min-sep sampler. A scheme
priced by Monte Carlo finds its runner through :mod:`opacus_structured.schemes.registry`
(``register_runner``), so the description never imports this layer; it sits with the samplers
(torch, above the schemes it runs).
"""

from . import monte_carlo  # noqa: E402,F401  (registers the Monte Carlo runner)
