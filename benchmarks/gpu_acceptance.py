"""Run every GPU acceptance check of issues 4, 5, 6, 8, 9 and 10 with one command.

Usage (on a machine with an NVIDIA GPU; no install needed, the repo root is put on the path)::

    python benchmarks/gpu_acceptance.py --out gpu-acceptance            # the issues' settings
    python benchmarks/gpu_acceptance.py --out gpu-acceptance --quick    # ~8 min on an H100
    python benchmarks/gpu_acceptance.py --out DIR --only 5 10           # some issues only
    python benchmarks/gpu_acceptance.py --out DIR --allow-cpu           # smoke test, no GPU

What it runs (each as a subprocess, ``sys.executable``, cwd = repo root, with a per-check
timeout) and the target each result is judged against:

========  ======================  ==========================================================
issue     check                   target
========  ======================  ==========================================================
4         ``forecast_deepar``     ``opacus-structured forecast --model deepar --epsilon 1
                                  --delta 1e-7 --device cuda`` (with its baselines): DP
                                  CRPS < seasonal-naive CRPS, and DP CRPS ≤ 1.25 ×
                                  non-private CRPS (realised ε ≤ 1 at δ = 1e-7).
5         ``correlated_noise``    ``benchmarks/correlated_noise.py`` (~10M-param MLP,
                                  b ∈ {1, 8, 64}): full-step time of BandMF b = 64 ≤ 1.10 ×
                                  stock ``DPOptimizer``. ``add_noise()`` alone is reported.
6, 18     ``bminsep_mc``          ``benchmarks/bminsep_mc.py --device cuda``: our CUDA
                                  samples/s beside jax_privacy's on the same GPU (reported,
                                  no numeric target); issue 18's CPU target, ours ≥ 10 ×
                                  jax_privacy on one core, judged at b = 4 (needs the
                                  ``jax-privacy`` wheel, the ``[peers]`` extra).
8         ``per_sample_tracking`` ``benchmarks/per_sample_tracking.py`` (10⁶ tracked
                                  examples): step-time overhead of the per-sample ε tracker
                                  and of the individual GDP filter each ≤ 3 % of a plain
                                  DP-SGD step (``both`` and ``tracker+pld`` are reported);
                                  issue 39: the release-row record (``rows``) ≤ 3 % too.
9         ``distributed_one_gpu`` the CUDA-marked DDP test of ``tests/test_distributed.py``
                                  with two gloo ranks sharing one GPU (correlated noise;
                                  parameters equal the single-process CUDA run).
9         ``distributed_nccl``    the CUDA-marked NCCL test of ``tests/test_distributed.py``;
                                  needs 2 GPUs, else "skipped: 1 GPU".
10        ``dp_lstm``             ``benchmarks/dp_lstm.py --device cuda``: FastDPLSTM DP-SGD
                                  (hooks, native) and (ghost, native) step ≤ 5 × the
                                  non-private cuDNN ``nn.LSTM`` step (row 0), batch 256.
10        ``bookkeeping``         ``benchmarks/bookkeeping.py --model seq``: book-keeping
                                  ghost clipping vs Opacus ghost / hooks (reported).
10        ``forecast_lstm_impl``  the DP forecasting main job (DeepAR, ε = 1, fixed
                                  ``--max-steps``) with ``--lstm-impl opacus`` vs ``fast``:
                                  training wall time ratio opacus / fast ≥ 5.
all       ``cuda_tests``          ``python -m pytest -q -m cuda tests``: no failure.
========  ======================  ==========================================================

Output in ``--out DIR``: ``<check>.log`` (stdout + stderr of the subprocesses), ``<check>.json``
(the script's own JSON; for ``forecast_lstm_impl`` ``{"fast": report, "opacus": report}``; for
the pytest checks the parsed counts), and ``summary.json`` (settings, machine, every row;
rewritten after each check, so a run killed from outside keeps what it measured). ``--budget S``
caps the whole run (default 540 s with ``--quick``): each check gets at most what is left, and
checks that cannot start are ERROR rows ("not run").

Reading the table: one row per target — issue, check, measured value, target, status:

* ``PASS`` / ``FAIL``: measured on a GPU, target met / not met;
* ``REPORT``: a figure the issue asks to report, with no pass/fail target;
* ``SKIP``: could not run here (e.g. the 2-GPU test on one GPU);
* ``ERROR``: the check crashed, timed out or wrote no usable JSON (see ``<check>.log``);
* ``CPU (not the target)``: a GPU target measured on a CPU (``--allow-cpu``) — never PASS.

Without CUDA the runner refuses (exit 2) unless ``--allow-cpu``, which runs everything on the
CPU with tiny settings (< 2 minutes on 2 cores) to test the runner itself. Exit status: 0 when
no row is FAIL or ERROR, 1 otherwise. The verdicts are pure functions of the JSON
(``evaluate(check_name, data)``), unit-tested in ``tests/test_gpu_acceptance.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PASS, FAIL, REPORT, SKIP, ERROR, CPU = "PASS", "FAIL", "REPORT", "SKIP", "ERROR", "CPU"
#: How each status is printed in the table.
STATUS_TEXT = {CPU: "CPU (not the target)"}
MODES = ("full", "quick", "cpu")
#: Default total budget per mode (s): --quick must fit a 10-minute device command.
DEFAULT_BUDGET = {"quick": 540.0}

# Targets (issue text).
CRPS_WITHIN = 0.25          # issue 4: DP CRPS within 25 % of non-private
FORECAST_EPSILON = 1.0      # issue 4: ε = 1 ...
FORECAST_DELTA = 1e-7       # ... at δ = 1e-7
BANDMF_RATIO = 1.10         # issue 5: b = 64 step ≤ 1.10 × stock
BANDMF_BANDS = 64
MC_CPU_SPEEDUP = 10.0       # issue 18 (CPU): ours ≥ 10 × jax_privacy on one core
MC_JUDGED_BANDS = 4         # issue 18: judged at b = 4 (b = 64 is FMA-bound on one core)
MC_ISSUE_N = 1000           # issue 18 benchmark setting (n ≥ 1000)
TRACKING_OVERHEAD_PCT = 3.0  # issue 8: ≤ 3 % of a DP-SGD step
TRACKING_EXAMPLES = 10**6
LSTM_RATIO = 5.0            # issue 10: FastDPLSTM DP-SGD ≤ 5 × cuDNN non-private
LSTM_JOB_SPEEDUP = 5.0      # issue 10: main job ≥ 5 × faster than with opacus DPLSTM

# ``python -m opacus_structured.cli`` would register the sub-commands on a second copy of the
# module (``__main__``), so the CLI is started through its ``main`` function.
CLI = [sys.executable, "-c",
       "import sys; from opacus_structured.cli import main; sys.exit(main(sys.argv[1:]))"]


@dataclass
class Result:
    """One row of the table: a measured value judged against one target."""

    issue: str
    check: str
    what: str
    measured: str
    target: str
    status: str
    note: str = ""

    @property
    def status_text(self) -> str:
        return STATUS_TEXT.get(self.status, self.status)


@dataclass
class Step:
    """One subprocess of a check: its command and where its JSON lands (None: parsed log)."""

    key: str
    cmd: list
    json_path: str | None


@dataclass
class Check:
    name: str
    issue: str
    title: str
    timeouts: dict = field(default_factory=dict)  # mode -> seconds


# ---- helpers for the pure evaluation ----------------------------------------------------------
def _num(x):
    """float(x) for finite numbers (or numeric strings); None for anything else, including the
    "inf"/"nan" strings the CLI writes: no target is judged on a non-finite value."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _on_cuda(device) -> bool:
    """Whether a script's ``device`` field names a GPU ("cuda", "cuda:0", "cuda (NVIDIA …)",
    or the GPU name that ``per_sample_tracking.py`` writes) rather than the CPU."""
    if not isinstance(device, str) or not device.strip():
        return False
    d = device.strip().lower()
    return not d.startswith("cpu")


