"""Commands: ``dask-otel`` (demo, summarize) and the dashed ``dask-scheduler`` and
``dask-worker``.

``distributed`` dropped the dashed commands for ``dask scheduler`` / ``dask worker``, but
``opentelemetry-instrument dask-worker ...`` is what OpenTelemetry users type. These run
the very same click commands, with the same options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distributed.cli import dask_scheduler as _scheduler_cli
from distributed.cli import dask_worker as _worker_cli


def dask_scheduler() -> None:
    """``dask-scheduler``: ``dask scheduler`` under its old name."""
    _scheduler_cli.main(prog_name="dask-scheduler")


def dask_worker() -> None:
    """``dask-worker``: ``dask worker`` under its old name."""
    _worker_cli.main(prog_name="dask-worker")


def main(argv: list[str] | None = None) -> int:
    """``dask-otel``: ``demo`` runs an instrumented example; ``summarize`` reads a recording."""
    parser = argparse.ArgumentParser(prog="dask-otel", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="run a short instrumented computation and summarize its telemetry"
    )
    demo.add_argument(
        "--output",
        type=Path,
        default=Path("dask-otel-telemetry"),
        help="where to write OTLP JSON files when OTEL_EXPORTER_OTLP_ENDPOINT is unset",
    )
    demo.add_argument("--size", choices=["normal", "small"], default="normal")
    summarize = commands.add_parser("summarize", help="summarize OTLP JSON files")
    summarize.add_argument("path", type=Path, help="an OTLP JSON file or a directory of them")
    args = parser.parse_args(argv)

    from dask_otel.tools import demo as demo_module
    from dask_otel.tools import summary

    try:
        if args.command == "demo":
            return demo_module.run(args.output, args.size)
        summary.render(summary.summarize(args.path), sys.stdout)
    except (summary.SummaryError, demo_module.DemoError) as e:
        print(f"dask-otel: {e}", file=sys.stderr)
        return 2
    return 0
