"""Start-up time of the ``opacus-structured`` command (issue 20: ``--help`` under 1 s; issue 41:
``forecast --help`` under 1 s, ``schemes`` under 2 s, every input error of ``forecast`` under
2 s, idle on 2 cores).

Median of ``--repeats`` (default 5) wall times, each a fresh interpreter, of

* ``opacus-structured --help`` and ``forecast --help``,
* ``opacus-structured schemes``,
* ``opacus-structured epsilon poisson --sample-rate 0.01 --noise-multiplier 1 --steps 100
  --delta 1e-5`` (start-up plus a small PLD composition),
* every input error of ``forecast`` below (:data:`FORECAST_ERRORS`: a missing ``--data`` file,
  an empty CSV, a duplicate timestamp, an unparseable date, mixed date formats, ``--epsilon 0``,
  ``--prediction-length -3``, ``--batch-size`` larger than the panel, ...), each expected to
  exit with status 2,
* ``python -c "import opacus_structured"``.

The command runs as the console script does (``from opacus_structured.console import main``),
without a shell or pyenv shim in front. ``--src DIR`` times another checkout (e.g. the tree
before a change; ``--entry opacus_structured.cli`` for trees older than the ``console``
module)::

    python benchmarks/cli_startup.py --json after.json
    git archive 7861904 opacus_structured | tar -x -C /tmp/before
    python benchmarks/cli_startup.py --src /tmp/before --repeats 1 --json before.json

Prints a table (median, min, max wall seconds; the median CPU seconds of the child, user +
system, which a busy machine inflates far less than the wall time; and the 1-minute load
average before and after) and with ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

try:
    import resource
except ImportError:  # not on Windows: CPU seconds are then nan
    resource = None

EPSILON_ARGS = ["epsilon", "poisson", "--sample-rate", "0.01", "--noise-multiplier", "1",
                "--steps", "100", "--delta", "1e-5"]


def _write_inputs(folder: str) -> dict[str, str]:
    """The CSV files of the forecast input errors, written to ``folder``."""
    months = [f"{2000 + k // 12}-{k % 12 + 1:02d}-01" for k in range(40)]

    def long(rows):
        return "item_id,timestamp,target\n" + "".join(f"{i},{t},{v}\n" for i, t, v in rows)

    files = {
        "empty": "",
        "duplicate": long([("a", t, k) for k, t in enumerate(months + [months[2]])]),
        "unparseable": long([("a", "not a date" if k == 5 else t, k)
                             for k, t in enumerate(months)]),
        "mixed": long([("a", "04/01/2000" if k == 3 else t, k) for k, t in enumerate(months)]),
        "three_series": long([(s, t, k) for s in "abc" for k, t in enumerate(months)]),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = os.path.join(folder, f"{name}.csv")
        with open(paths[name], "w") as fh:
            fh.write(text)
    paths["missing"] = os.path.join(folder, "missing.csv")
    return paths


def forecast_errors(paths: dict[str, str], output: str) -> dict[str, list[str]]:
    """Name -> ``forecast`` arguments of each input error (every one exits with status 2)."""
    cases = {
        "forecast --data missing.csv": ["--data", paths["missing"]],
        "forecast --data empty.csv": ["--data", paths["empty"]],
        "forecast --data (duplicate timestamp)": ["--data", paths["duplicate"]],
        "forecast --data (unparseable date)": ["--data", paths["unparseable"]],
        "forecast --data (mixed date formats)": ["--data", paths["mixed"]],
        "forecast --data (3 series) --batch-size 5": ["--data", paths["three_series"],
                                                      "--batch-size", "5"],
        "forecast --epsilon 0": ["--epsilon", "0"],
        "forecast --prediction-length -3": ["--prediction-length", "-3"],
        "forecast --delta 1": ["--delta", "1"],
        "forecast --tail-average 2": ["--tail-average", "2"],
    }
    return {name: ["forecast", *args, "--output", output, "--no-progress"]
            for name, args in cases.items()}


def _cases(entry: str, folder: str) -> dict[str, tuple[list[str], int]]:
    """Name -> (command, expected exit status)."""
    run = f"import sys; from {entry} import main; sys.exit(main())"
    command = [sys.executable, "-c", run]
    cases = {"opacus-structured --help": (command + ["--help"], 0),
             "opacus-structured forecast --help": (command + ["forecast", "--help"], 0),
             "opacus-structured schemes": (command + ["schemes"], 0),
             "opacus-structured epsilon poisson (100 steps)": (command + EPSILON_ARGS, 0)}
    for name, args in forecast_errors(_write_inputs(folder),
                                      os.path.join(folder, "out")).items():
        cases[f"opacus-structured {name}"] = (command + args, 2)
    cases["import opacus_structured"] = ([sys.executable, "-c", "import opacus_structured"], 0)
    return cases


def _children_cpu() -> float:
    if resource is None:
        return float("nan")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(cmd: list[str], expected: int, repeats: int, env: dict,
                 timeout: float) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (user + system of the child) of ``repeats`` runs. On a
    loaded machine the CPU seconds stay close to the idle wall time of a one-threaded start,
    where the wall time grows with the load."""
    times, cpus = [], []
    for _ in range(repeats):
        c0, t0 = _children_cpu(), time.perf_counter()
        # run outside the checkout: `python -c` puts the working directory first on sys.path
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              cwd=tempfile.gettempdir(), timeout=timeout)
        times.append(time.perf_counter() - t0)
        cpus.append(_children_cpu() - c0)
        if done.returncode != expected:
            raise SystemExit(f"{' '.join(cmd)} exited with {done.returncode}, expected "
                             f"{expected}:\n{done.stderr.decode()[-2000:]}")
    return times, cpus



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument("--src", metavar="DIR",
                        help="put DIR first on PYTHONPATH (time another checkout)")
    parser.add_argument("--entry", default="opacus_structured.console",
                        help="module whose main() is the command (default %(default)s; "
                             "opacus_structured.cli before lazy loading)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds one run may take (default %(default)g)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    env = {**os.environ, "OPACUS_STRUCTURED_PROGRESS": "0"}
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.src, env.get("PYTHONPATH")]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (cmd, expected) in _cases(args.entry, folder).items():
            times, cpus = time_command(cmd, expected, args.repeats, env, args.timeout)
            rows.append({"command": name, "exit_status": expected,
                         "median_s": statistics.median(times), "min_s": min(times),
                         "max_s": max(times), "cpu_median_s": statistics.median(cpus),
                         "runs": len(times)})
            print(f"{name:<62} {rows[-1]['median_s']:>8.3f}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{'command':<62} {'median s':>9} {'min s':>7} {'max s':>7} {'cpu s':>6}")
    for r in rows:
        print(f"{r['command']:<62} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}"
              f" {r['cpu_median_s']:>6.2f}")
    cpu = cpu_name()
    print(f"(median of {args.repeats} run(s) each; load average {load:.2f} before, "
          f"{load_after:.2f} after, on {os.cpu_count()} cores, {cpu}; entry {args.entry}"
          f"{'; src ' + args.src if args.src else ''})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "repeats": args.repeats, "load_average_1min": load,
                       "load_average_1min_after": load_after, "cpu_count": os.cpu_count(),
                       "cpu_model": cpu, "entry": args.entry, "src": args.src,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "python": sys.version.split()[0]}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
