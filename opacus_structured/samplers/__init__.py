"""samplers subpackage (see docs/architecture.md): one torch batch sampler per scheme.

Import a sampler from its module (``opacus_structured.samplers.poisson`` …); the distributed
wrapper is re-exported here because it applies to all of them, and so is
:class:`~.verification.SamplerParametersChangedError`, which every sampler raises when a
parameter of its law changed after it was built. Every module is imported, so each registers
its sampler for its scheme (``scheme.sampler(...)`` finds it).
"""

from .._discovery import import_submodules
from .distributed import DistributedBatchSampler, distributed_data_loader
from .verification import SamplerParametersChangedError

import_submodules(__name__)

__all__ = ["DistributedBatchSampler", "distributed_data_loader", "SamplerParametersChangedError"]
