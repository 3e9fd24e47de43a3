"""The text of ``dask-otel summarize``: one screen, section by section, from a
:class:`dask_otel.tools.summary.Summary`."""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timezone
from typing import TextIO

from dask_otel.tools import post_mortem
from dask_otel.tools.summary import MAX_ROWS, Summary

#: Waterfall bar width in characters, and how many traces get one.
BAR_WIDTH = 40
WATERFALL_TRACES = 2
#: Column widths of keys and names; longer ones are elided in the middle.
KEY_WIDTH = 44
NAME_WIDTH = 20


def elide(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: whole, or its start and end around ``…``."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2 + (width - 1) % 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def _host(address: str) -> str:
    return address.removeprefix("tcp://")


#: The hash of a Dask key (``inc-<32 hex digits>``, ``f-<uuid4>``) after its first 8 digits.
_KEY_HASH = re.compile(
    r"\b([0-9a-f]{8})(?:[0-9a-f]{24}|-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b"
)


def cut(text: str, width: int) -> str:
    """A message in at most ``width`` characters: the hashes of the keys it names
    shortened, addresses without ``tcp://``, then its end cut (``…``), for the reason
    comes first."""
    text = _KEY_HASH.sub(r"\1…", text).replace("tcp://", "")
    return text if len(text) <= width else text[: width - 1] + "…"


def size(value: float) -> str:
    """Bytes in the unit that fits: ``740 B``, ``12.3 kB``, ``7.1 MB``, ``2.0 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _moved(tally: list[float]) -> str:
    return f"{int(tally[0])} / {size(tally[1])}" if tally[0] else "-"


def _names(names: list[str]) -> str:
    """The most common of ``names``, for a finding's parenthesis."""
    counted = Counter(names).most_common(3)
    more = ", ..." if len(set(names)) > 3 else ""
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counted) + more


