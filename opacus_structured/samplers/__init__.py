"""samplers subpackage (see docs/architecture.md): one torch batch sampler per scheme.

Import a sampler from its module (``opacus_structured.samplers.poisson`` …); the distributed
wrapper is re-exported here because it applies to all of them.
"""

from .distributed import DistributedBatchSampler, distributed_data_loader

__all__ = ["DistributedBatchSampler", "distributed_data_loader"]
