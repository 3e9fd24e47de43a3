"""Assertions on received spans that several end-to-end tests share."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def orphans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spans whose parent is not among the spans of their trace."""
    ids = {(s["trace_id"], s["span_id"]) for s in spans}
    return [
        s for s in spans if s["parent_span_id"] and (s["trace_id"], s["parent_span_id"]) not in ids
    ]


def trace_of(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """All spans of the one trace that holds a span called ``name``."""
    (trace_id,) = {s["trace_id"] for s in spans if s["name"] == name}
    return by_trace(spans)[trace_id]


def services(spans: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(service.name, service.instance.id) of every process that sent these spans."""
    return {
        (s["resource"].get("service.name"), s["resource"].get("service.instance.id")) for s in spans
    }
