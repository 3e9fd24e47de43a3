"""What the real backends make of dask-otel's telemetry, asked through their own APIs.

Jaeger v2 (its UI's API: traces after its adjusters, with the warnings a user sees),
the OpenTelemetry Collector run with collector-config.yaml, Prometheus with its OTLP
receiver and VictoriaLogs, fed by a cluster whose every role is a host of its own
(conftest.py). Run with ``python -m pytest -m backends tests/backends`` as root.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import recording as backends_recording
from recording import SAMPLED_PERCENTAGE, Recording
from test_stack_config import prometheus_names

from dask_otel.signals.instruments import DROPPED, INSTRUMENTS

pytestmark = [pytest.mark.backends, pytest.mark.e2e]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    """One recording for every test here (recording.py), made once."""
    if os.geteuid() != 0:
        pytest.fail("the backends tests make network namespaces: run them as root")
    for tool in ("go", "ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.fail(f"the backends tests need {tool!r} on PATH")
    with backends_recording.record(tmp_path_factory.mktemp("backends")) as made:
        yield made


Span = dict[str, Any]
Trace = dict[str, Any]


def tags(item: Span | dict[str, Any]) -> dict[str, Any]:
    return {tag["key"]: tag["value"] for tag in item.get("tags", [])}


def process_tags(trace: Trace, span: Span) -> dict[str, Any]:
    return tags(trace["processes"][span["processID"]])


def service(trace: Trace, span: Span) -> str:
    return trace["processes"][span["processID"]]["serviceName"]


def parent_id(span: Span) -> str | None:
    for ref in span.get("references", []):
        if ref["refType"] == "CHILD_OF":
            return ref["spanID"]
    return None


def all_spans(traces: dict[str, Trace]) -> list[tuple[Trace, Span]]:
    return [(trace, span) for trace in traces.values() for span in trace["spans"]]


def roots(trace: Trace) -> list[Span]:
    ids = {span["spanID"] for span in trace["spans"]}
    return [span for span in trace["spans"] if parent_id(span) not in ids]


def by_name(traces: dict[str, Trace], pattern: str) -> list[tuple[Trace, Span]]:
    return [(t, s) for t, s in all_spans(traces) if re.fullmatch(pattern, s["operationName"])]


def test_the_job_ran(recording: Recording) -> None:
    outcome = recording.outcome
    assert outcome["retried"] == 2
    assert outcome["failed"] == "cannot process 2"
    assert outcome["killed_worker"] == "KilledWorker"
    assert outcome["p2p_rechunk"] == 2000 * 2000
    assert outcome["user_span"] == [sum(range(1000)), sum(i * i for i in range(8))]


def test_each_computation_is_one_trace_with_one_root(recording: Recording) -> None:
    for trace in recording.traces.values():
        names = [span["operationName"] for span in roots(trace)]
        assert len(names) == 1, f"trace {trace['traceID']} has roots {names}"
    root_names = Counter(roots(trace)[0]["operationName"] for trace in recording.traces.values())
    for name in ("compute flaky", "compute fail_for_good", "compute hog_memory"):
        assert root_names[name] == 1, root_names
    user = recording.traces[recording.outcome["user_trace_id"]]
    assert roots(user)[0]["operationName"] == "nightly report"
    computes = [
        s["operationName"] for s in user["spans"] if s["operationName"].startswith("compute")
    ]
    assert sorted(computes) == ["compute log_inside", "compute sum"], computes


def test_spans_come_from_every_host(recording: Recording) -> None:
    hosts = defaultdict(set)
    for trace, span in all_spans(recording.traces):
        hosts[process_tags(trace, span).get("host.name")].add(service(trace, span))
    assert {"client", "scheduler", "worker-a", "worker-b"} <= set(hosts), dict(hosts)
    assert hosts["client"] == {"dask-client"}
    assert hosts["scheduler"] == {"dask-scheduler"}


def test_jaeger_has_no_warnings(recording: Recording) -> None:
    warned = [
        (span["operationName"], service(trace, span), span["warnings"])
        for trace, span in all_spans(recording.traces)
        if span.get("warnings")
    ]
    trace_warnings = [t["warnings"] for t in recording.traces.values() if t.get("warnings")]
    assert not warned, f"{len(warned)} spans with warnings, e.g. {warned[:5]}"
    assert not trace_warnings


def test_every_child_lies_within_its_parent(recording: Recording) -> None:
    outside = []
    for trace in recording.traces.values():
        spans = {span["spanID"]: span for span in trace["spans"]}
        for span in trace["spans"]:
            parent = spans.get(parent_id(span) or "")
            if parent is None:
                continue
            start, end = span["startTime"], span["startTime"] + span["duration"]
            p_start, p_end = parent["startTime"], parent["startTime"] + parent["duration"]
            if start < p_start or end > p_end:
                outside.append(
                    f"{span['operationName']} ({service(trace, span)}) under "
                    f"{parent['operationName']}: {start - p_start} us after its start, "
                    f"{end - p_end} us after its end"
                )
    assert not outside, f"{len(outside)} children outside their parents: {outside[:8]}"


def test_one_service_name_per_process(recording: Recording) -> None:
    names = defaultdict(set)
    for trace, span in all_spans(recording.traces):
        instance = process_tags(trace, span)["service.instance.id"]
        names[instance].add(service(trace, span))
    several = {instance: found for instance, found in names.items() if len(found) > 1}
    assert not several
    assert not any(name.startswith("unknown_service") for found in names.values() for name in found)


KINDS = {
    r"compute .+": "producer",
    r"graph": "consumer",
    r"task .+": "internal",
    r"attempt .+": "internal",
    r"transfer": "client",
    r"(spill|unspill) .+": "internal",
    r"died .+": "internal",
}


def test_span_kinds_follow_the_contract(recording: Recording) -> None:
    wrong = []
    for pattern, kind in KINDS.items():
        for _trace, span in by_name(recording.traces, pattern):
            if tags(span).get("span.kind") != kind:
                wrong.append((span["operationName"], tags(span).get("span.kind")))
    assert not wrong, wrong[:10]


#: Attributes README's trace contract promises on each kind of span (a subset: those
#: every such span of the job must carry), by (name pattern, service).
CONTRACT = {
    (r"compute .+", "dask-client"): {"dask.client.id", "dask.graph.keys"},
    (r"graph", "dask-scheduler"): {
        "dask.cluster.id",
        "dask.client.id",
        "dask.graph.keys",
        "dask.graph.tasks",
        "dask.graph.memory",
        "dask.graph.erred",
        "dask.graph.forgotten",
    },
    (r"task .+", "dask-worker"): {
        "dask.cluster.id",
        "dask.task.key",
        "dask.task.prefix",
        "dask.task.group",
        "dask.worker.address",
        "thread.id",
        "dask.task.compute_seconds",
    },
    (r"attempt .+", "dask-scheduler"): {
        "dask.task.key",
        "dask.worker.address",
        "dask.attempt.outcome",
    },
    (r"task .+", "dask-scheduler"): {
        "dask.task.key",
        "dask.task.state",
        "dask.task.attempts",
        "error.type",
    },
    (r"transfer", "dask-worker"): {
        "dask.worker.address",
        "dask.peer.address",
        "network.peer.address",
        "network.peer.port",
        "dask.transfer.keys",
        "dask.transfer.bytes",
        "dask.transfer.outcome",
    },
    (r"rpc .+", "dask-worker"): {"rpc.system.name", "rpc.method", "server.address"},
    (r"died .+", "dask-nanny"): {"dask.task.key", "dask.worker.death.cause"},
}


@pytest.mark.parametrize(("pattern", "role"), sorted(CONTRACT))
def test_spans_carry_the_attributes_readme_promises(
    recording: Recording, pattern: str, role: str
) -> None:
    spans = [(t, s) for t, s in by_name(recording.traces, pattern) if service(t, s) == role]
    assert spans, f"no {pattern} span from {role}"
    for _trace, span in spans:
        missing = CONTRACT[pattern, role] - set(tags(span))
        assert not missing, f"{span['operationName']} lacks {sorted(missing)}"


def test_data_movement_and_spilling_are_spans(recording: Recording) -> None:
    transfers = by_name(recording.traces, r"transfer")
    assert transfers and by_name(recording.traces, r"rpc get_data")
    for _trace, span in transfers:
        assert {"dask.peer.address", "dask.transfer.bytes"} <= set(tags(span))
    # Spilling roots traces of its own, each referring to the task whose result it moved.
    task_spans = {span["spanID"] for _, span in by_name(recording.traces, r"task .+")}
    spilled = recording.worker_traces("spill ")
    assert spilled, "no spill span"
    for trace in spilled.values():
        (span,) = trace["spans"]
        (ref,) = span["references"]
        assert ref["refType"] == "FOLLOWS_FROM" and ref["spanID"] in task_spans


def test_failures_are_errors_where_they_happened(recording: Recording) -> None:
    def errors(pattern: str) -> list[tuple[Trace, Span]]:
        return [
            (t, s)
            for t, s in by_name(recording.traces, pattern)
            if tags(s).get("otel.status_code") == "ERROR"
        ]

    flaky = [
        t for t in recording.traces.values() if roots(t)[0]["operationName"] == "compute flaky"
    ]
    failed_attempts = [s for s in flaky[0]["spans"] if s["operationName"] == "attempt flaky"]
    assert len(failed_attempts) == 1 and tags(failed_attempts[0])["otel.status_code"] == "ERROR"
    assert any(tags(s).get("error.type") == "ValueError" for _, s in errors(r"task fail_for_good"))
    killed = errors(r"task hog_memory")
    assert killed and tags(killed[0][1])["error.type"] == "distributed.scheduler.KilledWorker"
    assert len(by_name(recording.traces, r"attempt hog_memory")) == 2
    died = by_name(recording.traces, r"died hog_memory")
    assert died and all(service(t, s) == "dask-nanny" for t, s in died)


def test_every_attribute_names_the_cluster(recording: Recording) -> None:
    clusters = {tags(s).get("dask.cluster.id") for _, s in by_name(recording.traces, r"graph")}
    assert len(clusters) == 1 and None not in clusters


def test_the_collector_refused_nothing(recording: Recording) -> None:
    for text in recording.collector_metrics:
        accepted = defaultdict(float)
        for line in text.splitlines():
            if line.startswith("otelcol_receiver_refused_"):
                assert float(line.rsplit(" ", 1)[1]) == 0, line
            match = re.match(r'otelcol_receiver_accepted_\w+\{.*transport="(\w+)".*\} (\S+)', line)
            if match:
                accepted[match[1]] += float(match[2])
        assert accepted["grpc"] > 0 and accepted["http"] > 0, dict(accepted)


def test_tail_sampling_keeps_errors_and_a_share_of_the_rest(recording: Recording) -> None:
    kept = Counter(roots(t)[0]["operationName"] for t in recording.probe_traces.values())
    assert kept["compute sampling_probe_error"] == 3, kept
    # 40 traces kept with probability 1/2 each: outside [8, 32] with probability < 1e-4.
    assert SAMPLED_PERCENTAGE == 50
    assert 8 <= kept["compute sampling_probe"] <= 32, kept


def test_span_metrics_reach_prometheus(recording: Recording) -> None:
    calls = recording.prometheus('traces_span_metrics_calls_total{span_name="task flaky"}')
    assert calls, "no span metrics for `task flaky`"


#: README's instruments the job cannot feed, and why.
NOT_FED = {
    "dask.scheduler.gil.contention": "needs gilknocker",
    "dask.worker.gil.contention": "needs gilknocker",
    **{name: "the job takes no semaphore" for name in INSTRUMENTS if ".semaphore." in name},
}


@pytest.mark.parametrize("instrument", sorted(set(INSTRUMENTS) - set(NOT_FED)))
def test_prometheus_has_the_metrics_readme_lists(recording: Recording, instrument: str) -> None:
    for series in sorted(prometheus_names(instrument, INSTRUMENTS[instrument])):
        result = recording.prometheus(f"count by (dask_cluster_id) ({series})")
        assert result, f"{series} is not in Prometheus"
        named = [r for r in result if r["metric"].get("dask_cluster_id")]
        assert len(named) == 1, result
        if instrument != DROPPED:  # counted per process: named while it hosts a server
            assert len(result) == 1, result


def test_prometheus_has_no_dask_series_readme_does_not_list(recording: Recording) -> None:
    listed = {s for n, i in INSTRUMENTS.items() for s in prometheus_names(n, i)}
    names = recording.prometheus('count by (__name__) ({__name__=~"dask_.*"})')
    stored = {r["metric"]["__name__"] for r in names}
    assert stored and stored <= listed, sorted(stored - listed)


def test_logs_from_tasks_point_at_spans_in_jaeger(recording: Recording) -> None:
    records = recording.logs('"inside task"')
    assert len(records) == 8, records[:3]
    user = recording.traces[recording.outcome["user_trace_id"]]
    span_ids = {span["spanID"] for span in user["spans"]}
    for record in records:
        assert record["trace_id"] == recording.outcome["user_trace_id"], record
        assert record["span_id"] in span_ids, record


def test_the_dead_workers_post_mortem_is_in_the_log_store(recording: Recording) -> None:
    records = recording.logs('"hog_memory"')
    assert any(r.get("service.name") == "dask-nanny" for r in records), records[:5]
