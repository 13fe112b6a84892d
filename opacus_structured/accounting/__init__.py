"""Pure privacy-accounting math (numpy, scipy, dp_accounting; no torch).

Layers, bottom up: :mod:`.gaussian` (closed forms, μ-GDP), :mod:`.mixture` (dominating pairs
as Gaussian mixtures, exact hockey-stick divergences), :mod:`.profiles` (privacy profiles built
from pairs), :mod:`.pld` (pessimistic PLDs on dp_accounting, composition, ε/δ),
:mod:`.calibration` (noise calibration). Scheme-specific theorems live in their own modules.
"""

from .calibration import CalibrationError, calibrate_noise_multiplier
from .gaussian import gaussian_delta, gaussian_epsilon, gdp_delta, gdp_epsilon, gdp_mu
from .mixture import GaussianMixture, MixturePair
from .pld import (
    DEFAULT_DISCRETIZATION,
    compose,
    delta_for_epsilon,
    epsilon_for_delta,
    pld_from_profile,
    privacy_profile_curve,
    self_compose,
)
from .profiles import (
    PERFECT_PRIVACY,
    PairProfile,
    PerfectPrivacyProfile,
    PrivacyProfile,
    SwitchingProfile,
    WeightedProfile,
)

__all__ = [
    "CalibrationError",
    "calibrate_noise_multiplier",
    "gaussian_delta",
    "gaussian_epsilon",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "GaussianMixture",
    "MixturePair",
    "DEFAULT_DISCRETIZATION",
    "compose",
    "delta_for_epsilon",
    "epsilon_for_delta",
    "pld_from_profile",
    "privacy_profile_curve",
    "self_compose",
    "PERFECT_PRIVACY",
    "PairProfile",
    "PerfectPrivacyProfile",
    "PrivacyProfile",
    "SwitchingProfile",
    "WeightedProfile",
]
