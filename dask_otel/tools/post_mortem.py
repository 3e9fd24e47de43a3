"""``dask-otel summarize``: the "Workers that died" section.

Reads the ``dask.worker.died`` records that Nannies running dask-otel emit (see
:mod:`dask_otel.plugins.nanny`) and prints, per death: when, the worker and its Nanny, why it
died, its memory in the seconds before, what it was executing and in which traces, the
failed tasks (KilledWorker) that name it, and its last log lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

#: Event name of a Nanny's record of its worker's death.
DIED = "dask.worker.died"
#: Deaths printed; the others are only counted.
MAX_DEATHS = 20
#: Log lines printed per death, and width of the memory sparkline.
MAX_LINES = 8
SPARK_WIDTH = 40
_SPARKS = " ▁▂▃▄▅▆▇█"


@dataclass
class Deaths:
    """The deaths found in a recording (attributes of their records), oldest first."""

    found: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0

    def add(self, record: dict[str, Any], attributes: dict[str, Any]) -> None:
        """Fold in one OTLP JSON log record (its ``attributes`` already decoded)."""
        if record.get("eventName") != DIED:
            return
        self.count += 1
        if len(self.found) < MAX_DEATHS:
            self.found.append({**attributes, "time": int(record.get("timeUnixNano", 0))})


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def _when(nanoseconds: int) -> str:
    moment = datetime.fromtimestamp(nanoseconds / 1e9, timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def sparkline(values: list[int], width: int = SPARK_WIDTH) -> str:
    """``values`` as block characters from 0 to their maximum, at most ``width`` wide."""
    if not values:
        return ""
    step = max(1, -(-len(values) // width))
    sampled = [max(values[i : i + step]) for i in range(0, len(values), step)]
    top = max(sampled) or 1
    return "".join(_SPARKS[round(v / top * (len(_SPARKS) - 1))] for v in sampled)


def render(deaths: Deaths, failures: list[dict[str, Any]], out: TextIO) -> None:
    """Print the section; ``failures`` (the summary's failed tasks) name the workers they
    died on."""
    w = out.write
    w(f"\nWorkers that died ({deaths.count}):\n")
    for death in sorted(deaths.found, key=lambda d: d["time"]):
        address = death.get("dask.worker.address", "?")
        who = ", ".join(
            part
            for part in (
                str(death.get("dask.worker.name", "")),
                f"pid {death.get('process.pid', '?')}",
                f"Nanny {death['dask.nanny.address']}" if "dask.nanny.address" in death else "",
            )
            if part
        )
        w(f"  {_when(death['time'])}  {address} ({who})\n")
        cause = death.get("dask.worker.death.cause", "?")
        w(f"      {cause}: {death.get('dask.worker.death.description', '')}\n")
        history = death.get("dask.worker.memory.history") or []
        times = death.get("dask.worker.memory.history_times") or []
        if history and times:
            seconds = (times[-1] - times[0]) / 1e9
            w(
                f"      memory before: {_mib(history[0])} -> {_mib(history[-1])} over "
                f"{seconds:.1f} s, peak {_mib(max(history))}  |{sparkline(history)}|\n"
            )
        keys = death.get("dask.task.keys") or []
        if keys:
            w(f"      executing: {', '.join(map(str, keys))}\n")
        for trace_id in death.get("dask.trace_ids") or []:
            w(f"      trace: {trace_id}\n")
        for failure in failures:
            if address in failure.get("workers", ()):
                w(f"      failed with it: {failure['name']} {failure['key']}: ")
                w(f"{failure['exception'][:80]}\n")
        recovered = (
            death.get("dask_otel.recovered.spans", 0),
            death.get("dask_otel.recovered.logs", 0),
        )
        if any(recovered):
            w(f"      sent by its Nanny: {recovered[0]} spans, {recovered[1]} log records\n")
        lines = death.get("dask.worker.last_logs") or []
        if lines:
            w("      last log lines:\n")
            for line in lines[-MAX_LINES:]:
                w(f"        {line}\n")
    if deaths.count > len(deaths.found):
        w(f"  ... {deaths.count - len(deaths.found)} more\n")