def _judge(value, ok, on_cuda: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ERROR
    if not on_cuda:
        return CPU
    return PASS if ok else FAIL


def _fmt(x, spec=".4g", unit=""):
    v = _num(x)
    return "-" if v is None else f"{format(v, spec)}{unit}"


def _err(issue, check, what, target, note) -> Result:
    return Result(issue, check, what, "-", target, ERROR, note)


# ---- evaluation: one pure function per check --------------------------------------------------
def eval_forecast_deepar(data: dict) -> list[Result]:
    """Issue 4 from the ``forecast`` report.json (``baselines.seasonal_naive``/``non_private``)."""
    iss, chk = "4", "forecast_deepar"
    t_naive = "DP CRPS < seasonal naive"
    t_np = f"DP CRPS ≤ {1 + CRPS_WITHIN:.2f} × non-private"
    crps = _num(data.get("crps"))
    base = data.get("baselines") or {}
    naive = _num((base.get("seasonal_naive") or {}).get("crps"))
    nonp = _num((base.get("non_private") or {}).get("crps"))
    eps, delta = _num(data.get("epsilon")), _num(data.get("delta"))
    if not data.get("private") or eps is None or delta is None:
        return [_err(iss, chk, "DeepAR at ε = 1", t_naive, "report is not a private run")]
    if eps > FORECAST_EPSILON * (1 + 1e-9) or delta > FORECAST_DELTA * (1 + 1e-9):
        note = f"run at ε = {eps:.4g}, δ = {delta:g}: not the issue's ε ≤ 1, δ = 1e-7"
        return [_err(iss, chk, "DeepAR at ε = 1", t_naive, note),
                _err(iss, chk, "DeepAR at ε = 1", t_np, note)]
    cuda = _on_cuda(data.get("device"))
    note = f"ε = {eps:.4g}, δ = {delta:g}, {data.get('steps')} steps"
    out = []
    if naive is None or crps is None:
        out.append(_err(iss, chk, "CRPS vs seasonal naive", t_naive, "no seasonal-naive CRPS"))
    else:
        out.append(Result(iss, chk, "CRPS vs seasonal naive",
                          f"{crps:.4f} vs {naive:.4f}", t_naive,
                          _judge(crps, crps < naive, cuda), note))
    if nonp is None or crps is None or nonp <= 0:
        out.append(_err(iss, chk, "CRPS vs non-private", t_np, "no non-private CRPS"))
    else:
        out.append(Result(iss, chk, "CRPS vs non-private",
                          f"{crps:.4f} vs {nonp:.4f} ({crps / nonp:.3f}×)", t_np,
                          _judge(crps, crps <= (1 + CRPS_WITHIN) * nonp, cuda), note))
    return out


def eval_correlated_noise(data: dict) -> list[Result]:
    """Issue 5 from ``correlated_noise.py --json`` (rows of kind full_step / add_noise)."""
    iss, chk = "5", "correlated_noise"
    target = f"b = {BANDMF_BANDS} step ≤ {BANDMF_RATIO:.2f} × stock"
    rows = data.get("rows") or []
    cuda = _on_cuda(data.get("device"))

    def find(kind, bands):
        return next((r for r in rows if r.get("kind") == kind and r.get("bands") == bands),
                    None)

    full, stock = find("full_step", BANDMF_BANDS), find("full_step", None)
    if full is None or stock is None:
        return [_err(iss, chk, "full step", target, f"no full_step rows for stock and "
                     f"b = {BANDMF_BANDS}")]
    ratio = _num(full.get("ratio"))
    params = full.get("params")
    note = f"{params:,} params" if isinstance(params, int) else ""
    if isinstance(params, int) and params < 5_000_000:
        note += " (issue: ~10M)"
    out = [Result(iss, chk, "full step (fwd+bwd+clip+noise)",
                  f"{_fmt(full.get('ms'), '.2f')} vs {_fmt(stock.get('ms'), '.2f')} ms "
                  f"({_fmt(ratio, '.3f')}×)", target,
                  _judge(ratio, ratio is not None and ratio <= BANDMF_RATIO, cuda), note)]
    noise = find("add_noise", BANDMF_BANDS)
    if noise is not None:
        out.append(Result(iss, chk, "add_noise() alone", f"{_fmt(noise.get('ratio'), '.2f')}× "
                          f"stock, state {_fmt(noise.get('state_mib'), '.0f')} MiB", "report",
                          ERROR if _num(noise.get("ratio")) is None else REPORT if cuda else CPU))
    bw = next((r for r in rows if r.get("kind") == "bandwidth" and r.get("variant") == "ring"
               and r.get("bands") == BANDMF_BANDS), None)
    if bw is not None:  # issue 32: the ring's add_noise() against the same run's triad
        frac = _num(bw.get("frac_triad"))
        out.append(Result("32", chk, "add_noise() bandwidth (ring)",
                          f"{_fmt(bw.get('gbs'), '.1f')} GB/s = {_fmt(frac, '.0%')} of triad "
                          f"[{_fmt(bw.get('frac_min'), '.0%')}–{_fmt(bw.get('frac_max'), '.0%')}]",
                          "≥ 60 % of triad (CPU target)",
                          ERROR if frac is None else REPORT if cuda else CPU,
                          f"{_fmt(bw.get('bytes_per_step', 0) / 1e6, '.0f')} MB/step"))
    return out


def eval_bminsep_mc(data: dict) -> list[Result]:
    """Issues 6 and 18 from ``bminsep_mc.py --json PATH`` (``rows``, one per (b, n)): our
    CUDA samples/s beside jax_privacy's on the same GPU (reported), and our one-core CPU
    samples/s against jax_privacy's on one core, judged at ``b = 4``, ``n ≥ 1000`` (issue 18's
    ≥ 10×; ``b = 64`` is bounded by the core's FMA peak, docs/benchmarks.md: reported)."""
    iss, chk = "6", "bminsep_mc"
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return [_err(iss, chk, "b-min-sep Monte Carlo", "-", "no rows")]
    out = []
    cuda_rows = [r for r in rows if _num(r.get("cuda_samples_per_s")) is not None]
    if data.get("device") != "cuda" or not cuda_rows:
        out.append(Result(iss, chk, "CUDA samples/s", "-", "report (no numeric target)", CPU,
                          "no CUDA device: the CUDA figure was not measured"))
    for r in cuda_rows:
        gpu = _num(r.get("jax_privacy_gpu_samples_per_s"))
        vs = (f" ({r['cuda_samples_per_s'] / gpu:.1f}× jax_privacy GPU {gpu:,.0f}/s)"
              if gpu else " (jax_privacy: no GPU backend)")
        out.append(Result(iss, chk, f"CUDA samples/s, b = {r.get('b')}, n = {r.get('n')}",
                          f"{r['cuda_samples_per_s']:,.0f}/s{vs}", "report (no numeric target)",
                          REPORT, str(r.get("cuda_device", ""))))
    target = f"ours ≥ {MC_CPU_SPEEDUP:g} × jax_privacy, one core, b = 4"
    for r in rows:
        ours, ref = _num(r.get("ours_samples_per_s")), _num(r.get("jax_privacy_samples_per_s"))
        what = f"CPU one core, b = {r.get('b')}, n = {r.get('n')}"
        if ours is None or not ref:
            out.append(_err("18", chk, what, target, "no CPU rates"))
            continue
        judged = r.get("b") == MC_JUDGED_BANDS and (r.get("n") or 0) >= MC_ISSUE_N
        status = (PASS if ours / ref >= MC_CPU_SPEEDUP else FAIL) if judged else REPORT
        out.append(Result("18", chk, what, f"{ours / ref:.1f}× ({ours:,.0f}/s vs {ref:,.0f}/s)",
                          target if judged else "report", status,
                          f"ours: {r.get('ours_accelerator', '?')}"))
    return out


def eval_per_sample_tracking(data: dict) -> list[Result]:
    """Issue 8 from ``per_sample_tracking.py --json`` (``overhead_pct`` per mode)."""
    iss, chk = "8", "per_sample_tracking"
    target = f"overhead ≤ {TRACKING_OVERHEAD_PCT:g} % of a DP-SGD step"
    over = data.get("overhead_pct") or {}
    steps = data.get("median_step_s") or {}
    cuda = _on_cuda(data.get("device"))
    n = data.get("num_examples")
    note = f"{n:,} tracked examples" if isinstance(n, int) else ""
    if isinstance(n, int) and n < TRACKING_EXAMPLES:
        note += f" (issue: {TRACKING_EXAMPLES:,})"
    plain = _num(steps.get("plain"))
    out = []
    for mode, what in (("tracker", "per-sample ε tracker"), ("filter", "individual GDP filter"),
                       ("rows", "release-row record (issue 39)")):
        pct = _num(over.get(mode))
        if pct is None and mode == "rows":
            continue  # a JSON written before issue 39
        if pct is None:
            out.append(_err(iss, chk, what, target, f"no overhead_pct[{mode!r}]"))
            continue
        out.append(Result(iss, chk, what, f"{pct:+.2f} % (plain step "
                          f"{_fmt(None if plain is None else 1e3 * plain, '.2f')} ms)", target,
                          _judge(pct, pct <= TRACKING_OVERHEAD_PCT, cuda), note))
    for mode in ("both", "tracker+pld"):
        pct = _num(over.get(mode))
        if pct is not None:
            out.append(Result(iss, chk, mode, f"{pct:+.2f} %", "report",
                              REPORT if cuda else CPU))
    ratio = _num(data.get("step_ratio_n_large_vs_small"))
    if ratio is not None:  # issue 32: the tracker's step does not grow with N
        small = (data.get("rows") or {}).get("tracker-small", {}).get("num_examples")
        out.append(Result("32", chk, "tracker step, N large / small", f"{ratio:.3f}×",
                          "≈ 1 (within the run's spread)", REPORT if cuda else CPU,
                          f"{n:,} vs {small:,} examples" if isinstance(n, int)
                          and isinstance(small, int) else ""))
    return out


def eval_pytest(data: dict, *, issue: str, check: str, what: str, min_gpus: int = 1
                ) -> list[Result]:
    """Pytest counts (parsed from ``-q`` output) plus the machine's CUDA device count."""
    target = "no failures" + (f" ({min_gpus} GPUs)" if min_gpus > 1 else "")
    passed, failed = data.get("passed", 0), data.get("failed", 0)
    errors, skipped = data.get("errors", 0), data.get("skipped", 0)
    counts = f"{passed} passed, {failed} failed, {errors} errors, {skipped} skipped"
    gpus = data.get("device_count", 0) if data.get("cuda_available") else 0
    if data.get("returncode") not in (0, 1) and not (passed or failed or skipped):
        return [_err(issue, check, what, target, f"pytest exit {data.get('returncode')}: "
                     "nothing ran (see the log)")]
    if failed or errors:
        return [Result(issue, check, what, counts, target, FAIL if gpus else CPU)]
    if not data.get("cuda_available"):
        return [Result(issue, check, what, counts, target, CPU, "no CUDA: the tests skip")]
    if gpus < min_gpus:
        return [Result(issue, check, what, f"skipped: {gpus} GPU", target, SKIP, counts)]
    if passed == 0:
        return [Result(issue, check, what, counts, target, SKIP, "nothing passed")]
    return [Result(issue, check, what, counts, target, PASS)]


def eval_dp_lstm(data: dict) -> list[Result]:
    """Issue 10 (step) from ``dp_lstm.py --json`` (rows with ratio_vs_nonprivate)."""
    iss, chk = "10", "dp_lstm"
    target = f"≤ {LSTM_RATIO:g} × row 0 (nn.LSTM non-private)"
    rows = data.get("rows") or []
    if not rows or not str(rows[0].get("method", "")).startswith("nn.LSTM non-private"):
        return [_err(iss, chk, "FastDPLSTM DP-SGD step", target,
                     "row 0 is not the nn.LSTM non-private reference (--cell lstm?)")]
    cuda = _on_cuda(data.get("device"))
    ref = _num(rows[0].get("ms_per_step"))
    batch = (data.get("settings") or {}).get("batch")
    note = f"row 0 {_fmt(ref, '.2f')} ms, batch {batch}" + (
        " (issue: 256)" if batch != 256 else "")
    by_name = {r.get("method"): r for r in rows}
    out = []
    for mode in ("hooks", "ghost"):
        name = f"FastDPLSTM DP-SGD ({mode}, native)"
        row = by_name.get(name)
        if row is None:
            out.append(_err(iss, chk, name, target, "row missing"))
            continue
        ratio = _num(row.get("ratio_vs_nonprivate"))
        out.append(Result(iss, chk, name, f"{_fmt(row.get('ms_per_step'), '.2f')} ms "
                          f"({_fmt(ratio, '.2f')}×)", target,
                          _judge(ratio, ratio is not None and ratio <= LSTM_RATIO, cuda), note))
    opac = by_name.get("opacus DPLSTM DP-SGD")
    if opac is not None:
        out.append(Result(iss, chk, "opacus DPLSTM DP-SGD",
                          f"{_fmt(opac.get('ms_per_step'), '.2f')} ms "
                          f"({_fmt(opac.get('ratio_vs_nonprivate'), '.2f')}×)", "report",
                          REPORT if cuda else CPU))
    return out


def eval_forecast_lstm_impl(data: dict) -> list[Result]:
    """Issue 10 (main job) from ``{"fast": report.json, "opacus": report.json}``."""
    iss, chk = "10", "forecast_lstm_impl"
    what, target = "DeepAR DP job, opacus / fast", f"≥ {LSTM_JOB_SPEEDUP:g}× faster with fast"
    fast, opac = data.get("fast") or {}, data.get("opacus") or {}
    tf, to = _num(fast.get("train_seconds")), _num(opac.get("train_seconds"))
    if tf is None or to is None or tf <= 0:
        return [_err(iss, chk, what, target, "missing train_seconds")]
    if fast.get("steps") != opac.get("steps"):
        return [_err(iss, chk, what, target, f"different step counts: {fast.get('steps')} vs "
                     f"{opac.get('steps')}")]
    cuda = _on_cuda(fast.get("device")) and _on_cuda(opac.get("device"))
    speedup = to / tf
    return [Result(iss, chk, what, f"{to:.3g} s / {tf:.3g} s = {speedup:.2f}×", target,
                   _judge(speedup, speedup >= LSTM_JOB_SPEEDUP, cuda),
                   f"{fast.get('steps')} steps (training wall time)")]


def eval_bookkeeping(data: dict) -> list[Result]:
    """Issue 10 deliverable 2 (ghost clipping in our wrappers) from ``bookkeeping.py --json``:
    reported, no target."""
    iss, chk = "10", "bookkeeping"
    rows = {r.get("method"): r for r in data.get("rows") or []}
    if "book-keeping" not in rows:
        return [_err(iss, chk, "book-keeping step", "report", "row missing")]
    cuda = _on_cuda(data.get("device"))
    settings = data.get("settings") or {}
    note = (f"model {settings.get('model')}, {_fmt(data.get('params'), ',.0f')} params, "
            f"batch {settings.get('batch')}")
    return [Result(iss, chk, f"{name} step", f"{_fmt(rows[name].get('ms_per_step'), '.2f')} ms "
                   f"({_fmt(rows[name].get('ratio_vs_nonprivate'), '.2f')}× non-private)",
                   "report", REPORT if cuda else CPU, note)
            for name in ("book-keeping", "opacus ghost", "opacus hooks") if name in rows]


EVALUATORS = {
    "forecast_deepar": eval_forecast_deepar,
    "correlated_noise": eval_correlated_noise,
    "bminsep_mc": eval_bminsep_mc,
    "per_sample_tracking": eval_per_sample_tracking,
    "distributed_one_gpu": lambda d: eval_pytest(d, issue="9", check="distributed_one_gpu",
                                                 what="DDP 2 ranks on one GPU"),
    "distributed_nccl": lambda d: eval_pytest(d, issue="9", check="distributed_nccl",
                                              what="NCCL 2-process test", min_gpus=2),
    "dp_lstm": eval_dp_lstm,
    "forecast_lstm_impl": eval_forecast_lstm_impl,
    "bookkeeping": eval_bookkeeping,
    "cuda_tests": lambda d: eval_pytest(d, issue="all", check="cuda_tests",
                                        what="pytest -m cuda tests"),
}


def evaluate(check: str, data: dict) -> list[Result]:
    """Judge one check's JSON; an evaluator crash on malformed JSON is an ERROR row."""
    if check not in EVALUATORS:
        raise ValueError(f"check must be one of {sorted(EVALUATORS)}, got {check!r}")
    try:
        return EVALUATORS[check](data)
    except Exception as exc:  # malformed JSON must not hide the other checks
        return [Result(CHECKS[check].issue, check, CHECKS[check].title, "-", "-", ERROR,
                       f"cannot evaluate: {type(exc).__name__}: {exc}")]


# ---- the checks and their commands ------------------------------------------------------------
CHECKS = {c.name: c for c in (
    Check("forecast_deepar", "4", "DeepAR ε = 1 vs baselines",
          {"full": 1200, "quick": 300, "cpu": 120}),
    Check("correlated_noise", "5", "BandMF step vs stock", {"full": 600, "quick": 180, "cpu": 90}),
    Check("bminsep_mc", "6", "b-min-sep Monte Carlo", {"full": 600, "quick": 120, "cpu": 60}),
    Check("per_sample_tracking", "8", "per-sample ε / GDP overhead",
          {"full": 600, "quick": 120, "cpu": 60}),
    Check("distributed_one_gpu", "9", "DDP 2 ranks on one GPU",
          {"full": 300, "quick": 120, "cpu": 60}),
    Check("distributed_nccl", "9", "NCCL 2-process test", {"full": 300, "quick": 120, "cpu": 60}),
    Check("dp_lstm", "10", "FastDPLSTM step", {"full": 600, "quick": 150, "cpu": 60}),
    Check("forecast_lstm_impl", "10", "DP job fast vs opacus LSTM",
          {"full": 1200, "quick": 240, "cpu": 120}),
    Check("bookkeeping", "10", "book-keeping ghost clipping step",
          {"full": 600, "quick": 120, "cpu": 60}),
    Check("cuda_tests", "all", "all @pytest.mark.cuda tests",
          {"full": 900, "quick": 180, "cpu": 120}),
)}


def _bench(script):
    return [sys.executable, os.path.join("benchmarks", script)]


def _forecast_cmd(mode, out_dir, extra):
    device = "cpu" if mode == "cpu" else "cuda"
    # the recipe of issues 4 and 10 (DeepAR trained from scratch, lr 1e-2, last iterate): the
    # public-pretraining defaults of issue 17 would pretrain DeepAR first (minutes on a CPU)
    cmd = CLI + ["forecast", "--model", "deepar", "--epsilon", str(FORECAST_EPSILON),
                 "--delta", str(FORECAST_DELTA), "--device", device, "--json", "--no-plot",
                 "--no-progress", "--output", out_dir, "--init-from", "none",
                 "--tail-average", "0"]
    if mode == "cpu":  # tiny: 20 series, 1 step, few sample paths
        cmd += ["--num-series", "20", "--batch-size", "8", "--max-steps", "1",
                "--num-samples", "2"]
    else:  # cut windows in 2 workers while the GPU steps (same batches, both LSTM impls)
        cmd += ["--num-workers", "2"]
    return cmd + extra


def build_steps(name: str, mode: str, out: str) -> list[Step]:
    """The subprocess(es) of check ``name`` in ``mode`` ("full", "quick" or "cpu")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    js = os.path.join(out, f"{name}.json")
    if name == "forecast_deepar":  # the issue's run: 200 steps, batch 64 (the CLI's default)
        rep = os.path.join(out, f"{name}_report")
        extra = [] if mode == "cpu" else ["--max-steps", "200"]
        return [Step("report", _forecast_cmd(mode, rep, extra),
                     os.path.join(rep, "diagnostics", "report.json"))]
    if name == "correlated_noise":
        bands = ["--bands", "1", "8", str(BANDMF_BANDS)]
        extra = {"full": ["--params", "10000000", *bands, "--repeats", "30"],
                 "quick": ["--params", "10000000", *bands, "--repeats", "10"],
                 "cpu": ["--params", "100000", "--bands", str(BANDMF_BANDS), "--repeats", "2",
                         "--threads", "1"]
                 }[mode]
        return [Step("rows", _bench("correlated_noise.py") + ["--json", js] + extra, js)]
    if name == "bminsep_mc":
        extra = {"full": ["--device", "cuda"],
                 "quick": ["--quick", "--device", "cuda"],
                 "cpu": ["--bands", "4", "--n", "128", "--reps", "1", "--ref-elements",
                         "20000", "--our-elements", "40000", "--device", "cpu"]}[mode]
        return [Step("record", _bench("bminsep_mc.py") + ["--json", js] + extra, js)]
    if name == "per_sample_tracking":
        extra = {"full": [], "quick": ["--rounds", "8"],
                 "cpu": ["--num-examples", "10000", "--batch-size", "32", "--dim", "16",
                         "--hidden", "16", "--rounds", "2", "--steps", "1"]}[mode]
        return [Step("result", _bench("per_sample_tracking.py") + ["--json", js] + extra, js)]
    if name in ("distributed_nccl", "distributed_one_gpu"):
        key = "nccl" if name == "distributed_nccl" else "one_gpu"
        return [Step("pytest", [sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                                "no:cacheprovider", "-m", "cuda",
                                "tests/test_distributed.py", "-k", key], None)]
    if name == "dp_lstm":
        extra = {"full": ["--device", "cuda", "--repeats", "30"],
                 "quick": ["--device", "cuda"],
                 "cpu": ["--device", "cpu", "--batch", "8", "--steps", "4", "--hidden", "8",
                         "--layers", "1", "--repeats", "1", "--warmup", "1", "--threads", "1",
                         "--skip-opacus"]}[mode]
        return [Step("rows", _bench("dp_lstm.py") + ["--json", js] + extra, js)]
    if name == "bookkeeping":
        extra = {"full": ["--device", "cuda", "--model", "seq", "--repeats", "10"],
                 "quick": ["--device", "cuda", "--model", "seq", "--batch", "32"],
                 "cpu": ["--device", "cpu", "--model", "seq", "--params", "20000", "--batch",
                         "4", "--repeats", "1", "--warmup", "1", "--threads", "1"]}[mode]
        return [Step("rows", _bench("bookkeeping.py") + ["--json", js] + extra, js)]
    if name == "forecast_lstm_impl":
        steps = {"full": "200", "quick": "50", "cpu": "2"}[mode]
        extra = ["--no-baselines"] + ([] if mode == "cpu" else
                                      ["--max-steps", steps, "--num-samples", "10"])
        res = []
        for impl in ("fast", "opacus"):
            rep = os.path.join(out, f"{name}_{impl}")
            res.append(Step(impl, _forecast_cmd(mode, rep, extra + ["--lstm-impl", impl]),
                            os.path.join(rep, "diagnostics", "report.json")))
        return res
    if name == "cuda_tests":
        return [Step("pytest", [sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                                "no:cacheprovider", "-m", "cuda", "tests"], None)]
    raise ValueError(f"check must be one of {sorted(CHECKS)}, got {name!r}")


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def parse_pytest(text: str, returncode: int) -> dict:
    """Counts from pytest's final ``-q`` summary line (``3 passed, 1 skipped in 2.0s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "deselected": 0, "errors": 0,
              "xfailed": 0, "xpassed": 0}
    lines = [ln for ln in text.strip().splitlines() if re.search(r" in [\d.]+s", ln)]
    for n, kind in _PYTEST_COUNT.findall(lines[-1] if lines else ""):
        counts["errors" if kind.startswith("error") else kind] += int(n)
    counts["returncode"] = returncode
    return counts


