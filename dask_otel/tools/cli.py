"""Commands: ``dask-otel`` (demo, summarize) and the dashed ``dask-scheduler`` and
``dask-worker``.

``distributed`` dropped the dashed commands for ``dask scheduler`` / ``dask worker``, but
``opentelemetry-instrument dask-worker ...`` is what OpenTelemetry users type. These run
the very same click commands, with the same options.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from distributed.cli import dask_scheduler as _scheduler_cli
from distributed.cli import dask_worker as _worker_cli

from dask_otel.version import __version__


def dask_scheduler() -> None:
    """``dask-scheduler``: ``dask scheduler`` under its old name."""
    _scheduler_cli.main(prog_name="dask-scheduler")


def dask_worker() -> None:
    """``dask-worker``: ``dask worker`` under its old name."""
    _worker_cli.main(prog_name="dask-worker")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dask-otel",
        description="OpenTelemetry for Dask: try it on a small cluster (demo), or read what "
        "a cluster recorded (summarize).",
    )
    parser.add_argument("--version", action="version", version=f"dask-otel {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a short instrumented computation and summarize its telemetry",
        description="Start a scheduler and two workers, each in a process of its own, run a "
        "reduction, a persist that spills, tasks that log and a task that fails twice, and "
        "summarize what they recorded. Exports to OTEL_EXPORTER_OTLP_ENDPOINT when it is "
        "set (exit status 1 if telemetry was lost, 2 if nothing listens there), else writes "
        "OTLP JSON files.",
    )
    demo.add_argument(
        "--output",
        type=Path,
        default=Path("dask-otel-telemetry"),
        metavar="DIR",
        help="where to write the OTLP JSON files when OTEL_EXPORTER_OTLP_ENDPOINT is unset "
        "(default: ./dask-otel-telemetry)",
    )
    demo.add_argument(
        "--size",
        choices=["normal", "small"],
        default="normal",
        help="how much work to run: normal (default, a few seconds) or small",
    )
    summarize = commands.add_parser(
        "summarize",
        help="summarize OTLP JSON files: failures, slow tasks, data movement, workers",
        description="Summarize OTLP JSON lines (dask-otel demo's files, a collector's file "
        "exporter) on one screen: what failed, where and why, what was slow, what moved "
        "and spilled, per worker, when task groups ran, ERROR log records and what is "
        "missing. Lines that cannot be read are skipped and reported. Exit status 2 when "
        "there is nothing to summarize.",
    )
    summarize.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="an OTLP JSON file, or a directory searched recursively for *.jsonl and *.json",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``dask-otel``: ``demo`` runs an instrumented example; ``summarize`` reads a recording."""
    args = _parser().parse_args(argv)

    from dask_otel.tools import demo as demo_module
    from dask_otel.tools import report, summary

    try:
        if args.command == "demo":
            return demo_module.run(args.output, args.size)
        report.render(summary.summarize(args.paths), sys.stdout)
        sys.stdout.flush()
    except (summary.SummaryError, demo_module.DemoError) as e:
        print(f"dask-otel: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`dask-otel summarize DIR | head`): nothing more to say.
        # Python would report the failed flush of stdout at exit; point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