def _when(nanoseconds: int) -> str:
    moment = datetime.fromtimestamp(nanoseconds / 1e9, timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


class _Report:
    """Writes the sections of :func:`render`."""

    def __init__(self, summary: Summary, out: TextIO) -> None:
        self.s = summary
        self.w = out.write
        self.out = out

    def more(self, rows: list, noun: str = "") -> None:
        """The line that counts what a list leaves out past its first MAX_ROWS rows."""
        if len(rows) > MAX_ROWS:
            self.w(f"  ... {len(rows) - MAX_ROWS} more{' ' + noun if noun else ''}\n")

    def header(self) -> None:
        s, w = self.s, self.w
        w(f"{s.files} file(s): {s.spans} spans, {s.log_records} log records, "
          f"{s.metric_points} metric points\n")  # fmt: skip
        if s.skipped_count:
            w(f"  skipped {s.skipped_count} line(s) that could not be read:\n")
            for problem in s.skipped:
                w(f"    {problem}\n")
            if s.skipped_count > len(s.skipped):
                w(f"    ... {s.skipped_count - len(s.skipped)} more\n")
        with_spans = {k: t for k, t in s.tasks.items() if t.attempts or t.erred or t.finished}
        tasks = with_spans.values()
        failed = sum(t.failed and not t.erred_by for t in tasks)
        dependents = sum(t.failed and bool(t.erred_by) for t in tasks)
        again = [(k, t) for (_, k), t in with_spans.items() if t.failed_attempts and not t.failed]
        retried = [key for key, t in again if t.failed_after_running]
        rerun = len(again) - len(retried)
        attempts = sum(t.attempts for t in tasks)
        w(f"Tasks with spans: {len(tasks)} ({attempts} attempts); {failed} failed, "
          f"{dependents} failed because a dependency did, "
          f"{len(retried)} recovered on retry"
          f"{f', {rerun} run again after their worker was lost' if rerun else ''}\n")  # fmt: skip
        if retried:
            named = ", ".join(elide(key, KEY_WIDTH) for key in retried[:3])
            more = f", ... {len(retried) - 3} more" if len(retried) > 3 else ""
            w(f"  recovered on retry: {named}{more}\n")

    def traces(self) -> None:
        s, w = self.s, self.w
        ranked = sorted(s.traces.items(), key=lambda t: t[1].start)
        failed = Counter(trace for trace, _, _ in s.failures())
        first = min((t.start for _, t in ranked if t.start), default=0)
        last = max((t.end for _, t in ranked), default=0)
        span = f", {_when(first)}, {(last - first) / 1e9:.1f} s" if first else ""
        w(f"\nTraces ({len(ranked)}{span}):\n")
        w(f"  {'trace':<32}  {'root':<28} {'role':<15} {'spans':>6} {'seconds':>8} failed\n")
        for trace_id, trace in ranked[:MAX_ROWS]:
            root = elide(trace.root or "(root not recorded)", 28)
            w(f"  {trace_id:<32}  {root:<28} {trace.root_role:<15} {trace.spans:6} "
              f"{(trace.end - trace.start) / 1e9:8.2f} {failed.get(trace_id, 0):6}\n")  # fmt: skip
        self.more(ranked, "traces")

    def failures(self) -> None:
        s, w = self.s, self.w
        failures = s.failures()
        w(f"\nFailed tasks ({len(failures)}):\n")
        for trace, key, task in failures[:MAX_ROWS]:
            workers = ", ".join(sorted(map(_host, task.workers))) or "no worker recorded"
            attempts = max(task.attempts, task.counted)
            w(f"  {elide(key, KEY_WIDTH)}  trace {trace}\n")
            w(f"      {elide(task.exception or '(no exception recorded)', 90)}\n")
            w(f"      {attempts} attempt(s) on {workers}\n")
        self.more(failures)
        dependents = Counter(t.prefix for t in s.tasks.values() if t.failed and t.erred_by)
        if dependents:
            counts = ", ".join(f"{n} {p}" for p, n in dependents.most_common(MAX_ROWS))
            w(f"  and because a dependency failed: {counts}\n")

    def slowest(self) -> None:
        s, w = self.s, self.w
        if s.slowest:
            w("\nSlowest task attempts:\n")
            for seconds, _prefix, key, worker, trace in sorted(s.slowest, reverse=True):
                w(f"  {seconds:8.3f} s  {elide(key, KEY_WIDTH):<{KEY_WIDTH}}  "
                  f"{_host(worker):<21} trace {trace}\n")  # fmt: skip

    def movement(self) -> None:
        s, w = self.s, self.w
        totals = {
            name: [sum(getattr(x, name)[i] for x in s.workers.values()) for i in (0, 1)]
            for name in ("received", "spilled", "unspilled")
        }
        w("\nData movement:\n")
        received = totals["received"]
        w(f"  transfers between workers: {_moved(received)}\n")
        for seconds, moved, peer, worker, trace in sorted(s.slowest_transfers, reverse=True)[:3]:
            w(f"    {seconds:6.3f} s  {size(moved):>9}  {_host(peer)} -> {_host(worker)}  "
              f"trace {trace}\n")  # fmt: skip
        w(f"  spilled to disk: {_moved(totals['spilled'])}; "
          f"read back: {_moved(totals['unspilled'])}\n")  # fmt: skip

    def per_worker(self) -> None:
        s, w = self.s, self.w
        if not s.workers:
            return
        w("\nPer worker (transfers and spills: count / size):\n")
        w(f"  {'worker':<21} {'name':<10} {'attempts':>8} {'failed':>6} {'compute s':>9}  "
          f"{'received':<13} {'sent':<13} {'spilled':<13} {'read back':<13}\n")  # fmt: skip
        rows = sorted(s.workers.items())
        for address, worker in rows[:MAX_ROWS]:
            name = "-" if worker.name in ("", address) else elide(worker.name, 10)
            w(f"  {_host(address):<21} {name:<10} {worker.attempts:8} "
              f"{worker.failed:6} {worker.compute:9.2f}  {_moved(worker.received):<13} "
              f"{_moved(worker.sent):<13} {_moved(worker.spilled):<13} "
              f"{_moved(worker.unspilled):<13}\n")  # fmt: skip
        self.more(rows, "workers")

    def waterfall(self) -> None:
        s, w = self.s, self.w
        # The traces with the most task groups, then the most attempts.
        busiest = sorted(
            (t for t in s.traces.items() if t[1].groups),
            key=lambda t: (-len(t[1].groups), -sum(map(len, t[1].groups.values()))),
        )[:WATERFALL_TRACES]
        for trace_id, trace in sorted(busiest, key=lambda t: t[1].start):
            length = max(trace.end - trace.start, 1)
            w(f"\nWhen task groups ran: {elide(trace.root or trace_id, 40)}, "
              f"{length / 1e9:.2f} s, trace {trace_id}\n")  # fmt: skip
            groups = sorted(trace.groups.items(), key=lambda g: min(g[1]))
            for prefix, intervals in groups[:MAX_ROWS]:
                bar = [" "] * BAR_WIDTH
                for start, end in intervals:
                    first = int(BAR_WIDTH * (start - trace.start) / length)
                    last = int(BAR_WIDTH * (end - trace.start) / length)
                    for i in range(max(0, first), min(BAR_WIDTH - 1, last) + 1):
                        bar[i] = "#"
                began = (min(s for s, _ in intervals) - trace.start) / 1e9
                ended = (max(e for _, e in intervals) - trace.start) / 1e9
                w(f"  {elide(prefix, NAME_WIDTH):<{NAME_WIDTH}} |{''.join(bar)}| "
                  f"{began:5.2f}-{ended:.2f} s  {len(intervals)} run(s)\n")  # fmt: skip
            self.more(groups, "groups")

    def logs(self) -> None:
        s, w = self.s, self.w
        if not s.severities:
            return
        counts = ", ".join(f"{n} {sev}" for sev, n in sorted(s.severities.items()))
        w(f"\nLog records: {counts}\n")
        errors = sorted(s.errors.items(), key=lambda e: -e[1][0])
        for (severity, role, line), (count, trace) in errors[:MAX_ROWS]:
            where = f"  trace {trace}" if trace else ""
            w(f"  {severity} x{count} {role}: {cut(line, 64 if trace else 104)}{where}\n")
        self.more(errors, "distinct ERROR records")

    def missing(self) -> None:
        s, w = self.s, self.w
        findings = []
        silent, partial = s.unanswered()
        if silent:
            findings.append(
                f"{len(silent)} computation(s) have no spans from the cluster "
                f"({_names(silent)}): is it exporting, and to where the client does?"
            )
        if partial:
            findings.append(
                f"{len(partial)} computation(s) have no graph span from the scheduler "
                f"({_names(partial)}): is it exporting, and to where the client does?"
            )
        unseen = {
            key: task.counted - task.attempts
            for (_, key), task in s.tasks.items()
            if task.failed and task.counted > task.attempts
        }
        if unseen:
            keys = ", ".join(elide(k, 30) for k in list(unseen)[:3])
            findings.append(
                f"{sum(unseen.values())} attempt(s) of {len(unseen)} failed task(s) have no "
                f"span ({keys}): their workers died before exporting, or did not trace them"
            )
        orphans = s.orphans()
        if orphans:
            findings.append(
                f"{orphans} span(s) name a parent that is not in the recording (a process "
                "whose telemetry is missing, or spans lost on the way)"
            )
        rootless = sum(not t.root for t in s.traces.values())
        if rootless:
            findings.append(f"{rootless} trace(s) without their root span")
        if s.duplicates:
            twice = " and ".join(f"{n} {what}" for what, n in sorted(s.duplicates.items()))
            findings.append(f"{twice} arrived more than once (counted once)")
        lost = s.lost_by_exporters()
        if any(lost.values()):
            nouns = {"traces": "spans", "logs": "log records"}
            said = ", ".join(
                f"{n} {nouns.get(signal, signal)} ({reason.replace('_', ' ')})"
                for (signal, reason), n in sorted(lost.items())
                if n
            )
            findings.append(f"the exporters said they lost {said} (dask_otel.exporter.dropped)")
        w("\nGaps in the recording:" + (" none found\n" if not findings else "\n"))
        for finding in findings:
            w(f"  - {finding}\n")

    def deaths(self) -> None:
        if self.s.deaths.count:
            # The failures a death explains: attempts lost with their workers.
            failures = [
                {"name": f"task {t.prefix}", "key": key, "workers": t.workers,
                 "exception": t.exception}
                for _, key, t in self.s.failures()
                if t.lost or "KilledWorker" in t.exception
            ]  # fmt: skip
            post_mortem.render(self.s.deaths, failures, self.out)


def render(summary: Summary, out: TextIO) -> None:
    """Print the summary as text."""
    report = _Report(summary, out)
    report.header()
    report.traces()
    report.failures()
    report.slowest()
    report.movement()
    report.per_worker()
    report.waterfall()
    report.logs()
    report.missing()
    report.deaths()