def _run_step(step: Step, log, timeout: float, env) -> tuple[int | None, str]:
    log.write(f"$ {' '.join(step.cmd)}\n")
    log.flush()
    proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=max(1.0, timeout))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: mp.spawn children included
        text, _ = proc.communicate()
        rc = None
    log.write(text or "")
    log.write(f"\n[exit {rc if rc is not None else 'timeout'}]\n")
    log.flush()
    return rc, text or ""


def run_check(name: str, mode: str, out: str, env, timeout: float | None = None) -> dict:
    """Run one check's subprocesses (``timeout`` seconds for all of them; default: the
    check's own for ``mode``), write ``<name>.log`` / ``<name>.json``, judge it."""
    check = CHECKS[name]
    timeout = check.timeouts[mode] if timeout is None else timeout
    steps = build_steps(name, mode, out)
    t0 = time.perf_counter()
    data, problem = {}, None
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        for step in steps:
            left = timeout - (time.perf_counter() - t0)
            rc, text = _run_step(step, log, left, env)
            if rc is None:
                problem = f"timed out after {timeout:.0f} s"
                break
            if step.json_path is None:
                got = parse_pytest(text, rc)
                try:
                    import torch

                    got.update(cuda_available=torch.cuda.is_available(),
                               device_count=torch.cuda.device_count())
                except ImportError:  # pragma: no cover
                    got.update(cuda_available=False, device_count=0)
            elif rc != 0 or not os.path.exists(step.json_path):
                problem = f"step {step.key!r} exited {rc} without JSON (see {name}.log)"
                break
            else:
                with open(step.json_path) as fh:
                    got = json.load(fh)
            data[step.key] = got
    seconds = time.perf_counter() - t0
    if problem is None:
        if len(steps) == 1:
            data = data[steps[0].key]
        with open(os.path.join(out, f"{name}.json"), "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        results = evaluate(name, data)
    else:
        results = [Result(check.issue, name, check.title, "-", "-", ERROR, problem)]
    return {"check": name, "issue": check.issue, "seconds": seconds, "mode": mode,
            "log": os.path.join(out, f"{name}.log"),
            "json": None if problem else os.path.join(out, f"{name}.json"),
            "results": [asdict(r) | {"status_text": r.status_text} for r in results]}


def format_table(results: list[Result]) -> str:
    head = ["issue", "check", "what", "measured", "target", "status"]
    body = [[r.issue, r.check, r.what, r.measured, r.target, r.status_text]
            + ([f"  {r.note}"] if r.note else []) for r in results]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells):
        return " | ".join(c.ljust(w) for c, w in zip(cells[:6], widths, strict=True)).rstrip() \
            + (cells[6] if len(cells) > 6 else "")
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, body)])


