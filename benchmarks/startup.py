"""Start-up time of a Python process, plain and under ``opentelemetry-instrument``.

``opentelemetry-instrument`` puts its sitecustomize on ``PYTHONPATH``: every Python process
a traced program starts (multiprocessing's children and resource tracker, any tool it
runs) loads dask-otel's configurator and instrumentor, whether it uses Dask or not. This
runs ``python -c CODE`` plain and under ``opentelemetry-instrument`` (traces, metrics and
logs over OTLP/gRPC to the tests' receiver in another process), alternating which goes
first, and reports each one's median wall time with min-max and the median of the
per-round ratios (``--also VAR=VALUE`` adds an instrumented process with that variable
set: ``OTEL_SDK_DISABLED=true`` shows the SDK's share). It first says which dask-otel the
instrumented process loaded and
whether it imported dask. The processes run in an empty directory (``python -c`` imports
from its working directory first): ``PYTHONPATH=<a checkout>`` measures that checkout's
dask-otel.

    python benchmarks/startup.py --rounds 9
    python benchmarks/startup.py --rounds 9 --code "import distributed"
    python benchmarks/startup.py --rounds 9 --also OTEL_SDK_DISABLED=true
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import start_receiver

#: Prints where dask_otel came from and whether dask was imported.
PROBE = (
    "import sys; m = sys.modules.get('dask_otel');"
    "print(m and m.__file__, 'dask imported:', 'dask' in sys.modules)"
)


def environment(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update({f"OTEL_{s}_EXPORTER": "otlp" for s in ("TRACES", "METRICS", "LOGS")})
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    return env


def run(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, str]:
    """(seconds from start to exit, stdout) of ``command``, which must succeed."""
    start = time.perf_counter()
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, out.stdout


def spread(values: list[float]) -> str:
    """Median (min-max)."""
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--code", default="pass", help="what the process runs (python -c)")
    parser.add_argument("--also", action="append", default=[], metavar="VAR=VALUE")
    args = parser.parse_args()
    instrument = str(Path(sys.executable).with_name("opentelemetry-instrument"))
    endpoint, receiver = start_receiver()
    env = environment(endpoint)
    traced = [instrument, sys.executable, "-c", args.code]
    commands = {"plain": ([sys.executable, "-c", args.code], env), "instrumented": (traced, env)}
    for also in args.also:
        name, _, value = also.partition("=")
        commands[f"instrumented, {also}"] = (traced, {**env, name: value})
    times: dict[str, list[float]] = {name: [] for name in commands}
    try:
        with tempfile.TemporaryDirectory() as cwd:
            probe = run([instrument, sys.executable, "-c", PROBE], env, cwd)[1]
            print("instrumented process:", probe.strip())
            for i in range(args.rounds):
                for name in list(commands)[:: 1 if i % 2 == 0 else -1]:
                    times[name].append(run(*commands[name], cwd)[0])
    finally:
        receiver.communicate("")
    print(f"python -c {args.code!r}, {args.rounds} rounds: seconds, and ratio to plain")
    for name, values in times.items():
        ratios = [t / p for t, p in zip(values, times["plain"], strict=True)]
        print(f"  {name:44} {spread(values)}  {spread(ratios)}")


if __name__ == "__main__":
    main()
