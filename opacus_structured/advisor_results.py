"""The scheme advisor's results: the setting it was asked about (:class:`AdvisorSetting`), one
row per scheme (:class:`AdvisorRow`), the ranked table (:class:`Advice`) and its text / JSON forms
(split out of :mod:`opacus_structured.advisor`, which computes them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ._validation import check_int, check_open_unit, check_positive

SCHEMA_ID = "opacus-structured/advise/1"
UTILITY_PROXY = ("prefix_sum_rmse = sigma / E[batch] * sqrt(||A C^-1||_F^2 / T) per unit "
                 "clipping norm (for independent noise C = I: noise_std * sqrt((T+1)/2), "
                 "noise_std = sigma / E[batch]); lower is better")
#: Relative ε slack of the suggested truncated-Poisson max batch size (vs. Poisson, same σ).
TRUNCATION_SLACK = 0.01
#: Wall-clock seconds shared by the random-allocation-MF rows (child processes). 60: the issue-41
#: setting needs ~7 s idle for bands 4 and 16 and ~20 s for 1, 4, 16 and 64, and the budget is
#: wall time, so a loaded machine (load 5 on 2 cores) must not skip them.
DEFAULT_TIME_BUDGET = 60.0
_CURVE_FACTORS = (0.6, 0.75, 0.9, 1.0, 1.15, 1.35, 1.7, 2.2)
#: B_max / ceil(N·q) of the truncated-Poisson ε-against-B_max line (plus the chosen B_max).
_MAX_BATCH_FACTORS = (1.0, 1.25, 1.5, 2.0)


# ---- data ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdvisorSetting:
    """The setting every scheme is calibrated for (validated)."""

    dataset_size: int
    batch_size: float
    steps: int
    target_epsilon: float
    delta: float
    bands: tuple[int, ...] = ()
    max_batch_size: Optional[int] = None
    discretization: float = 1e-3

    def __post_init__(self):
        n = check_int("dataset_size", self.dataset_size, minimum=1)
        object.__setattr__(self, "dataset_size", n)
        b = check_positive("batch_size", self.batch_size)
        if b > n:
            raise ValueError(f"batch_size must be in (0, dataset_size={n}], got {b}")
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=1))
        object.__setattr__(self, "target_epsilon",
                           check_positive("target_epsilon", self.target_epsilon))
        object.__setattr__(self, "delta", check_open_unit("delta", self.delta))
        object.__setattr__(self, "bands", tuple(sorted({check_int("bands", x, minimum=1)
                                                        for x in self.bands})))
        if self.max_batch_size is not None:
            object.__setattr__(self, "max_batch_size", check_int(
                "max_batch_size", self.max_batch_size, minimum=1, maximum=n))
        object.__setattr__(self, "discretization",
                           check_positive("discretization", self.discretization))

    @property
    def steps_per_epoch(self) -> int:
        """k = round(N/B) (at least 1): batches per epoch of the epoch-based schemes."""
        return max(1, round(self.dataset_size / self.batch_size))

    @property
    def epochs(self) -> int:
        """E = ceil(T/k): planned epochs of the schemes that price a whole run."""
        return -(-self.steps // self.steps_per_epoch)

    @property
    def sample_rate(self) -> float:
        """q = B/N of the Poisson schemes."""
        return self.batch_size / self.dataset_size


@dataclasses.dataclass(frozen=True)
class AdvisorRow:
    """One scheme of the table (a frozen record; :meth:`to_dict` is its JSON form).

    ``noise_multiplier`` is ``None`` when the scheme was not calibrated (Monte Carlo only,
    skipped, or infeasible); ``note`` says why. ``rank`` is ``None`` for rows that are not
    certified guarantees or were not calibrated.
    """

    scheme: str
    label: str
    noise: str                        # "independent" or "correlated"
    bound: str                        # "tight", "upper", "monte-carlo"
    certified: bool
    bands: int
    steps: int
    expected_batch_size: float
    noise_multiplier: Optional[float]
    epsilon: Optional[float]
    noise_std: Optional[float]
    prefix_sum_rmse: Optional[float]
    rank: Optional[int]
    note: str
    seconds: float
    parameters: tuple = ()
    curve: tuple = ()                 # ((epsilon, noise_multiplier, prefix_sum_rmse), ...)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["parameters"] = dict(self.parameters)
        out["curve"] = [list(p) for p in self.curve]
        return out


@dataclasses.dataclass(frozen=True)
class Advice:
    """The advisor's answer: the setting and the table (``rows``, ranked rows first)."""

    setting: AdvisorSetting
    rows: tuple[AdvisorRow, ...]
    seconds: float

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def row(self, scheme: str, bands: Optional[int] = None) -> AdvisorRow:
        """The row of ``scheme`` (and ``bands`` for the matrix mechanisms)."""
        for r in self.rows:
            if r.scheme == scheme and (bands is None or r.bands == bands):
                return r
        raise KeyError(f"no row for scheme {scheme!r}" + ("" if bands is None else
                                                          f" with bands={bands}"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (:data:`JSON_SCHEMA`)."""
        s = self.setting
        return {"schema": SCHEMA_ID, "utility_proxy": UTILITY_PROXY,
                "setting": {**dataclasses.asdict(s), "bands": list(s.bands),
                            "steps_per_epoch": s.steps_per_epoch, "epochs": s.epochs,
                            "sample_rate": s.sample_rate},
                "seconds": self.seconds, "rows": [r.to_dict() for r in self.rows]}

    def format_table(self) -> str:
        """A plain-text table (what ``opacus-structured advise`` prints)."""
        s = self.setting
        head = (f"N = {s.dataset_size}, B = {s.batch_size:g}, T = {s.steps} steps "
                f"(k = {s.steps_per_epoch} steps/epoch, E = {s.epochs} epochs), target "
                f"epsilon = {s.target_epsilon:g}, delta = {s.delta:g}; discretization "
                f"{s.discretization:g} (pessimistic)\nranked by prefix_sum_rmse = "
                f"sigma/E[batch] * sqrt(||A C^-1||_F^2 / T) (independent noise: noise_std "
                f"sigma/E[batch] times sqrt((T+1)/2)); lower is better")
        cols = ("rank", "scheme", "bound", "sigma", "epsilon", "E[batch]", "noise_std",
                "prefix_rmse", "note")
        lines = [head, "  ".join(f"{c:>{w}}" for c, w in zip(cols, _WIDTHS, strict=False))]
        for r in self.rows:
            cells = (str(r.rank) if r.rank else "-", r.label, r.bound, _fmt(r.noise_multiplier),
                     _fmt(r.epsilon), f"{r.expected_batch_size:.5g}", _fmt(r.noise_std),
                     _fmt(r.prefix_sum_rmse), r.note)
            lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS, strict=False)))
        for r in self.rows:
            by_b = dict(r.parameters).get("epsilon_by_max_batch_size")
            if by_b:
                chosen = dict(r.parameters).get("max_batch_size")
                pts = ", ".join(f"{b}{' (chosen)' if b == chosen else ''}: {e:.4g}"
                                for b, e in by_b["points"])
                lines.append(f"{r.label}: epsilon against B_max at Poisson's sigma = "
                             f"{by_b['noise_multiplier']:.4g} (Poisson: "
                             f"{by_b['poisson_epsilon']:.4g}): {pts}")
        return "\n".join(lines)


_WIDTHS = (4, 32, 11, 9, 8, 9, 10, 11, 0)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


#: JSON schema (draft 2020-12) of :meth:`Advice.to_dict` / ``opacus-structured advise --json``.
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "opacus-structured advise",
    "type": "object",
    "required": ["schema", "utility_proxy", "setting", "seconds", "rows"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "utility_proxy": {"type": "string"},
        "seconds": {"type": "number", "minimum": 0},
        "setting": {
            "type": "object",
            "required": ["dataset_size", "batch_size", "steps", "target_epsilon", "delta",
                         "bands", "max_batch_size", "discretization", "steps_per_epoch",
                         "epochs", "sample_rate"],
            "properties": {
                "dataset_size": {"type": "integer", "minimum": 1},
                "batch_size": {"type": "number", "exclusiveMinimum": 0},
                "steps": {"type": "integer", "minimum": 1},
                "target_epsilon": {"type": "number", "exclusiveMinimum": 0},
                "delta": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "bands": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "max_batch_size": {"type": ["integer", "null"]},
                "discretization": {"type": "number", "exclusiveMinimum": 0},
                "steps_per_epoch": {"type": "integer", "minimum": 1},
                "epochs": {"type": "integer", "minimum": 1},
                "sample_rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            },
        },
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["scheme", "label", "noise", "bound", "certified", "bands", "steps",
                             "expected_batch_size", "noise_multiplier", "epsilon", "noise_std",
                             "prefix_sum_rmse", "rank", "note", "seconds", "parameters",
                             "curve"],
                "properties": {
                    "scheme": {"enum": ["poisson", "truncated-poisson", "balls-in-bins",
                                        "shuffle", "bandmf-cyclic-poisson",
                                        "random-allocation-mf", "bminsep-mc", "gdp"]},
                    "label": {"type": "string"},
                    "noise": {"enum": ["independent", "correlated"]},
                    "bound": {"enum": ["tight", "upper", "monte-carlo"]},
                    "certified": {"type": "boolean"},
                    "bands": {"type": "integer", "minimum": 1},
                    "steps": {"type": "integer", "minimum": 1},
                    "expected_batch_size": {"type": "number", "exclusiveMinimum": 0},
                    "noise_multiplier": {"type": ["number", "null"]},
                    "epsilon": {"type": ["number", "null"]},
                    "noise_std": {"type": ["number", "null"]},
                    "prefix_sum_rmse": {"type": ["number", "null"]},
                    "rank": {"type": ["integer", "null"], "minimum": 1},
                    "note": {"type": "string"},
                    "seconds": {"type": "number", "minimum": 0},
                    "parameters": {"type": "object"},
                    "curve": {"type": "array",
                              "items": {"type": "array", "minItems": 3, "maxItems": 3,
                                        "items": {"type": "number"}}},
                },
            },
        },
    },
}
