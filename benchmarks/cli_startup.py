"""Start-up time of the ``opacus-structured`` command (issue 20: ``--help`` under 1 s).

Median of ``--repeats`` (default 5) wall times, each a fresh interpreter, of

* ``opacus-structured --help``,
* ``opacus-structured epsilon poisson --sample-rate 0.01 --noise-multiplier 1 --steps 100
  --delta 1e-5`` (start-up plus a small PLD composition),
* ``python -c "import opacus_structured"``.

The command runs as the console script does (``from opacus_structured.console import main``),
without a shell or pyenv shim in front. ``--src DIR --entry opacus_structured.cli`` times
another checkout (e.g. the tree before lazy loading, which had no ``console`` module)::

    python benchmarks/cli_startup.py --json after.json
    git archive 6a95a5e opacus_structured | tar -x -C /tmp/before
    python benchmarks/cli_startup.py --src /tmp/before --entry opacus_structured.cli

Prints a table (median, min, max in seconds, and the 1-minute load average, since a busy
machine inflates every number) and with ``--json PATH`` writes the numbers.
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

EPSILON_ARGS = ["epsilon", "poisson", "--sample-rate", "0.01", "--noise-multiplier", "1",
                "--steps", "100", "--delta", "1e-5"]


def _cases(entry: str) -> dict[str, list[str]]:
    run = f"import sys; from {entry} import main; sys.exit(main())"
    return {"opacus-structured --help": [sys.executable, "-c", run, "--help"],
            "opacus-structured epsilon poisson (100 steps)": [sys.executable, "-c", run,
                                                               *EPSILON_ARGS],
            "import opacus_structured": [sys.executable, "-c", "import opacus_structured"]}


def time_command(cmd: list[str], repeats: int, env: dict) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        # run outside the checkout: `python -c` puts the working directory first on sys.path
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              cwd=tempfile.gettempdir())
        times.append(time.perf_counter() - t0)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr.decode()[-2000:]}")
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument("--src", metavar="DIR",
                        help="put DIR first on PYTHONPATH (time another checkout)")
    parser.add_argument("--entry", default="opacus_structured.console",
                        help="module whose main() is the command (default %(default)s; "
                             "opacus_structured.cli before lazy loading)")
    args = parser.parse_args(argv)
    env = {**os.environ, "OPACUS_STRUCTURED_PROGRESS": "0"}
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.src, env.get("PYTHONPATH")]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for name, cmd in _cases(args.entry).items():
        times = time_command(cmd, args.repeats, env)
        rows.append({"command": name, "median_s": statistics.median(times),
                     "min_s": min(times), "max_s": max(times), "runs": len(times)})
    print(f"{'command':<48} {'median s':>9} {'min s':>7} {'max s':>7}")
    for r in rows:
        print(f"{r['command']:<48} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}")
    print(f"(median of {args.repeats} runs each; load average {load:.2f} on "
          f"{os.cpu_count()} cores; entry {args.entry}{'; src ' + args.src if args.src else ''})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "repeats": args.repeats, "load_average_1min": load,
                       "cpu_count": os.cpu_count(), "entry": args.entry, "src": args.src,
                       "python": sys.version.split()[0]}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
