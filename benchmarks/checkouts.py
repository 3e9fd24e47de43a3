"""Two checkouts of dask-otel side by side: one benchmark, alternating runs of each.

``deployed.py --against`` puts another checkout's ``dask_otel`` in the scheduler and the
workers while the client keeps this one's; that breaks when the two pickle their plugins
differently (a restructuring that moved modules). Here each run is a whole process of its
own checkout: its own benchmark script, its ``dask_otel`` first on ``PYTHONPATH``, the
plain and instrumented rounds interleaved inside it as the script does. The runs of the
checkouts alternate (rotating which goes first), and every run's per-mode wall ratios are
collected: the median with min-max of each checkout's ratios is printed per mode.

    python benchmarks/checkouts.py --against before=/tmp/before --runs 7 -- \
        overhead.py --tasks 4000 --rounds 1 --processor dask-otel --processor sdk
    python benchmarks/checkouts.py --against before=/tmp/before --runs 7 -- \
        deployed.py --workload graph --tasks 4000 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from overhead import median_range

HERE = Path(__file__).resolve().parent.parent

#: A report's section heading: ``dask-otel: noop workload, ...`` or ``all: wall ratio ...``.
LABEL = re.compile(r"^([\w.-]+):")
#: A wall ratio's median as overhead.py (``wall ratio  median X``) and deployed.py
#: (``wall ratio X (min-max)``) print it.
WALL_RATIO = re.compile(r"wall ratio\s+(?:median\s+)?([0-9]+\.[0-9]+)")


def wall_ratios(output: str) -> dict[str, float]:
    """Each mode's wall ratio in one run's report, by the heading above it."""
    ratios: dict[str, float] = {}
    label = None
    for line in output.splitlines():
        heading = LABEL.match(line)
        if heading is not None:
            label = heading.group(1)
        ratio = WALL_RATIO.search(line)
        if ratio is not None and label is not None and label not in ratios:
            ratios[label] = float(ratio.group(1))
    return ratios


def run(checkout: Path, script_args: list[str]) -> dict[str, float]:
    """One run of the benchmark of ``checkout``, its ``dask_otel`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    script, *rest = script_args
    done = subprocess.run(
        [sys.executable, str(checkout / "benchmarks" / script), *rest],
        cwd=checkout / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {script} failed\n{done.stdout}\n{done.stderr}")
    return wall_ratios(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="NAME=DIR")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = parser.parse_args()
    name, directory = args.against.split("=", 1)
    script = [a for a in args.script if a != "--"]
    checkouts = {"this": HERE, name: Path(directory).resolve()}
    collected: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for number in range(args.runs):
        order = list(checkouts) if number % 2 == 0 else list(reversed(checkouts))
        for which in order:
            ratios = run(checkouts[which], script)
            for mode, ratio in ratios.items():
                collected[mode][which].append(ratio)
            print(f"run {number + 1} {which}: {ratios}", flush=True)
    print(f"\n{' '.join(script)}, {args.runs} alternating runs of each checkout")
    for mode, by_checkout in collected.items():
        for which, ratios in by_checkout.items():
            print(f"{mode:<14} {which:<8} wall ratio {median_range(ratios)}, {len(ratios)} runs")


if __name__ == "__main__":
    main()