def select(only) -> list[str]:
    """Check names for ``--only`` tokens (issue numbers, "all", or check names)."""
    if not only:
        return list(CHECKS)
    names = []
    for tok in only:
        hit = [c.name for c in CHECKS.values() if tok in (c.issue, c.name)]
        if not hit:
            issues = sorted({c.issue for c in CHECKS.values()})
            raise ValueError(f"--only: {tok!r} is neither an issue ({', '.join(issues)}) nor "
                             f"a check ({', '.join(CHECKS)})")
        names += [h for h in hit if h not in names]
    return names


def _machine() -> dict:
    import platform

    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            info.update(device_count=torch.cuda.device_count(),
                        device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    except ImportError:  # pragma: no cover
        info["cuda_available"] = False
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for logs, JSON and summary.json")
    p.add_argument("--quick", action="store_true",
                   help="smaller settings: the whole run fits in ~8 minutes on an H100")
    p.add_argument("--only", nargs="+", metavar="ISSUE", default=None,
                   help="issue numbers (4 5 6 8 9 10), 'all' (the cuda tests) or check names")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without CUDA, run everything on the CPU with tiny settings (a smoke "
                        "test of this runner: GPU targets are then never judged)")
    p.add_argument("--timeout", type=float, default=None,
                   help="per-check timeout in seconds (default: per check and mode)")
    p.add_argument("--budget", type=float, default=None,
                   help="total seconds for all checks; a check gets at most what is left and "
                        "is not started (ERROR) when it is spent (default: 540 with --quick, "
                        "none otherwise)")
    args = p.parse_args(argv)
    try:
        names = select(args.only)
    except ValueError as exc:
        p.error(str(exc))
    for opt in ("timeout", "budget"):
        if getattr(args, opt) is not None and not getattr(args, opt) > 0:
            p.error(f"--{opt} must be > 0, got {getattr(args, opt)}")
    machine = _machine()
    if not machine.get("cuda_available"):
        if not args.allow_cpu:
            print("gpu_acceptance: error: torch.cuda.is_available() is False: these are GPU "
                  "checks. Run on a machine with an NVIDIA GPU, or pass --allow-cpu for a "
                  "tiny CPU smoke test (its results never count as PASS for a GPU target).",
                  file=sys.stderr)
            return 2
        mode = "cpu"
    else:
        mode = "quick" if args.quick else "full"
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONHASHSEED", "0")
    if mode == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # never touch a GPU in the smoke test
    print(f"gpu_acceptance: mode {mode}, checks {', '.join(names)}; "
          f"{machine.get('device_name', 'no GPU')}; output {out}", flush=True)
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET.get(mode)
    t0 = time.perf_counter()
    checks, results = [], []
    for name in names:
        check = CHECKS[name]
        left = None if budget is None else budget - (time.perf_counter() - t0)
        if left is not None and left < 10:
            rec = {"check": name, "issue": check.issue, "seconds": 0.0, "mode": mode,
                   "log": None, "json": None, "results": [asdict(Result(
                       check.issue, name, check.title, "-", "-", ERROR,
                       f"not run: --budget {budget:.0f} s spent")) | {"status_text": ERROR}]}
        else:
            print(f"  running {name} (issue {check.issue}) ...", end=" ", flush=True)
            timeout = args.timeout if args.timeout is not None else check.timeouts[mode]
            rec = run_check(name, mode, out, env, timeout if left is None else
                            min(timeout, left))
            print(f"{rec['seconds']:.0f} s: "
                  + ", ".join(r["status_text"] for r in rec["results"]), flush=True)
        checks.append(rec)
        results = [Result(**{k: v for k, v in r.items() if k != "status_text"})
                   for c in checks for r in c["results"]]
        # rewritten after every check: a run killed from outside keeps what it measured
        summary = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode,
                   "quick": args.quick, "argv": sys.argv if argv is None else argv,
                   "machine": machine, "budget_s": budget, "seconds": time.perf_counter() - t0,
                   "complete": len(checks) == len(names), "checks": checks,
                   "counts": {s: sum(r.status == s for r in results)
                              for s in (PASS, FAIL, REPORT, SKIP, ERROR, CPU)}}
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
    print()
    print(format_table(results))
    print(f"\n{summary['counts']}; {summary['seconds']:.0f} s; summary: "
          f"{os.path.join(out, 'summary.json')}")
    return 1 if any(r.status in (FAIL, ERROR) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
