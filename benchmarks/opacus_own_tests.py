"""Opacus 1.6.0's own released tests, run unchanged with this package's accountant swapped in.

The test modules are Opacus' (``opacus/tests`` of the released Opacus 1.6.0 wheel, Apache-2.0,
Meta Platforms; ``--source DIR`` takes another copy, e.g. ``git archive v1.6.0 opacus/tests``
of a checkout). Nothing of them is copied into this repository: pytest runs them in place,
with the plugin ``tests/opacus_released/swap.py``:

* ``PrivacyEngine()`` builds our ``"poisson"`` accountant instead of Opacus' ``"prv"`` (an
  accountant a test names, ``accountant="rdp"``, is kept), and a fresh ``"poisson"`` becomes
  ``"shuffle"`` under ``make_private(..., poisson_sampling=False)`` (a shuffled or sequential
  loader, which ``"poisson"`` refuses and ``"shuffle"`` prices);
* torchvision's few names are a documented stand-in when torchvision is not installed
  (``tests/opacus_released/torchvision_standin.py``);
* ``--max-examples N`` caps Opacus' hypothesis tests at ``N`` examples each (default 5;
  ``--max-examples 100`` is hypothesis' default, what Opacus' CI runs: hours on 2 cores).

It prints one row per test module (passed / failed / errors / skipped; the engine module also
per test class, the five ``*HooksTest`` classes of ``make_private(wrap_model=False)``
included) and lists every failure. A failure is **documented** when it is one of
:data:`REFUSALS` (a loop this package refuses on purpose, with the reason; the same list is in
``docs/guides/opacus_parity.md``) and raised what that entry expects; anything else is an
**undocumented failure** and the script exits with status 1.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/opacus_own_tests.py \\
        [--modules privacy_engine_test ...] [--max-examples 5] [-k EXPR] [--json PATH]

Out of the default test suite (3-6 min on 2 cores); ``tests/test_opacus_suite.py``
keeps a fast subset in it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The released modules run by default: everything that builds a ``PrivacyEngine`` or prices,
#: on one process and CPU (the multi-GPU / DDP / FSDP modules need several ranks or GPUs), and
#: the validators. ``--modules all`` runs every ``*_test.py`` of the source.
DEFAULT_MODULES = (
    "privacy_engine_test", "privacy_engine_validation_test", "module_validator_test",
    "validators", "schedulers", "accountants_test", "accounting_noise_multiplier_test",
    "batch_memory_manager_test", "gradient_accumulation_test", "randomness_test",
    "poisson_test", "dpdataloader_test", "mixed_precision_test", "grad_sample_hooks_test",
    "grad_sample_hooks_fast_gradient_clipping_test")

#: Failures that are this package's refusals by design: ``(test id regex, what the failure
#: message must contain, the reason)``. docs/guides/opacus_parity.md lists the same.
REFUSALS = (
    (r"accounting_noise_multiplier_test\.py::.*::test_privacy_accounting_with_adaclip_e2e",
     "adaptive clipping",
     "adaptive clipping (Opacus' AdaClipDPOptimizer) releases a noisy count of unclipped "
     "examples divided by the private batch size, which none of our accountants prices: "
     "refused at make_private (accountants/release_guard.py, refuse_adaptive)"),
)


def _source(arg: str | None) -> Path:
    if arg:
        return Path(arg).resolve()
    import opacus

    if not opacus.__version__.startswith("1.6"):
        print(f"warning: Opacus {opacus.__version__} installed; the table is for 1.6.0",
              file=sys.stderr)
    return Path(opacus.__file__).resolve().parent / "tests"


def _paths(source: Path, modules) -> list[str]:
    if list(modules) == ["all"]:
        skip = ("multigpu", "ddp", "fsdp", "distributed")
        return sorted(str(p) for p in source.rglob("*_test.py")
                      if not any(s in p.name for s in skip))
    out = []
    for name in modules:
        path = source / name
        if path.is_dir():
            out.append(str(path))
        elif path.with_suffix(".py").exists():
            out.append(str(path.with_suffix(".py")))
        else:
            raise SystemExit(f"--modules: no {name}(.py) under {source}")
    return out


def run(paths, *, rootdir: Path, max_examples: int, keyword: str | None, junit: Path,
        timeout: int) -> int:
    """One pytest process over ``paths`` with the swap plugin; returns its exit status."""
    ini = junit.parent / "pytest.ini"
    ini.write_text("[pytest]\n")  # none of this repository's pytest settings
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    # rootdir: the parent of the tests directory, so that ids read tests/<module>.py::...
    cmd = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(rootdir),
           "-p", "no:cacheprovider", "-p", "opacus_released.swap", "-q",
           f"--max-examples={max_examples}", f"--junitxml={junit}", *paths]
    if keyword:
        cmd += ["-k", keyword]
    return subprocess.run(cmd, env=env, cwd=junit.parent, timeout=timeout).returncode


def _module_of(classname: str) -> str:
    """``validators/lstm_test.py`` of the junit class name ``tests.validators.lstm_test.C``."""
    parts = classname.split(".")
    if "tests" in parts:
        parts = parts[parts.index("tests") + 1:]
    return "/".join(p for p in parts if not p[:1].isupper()) + ".py"


def parse(junit: Path) -> list[dict]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        status, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "").strip()
                break
        classname = case.get("classname", "")
        cls = classname.rsplit(".", 1)[-1]
        module = _module_of(classname)
        rows.append({"module": module, "class": cls if cls[:1].isupper() else "",
                     "name": case.get("name"), "status": status, "message": message,
                     "id": f"{module}::{cls}::{case.get('name')}"})
    return rows


def classify(row: dict):
    """``(documented, reason)`` of a failed or errored test."""
    for pattern, needle, reason in REFUSALS:
        if re.search(pattern, row["id"]) and needle.lower() in row["message"].lower():
            return True, reason
    return False, ""


def table(rows: list[dict]) -> tuple[str, list[dict]]:
    counts: dict = defaultdict(lambda: defaultdict(int))
    for r in rows:
        counts[r["module"]][r["status"]] += 1
        if r["module"].endswith("privacy_engine_test.py") and r["class"]:
            counts[f"  {r['class']}"][r["status"]] += 1
    lines = ["| module | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
    for key in sorted(counts, key=lambda k: (k.startswith("  "), k)):
        c = counts[key]
        lines.append(f"| {key} | {c['passed']} | {c['failed']} | {c['error']} | "
                     f"{c['skipped']} |")
    failures = []
    for r in rows:
        if r["status"] in ("failed", "error"):
            documented, reason = classify(r)
            failures.append({**r, "documented": documented, "reason": reason})
    return "\n".join(lines), failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=None, help="Opacus' tests directory (default: the "
                   "installed opacus/tests)")
    p.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES))
    p.add_argument("--max-examples", type=int, default=5)
    p.add_argument("-k", dest="keyword", default=None)
    p.add_argument("--timeout", type=int, default=4 * 3600)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.max_examples < 1:
        raise SystemExit("--max-examples must be >= 1")
    source = _source(args.source)
    paths = _paths(source, args.modules)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        started = time.perf_counter()
        status = run(paths, rootdir=source.parent, max_examples=args.max_examples,
                     keyword=args.keyword, junit=junit, timeout=args.timeout)
        seconds = time.perf_counter() - started
        if not junit.exists():
            print(f"pytest exited with {status} before writing a report", file=sys.stderr)
            return 2
        rows = parse(junit)
    text, failures = table(rows)
    import opacus

    print(f"\nOpacus {opacus.__version__} released tests from {source}, our accountant "
          f"swapped in (--max-examples {args.max_examples}), {seconds:.0f} s")
    print(text)
    undocumented = [f for f in failures if not f["documented"]]
    for f in failures:
        tag = "documented refusal" if f["documented"] else "UNDOCUMENTED FAILURE"
        first = f["message"].splitlines()[0][:200] if f["message"] else ""
        print(f"- {tag}: {f['id']}: {first}" + (f"\n    reason: {f['reason']}"
                                                 if f["documented"] else ""))
    print(f"\n{len(rows)} tests: {sum(r['status'] == 'passed' for r in rows)} passed, "
          f"{len(failures) - len(undocumented)} documented refusals, {len(undocumented)} "
          f"undocumented failures, {sum(r['status'] == 'skipped' for r in rows)} skipped")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"opacus": opacus.__version__, "source": str(source),
                       "max_examples": args.max_examples, "seconds": seconds, "tests": rows,
                       "failures": failures}, fh, indent=1)
    return 1 if undocumented else 0


if __name__ == "__main__":
    sys.exit(main())
